"""The book's catalogue of ring-cache bugs, each as a cache the kit can test (and must catch).

Every entry is a small, plausible cache that one shipped bug or one chapter's trap turned
wrong, built on :class:`ringviz.RingKVCache`'s storage; its docstring says where the book (or
the field) met it. :data:`PITFALLS` names each with what it does wrong and the property
:func:`check` must report (``python -m ringviz conform --list`` prints them).

Each is a ring factory: ``factory(window)`` is a make_step (the seam,
:data:`ringviz.cache.MakeStep`), so the kit checks it and ``RingRunner(model, ..., ring=factory)``
or ``ringviz.hf.generate(model, ..., ring=factory)`` runs it inside a real model. The RoPE
pitfalls of chapter 4 (:func:`slot_rope`, :func:`double_rope`, :func:`one_base`,
:func:`batch_counter`) take the rotation ``rope`` (``f(x, positions)``):
:func:`ringviz.apply_rope` for the kit's keys, the model's own
(:func:`ringviz.hf.rotary.model_sink_rope`) on a real model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from ringviz import apply_rope, band_mask
from ringviz.cache import MakeStep, Step
from ringviz.conformance.seam import StepSpec, prebuilt
from ringviz.rope import Rope


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention ``(B, Hq, T, D)`` under a bool mask ``(B, T, K)``, in ``q``'s dtype:
    head ``h`` reads KV head ``h // G`` (grouped-query), a query that sees nothing outputs 0.
    In float64, the kit's reference (:mod:`~ringviz.conformance.probe`)."""
    G = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
    scores = (q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
        ~mask[:, None], float("-inf"))
    return scores.softmax(dim=-1).nan_to_num(nan=0.0) @ values


def _on_ring(window: int, step: Callable[..., torch.Tensor], **ring_kw) -> MakeStep:
    """A make_step whose step is ``step(ring, q, k, v, positions)`` on a fresh ring."""
    return prebuilt(lambda s: partial(step, s.ring(window, **ring_kw)))


def off_by_one(window: int) -> MakeStep:
    """A ring of ``window - 1`` slots: the query at p loses key p - W + 1 (chapter 5;
    transformers #37574)."""
    return prebuilt(lambda s: s.ring(window - 1).step)


def no_stale_mask(window: int) -> MakeStep:
    """Spare slots (1.5 W) and a mask of "filled and not future": keys older than W stay
    (chapter 5)."""
    return prebuilt(lambda s: s.ring(window + window // 2).step)


def _custom_mask(window: int, rule: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 **ring_kw) -> MakeStep:
    """The correct ring's storage and data path, with ``rule(q_pos, key_pos)`` as its mask."""
    def step(ring, q, k, v, positions):
        if k.shape[2] == 1:
            ring.write(k, v, positions)
            keys, values, key_pos = ring.k, ring.v, ring.positions
        else:
            keys, values, key_pos = ring.keys_with_chunk(k, v, positions)
            ring.write(k, v, positions)
        return attend(q, keys, values, rule(positions, key_pos))

    return _on_ring(window, step, **ring_kw)


def distance_rule(window: int) -> MakeStep:
    """The seed's decode rule ``0 <= p - pos < W``: an empty slot (-1) is "near" early on
    (chapter 5)."""
    def rule(q_pos, key_pos):
        dist = q_pos[..., :, None] - key_pos[..., None, :]
        return (dist >= 0) & (dist < window) & (q_pos[..., :, None] >= 0)

    return _custom_mask(window, rule)


def sinks_overwritten(window: int, sinks: int) -> MakeStep:
    """The mask keeps positions ``< sinks`` visible, but they live in the ring like any other
    token (``S + W`` slots, no sink slots), so later tokens overwrite them (mlx-lm #1631)."""
    return _custom_mask(window, lambda q, key: band_mask(q, key, window, sinks),
                        capacity=window + sinks)


def trim_chunk(window: int) -> MakeStep:
    """A chunk attends over ``[ring | chunk]`` cut to its newest W keys: the chunk's early
    queries lose keys their windows still hold (LLMs-from-scratch #1008)."""
    def step(ring, q, k, v, positions):
        keys, values, key_pos = ring.keys_with_chunk(k, v, positions)
        ring.write(k, v, positions)
        newest = positions.max(dim=1, keepdim=True).values  # (B, 1)
        kept = torch.where(key_pos > newest - window, key_pos, -1)  # the last W only
        return attend(q, keys, values, band_mask(positions, kept, window))

    return _on_ring(window, step)


def temporal_mask(window: int) -> MakeStep:
    """Keys ``[ring | chunk]`` masked as if the ring's slot ``j`` held position ``p0 - W + j``
    (temporal order, the chunk starting at ``p0``), as stock masks (transformers') assume;
    slots hold ``pos % W`` (chapter 12)."""
    def step(ring, q, k, v, positions):
        keys, values, _ = ring.keys_with_chunk(k, v, positions)
        ring.write(k, v, positions)
        first = positions[:, :1]  # (B, 1)
        assumed = first - window + torch.arange(window + q.shape[2], device=q.device)
        return attend(q, keys, values, band_mask(positions, assumed, window))

    return _on_ring(window, step)


def chunk_first(window: int) -> MakeStep:
    """Write the whole chunk, then attend over the ring: a chunk overwrites keys its own early
    queries still need (chapter 6; executorch #20346)."""
    def step(ring, q, k, v, positions):
        ring.write(k, v, positions)
        return ring.attend(q, positions)

    return _on_ring(window, step)


def padding_in_slots(window: int) -> MakeStep:
    """Positions counted by column, padding included: pad tokens take slots and stay visible
    (chapter 7; mlx-lm #439)."""
    def build(s: StepSpec) -> Step:
        ring = s.ring(window)
        seen = [0]

        def step(q, k, v, positions):
            T = k.shape[2]
            cols = (seen[0] + torch.arange(T, device=k.device)).expand(positions.shape[0], T)
            seen[0] += T
            return ring.step(q, k, v, cols.contiguous())

        return step

    return prebuilt(build)


def shared_ring(window: int) -> MakeStep:
    """One ring (batch size 1) serves every row in turn, its checks off as in a hot loop
    (chapter 7)."""
    def build(s: StepSpec) -> Step:
        ring = replace(s, batch_size=1).ring(window)

        def step(q, k, v, positions):
            return torch.cat([ring.step(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                        positions[b:b + 1], check=False)
                              for b in range(q.shape[0])])

        return step

    return prebuilt(build)


def _turned(window: int, turn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                           tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
            ) -> MakeStep:
    """The correct ring fed ``turn(q, k, positions) -> (q, k, positions)``: RoPE gone wrong."""
    def step(ring, q, k, v, positions):
        q, k, positions = turn(q, k, positions)
        return ring.step(q, k, v, positions)

    return _on_ring(window, step)


def slot_rope(window: int, rope: Rope = apply_rope) -> MakeStep:
    """Keys (already turned to ``pos``) turned by ``pos % W - pos`` more, i.e. to their
    slot: right until the first wrap, then every old key is scored at the wrong distance."""
    return _turned(window, lambda q, k, pos: (q, rope(k, pos % window - pos), pos))


def double_rope(window: int, rope: Rope = apply_rope) -> MakeStep:
    """Keys the model already turned to ``pos`` turned by ``pos`` again (a cache that "adds"
    RoPE): ``R(2 pos)``, right at position 0 only."""
    return _turned(window, lambda q, k, pos: (q, rope(k, pos), pos))


def one_base(window: int, own: Rope = apply_rope,
             other: Rope = lambda x, pos: apply_rope(x, pos, theta=1e6)) -> MakeStep:
    """Queries and keys turned from the layer's own RoPE base to another (Gemma 3's global
    base on its local layers, as if the model had one): right at position 0 only."""
    def turn(q, k, pos):
        return other(own(q, -pos), pos), other(own(k, -pos), pos), pos

    return _turned(window, turn)


def batch_counter(window: int, rope: Rope = apply_rope) -> MakeStep:
    """One position counter for the batch: after a left-padded prefill with per-row positions,
    every row's decode token takes the padded width (+1 per step), so a row with ``p`` padding
    tokens sits ``p`` positions too far: turned, stored and masked there."""
    def build(s: StepSpec) -> Step:
        ring, columns = s.ring(window), [0]

        def step(q, k, v, pos):
            T, counted = pos.shape[1], columns[0]
            columns[0] += T
            if T == 1 and counted:  # a decode step: every row at the batch's counter
                shared = torch.full_like(pos, counted)  # (B, 1)
                q, k, pos = rope(q, shared - pos), rope(k, shared - pos), shared
            return ring.step(q, k, v, pos)  # a prefill chunk keeps its per-row positions

        return step

    return prebuilt(build)


@dataclass(frozen=True)
class Pitfall:
    """One buggy cache of the catalogue: what it does wrong, the property the kit must report,
    and the batch it needs for the bug to show (two rows to share a ring, ragged ones to pad)."""

    what: str
    factory: Callable[..., MakeStep]  # factory(window), or factory(window, sinks) if sinks
    breaks: str
    batch_size: int = 1
    ragged: bool = False
    sinks: int = 0

    def build(self, window: int, sinks: int | None = None) -> MakeStep:
        """The buggy cache's ``make_step`` for ``window`` (and its sinks, if it keeps any)."""
        if not self.sinks:
            return self.factory(window)
        return self.factory(window, self.sinks if sinks is None else sinks)


PITFALLS: dict[str, Pitfall] = {
    "off_by_one": Pitfall("ring (and so window) sized W-1", off_by_one, "window"),
    "no_stale_mask": Pitfall("spare slots (1.5 W), mask checks 'filled' only", no_stale_mask,
                             "window"),
    "distance_rule": Pitfall("mask 0 <= p - pos < W: empty slots visible", distance_rule,
                             "window"),
    "chunk_first": Pitfall("a chunk written before it attends", chunk_first, "window"),
    "trim_chunk": Pitfall("[ring | chunk] cut to W keys before a chunk attends", trim_chunk,
                          "window"),
    "temporal_mask": Pitfall("ring slots masked as if in temporal order", temporal_mask,
                             "window"),
    "padding_in_slots": Pitfall("padding counted as tokens: it takes ring slots",
                                padding_in_slots, "window", batch_size=2, ragged=True),
    "shared_ring": Pitfall("the rows of a batch take turns in one ring", shared_ring, "window",
                           batch_size=2),
    "sinks_overwritten": Pitfall("sinks kept by the mask, overwritten in the ring",
                                 sinks_overwritten, "window", sinks=2),
    "slot_rope": Pitfall("keys turned again, to their slot pos % W", slot_rope, "values"),
    "double_rope": Pitfall("keys the model already turned, turned again by pos", double_rope,
                           "values"),
    "one_base": Pitfall("local layers turned with the global RoPE base", one_base, "values"),
    "batch_counter": Pitfall("one decode position for a left-padded batch", batch_counter,
                             "window", batch_size=2, ragged=True),
}
