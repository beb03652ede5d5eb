"""Schedules: how a sequence is cut into the chunks a cache is fed, where its rows start, and
where it rewinds.

A :class:`Schedule` is a list of chunk sizes (1 = a decode step) plus, for a ragged batch, each
row's start column: row ``b`` is left-padded with ``offsets[b]`` padding tokens (position -1),
then counts positions 0, 1, 2, ... . Every row takes the same chunk sizes, as a batched
``generate`` feeds a left-padded batch. With ``pads``, a row also pads *after* it started:
``pads[b]`` lists the further columns where row ``b`` holds a padding token (its positions go
on counting after them), which is how right padding (a prompt padded to the batch's longest,
generation after the pads), a row that idles a step in a padded batch, and a finished row
look to a cache: rows no longer in lock-step.

A schedule may also **rewind** (:class:`Rewind`): after chunk ``after``, every row forgets its
newest ``n`` tokens, as a speculative decoder forgets rejected drafts or a prompt cache trims a
conversation back to the prefix a new request shares. The next tokens go to the forgotten
positions again: new keys (another draft), or, with ``same=True``, the very keys that were
forgotten (a re-prefill). Every forgotten token is a real token of every row (rewinds come once
every row has started, as after a batched prefill), so all rows rewind by the same ``n``.

Columns count the tokens fed, in time order (a re-fed token takes a new column); each fed
column gets a token id (:meth:`Schedule.token_ids`), the same id again where the same key is
fed again. :meth:`Schedule.held` says which columns' keys the cache holds when a query is
answered: the reference a query is checked against is its window over those.

:func:`schedules` is the hypothesis strategy the kit draws from; hypothesis shrinks a failing
schedule towards fewer, smaller chunks, smaller offsets, fewer and smaller rewinds.

>>> s = Schedule(chunks=(3, 1), offsets=(0, 2))
>>> s.positions().tolist()
[[0, 1, 2, 3], [-1, -1, 0, 1]]
>>> r = Schedule(chunks=(3, 2), rewinds=(Rewind(after=0, n=2),))  # forget 1, 2; feed 1, 2
>>> r.positions().tolist(), r.token_ids().tolist()
([[0, 1, 2, 1, 2]], [[0, 1, 2, 3, 4]])
>>> Schedule(chunks=(3, 2), rewinds=(Rewind(0, 2, same=True),)).token_ids().tolist()
[[0, 1, 2, 1, 2]]
>>> Schedule(chunks=(3, 2), offsets=(0, 1), pads=((), (2, 3))).positions().tolist()
[[0, 1, 2, 3, 4], [-1, 0, -1, -1, 1]]
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import NamedTuple

import torch
from hypothesis import strategies as st

MAX_REWINDS = 3  # rewinds per drawn schedule


class Rewind(NamedTuple):
    """After chunk ``after``, every row forgets its newest ``n`` tokens; the tokens fed next at
    those positions repeat the forgotten keys if ``same`` (a re-prefill), else are new ones."""

    after: int
    n: int
    same: bool = False

    def __str__(self) -> str:
        return (f"rewind {self.n} after chunk {self.after} "
                f"({'the same keys again' if self.same else 'new keys'})")


@dataclass(frozen=True)
class _Trace:
    """What a schedule feeds, per fed column: its index in the sequence, the column whose key
    it repeats (itself for a new key), and which columns each query finds held."""

    index: list[int]
    source: list[int]
    held: torch.Tensor  # (N, N) bool


@dataclass(frozen=True)
class Schedule:
    """Chunk sizes fed to the cache, each row's start column (its left padding), rewinds."""

    chunks: tuple[int, ...]
    offsets: tuple[int, ...] = (0,)
    rewinds: tuple[Rewind, ...] = ()
    pads: tuple[tuple[int, ...], ...] = ()  # per row: padding columns after its left padding

    def __post_init__(self) -> None:
        object.__setattr__(self, "rewinds", tuple(Rewind(*r) for r in self.rewinds))
        object.__setattr__(self, "pads", tuple(tuple(sorted(set(p))) for p in self.pads))
        if self.pads and len(self.pads) != len(self.offsets):
            raise ValueError(f"pads needs one tuple of columns per row ({len(self.offsets)}), "
                             f"got {len(self.pads)}")
        if any(not 0 <= c < self.columns for p in self.pads for c in p):
            raise ValueError(f"pad columns must lie in 0 .. {self.columns - 1}, got "
                             f"{[list(p) for p in self.pads]}")
        if self.rewinds and self.gapped:
            raise ValueError("a schedule pads rows after they start or rewinds, not both "
                             "(a rewind forgets real tokens of every row)")
        self._trace  # noqa: B018 -- a rewind the schedule cannot make raises here

    @property
    def gapped(self) -> bool:
        """Some row pads after it started (right padding, a gap mid-row)."""
        return any(c >= o for p, o in zip(self.pads, self.offsets) for c in p)

    @cached_property
    def _trace(self) -> _Trace:
        """Run the schedule's sequence; ValueError for a rewind it cannot make."""
        for r in self.rewinds:
            if not (type(r.after) is int and type(r.n) is int and isinstance(r.same, bool)):
                raise TypeError(f"a rewind is (after: int, n: int, same: bool), got {tuple(r)}")
        afters = [r.after for r in self.rewinds]
        if afters != sorted(set(afters)) or any(not 0 <= a < len(self.chunks) - 1
                                                for a in afters):
            raise ValueError(f"rewinds must come after distinct chunks 0 .. "
                             f"{len(self.chunks) - 2}, in order (a rewind needs a chunk "
                             f"after it), got {list(self.rewinds)}")
        rewind_after = {r.after: r for r in self.rewinds}
        n_cols = self.columns
        index, source = [], []
        held = torch.zeros(n_cols, n_cols, dtype=torch.bool)
        seq: list[int] = []  # the fed columns the sequence holds, in order
        redo: dict[int, int] = {}  # sequence index -> column whose forgotten key comes back
        col = 0
        for i, n in enumerate(self.chunks):
            for _ in range(n):
                index.append(len(seq))
                source.append(redo.pop(len(seq), col))
                seq.append(col)
                col += 1
            held[col - n:col, seq] = True
            r = rewind_after.get(i)
            if r is None:
                continue
            real = len(seq) - max(self.offsets)  # tokens of the row that started last
            if not 1 <= r.n <= real:
                raise ValueError(f"{r}: every row must hold n >= 1 real tokens to forget; "
                                 f"the row that started last holds {max(real, 0)}")
            if r.same:
                redo.update({index[c]: source[c] for c in seq[-r.n:]})
            else:
                redo.clear()
            del seq[-r.n:]
        return _Trace(index, source, held)

    @property
    def columns(self) -> int:
        """Tokens fed per row, padding and re-fed tokens included."""
        return sum(self.chunks)

    @property
    def batch_size(self) -> int:
        return len(self.offsets)

    def positions(self) -> torch.Tensor:
        """``(B, N)`` int64 absolute position of each fed column, -1 for a row's padding."""
        index = torch.tensor(self._trace.index, dtype=torch.int64)
        pos = index[None, :] - torch.tensor(self.offsets)[:, None]
        if not self.gapped:
            return pos.masked_fill(pos < 0, -1)
        pad = pos < 0
        for b, cols in enumerate(self.pads):
            pad[b, list(cols)] = True
        # no rewinds here: a row's real columns count 0, 1, 2, ... in time order
        return torch.where(pad, -1, (~pad).long().cumsum(dim=1) - 1)

    def sources(self) -> torch.Tensor:
        """``(N,)`` int64: the column whose key each column feeds (itself, unless a rewind with
        ``same=True`` brings a forgotten key back)."""
        return torch.tensor(self._trace.source, dtype=torch.int64)

    def token_ids(self) -> torch.Tensor:
        """``(B, N)`` int64 id of each fed token, ``row * N + column`` of its key's first feed."""
        rows = torch.arange(self.batch_size)[:, None] * self.columns
        return rows + self.sources()[None, :]

    def held(self) -> torch.Tensor:
        """``(N, N)`` bool: column ``j``'s query is answered while the cache holds column
        ``j'``'s key (fed by the end of ``j``'s chunk, not forgotten since)."""
        return self._trace.held.clone()

    def rewind_after(self, chunk: int) -> int:
        """Tokens every row forgets after ``chunk`` (0: no rewind there)."""
        return next((r.n for r in self.rewinds if r.after == chunk), 0)

    def bounds(self) -> list[tuple[int, int]]:
        """Column range ``(start, stop)`` of each chunk."""
        stops = list(accumulate(self.chunks))
        return list(zip([0] + stops[:-1], stops))

    def chunk_of(self, column: int) -> int:
        """Index of the chunk that holds ``column``."""
        if not 0 <= column < self.columns:
            raise ValueError(f"column {column} is outside the schedule's {self.columns} columns")
        return bisect_right(list(accumulate(self.chunks)), column)


def default_limits(window: int, sinks: int) -> tuple[int, int]:
    """``(max_tokens, max_chunk)``: three rings' worth of tokens, chunks up to two rings long.

    Long enough for every schedule to wrap the ring (sinks included) more than once, to hold
    chunks shorter and longer than the window, and runs of decode steps after a wrap.
    """
    ring = window + sinks
    return 3 * ring + 4, 2 * ring + 1


def fit_rewinds(chunks: tuple[int, ...], offsets: tuple[int, ...],
                drawn: list[tuple[int, int, bool]]) -> tuple[Rewind, ...]:
    """The rewinds a schedule can make from drawn ``(after, n, same)``: one per chunk (the
    first drawn), in order, ``n`` cut to the tokens of the row that started last (none where
    it holds none)."""
    wanted: dict[int, tuple[int, bool]] = {}
    for after, n, same in drawn:
        wanted.setdefault(after, (n, same))
    out, held, start = [], 0, max(offsets)
    for i, size in enumerate(chunks[:-1]):
        held += size
        if i in wanted and held - start >= 1:
            n, same = wanted[i]
            n = min(n, held - start)
            out.append(Rewind(i, n, same))
            held -= n
    return tuple(out)


MAX_GAPS = 2  # runs of padding per row after it started, with padding="any"
PADDINGS = ("left", "any")


def gap_columns(runs: list[tuple[int, int]], offset: int, columns: int) -> tuple[int, ...]:
    """The padding columns of a row from drawn runs ``(start, length)``: those at or after the
    row's left padding ``offset`` and before the schedule's end (a run past the last column is
    right padding, cut there)."""
    return tuple(sorted({c for start, n in runs for c in range(start, start + n)
                         if offset <= c < columns}))


def schedules(*, window: int, sinks: int, batch_size: int, ragged: bool,
              max_chunk: int | None = None, rewind: bool = False,
              padding: str = "left") -> st.SearchStrategy[Schedule]:
    """Hypothesis strategy of schedules for a cache of ``window`` (+ ``sinks``) keys.

    Chunk sizes lean towards 1 (decode steps) and shrink towards them; a list of chunks is cut
    at the token budget of :func:`default_limits`. Ragged rows start at offsets
    ``0 .. window + sinks`` columns, the earliest at 0 (left padding, as a batch is padded).
    With ``rewind``, a schedule of two chunks or more also rewinds, 1 to :data:`MAX_REWINDS`
    times after chunks drawn anywhere (before and after the wrap), each by ``n`` tokens: up
    to the longest chunk of :func:`default_limits`, leaning towards 1 to 3 (a few drafts), and
    never more than the row that started last holds (:func:`fit_rewinds`). With
    ``padding="any"`` (ragged rows, no rewinds), each row also pads after it started: up to
    :data:`MAX_GAPS` runs of 1 to ``window + sinks`` padding columns anywhere (mid-row gaps,
    right padding), shrinking towards fewer and shorter runs (:func:`gap_columns`).
    """
    max_tokens, default_chunk = default_limits(window, sinks)
    top = default_chunk if max_chunk is None else max_chunk
    size = st.one_of(st.just(1), st.integers(1, top)) if top > 1 else st.just(1)
    forget = st.one_of(st.integers(1, 3), st.integers(1, default_chunk))

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
        pads: tuple[tuple[int, ...], ...] = ()
        if padding == "any":
            run = st.tuples(st.integers(0, max(total - 1, 0)), st.integers(1, window + sinks))
            pads = tuple(gap_columns(draw(st.lists(run, max_size=MAX_GAPS)), o, total)
                         for o in offsets)
        rewinds: tuple[Rewind, ...] = ()
        if rewind and len(chunks) > 1:
            drawn = draw(st.lists(st.tuples(st.integers(0, len(chunks) - 2), forget,
                                            st.booleans()), min_size=1, max_size=MAX_REWINDS))
            rewinds = fit_rewinds(tuple(chunks), offsets, drawn)
        return Schedule(tuple(chunks), offsets, rewinds, pads)

    return draw_schedule()
