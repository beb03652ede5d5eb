"""check(layout="rows"): each row's real tokens only, as a server takes them."""

import pytest
import torch

from ringviz.conformance import Schedule, check
from ringviz.conformance.adapters import RowsStep, ringviz_ring, ringviz_rows
from ringviz.conformance.probe import evaluate


@pytest.mark.parametrize(("sinks", "batch_size", "ragged"), [(0, 1, False), (2, 3, True)])
def test_a_ring_per_row_passes_with_no_padding_code(sinks, batch_size, ragged):
    report = check(ringviz_rows(5, sinks=sinks), window=5, sinks=sinks, batch_size=batch_size,
                   ragged=ragged, layout="rows", examples=25)
    assert report.ok and report.layout == "rows", str(report)
    assert "rows layout" in str(report) and report.to_dict()["layout"] == "rows"


def test_the_step_gets_each_rows_real_tokens_and_empty_rows_before_they_start():
    seen = []

    def make_step(**shape):
        def step(q, k, v, positions):
            seen.append([tuple(p.tolist()) for p in positions])
            D = q[0].shape[-1]
            assert [tuple(x.shape) for x in q] == [(4, len(p), D) for p in positions]
            assert [tuple(x.shape) for x in k] == [(2, len(p), D) for p in positions]
            return [torch.zeros_like(x) for x in q]
        return step

    evaluate(make_step, Schedule((2, 3), (0, 3)), window=4, sinks=0, dtype=torch.float64,
             device=torch.device("cpu"), seed=0, layout="rows")
    assert seen[:2] == [[(0, 1), ()], [(2, 3, 4), (0, 1)]]  # row 1 starts at column 3


def test_rows_mixed_up_are_caught_as_other_rows():
    class Crosstalk(RowsStep):  # row b's ring gets the next row's keys
        def __call__(self, q, k, v, positions):
            return super().__call__(q, k[1:] + k[:1], v[1:] + v[:1], positions)

    def make_step(**shape):
        return Crosstalk(ringviz_rows(4)(**shape).rings)

    report = check(make_step, window=4, batch_size=2, layout="rows", examples=30)
    f = report.failures[0]
    assert f.property == "window" and f.other_rows, str(report)


def test_rows_rewind_together_and_a_row_left_behind_is_caught():
    report = check(ringviz_rows(5, sinks=1, drafts=2), window=5, sinks=1, batch_size=2,
                   ragged=True, layout="rows", rewind=True, examples=40)
    assert report.ok and report.rewind, str(report)

    class FirstRowOnly(RowsStep):
        def rewind(self, n):
            RowsStep(self.rings[:1]).rewind(n)

    def make_step(**shape):
        return FirstRowOnly(ringviz_rows(5, drafts=2)(**shape).rings)

    report = check(make_step, window=5, batch_size=2, layout="rows", rewind=True, examples=40)
    f = report.failures[0]  # row 1's ring refuses the positions it still holds
    assert f.property == "error" and f.rewinds and "not after the row's cached" in f.message


def test_a_padded_step_in_the_rows_layout_is_an_error_and_bad_layouts_raise():
    report = check(ringviz_ring(4), window=4, layout="rows", examples=5)
    f = report.failures[0]
    assert f.property == "error" and "got list" in f.message, str(report)
    with pytest.raises(ValueError, match="layout"):
        check(ringviz_ring(4), window=4, layout="packed")


def test_a_rows_step_that_drops_a_row_is_an_error():
    class Dropped(RowsStep):
        def __call__(self, q, k, v, positions):
            return super().__call__(q, k, v, positions)[:-1]

    report = check(lambda **shape: Dropped(ringviz_rows(4)(**shape).rings), window=4,
                   batch_size=2, layout="rows", examples=5)
    f = report.failures[0]
    assert f.property == "error" and "expected a list of 2 tensors" in f.message, str(report)
