"""Chapter 14's pictures draw what they are given: a probe's measured output, a Failure's grids."""

import matplotlib.pyplot as plt
import pytest

from ringviz.book.conform import draw_failure, draw_probe, failure_grid
from ringviz.conformance import Failure, check
from ringviz.conformance.pitfalls import PITFALLS


@pytest.fixture(scope="module")
def failures():
    return {name: check(PITFALLS[name].build(4), window=4, batch_size=PITFALLS[name].batch_size,
                        ragged=PITFALLS[name].ragged, examples=40).failures[0]
            for name in ("off_by_one", "distance_rule", "shared_ring")}


def test_failure_grid_counts_keys_outside_the_row(failures):
    blank = failures["distance_rule"]
    assert blank.seen_blank[blank.position] == blank.seen.count(-1) == 3  # empty slots of W=4
    other = failures["shared_ring"]
    assert other.seen_other_rows[other.position] == len(other.other_rows) >= 1
    fig = failure_grid(list(failures.items()), columns=2)
    assert len(fig.axes) == 4 and not fig.axes[3].axison  # three panels, one blank
    # every panel draws one cell per expected-or-seen pair, plus the count cells
    ax = fig.axes[0]
    f = failures["off_by_one"]
    cells = sum(e or s for er, sr in zip(f.expected_mask, f.seen_mask)
                for e, s in zip(er, sr))
    filled = [p for p in ax.patches if p.get_fill() and p.get_facecolor()[:3] != (
        0.9333333333333333, 0.9333333333333333, 0.9333333333333333)]
    assert len(filled) == cells
    plt.close("all")


def test_draw_failure_rejects_other_properties():
    with pytest.raises(ValueError, match="window failures"):
        draw_failure(Failure("values", [2], [0], message="", max_error=1.0))


def test_draw_probe_checks_lengths():
    with pytest.raises(ValueError, match="weights"):
        draw_probe([0, 1], [0.5], [0.5, 0.5], query=1)
    ax = draw_probe([0, 1, -1], [0.5, 0.5, 0.0], [0.5, 0.5], query=1)
    assert ax.get_title(loc="left") == "zero query at position 1"
    plt.close("all")
