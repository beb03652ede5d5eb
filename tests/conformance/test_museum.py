"""The museum: every exhibit's buggy cache is caught with its property, its fix passes, and the
correct caches of unusual layout pass; the window conventions map to the kit's window."""

import pytest
import torch

from ringviz.conformance import check
from ringviz.conformance.museum import (
    CONVENTIONS,
    EXHIBITS,
    UNUSUAL,
    convention_step,
    run,
)


@pytest.mark.parametrize("name", list(EXHIBITS))
def test_exhibit_bug_caught_and_fix_passes(name):
    exhibit = EXHIBITS[name]
    if exhibit.requires:
        pytest.importorskip(exhibit.requires, reason=f"the exhibit runs the package "
                            f"{exhibit.requires}, not installed here")
    result = run(exhibit, examples=40)
    assert result.caught, str(result.bug)
    assert result.fix.ok, str(result.fix)
    if exhibit.upstream_fix is not None:  # a project's fix that still breaks
        assert not result.upstream.ok, str(result.upstream)
    smallest = next(f for f in result.bug.failures if f.property == exhibit.expect)
    assert sum(smallest.schedule) <= 3 * exhibit.window  # a schedule a reader can follow


def test_every_exhibit_has_one_class():
    from ringviz.conformance.museum import CLASSES

    named = [n for c in CLASSES for n in c.exhibits]
    assert sorted(named) == sorted(EXHIBITS), set(named) ^ set(EXHIBITS)


def test_design_space_rows_measured_where_the_package_runs():
    from ringviz.conformance.designs import DESIGNS, measured_slots
    from ringviz.conformance.peers import PEERS

    rows = {d.ring: d for d in DESIGNS}
    assert measured_slots(rows["ringviz RingKVCache"], 6, 8) == 7  # W + 1
    assert measured_slots(rows["transformers dynamic sliding layer"], 6, 8) == 13
    assert all(d.peer in PEERS for d in DESIGNS if d.peer)
    assert all(d.source for d in DESIGNS)
    pytest.importorskip("executorch")
    assert measured_slots(rows["ExecuTorch RingKVCache 1.5.1"], 6, 8) == 12  # 2W


def test_museum_spans_projects():
    assert len(EXHIBITS) >= 12
    assert len([e for e in EXHIBITS.values() if e.requires is None]) >= 12  # with no peers
    assert len({e.project for e in EXHIBITS.values()}) >= 5
    assert all(e.url.startswith("https://github.com/") for e in EXHIBITS.values())


@pytest.mark.parametrize("name", list(UNUSUAL))
def test_unusual_layouts_pass(name):
    u = UNUSUAL[name]
    report = check(u.build(4), window=4, batch_size=u.batch_size, ragged=u.ragged, examples=40)
    assert report.ok, str(report)


@pytest.mark.parametrize("convention", CONVENTIONS, ids=lambda c: c.library)
def test_convention_window(convention):
    n = 4
    report = check(convention_step(convention, n), window=convention.window_for(n),
                   batch_size=2, ragged=True, examples=30)
    if "symmetric" in convention.library:  # not causal: it sees later keys
        f = report.failures[0]
        assert f.property == "window" and max(f.seen) > f.position
    else:
        assert report.ok, str(report)
        # and the library's number taken as the kit's window is off by its convention
        if convention.window_for(n) != n:
            assert not check(convention_step(convention, n), window=n, examples=30).ok


def test_exhibit_check_uses_its_setting():
    e = EXHIBITS["hf_37574"]
    report = e.check(e.fixed, examples=5)
    assert (report.window, report.max_chunk, report.dtype) == (e.window, 1, "float64")
    assert str(torch.float64).endswith(report.dtype)


def test_listings_name_real_objects():
    import importlib

    for e in EXHIBITS.values():  # the chapter shows these with literalinclude :pyobject:
        path, name = e.listing
        obj = importlib.import_module(f"ringviz.conformance.{path.removesuffix('.py')}")
        for part in name.split("."):
            obj = getattr(obj, part)
        assert callable(obj), e.name
