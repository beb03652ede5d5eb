"""ringviz.checks: every argument check accepts what it should and names what it refuses."""

import numpy as np
import pytest
import torch

from ringviz.cache import check_truncate
from ringviz.checks import (
    check_int,
    check_kv,
    check_positions,
    check_query,
    check_scale,
    check_sink_rope,
    check_sinks,
    check_tensor,
    missing_positions,
)
from ringviz.rope import apply_rope

CPU = torch.device("cpu")


@pytest.mark.parametrize(("value", "minimum", "error", "match"), [
    (True, 1, TypeError, "w must be an int, got bool"),
    (2.0, 1, TypeError, "got float"),
    ("3", 1, TypeError, "got str"),
    (0, 1, ValueError, "w must be >= 1, got 0"),
    (-1, 0, ValueError, ">= 0, got -1"),
])
def test_check_int_refuses_with_the_name(value, minimum, error, match):
    with pytest.raises(error, match=match):
        check_int("w", value, minimum)


def test_check_int_accepts_numpy_integers_and_returns_python_ints():
    got = check_int("w", np.int64(4))
    assert got == 4 and type(got) is int
    assert check_int("sinks", 0, minimum=0) == 0


@pytest.mark.parametrize(("scale", "error"), [(0, ValueError), (-1.0, ValueError),
                                              (float("inf"), ValueError), (True, TypeError),
                                              ("0.5", TypeError)])
def test_check_scale_refuses(scale, error):
    with pytest.raises(error, match="scale"):
        check_scale(scale)


def test_check_scale_accepts_none_and_reals():
    assert check_scale(None) is None and check_scale(np.float32(0.5)) == 0.5


def test_check_tensor_names_type_and_device():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        check_tensor("x", [1], CPU)
    with pytest.raises(ValueError, match="x is on meta"):
        check_tensor("x", torch.empty(1, device="meta"), CPU)


def test_check_kv_shapes_and_dtype():
    x = torch.zeros(2, 3, 4, 8)
    kw = {"batch_size": 2, "num_kv_heads": 3, "head_dim": 8, "dtype": x.dtype, "device": CPU}
    check_kv(x, x, **kw)
    with pytest.raises(TypeError, match="k has dtype torch.float64"):
        check_kv(x.double(), x, **kw)
    with pytest.raises(ValueError, match="T>=1"):
        check_kv(x[:, :, :0], x[:, :, :0], **kw)
    with pytest.raises(ValueError, match="k and v shapes differ"):
        check_kv(x, x[:, :, :2], **kw)


def test_check_query_heads_and_positions():
    q = torch.zeros(2, 6, 4, 8)
    kw = {"batch_size": 2, "num_kv_heads": 3, "head_dim": 8, "dtype": q.dtype, "device": CPU}
    check_query(q, 4, **kw, q_positions=torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="not a positive multiple of num_kv_heads=3"):
        check_query(q[:, :4], 4, **kw)
    with pytest.raises(ValueError, match=r"q must be \(B=2, Hq, T=5"):
        check_query(q, 5, **kw)
    check_query(q, 5, **kw, last=True)  # a chunk's last 4 of 5 queries
    with pytest.raises(ValueError, match=r"q must be \(B=2, Hq, T=1..3"):
        check_query(q, 3, **kw, last=True)
    with pytest.raises(ValueError, match="q_positions must be integer"):
        check_query(q, 4, **kw, q_positions=torch.zeros(2, 4))
    with pytest.raises(TypeError, match="q_positions must be a torch.Tensor"):
        check_query(q, 4, **kw, q_positions=[[0] * 4] * 2)


def test_check_positions_strictly_increasing_after_the_newest():
    newest = torch.tensor([3, -1])
    check_positions(torch.tensor([[4, -1, 6], [-1, 0, 1]]), newest, 3)
    with pytest.raises(ValueError, match="row 0: position 3 is not after"):
        check_positions(torch.tensor([[3, 4, 5], [0, 1, 2]]), newest, 3)
    with pytest.raises(ValueError, match="row 1: positions must strictly increase, got 0 after 1"):
        check_positions(torch.tensor([[4, 5, 6], [1, 0, 2]]), newest, 3)
    with pytest.raises(ValueError, match="-1 for padding"):
        check_positions(torch.tensor([[4, 5, -2], [0, 1, 2]]), newest, 3)
    with pytest.raises(TypeError, match="int64 or int32"):
        check_positions(torch.zeros(2, 3), newest, 3)
    with pytest.raises(ValueError, match=r"\(B, T\) = \(2, 2\)"):
        check_positions(torch.zeros(2, 3, dtype=torch.int64), newest, 2)


def test_check_truncate_and_missing_positions():
    stored = torch.tensor([[4, 5, 2, 3]])  # a ring of 4 after positions 0..5
    newest = torch.tensor([5])
    assert check_truncate(torch.tensor([5]), stored, newest, window=4, capacity=4).tolist() == [5]
    assert missing_positions(stored, torch.tensor([6]), window=4) == [[]]
    assert missing_positions(stored, torch.tensor([4]), window=4) == [[1]]
    with pytest.raises(ValueError, match=r"truncating to 3 leaves out position\(s\) \[0, 1\]"):
        check_truncate(torch.tensor([3]), stored, newest, window=4, capacity=4)
    with pytest.raises(ValueError, match="it has seen 6"):
        check_truncate(torch.tensor([7]), stored, newest, window=4, capacity=4)


def test_check_sink_rope_probes_a_rotation():
    assert check_sink_rope(None, 0, 4, torch.float32, CPU) is None
    assert check_sink_rope(apply_rope, 2, 4, torch.float32, CPU) is apply_rope
    with pytest.raises(ValueError, match="needs sinks >= 1"):
        check_sink_rope(apply_rope, 0, 4, torch.float32, CPU)
    with pytest.raises(ValueError, match="not a rotation"):
        check_sink_rope(lambda x, p: 2 * x, 2, 4, torch.float32, CPU)
    with pytest.raises(TypeError, match="failed on a"):
        check_sink_rope(lambda x, p: x @ x, 2, 4, torch.float32, CPU)
    with pytest.raises(TypeError, match="callable"):
        check_sink_rope("cache", 2, 4, torch.float32, CPU)


def test_sink_conventions():
    assert check_sinks(0, "absolute") == 0 and check_sinks(3, "cache") == 3
    with pytest.raises(ValueError, match="sink_convention must be one of"):
        check_sinks(2, None)
    with pytest.raises(ValueError, match="needs sinks >= 1"):
        check_sinks(0, "cache")
