"""The implementations under test, each brought to a full window and wrapped as one decode call.

Every cache starts from the same prefill (the same ``window`` random keys and values) and then
takes the same new token each call, so all of them do the same logical work: one token in, the
oldest out. The ring's call also advances its position tensor in place (work any decode loop
does, charged to the ring alone). Hugging Face's layers are used exactly as a model's attention
calls them: ``layer.update(key_states, value_states)`` once per step.

Impl names (the ``impl`` field of a benchmark row):

* ``ring`` — :meth:`ringviz.RingKVCache.write` (update) or :meth:`~ringviz.RingKVCache.step`
  (decode_step): one slot written, the storage never moves.
* ``naive_cat`` / ``naive_roll`` — :class:`ringviz.reference.ShiftWindowKVCache`: O(window) copy.
* ``hf_dynamic`` / ``hf_static`` — transformers' ``DynamicSlidingWindowLayer`` and
  ``StaticSlidingWindowLayer`` (cat + slice; roll + index assign + ``copy_``).
* ``attention_only`` — SDPA of the query over the ring's ``window`` keys with no cache write and
  no mask (every key is visible once the window is full): the attention every layout must do.
  Not a strict lower bound of a measured time: a ring step can come out a little under it, by
  noise between repetitions (see each row's p10/p90).
* ``slot_copies`` (decode_step) — the ring's storage written as no step can undercut in eager
  PyTorch: four strided copies at a slot known in advance (k, v, the position, the row's
  newest), then the same SDPA, with no validation and no bookkeeping. The eager floor of a
  ring step (what is left above it is Python and checks); fusing those copies into the
  attention (a CUDA graph, a compiled step) is the only way under it.
* ``mlx_rotating`` (decode_step, CPU, where mlx-lm is installed) — a peer:
  :mod:`ringviz.bench.mlx_peer`, mlx-lm's ``RotatingKVCache`` step on MLX's own CPU kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ringviz.bench import mlx_peer
from ringviz.bench.harness import Case
from ringviz.cache import RingKVCache
from ringviz.reference import ShiftWindowKVCache

UPDATE_IMPLS = ("ring", "naive_cat", "naive_roll", "hf_dynamic", "hf_static")
DECODE_IMPLS = ("ring", "ring_trusted", "attention_only", "slot_copies", "naive_cat")


@dataclass(frozen=True)
class Shape:
    """Tensor geometry shared by every impl in one comparison."""

    batch: int  # B
    kv_heads: int  # num_kv_heads
    q_heads: int  # Hq, a multiple of kv_heads (GQA)
    head_dim: int  # D
    dtype: torch.dtype
    device: torch.device

    def fields(self) -> dict:
        """The row fields that describe this geometry."""
        return {"batch": self.batch, "kv_heads": self.kv_heads, "q_heads": self.q_heads,
                "head_dim": self.head_dim, "dtype": str(self.dtype).removeprefix("torch."),
                "device": self.device.type}


@dataclass(frozen=True)
class Prefill:
    """The window of keys and values every cache starts from (dropped once the caches are full)."""

    k: torch.Tensor  # (B, num_kv_heads, window, head_dim)
    v: torch.Tensor  # (B, num_kv_heads, window, head_dim)


@dataclass(frozen=True)
class Token:
    """The new token every decode call feeds in (the same one each call)."""

    k: torch.Tensor  # (B, num_kv_heads, 1, head_dim)
    v: torch.Tensor  # (B, num_kv_heads, 1, head_dim)
    q: torch.Tensor  # (B, Hq, 1, head_dim)


def make_inputs(shape: Shape, window: int) -> tuple[Prefill, Token]:
    """Seeded random prefill of ``window`` tokens and decode token, created on ``shape.device``."""
    gen = torch.Generator(device=shape.device).manual_seed(123)
    B, H, D = shape.batch, shape.kv_heads, shape.head_dim

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, dtype=shape.dtype, device=shape.device)

    prefill = Prefill(k=randn(B, H, window, D), v=randn(B, H, window, D))
    return prefill, Token(k=randn(B, H, 1, D), v=randn(B, H, 1, D), q=randn(B, shape.q_heads, 1, D))


def _full_ring(shape: Shape, window: int, pre: Prefill, first: int = 0,
               **ring_kwargs) -> tuple[RingKVCache, torch.Tensor]:
    """A ring (``RingKVCache(..., **ring_kwargs)``) holding ``pre``'s tokens at positions
    ``first, first + 1, ...``, and the (B, 1) position tensor of the last of them."""
    cache = RingKVCache(shape.batch, shape.kv_heads, window, shape.head_dim,
                        dtype=shape.dtype, device=shape.device, **ring_kwargs)
    n = pre.k.shape[2]
    prefill_pos = torch.arange(first, first + n, device=shape.device).expand(shape.batch, n)
    cache.write(pre.k, pre.v, prefill_pos)
    pos = torch.full((shape.batch, 1), first + n - 1, dtype=torch.int64, device=shape.device)
    return cache, pos


def _full_shift(shape: Shape, window: int, pre: Prefill, mode: str) -> ShiftWindowKVCache:
    cache = ShiftWindowKVCache(shape.batch, shape.kv_heads, window, shape.head_dim, mode=mode,
                               dtype=shape.dtype, device=shape.device)
    cache.update(pre.k, pre.v)
    return cache


def _full_hf_layer(kind: str, window: int, pre: Prefill):
    """A transformers sliding layer after a ``window``-token prefill (its steady state)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

    if kind == "hf_dynamic":
        layer = DynamicSlidingWindowLayer(sliding_window=window)
    else:
        layer = StaticSlidingWindowLayer(max_cache_len=window, sliding_window=window)
    layer.update(pre.k, pre.v)
    return layer


def update_step(impl: str, shape: Shape, window: int, pre: Prefill,
                tok: Token) -> Callable[[], object]:
    """One decode step's cache write for ``impl``, on a cache already holding a full
    window."""
    if impl == "ring":
        ring, pos = _full_ring(shape, window, pre)

        def step() -> None:
            pos.add_(1)
            ring.write(tok.k, tok.v, pos)

        return step
    if impl in ("naive_cat", "naive_roll"):
        shift = _full_shift(shape, window, pre, impl.removeprefix("naive_"))
        return lambda: shift.update(tok.k, tok.v)
    if impl in ("hf_dynamic", "hf_static"):
        layer = _full_hf_layer(impl, window, pre)
        return lambda: layer.update(tok.k, tok.v)
    raise ValueError(f"unknown update impl {impl!r}; expected one of {UPDATE_IMPLS}")


def decode_step(impl: str, shape: Shape, window: int, pre: Prefill,
                tok: Token) -> Callable[[], torch.Tensor]:
    """Write one token and attend one query over the window; returns (B, Hq, 1, head_dim)."""
    gqa = shape.q_heads != shape.kv_heads
    if impl == "ring":
        ring, pos = _full_ring(shape, window, pre)

        def step() -> torch.Tensor:
            pos.add_(1)
            return ring.step(tok.q, tok.k, tok.v, pos)

        return step
    if impl == "ring_trusted":  # the loop a CUDA graph replays: check=False after validated ones
        ring, pos = _full_ring(shape, window, pre)

        def step() -> torch.Tensor:
            pos.add_(1)
            return ring.step(tok.q, tok.k, tok.v, pos, check=False, contiguous=True)

        return step
    if impl == "attention_only":
        ring, _ = _full_ring(shape, window, pre)
        return lambda: F.scaled_dot_product_attention(tok.q, ring.k, ring.v, enable_gqa=gqa)
    if impl == "slot_copies":
        ring, pos = _full_ring(shape, window, pre)
        slot = [window - 1]

        def step() -> torch.Tensor:
            pos.add_(1)
            s = slot[0] = (slot[0] + 1) % window
            ring._k_store.narrow(2, s, 1).copy_(tok.k)
            ring._v_store.narrow(2, s, 1).copy_(tok.v)
            ring._pos_store.narrow(1, s, 1).copy_(pos)
            ring._last_col.copy_(pos)
            return F.scaled_dot_product_attention(tok.q, ring.k, ring.v, enable_gqa=gqa)

        return step
    if impl == "naive_cat":
        shift = _full_shift(shape, window, pre, "cat")

        def step() -> torch.Tensor:
            k_win, v_win = shift.update(tok.k, tok.v)  # (B, num_kv_heads, window, head_dim)
            return F.scaled_dot_product_attention(tok.q, k_win, v_win, enable_gqa=gqa)

        return step
    raise ValueError(f"unknown decode_step impl {impl!r}; expected one of {DECODE_IMPLS}")


WARMUP_STEPS = 3  # eager decode steps before a CUDA-graph capture (they advance the ring)


def capture_ring_step(ring: RingKVCache, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``pos += 1; out = ring.step(q, k, v, pos)`` captured in a CUDA graph: (graph, out).

    Capture is possible because the ring's storage never moves and ``check=False`` skips the
    validation's host syncs; every step is each row's next position (``contiguous=True``), so a
    full ring's graph records the unmasked step, with no mask kernels, and replays stay right
    for as long as they advance ``pos`` by one. :data:`WARMUP_STEPS` real steps run first on a
    side stream, as capture requires; capturing runs nothing. Each ``graph.replay()`` is then
    the next decode step: it reads ``q``, ``k``, ``v`` where they are (copy a new token into
    them first) and writes its attention output into ``out``.
    """
    device = ring.device
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a cuda device, got {device}")
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            pos.add_(1)
            ring.step(q, k, v, pos, check=False, contiguous=True)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pos.add_(1)
        out = ring.step(q, k, v, pos, check=False, contiguous=True)
    return graph, out


def ring_graph_step(shape: Shape, window: int, pre: Prefill,
                    tok: Token) -> Callable[[], object]:
    """The ring decode step captured once in a CUDA graph (:func:`capture_ring_step`); each
    call replays it, the next decode step of the same token."""
    ring, pos = _full_ring(shape, window, pre)
    graph, _ = capture_ring_step(ring, pos, tok.q, tok.k, tok.v)
    return graph.replay


def build_cases(kind: str, impls: tuple[str, ...], shape: Shape, window: int, *,
                peer: bool = False) -> list[Case]:
    """Cases for ``kind`` in ("update", "decode_step"), all from one shared set of inputs;
    ``peer=True`` adds the mlx-lm row to decode_step where it can run.

    The prefill tensors are dropped on return; the cases keep only their caches and the token.
    """
    make = {"update": update_step, "decode_step": decode_step}.get(kind)
    if make is None:
        raise ValueError(f"kind must be 'update' or 'decode_step', got {kind!r}")
    pre, tok = make_inputs(shape, window)
    cases = [Case(impl, window, make(impl, shape, window, pre, tok)) for impl in impls]
    if kind == "decode_step" and shape.device.type == "cuda":
        cases.append(Case("ring_cuda_graph", window, ring_graph_step(shape, window, pre, tok)))
    if kind == "decode_step" and peer and mlx_peer.skip_reason(shape.device.type) is None:
        steps = mlx_peer.decode_steps(pre.k, pre.v, tok.k, tok.v, tok.q, window)
        cases += [Case(impl, window, step) for impl, step in steps.items()]
    return cases
