"""Pictures of a draft/verify cycle (chapter 13): ring states stacked, coloured for one query.

The states are recorded from a real ring (``ring.cache.positions`` after each call of a
:mod:`ringviz.book.speculative` engine); nothing here computes ring state.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.axes import Axes

from ringviz.book.draw import _axes, _bare, slot_box, slot_legend
from ringviz.book.style import BOOK_WIDTH, EDGE_COLOR, EVICT_COLOR, STATE_COLORS
from ringviz.checks import check_int
from ringviz.masks import visible

PITCH = 1.5  # vertical distance between rows
FILLS = {  # what a stored position is for the next query
    "needed": STATE_COLORS["visible"],
    "older than its window": STATE_COLORS["stale"],
    "rejected draft": STATE_COLORS["future"],
    "empty": STATE_COLORS["empty"],
}


def slot_role(pos: int, query: int, window: int) -> str:
    """What the key at ``pos`` is to the query at ``query``: a key of :data:`FILLS`.

    >>> [slot_role(p, 12, 8) for p in (-1, 4, 5, 11, 13)]
    ['empty', 'older than its window', 'needed', 'needed', 'rejected draft']
    """
    if pos < 0:
        return "empty"
    if pos >= query:
        return "rejected draft"
    return "needed" if visible(query, pos, window) else "older than its window"


def draw_draft_rows(rows: Sequence[tuple[str, Sequence[int]]], *, window: int, query: int,
                    notes: Sequence[str] = (), ax: Axes | None = None) -> Axes:
    """Ring states top to bottom, each slot filled by its role for the query at ``query``.

    ``rows``: (label, position held by each slot, -1 = empty). An orange edge marks a slot
    whose position changed from the row above; ``notes`` (one per row, may be "") are written
    under the row in vermillion.
    """
    check_int("window", window)
    check_int("query", query, 0)
    if not rows or (notes and len(notes) != len(rows)):
        raise ValueError(f"need at least one row and one note per row, got {len(rows)} rows "
                         f"and {len(notes)} notes")
    width = max(len(pos) for _, pos in rows)
    ax = _axes(ax, (BOOK_WIDTH, 0.95 * len(rows) + 0.9))
    above: Sequence[int] = ()
    for r, (label, positions) in enumerate(rows):
        y = -r * PITCH
        ax.text(-0.25, y + 0.4, label, ha="right", va="center", fontsize=11)
        if r == 0:
            ax.text(-0.25, y + 0.9, "slot", ha="right", va="bottom", fontsize=10,
                    color=EDGE_COLOR)
        for s, pos in enumerate(positions):
            changed = r > 0 and (s >= len(above) or above[s] != pos) and pos >= 0
            slot_box(ax, s, y, pos, FILLS[slot_role(pos, query, window)], written=changed,
                     fontsize=11)
            if r == 0:
                ax.text(s + 0.5, y + 0.9, str(s), ha="center", va="bottom", fontsize=10,
                        color=EDGE_COLOR)
        if notes and notes[r]:
            ax.text(0.04, y - 0.12, notes[r], ha="left", va="top", fontsize=10.5,
                    color=EVICT_COLOR)
        above = positions
    _bare(ax, (-4.2, width + 0.2), (-(len(rows) - 1) * PITCH - 0.75, 1.3), equal=False)
    fills = {f"{n} by query {query}" if n == "needed" else n: c for n, c in FILLS.items()}
    slot_legend(ax, fills, written="just written", y=0.0, ncol=3, fontsize=10)
    return ax
