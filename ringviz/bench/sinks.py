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
* ``streaming_llm`` — StreamingLLM's reference scheme: unrotated keys, ``cat`` then keep
  ``[sinks | last W]``, and all ``S + W`` keys re-rotated at positions ``0 .. S+W-1`` from a
  precomputed cos/sin table (the cheapest way to re-rotate), then SDPA.
* ``sink_concat`` — a ring for the window plus a separate sink store, concatenated into
  ``[sinks | ring]`` every step (chapter 8's loop before the package had sinks): an O(W) copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ringviz.bench.cases import Shape, make_inputs
from ringviz.bench.harness import Case
from ringviz.cache import RingKVCache
from ringviz.masks import band_mask
from ringviz.rope import apply_rope, rope_angles, rotate
from ringviz.sinks import rotate_sinks

SINK_IMPLS = ("ring_sinks", "ring_sinks_absolute", "streaming_llm", "sink_concat")


def _full_sink_ring(shape: Shape, window: int, sinks: int, convention: str,
                    pre_k: torch.Tensor, pre_v: torch.Tensor):
    """A ring with ``sinks`` sinks holding positions 0 .. S+W-1, and the last position (B, 1)."""
    rope = apply_rope if convention == "cache" else None
    cache = RingKVCache(shape.batch, shape.kv_heads, window, shape.head_dim, sinks=sinks,
                        sink_rope=rope, dtype=shape.dtype, device=shape.device)
    n = sinks + window
    cache.write(pre_k, pre_v, torch.arange(n, device=shape.device).expand(shape.batch, n))
    return cache, torch.full((shape.batch, 1), n - 1, dtype=torch.int64, device=shape.device)


class StreamingLLMCache:
    """StreamingLLM's scheme: unrotated ``[sinks | recent]``, re-rotated in the cache per step."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, sinks: int, window: int) -> None:
        self.k, self.v, self.sinks, self.window = k, v, sinks, window  # (B, Hkv, S + W, D)
        angles = rope_angles(torch.arange(sinks + window, device=k.device), k.shape[-1])
        emb = torch.cat((angles, angles), dim=-1)  # (S + W, D): positions inside the cache
        self.cos, self.sin = emb.cos().to(k.dtype), emb.sin().to(k.dtype)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append, evict the oldest non-sink, return the keys rotated at 0 .. n-1 and values."""
        S = self.sinks
        self.k = torch.cat([self.k[:, :, :S], self.k[:, :, S + 1:], k], dim=2)
        self.v = torch.cat([self.v[:, :, :S], self.v[:, :, S + 1:], v], dim=2)
        return rotate(self.k, self.cos, self.sin), self.v

    def query(self, q_raw: torch.Tensor) -> torch.Tensor:
        """The unrotated query rotated at the cache's last position."""
        return rotate(q_raw, self.cos[-1], self.sin[-1])


def _steps(impl: str, shape: Shape, window: int, sinks: int, pre_k: torch.Tensor,
           pre_v: torch.Tensor, tok) -> tuple[Callable[[], object], Callable[[], torch.Tensor]]:
    """(update, decode) callables for ``impl``, each on its own cache."""
    gqa = shape.q_heads != shape.kv_heads
    if impl in ("ring_sinks", "ring_sinks_absolute"):
        convention = "cache" if impl == "ring_sinks" else "absolute"
        ring_u, pos_u = _full_sink_ring(shape, window, sinks, convention, pre_k, pre_v)
        ring_d, pos_d = _full_sink_ring(shape, window, sinks, convention, pre_k, pre_v)

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
        ref_u, ref_d = (StreamingLLMCache(pre_k, pre_v, sinks, window) for _ in range(2))

        def decode_ref() -> torch.Tensor:
            keys, values = ref_d.update(tok.k, tok.v)
            return F.scaled_dot_product_attention(ref_d.query(tok.q), keys, values,
                                                  enable_gqa=gqa)

        return (lambda: ref_u.update(tok.k, tok.v)), decode_ref
    if impl == "sink_concat":
        def concat_cache():
            ring = RingKVCache(shape.batch, shape.kv_heads, window, shape.head_dim,
                               dtype=shape.dtype, device=shape.device)
            n = sinks + window
            ring.write(pre_k[:, :, sinks:], pre_v[:, :, sinks:],
                       torch.arange(sinks, n, device=shape.device).expand(shape.batch, window))
            sink_pos = torch.arange(sinks, device=shape.device).expand(shape.batch, sinks)
            pos = torch.full((shape.batch, 1), n - 1, dtype=torch.int64, device=shape.device)
            return ring, pre_k[:, :, :sinks].clone(), pre_v[:, :, :sinks].clone(), sink_pos, pos

        ring_u, sk_u, sv_u, _, pos_u = concat_cache()
        ring_d, sk_d, sv_d, sp_d, pos_d = concat_cache()

        def update_cat() -> object:
            pos_u.add_(1)
            ring_u.write(tok.k, tok.v, pos_u)
            return torch.cat([sk_u, ring_u.k], dim=2), torch.cat([sv_u, ring_u.v], dim=2)

        def decode_cat() -> torch.Tensor:
            pos_d.add_(1)
            ring_d.write(tok.k, tok.v, pos_d)
            keys = torch.cat([sk_d, ring_d.k], dim=2)  # (B, Hkv, S + W, D): copies all W
            values = torch.cat([sv_d, ring_d.v], dim=2)
            mask = band_mask(pos_d, torch.cat([sp_d, ring_d.positions], dim=1), window, sinks)
            return F.scaled_dot_product_attention(tok.q, keys, values, attn_mask=mask[:, None],
                                                  enable_gqa=gqa)

        return update_cat, decode_cat
    raise ValueError(f"unknown sinks impl {impl!r}; expected one of {SINK_IMPLS}")


def build_sink_cases(shape: Shape, window: int, sinks: int,
                     seed: int = 123) -> dict[str, list[Case]]:
    """``{"sinks_update": [...], "sinks_decode": [...]}``: every impl from one set of inputs."""
    pre, tok = make_inputs(shape, sinks + window, seed)  # S + W prefill tokens
    cases: dict[str, list[Case]] = {"sinks_update": [], "sinks_decode": []}
    for impl in SINK_IMPLS:
        update, decode = _steps(impl, shape, window, sinks, pre.k, pre.v, tok)
        cases["sinks_update"].append(Case(impl, window, update))
        cases["sinks_decode"].append(Case(impl, window, decode))
    return cases
