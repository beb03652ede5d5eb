"""Traces: the states the real caches go through for a scenario, recorded as plain data.

A trace is the one source of truth for every picture and stepper. It is produced by running the
actual caches (:class:`ringviz.RingKVCache` for scenarios, :class:`ringviz.RingKV` for the
teaching ring, :class:`ringviz.ShiftWindowKVCache` for the copying window) and *diffing* their
state before and after each step: written slots, evicted tokens and moved entries are observed,
never re-derived from ``pos % window``. Frames hold only lists, ints, floats, strings and
``None``, so a trace survives ``json.dumps`` and is what the stepper widget embeds. A frame's
caption and index arithmetic are written by :mod:`ringviz.book.captions`.

>>> t = trace_ring(window=4, tokens=6)
>>> t.frames[-1].positions, t.frames[-1].start, t.frames[-1].evicted
([[4, 5, 2, 3]], [2], [[1]])
>>> t.frames[-1].caption
'token 5 written to slot 1, evicting token 1; start -> slot 2'
>>> t.frames[-1].arithmetic
'pos 5 -> slot 5 % 4 = 1; evicts 1 = 5 - 4; start = (5 + 1) % 4 = 2'

A scenario with ``sinks=S`` runs ``RingKVCache(..., sinks=S)``: frames then hold ``S + W`` slots,
``[S sink slots | W ring slots]``, the sink slots in their own state ``"sink"``:

>>> t = trace_scenario(Scenario(window=4, prompt=9, decode_steps=1, sinks=2))
>>> t.frames[-1].positions, t.frames[-1].slot_state[0][:3]
([[0, 1, 8, 9, 6, 7]], ['sink', 'sink', 'visible'])
>>> t.frames[-1].arithmetic
'pos 9 -> slot 2 + 9 % 4 = 3; evicts 5 = 9 - 4; ring start = 2 + (9 + 1) % 4 = 4'

Taught in chapters 3 (ring indexing), 5 (masks), 6 (prefill) and 8 (sinks).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import numpy as np
import torch

from ringviz.book.captions import ring_start, spans, step_arithmetic, step_caption
from ringviz.cache import RingKVCache
from ringviz.checks import check_int
from ringviz.masks import band_mask, visible
from ringviz.reference import ShiftWindowKVCache
from ringviz.ring import RingKV
from ringviz.rope import rope_angles

MAX_TOKENS = 256  # traces are for pictures; longer runs belong in benchmarks
SLOT_STATES = ("visible", "stale", "future", "empty", "sink")


@dataclass(frozen=True)
class Scenario:
    """What to run through the batched ring: window, prompt(s), chunking, decode steps, sinks."""

    window: int = 8  # slots per ring (W)
    prompt: int = 12  # prompt tokens (one row); ignored when batch_lengths is given
    chunk: int | None = None  # prefill chunk size; None = the whole prompt in one step
    decode_steps: int = 4  # tokens generated one at a time after the prompt
    batch_lengths: tuple[int, ...] | None = None  # per-row prompt lengths (ragged batch)
    head_dim: int = 8  # for the RoPE angles recorded per slot
    theta: float = 10000.0  # RoPE base
    rope_pair: int = 0  # which (even, odd) dimension pair's angle to record
    sinks: int = 0  # attention-sink slots before the ring (S); 0 = a plain ring

    def __post_init__(self) -> None:
        if self.batch_lengths is not None:
            object.__setattr__(self, "batch_lengths", tuple(self.batch_lengths))
        check_int("window", self.window, 1)
        check_int("prompt", self.prompt, 1)
        check_int("decode_steps", self.decode_steps, 0)
        check_int("head_dim", self.head_dim, 2)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        check_int("rope_pair", self.rope_pair, 0)
        check_int("sinks", self.sinks, 0)
        if self.rope_pair >= self.head_dim // 2:
            raise ValueError(f"rope_pair must be < head_dim // 2 = {self.head_dim // 2}, "
                             f"got {self.rope_pair}")
        if self.chunk is not None:
            check_int("chunk", self.chunk, 1)
        if self.batch_lengths is not None:
            if not self.batch_lengths:
                raise ValueError("batch_lengths must name at least one row")
            for i, n in enumerate(self.batch_lengths):
                check_int(f"batch_lengths[{i}]", n, 1)
        if max(self.lengths) + self.decode_steps > MAX_TOKENS:
            raise ValueError(f"a trace holds at most {MAX_TOKENS} tokens per row, got "
                             f"{max(self.lengths)} + {self.decode_steps} decode steps")

    def to_dict(self) -> dict:
        """Plain JSON types (lists, not tuples), as stored in a trace."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @property
    def lengths(self) -> tuple[int, ...]:
        """Prompt length of each row."""
        return self.batch_lengths if self.batch_lengths is not None else (self.prompt,)


@dataclass
class Frame:
    """One state of the cache(s), per batch row, after one step (or the empty start)."""

    kind: str  # "empty" | "prefill" | "chunk" | "decode" | "push" | "shift"
    caption: str  # what happened, in words
    positions: list[list[int]]  # (rows, S + window): absolute pos in each slot, -1 = empty
    start: list[int]  # (rows,): slot of the oldest visible entry (shift: always 0; with sinks:
    # the oldest entry of the ring part, read from the stored positions; 0 while that is empty)
    written: list[list[int]]  # per row: slots whose content changed this step
    evicted: list[list[int]]  # per row: positions that left the cache this step
    moved: list[int]  # per row: surviving entries that changed slot (0 for a ring)
    queries: list[list[int]] = field(default_factory=list)  # per row: this step's query positions
    # per row: key positions attended, in the order attention reads them (the ring's slots, then
    # the chunk), empty slots left out: slot order, not sorted, as the code attends
    keys: list[list[int]] = field(default_factory=list)
    band: list[list[list[bool]]] = field(default_factory=list)  # per row: (queries, keys) mask
    slot_state: list[list[str]] = field(default_factory=list)  # per row/slot, newest query's view
    rope_abs: list[list[float | None]] = field(default_factory=list)  # angle at absolute pos
    rope_slot: list[list[float | None]] = field(default_factory=list)  # angle at slot index
    arithmetic: str = ""  # the step's index arithmetic, checked against the observed slots


@dataclass
class Trace:
    """A scenario's frames, oldest first; ``layout`` says how to read ``positions``."""

    layout: str  # "ring": slot s holds pos with pos % window == s; "shift": oldest first
    window: int
    rows: int
    scenario: dict
    frames: list[Frame]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict) -> Trace:
        frames = [Frame(**f) for f in data["frames"]]
        return cls(**{**data, "frames": frames})


def slot_states(query_pos: int, positions: np.ndarray, window: int, sinks: int = 0) -> list[str]:
    """Classify each slot for one query: visible (the window rule), else stale/future/empty.

    With ``sinks=S`` the first ``S`` slots are sink slots: ``"sink"`` once they hold a position
    the query sees (by the same rule with sinks), ``"empty"`` before.
    """
    positions = np.asarray(positions)
    seen = visible(np.asarray(query_pos), positions, window, sinks)
    return [("sink" if slot < sinks else "visible") if s else "empty" if p < 0
            else "future" if p > query_pos else "stale"
            for slot, (s, p) in enumerate(zip(seen.tolist(), positions.tolist(), strict=True))]


def _rope(positions: np.ndarray, scenario: Scenario) -> tuple[list, list]:
    """Angle (mod 2 pi) of one dimension pair per slot: at the absolute position vs slot index."""
    pos = torch.as_tensor(positions)  # (rows, window)
    slots = torch.arange(pos.shape[-1]).expand_as(pos)
    pair = scenario.rope_pair
    by_pos = rope_angles(pos.clamp(min=0), scenario.head_dim, scenario.theta)[..., pair]
    by_slot = rope_angles(slots, scenario.head_dim, scenario.theta)[..., pair]

    def keep(angles: torch.Tensor) -> list:
        wrapped = torch.remainder(angles, 2 * np.pi).tolist()
        return [[a if p >= 0 else None for a, p in zip(row, prow, strict=True)]
                for row, prow in zip(wrapped, pos.tolist(), strict=True)]

    return keep(by_pos), keep(by_slot)


def _diff(before: np.ndarray, after: np.ndarray) -> tuple[list[list[int]], list[list[int]],
                                                          list[int]]:
    """Written slots, evicted positions and moved entries per row, from two position snapshots."""
    written, evicted, moved = [], [], []
    for b_row, a_row in zip(before.tolist(), after.tolist(), strict=True):
        written.append([s for s, (x, y) in enumerate(zip(b_row, a_row, strict=True)) if x != y])
        evicted.append(sorted(set(b_row) - set(a_row) - {-1}))
        where = {p: s for s, p in enumerate(b_row) if p >= 0}
        moved.append(sum(1 for s, p in enumerate(a_row) if p in where and where[p] != s))
    return written, evicted, moved


def _ring_frame(kind: str, scenario: Scenario, before: np.ndarray, after: np.ndarray,
                start: list[int], queries: list[list[int]], attended: np.ndarray) -> Frame:
    """A frame of a ring trace; ``attended`` is what the step's queries saw (ring + chunk)."""
    window, sinks = scenario.window, scenario.sinks
    written, evicted, moved = _diff(before, after)
    keys = [[p for p in row if p >= 0] for row in attended.tolist()]  # slot order
    band = [band_mask(np.array(q, dtype=np.int64), np.array(k, dtype=np.int64), window,
                      sinks).tolist()
            for q, k in zip(queries, keys, strict=True)]
    states = [slot_states(max(row), np.array(row), window, sinks) for row in after.tolist()]
    rope_abs, rope_slot = _rope(after, scenario)
    caption = ("empty cache: every slot is free" if kind == "empty"
               else step_caption(queries, evicted, after, start, window, sinks))
    arithmetic = ("" if kind == "empty"
                  else step_arithmetic(queries, evicted, after, start, window, sinks))
    return Frame(kind=kind, caption=caption, positions=after.tolist(), start=start,
                 written=written, evicted=evicted, moved=moved, queries=queries, keys=keys,
                 band=band, slot_state=states, rope_abs=rope_abs, rope_slot=rope_slot,
                 arithmetic=arithmetic)


def _steps(scenario: Scenario) -> list[tuple[str, np.ndarray]]:
    """The (kind, positions (B, T)) of each cache step; -1 pads rows with shorter prompts."""
    lengths = np.array(scenario.lengths)  # (B,)
    longest = int(lengths.max())
    chunk = scenario.chunk or longest
    kind = "prefill" if chunk >= longest else "chunk"
    steps = []
    for first in range(0, longest, chunk):
        pos = np.arange(first, min(first + chunk, longest))[None, :]  # (1, T)
        steps.append((kind, np.where(pos < lengths[:, None], pos, -1)))  # (B, T)
    for d in range(scenario.decode_steps):
        steps.append(("decode", (lengths + d)[:, None]))  # (B, 1)
    return steps


def trace_scenario(scenario: Scenario, *, device: torch.device | str | None = None) -> Trace:
    """Run ``scenario`` through a real :class:`RingKVCache` (with its ``sinks``) and record every
    state."""
    if not isinstance(scenario, Scenario):
        raise TypeError(f"scenario must be a Scenario, got {type(scenario).__name__}")
    rows, window, dim = len(scenario.lengths), scenario.window, scenario.head_dim
    cache = RingKVCache(rows, 1, window, dim, sinks=scenario.sinks, device=device)
    gen = torch.Generator(device=cache.device).manual_seed(123)
    empty = cache.positions.cpu().numpy()

    def start() -> list[int]:
        if not scenario.sinks:
            return cache.start.tolist()
        return [ring_start(row, scenario.sinks) for row in cache.positions.tolist()]

    frames = [_ring_frame("empty", scenario, empty, empty, start(),
                          [[] for _ in range(rows)], empty)]
    for kind, pos in _steps(scenario):
        T = pos.shape[1]
        q, k, v = torch.randn(3, rows, 1, T, dim, generator=gen,
                              device=cache.device)  # each (B, num_kv_heads=1, T, head_dim)
        before = cache.positions.cpu().numpy().copy()  # (B, window)
        cache.step(q, k, v, torch.as_tensor(pos, device=cache.device))
        after = cache.positions.cpu().numpy().copy()  # (B, window)
        # decode writes first and attends over the ring; a chunk attends over [ring | chunk]
        attended = after if T == 1 else np.concatenate([before, pos], axis=1)
        queries = [[p for p in row if p >= 0] for row in pos.tolist()]
        frames.append(_ring_frame(kind, scenario, before, after, start(), queries, attended))
    return Trace(layout="ring", window=window, rows=rows, scenario=scenario.to_dict(),
                 frames=frames)


def trace_ring(window: int, tokens: int) -> Trace:
    """Push ``tokens`` tokens one by one into the teaching :class:`RingKV` and record each state."""
    check_int("tokens", tokens, 1)
    scenario = Scenario(window=window, prompt=tokens, decode_steps=0)
    head_dim = scenario.head_dim
    rng = np.random.default_rng(42)
    ring = RingKV(window, head_dim)
    empty = ring.positions[None].copy()
    frames = [_ring_frame("empty", scenario, empty, empty, [ring.start], [[]], empty)]
    for pos in range(tokens):
        before = ring.positions[None].copy()  # (1, window)
        ring.push(rng.standard_normal(head_dim), rng.standard_normal(head_dim), pos)
        after = ring.positions[None].copy()
        frames.append(_ring_frame("push", scenario, before, after, [ring.start], [[pos]], after))
    return Trace(layout="ring", window=window, rows=1, scenario=scenario.to_dict(),
                 frames=frames)


def trace_shift(window: int, tokens: int, *, mode: str = "cat",
                device: torch.device | str | None = None) -> Trace:
    """Push tokens one by one through :class:`ShiftWindowKVCache` and record what moves.

    Each key carries ``pos + 1`` in every component, so the window's contents are read back from
    the real buffer (0 = nothing there yet).
    """
    check_int("window", window, 1)
    check_int("tokens", tokens, 1)
    if tokens > MAX_TOKENS:
        raise ValueError(f"a trace holds at most {MAX_TOKENS} tokens, got {tokens}")
    cache = ShiftWindowKVCache(1, 1, window, 1, mode=mode, device=device)
    before = np.full((1, window), -1, dtype=np.int64)
    frames = [Frame(kind="empty", caption="empty window", positions=before.tolist(), start=[0],
                    written=[[]], evicted=[[]], moved=[0])]
    for pos in range(tokens):
        k = torch.full((1, 1, 1, 1), pos + 1.0, device=cache.device)  # (B, num_kv_heads, 1, 1)
        k_win, _ = cache.update(k, k.clone())  # (1, 1, n, 1), oldest first
        held = k_win[0, 0, :, 0].round().long().cpu().numpy() - 1  # (n,)
        after = np.full((1, window), -1, dtype=np.int64)
        after[0, : held.size] = held
        written, evicted, moved = _diff(before, after)
        text = f"token {pos} written at the end (slot {held.size - 1})"
        if moved[0]:
            text = (f"{moved[0]} tokens each copied one slot left, then token {pos} "
                    f"written at the end")
        if evicted[0]:
            text += f"; token {spans(evicted[0])} dropped"
        frames.append(Frame(kind="shift", caption=text, positions=after.tolist(), start=[0],
                            written=written, evicted=evicted, moved=moved, queries=[[pos]]))
        before = after
    return Trace(layout="shift", window=window, rows=1,
                 scenario={"window": window, "tokens": tokens, "mode": mode}, frames=frames)
