"""Attention sinks: StreamingLLM's first ``S`` tokens kept beside the ring, and their RoPE maths.

With ``RingKVCache(sinks=S)`` positions ``0 .. S-1`` live in ``S`` slots before the ring and are
never overwritten; a query at ``p`` sees ``0 .. S-1`` and ``p-W+1 .. p``. Keys arrive rotated at
their absolute positions and stay so. Two RoPE conventions for the sinks:

* ``sink_rope=None``: every key keeps its absolute rotation, so a query at ``p`` sees sink ``j``
  at distance ``p - j``, which grows without bound (mlx-lm's ``RotatingKVCache(keep=S)``).
* ``sink_rope=f`` (``f(x, positions)`` rotates like :func:`ringviz.apply_rope`): StreamingLLM's
  positions inside the cache. StreamingLLM re-rotates ``[sinks | window]`` at ``0 .. n-1`` every
  step; a window key's distance to the query is then the same as with absolute positions, and
  only a sink ``j`` differs: it is scored as if the query sat at ``c = min(p, S + W - 1)``. Since
  ``<R(p) q, R(p - c) R(j) k> = <R(c) q, R(j) k>``, rotating just the ``S`` sink keys by
  ``p - c`` (:func:`sink_shift`) gives StreamingLLM's scores exactly: ``O(S)`` work per query,
  the window never re-rotated, the stored sinks never changed.

``sink_rope`` reproduces StreamingLLM for rows whose positions run ``0, 1, 2, ...``; for other
rows it applies the same rule, ``c = min(p, S + W - 1)``, to their absolute positions.

>>> sink_shift(torch.tensor([[3, 5, 6, 20]]), sinks=2, window=4)  # rotation of the sink keys
tensor([[ 0,  0,  1, 15]])

Two sinks beside the same ring: positions 0 and 1 stay in slots 0 and 1 for good, the ring
after them holds the last four positions in slots ``2 + pos % 4``:

>>> from ringviz import RingKVCache, apply_rope
>>> cache = RingKVCache(1, 1, window=4, head_dim=2, sinks=2, sink_rope=apply_rope)
>>> x = torch.zeros(1, 1, 9, 2)
>>> _ = cache.step(x, x, x, torch.arange(9)[None])
>>> cache.positions
tensor([[0, 1, 8, 5, 6, 7]])
"""

from __future__ import annotations

import torch

from ringviz.rope import Rope


def sink_shift(q_positions: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """How far StreamingLLM's convention moves a sink for each query:
    ``p - min(p, S + W - 1)``.

    StreamingLLM places the query at cache position ``c = min(p, S + W - 1)``; rotating a
    sink key by ``p - c`` makes an absolutely rotated query score it as from ``c``.
    Padding (-1) gets 0.
    """
    return (q_positions - (sinks + window - 1)).clamp(min=0)


def rotate_sinks(sink_k: torch.Tensor, q_positions: torch.Tensor, window: int,
                 rope: Rope) -> torch.Tensor:
    """Sink keys ``(B, Hkv, S, D)`` turned by each query's sink_shift:
    ``(B, Hkv, T, S, D)``.

    ``S`` keys per query, whatever the window: the O(S) cost of StreamingLLM's convention.
    """
    B, H, S, D = sink_k.shape
    T = q_positions.shape[1]
    shift = sink_shift(q_positions, S, window)  # (B, T)
    x = sink_k[:, :, None].expand(B, H, T, S, D).reshape(B, H, T * S, D)
    return rope(x, shift[:, :, None].expand(B, T, S).reshape(B, T * S)).view(B, H, T, S, D)


def sinks_with_chunk(store: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                     sinks: int) -> torch.Tensor:
    """The ``S`` sink slots of ``store`` (B, Hkv, >= S + 1, D) as they will be once the chunk
    ``x`` (B, Hkv, T, D) at ``positions`` (B, T) is stored: ``(B, Hkv, S, D)``.

    A copy of ``S + 1`` slots (slot ``S`` a scratch for the chunk's other tokens), so the chunk's
    queries score every sink alike while nothing is written before attention.
    """
    B, H, T, D = x.shape
    slot = torch.where((positions >= 0) & (positions < sinks), positions, sinks)
    index = slot[:, None, :, None].expand(B, H, T, D)
    return store[:, :, :sinks + 1].clone().scatter_(2, index, x)[:, :, :sinks]
