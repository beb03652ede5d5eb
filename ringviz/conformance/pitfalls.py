"""The book's catalogue of ring-cache bugs, each as a cache the kit can test (and must catch).

Every entry is a small, plausible cache that one shipped bug or one chapter's trap turned
wrong, built on :class:`ringviz.RingKVCache`'s storage. :data:`PITFALLS` names each with what it
does wrong, where the book (or the field) met it, and the property :func:`check` must report.

=================  ==============================================================  ==========
name               what the code does wrong                                        breaks
=================  ==============================================================  ==========
off_by_one         ring (so window) sized W-1 (ch. 5; HF #37574)                   window
no_stale_mask      spare slots (1.5 W) and a mask that only asks "filled" (ch. 5)  window
distance_rule      ``0 <= p - pos < W`` alone: empty slots (-1) visible (ch. 5)    window
chunk_first        a chunk written before it attends (ch. 6; executorch #20346)    window
trim_chunk         [ring | chunk] cut to W keys before a chunk attends (rasbt #1008)  window
temporal_mask      slots masked as if in temporal order (ch. 12; HF's stock masks)  window
padding_in_slots   padding counted as tokens: it takes slots (ch. 7; mlx-lm #439)   window
shared_ring        the rows of a batch take turns in one ring (ch. 7)              window
sinks_overwritten  sinks kept by the mask but not by the storage (mlx-lm #1631)    window
slot_rope          keys turned again, to their slot ``pos % W`` (ch. 4)            values
=================  ==============================================================  ==========
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ringviz import RingKVCache, apply_rope, band_mask
from ringviz.conformance.probe import MakeStep, Step


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention ``(B, Hq, T, D)`` under a bool mask ``(B, T, K)``; GQA; empty rows 0."""
    G = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
    scores = (q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
        ~mask[:, None], float("-inf"))
    return scores.softmax(dim=-1).nan_to_num(nan=0.0) @ values


def _lazy(build: Callable[[torch.Tensor, int, int, int], Step]) -> MakeStep:
    """A make_step whose step is built on the first call, from the inputs' dtype and device."""
    def make_step(*, batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> Step:
        made: list[Step] = []

        def step(q, k, v, positions):
            if not made:
                made.append(build(k, batch_size, num_kv_heads, head_dim))
            return made[0](q, k, v, positions)

        return step

    return make_step


def _ring(k: torch.Tensor, B: int, H: int, D: int, window: int, **kw) -> RingKVCache:
    return RingKVCache(B, H, window, D, dtype=k.dtype, device=k.device, **kw)


def off_by_one(window: int) -> MakeStep:
    """A ring of ``window - 1`` slots: the query at p loses key p - W + 1."""
    return _lazy(lambda k, B, H, D: _ring(k, B, H, D, window - 1).step)


def no_stale_mask(window: int) -> MakeStep:
    """Spare slots (1.5 W) and a mask of "filled and not future": keys older than W stay."""
    return _lazy(lambda k, B, H, D: _ring(k, B, H, D, window + window // 2).step)


def _custom_mask(window: int, rule: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 **ring_kw) -> MakeStep:
    """The correct ring's storage and data path, with ``rule(q_pos, key_pos)`` as its mask."""
    def build(k, B, H, D):
        ring = _ring(k, B, H, D, window, **ring_kw)

        def step(q, k, v, positions):
            if k.shape[2] == 1:
                ring.write(k, v, positions)
                keys, values, key_pos = ring.k, ring.v, ring.positions
            else:
                keys, values, key_pos = ring.keys_with_chunk(k, v, positions)
                ring.write(k, v, positions)
            return attend(q, keys, values, rule(positions, key_pos))

        return step

    return _lazy(build)


def distance_rule(window: int) -> MakeStep:
    """The seed's decode rule ``0 <= p - pos < W``: an empty slot (-1) is "near" early on."""
    def rule(q_pos, key_pos):
        dist = q_pos[..., :, None] - key_pos[..., None, :]
        return (dist >= 0) & (dist < window) & (q_pos[..., :, None] >= 0)

    return _custom_mask(window, rule)


def sinks_overwritten(window: int, sinks: int) -> MakeStep:
    """The mask keeps positions ``< sinks`` visible, but they live in the ring like any other
    token (``S + W`` slots, no sink slots), so later tokens overwrite them."""
    return _custom_mask(window, lambda q, key: band_mask(q, key, window, sinks),
                        capacity=window + sinks)


def trim_chunk(window: int) -> MakeStep:
    """A chunk attends over ``[ring | chunk]`` cut to its newest W keys: the chunk's early
    queries lose keys their windows still hold."""
    def build(k, B, H, D):
        ring = _ring(k, B, H, D, window)

        def step(q, k, v, positions):
            keys, values, key_pos = ring.keys_with_chunk(k, v, positions)
            ring.write(k, v, positions)
            newest = positions.max(dim=1, keepdim=True).values  # (B, 1)
            kept = torch.where(key_pos > newest - window, key_pos, -1)  # the last W only
            return attend(q, keys, values, band_mask(positions, kept, window))

        return step

    return _lazy(build)


def temporal_mask(window: int) -> MakeStep:
    """Keys ``[ring | chunk]`` masked as if the ring's slot ``j`` held position ``p0 - W + j``
    (temporal order, the chunk starting at ``p0``), as stock masks assume; slots hold
    ``pos % W``."""
    def build(k, B, H, D):
        ring = _ring(k, B, H, D, window)

        def step(q, k, v, positions):
            keys, values, _ = ring.keys_with_chunk(k, v, positions)
            ring.write(k, v, positions)
            first = positions[:, :1]  # (B, 1)
            assumed = first - window + torch.arange(window + q.shape[2], device=q.device)
            return attend(q, keys, values, band_mask(positions, assumed, window))

        return step

    return _lazy(build)


def chunk_first(window: int) -> MakeStep:
    """Write the whole chunk, then attend over the ring: a chunk overwrites keys its own early
    queries still need."""
    def build(k, B, H, D):
        ring = _ring(k, B, H, D, window)

        def step(q, k, v, positions):
            ring.write(k, v, positions)
            return ring.attend(q, positions)

        return step

    return _lazy(build)


def padding_in_slots(window: int) -> MakeStep:
    """Positions counted by column, padding included: pad tokens take slots and stay visible."""
    def build(k, B, H, D):
        ring = _ring(k, B, H, D, window)
        seen = [0]

        def step(q, k, v, positions):
            T = k.shape[2]
            cols = (seen[0] + torch.arange(T, device=k.device)).expand(positions.shape[0], T)
            seen[0] += T
            return ring.step(q, k, v, cols.contiguous())

        return step

    return _lazy(build)


def shared_ring(window: int) -> MakeStep:
    """One ring (batch size 1) serves every row in turn, its checks off as in a hot loop."""
    def build(k, B, H, D):
        ring = _ring(k, 1, H, D, window)

        def step(q, k, v, positions):
            return torch.cat([ring.step(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                        positions[b:b + 1], check=False)
                              for b in range(q.shape[0])])

        return step

    return _lazy(build)


def slot_rope(window: int) -> MakeStep:
    """Keys (already turned to ``pos``) turned by ``pos % W - pos`` more, i.e. to their slot:
    right until the first wrap, then every old key is scored at the wrong distance."""
    def build(k, B, H, D):
        ring = _ring(k, B, H, D, window)

        def step(q, k, v, positions):
            return ring.step(q, apply_rope(k, positions % window - positions), v, positions)

        return step

    return _lazy(build)


# name -> (what it does wrong, factory(window, sinks), property, batch_size, ragged, sinks)
PITFALLS: dict[str, tuple[str, Callable[[int, int], MakeStep], str, int, bool, int]] = {
    "off_by_one": ("ring (and so window) sized W-1", lambda w, s: off_by_one(w),
                   "window", 1, False, 0),
    "no_stale_mask": ("spare slots (1.5 W), mask checks 'filled' only",
                      lambda w, s: no_stale_mask(w), "window", 1, False, 0),
    "distance_rule": ("mask 0 <= p - pos < W: empty slots visible",
                      lambda w, s: distance_rule(w), "window", 1, False, 0),
    "chunk_first": ("a chunk written before it attends", lambda w, s: chunk_first(w),
                    "window", 1, False, 0),
    "trim_chunk": ("[ring | chunk] cut to W keys before a chunk attends",
                   lambda w, s: trim_chunk(w), "window", 1, False, 0),
    "temporal_mask": ("ring slots masked as if in temporal order",
                      lambda w, s: temporal_mask(w), "window", 1, False, 0),
    "padding_in_slots": ("padding counted as tokens: it takes ring slots",
                         lambda w, s: padding_in_slots(w), "window", 2, True, 0),
    "shared_ring": ("the rows of a batch take turns in one ring", lambda w, s: shared_ring(w),
                    "window", 2, False, 0),
    "sinks_overwritten": ("sinks kept by the mask, overwritten in the ring",
                          lambda w, s: sinks_overwritten(w, s), "window", 1, False, 2),
    "slot_rope": ("keys turned again, to their slot pos % W", lambda w, s: slot_rope(w),
                  "values", 1, False, 0),
}
