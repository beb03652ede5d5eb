"""ringviz.conformance: correct caches pass, broken ones are caught with a small schedule."""

import pytest
import torch

from ringviz.conformance import Failure, Report, Schedule, Unsupported, check
from ringviz.conformance.adapters import (
    hf_dynamic_sliding,
    hf_static_sliding,
    mlx_batch_rotating,
    mlx_rotating,
    ringviz_hf,
    ringviz_ring,
)
from ringviz.conformance.pitfalls import PITFALLS
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
    # where in the cache's code: the innermost frames, the raise last, none of the kit's own
    frames = f.message.split("last frames, innermost last:\n")[1]
    assert frames.count('File "') == 2  # the wrapper's lambda, then boom (fewer than 3 here)
    assert "in boom" in frames and frames.rstrip().endswith('raise RuntimeError("chunk too long")')
    assert "probe.py" not in frames and "seam.py" not in frames
    assert "in boom" in str(report)


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


# ---------------------------------------------------------------- the pitfall catalogue
@pytest.mark.parametrize("name", list(PITFALLS))
def test_every_pitfall_is_caught_with_its_property_and_a_small_schedule(name):
    pitfall = PITFALLS[name]
    W, sinks, prop = 6, pitfall.sinks, pitfall.breaks
    report = check(pitfall.build(W), window=W, sinks=sinks, batch_size=pitfall.batch_size,
                   ragged=pitfall.ragged, examples=100)
    assert not report.ok and report.properties()[0] == prop, str(report)
    f = report.failures[0]
    assert sum(f.schedule) <= 2 * (W + sinks) + 2 and len(f.schedule) <= 3, str(f)
    if prop == "window":
        assert f.expected != f.seen or f.other_rows
        assert f.expected_mask != f.seen_mask or f.other_rows or -1 in f.seen
    else:
        assert f.max_error > 1e-3


def test_pitfalls_pass_where_their_bug_cannot_show():
    # the chunk bugs need a chunk; the shared ring needs two rows; padding needs ragged rows
    for name in ("chunk_first", "trim_chunk"):
        assert check(PITFALLS[name].build(5), window=5, max_chunk=1, examples=20).ok
    assert check(PITFALLS["shared_ring"].build(5), window=5, examples=20).ok
    assert check(PITFALLS["padding_in_slots"].build(5), window=5, batch_size=2,
                 examples=20).ok


# ---------------------------------------------------------------- peers
@pytest.mark.parametrize(("factory", "kwargs"), [
    (lambda: ringviz_hf(5), {"batch_size": 2, "ragged": True}),
    (lambda: ringviz_hf(5, 2), {"sinks": 2, "batch_size": 2, "ragged": True}),
    (lambda: hf_dynamic_sliding(5), {"batch_size": 2, "ragged": True}),
    (lambda: hf_static_sliding(5), {"batch_size": 2, "ragged": True}),
    (lambda: hf_static_sliding(5), {}),
])
def test_correct_peers_pass(factory, kwargs):
    report = check(factory(), window=5, examples=40, **kwargs)
    assert report.ok, str(report)


def test_mlx_rotating_without_sinks_passes():
    pytest.importorskip("mlx_lm")
    assert check(mlx_rotating(6), window=6, examples=60, dtype=torch.float32).ok
    assert check(mlx_rotating(6, window_size=6), window=6, examples=60, dtype=torch.float32).ok


def test_mlx_rotating_with_sinks_is_caught_and_the_kit_reads_mlx_own_mask():
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    report = check(mlx_rotating(8, keep=2), window=6, sinks=2, examples=100,
                   dtype=torch.float32)
    assert report.properties() == ["window"]
    f = report.failures[0]
    assert f.schedule == [9] and f.position == 8  # a first chunk longer than max_size
    # mlx's own mask for that chunk: a plain causal band of 8 keys, no sinks
    cache = RotatingKVCache(max_size=8, keep=2)
    mask = cache.make_mask(9)
    row = [int(i) for i, seen in enumerate(mx.array(mask)[8].tolist()) if seen]
    assert row == f.seen == [1, 2, 3, 4, 5, 6, 7, 8] and f.expected == [0, 1, 3, 4, 5, 6, 7, 8]
    # chunks of at most 4 after decode steps: the finding of the issue (sinks lost after a wrap)
    small = check(mlx_rotating(8, keep=2), window=6, sinks=2, examples=100,
                  dtype=torch.float32, max_chunk=4).failures[0]
    assert small.property == "window" and max(small.schedule) <= 4 and 0 not in small.seen


def test_mlx_batch_rotating_ragged_rows_are_caught():
    pytest.importorskip("mlx_lm")
    assert check(mlx_batch_rotating(6), window=6, batch_size=2, examples=40,
                 dtype=torch.float32).ok
    report = check(mlx_batch_rotating(6), window=6, batch_size=2, ragged=True,
                   dtype=torch.float32)
    f = report.failures[0]
    assert f.property == "window" and any(f.offsets) and report.skipped > 0
    assert set(f.seen) < set(f.expected)  # a key of the window hidden from a padded row
    # mlx itself, without the kit: the schedule it reports, each key valued by its column
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import BatchRotatingKVCache

    assert (f.schedule, f.offsets, f.row, f.position) == ([6, 1, 2], [0, 2], 1, 5)
    cache = BatchRotatingKVCache(6, left_padding=[0, 2])
    for cols in ([0, 1, 2, 3, 4, 5], [6], [7, 8]):
        k = mx.array(np.array(cols, dtype=np.float32).reshape(1, 1, -1, 1).repeat(2, 0))
        mask = np.array(cache.make_mask(len(cols), window_size=6))
        keys = np.array(cache.update_and_fetch(k, k)[0])[1, 0, :, 0].astype(int).tolist()
    seen_cols = [c for c, m in zip(keys, mask[1, 0, 0].tolist(), strict=True) if m]
    assert seen_cols == [c + 2 for c in f.seen]  # row 1 starts at column 2
    assert 2 in keys and 2 not in seen_cols  # its position 0 is held, and masked


def test_declined_schedules_are_skipped_and_counted():
    def picky(step, q, k, v, p):
        if q.shape[2] > 2:
            raise Unsupported("chunks of at most 2")
        return step(q, k, v, p)

    report = check(_wrapped(ringviz_ring(4), picky), window=4, examples=30)
    assert report.ok and report.skipped > 0 and "declined" in str(report)

    def never(step, q, k, v, p):
        raise Unsupported("nothing")

    report = check(_wrapped(ringviz_ring(4), never), window=4, examples=10)
    assert report.properties() == ["error"] and "declined every schedule" in \
        report.failures[0].message


def test_check_runs_on_every_device(device):
    report = check(ringviz_ring(4, sinks=1), window=4, sinks=1, batch_size=2, ragged=True,
                   examples=10, device=device)
    assert report.ok, str(report)


def test_a_cache_wrong_only_sometimes_is_reported_once_per_property():
    calls = iter(range(10**6))

    def sometimes(step, q, k, v, p):
        out = step(q, k, v, p)
        return out + 1 if next(calls) % 7 == 3 else out

    report = check(_wrapped(ringviz_ring(4), sometimes), window=4, examples=30)
    assert report.properties() == ["values"] and len(report.failures) == 1


def test_a_step_writing_into_its_inputs_cannot_fool_the_reference():
    def rotate_in_place(step, q, k, v, p):
        k.mul_(-1.0)  # the kit's own copy of k is untouched: the reference still sees +k
        return step(q, k, v, p)

    report = check(_wrapped(ringviz_ring(4), rotate_in_place), window=4, examples=20)
    assert report.properties() == ["values"]


def test_more_ids_than_head_dim_take_several_probes():
    from ringviz.conformance.probe import MAX_HEAD_DIM, probe_weights

    s = Schedule((30, 1, 9), (0, 3))  # 2 rows x 40 columns: 80 ids > 64 entries per probe
    assert s.batch_size * s.columns > MAX_HEAD_DIM
    pos = s.positions()
    w = probe_weights(ringviz_ring(5), s, pos, dtype=torch.float64,
                      device=torch.device("cpu"), gen=torch.Generator().manual_seed(0))
    assert w.shape == (2, 4, 40, 80)
    real = pos >= 0
    assert torch.allclose(w.sum(-1)[real[:, None].expand(2, 4, 40)],
                          torch.ones((), dtype=torch.float64))
    # row 1's last query (position 36) reads 1/5 on ids 40 + 35 .. 40 + 39, past the first probe
    assert torch.allclose(w[1, 0, 39, 75:80], torch.full((5,), 0.2, dtype=torch.float64))


def test_error_frames_keep_the_innermost_three():
    def deep(n):
        if n == 0:
            raise KeyError("slot")
        return deep(n - 1)

    report = check(_wrapped(ringviz_ring(4), lambda s, q, k, v, p: deep(5)), window=4,
                   examples=5)
    frames = report.failures[0].message.split("last frames, innermost last:\n")[1]
    assert frames.count('File "') == 3 and frames.count("in deep") == 3


# ---------------------------------------------------------------- padding outputs
def _nan_padding(step, q, k, v, p):
    return step(q, k, v, p).masked_fill((p < 0)[:, None, :, None], float("nan"))


def test_nan_in_a_padding_output_is_a_padding_failure():
    report = check(_wrapped(ringviz_ring(4), _nan_padding), window=4, batch_size=2,
                   ragged=True, examples=30)
    assert report.properties() == ["padding"], str(report)
    f = report.failures[0]
    # smallest: one column, row 1 padded: its query at column 0 (chunk 0) gave NaN
    assert (f.schedule, f.offsets, f.row, f.column, f.step, f.position, f.bad_value) == \
        ([1], [0, 1], 1, 0, 0, -1, "nan")
    text = str(f)
    assert "row 1, query at position -1 (column 0, chunk 0): its output holds nan" in text
    assert "-1: a padding token" in text
    # no padding, nothing to break: the same cache passes unragged
    assert check(_wrapped(ringviz_ring(4), _nan_padding), window=4, batch_size=2,
                 examples=20).ok


def test_inf_in_a_padding_output_is_named_inf():
    def inf_padding(step, q, k, v, p):
        return step(q, k, v, p).masked_fill((p < 0)[:, None, :, None], float("inf"))

    f = check(_wrapped(ringviz_ring(4), inf_padding), window=4, batch_size=2, ragged=True,
              examples=30).failures[0]
    assert f.property == "padding" and f.bad_value == "inf" and "holds inf" in str(f)


def test_every_broken_property_is_reported_each_with_its_own_schedule():
    # NaN at padding and a wrong scale: schedules without padding still show "values"
    def both(step, q, k, v, p):
        return _nan_padding(step, 2 * q, k, v, p)

    report = check(_wrapped(ringviz_ring(4), both), window=4, batch_size=2, ragged=True,
                   examples=60)
    assert report.properties() == ["padding", "values"], str(report)
    padding, values = report.failures
    assert padding.schedule == [1] and any(padding.offsets)
    assert values.schedule == [2] and not any(values.offsets)
    assert "2 properties broken" in str(report)


# ---------------------------------------------------------------- reports a person can act on
def test_window_text_shows_the_difference_and_explains_minus_one():
    off = check(PITFALLS["off_by_one"].build(6), window=6, examples=30).failures[0]
    assert off.difference() == ([0], [])
    assert "missing [0], extra none" in str(off) and "-1:" not in str(off)
    blank = check(PITFALLS["distance_rule"].build(6), window=6, examples=30).failures[0]
    missing, extra = blank.difference()
    assert not missing and extra == [-1] * 5  # empty slots of a ring that holds one token
    assert "missing none, extra [-1, -1, -1, -1, -1]" in str(blank)
    assert "-1: holds no token of the row" in str(blank)


def test_difference_counts_repeats():
    f = Failure("window", [3], [0], message="", expected=[0, 1, 2], seen=[1, 2, 2, -1])
    assert f.difference() == ([0], [-1, 2])


def _float32_inside(window):
    """A correct ring that computes in float32 whatever the check's dtype (as HF's eager
    attention does its softmax)."""
    make = ringviz_ring(window)

    def make_step(*, dtype, device, **shape):
        step = make(**shape, dtype=torch.float32, device=device)
        return lambda q, k, v, p: step(q.float(), k.float(), v.float(), p).to(dtype)

    return make_step


def test_float32_rounding_at_float64_hints_at_dtype_float32():
    report = check(_float32_inside(4), window=4, examples=20)
    assert report.properties() == ["values"] and report.failures[0].max_error < 1e-4
    assert report.dtype == "float64" and "dtype=torch.float32" in report.hint()
    assert str(report).splitlines()[-1].startswith("hint: ")
    assert check(_float32_inside(4), window=4, examples=20, dtype=torch.float32).ok
    # a real values bug (a wrong scale) gets no hint, nor does a check already at float32
    wrong = check(_wrapped(ringviz_ring(4), lambda s, q, k, v, p: s(2 * q, k, v, p)),
                  window=4, examples=20)
    assert wrong.properties() == ["values"] and wrong.hint() is None
    assert "hint" not in str(wrong)
    small = Failure("values", [1], [0], message="", max_error=5e-8)
    assert Report([small], examples=1, window=4, dtype="float32").hint() is None
    assert Report([small], examples=1, window=4).hint() is not None


def test_a_ring_broken_twice_is_reported_for_both_properties():
    """One stale key once the ring is full (W + 1 slots) and, in the same chunks, outputs
    scaled by 1.01: every schedule that breaks one breaks the other, and the queries of such
    a chunk that saw the right keys still break "values"."""
    W = 4

    def stale_and_scaled(step, q, k, v, p):
        out = step(q, k, v, p)
        return out * 1.01 if int(p.max()) >= W else out

    report = check(_wrapped(ringviz_ring(W + 1), stale_and_scaled), window=W, examples=60)
    assert report.properties() == ["window", "values"], str(report)
    window, values = report.failures
    assert window.difference() == ([], [window.position - W])  # the stale key
    assert values.position < W <= max(sum(values.schedule) - 1, 0)
    assert 1e-3 < values.max_error and "values:" in str(report)
