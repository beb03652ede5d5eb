"""The draft/verify picture shows the recorded ring states, coloured for the next query."""

from __future__ import annotations

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.patches import Rectangle

from ringviz.book.draft import FILLS, draw_draft_rows
from ringviz.book.speculative import OverwritingRing
from ringviz.book.style import WRITE_COLOR


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def recorded_cycle():
    ring = OverwritingRing(1, 1, 4, 2, 2)
    x = torch.zeros(1, 1, 6, 2)
    ring.prefill(x, x, x, torch.arange(6)[None])
    rows = [("prompt", ring.cache.positions[0].tolist())]
    ring.verify(x[:, :, :3], x[:, :, :3], x[:, :, :3], torch.arange(6, 9)[None])
    rows.append(("verify", ring.cache.positions[0].tolist()))
    ring.commit(torch.tensor([1]))
    rows.append(("commit", ring.cache.positions[0].tolist()))
    return rows


def test_rows_show_positions_roles_and_writes():
    rows = recorded_cycle()  # [4 5 2 3], [8 5 6 7], [-1 5 6 -1]
    ax = draw_draft_rows(rows, window=4, query=7, notes=["", "overwrote 2, 3, 4", "4 lost"])
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(boxes) == 12
    fills = [mcolors.to_hex(b.get_facecolor()).upper() for b in boxes]
    role = {v.upper(): k for k, v in FILLS.items()}
    assert [role[f] for f in fills[4:8]] == ["rejected draft", "needed", "needed",
                                             "rejected draft"]
    assert role[fills[0]] == "needed" and role[fills[2]] == "older than its window"
    written = [mcolors.to_hex(b.get_edgecolor()).upper() == WRITE_COLOR for b in boxes]
    assert written == [False] * 4 + [True, False, True, True] + [False] * 4
    texts = [t.get_text() for t in ax.texts]
    assert {"prompt", "verify", "commit", "overwrote 2, 3, 4", "4 lost"} <= set(texts)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "needed by query 7" in legend and "just written" in legend


def test_bad_rows_raise():
    with pytest.raises(ValueError, match="one note per row"):
        draw_draft_rows([("a", [0, 1])], window=2, query=2, notes=["x", "y"])
    with pytest.raises(ValueError, match="at least one row"):
        draw_draft_rows([], window=2, query=2)
    with pytest.raises(ValueError, match="window must be >= 1"):
        draw_draft_rows([("a", [0])], window=0, query=1)
