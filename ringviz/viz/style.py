"""One look for every figure: the Okabe-Ito colour-blind-safe palette, sized for the book column.

State colours are shared with the stepper's JavaScript view (passed to it in the widget state),
so a slot means the same thing in a static figure and in a widget.
"""

from __future__ import annotations

import matplotlib as mpl

# Okabe & Ito (2008), "Color Universal Design": distinguishable with every common colour deficit.
OKABE_ITO = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky": "#56B4E9",
    "green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "purple": "#CC79A7",
}

# what a slot (or a key) is, for the query being shown
STATE_COLORS = {
    "visible": "#56B4E9",  # sky: attended
    "stale": "#D55E00",  # vermillion: still stored, older than the window
    "future": "#F0E442",  # yellow: after the query (causal mask)
    "empty": "#FFFFFF",  # white with a grey outline: nothing there yet
}
WRITE_COLOR = OKABE_ITO["orange"]  # slot written in this step, write pointer
START_COLOR = OKABE_ITO["green"]  # start pointer: oldest visible entry
EVICT_COLOR = OKABE_ITO["vermillion"]  # tokens that left the cache
EDGE_COLOR = "#555555"

BOOK_WIDTH = 7.0  # inches: a full-width figure in the book's text column


def set_style() -> None:
    """Apply ringviz's matplotlib defaults (palette, sizes readable at book width)."""
    mpl.rcParams.update({
        "figure.figsize": (BOOK_WIDTH, 3.0),
        "figure.dpi": 110,
        "savefig.dpi": 150,
        "savefig.bbox": "tight",
        "font.size": 10,
        "axes.titlesize": 11,
        "axes.labelsize": 10,
        "legend.fontsize": 9,
        "legend.frameon": False,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.grid": False,
        "axes.prop_cycle": mpl.cycler(color=[OKABE_ITO[c] for c in (
            "blue", "orange", "green", "vermillion", "purple", "sky", "yellow", "black")]),
        "lines.linewidth": 1.8,
        "lines.markersize": 5,
    })
