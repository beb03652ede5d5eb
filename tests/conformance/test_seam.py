"""The seam: the kit tells a make_step its dtype and device; old make_steps keep working."""

import pytest
import torch

from ringviz.conformance import check
from ringviz.conformance.adapters import ringviz_ring
from ringviz.conformance.peers import PEERS
from ringviz.conformance.seam import StepSpec, build_keywords, make, prebuilt


def _recording(calls: list[dict], inner=None):
    """A make_step that names every keyword and records what the kit passed."""
    inner = inner or ringviz_ring(4)

    def make_step(*, batch_size, num_heads, num_kv_heads, head_dim, dtype, device):
        calls.append({"dtype": dtype, "device": device, "batch_size": batch_size})
        return inner(batch_size=batch_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, dtype=dtype, device=device)

    return make_step


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_kit_passes_its_dtype_and_device(dtype, device):
    calls: list[dict] = []
    assert check(_recording(calls), window=4, batch_size=2, examples=5, dtype=dtype,
                 device=device).ok
    assert calls and all(c["dtype"] is dtype and c["device"] == device
                         and c["batch_size"] == 2 for c in calls)


def test_a_make_step_of_the_four_shapes_alone_still_works():
    inner = ringviz_ring(4)

    def old(*, batch_size, num_heads, num_kv_heads, head_dim):
        return inner(batch_size=batch_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim)

    assert build_keywords(old) == ()
    assert check(old, window=4, examples=10, dtype=torch.float32).ok


def test_build_keywords_reads_names_and_kwargs():
    def only_dtype(*, batch_size, num_heads, num_kv_heads, head_dim, dtype):
        pass

    def kwargs(**shape):
        pass

    assert build_keywords(only_dtype) == ("dtype",)
    assert build_keywords(kwargs) == ("dtype", "device")
    assert build_keywords(ringviz_ring(4)) == ("dtype", "device")
    seen = {}
    make(lambda **kw: seen.update(kw), StepSpec(2, 4, 2, 8, torch.float32, torch.device("cpu")))
    assert seen == {"batch_size": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
                    "dtype": torch.float32, "device": torch.device("cpu")}


@pytest.mark.parametrize("name", list(PEERS))
def test_every_known_make_step_takes_dtype_and_device(name):
    peer = PEERS[name]
    assert build_keywords(peer.build(6, peer.default_sinks)) == ("dtype", "device")


def test_prebuilt_builds_up_front_when_told_else_at_the_first_step():
    built: list[StepSpec] = []

    def build(spec):
        built.append(spec)
        return lambda q, k, v, p: q

    make_step = prebuilt(build)
    make_step(batch_size=1, num_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.float32,
              device="cpu")
    assert built == [StepSpec(1, 2, 1, 8, torch.float32, torch.device("cpu"))]
    step = make_step(batch_size=1, num_heads=2, num_kv_heads=1, head_dim=8)  # the shapes alone
    assert len(built) == 1  # nothing to build from yet
    x = torch.zeros(1, 1, 3, 8, dtype=torch.float16)
    step(torch.zeros(1, 2, 3, 8, dtype=torch.float16), x, x, torch.arange(3)[None])
    step(torch.zeros(1, 2, 3, 8, dtype=torch.float16), x, x, torch.arange(3)[None])
    assert len(built) == 2 and built[1].dtype is torch.float16  # once, from the first keys


def test_ringviz_ring_allocates_up_front_in_the_dtype_given():
    step = ringviz_ring(4)(batch_size=1, num_heads=2, num_kv_heads=1, head_dim=8,
                           dtype=torch.float32, device="cpu")
    ring = step.__self__  # RingKVCache.step, bound: the ring exists before any token
    assert ring.k.dtype is torch.float32 and ring.k.shape == (1, 1, 4, 8)


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"dtype": "float32"}, TypeError), ({"device": 3}, TypeError),
    ({"head_dim": 0}, ValueError), ({"batch_size": 1.5}, TypeError)])
def test_prebuilt_rejects_bad_arguments(kwargs, error):
    shape = {"batch_size": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8} | kwargs
    with pytest.raises(error):
        prebuilt(lambda spec: None)(**shape)


def test_kwargs_forwarded_to_a_four_shape_builder_is_explained():
    from ringviz import RingKVCache

    def inner(*, batch_size, num_heads, num_kv_heads, head_dim):
        return RingKVCache(batch_size, num_kv_heads, 4, head_dim).step

    def make_step(**shape):  # forwards everything, dtype and device included
        return inner(**shape)

    (f,) = check(make_step, window=4, examples=5).failures
    assert f.property == "error" and f.schedule == [1]
    assert "make_step raised TypeError" in f.message
    assert "unexpected keyword argument 'dtype'" in f.message
    hint = " ".join(f.message.split("hint: ")[1].split())
    assert "forward them" in hint and "name the four shapes" in hint
    # either way out passes: the four shapes named, or dtype and device forwarded
    named = lambda *, batch_size, num_heads, num_kv_heads, head_dim: inner(  # noqa: E731
        batch_size=batch_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim)
    assert check(named, window=4, examples=5, dtype=torch.float32).ok

    def forwarded(**shape):
        return ringviz_ring(4)(**shape)

    assert check(forwarded, window=4, examples=5).ok


def test_no_hint_for_other_errors():
    from ringviz.conformance.seam import build_hint

    def make_step(**shape):
        raise TypeError("something else")

    assert build_hint(make_step, TypeError("something else")) == ""
    assert build_hint(lambda *, batch_size: None,
                      TypeError("f() got an unexpected keyword argument 'dtype'")) == ""
