"""Attention sinks, timed: the ring with sinks against StreamingLLM's re-rotation and a concat.

Every cache holds ``S`` sinks and a full window of ``W`` and takes the same new token per call.
Two benches (``bench`` field):

* ``sinks_update``: everything a decode step does besides attention over the keys: the write,
  plus whatever makes the keys ready to attend.
* ``sinks_decode``: that plus the query's attention over the ``S + W`` keys.

Impls (``impl`` field), all in StreamingLLM's convention (sinks scored from cache position
``min(p, S + W - 1)``) except ``ring_sinks_absolute``:

* ``ring_sinks`` — :class:`ringviz.RingKVCache` with ``sinks=S, sink_rope=apply_rope``: one slot
  written, the ``S`` sink keys turned by ``p - c`` (:func:`ringviz.sinks.rotate_sinks`).
* ``ring_sinks_absolute`` — the same cache with ``sink_rope=None``: no rotation at all.
* ``streaming_llm`` — StreamingLLM's reference scheme
  (:class:`ringviz.reference.StreamingLLMCache`): unrotated keys, ``cat`` keeping
  ``[sinks | last W]``, and all ``S + W`` keys re-rotated at positions ``0 .. S+W-1`` from a
  precomputed cos/sin table (the cheapest way to re-rotate), then SDPA.
* ``sink_concat`` — a ring for the window plus a separate sink store, concatenated into
  ``[sinks | ring]`` every step: an O(W) copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ringviz.bench.cases import Prefill, Shape, Token, _full_ring, make_inputs
from ringviz.bench.harness import Case
from ringviz.masks import band_mask
from ringviz.reference import StreamingLLMCache
from ringviz.rope import Rope, apply_rope, rope_angles, rotate
from ringviz.sinks import rotate_sinks

SINK_IMPLS = ("ring_sinks", "ring_sinks_absolute", "streaming_llm", "sink_concat")


def _table_rope(n: int, head_dim: int, dtype: torch.dtype, device) -> Rope:
    """StreamingLLM's rotation from a cos/sin table of the ``n`` cache positions, built once.

    The reference rotates every row at the same cache positions, so one row's lookup serves the
    batch: the cheapest way to re-rotate ``S + W`` keys per step.
    """
    emb = torch.cat([rope_angles(torch.arange(n, device=device), head_dim)] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # (n, D)

    def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rotate(x, cos[positions[0]], sin[positions[0]])

    return rope


def streaming_llm_cache(pre_k: torch.Tensor, pre_v: torch.Tensor, sinks: int,
                        window: int) -> StreamingLLMCache:
    """:class:`ringviz.reference.StreamingLLMCache` holding the ``S + W`` unrotated prefill keys."""
    rope = _table_rope(sinks + window, pre_k.shape[-1], pre_k.dtype, pre_k.device)
    cache = StreamingLLMCache(sinks, window, rope)
    cache.update(pre_k, pre_v)
    return cache


def _steps(impl: str, shape: Shape, window: int, sinks: int, pre: Prefill,
           tok: Token) -> tuple[Callable[[], object], Callable[[], torch.Tensor]]:
    """(update, decode) callables for ``impl``, each on its own cache."""
    gqa = shape.q_heads != shape.kv_heads
    if impl in ("ring_sinks", "ring_sinks_absolute"):
        rope = apply_rope if impl == "ring_sinks" else None
        ring_u, pos_u = _full_ring(shape, window, pre, sinks=sinks, sink_rope=rope)
        ring_d, pos_d = _full_ring(shape, window, pre, sinks=sinks, sink_rope=rope)

        def update() -> object:
            pos_u.add_(1)
            ring_u.write(tok.k, tok.v, pos_u)
            if ring_u.sink_rope is not None:
                return rotate_sinks(ring_u.k[:, :, :sinks], pos_u, window, ring_u.sink_rope)
            return None

        def decode() -> torch.Tensor:
            pos_d.add_(1)
            return ring_d.step(tok.q, tok.k, tok.v, pos_d)

        return update, decode
    if impl == "streaming_llm":
        ref_u, ref_d = (streaming_llm_cache(pre.k, pre.v, sinks, window) for _ in range(2))

        def decode_ref() -> torch.Tensor:
            keys, values = ref_d.update(tok.k, tok.v)
            return F.scaled_dot_product_attention(ref_d.query(tok.q), keys, values,
                                                  enable_gqa=gqa)

        return (lambda: ref_u.update(tok.k, tok.v)), decode_ref
    if impl == "sink_concat":
        window_pre = Prefill(pre.k[:, :, sinks:], pre.v[:, :, sinks:])
        ring_u, pos_u = _full_ring(shape, window, window_pre, first=sinks)
        ring_d, pos_d = _full_ring(shape, window, window_pre, first=sinks)
        sink_k, sink_v = pre.k[:, :, :sinks].clone(), pre.v[:, :, :sinks].clone()
        sink_pos = torch.arange(sinks, device=shape.device).expand(shape.batch, sinks)

        def update_cat() -> object:
            pos_u.add_(1)
            ring_u.write(tok.k, tok.v, pos_u)
            return torch.cat([sink_k, ring_u.k], dim=2), torch.cat([sink_v, ring_u.v], dim=2)

        def decode_cat() -> torch.Tensor:
            pos_d.add_(1)
            ring_d.write(tok.k, tok.v, pos_d)
            keys = torch.cat([sink_k, ring_d.k], dim=2)  # (B, Hkv, S + W, D): copies all W
            values = torch.cat([sink_v, ring_d.v], dim=2)
            mask = band_mask(pos_d, torch.cat([sink_pos, ring_d.positions], dim=1), window, sinks)
            return F.scaled_dot_product_attention(tok.q, keys, values, attn_mask=mask[:, None],
                                                  enable_gqa=gqa)

        return update_cat, decode_cat
    raise ValueError(f"unknown sinks impl {impl!r}; expected one of {SINK_IMPLS}")


def build_sink_cases(shape: Shape, window: int, sinks: int) -> dict[str, list[Case]]:
    """``{"sinks_update": [...], "sinks_decode": [...]}``: every impl from one set of inputs."""
    pre, tok = make_inputs(shape, sinks + window)  # S + W prefill tokens
    cases: dict[str, list[Case]] = {"sinks_update": [], "sinks_decode": []}
    for impl in SINK_IMPLS:
        update, decode = _steps(impl, shape, window, sinks, pre, tok)
        cases["sinks_update"].append(Case(impl, window, update))
        cases["sinks_decode"].append(Case(impl, window, decode))
    return cases
