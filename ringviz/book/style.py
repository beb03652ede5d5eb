"""One look for every figure: the Okabe-Ito colour-blind-safe palette, sized for the book column.

Figures render as SVG in notebooks and the book (crisp on high-DPI screens); lines differ in
colour *and* in marker and dash, so no two series depend on telling similar hues apart.

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
    "sink": OKABE_ITO["purple"],  # an attention-sink slot: kept for good, seen by every query
}
WRITE_COLOR = OKABE_ITO["orange"]  # slot written in this step, write pointer
START_COLOR = OKABE_ITO["green"]  # start pointer: oldest visible entry
EVICT_COLOR = OKABE_ITO["vermillion"]  # tokens that left the cache
EDGE_COLOR = "#555555"

BOOK_WIDTH = 7.0  # inches: a full-width figure in the book's text column

# Line series: orange and vermillion, the two warm hues, are never neighbours in the cycle, and
# every series also has its own marker and dash pattern.
LINE_COLORS = [OKABE_ITO[c] for c in (
    "blue", "orange", "green", "purple", "black", "vermillion", "sky", "yellow")]
LINE_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
LINE_DASHES = ["-", "--", "-.", ":", "-", "--", "-.", ":"]
# markers at most every 6% of the axes' diagonal: a dense line gets a few, a sparse one all
MARK_EVERY = 0.06


def line_cycle() -> mpl.cycler:
    """Colour, marker and dash together: series stay distinct in greyscale or to a colour-blind eye.

    >>> [s["color"] for s in line_cycle()][:2]
    ['#0072B2', '#E69F00']
    """
    return (mpl.cycler(color=LINE_COLORS) + mpl.cycler(marker=LINE_MARKERS)
            + mpl.cycler(linestyle=LINE_DASHES) + mpl.cycler(markevery=[MARK_EVERY] * 8))


def _inline_svg() -> None:
    """Inside IPython (a notebook, the book's build) show figures as SVG, sharp at any zoom."""
    from IPython import get_ipython

    if get_ipython() is not None:
        from matplotlib_inline.backend_inline import set_matplotlib_formats

        set_matplotlib_formats("svg")


def set_style() -> None:
    """Apply ringviz's matplotlib defaults: palette, line cycle, text readable at book width.

    A 7-inch figure is shown about 730 px wide in the book's column, so 11-point text is about
    11 px on screen, ticks 10 px: the smallest sizes used.
    """
    mpl.rcParams.update({
        "figure.figsize": (BOOK_WIDTH, 3.0),
        "figure.dpi": 100,
        "savefig.dpi": 200,  # PNGs written by the CLI: 2x for high-DPI screens
        "savefig.bbox": "tight",
        "svg.fonttype": "path",  # the same glyphs on every reader's machine
        "font.size": 11,
        "axes.titlesize": 12,
        "axes.labelsize": 11,
        "xtick.labelsize": 10,
        "ytick.labelsize": 10,
        "legend.fontsize": 10,
        "legend.frameon": False,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.grid": False,
        "axes.prop_cycle": line_cycle(),
        "lines.linewidth": 1.8,
        "lines.markersize": 5,
    })
    _inline_svg()
