"""The museum: public sliding-window cache bugs, each as the cache that shipped it and its fix.

Every :class:`Exhibit` holds a bug report's link, its project, the root cause in one sentence,
``buggy(window)`` and ``fixed(window)`` (each a make_step, :mod:`ringviz.conformance`), the
setting to check them at, and the property :func:`~ringviz.conformance.check` must report for
the buggy one. The code is the real package where it installs here (mlx-lm, imported as
installed), otherwise the cited lines transcribed from the cited commit into the step's shapes
(``(B, H, T, D)``; the kit's keys come rotated, so RoPE lines are left out). Each transcription
names its source in the exhibit's ``source`` and ``fix_source``. Where a project's own fix still
breaks the contract, ``upstream_fix`` holds it and ``fixed`` is the smallest change that passes
(said in ``fix_source``).

:data:`UNUSUAL` holds correct caches laid out unlike a ring (paged blocks freed outside the
window; keys stored before RoPE and turned at read): they pass, because the kit judges what each
query sees, not how the cache stores it. :func:`run` checks one exhibit: the bug, the fix, and
the upstream fix where there is one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ringviz import apply_rope, band_mask
from ringviz.cache import MakeStep, Step
from ringviz.conformance.adapters import (
    HfStep,
    MlxStep,
    _mlx_sdpa,
    _to_mx,
    executorch_ring,
    hf_dynamic_sliding,
    mlx_rotating,
)
from ringviz.conformance.kit import check
from ringviz.conformance.pitfalls import _on_ring, attend
from ringviz.conformance.probe import Unsupported
from ringviz.conformance.report import Report
from ringviz.conformance.seam import StepSpec, prebuilt


@dataclass(frozen=True)
class Exhibit:
    """One public bug: where it was reported, why, the buggy and fixed caches, how to check."""

    name: str
    project: str
    report: str  # "#37574"
    url: str
    cause: str  # the root cause, one sentence
    source: str  # where the buggy code comes from
    fix_source: str
    buggy: Callable[[int], MakeStep]  # window -> make_step
    fixed: Callable[[int], MakeStep]
    expect: str  # the property the kit must report for the buggy cache
    window: int = 4
    sinks: int = 0
    batch_size: int = 1
    ragged: bool = False
    max_chunk: int | None = None
    dtype: torch.dtype = torch.float64
    examples: int = 60  # schedules for the fix (a bug stops at its first failure)
    upstream_fix: Callable[[int], MakeStep] | None = None  # a project's fix that still breaks
    rewind: bool = False  # schedules that rewind (the step has rewind(n))
    listing: tuple[str, str] = ("museum.py", "")  # (file in ringviz/conformance, pyobject)
    requires: str | None = None  # a package the exhibit runs (its tests skip without it)

    def check(self, make: Callable[[int], MakeStep], examples: int | None = None) -> Report:
        """Check ``make(window)`` at this exhibit's setting."""
        return check(make(self.window), window=self.window, sinks=self.sinks,
                     batch_size=self.batch_size, ragged=self.ragged,
                     examples=self.examples if examples is None else examples,
                     max_chunk=self.max_chunk, dtype=self.dtype, rewind=self.rewind,
                     name=self.name)


@dataclass(frozen=True)
class Result:
    """An exhibit checked: the bug's report, the fix's and the upstream fix's."""

    exhibit: Exhibit
    bug: Report
    fix: Report
    upstream: Report | None

    @property
    def caught(self) -> bool:
        """The bug fails with the expected property (others may break too)."""
        return self.exhibit.expect in self.bug.properties()

    def row(self) -> dict[str, str]:
        """One line of the museum's table."""
        f = next((f for f in self.bug.failures if f.property == self.exhibit.expect), None)
        return {"project": self.exhibit.project,
                "bug": f"[{self.exhibit.report}]({self.exhibit.url})",
                "caught": f.property if f else "no",
                "schedule": f"{f.schedule}" if f else "-",
                "tokens": str(sum(f.schedule)) if f else "-",
                "fix": "passes" if self.fix.ok else "FAILS",
                "upstream fix": ("-" if self.upstream is None
                                 else "passes" if self.upstream.ok else "still breaks")}


def run(exhibit: Exhibit, examples: int | None = None) -> Result:
    """Check an exhibit's buggy cache, its fix, and its upstream fix if it has one."""
    bug, fix = exhibit.check(exhibit.buggy, examples), exhibit.check(exhibit.fixed, examples)
    upstream = None if exhibit.upstream_fix is None else exhibit.check(exhibit.upstream_fix,
                                                                         examples)
    return Result(exhibit, bug, fix, upstream)


def _per_window(build: Callable[[int, StepSpec], Step]) -> Callable[[int], MakeStep]:
    """``window -> make_step`` from ``build(window, spec) -> step``."""
    return lambda window: prebuilt(partial(build, window))


def _visible_all(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A mask that lets every query see every key: ``(B, T, K)`` of True."""
    return torch.ones(q.shape[0], q.shape[2], keys.shape[2], dtype=torch.bool, device=q.device)


# ------------------------------------------------------------------ transformers #37574
def hf451_sliding_update(k_cache: torch.Tensor, v_cache: torch.Tensor, key_states: torch.Tensor,
                         value_states: torch.Tensor, cache_position: torch.Tensor,
                         max_cache_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``SlidingWindowCache.update`` of transformers 4.51.3, the lines a chunk no longer than
    the cache runs: roll by one once ``cache_position >= max_cache_len - 1``, one token early."""
    slicing = torch.ones(max_cache_len, dtype=torch.long, device=value_states.device).cumsum(0)
    cache_position = cache_position.clamp(0, max_cache_len - 1)
    to_shift = cache_position >= max_cache_len - 1
    indices = (slicing + to_shift[-1].int() - 1) % max_cache_len
    k_out, v_out = k_cache[:, :, indices], v_cache[:, :, indices]
    k_out.index_copy_(2, cache_position, key_states)
    v_out.index_copy_(2, cache_position, value_states)
    k_cache.zero_()
    v_cache.zero_()
    k_cache += k_out
    v_cache += v_out
    return k_out, v_out


def hf452_sliding_update(k_cache: torch.Tensor, v_cache: torch.Tensor, key_states: torch.Tensor,
                         value_states: torch.Tensor, cache_position: torch.Tensor,
                         max_cache_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_sliding_cache_update`` of transformers 4.52.4 (PR #38046), same lines: roll once
    the sequence is longer than the cache, ``cache_position[-1] + 1 > max_cache_len``."""
    slicing = torch.arange(max_cache_len, device=value_states.device)
    current_seq_len = cache_position[-1] + 1
    to_shift = current_seq_len > max_cache_len
    indices = (slicing + to_shift.sum()) % max_cache_len
    k_out_shifted, v_out_shifted = k_cache[:, :, indices], v_cache[:, :, indices]
    update_position = cache_position.clamp(min=0, max=max_cache_len - 1)
    k_out_updated = k_out_shifted.index_copy(2, update_position, key_states)
    v_out_updated = v_out_shifted.index_copy(2, update_position, value_states)
    k_cache.copy_(k_out_updated)
    v_cache.copy_(v_out_updated)
    return k_out_updated, v_out_updated


def _hf_sliding_window_cache(update) -> Callable[[int], MakeStep]:
    """A Mistral layer over ``SlidingWindowCache`` (one row): the update, then the 4D mask of
    ``_prepare_4d_causal_attention_mask_with_cache_position`` (a sliding cache's mask hides only
    the slots past ``cache_position``), then softmax attention."""
    def build(window: int, s: StepSpec) -> Step:
        shape = (s.batch_size, s.num_kv_heads, window, s.head_dim)
        k_cache = torch.zeros(shape, dtype=s.dtype, device=s.device)
        v_cache = torch.zeros_like(k_cache)

        def step(q, k, v, positions):
            cache_position = positions[0]
            keys, values = update(k_cache, v_cache, k, v, cache_position, window)
            hidden = torch.arange(window, device=q.device) > cache_position.reshape(-1, 1)
            return attend(q, keys, values, (~hidden)[None].expand(q.shape[0], -1, -1))

        return step

    return _per_window(build)


# ------------------------------------------------------------------ LLMs-from-scratch #1008
def _rasbt_swa(fixed: bool) -> Callable[[int], MakeStep]:
    """``MultiHeadAttentionWithSWA.forward``'s cache lines (``use_cache=True``), keys on dim 2."""
    def factory(window: int) -> MakeStep:
        def build(s: StepSpec) -> Step:
            state = {"k": None, "v": None, "ptr": 0}

            def step(q, k, v, positions):
                num_tokens = q.shape[2]
                old_k, old_v = state["k"], state["v"]
                old_len = 0 if old_k is None else old_k.size(2)
                combined_k = k if old_k is None else torch.cat([old_k, k], dim=2)
                combined_v = v if old_v is None else torch.cat([old_v, v], dim=2)
                if fixed:  # @28c65cd: attend over W - 1 older keys plus the chunk
                    attn_keep = min(combined_k.size(2), window + num_tokens - 1)
                    keys, values = combined_k[:, :, -attn_keep:], combined_v[:, :, -attn_keep:]
                    cache_keep = min(combined_k.size(2), window)
                    state["k"] = combined_k[:, :, -cache_keep:]
                    state["v"] = combined_v[:, :, -cache_keep:]
                    dropped = combined_k.size(2) - keys.size(2)
                else:  # @4612d20: cut the cache to W keys, then attend over it
                    state["k"], state["v"] = combined_k, combined_v
                    if state["k"].size(2) > window:
                        state["k"] = state["k"][:, :, -window:]
                        state["v"] = state["v"][:, :, -window:]
                    total_len = old_len + num_tokens
                    dropped = max(0, total_len - state["k"].size(2))
                    keys, values = state["k"], state["v"]
                k_start = (state["ptr"] - old_len) + dropped
                q_pos = torch.arange(state["ptr"], state["ptr"] + num_tokens, device=q.device)
                k_pos = torch.arange(k_start, k_start + keys.shape[2], device=q.device)
                diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(0)
                mask_bool = (diff < 0) | (diff >= window)
                state["ptr"] += num_tokens
                return attend(q, keys, values, (~mask_bool)[None].expand(q.shape[0], -1, -1))

            return step

        return prebuilt(build)

    return factory


# ------------------------------------------------------------------ mistral.rs #246
def _mistralrs_decode(narrow_when: Callable[[int, int], bool] | None
                      ) -> Callable[[int], MakeStep]:
    """mistral.rs's ``Attention::forward`` for one new token: the cached keys, narrowed to the
    last ``W - 1`` when ``narrow_when(kv_seq_len, W)`` (never, for None), then the new key
    appended; a one-token forward gets no mask (``seq_len <= 1``)."""
    def factory(window: int) -> MakeStep:
        def build(s: StepSpec) -> Step:
            cache: list[tuple[torch.Tensor, torch.Tensor]] = []

            def step(q, k, v, positions):
                if q.shape[2] != 1:
                    raise ValueError("this transcription holds the one-token path only")
                if cache:
                    prev_k, prev_v = cache.pop()
                    kv_seq_len = prev_k.shape[2]
                    if narrow_when is not None and narrow_when(kv_seq_len, window):
                        start = kv_seq_len - (window - 1)
                        prev_k = prev_k.narrow(2, start, window - 1)
                        prev_v = prev_v.narrow(2, start, window - 1)
                    k, v = torch.cat([prev_k, k], 2), torch.cat([prev_v, v], 2)
                cache.append((k, v))
                return attend(q, k, v, _visible_all(q, k))

            return step

        return prebuilt(build)

    return factory


# ------------------------------------------------------------------ litgpt #2145, #2182
LITGPT_MAX_SEQ = 64  # the model's max_seq_length: longer than any schedule the kit draws here


def _litgpt(version: str, token_by_token: bool = False) -> Callable[[int], MakeStep]:
    """litgpt's ``CausalSelfAttention.forward`` with a KV cache (``input_pos`` given) on a
    sliding layer, at ``version``: ``"ba331d6"`` (a full-length cache; the window bias added to
    the boolean mask the cache path uses), ``"3023ca8"`` (PR #2153: a ring of W slots, slot
    ``input_pos % W``, the mask's columns cut to the ring's length) or ``"d28a00d"`` (PR #2215:
    the same, refusing a chunk longer than W). The mask is ``mask_cache`` (a lower triangle over
    absolute positions) at the rows ``input_pos``, its columns cut to ``max(input_pos) + 1``.
    ``token_by_token`` feeds a chunk one token at a time (the decode path)."""
    def factory(window: int) -> MakeStep:
        def build(s: StepSpec) -> Step:
            length = LITGPT_MAX_SEQ if version == "ba331d6" else min(LITGPT_MAX_SEQ, window)
            shape = (s.batch_size, s.num_kv_heads, length, s.head_dim)
            k_buf = torch.zeros(shape, dtype=s.dtype, device=s.device)
            v_buf = torch.zeros_like(k_buf)
            mask_cache = torch.ones(LITGPT_MAX_SEQ, LITGPT_MAX_SEQ, dtype=torch.bool,
                                    device=s.device).tril()

            def forward(q, k, v, input_pos):
                T, maxp1 = len(input_pos), int(input_pos.max()) + 1
                mask = mask_cache[input_pos][:, :maxp1]  # (T, maxp1)
                if version == "ba331d6":
                    keys = k_buf.index_copy_(2, input_pos, k)[:, :, :maxp1]
                    values = v_buf.index_copy_(2, input_pos, v)[:, :, :maxp1]
                    bias = torch.ones_like(mask).tril(diagonal=-window)
                    bias.masked_fill_(bias.bool(), float("-inf"))  # on a bool mask: True
                    mask = mask + bias
                else:
                    if version == "d28a00d" and T > window:  # litgpt raises ValueError;
                        # Unsupported is one, and tells the kit the cache declines by design
                        raise Unsupported(f"Prefill length ({T}) exceeds the sliding window "
                                          f"size ({window}): use chunked prefill")
                    cache_positions = input_pos % window
                    keys = k_buf.index_copy_(2, cache_positions, k)
                    values = v_buf.index_copy_(2, cache_positions, v)
                    if maxp1 - 1 < window:
                        keys, values = keys[:, :, :maxp1], values[:, :, :maxp1]
                    mask = mask[:, :keys.size(2)]
                return attend(q, keys, values, mask[None].expand(q.shape[0], -1, -1))

            def step(q, k, v, positions):
                if not token_by_token:
                    return forward(q, k, v, positions[0])
                return torch.cat([forward(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                          positions[0, t:t + 1]) for t in range(q.shape[2])], 2)

            return step

        return prebuilt(build)

    return factory


# ------------------------------------------------------------------ mlx-lm (the real package)
def causal_mask_pre390(N: int, offset: int, window_size: int | None):
    """mlx-lm's ``create_causal_mask`` before PR #390: the window test ``<=`` admits W + 1."""
    import mlx.core as mx

    rinds = mx.arange(offset + N)
    linds = mx.arange(offset, offset + N) if offset else rinds
    linds, rinds = linds[:, None], rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds <= rinds + window_size)
    return mask


def attention_mask_pre843(N: int, offset: int, return_array: bool, window_size: int | None):
    """mlx-lm's ``create_attention_mask`` before PR #843: one token gets no mask at all."""
    from mlx_lm.models.base import create_causal_mask

    if N == 1:
        return None
    if return_array:
        return create_causal_mask(N, offset, window_size=window_size)
    return "causal"


def _mlx_windowed_kv(attention_mask: Callable | None) -> Callable[[int], MakeStep]:
    """mlx-lm's plain ``KVCache`` under a window mask, as a sliding layer calls it
    (``create_attention_mask(h, cache, window_size=W, return_array=True)``): the mask from
    ``attention_mask(N, offset, return_array, window_size)`` (None: the installed mlx-lm's),
    built before ``update_and_fetch``."""
    def build(window: int, s: StepSpec) -> Step:
        from mlx_lm.models.cache import KVCache, create_attention_mask

        cache = KVCache()
        make_mask = attention_mask or create_attention_mask

        def step(q, k, v, positions):
            mask = make_mask(q.shape[2], cache.offset, True, window)
            keys, values = cache.update_and_fetch(_to_mx(k), _to_mx(v))
            return _mlx_sdpa(q, keys, values, mask)

        return step

    return _per_window(build)


def merge_031(cls, caches):
    """``BatchRotatingKVCache.merge`` of mlx-lm 0.31.1: each row's keys are copied into a
    slice as wide as its write cursor ``_idx``, not as the keys it holds."""
    import mlx.core as mx

    if not all(c.max_size == caches[0].max_size for c in caches):
        raise ValueError("BatchRotatingKVCache can only merge caches with the same maximum size")
    offsets = [c.offset for c in caches]
    lengths = [c.size() for c in caches]
    max_length = max(lengths)
    padding = [max_length - length for length in lengths]
    B = len(caches)
    H = max(c.keys.shape[1] for c in caches if c.keys is not None)
    Dk = max(c.keys.shape[3] for c in caches if c.keys is not None)
    Dv = max(c.values.shape[3] for c in caches if c.values is not None)
    dt = next(iter(c.keys.dtype for c in caches if c.keys is not None))
    keys = mx.zeros((B, H, max_length, Dk), dtype=dt)
    values = mx.zeros((B, H, max_length, Dv), dtype=dt)
    for i, (p, c) in enumerate(zip(padding, caches)):
        if c.keys is None:
            continue
        keys[i : i + 1, :, p : p + c._idx] = c._temporal_order(c.keys)
        values[i : i + 1, :, p : p + c._idx] = c._temporal_order(c.values)
    cache = cls(caches[0].max_size, padding)
    cache.keys, cache.values = keys, values
    cache.offset = mx.array(offsets)
    cache._idx = keys.shape[2]
    cache._offset = keys.shape[2]
    return cache


def merge_029(cls, caches):
    """``BatchRotatingKVCache.merge`` of mlx-lm 0.29.1: each row's slice is as wide as its
    ``offset``, every token it ever saw, however few the ring still holds."""
    import mlx.core as mx

    if not all(c.max_size == caches[0].max_size for c in caches):
        raise ValueError("BatchRotatingKVCache can only merge caches with the same maximum size")
    offsets = [c.offset for c in caches]
    lengths = [c.size() for c in caches]  # len(c) in 0.29.1: min(offset, max_size)
    max_length = max(lengths)
    padding = [max_length - length for length in lengths]
    B = len(caches)
    H = max(c.keys.shape[1] for c in caches if c.keys is not None)
    Dk = max(c.keys.shape[3] for c in caches if c.keys is not None)
    Dv = max(c.values.shape[3] for c in caches if c.values is not None)
    dt = next(iter(c.keys.dtype for c in caches if c.keys is not None))
    keys = mx.zeros((B, H, max_length, Dk), dtype=dt)
    values = mx.zeros((B, H, max_length, Dv), dtype=dt)
    for i, (p, c) in enumerate(zip(padding, caches)):
        keys[i : i + 1, :, p : p + c.offset] = c._temporal_order(c.keys)
        values[i : i + 1, :, p : p + c.offset] = c._temporal_order(c.values)
    cache = cls(caches[0].max_size, padding)
    cache.keys, cache.values = keys, values
    cache.offset = mx.array(offsets)
    cache._idx = keys.shape[2]
    cache._offset = keys.shape[2]
    return cache


def _mlx_server(merge: Callable | None, keep: int = 0,
                batched: bool = True) -> Callable[[int], MakeStep]:
    """A server over mlx-lm's caches, as ``BatchGenerator`` serves requests: each row's prompt
    (a chunk) is prefilled alone in its own ``RotatingKVCache(W)``; each decode step merges the
    rows that hold a token into a ``BatchRotatingKVCache`` (``merge``: a transcription, None:
    the installed one), decodes them together and extracts each row back (rows join and leave
    the batch at every step). ``keep`` sinks: each request's cache is
    ``RotatingKVCache(W + keep, keep)``, as ``make_prompt_cache(max_kv_size=...)`` builds it,
    masked as a Llama with ``--max-kv-size`` masks it (no window_size); ``batched=False``
    decodes each request alone in its own cache."""
    def factory(window: int) -> MakeStep:
        def build(s: StepSpec) -> Step:
            from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

            batch_cls = BatchRotatingKVCache if merge is None else type(
                "BatchRotatingKVCache", (BatchRotatingKVCache,), {"merge": classmethod(merge)})
            rows = [RotatingKVCache(max_size=window + keep, keep=keep)
                    for _ in range(s.batch_size)]
            window_size = None if keep else window

            def alone(b, t, q, k, v, out):  # a prompt: one row, its own cache
                mask = rows[b].make_mask(len(t), window_size=window_size)
                keys, values = rows[b].update_and_fetch(_to_mx(k[b:b + 1, :, t]),
                                                        _to_mx(v[b:b + 1, :, t]))
                out[b:b + 1, :, t] = _mlx_sdpa(q[b:b + 1, :, t], keys, values, mask)

            def step(q, k, v, positions):
                out = torch.zeros_like(q)
                if q.shape[2] > 1:  # prompts: each row alone, its real tokens only
                    for b in range(q.shape[0]):
                        t = (positions[b] >= 0).nonzero().flatten()
                        if len(t):
                            alone(b, t, q, k, v, out)
                    return out
                real = (positions[:, 0] >= 0).tolist()
                fresh = [b for b in range(q.shape[0]) if real[b] and rows[b].empty()]
                for b in fresh:  # a new request: its first token is its prompt
                    alone(b, torch.tensor([0]), q, k, v, out)
                active = [b for b in range(q.shape[0]) if real[b] and b not in fresh]
                if not batched:  # each request decodes alone
                    for b in active:
                        alone(b, torch.tensor([0]), q, k, v, out)
                    return out
                if not active:
                    return out
                batch = batch_cls.merge([rows[b] for b in active])
                mask = batch.make_mask(1, window_size=window_size)
                keys, values = batch.update_and_fetch(_to_mx(k[active]), _to_mx(v[active]))
                out[active] = _mlx_sdpa(q[active], keys, values, mask)
                for i, b in enumerate(active):
                    rows[b] = batch.extract(i)
                return out

            return step

        return prebuilt(build)

    return factory


# ------------------------------------------------------------------ correct but unusual
def paged_blocks(window: int, block_size: int = 2) -> MakeStep:
    """A paged cache: each row's tokens go to fixed-size blocks taken from a shared pool, a
    block table per row in position order; after each step a row frees (returns to the pool)
    every block whose newest token no later query can see. Attention gathers a row's live
    blocks and masks by the positions they hold."""
    def build(s: StepSpec) -> Step:
        B, H, D = s.batch_size, s.num_kv_heads, s.head_dim
        pool_k: list[torch.Tensor] = []  # physical blocks (H, block_size, D)
        pool_v: list[torch.Tensor] = []
        pool_pos: list[torch.Tensor] = []  # positions each physical block holds, -1 empty
        free: list[int] = []
        tables: list[dict[int, int]] = [{} for _ in range(B)]  # logical block -> physical

        def take() -> int:
            if free:
                return free.pop()
            pool_k.append(torch.zeros(H, block_size, D, dtype=s.dtype, device=s.device))
            pool_v.append(torch.zeros_like(pool_k[-1]))
            pool_pos.append(torch.full((block_size,), -1, device=s.device))
            return len(pool_k) - 1

        def step(q, k, v, positions):
            outs = []
            for b in range(B):
                for t, p in enumerate(positions[b].tolist()):
                    if p < 0:
                        continue
                    block = tables[b].get(p // block_size)
                    if block is None:
                        block = tables[b][p // block_size] = take()
                        pool_pos[block].fill_(-1)
                    pool_k[block][:, p % block_size] = k[b, :, t]
                    pool_v[block][:, p % block_size] = v[b, :, t]
                    pool_pos[block][p % block_size] = p
                live = [tables[b][i] for i in sorted(tables[b])]
                if live:
                    keys = torch.cat([pool_k[i] for i in live], 1)[None]
                    values = torch.cat([pool_v[i] for i in live], 1)[None]
                    key_pos = torch.cat([pool_pos[i] for i in live])[None]
                else:  # a row of padding only so far
                    keys = values = k.new_zeros(1, H, 1, D)
                    key_pos = positions.new_full((1, 1), -1)
                mask = band_mask(positions[b:b + 1], key_pos, window)
                outs.append(attend(q[b:b + 1], keys, values, mask))
                newest = int(positions[b].max())
                for i in [i for i in tables[b] if (i + 1) * block_size - 1 <= newest - window + 1]:
                    free.append(tables[b].pop(i))  # no later query reaches this block
            return torch.cat(outs, 0)

        return step

    return prebuilt(build)


def rope_at_read(window: int) -> MakeStep:
    """Keys stored before RoPE (the kit's keys turned back by their positions) in a ring, and
    turned by the positions their slots hold each time they are read, as StreamingLLM does."""
    def step(ring, q, k, v, positions):
        raw = apply_rope(k, -positions)  # what the model had before it turned the keys
        keys, values, key_pos = ring.keys_with_chunk(raw, v, positions)
        keys = apply_rope(keys, key_pos)  # turned at read
        ring.write(raw, v, positions)
        return attend(q, keys, values, band_mask(positions, key_pos, window))

    return _on_ring(window, step)


@dataclass(frozen=True)
class Unusual:
    """A correct cache with an unusual layout, and the setting that checks it."""

    name: str
    what: str
    build: Callable[[int], MakeStep]
    batch_size: int = 2
    ragged: bool = True


UNUSUAL: dict[str, Unusual] = {u.name: u for u in [
    Unusual("paged_blocks", "paged blocks of 2 from a shared pool, freed outside the window",
            paged_blocks),
    Unusual("rope_at_read", "keys stored before RoPE, turned by position at every read",
            rope_at_read),
]}


_HF = "https://github.com/huggingface/transformers"
_RASBT = "https://github.com/rasbt/LLMs-from-scratch"
_MRS = "https://github.com/EricLBuehler/mistral.rs"
EXHIBITS: dict[str, Exhibit] = {e.name: e for e in [
    Exhibit(
        "hf_37574", "transformers", "#37574", f"{_HF}/issues/37574",
        "SlidingWindowCache rolls one token early (cache_position >= max_cache_len - 1), so "
        "the W-th token evicts position 0 and leaves an empty slot in the window.",
        "transcribed from transformers v4.51.3: src/transformers/cache_utils.py#L1405-L1428 "
        "(SlidingWindowCache.update) and models/mistral/modeling_mistral.py#L689-L702 (mask)",
        "transformers v4.52.4 (PR #38046): src/transformers/cache_utils.py#L95-L119",
        _hf_sliding_window_cache(hf451_sliding_update),
        _hf_sliding_window_cache(hf452_sliding_update), "window", max_chunk=1,
        listing=("museum.py", "hf451_sliding_update")),
    Exhibit(
        "rasbt_1008", "LLMs-from-scratch", "#1008", f"{_RASBT}/issues/1008",
        "The cache is cut to its last W keys before a chunk attends, so the chunk's early "
        "queries lose keys their windows still hold.",
        "transcribed from rasbt/LLMs-from-scratch@4612d20: ch04/06_swa/gpt_with_kv_swa.py"
        "#L58-L76 (cache) and #L101-L108 (mask)",
        "rasbt/LLMs-from-scratch@28c65cd (PR #1013): the same file, #L58-L84",
        _rasbt_swa(fixed=False), _rasbt_swa(fixed=True), "window", batch_size=2,
        listing=("museum.py", "_rasbt_swa")),
    Exhibit(
        "mistralrs_246", "mistral.rs", "#246", f"{_MRS}/issues/246",
        "The KV cache is concatenated and never sliced, and a one-token step gets no mask, so "
        "decoding past W sees every earlier key.",
        "transcribed from EricLBuehler/mistral.rs@4505a5e: mistralrs-core/src/models/mistral.rs"
        "#L160-L168 (cache) and #L405-L411 (no mask for seq_len <= 1)",
        "PR #244 (d442e02) narrows the cache only when it holds more than W keys (`>`), so the "
        "step at position W still sees W + 1; `>=` (ours, one character) passes",
        _mistralrs_decode(None), _mistralrs_decode(lambda n, w: n >= w), "window",
        max_chunk=1, upstream_fix=_mistralrs_decode(lambda n, w: n > w),
        listing=("museum.py", "_mistralrs_decode")),
]}
_MLX = "https://github.com/ml-explore/mlx-lm"
_MLX_REAL = "mlx-lm as installed (the fixed release)"
EXHIBITS |= {e.name: e for e in [
    Exhibit(
        "mlx_lm_390", "mlx-lm", "PR #390", f"{_MLX}/pull/390",
        "create_causal_mask's window test `linds <= rinds + window_size` lets each query see "
        "W + 1 keys.",
        "transcribed from ml-explore/mlx-lm@6fd60d3^: mlx_lm/models/base.py#L32-L38, on the "
        "installed KVCache and create_attention_mask",
        f"{_MLX_REAL}: create_causal_mask with `<` (PR #390, 6fd60d3)",
        _mlx_windowed_kv(lambda N, off, ra, w: causal_mask_pre390(N, off, w)),
        _mlx_windowed_kv(None), "window", dtype=torch.float32,
        listing=("museum.py", "causal_mask_pre390")),
    Exhibit(
        "mlx_lm_843", "mlx-lm", "PR #843", f"{_MLX}/pull/843",
        "create_attention_mask returns no mask for a single token, so a sliding layer on a "
        "plain KVCache decodes over every key it ever stored.",
        "transcribed from ml-explore/mlx-lm@25a4c83^: mlx_lm/models/cache.py#L112-L120, on "
        "the installed KVCache",
        f"{_MLX_REAL}: a window mask for one token too (PR #843, 25a4c83)",
        _mlx_windowed_kv(attention_mask_pre843), _mlx_windowed_kv(None), "window",
        dtype=torch.float32,
        listing=("museum.py", "attention_mask_pre843")),
    Exhibit(
        "omlx_543", "oMLX", "#543", "https://github.com/jundot/omlx/issues/543",
        "BatchRotatingKVCache.merge sizes each row's slice by its write cursor `_idx`, which "
        "after a wrap is not the number of keys the ring holds.",
        "transcribed from mlx-lm 0.31.1 (the version oMLX 0.3.1 bundles): "
        "mlx_lm/models/cache.py#L1343-L1374 (merge), on the installed caches",
        f"{_MLX_REAL}: merge slices by `c.size()` (mlx-lm PR #1072)",
        _mlx_server(merge_031), _mlx_server(None), "error", batch_size=2, ragged=True,
        max_chunk=None, dtype=torch.float32,
        listing=("museum.py", "merge_031")),
    Exhibit(
        "mlx_lm_1631", "mlx-lm", "#1631", f"{_MLX}/issues/1631",
        "A request's cache keeps `keep` sinks, but the batch it decodes in "
        "(BatchRotatingKVCache: merge, extract) has no `keep`, so the sinks are overwritten "
        "once the ring wraps.",
        "mlx-lm as installed: RotatingKVCache(W + S, keep=S), merged into and extracted from "
        "BatchRotatingKVCache, as BatchGenerator decodes",
        "no upstream fix (open); ours: a request whose cache keeps sinks decodes alone",
        _mlx_server(None, keep=2), _mlx_server(None, keep=2, batched=False), "window",
        sinks=2, batch_size=2, ragged=True, max_chunk=1, dtype=torch.float32,
        listing=("museum.py", "_mlx_server")),
    Exhibit(
        "vllm_metal_117", "vllm-metal", "PR #117", "https://github.com/vllm-project/vllm-metal/pull/117",
        "BatchRotatingKVCache.merge sizes each row's slice by `offset`, every token the row "
        "ever saw, which past the window is more than the ring holds.",
        "transcribed from mlx-lm 0.29.1 (the version vllm-metal pinned): "
        "mlx_lm/models/cache.py#L1169-L1198 (merge), on the installed caches",
        f"{_MLX_REAL}: merge slices by what each row holds (mlx-lm PR #738, then #1072)",
        _mlx_server(merge_029), _mlx_server(None), "error", batch_size=2, ragged=True,
        dtype=torch.float32,
        listing=("museum.py", "merge_029")),
]}
_LIT = "https://github.com/Lightning-AI/litgpt"
EXHIBITS |= {e.name: e for e in [
    Exhibit(
        "litgpt_2145", "litgpt", "#2145", f"{_LIT}/issues/2145",
        "With a KV cache the mask is boolean, and the window bias added to it (-inf, which a "
        "boolean reads as True) removes nothing, so a cached forward has no window at all.",
        "transcribed from Lightning-AI/litgpt@ba331d6: litgpt/model.py#L475-L492 (mask) and "
        "#L1048 (KVCache.forward)",
        "Lightning-AI/litgpt@3023ca8 (PR #2153): a ring of W slots, litgpt/model.py KVCache",
        _litgpt("ba331d6"), _litgpt("3023ca8"), "window", max_chunk=1,
        listing=("museum.py", "_litgpt")),
    Exhibit(
        "litgpt_2182", "litgpt", "#2182", f"{_LIT}/issues/2182",
        "A chunk is written into the ring before it attends, under a mask of absolute positions "
        "cut to the ring's length, so after the wrap its queries see later keys and lose "
        "earlier ones.",
        "transcribed from Lightning-AI/litgpt@3023ca8: litgpt/model.py KVCache.forward "
        "(ring write) and CausalSelfAttention.forward (mask cut to actual_kv_len)",
        "PR #2215 (d28a00d) refuses a chunk longer than W but still breaks on a chunk after "
        "the wrap; ours: feed a chunk token by token, litgpt's decode path",
        _litgpt("3023ca8"), _litgpt("3023ca8", token_by_token=True), "window",
        upstream_fix=_litgpt("d28a00d"),
        listing=("museum.py", "_litgpt")),
]}


# ------------------------------------------------------------------ window conventions
@dataclass(frozen=True)
class Convention:
    """How one library writes "the last W": its rule as written, the number it takes, and the
    ``window=`` that number means to the kit."""

    library: str
    written: str  # the rule, as the library writes it
    number: str  # the library's parameter, in its own words
    visible: Callable[[torch.Tensor, int], torch.Tensor] | None  # (q - k, n) -> visible
    window_for: Callable[[int], int]  # the library's number -> the kit's window
    window_text: str  # the same, in words: "sliding_window", "left + 1"
    source: str
    real: Callable[[int], MakeStep] | None = None  # a real library cache, if one runs here


def by_rule(visible: Callable[[torch.Tensor, int], torch.Tensor], n: int) -> MakeStep:
    """Every key kept (rows of any length), masked by ``visible(q - k, n)`` alone, so the check
    sees the library's rule and nothing else."""
    def build(s: StepSpec) -> Step:
        kept: list[torch.Tensor] = []  # keys, values, positions so far

        def step(q, k, v, positions):
            keys = torch.cat([kept[0], k], 2) if kept else k
            values = torch.cat([kept[1], v], 2) if kept else v
            key_pos = torch.cat([kept[2], positions], 1) if kept else positions
            kept[:] = [keys, values, key_pos]
            diff = positions[:, :, None] - key_pos[:, None, :]
            real = (positions[:, :, None] >= 0) & (key_pos[:, None, :] >= 0)
            return attend(q, keys, values, real & visible(diff, n))

        return step

    return prebuilt(build)


def _below(d: torch.Tensor, n: int) -> torch.Tensor:
    """``0 <= q - k < n``: n keys."""
    return (d >= 0) & (d < n)


def _up_to(d: torch.Tensor, n: int) -> torch.Tensor:
    """``0 <= q - k <= n``: n + 1 keys."""
    return (d >= 0) & (d <= n)


_LLAMA = "ggml-org/llama.cpp src/llama-hparams.cpp, llama_hparams::is_masked_swa"
CONVENTIONS: list[Convention] = [
    Convention("transformers, mlx-lm", "`0 <= q - k < W`", "sliding_window", _below,
               lambda n: n, "sliding_window",
               "transformers masking_utils sliding_window_overlay; mlx-lm create_causal_mask"),
    Convention("FlashAttention", "`q - left <= k <= q`",
               "left", _up_to, lambda n: n + 1, "left + 1",
               "Dao-AILab/flash-attention flash_attn_func docstring (inclusive, bottom-right)"),
    Convention("FlashInfer", "`window_left + 1` keys", "window_left",
               _up_to, lambda n: n + 1, "window_left + 1",
               "flashinfer BatchPrefillWithPagedKVCacheWrapper.plan(window_left=...)"),
    Convention("mistral-inference reference",
               "`triu(.., diagonal=-W)`",
               "sliding_window", _up_to, lambda n: n + 1, "sliding_window + 1",
               "mistralai/mistral-inference@215fc80: one_file_ref.py, Transformer.forward"),
    Convention("transformers, dynamic sliding layer",
               "keeps `W - 1`, then appends", "sliding_window",
               None, lambda n: n, "sliding_window",
               "transformers cache_utils.DynamicSlidingWindowLayer (the installed one, with "
               "its masks and sdpa)", real=hf_dynamic_sliding),
    Convention("llama.cpp, standard SWA", "masked if `p1 - p0 >= n_swa`", "n_swa", _below,
               lambda n: n, "n_swa", f"{_LLAMA}, LLAMA_SWA_TYPE_STANDARD"),
    Convention("llama.cpp, symmetric SWA",
               "masked if `abs(p1 - p0) > n_swa / 2`", "n_swa",
               lambda d, n: (d >= -(n // 2)) & (d <= n // 2), lambda n: n // 2 + 1,
               "none (not causal)", f"{_LLAMA}, LLAMA_SWA_TYPE_SYMMETRIC (later keys too)"),
]


def convention_step(convention: Convention, n: int) -> MakeStep:
    """The make_step of a convention at its library's number ``n``."""
    return convention.real(n) if convention.real is not None else by_rule(convention.visible, n)


# ------------------------------------------------------------------ rewinds (mlx-lm, mlx-vlm)
class _TrimWhenSafe(MlxStep):
    """A rewind that trims only a cache that can give the tokens back (not yet wrapped), and
    otherwise declines the state, as a decoder that falls back to a cold path does."""

    def rewind(self, n: int) -> None:
        if not self.cache.is_trimmable():
            raise Unsupported("the ring has wrapped: fall back (target-only decoding, or a "
                              "cold prefill)")
        self.cache.trim(n)


class _VlmSliceTrim(MlxStep):
    """mlx-vlm 0.6.7's prompt-cache reuse, as a rewind to ``prefix_len = offset - n``."""

    def rewind(self, n: int) -> None:
        c, prefix_len = self.cache, self.cache.offset - n
        if c.keys is not None:
            cached_len = c.keys.shape[2]
            if cached_len > prefix_len:
                c.keys = c.keys[:, :, :prefix_len, :]
                c.values = c.values[:, :, :prefix_len, :]
                c.offset = prefix_len


_VLM = "https://github.com/Blaizzy/mlx-vlm"
EXHIBITS |= {e.name: e for e in [
    Exhibit(
        "mlx_lm_1423", "mlx-lm", "#1423", f"{_MLX}/issues/1423",
        "Speculative decoding rejects drafts with trim_prompt_cache and ignores its answer; "
        "once the ring has wrapped it trims nothing, so rejected drafts stay in the window.",
        "mlx-lm as installed: RotatingKVCache and trim_prompt_cache, called as "
        "speculative_generate_step's rewind calls them (the same bug: mlx-swift-lm #424)",
        "PR #1427's rule (closed unmerged): fall back to target-only decoding when the ring can "
        "no longer be trimmed (here: the rewind declines the state)",
        mlx_rotating, partial(mlx_rotating, step_cls=_TrimWhenSafe), "window",
        dtype=torch.float32, rewind=True,
        listing=("adapters.py", "MlxStep.rewind")),
    Exhibit(
        "mlx_vlm_1715", "mlx-vlm", "#1715", f"{_VLM}/issues/1715",
        "Prompt-cache reuse cuts a rotating cache with a flat slice `keys[..., :prefix_len, :]` "
        "and resets `offset`, leaving the ring's write index `_idx` where it was.",
        "transcribed from mlx-vlm 0.6.7: mlx_vlm/generate/dispatch.py#L879-L886, on mlx-lm's "
        "RotatingKVCache (mlx-vlm's copy differs only in how it saves its state)",
        "PR #1748: reuse a prefix only while the cache still holds its whole sequence (not yet "
        "wrapped), trimming through the cache's own trim(); else a cold prefill",
        partial(mlx_rotating, step_cls=_VlmSliceTrim),
        partial(mlx_rotating, step_cls=_TrimWhenSafe), "window",
        dtype=torch.float32, rewind=True,
        listing=("museum.py", "_VlmSliceTrim.rewind")),
]}


# ------------------------------------------------------------------ transformers #48280
def _recording_layer_pre48280():
    """``DynamicSlidingWindowLayer`` before transformers PR #48280: while it records its past
    (assisted decoding), ``update`` returns every key it holds, while ``get_mask_sizes`` still
    promises the mask ``W - 1 + T`` columns."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    class RecordingLayer(DynamicSlidingWindowLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.record_past:
                return super().update(key_states, value_states, *args, **kwargs)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.cumulative_length += key_states.shape[-2]
            full_key_states = torch.cat([self.keys, key_states], dim=-2)
            full_value_states = torch.cat([self.values, value_states], dim=-2)
            self.keys, self.values = full_key_states, full_value_states
            return full_key_states, full_value_states

    return RecordingLayer


class _AssistedStep(HfStep):
    """One row through a transformers sliding layer recording its past, as assisted decoding
    drives it (:class:`~ringviz.conformance.adapters.HfStep`); a rewind is ``cache.crop(-n)``,
    which takes back only tokens fed since the last crop."""

    def __init__(self, layer, window: int, s: StepSpec) -> None:
        layer.activate_past_recording()
        super().__init__(layer, window, s)
        self.cropped_at = 0  # tokens fed before the last crop

    def rewind(self, n: int) -> None:
        since_crop = self.padding.shape[1] - self.cropped_at
        if n > since_crop:
            raise Unsupported(f"crop takes back the {since_crop} tokens fed since the last "
                              f"crop, not {n}")
        self.cache.crop(-n)
        self.padding = self.padding[:, :-n]
        self.cropped_at = self.padding.shape[1]


def _hf_assisted(layer_cls: Callable | None) -> Callable[[int], MakeStep]:
    """:class:`_AssistedStep` over ``layer_cls`` (None: the installed
    ``DynamicSlidingWindowLayer``)."""
    def build(window: int, s: StepSpec) -> Step:
        from transformers.cache_utils import DynamicSlidingWindowLayer

        cls = layer_cls() if layer_cls is not None else DynamicSlidingWindowLayer
        return _AssistedStep(cls(sliding_window=window), window, s)

    return _per_window(build)


EXHIBITS |= {e.name: e for e in [
    Exhibit(
        "hf_48280", "transformers", "PR #48280", f"{_HF}/pull/48280",
        "While a sliding layer records its past for assisted decoding, `update` returns every "
        "key it holds, but the mask is sized for the last W - 1 keys and the chunk.",
        "transcribed from transformers before PR #48280 (after #47447): "
        "src/transformers/cache_utils.py, DynamicSlidingWindowLayer.update's recording branch, "
        "on the installed layer, masks and sdpa",
        "transformers as installed: update returns the last W - 1 + T keys, as the mask "
        "expects (PR #48280)",
        _hf_assisted(_recording_layer_pre48280), _hf_assisted(None), "error", rewind=True,
        listing=("museum.py", "_recording_layer_pre48280")),
]}


_ET = "https://github.com/pytorch/executorch"
EXHIBITS |= {e.name: e for e in [
    Exhibit(
        "executorch_20346", "ExecuTorch", "PR #20346", f"{_ET}/pull/20346",
        "The ring holds 2W slots and a chunk is written before it attends, so a chunk longer "
        "than W + 1 tokens overwrites keys its own first queries still need; the gemma4 "
        "runner prefilled in chunks of 2W.",
        "executorch 1.5.1 as installed: examples/models/llama/attention.py, RingKVCache "
        "(2W slots, cache_positions), driven as AttentionMHA.forward drives it (update, "
        "create_causal_mask_for_ring_buffer, SDPA)",
        "PR #20346 (open): the runner caps its prefill chunks at the sliding window; here the "
        "same installed ring, each chunk cut to W tokens before the forward",
        executorch_ring, lambda window: executorch_ring(window, max_chunk=window), "window",
        batch_size=2, dtype=torch.float32, listing=("adapters.py", "ExecuTorchStep.__call__"),
        requires="executorch"),
]}


# ------------------------------------------------------------------ the bugs, by class
@dataclass(frozen=True)
class BugClass:
    """Exhibits that broke the same rule, and what their fixes restored."""

    name: str
    exhibits: tuple[str, ...]
    restored: str  # the rule the fixes put back, one line


CLASSES: list[BugClass] = [
    BugClass("the window off by one", ("hf_37574", "mlx_lm_390"),
             "the window's bound, counted in keys: a query sees W, not W - 1 or W + 1"),
    BugClass("no window on a decode step", ("mistralrs_246", "mlx_lm_843", "litgpt_2145"),
             "a window mask for every step, one token included"),
    BugClass("a chunk's write clobbers its own keys",
             ("rasbt_1008", "litgpt_2182", "executorch_20346"),
             "attend before writing, or a ring (or a chunk cap) that spares the chunk's keys"),
    BugClass("a batch merge sized by the wrong count", ("omlx_543", "vllm_metal_117"),
             "slice each row by the keys it holds, not by a cursor or a total"),
    BugClass("sinks lost in a batch", ("mlx_lm_1631",),
             "the sinks' slots kept out of the ring's rotation"),
    BugClass("a rewind that does not take back", ("mlx_lm_1423", "mlx_vlm_1715", "hf_48280"),
             "take back only what the ring still holds, through its own bookkeeping"),
]
