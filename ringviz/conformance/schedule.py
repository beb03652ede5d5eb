"""Schedules: how a sequence is cut into the chunks a cache is fed, and where its rows start.

A :class:`Schedule` is a list of chunk sizes (1 = a decode step) plus, for a ragged batch, each
row's start column: row ``b`` is left-padded with ``offsets[b]`` padding tokens (position -1),
then counts positions 0, 1, 2, ... . Every row takes the same chunk sizes, as a batched
``generate`` feeds a left-padded batch.

:func:`schedules` is the hypothesis strategy the kit draws from; hypothesis shrinks a failing
schedule towards fewer, smaller chunks and smaller offsets.

>>> s = Schedule(chunks=(3, 1), offsets=(0, 2))
>>> s.positions().tolist()
[[0, 1, 2, 3], [-1, -1, 0, 1]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st


@dataclass(frozen=True)
class Schedule:
    """Chunk sizes fed to the cache, and each row's start column (its left padding)."""

    chunks: tuple[int, ...]
    offsets: tuple[int, ...] = (0,)

    @property
    def columns(self) -> int:
        """Tokens per row, padding included."""
        return sum(self.chunks)

    @property
    def batch_size(self) -> int:
        return len(self.offsets)

    def positions(self) -> torch.Tensor:
        """``(B, N)`` int64 absolute positions, -1 for a row's left padding."""
        col = torch.arange(self.columns)
        pos = col[None, :] - torch.tensor(self.offsets)[:, None]
        return pos.masked_fill(pos < 0, -1)

    def bounds(self) -> list[tuple[int, int]]:
        """Column range ``(start, stop)`` of each chunk."""
        out, start = [], 0
        for n in self.chunks:
            out.append((start, start + n))
            start += n
        return out

    def chunk_of(self, column: int) -> int:
        """Index of the chunk that holds ``column``."""
        for i, (start, stop) in enumerate(self.bounds()):
            if start <= column < stop:
                return i
        raise ValueError(f"column {column} is outside the schedule's {self.columns} columns")


def default_limits(window: int, sinks: int) -> tuple[int, int]:
    """``(max_tokens, max_chunk)``: three rings' worth of tokens, chunks up to two rings long.

    Long enough for every schedule to wrap the ring (sinks included) more than once, to hold
    chunks shorter and longer than the window, and runs of decode steps after a wrap.
    """
    ring = window + sinks
    return 3 * ring + 4, 2 * ring + 1


def schedules(*, window: int, sinks: int, batch_size: int, ragged: bool,
              max_chunk: int | None = None) -> st.SearchStrategy[Schedule]:
    """Hypothesis strategy of schedules for a cache of ``window`` (+ ``sinks``) keys.

    Chunk sizes lean towards 1 (decode steps) and shrink towards them; a list of chunks is cut
    at the token budget of :func:`default_limits`. Ragged rows start at offsets
    ``0 .. window + sinks`` columns, the earliest at 0 (left padding, as a batch is padded).
    """
    max_tokens, default_chunk = default_limits(window, sinks)
    top = default_chunk if max_chunk is None else max_chunk
    size = st.one_of(st.just(1), st.integers(1, top)) if top > 1 else st.just(1)

    @st.composite
    def draw_schedule(draw) -> Schedule:
        chunks, total = [], 0
        for n in draw(st.lists(size, min_size=1, max_size=max_tokens)):
            n = min(n, max_tokens - total)
            if n <= 0:
                break
            chunks.append(n)
            total += n
        if ragged:
            offs = draw(st.lists(st.integers(0, window + sinks), min_size=batch_size,
                                 max_size=batch_size))
            low = min(offs)
            offsets = tuple(o - low for o in offs)
        else:
            offsets = (0,) * batch_size
        return Schedule(tuple(chunks), offsets)

    return draw_schedule()
