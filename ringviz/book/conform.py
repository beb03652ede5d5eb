"""Pictures for chapter 14: how the kit reads a cache's key set, and what a failure looked like.

* :func:`draw_probe`: one query of a real cache step, zero query and one-hot values: the slots'
  equal weights, their one-hot values and the output that spells out which keys were seen.
* :func:`draw_failure`: a :class:`ringviz.conformance.Failure`'s row, queries x keys: seen as
  expected, expected but missed, seen but outside the window; chunk boundaries marked.

Both draw what they are given (measured outputs, a Failure's grids); neither computes a mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.patches import Patch, Rectangle

from ringviz.book.draw import _axes, _bare
from ringviz.book.style import BOOK_WIDTH, EDGE_COLOR, EVICT_COLOR, OKABE_ITO, STATE_COLORS

MISSED_COLOR, EXTRA_COLOR = EVICT_COLOR, OKABE_ITO["yellow"]
HOT_COLOR = OKABE_ITO["blue"]


def draw_probe(slot_positions: Sequence[int], weights: Sequence[float],
               output: Sequence[float], *, query: int, title: str = "",
               ax: Axes | None = None) -> Axes:
    """One zero query over a cache's slots: weight of each slot, its one-hot value, the output.

    ``slot_positions`` (-1 = empty, value all zeros) and ``weights`` are per slot, in slot
    order; ``output`` is the query's measured output, one entry per token id (= position).
    Slot rows read left to right: weight, then the value vector; the bottom row is
    ``sum(weight x value)``, the output.
    """
    slots, ids = len(slot_positions), len(output)
    if len(weights) != slots:
        raise ValueError(f"weights has {len(weights)} entries for {slots} slots")
    ax = _axes(ax, (4.2, 0.9 + 0.42 * (slots + 2)))
    for s, (pos, w) in enumerate(zip(slot_positions, weights, strict=True)):
        y = -s
        ax.text(-2.6, y + 0.5, "empty" if pos < 0 else f"pos {pos}", ha="right", va="center",
                fontsize=9, color=EDGE_COLOR)
        seen = w > 0
        ax.add_patch(Rectangle((-2.4, y + 0.06), 1.8, 0.88, linewidth=0.8,
                               facecolor=STATE_COLORS["visible" if seen else "empty"],
                               edgecolor=EDGE_COLOR))
        ax.text(-1.5, y + 0.5, _fraction(w), ha="center", va="center", fontsize=9)
        for j in range(ids):
            hot = pos == j
            ax.add_patch(Rectangle((j + 0.06, y + 0.06), 0.88, 0.88, linewidth=0.6,
                                   facecolor=HOT_COLOR if hot else "white",
                                   edgecolor=EDGE_COLOR))
            if hot:
                ax.text(j + 0.5, y + 0.5, "1", ha="center", va="center", fontsize=8,
                        color="white")
    y = -slots - 0.6
    for j, o in enumerate(output):
        ax.add_patch(Rectangle((j + 0.06, y + 0.06), 0.88, 0.88, linewidth=0.8,
                               facecolor=STATE_COLORS["visible"] if o > 1e-9 else "white",
                               edgecolor="black"))
        if o > 1e-9:
            ax.text(j + 0.5, y + 0.5, _fraction(o), ha="center", va="center", fontsize=8)
        ax.text(j + 0.5, y - 0.25, str(j), ha="center", va="top", fontsize=8)
    ax.text(-2.6, y + 0.5, "output", ha="right", va="center", fontsize=9, fontweight="bold")
    ax.text(-1.5, 1.15, "weight", ha="center", va="bottom", fontsize=9)
    ax.text(0, 1.15, "value: one-hot at the token's id", ha="left", va="bottom", fontsize=9)
    ax.text(ids / 2, y - 0.95, "token id = position", ha="center", va="top", fontsize=8,
            color=EDGE_COLOR)
    _bare(ax, (-4.6, ids + 0.2), (y - 1.5, 2.0))
    ax.set_title(title or f"zero query at position {query}", fontsize=10, loc="left")
    return ax


def _fraction(w: float) -> str:
    """``0.25`` -> ``"1/4"``: weights of a zero query are 1/K (or 0)."""
    if w <= 1e-9:
        return "0"
    k = round(1 / w)
    return f"1/{k}" if abs(w * k - 1) < 1e-6 else f"{w:.2f}"


def draw_failure(failure, *, title: str | None = None, size: int | None = None,
                 ax: Axes | None = None) -> Axes:
    """A window Failure's row, queries (rows) x keys (columns), both by position.

    Cells: seen as expected, expected but missed, seen though outside the window. Two narrow
    columns on the right count each query's keys that hold no token of the row (empty slots,
    padding: "none") and keys of other rows ("other"), when there are any. Dotted lines mark
    the schedule's chunk boundaries; the failing query's row is outlined. ``size`` fixes the
    grid's extent (in cells), so panels side by side share one scale.
    """
    if failure.property != "window" or failure.expected_mask is None:
        raise ValueError(f"draw_failure draws window failures, got {failure.property!r}")
    expected = np.asarray(failure.expected_mask, dtype=bool)
    seen = np.asarray(failure.seen_mask, dtype=bool)
    n = len(expected)
    size = max(n, size or n)
    ax = _axes(ax, (1.6 + 0.32 * size, 1.4 + 0.32 * size))

    def cell(x: float, q: int, face: str, hatch: str | None = None) -> None:
        ax.add_patch(Rectangle((x, -q - 1), 1, 1, facecolor=face, hatch=hatch,
                               edgecolor="white", linewidth=0.6))

    for q in range(n):
        for k in range(n):
            e, s = expected[q, k], seen[q, k]
            if e and s:
                cell(k, q, STATE_COLORS["visible"])
            elif e:
                cell(k, q, MISSED_COLOR, "xxx")
            elif s:
                cell(k, q, EXTRA_COLOR, "///")
            elif k <= q:
                cell(k, q, "#E0E0E0")
    extras = [(name, counts) for name, counts in (("none", failure.seen_blank),
                                                  ("other", failure.seen_other_rows))
              if counts and any(counts)]
    for i, (_, counts) in enumerate(extras):
        x = n + 0.8 + 1.1 * i  # a gap wide enough that the column's name clears the last tick
        for q, count in enumerate(counts):
            if count:  # unhatched, so the count reads
                cell(x, q, EXTRA_COLOR)
                ax.text(x + 0.5, -q - 0.5, str(count), ha="center", va="center", fontsize=8,
                        color="black")
    q = failure.position
    ax.add_patch(Rectangle((0, -q - 1), n + 1.1 * len(extras) + 0.7 * bool(extras), 1,
                           fill=False, edgecolor="black", linewidth=1.4))
    offset = failure.offsets[failure.row] if failure.offsets else 0
    for e in np.cumsum([0, *failure.schedule])[1:-1] - offset:  # chunk boundaries
        if 0 < e < n:
            ax.plot([-0.4, n], [-e, -e], color=EDGE_COLOR, linewidth=1.0, linestyle=":",
                    marker="")
    ticks = sorted({0, n - 1, q})
    # the narrow columns are named on the key axis, beside the positions, never over a cell
    xs = [t + 0.5 for t in ticks] + [n + 1.3 + 1.1 * i for i in range(len(extras))]
    ax.set_xticks(xs, [str(t) for t in ticks] + [name for name, _ in extras], fontsize=9)
    for label in ax.get_xticklabels()[len(ticks):]:
        label.set_fontsize(8)
    ax.set_yticks(-np.array(ticks) - 0.5, [str(t) for t in ticks], fontsize=9)
    ax.tick_params(length=2, pad=1)
    ax.set_xlim(0, size + 3.0)
    ax.set_ylim(-n - 0.1, 0.1)
    ax.set_aspect("equal")
    ax.spines[:].set_visible(False)
    label = f"chunks {failure.schedule}"
    if any(failure.offsets):
        label += f"\nrow {failure.row} starts at column {offset}"
    ax.set_title(title if title is not None else label, fontsize=10, loc="left")
    return ax


def failure_grid(failures: Sequence[tuple[str, object]], *, columns: int = 3):
    """Small multiples: one :func:`draw_failure` panel per ``(name, failure)``, one legend;
    returns the figure."""
    rows = -(-len(failures) // columns)
    size = max(len(f.expected_mask) for _, f in failures)
    fig, axes = plt.subplots(rows, columns, figsize=(BOOK_WIDTH, 2.35 * rows + 0.8),
                             squeeze=False)
    for ax, (name, failure) in zip(axes.flat, failures, strict=False):
        where = f"chunks {failure.schedule}"
        if any(failure.offsets):
            where += f"\nrows start {failure.offsets}"
        draw_failure(failure, title=f"{name}\n{where}", size=size, ax=ax)
    for ax in axes.flat[len(failures):]:
        ax.axis("off")
    fig.tight_layout(rect=(0, 0.1, 1, 1), w_pad=0.3, h_pad=0.6)
    handles = [Patch(facecolor=STATE_COLORS["visible"], label="seen, in the window"),
               Patch(facecolor=MISSED_COLOR, hatch="xx", edgecolor="white",
                     label="in the window, not seen"),
               Patch(facecolor=EXTRA_COLOR, hatch="//", edgecolor="white",
                     label="seen, outside the window"),
               Patch(facecolor="#E0E0E0", label="causal, outside the window"),
               Patch(facecolor=EXTRA_COLOR,
                     label="n: seen keys holding no token (none) or of another row (other)"),
               Patch(facecolor="none", edgecolor="black", label="the failing query")]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=9,
               bbox_to_anchor=(0.5, -0.01))
    return fig
