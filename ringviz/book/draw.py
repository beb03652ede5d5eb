"""Pictures of cache states: the ring as a row of slots and as a circle, the shift window, a batch,
a step's ``[ring | chunk]`` key axis with its mask, a padded (B, T) positions grid.

Every function draws what a :class:`ringviz.book.trace.Trace` frame (or, for the padded grid, the
positions a real cache was given and holds) says; it never computes ring state. Each takes
``ax=None`` and returns the axes it drew on. Slot fill says what the slot is for the row's
newest query (``frame.slot_state``); an orange edge marks slots written in this step; the green
and orange triangles are the start and write pointers; vermillion text names evicted tokens.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle, Wedge

from ringviz.book.style import (
    BOOK_WIDTH,
    EDGE_COLOR,
    EVICT_COLOR,
    START_COLOR,
    STATE_COLORS,
    WRITE_COLOR,
)
from ringviz.book.trace import Frame, Trace


def _frame(trace: Trace, frame: int) -> Frame:
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a ringviz.book.trace.Trace, got {type(trace).__name__}")
    if not -len(trace.frames) <= frame < len(trace.frames):
        raise ValueError(f"frame {frame} out of range for a trace of {len(trace.frames)} frames")
    return trace.frames[frame]


def _row(trace: Trace, row: int) -> int:
    if not 0 <= row < trace.rows:
        raise ValueError(f"row {row} out of range for a trace of {trace.rows} rows")
    return row


def _axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    return plt.subplots(figsize=size)[1] if ax is None else ax


def _bare(ax: Axes, xlim: tuple[float, float], ylim: tuple[float, float], *,
          equal: bool = True) -> None:
    """Fix a drawing's extent and hide the axis; ``equal``: square cells."""
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    if equal:
        ax.set_aspect("equal")
    ax.axis("off")


def slot_box(ax: Axes, x: float, y: float, pos: int, color: str | None = None, *,
             written: bool = False, linewidth: float = 1.0, fontsize: float | None = None) -> None:
    """One slot at (x, y), its position inside; hatched and blank when empty (``pos < 0``).

    ``color`` defaults to visible, or empty when ``pos < 0``; ``written`` gives it an orange
    edge and a bold number (a slot written in this step).
    """
    if color is None:
        color = STATE_COLORS["empty" if pos < 0 else "visible"]
    edge, lw = (WRITE_COLOR, 3.0) if written else (EDGE_COLOR, linewidth)
    ax.add_patch(Rectangle((x + 0.04, y), 0.92, 0.8, facecolor=color, edgecolor=edge,
                           linewidth=lw, hatch="//" if pos < 0 else None))
    ax.text(x + 0.5, y + 0.4, "" if pos < 0 else str(pos), ha="center", va="center",
            fontsize=fontsize, fontweight="bold" if written else "normal")


def slot_legend(ax: Axes, fills: Mapping[str, str], *, written: str = "written",
                pointers: bool = False, y: float = -0.02, ncol: int | None = None,
                fontsize: float = 8) -> None:
    """A legend under the slots: each fill (the empty one hatched), the written edge, and the
    write and start pointers when ``pointers``."""
    handles = [Patch(facecolor=color, edgecolor=EDGE_COLOR, label=label,
                     hatch="//" if color == STATE_COLORS["empty"] else None)
               for label, color in fills.items()]
    handles.append(Patch(facecolor="white", edgecolor=WRITE_COLOR, linewidth=3, label=written))
    if pointers:
        handles += [plt.Line2D([], [], color=c, marker="^", linestyle="", label=name)
                    for c, name in ((WRITE_COLOR, "write pointer"), (START_COLOR, "start"))]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, y),
              ncol=ncol or len(handles), fontsize=fontsize, handlelength=1.2, columnspacing=1.0)


def _fills(states: Sequence[str]) -> dict[str, str]:
    return {s: STATE_COLORS[s] for s in states}


def _states(f: Frame, row: int) -> list[str]:
    """Slot colours: the frame's view for a ring; a shift window has no query view (all held)."""
    if f.slot_state:
        return f.slot_state[row]
    return ["empty" if p < 0 else "visible" for p in f.positions[row]]


def _write_slot(f: Frame, row: int) -> int | None:
    """Slot of the row's newest token (where the write pointer stands), None when empty."""
    pos = f.positions[row]
    return int(np.argmax(pos)) if max(pos) >= 0 else None


ROW_PITCH = 1.45  # vertical distance between stacked rows (box 0.8, labels and pointers)


def _slots(ax: Axes, f: Frame, row: int, y: float, pointers: bool, index: bool) -> None:
    """Draw one row of slots at height ``y`` (slot s spans x in [s, s+1])."""
    written = set(f.written[row])
    for s, (pos, state) in enumerate(zip(f.positions[row], _states(f, row), strict=True)):
        slot_box(ax, s, y, pos, STATE_COLORS[state], written=s in written, fontsize=10)
        if index:
            ax.text(s + 0.5, y + 0.88, f"slot {s}" if s == 0 else str(s), ha="center",
                    va="bottom", fontsize=7, color=EDGE_COLOR)
    if f.evicted[row]:
        ax.text(len(f.positions[row]) + 0.15, y + 0.4, "evicted " + ", ".join(
            map(str, f.evicted[row])), color=EVICT_COLOR, va="center", fontsize=9)
    write = _write_slot(f, row)
    if pointers and write is not None:
        ax.plot(write + 0.68, y - 0.2, marker="^", color=WRITE_COLOR, markersize=8)
        ax.plot(f.start[row] + 0.32, y - 0.2, marker="^", color=START_COLOR, markersize=8)


def _finish_rows(ax: Axes, window: int, n_rows: int, top: float = 1.15) -> None:
    """Frame ``n_rows`` stacked rows (row 0 on top) with room for labels and pointers."""
    _bare(ax, (-0.9, window + 2.8), (-0.45, (n_rows - 1) * ROW_PITCH + top), equal=False)


def _stack(ax: Axes, trace: Trace, f: Frame, label: Callable[[int], str] | None) -> None:
    """Every row of frame ``f``, row 0 on top and its slot indices above it; ``label(row)``
    written left of each row."""
    for row in range(trace.rows):
        y = (trace.rows - 1 - row) * ROW_PITCH
        _slots(ax, f, row, y, pointers=trace.layout == "ring", index=row == 0)
        if label is not None:
            ax.text(-0.2, y + 0.4, label(row), ha="right", va="center", fontsize=8)
    _finish_rows(ax, trace.window, trace.rows)


def draw_ring_row(trace: Trace, frame: int = -1, *, row: int = 0,
                  ax: Axes | None = None) -> Axes:
    """One ring as a row of slots, with pointers, evictions and the wrap-around arrow (ch. 3)."""
    f, row = _frame(trace, frame), _row(trace, row)
    ax = _axes(ax, (BOOK_WIDTH, 1.9))
    _slots(ax, f, row, 0.0, pointers=trace.layout == "ring", index=True)
    if trace.layout == "ring":
        ax.add_patch(FancyArrowPatch((trace.window - 0.5, 1.12), (0.5, 1.12),
                                     connectionstyle="arc3,rad=0.12", arrowstyle="-|>",
                                     mutation_scale=12, color=EDGE_COLOR, linewidth=1))
        ax.text(trace.window / 2, 1.45, f"after slot {trace.window - 1} the next write wraps "
                "to slot 0", ha="center", va="bottom", fontsize=8, color=EDGE_COLOR)
    _finish_rows(ax, trace.window, 1, top=1.8 if trace.layout == "ring" else 1.15)
    ax.set_title(_wrap(f.caption), loc="left", fontsize=9)
    slot_legend(ax, _fills(("visible", "empty")), pointers=trace.layout == "ring")
    return ax


def draw_ring_circle(trace: Trace, frame: int = -1, *, row: int = 0,
                     ax: Axes | None = None) -> Axes:
    """One ring as a circle: slot 0 on top, clockwise, arrows to start and write (ch. 3)."""
    f, row = _frame(trace, frame), _row(trace, row)
    if trace.layout != "ring":
        raise ValueError("draw_ring_circle draws ring traces; a shift window is a row")
    ax = _axes(ax, (3.6, 3.6))
    W, written = trace.window, set(f.written[row])
    step = 360.0 / W
    for s, (pos, state) in enumerate(zip(f.positions[row], _states(f, row), strict=True)):
        theta1 = 90 - (s + 1) * step  # clockwise from 12 o'clock
        edge, lw = (WRITE_COLOR, 3.0) if s in written else (EDGE_COLOR, 1.0)
        ax.add_patch(Wedge((0, 0), 1.0, theta1, theta1 + step, width=0.38,
                           facecolor=STATE_COLORS[state], edgecolor=edge, linewidth=lw,
                           hatch="//" if pos < 0 else None))
        mid = np.deg2rad(theta1 + step / 2)
        ax.text(0.81 * np.cos(mid), 0.81 * np.sin(mid), "" if pos < 0 else str(pos),
                ha="center", va="center", fontsize=10)
        ax.text(1.13 * np.cos(mid), 1.13 * np.sin(mid), str(s), ha="center", va="center",
                fontsize=7, color=EDGE_COLOR)
    write = _write_slot(f, row)
    if write is not None:
        for slot, color, r in ((write, WRITE_COLOR, 0.58), (f.start[row], START_COLOR, 0.45)):
            mid = np.deg2rad(90 - (slot + 0.5) * step)
            ax.annotate("", (r * np.cos(mid), r * np.sin(mid)), (0, 0),
                        arrowprops={"arrowstyle": "-|>", "color": color, "lw": 2})
    if f.evicted[row]:
        ax.text(0, -1.3, "evicted " + ", ".join(map(str, f.evicted[row])), ha="center",
                color=EVICT_COLOR, fontsize=9)
    _bare(ax, (-1.35, 1.35), (-1.45, 1.3))
    ax.set_title(f"ring, W={W}: slot = pos % {W}", fontsize=10)
    return ax


def draw_batch(trace: Trace, frame: int = -1, *, ax: Axes | None = None) -> Axes:
    """Every batch row's ring, one above the other (row 0 on top), with its count (ch. 7)."""
    f = _frame(trace, frame)
    ax = _axes(ax, (BOOK_WIDTH, 1.0 + 0.75 * trace.rows))
    _stack(ax, trace, f, lambda row: f"row {row}\n"
           f"{sum(s == 'visible' for s in _states(f, row))} visible")
    ax.set_title(_wrap(f.caption, 110), loc="left", fontsize=8)
    slot_legend(ax, _fills(("visible", "empty")), pointers=trace.layout == "ring")
    return ax


def draw_ring_and_shift(ring: Trace, shift: Trace, frame: int = -1) -> Figure:
    """The ring and the copying window after the same tokens, one above the other (ch. 2)."""
    if ring.layout != "ring" or shift.layout != "shift":
        raise ValueError("pass a ring trace first and a shift trace second")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(BOOK_WIDTH, 3.8))
    draw_ring_row(ring, frame, ax=top)
    draw_ring_row(shift, frame, ax=bottom)
    top.set_title(_wrap(f"ring: {ring.frames[frame].caption}; "
                        f"{ring.frames[frame].moved[0]} entries moved"), loc="left", fontsize=9)
    bottom.set_title(_wrap(f"shift window (oldest first): {shift.frames[frame].caption}"),
                     loc="left", fontsize=9)
    fig.tight_layout()
    return fig


def _key_states(f: Frame) -> list[list[str]]:
    """Each (query, key) cell of a one-row step's mask: visible (as recorded), future or stale."""
    return [["visible" if b else "future" if k > q else "stale"
             for k, b in zip(f.keys[0], band, strict=True)]
            for q, band in zip(f.queries[0], f.band[0], strict=True)]


def _mask(ax: Axes, f: Frame, *, fontsize: float = 9) -> None:
    """A one-row step's queries (rows, top down) x keys (columns): visible / stale / future.

    Keys are in the order attention reads them: the ring's slots, then the chunk (bracketed
    apart); chunk tokens the ring did not keep are struck through in vermillion.
    """
    queries, keys = f.queries[0], f.keys[0]
    kept, chunk = set(f.positions[0]), set(queries)
    for i, (q, states) in enumerate(zip(queries, _key_states(f), strict=True)):
        for j, state in enumerate(states):
            ax.add_patch(Rectangle((j + 0.04, -i - 0.96), 0.92, 0.92,
                                   facecolor=STATE_COLORS[state], edgecolor="none"))
        ax.text(-0.15, -i - 0.5, str(q), ha="right", va="center", fontsize=fontsize)
    for j, k in enumerate(keys):
        never = k in chunk and k not in kept
        ax.text(j + 0.5, 0.15, str(k), ha="center", va="bottom", fontsize=fontsize,
                color=EVICT_COLOR if never else "black", fontweight="bold" if never else None)
        if never:
            ax.plot([j + 0.15, j + 0.85], [0.45, 0.45], color=EVICT_COLOR, linewidth=1.2,
                    linestyle="-", marker="")
    n_ring = sum(k not in chunk for k in keys)
    if len(queries) > 1:
        for a, b, name in ((0, n_ring, "slots"), (n_ring, len(keys), "chunk")):
            if b > a:
                # explicit style: the book's line cycle would add markers and dashes
                ax.plot([a + 0.1, a + 0.1, b - 0.1, b - 0.1], [1.05, 1.2, 1.2, 1.05],
                        color=EDGE_COLOR, linewidth=1, linestyle="-", marker="")
                ax.text((a + b) / 2, 1.3, name, ha="center", va="bottom", fontsize=fontsize,
                        color=EDGE_COLOR)
    _bare(ax, (-1.4, max(len(keys), 4) + 0.2), (-max(len(queries), 1) - 0.2, 2.2))


def draw_chunk_keys(trace: Trace, frame: int, *, ax: Axes | None = None) -> Axes:
    """A chunk step's key axis ``[ring | chunk]`` and its mask (chapter 6).

    Columns are the keys the step attended: first those the ring held before the step, then
    the chunk's own tokens; chunk tokens that the ring did not keep (a chunk longer than W, or
    overwritten by later tokens of the same chunk) are struck through: attended, never stored.
    """
    f = _frame(trace, frame)
    if trace.layout != "ring" or not f.band or len(f.queries[0]) < 2:
        raise ValueError(f"frame {frame} is not a chunk step of a ring trace (it has "
                         f"{len(f.queries[0]) if f.queries else 0} queries)")
    ax = _axes(ax, (BOOK_WIDTH, 1.2 + 0.42 * len(f.queries[0])))
    _mask(ax, f, fontsize=10)
    ax.text(-1.3, -len(f.queries[0]) / 2, "query", rotation=90, ha="center", va="center",
            fontsize=10)
    ax.set_title(_wrap(f"step {trace.frames.index(f)}, W={trace.window}: {f.caption}", 95),
                 loc="left", fontsize=9)
    present = {state for states in _key_states(f) for state in states}
    handles = [Patch(facecolor=STATE_COLORS[s], label=s) for s in ("visible", "stale", "future")
               if s in present]
    handles.append(plt.Line2D([], [], color=EVICT_COLOR, label="struck key: never stored"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax


def draw_padded_batch(positions: np.ndarray, ring_positions: np.ndarray, window: int, *,
                      ax: Axes | None = None) -> Axes:
    """The padded (B, T) positions a batch step passes (left) and each row's ring after it.

    ``positions`` is what the cache was given (-1 = padding, drawn hatched); under each real
    token is the slot the ring holds it in, read from ``ring_positions`` (B, window), the
    cache's stored positions after the step ("-" where a later token of the chunk displaced
    it). Below: the rings themselves, slot by slot (chapter 7).
    """
    pos, ring = np.asarray(positions), np.asarray(ring_positions)
    if pos.ndim != 2 or ring.ndim != 2 or len(pos) != len(ring) or ring.shape[1] != window:
        raise ValueError(f"positions must be (B, T) and ring_positions (B, {window}), got "
                         f"{pos.shape} and {ring.shape}")
    B, T = pos.shape
    step = 1.75  # row pitch: a row of cells plus its line of slot labels
    below = B * step + 1.6  # the rings sit under the grid, so both get the full width
    pitch = 1.15  # ring rows: no slot labels under them
    x_lim, y_lim = (-1.6, max(T, window) + 0.3), (-(B - 1) * pitch - below - 0.3, 2.3)
    aspect = (y_lim[1] - y_lim[0]) / (x_lim[1] - x_lim[0])
    ax = _axes(ax, (BOOK_WIDTH, BOOK_WIDTH * aspect))
    for b in range(B):
        y = -b * step
        held = {int(p): s for s, p in enumerate(ring[b].tolist()) if p >= 0}
        for t, p in enumerate(pos[b].tolist()):
            slot_box(ax, t, y, p, linewidth=0.8, fontsize=12)
            if p >= 0:
                ax.text(t + 0.5, y - 0.12, f"s{held[p]}" if p in held else "-",
                        ha="center", va="top", fontsize=10, color=EDGE_COLOR)
        ax.text(-0.2, y + 0.4, f"row {b}", ha="right", va="center", fontsize=12)
        y = -b * pitch - below
        for s, p in enumerate(ring[b].tolist()):
            slot_box(ax, s, y, p, linewidth=0.8, fontsize=12)
        ax.text(-0.2, y + 0.4, f"row {b}", ha="right", va="center", fontsize=12)
    ax.text(0, 1.0, f"positions passed, (B, T) = ({B}, {T}); hatched: padding (-1)\n"
            "under each token: sN = kept in slot N, - = not kept", ha="left", va="bottom",
            fontsize=11)
    top = 1.0 - below
    ax.text(0, top + 0.5, f"each row's ring after the step (W = {window}), slot by slot:",
            ha="left", va="bottom", fontsize=11)
    for s in range(window):
        ax.text(s + 0.5, top, str(s), ha="center", va="bottom", fontsize=10, color=EDGE_COLOR)
    ax.text(-0.2, top, "slot", ha="right", va="bottom", fontsize=10, color=EDGE_COLOR)
    _bare(ax, x_lim, y_lim)
    return ax


def draw_frames(trace: Trace, frames: list[int] | None = None, *,
                max_frames: int = 10) -> Figure:
    """A static strip of frames (all rows of each), for readers of the printed or static page.

    For a single-row ring trace each frame also shows the step's mask, query x key, beside the
    ring (the same picture as the stepper's lower panel).
    """
    index = list(range(len(trace.frames))) if frames is None else [int(i) for i in frames]
    if len(index) > max_frames:
        keep = np.linspace(0, len(index) - 1, max_frames).round().astype(int)
        index = [index[i] for i in keep]
    for i in index:
        _frame(trace, i)
    # single-row ring traces record each step's mask (``band``): drawn in a second column
    masks = trace.layout == "ring" and trace.rows == 1 and any(f.band and f.band[0]
                                                               for f in trace.frames)
    if masks:
        most = max(len(trace.frames[i].queries[0]) for i in index)
        height = 0.55 + 0.3 * max(most, 2)
    else:
        height = 0.6 + 0.55 * trace.rows
    fig, axes = plt.subplots(len(index), 1 + masks, figsize=(BOOK_WIDTH, height * len(index)),
                             squeeze=False, width_ratios=(1.25, 1) if masks else None)
    for i, row_axes in zip(index, axes, strict=True):
        f, ax = trace.frames[i], row_axes[0]
        _stack(ax, trace, f, (lambda row: f"row {row}") if trace.rows > 1 else None)
        if masks and f.queries[0]:
            _mask(row_axes[1], f)
        elif masks:
            row_axes[1].axis("off")
        ax.set_title(_wrap(f"step {i}: {f.caption}", 62 if masks else 120), loc="left",
                     fontsize=9 if masks else 8)
    states = ("visible", "stale", "future", "empty") if masks else ("visible", "empty")
    slot_legend(axes[-1, 0], _fills(states), pointers=trace.layout == "ring")
    fig.tight_layout()
    return fig


def _wrap(text: str, width: int = 90) -> str:
    return "\n".join(textwrap.wrap(text, width))
