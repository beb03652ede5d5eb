"""ringviz.conformance: correct caches pass, broken ones are caught with a small schedule."""

import pytest
import torch

from ringviz.conformance import Failure, Report, Schedule, check
from ringviz.conformance.adapters import ringviz_ring
from ringviz.conformance.probe import read_seen


@pytest.mark.parametrize(("sinks", "batch_size", "ragged"),
                         [(0, 1, False), (2, 1, False), (0, 3, True), (2, 3, True),
                          (1, 2, False)])
def test_ringviz_ring_passes(sinks, batch_size, ragged):
    report = check(ringviz_ring(5, sinks=sinks), window=5, sinks=sinks, batch_size=batch_size,
                   ragged=ragged, examples=25)
    assert report.ok, str(report)
    assert report.examples == 25
    assert str(report).startswith("PASS")


def test_float32_ring_passes_at_float32_tolerance():
    assert check(ringviz_ring(4), window=4, examples=15, dtype=torch.float32).ok


def test_window_one_smaller_is_caught_at_the_edge():
    report = check(ringviz_ring(5), window=6, examples=50)
    assert not report.ok and report.properties() == ["window"]
    f = report.failures[0]
    # the smallest schedule that shows it: six tokens in one chunk, query 5 misses key 0
    assert f.schedule == [6] and f.offsets == [0]
    assert (f.row, f.position, f.expected, f.seen) == (0, 5, [0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    assert f.expected_mask[5] == [True] * 6 and f.seen_mask[5] == [False] + [True] * 5
    assert "window" in str(report) and "[6]" in str(report)


def test_missing_sinks_are_caught():
    report = check(ringviz_ring(4), window=4, sinks=1, examples=50)
    f = report.failures[0]
    assert f.property == "window" and f.expected[0] == 0 and 0 not in f.seen
    assert sum(f.schedule) == 5  # the first query past window + sinks


def _wrapped(inner, fn):
    def make_step(**shape):
        step = inner(**shape)
        return lambda q, k, v, positions: fn(step, q, k, v, positions)
    return make_step


def test_wrong_scale_is_a_values_failure():
    report = check(_wrapped(ringviz_ring(4), lambda s, q, k, v, p: s(2 * q, k, v, p)),
                   window=4, examples=30)
    assert report.properties() == ["values"]
    f = report.failures[0]
    assert sum(f.schedule) == 2 and f.position == 1 and f.max_error > 1e-3  # smallest: 2 keys


def test_a_step_that_raises_is_reported_not_propagated():
    def boom(step, q, k, v, p):
        if q.shape[2] > 3:
            raise RuntimeError("chunk too long")
        return step(q, k, v, p)

    report = check(_wrapped(ringviz_ring(4), boom), window=4, examples=30)
    assert report.properties() == ["error"]
    f = report.failures[0]
    assert f.schedule == [4] and f.step == 0 and "RuntimeError: chunk too long" in f.message


def test_wrong_shape_is_an_error():
    report = check(_wrapped(ringviz_ring(4), lambda s, q, k, v, p: s(q, k, v, p)[:, :1]),
                   window=4, examples=10)
    f = report.failures[0]
    assert f.property == "error" and "shape" in f.message and f.schedule == [1]


def test_max_chunk_caps_every_chunk_and_same_seed_same_report():
    sizes = []

    def record(step, q, k, v, p):
        sizes.append(q.shape[2])
        return step(q, k, v, p)

    report = check(_wrapped(ringviz_ring(3), record), window=3, max_chunk=1, examples=20)
    assert report.ok and set(sizes) == {1}
    sizes.clear()
    check(_wrapped(ringviz_ring(3), record), window=3, max_chunk=2, examples=20)
    assert set(sizes) == {1, 2}
    a = check(ringviz_ring(3), window=4, examples=20, seed=7)
    b = check(ringviz_ring(3), window=4, examples=20, seed=7)
    assert a.failures == b.failures and a.examples == b.examples


def test_rows_mixed_up_are_seen_as_other_rows():
    def swap_rows(step, q, k, v, p):
        return step(q, k.flip(0), v.flip(0), p)

    report = check(_wrapped(ringviz_ring(4), swap_rows), window=4, batch_size=2, examples=20)
    f = report.failures[0]
    assert f.property == "window" and f.other_rows and f.seen == []


def test_read_seen_counts_duplicates_and_blank_keys():
    w = torch.tensor([0.25, 0.5, 0.0, 0.0])  # id 1 twice, one key with no id: K = 4
    assert read_seen(w, 1e-9) == ({0: 1, 1: 2}, 1)
    assert read_seen(torch.full((3,), float("nan")), 1e-9) == ({}, 0)


def test_schedule_positions_left_pad():
    s = Schedule((2, 1), (1, 0))
    assert s.positions().tolist() == [[-1, 0, 1], [0, 1, 2]]
    assert s.bounds() == [(0, 2), (2, 3)]


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"window": 0}, ValueError), ({"window": 4, "sinks": -1}, ValueError),
    ({"window": 4, "ragged": True}, ValueError), ({"window": 4, "examples": 0}, ValueError),
    ({"window": 4, "dtype": torch.int64}, TypeError), ({"window": 4, "max_chunk": 0}, ValueError),
    ({"window": 2.5}, TypeError), ({"window": 4, "ragged": 1}, TypeError),
])
def test_bad_arguments_raise(kwargs, error):
    with pytest.raises(error):
        check(ringviz_ring(4), **kwargs)
    with pytest.raises(TypeError, match="make_step"):
        check(None, window=4)


def test_failure_rejects_unknown_property_and_report_dict():
    with pytest.raises(ValueError, match="property"):
        Failure("speed", [1], [0], message="")
    d = Report(failures=[], examples=3, window=4).to_dict()
    assert d["ok"] and d["examples"] == 3
