"""Ready ``make_step`` factories: ringviz's own caches and other libraries', driven as their
models drive them.

A factory takes the cache's settings and returns ``make_step(*, batch_size, num_heads,
num_kv_heads, head_dim, dtype=None, device=None)``, which builds one fresh cache and returns its
``step(q, k, v, positions) -> out`` (see :mod:`ringviz.conformance`). Each is a
:func:`~ringviz.conformance.seam.prebuilt`: storage is made at once in ``dtype`` on ``device``
when they are given (the kit gives them), else at the first step from the inputs'.

Some steps also have ``rewind(n)`` ("forget the newest n tokens of every row", for
``check(..., rewind=True)``): :func:`ringviz_draft`, :func:`ringviz_rows` and
:func:`mlx_rotating`. :func:`ringviz_rows` takes the rows layout (``check(...,
layout="rows")``): each row's real tokens, no padding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ringviz import RingKVCache
from ringviz.cache import MakeStep, Step
from ringviz.conformance.probe import Unsupported
from ringviz.conformance.seam import StepSpec, prebuilt


def ringviz_ring(window: int, sinks: int = 0) -> MakeStep:
    """ringviz's :class:`~ringviz.RingKVCache`: one ``step`` per chunk, absolute-position sinks.

    >>> import torch
    >>> step = ringviz_ring(4)(batch_size=1, num_heads=2, num_kv_heads=1, head_dim=8,
    ...                        dtype=torch.float32, device="cpu")
    >>> x = torch.zeros(1, 1, 3, 8)
    >>> step(torch.zeros(1, 2, 3, 8), x, x, torch.arange(3)[None]).shape
    torch.Size([1, 2, 3, 8])
    """
    return prebuilt(lambda s: s.ring(window, sinks=sinks).step)


def _rewound_lengths(ring: RingKVCache, n: int) -> torch.Tensor:
    """Each row's length once its newest ``n`` positions are forgotten, or
    :class:`Unsupported` where later tokens overwrote a key the next query needs."""
    lengths = ring.lengths - n
    try:
        ring.check_truncation(lengths)
    except ValueError as err:
        raise Unsupported(f"rewind({n}): {err}") from err
    return lengths


def ringviz_draft(window: int, sinks: int = 0, drafts: int = 2) -> MakeStep:
    """ringviz's ring with ``drafts`` draft slots (``capacity = window + drafts``, chapter 13)
    and a ``rewind``: it takes back up to ``drafts + 1`` tokens once the ring has wrapped (any
    number before), and raises :class:`Unsupported` for more, whose keys are overwritten.

    >>> import torch
    >>> step = ringviz_draft(4)(batch_size=1, num_heads=2, num_kv_heads=1, head_dim=8,
    ...                         dtype=torch.float32, device="cpu")
    >>> x = torch.zeros(1, 1, 6, 8)
    >>> _ = step(torch.zeros(1, 2, 6, 8), x, x, torch.arange(6)[None])
    >>> step.rewind(3)
    >>> step.ring.lengths.tolist()
    [3]
    """
    return prebuilt(lambda s: DraftStep(s.ring(window, sinks=sinks, capacity=window + drafts)))


class RowsStep:
    """One ring per row, each fed its own row's tokens: a server's batch, no padding."""

    def __init__(self, rings: list[RingKVCache]) -> None:
        self.rings = rings

    def __call__(self, q: list[torch.Tensor], k: list[torch.Tensor], v: list[torch.Tensor],
                 positions: list[torch.Tensor]) -> list[torch.Tensor]:
        return [ring.step(*(t[None] for t in row))[0] if len(row[3]) else row[0]
                for ring, row in zip(self.rings, zip(q, k, v, positions), strict=True)]

    def rewind(self, n: int) -> None:
        """Forget the newest ``n`` tokens of every row (each ring checked before any moves)."""
        lengths = [_rewound_lengths(ring, n) for ring in self.rings]
        for ring, kept in zip(self.rings, lengths, strict=True):
            ring.truncate(kept, check=False)


class DraftStep(RowsStep):
    """A :class:`~ringviz.RingKVCache`'s ``step`` and ``rewind(n)`` (a speculative decoder's
    rollback of rejected drafts)."""

    def __init__(self, ring: RingKVCache) -> None:
        super().__init__([ring])
        self.ring = ring

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        return self.ring.step(q, k, v, positions)


def ringviz_rows(window: int, sinks: int = 0, drafts: int = 0) -> MakeStep:
    """The rows layout (``check(..., layout="rows")``): per row, a ring of batch 1 that steps
    on that row's tokens, ``(Hq, n, D)`` and ``(n,)``; a row with no token yet (``n = 0``)
    is left alone. ``rewind`` as :func:`ringviz_draft`'s."""
    def build(s: StepSpec) -> Step:
        row = replace(s, batch_size=1)
        return RowsStep([row.ring(window, sinks=sinks, capacity=window + drafts)
                         for _ in range(s.batch_size)])

    return prebuilt(build)


# ---------------------------------------------------------------- Hugging Face transformers
class HfStep:
    """A transformers cache layer driven as a model's forward drives it. Per forward: the mask
    first, from ``create_sliding_window_causal_mask`` (it sizes itself with the layer's
    ``get_mask_sizes``) and the 2D padding mask over every token so far; then ``cache.update``;
    then the sdpa attention function over what the update returned."""

    def __init__(self, layer, window: int, s: StepSpec) -> None:
        from transformers import MistralConfig
        from transformers.cache_utils import Cache

        self.config = MistralConfig(sliding_window=window, num_attention_heads=s.num_heads,
                                    num_key_value_heads=s.num_kv_heads)
        self.config._attn_implementation = "sdpa"
        self.cache = Cache(layers=[layer])
        self.module = torch.nn.Module()  # what sdpa_attention_forward reads of a module
        self.module.is_causal = True
        self.module.num_key_value_groups = s.num_heads // s.num_kv_heads
        self.padding = torch.empty(s.batch_size, 0, dtype=torch.bool, device=s.device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import create_sliding_window_causal_mask

        B, _, T, D = q.shape
        self.padding = torch.cat([self.padding, positions >= 0], dim=1)  # (B, tokens so far)
        embeds = q.new_zeros(B, T, 1)  # only its shape, dtype and device are read
        # generate's position ids: a row's real tokens count 0, 1, ...; padding gets 1
        position_ids = positions.masked_fill(positions < 0, 1)
        mask = create_sliding_window_causal_mask(self.config, embeds, self.padding, self.cache,
                                                 position_ids)
        keys, values = self.cache.update(k, v, 0)
        out, _ = sdpa_attention_forward(self.module, q, keys, values, mask, scaling=D ** -0.5,
                                        sliding_window=self.config.sliding_window)
        return out.transpose(1, 2)  # (B, T, Hq, D) -> (B, Hq, T, D)


def _hf_allocated(layer_factory: Callable[[], object], window: int) -> MakeStep:
    """An :class:`HfStep` over ``layer_factory()``, allocated up front
    (``Cache.early_initialization``, as transformers' export recipes do)."""
    def build(s: StepSpec) -> Step:
        step = HfStep(layer_factory(), window, s)
        step.cache.early_initialization(s.batch_size, s.num_kv_heads, s.head_dim, s.dtype,
                                        s.device)
        return step

    return prebuilt(build)


def hf_dynamic_sliding(window: int) -> MakeStep:
    """transformers' ``DynamicSlidingWindowLayer`` (cat, keep the last W-1) with its masks."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return _hf_allocated(lambda: DynamicSlidingWindowLayer(sliding_window=window), window)


def hf_static_sliding(window: int, max_cache_len: int = 4096) -> MakeStep:
    """transformers' ``StaticSlidingWindowLayer`` (roll and copy W slots) with its masks."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    return _hf_allocated(
        lambda: StaticSlidingWindowLayer(max_cache_len=max_cache_len, sliding_window=window),
        window)


def ringviz_hf(window: int, sinks: int = 0) -> MakeStep:
    """ringviz.hf's ring layer, as ``RingCache`` drives it: the mask from the positions its
    keys will hold (built before the write, as the forward plan does), then its step. The
    ring is allocated up front, as ``RingCache.allocate`` does."""
    from ringviz.hf import RingLayer

    def build(s: StepSpec) -> Step:
        layer = RingLayer(window, sinks=sinks)
        empty = torch.empty(s.batch_size, s.num_kv_heads, 0, s.head_dim, dtype=s.dtype,
                            device=s.device)
        layer.lazy_initialization(empty, empty)

        def step(q, k, v, positions):
            mask = layer.mask(positions)
            return layer.step(q, k, v, positions, mask, q.shape[-1] ** -0.5)

        return step

    return prebuilt(build)


# ---------------------------------------------------------------- mlx-lm
def _to_mx(x: torch.Tensor):
    import mlx.core as mx

    return mx.array(x.detach().cpu().numpy())


def _from_mx(x, like: torch.Tensor) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.array(x)).to(device=like.device, dtype=like.dtype)


def _mlx_sdpa(q: torch.Tensor, keys, values, mask) -> torch.Tensor:
    """mlx's fast attention over mlx ``keys``/``values`` for torch ``q``, back to torch."""
    import mlx.core as mx

    out = mx.fast.scaled_dot_product_attention(_to_mx(q), keys, values,
                                               scale=q.shape[-1] ** -0.5, mask=mask)
    return _from_mx(out, q)


def _mlx_forward(cache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window_size: int | None) -> torch.Tensor:
    """One forward as ``mlx_lm.models.base`` runs it: the mask (before the update), the
    update, mlx's attention."""
    mask = cache.make_mask(q.shape[2], window_size=window_size)
    keys, values = cache.update_and_fetch(_to_mx(k), _to_mx(v))
    return _mlx_sdpa(q, keys, values, mask)


class MlxStep:
    """One mlx-lm cache driven as ``mlx_lm.models.base`` drives it, and rewound as
    ``mlx_lm``'s speculative decoder rewinds it."""

    def __init__(self, cache, window_size: int | None) -> None:
        self.cache, self.window_size = cache, window_size
        self.trimmed: list[tuple[int, int]] = []  # (asked, trimmed) per rewind

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        if bool((positions < 0).any()):
            raise ValueError("RotatingKVCache has no padding (one sequence per row, "
                             "all rows in step): check it with ragged=False")
        return _mlx_forward(self.cache, q, k, v, self.window_size)

    def rewind(self, n: int) -> None:
        """``trim_prompt_cache([cache], n)``, its answer recorded and, as mlx-lm does, not
        acted on: once the ring has wrapped it trims nothing (mlx-lm #1423)."""
        from mlx_lm.models.cache import trim_prompt_cache

        self.trimmed.append((n, trim_prompt_cache([self.cache], n)))


def mlx_rotating(max_size: int, keep: int = 0, window_size: int | None = None,
                 step_cls: type[MlxStep] = MlxStep) -> MakeStep:
    """mlx-lm's ``RotatingKVCache(max_size, keep)`` as its models drive it.

    Per forward, as ``mlx_lm.models.base``: ``mask = cache.make_mask(T, window_size=...)``
    (before the update), ``keys, values = cache.update_and_fetch(k, v)``, then
    ``mx.fast.scaled_dot_product_attention(q, keys, values, scale, mask)``. ``window_size=None``
    is how a Llama built with ``--max-kv-size`` calls it (``RotatingKVCache(max_kv_size,
    keep=4)`` in every layer); Gemma 3's sliding layers pass their window. Check it with
    ``window=max_size - keep, sinks=keep``. It has no padding: ragged rows raise. (mlx makes
    its arrays as the keys come, in their dtype: nothing to build up front.)

    ``step.rewind(n)`` is how ``mlx_lm.generate.speculative_generate_step`` rejects drafts:
    ``trim_prompt_cache([cache], n)``, whose count of tokens trimmed the decoder ignores (it
    checks ``can_trim_prompt_cache`` once, before the first token). ``step.trimmed`` lists
    each call's ``(n, trimmed)``. ``step_cls``: an :class:`MlxStep` that rewinds otherwise.
    """
    def build(s: StepSpec) -> Step:
        from mlx_lm.models.cache import RotatingKVCache

        return step_cls(RotatingKVCache(max_size=max_size, keep=keep), window_size)

    return prebuilt(build)


def mlx_batch_rotating(max_size: int) -> MakeStep:
    """mlx-lm's ``BatchRotatingKVCache(max_size, left_padding)``: rows left-padded, each row's
    padding given when the cache is built (read from the first chunk; a row whose first chunk
    is all padding raises :class:`Unsupported`). Masks from its ``make_mask``, as above. Check
    with ``window=max_size``."""
    def build(s: StepSpec) -> Step:
        from mlx_lm.models.cache import BatchRotatingKVCache

        cache: list = []

        def step(q, k, v, positions):
            if not cache:
                real = positions >= 0
                if not bool(real.any(dim=1).all()):
                    raise Unsupported("BatchRotatingKVCache takes each row's left padding when "
                                      "it is built: a row's first chunk must hold a real token")
                pad = (~real).sum(dim=1).tolist()
                cache.append(BatchRotatingKVCache(max_size, left_padding=pad))
            return _mlx_forward(cache[0], q, k, v, max_size)

        return step

    return prebuilt(build)


# ---------------------------------------------------------------- ExecuTorch
class ExecuTorchStep:
    """ExecuTorch's ``RingKVCache`` (``executorch.examples.models.llama.attention``: 2W slots,
    each slot's position in ``cache_positions``) driven as its ``AttentionMHA.forward`` drives
    it: ``kv_cache.update(input_pos, k, v)``, then ``create_causal_mask_for_ring_buffer(start,
    T)`` over the positions the slots hold after the write, then its ``SDPA`` module.

    ``input_pos`` is one start position for the whole batch: every row in step, no padding
    (ragged rows raise). A chunk over the ring's 2W slots is refused by the cache's own
    ``assert``; the step declines it as :class:`Unsupported` (a limit by design, not a bug).
    Check it in float32, its models' dtype: its mask is always float32, and torch 2.13's fused
    CPU attention misreads a float32 mask beside float64 queries once it spans 16 keys.
    """

    def __init__(self, window: int, s: StepSpec) -> None:
        from executorch.examples.models.llama.attention import SDPA, RingKVCache

        self.cache = RingKVCache(s.batch_size, window, s.num_kv_heads, s.head_dim,
                                 enable_dynamic_shape=True, dtype=s.dtype).to(s.device)
        self.sdpa = SDPA(dim=s.num_heads * s.head_dim, head_dim=s.head_dim,
                         n_rep=s.num_heads // s.num_kv_heads, max_context_len=window)
        self.slots = self.cache.k_cache.shape[2]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        import warnings

        B, H, T, D = q.shape
        if bool((positions < 0).any()) or bool((positions != positions[:1]).any()):
            raise ValueError("ExecuTorch's RingKVCache takes one input_pos for the whole "
                             "batch (every row in step, no padding): check it with "
                             "ragged=False")
        if T > self.slots:
            raise Unsupported(f"RingKVCache.update asserts a chunk fits its {self.slots} "
                              f"slots (2W); got {T} tokens")
        input_pos = positions[0, :1]
        start = int(input_pos[0])
        with warnings.catch_warnings():  # torch._check_is_size's deprecation, per call
            warnings.simplefilter("ignore", FutureWarning)
            keys, values = self.cache.update(input_pos, k, v)
            mask = self.cache.create_causal_mask_for_ring_buffer(start, T)
        out = self.sdpa(input_pos, q, keys, values, B, T, mask)
        return out.view(B, T, H, D).transpose(1, 2)


class _CappedChunks:
    """A step fed chunks of at most ``cap`` tokens, one after another: a runner that cuts a
    long prefill into pieces (ExecuTorch PR #20346 caps the gemma4 runner's at W)."""

    def __init__(self, step: Step, cap: int) -> None:
        self.step, self.cap = step, cap

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        T = q.shape[2]
        return torch.cat([self.step(*(t[:, :, a:a + self.cap] for t in (q, k, v)),
                                    positions[:, a:a + self.cap])
                          for a in range(0, T, self.cap)], dim=2)


def executorch_ring(window: int, max_chunk: int | None = None) -> MakeStep:
    """ExecuTorch's pure-PyTorch ``RingKVCache(max_context_length=window)`` as its attention
    drives it (:class:`ExecuTorchStep`). ``max_chunk``: the runner cuts each chunk into pieces
    of at most that many tokens before the forward (``None``: fed whole, up to 2W)."""
    def build(s: StepSpec) -> Step:
        step = ExecuTorchStep(window, s)
        return step if max_chunk is None else _CappedChunks(step, max_chunk)

    return prebuilt(build)
