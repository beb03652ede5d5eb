"""Masks, RoPE angles, memory and latency: the charts around the ring.

Each function takes ``ax=None`` and returns the axes. Mask colours come from
:func:`ringviz.book.trace.slot_states` (the window rule, :func:`ringviz.masks.visible`).
``plot_memory`` and ``plot_latency`` take lists of dict rows (one measurement each), the shape
the benchmarks write.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from ringviz.book.draw import _axes, _bare, _frame, _row, slot_box
from ringviz.book.style import BOOK_WIDTH, EDGE_COLOR, OKABE_ITO, STATE_COLORS
from ringviz.book.trace import SLOT_STATES, Trace, slot_states


def _state_legend(ax: Axes, states: Sequence[str], **kwargs) -> None:
    ax.legend(handles=[Patch(facecolor=STATE_COLORS[s], edgecolor=EDGE_COLOR, label=s)
                       for s in states], **kwargs)


def draw_decode_mask(query_pos: int, positions: Sequence[int], window: int, *,
                     ax: Axes | None = None) -> Axes:
    """One query's view of the cache slots: visible, stale, future or empty (chapter 5)."""
    states = slot_states(query_pos, np.asarray(positions, dtype=np.int64), window)
    ax = _axes(ax, (BOOK_WIDTH, 1.4))
    for s, (pos, state) in enumerate(zip(positions, states, strict=True)):
        slot_box(ax, s, 0, pos, STATE_COLORS[state])
    ax.set_xlim(0, len(positions))
    ax.set_ylim(-0.1, 0.9)
    ax.set_xticks(np.arange(len(positions)) + 0.5, [str(s) for s in range(len(positions))])
    ax.set_xlabel("slot (number = token position stored there)")
    ax.set_yticks([])
    ax.spines[["left", "top", "right"]].set_visible(False)
    ax.set_title(f"decode mask for the query at position {query_pos}, W={window}: "
                 f"sees {max(0, query_pos - window + 1)}..{query_pos}", loc="left", fontsize=10)
    _state_legend(ax, [s for s in SLOT_STATES if s in states], loc="upper center",
                  bbox_to_anchor=(0.5, -0.55), ncol=4)
    return ax


def draw_band_mask(q_positions: Sequence[int], k_positions: Sequence[int], window: int, *,
                   ax: Axes | None = None) -> Axes:
    """Heatmap of queries (rows) x keys (columns): visible / stale / future / empty (ch. 5)."""
    if len(q_positions) == 0 or len(k_positions) == 0:
        raise ValueError("draw_band_mask needs at least one query and one key position")
    keys = np.asarray(k_positions, dtype=np.int64)
    codes = np.array([[SLOT_STATES.index(s) for s in slot_states(int(q), keys, window)]
                      for q in q_positions])  # (Tq, Tk)
    ax = _axes(ax, (min(BOOK_WIDTH, 1.5 + 0.3 * len(keys)), 1.2 + 0.3 * len(q_positions)))
    cmap = ListedColormap([STATE_COLORS[s] for s in SLOT_STATES])
    ax.imshow(codes, cmap=cmap, vmin=-0.5, vmax=len(SLOT_STATES) - 0.5, aspect="equal")
    ax.set_xticks(range(len(keys)), [str(k) for k in keys], fontsize=7)
    ax.set_yticks(range(len(q_positions)), [str(q) for q in q_positions], fontsize=7)
    ax.set_xticks(np.arange(len(keys) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(len(q_positions) + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(f"band mask, W={window}", fontsize=10)
    present = [s for i, s in enumerate(SLOT_STATES) if (codes == i).any()]
    _state_legend(ax, present, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def draw_rope_angles(trace: Trace, frame: int = -1, *, row: int = 0,
                     ax: Axes | None = None) -> Axes:
    """Per slot, the RoPE angle of the stored key at its absolute position vs at its slot index.

    They agree until the first wrap-around; after it, rotating by slot index gives the key the
    angle of a token ``window`` (or a multiple of it) positions later.
    """
    f, row = _frame(trace, frame), _row(trace, row)
    if not f.rope_abs:
        raise ValueError("this trace records no RoPE angles (a shift trace?)")
    ax = _axes(ax, (BOOK_WIDTH, 2.6))
    slots = np.arange(trace.window)
    by_pos = np.array(f.rope_abs[row], dtype=float)  # None (an empty slot) -> nan
    by_slot = np.array(f.rope_slot[row], dtype=float)
    width = 0.38
    ax.bar(slots - width / 2, by_pos, width, color=OKABE_ITO["blue"],
           label="absolute position (correct)")
    ax.bar(slots + width / 2, by_slot, width, color=OKABE_ITO["vermillion"],
           label="slot index (wrong after wrap)")
    for s, pos in enumerate(f.positions[row]):
        if pos >= 0:
            ax.text(s, 2 * np.pi * 1.02, f"pos {pos}", ha="center", fontsize=7)
    pair = trace.scenario.get("rope_pair", 0)
    ax.set_xticks(slots, [str(s) for s in slots])
    ax.set_xlabel("slot")
    ax.set_yticks([0, np.pi, 2 * np.pi], ["0", "π", "2π"])
    ax.set_ylim(0, 2 * np.pi * 1.12)
    ax.set_ylabel(f"angle of pair {pair}\n(mod 2π)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2)
    return ax


def _rotation_panel(ax: Axes, query_pos: int, key_pos: int, key_angle_pos: int,
                    step: float, title: str, color: str) -> None:
    """Unit circle with the query and key of one RoPE pair as arrows, and the arc between them."""
    ax.add_patch(plt.Circle((0, 0), 1.0, fill=False, color=EDGE_COLOR, lw=0.8, ls=":"))
    for p in range(query_pos + 1):  # where each position would put a vector: the dial
        a = p * step
        ax.plot([0.93 * np.cos(a), 1.0 * np.cos(a)], [0.93 * np.sin(a), 1.0 * np.sin(a)],
                color=EDGE_COLOR, lw=0.8, marker="none", ls="-")
        ax.text(1.14 * np.cos(a), 1.14 * np.sin(a), str(p), ha="center", va="center",
                fontsize=9, color=EDGE_COLOR)
    aq, ak = query_pos * step, key_angle_pos * step
    for a, c in ((aq, OKABE_ITO["blue"]), (ak, color)):
        ax.annotate("", (0.85 * np.cos(a), 0.85 * np.sin(a)), (0, 0),
                    arrowprops={"arrowstyle": "-|>", "color": c, "lw": 2.2})
    arc = np.linspace(ak, aq, 40)
    ax.plot(0.35 * np.cos(arc), 0.35 * np.sin(arc), color=color, lw=1.5, ls="-", marker="none")
    ax.text(0, -1.5, f"blue: query at {query_pos}; key at {key_pos}, turned as {key_angle_pos}\n"
            f"angle between them: {query_pos - key_angle_pos} steps,\n"
            f"the score of a key {query_pos - key_angle_pos} tokens back", ha="center",
            va="center", fontsize=10, color=color)
    _bare(ax, (-1.3, 1.3), (-1.9, 1.3))
    ax.set_title(title, fontsize=11)


def draw_rotation(query_pos: int, key_pos: int, window: int, *, step: float = np.pi / 7,
                  axes: Sequence[Axes] | None = None) -> Sequence[Axes]:
    """One RoPE pair of a key and a query: rotated at the absolute position vs at the slot (ch. 4).

    Each position turns the pair by ``step`` radians. The score only sees the angle between
    query and key; rotated at its slot ``key_pos % window`` a key looks ``query_pos - slot``
    tokens back instead of ``query_pos - key_pos``.
    """
    if not 0 <= key_pos <= query_pos or window <= 0:
        raise ValueError(f"need 0 <= key_pos <= query_pos and window > 0, got key_pos={key_pos},"
                         f" query_pos={query_pos}, window={window}")
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(BOOK_WIDTH, 3.9))
    slot = key_pos % window
    _rotation_panel(axes[0], query_pos, key_pos, key_pos, step,
                    f"rotated at its position {key_pos} (right)", OKABE_ITO["green"])
    _rotation_panel(axes[1], query_pos, key_pos, slot, step,
                    f"rotated at its slot {key_pos} % {window} = {slot} (wrong)",
                    OKABE_ITO["vermillion"])
    return axes


def _chart(rows: Sequence[dict], x: str, y: str, group: str, ax: Axes | None, name: str,
           xlabel: str, ylabel: str) -> Axes:
    """One line per ``group`` value, points sorted by ``x``; colour, marker and dash from the
    style's cycle (``style.line_cycle``), so no two lines differ by hue alone."""
    if not rows:
        raise ValueError(f"{name} needs at least one row")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise TypeError(f"{name}: row {i} must be a dict, got {type(r).__name__}")
        missing = [k for k in (x, y, group) if k not in r]
        if missing:
            raise ValueError(f"{name}: row {i} lacks key(s) {missing}; has {sorted(r)}")
    ax = _axes(ax, (BOOK_WIDTH, 3.0))
    for label in dict.fromkeys(r[group] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[group] == label)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=str(label))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    return ax


def plot_memory(rows: Sequence[dict], *, x: str = "tokens", y: str = "bytes",
                group: str = "cache", ax: Axes | None = None) -> Axes:
    """Cache memory vs tokens processed, one line per cache (e.g. growing vs ring).

    ``rows``: e.g. ``[{"cache": "ring", "tokens": 512, "bytes": 65536}, ...]``.
    """
    return _chart(rows, x, y, group, ax, "plot_memory",
                  "tokens processed" if x == "tokens" else x,
                  "cache memory (bytes)" if y == "bytes" else y)


def plot_latency(rows: Sequence[dict], *, x: str = "window", y: str = "ms_per_token",
                 group: str = "method", logx: bool = True, ax: Axes | None = None) -> Axes:
    """Per-token latency vs window size, one line per method (ring, shift-copy, HF layers...).

    ``rows``: e.g. ``[{"method": "ring", "window": 512, "ms_per_token": 0.21}, ...]``.
    Used by ``ringviz.bench.report`` (chapter 9).
    """
    ax = _chart(rows, x, y, group, ax, "plot_latency", "window W (slots)" if x == "window" else x,
                "ms per token" if y == "ms_per_token" else y)
    if logx:
        ax.set_xscale("log", base=2)
    return ax
