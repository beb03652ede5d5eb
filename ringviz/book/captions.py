"""A cache step in words: the captions and index arithmetic a trace frame carries.

Both are written from what the real cache *did* (the positions before and after a step) and the
arithmetic is checked against it: a slot or start pointer that disagrees with ``pos % W`` (or,
with ``S`` sinks, ``S + pos % W``) raises instead of printing a formula the cache did not follow.

>>> spans([0, 1, 2, 5])
'0..2, 5'
>>> slot_sum(9, 3, window=4, sinks=2)
'pos 9 -> slot 2 + 9 % 4 = 3'

Used by :mod:`ringviz.book.trace`; taught in chapters 3 (ring indexing), 6 (prefill) and 8 (sinks).
"""

from __future__ import annotations

import numpy as np


def spans(values: list[int]) -> str:
    """Runs of consecutive ints for captions: ``[0, 1, 2, 5] -> '0..2, 5'``; order is kept."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs)


def _named(noun: str, values: list[int]) -> str:
    """``token 5`` or ``tokens 0..4``."""
    return f"{noun} {values[0]}" if len(values) == 1 else f"{noun}s {spans(values)}"


def _row_caption(queries: list[int], evicted: list[int],
                 after: list[int], start: int, window: int, sinks: int = 0) -> str:
    """One row's step in words: what was written where, what left, where the start is now."""
    if not queries:
        return "padding only, nothing written"
    kept = [p for p in queries if p in after]
    where = _named("slot", [after.index(p) for p in kept])
    dropped = [p for p in queries if p not in after]
    text = f"{_named('token', queries)} written to {where}"
    if dropped:
        text = (f"{_named('token', queries)} ({len(queries)} > W={window}) all attended inside "
                f"the chunk; {_named('token', kept)} kept in {where}")
    if evicted:
        text += f", evicting {_named('token', evicted)}"
    if dropped:
        text += f"; {_named('token', dropped)} never stored"
    if sinks and max(after[sinks:]) < 0:
        return f"{text}; the ring is still empty"
    return f"{text}; {'ring start' if sinks else 'start'} -> slot {start}"


def step_caption(queries: list[list[int]], evicted: list[list[int]],
             after: np.ndarray, start: list[int], window: int, sinks: int = 0) -> str:
    return _by_row([_row_caption(q, e, a, s, window, sinks)
                    for q, e, a, s in zip(queries, evicted, after.tolist(), start, strict=True)])


def _by_row(parts: list[str]) -> str:
    """One row's text as it is; several as ``row 0: ...; row 1: ...`` (rows with no text left
    out)."""
    if len(parts) == 1:
        return parts[0]
    return "; ".join(f"row {b}: {text}" for b, text in enumerate(parts) if text)


def slot_sum(pos: int, slot: int, window: int, sinks: int = 0) -> str:
    """``pos 10 -> slot 10 % 4 = 2``, after checking that the cache really used that slot.

    With sinks: ``pos 1 -> sink slot 1`` below ``sinks``, ``pos 9 -> slot 2 + 9 % 4 = 3`` after.
    """
    if sinks:
        expected = pos if pos < sinks else sinks + pos % window
        text = (f"sink slot {pos}" if pos < sinks else f"slot {sinks} + {pos} % {window}")
        if expected != slot:
            raise RuntimeError(f"the cache stored position {pos} in slot {slot}, not {text}")
        return f"pos {pos} -> {text}" + ("" if pos < sinks else f" = {slot}")
    if pos % window != slot:
        raise RuntimeError(f"the cache stored position {pos} in slot {slot}, not "
                           f"{pos} % {window} = {pos % window}")
    return f"pos {pos} -> slot {pos} % {window} = {slot}"


def ring_start(after: list[int], sinks: int) -> int:
    """With sinks: the slot of the oldest entry in the ring part of a row (0 while it is empty)."""
    ring = [(p, sinks + s) for s, p in enumerate(after[sinks:]) if p >= 0]
    return min(ring)[1] if ring else 0


def _start_sum(newest: int, after: list[int], start: int, window: int, sinks: int) -> str:
    """``start = (10 + 1) % 4 = 3``, or with sinks ``ring start = 2 + (9 + 1) % 4 = 4``, after
    checking it against the start read from the cache."""
    if sinks:
        if newest < sinks:
            return ""
        full = newest - window + 1 >= sinks
        formula = (f"{sinks} + ({newest} + 1) % {window}" if full
                   else f"{sinks} + {sinks} % {window}")
        expected = sinks + ((newest + 1) % window if full else sinks % window)
        name = "ring start"
    else:
        full = min(after) >= 0
        formula = f"({newest} + 1) % {window}" if full else "0 (ring not full)"
        expected = (newest + 1) % window if full else 0
        name = "start"
    if expected != start:
        raise RuntimeError(f"the cache's {name} is slot {start}, not {formula}")
    if not (full or sinks):
        return f"{name} = {formula}"
    return f"{name} = {formula} = {start}" + ("" if full else " (ring not full)")


def _row_arithmetic(queries: list[int], evicted: list[int], after: list[int], start: int,
                    window: int, with_start: bool, sinks: int = 0) -> str:
    """One row's index arithmetic: the slot of each stored token, evictions, the start pointer."""
    kept = [p for p in queries if p in after]
    if not kept:
        return "nothing stored" if queries else ""
    sums = [slot_sum(p, after.index(p), window, sinks) for p in kept]
    parts = [sums[0] if len(sums) == 1 else ", ".join(sums) if len(sums) == 2
             else f"{sums[0]} ... {sums[-1]}"]
    newest = max(kept)
    if evicted == [newest - window]:
        parts.append(f"evicts {evicted[0]} = {newest} - {window}")
    elif evicted:
        parts.append(f"evicts {spans(evicted)} (older than {newest} - {window} + 1 = "
                     f"{newest - window + 1})")
    if with_start:
        parts.append(_start_sum(newest, after, start, window, sinks))
    return "; ".join(p for p in parts if p)


def step_arithmetic(queries: list[list[int]], evicted: list[list[int]], after: np.ndarray,
                start: list[int], window: int, sinks: int = 0) -> str:
    rows = after.tolist()
    return _by_row([_row_arithmetic(q, e, a, s, window, with_start=len(rows) == 1, sinks=sinks)
                    for q, e, a, s in zip(queries, evicted, rows, start, strict=True)])
