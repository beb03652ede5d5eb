"""The ring decode path on a real model: Hugging Face's layers, ringviz's ``RingKVCache``.

Hugging Face computes everything around attention (embeddings, RMSNorm, q/k/v projections,
RoPE at the positions we pass, MLP, logits) with its own modules, so the ring path and an HF
reference share every op but attention. In a float64 model that means HF's RoPE angles, which
it computes in float32 even then, and RMSNorms in float64 (``load_model(float64)`` patches
them: HF's float32 norm alone makes a decode and a full forward differ by ~1e-8). The float64
tolerances of the tests and chapters (<= 1e-10) assume the reference runs attention through
PyTorch SDPA (``attn_implementation="sdpa"``, what ``load_model`` sets): HF's "eager"
attention takes its softmax in float32 even in float64 models, so an eager reference differs
by ~1e-7 (8.5e-8 measured, vs 5.6e-17 for sdpa). What HF hands to attention is the new tokens'
rotated ``q``, ``k``, ``v``; we register an attention function under the name
``"ringviz_ring"`` that sends them to the layer's ring::

    q, k, v (rotated at absolute positions) -> RingKVCache.step -> write slot pos % W
                                              -> mask from stored positions -> attention

No Hugging Face cache is built (``use_cache=False``) and no HF mask is made (masks come from the
ring's stored positions), so the ring is the only KV state. Sliding layers get a ring of
capacity ``window``; a full-attention layer (Gemma 3's 5, 11, 17) gets a ``RingKVCache`` whose
capacity covers the whole run, so it never wraps: a preallocated full cache. A position at or
past ``capacity`` is refused before any layer is written (past it a full layer would silently
become a sliding one).

Prompts are fed in chunks (:meth:`RingRunner.prefill`, default chunk = the smallest window), so
a prefill's attention scores and activations are bounded by the chunk, not the prompt; the ring
is exact for any chunk schedule. A forward stopped after some layers wrote (an exception, or
Ctrl-C in a notebook) leaves the layers out of step: the runner then refuses every call until
:meth:`RingRunner.reset`, rather than decode from a cache whose layers disagree.
"""

from __future__ import annotations

import torch

from ringviz.cache import RingKVCache
from ringviz.checks import check_int, check_sinks
from ringviz.hf.attention import attention_implementation, shares_one_config
from ringviz.hf.config import layer_windows, read_layout
from ringviz.hf.rotary import model_sink_rope

ATTN_NAME = "ringviz_ring"


def _ring_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                    dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention-interface entry: route one layer's q/k/v through the runner's ring."""
    runner: RingRunner = kwargs["ring_runner"]
    positions = kwargs["position_ids"]  # (B, T) absolute, -1 = padding
    out = runner.attend(module.layer_idx, query, key, value, positions, scaling)  # (B, Hq, T, D)
    return out.transpose(1, 2), None  # HF expects (B, T, Hq, D)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _ring_attention)


class RingRunner:
    """One model's KV state in ``RingKVCache`` objects, one per layer, for a batch of rows.

    ``sinks=S`` keeps each row's first ``S`` positions in every sliding layer beside its ring
    (full-attention layers keep everything anyway). ``sink_rope=None`` scores them at their
    absolute positions; ``sink_rope="cache"`` uses StreamingLLM's positions inside the cache,
    the sink keys turned by the model's own rotary embedding for that layer's type
    (:func:`ringviz.hf.rotary.model_sink_rope`: Gemma 3's local base, not the global one).
    """

    def __init__(self, model, batch_size: int, window: int | None, capacity: int, *,
                 sinks: int = 0, sink_rope: str | None = None) -> None:
        """``capacity``: positions the run may reach, 0 .. capacity-1 (sizes the full layers)."""
        self.capacity = check_int("capacity", capacity)
        self.sinks = check_sinks(sinks, sink_rope)
        self.sink_rope = sink_rope
        _register()
        with attention_implementation(model, ATTN_NAME):  # validates the name once
            pass
        self.one_config = shares_one_config(model)  # then every forward switches cheaply
        layout = read_layout(model)
        self.model = model
        self.windows = layer_windows(model, window)
        param = next(model.parameters())
        rope = model_sink_rope(model, "sliding_attention") if sink_rope == "cache" else None
        self.caches = [
            RingKVCache(batch_size, layout.num_kv_heads, w or capacity, layout.head_dim,
                        sinks=self.sinks if w else 0, sink_rope=rope if w else None,
                        dtype=param.dtype, device=param.device)
            for w in self.windows
        ]
        # default prefill chunk: the smallest ring, so a chunk's scores are at most (W, 2W)
        self.prefill_chunk = min(w or capacity for w in self.windows)
        self._mid_step = False  # True from a layer's first write until its forward completes

    def reset(self) -> None:
        """Empty every layer's cache: the way back after an interrupted forward."""
        for cache in self.caches:
            cache.reset()
        self._mid_step = False

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' caches (k, v and positions)."""
        return sum(cache.nbytes for cache in self.caches)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention for one layer: write into its ring and attend (bugs.py overrides this).

        Every layer of one forward gets the same positions and shapes, and all rings advance
        together, so validating at layer 0 (before anything is written) covers them all and
        spares the other layers the host sync. From the first write on, the runner counts as
        mid-step until the forward returns (see :meth:`forward`).
        """
        cache = self.caches[layer]
        if layer == 0:
            cache.check_step(q, k, v, positions, scale=scale)  # a refusal writes nothing
        self._mid_step = True
        return cache.step(q, k, v, positions, scale=scale, check=False)

    def _check_call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Refuse a call on a runner left mid-step, mismatched shapes, positions past capacity."""
        if self._mid_step:
            raise RuntimeError(
                "the ring cache was left mid-step: an earlier forward stopped (an exception or "
                "an interrupt) after some layers had written, so the layers now hold different "
                "positions. Call runner.reset() and feed the sequence again from its start.")
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if input_ids.shape != positions.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions "
                             f"{tuple(positions.shape)} differ")
        newest = int(positions.max()) if positions.numel() else -1
        if newest >= self.capacity:
            raise ValueError(f"position {newest} is at or past the runner's capacity="
                             f"{self.capacity} (positions 0..{self.capacity - 1}): its full-"
                             f"attention layers would drop tokens; make a RingRunner with a "
                             f"larger capacity")

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *,
                logits_to_keep: int = 0) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` of ``T`` new tokens per row; -1 positions are padding.

        ``logits_to_keep=n`` computes only the last ``n`` columns' logits (HF's argument; 0 =
        all). Nothing is written when the call is refused.
        """
        self._check_call(input_ids, positions)
        with attention_implementation(self.model, ATTN_NAME, one_config=self.one_config):
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                             logits_to_keep=logits_to_keep, ring_runner=self)
        self._mid_step = False  # every layer wrote this forward's tokens
        return out.logits

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, *,
                chunk: int | None = None, last_only: bool = False) -> torch.Tensor:
        """Feed a ``(B, T)`` prompt in column chunks of ``chunk`` (default: the smallest window).

        Equal to one forward over the whole prompt (the ring is exact for any chunking), but
        the attention scores and activations held at once scale with the chunk, not with T.
        Returns the logits ``(B, T, vocab)``, or with ``last_only`` just the last column's
        ``(B, 1, vocab)`` (the other chunks then skip the LM head). The whole prompt is checked
        before its first chunk is written.
        """
        chunk = self.prefill_chunk if chunk is None else check_int("chunk", chunk)
        self._check_call(input_ids, positions)
        T = positions.shape[1]
        if T <= chunk:  # one chunk: forward's own layer-0 check covers it
            return self.forward(input_ids, positions, logits_to_keep=1 if last_only else 0)
        self.caches[0].check_positions(positions)  # all chunks, before the first write
        out = None
        for s in range(0, T, chunk):
            logits = self.forward(input_ids[:, s:s + chunk], positions[:, s:s + chunk],
                                  logits_to_keep=1 if last_only else 0)
            if last_only:
                out = logits
            else:  # filled in place: no second copy of T x vocab logits
                out = logits.new_empty(logits.shape[0], T, logits.shape[2]) if s == 0 else out
                out[:, s:s + chunk] = logits
        return out


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token rows of different lengths, padded on the left: ``(ids, positions)`` (B, T).

    >>> ids, pos = left_pad([torch.tensor([7, 8, 9]), torch.tensor([5])], pad_id=0)
    >>> ids.tolist(), pos.tolist()
    ([[7, 8, 9], [0, 0, 5]], [[0, 1, 2], [-1, -1, 0]])
    """
    T = max(len(r) for r in rows)
    device = rows[0].device
    ids = torch.full((len(rows), T), pad_id, dtype=torch.int64, device=device)
    positions = torch.full((len(rows), T), -1, dtype=torch.int64, device=device)
    for b, row in enumerate(rows):
        ids[b, T - len(row):] = row
        positions[b, T - len(row):] = torch.arange(len(row), device=device)
    return ids, positions


@torch.no_grad()
def ring_logits(runner: RingRunner, rows: list[torch.Tensor], prompt_lengths: list[int],
                progress: bool = False, *, prefill_chunk: int | None = None
                ) -> list[torch.Tensor]:
    """Teacher-forced ring decode: prefill each row's prompt, then one token per step.

    ``rows[b]`` holds row b's whole sequence; its first ``prompt_lengths[b]`` tokens are the
    prompt (one batched, left-padded prefill in chunks of ``prefill_chunk`` columns, see
    :meth:`RingRunner.prefill`), the rest are fed one per decode step. Rows must have the same
    number of decode tokens. Returns each row's logits ``(L_b, vocab)``.
    """
    from tqdm.auto import tqdm

    new = {len(r) - p for r, p in zip(rows, prompt_lengths, strict=True)}
    if len(new) != 1 or min(prompt_lengths) <= 0:
        raise ValueError("rows need prompts of >= 1 token and the same number of new tokens")
    n_new = new.pop()
    pad_id = int(rows[0][0])  # any valid id: padded tokens are never attended to
    ids, positions = left_pad([r[:p] for r, p in zip(rows, prompt_lengths, strict=True)],
                              pad_id)
    prefill = runner.prefill(ids, positions, chunk=prefill_chunk)  # (B, P_max, vocab)
    steps = []
    lengths = torch.tensor(prompt_lengths, device=ids.device)
    for i in tqdm(range(n_new), desc="ring decode", disable=not progress, leave=False):
        tok = torch.stack([r[p + i] for r, p in zip(rows, prompt_lengths, strict=True)])  # (B,)
        steps.append(runner.forward(tok[:, None], (lengths + i)[:, None]))  # (B, 1, vocab)
    decode = torch.cat(steps, dim=1) if steps else prefill[:, :0]
    return [torch.cat([prefill[b, prefill.shape[1] - p:], decode[b]])
            for b, p in enumerate(prompt_lengths)]


@torch.no_grad()
def ring_generate(runner: RingRunner, prompts: list[torch.Tensor], new_tokens: int, *,
                  prefill_chunk: int | None = None) -> list[torch.Tensor]:
    """Greedy decoding through the ring: each row's ``new_tokens`` next token ids.

    The prompts are prefilled in chunks (:meth:`RingRunner.prefill`); the whole run's last
    position must lie below the runner's capacity, checked before anything is written.
    """
    new_tokens = check_int("new_tokens", new_tokens)
    ids, positions = left_pad(prompts, pad_id=int(prompts[0][0]))
    last = int(positions[:, -1].max()) + new_tokens - 1
    if last >= runner.capacity:
        raise ValueError(f"generating {new_tokens} tokens reaches position {last}, at or past "
                         f"the runner's capacity={runner.capacity}")
    nxt = runner.prefill(ids, positions, chunk=prefill_chunk, last_only=True)[:, -1].argmax(-1)
    out = [nxt]
    pos = positions[:, -1] + 1  # (B,) next absolute position of each row
    for i in range(new_tokens - 1):
        nxt = runner.forward(nxt[:, None], (pos + i)[:, None])[:, -1].argmax(-1)  # (B,)
        out.append(nxt)
    return list(torch.stack(out, dim=1))  # B tensors of (new_tokens,)
