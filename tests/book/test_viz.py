"""Drawings show what the trace says; the stepper embeds the trace; the served JS is intact."""

from __future__ import annotations

import json
import logging
import re

import matplotlib
import matplotlib.pyplot as plt
import pytest
import traitlets
from matplotlib.axes import Axes
from matplotlib.figure import Figure

import ringviz.book as viz
from ringviz.book import offline, vendor
from ringviz.book.stepper import STATE_LETTERS, pack, unpack, view
from ringviz.book.trace import Scenario, trace_ring, trace_scenario, trace_shift

STATE_NAMES = {letter: name for name, letter in STATE_LETTERS.items()}


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def decode_trace():
    return trace_scenario(Scenario(window=8, prompt=13, decode_steps=2))


@pytest.fixture(scope="module")
def batch_trace():
    return trace_scenario(Scenario(window=4, chunk=3, decode_steps=2, batch_lengths=(7, 2, 5)))


def _texts(ax: Axes) -> list[str]:
    return [t.get_text() for t in ax.texts]


def _legend(ax: Axes) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_set_style_uses_the_colour_blind_safe_cycle():
    viz.set_style()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    assert colors[:3] == ["#0072B2", "#E69F00", "#009E73"]
    assert set(viz.STATE_COLORS) == {"visible", "stale", "future", "empty", "sink"}


def test_latency_lines_differ_in_colour_marker_and_dash():
    viz.set_style()
    rows = [{"method": m, "window": w, "ms_per_token": 0.1 * i + w}
            for i, m in enumerate("abcdef") for w in (4, 8)]
    lines = viz.plot_latency(rows).get_lines()
    looks = {(ln.get_color(), ln.get_marker(), ln.get_linestyle()) for ln in lines}
    assert len(lines) == len(looks) == 6
    assert len({ln.get_marker() for ln in lines}) == 6  # not by hue alone
    warm = [i for i, ln in enumerate(lines) if ln.get_color() in ("#E69F00", "#D55E00")]
    assert warm == [1, 5]  # orange and vermillion never drawn side by side in the cycle


def test_ring_row_shows_positions_eviction_and_caption(decode_trace):
    ax = viz.draw_ring_row(decode_trace, frame=2)
    assert isinstance(ax, Axes)
    texts = _texts(ax)
    in_boxes = [t.get_text() for t in ax.texts if t.get_position()[1] == pytest.approx(0.4)]
    assert in_boxes[:8] == ["8", "9", "10", "11", "12", "13", "6", "7"]
    assert "evicted 5" in texts
    assert any("wraps to slot 0" in t for t in texts)
    assert ax.get_title(loc="left") == decode_trace.frames[2].caption
    assert {"visible", "empty", "written", "write pointer", "start"} <= set(_legend(ax))


def test_drawing_on_a_given_axes_returns_it(decode_trace):
    fig, ax = plt.subplots()
    assert viz.draw_ring_circle(decode_trace, 1, ax=ax) is ax
    assert viz.draw_batch(decode_trace, ax=ax) is ax


def test_circle_labels_every_slot(decode_trace):
    ax = viz.draw_ring_circle(decode_trace, frame=2)
    texts = _texts(ax)
    assert all(str(s) in texts for s in range(8))
    assert "evicted 5" in texts
    assert ax.get_title() == "ring, W=8: slot = pos % 8"


def test_batch_view_has_one_labelled_ring_per_row(batch_trace):
    ax = viz.draw_batch(batch_trace, frame=3)
    texts = _texts(ax)
    assert ["row 0\n4 visible", "row 1\n2 visible", "row 2\n4 visible"] == [
        t for t in texts if t.startswith("row")]


def test_ring_and_shift_side_by_side():
    fig = viz.draw_ring_and_shift(trace_ring(4, 6), trace_shift(4, 6))
    assert isinstance(fig, Figure)
    assert fig.axes[0].get_title(loc="left").endswith("start -> slot 2; 0 entries moved")
    assert fig.axes[1].get_title(loc="left").replace("\n", " ") == (
        "shift window (oldest first): 3 tokens each copied one slot left, then token 5 written "
        "at the end; token 1 dropped")
    with pytest.raises(ValueError, match="ring trace first"):
        viz.draw_ring_and_shift(trace_shift(4, 6), trace_ring(4, 6))


def test_decode_mask_names_every_state():
    ax = viz.draw_decode_mask(9, [8, 9, 2, -1, 10], window=4)
    assert _legend(ax) == ["visible", "stale", "future", "empty"]
    assert "sees 6..9" in ax.get_title(loc="left")


def test_band_mask_heatmap_colours_by_state():
    ax = viz.draw_band_mask([4, 5], [0, 1, 2, 3, 4, 5], window=3)
    codes = ax.images[0].get_array()
    # 0 visible, 1 stale, 2 future: query 4 sees 2..4, query 5 sees 3..5
    assert codes.tolist() == [[1, 1, 0, 0, 0, 2], [1, 1, 1, 0, 0, 0]]
    assert ax.get_xlabel() == "key position" and ax.get_ylabel() == "query position"
    with pytest.raises(ValueError, match="at least one"):
        viz.draw_band_mask([], [1], window=3)


def test_rope_angles_bars(decode_trace):
    ax = viz.draw_rope_angles(decode_trace)
    assert _legend(ax) == ["absolute position (correct)", "slot index (wrong after wrap)"]
    with pytest.raises(ValueError, match="no RoPE"):
        viz.draw_rope_angles(trace_shift(4, 3))


def test_memory_and_latency_plots_take_dict_rows():
    rows = [{"cache": c, "tokens": n, "bytes": b} for c, n, b in
            (("ring", 1, 64), ("ring", 8, 64), ("growing", 1, 8), ("growing", 8, 64))]
    ax = viz.plot_memory(rows)
    assert [line.get_label() for line in ax.lines] == ["ring", "growing"]
    assert ax.get_ylabel() == "cache memory (bytes)"
    lat = viz.plot_latency([{"method": "ring", "window": w, "ms_per_token": 0.1} for w in (4, 8)])
    assert lat.get_xscale() == "log" and lat.get_xlabel() == "window W (slots)"
    with pytest.raises(ValueError, match=r"lacks key\(s\) \['bytes'\]"):
        viz.plot_memory([{"cache": "ring", "tokens": 1}])
    with pytest.raises(ValueError, match="at least one row"):
        viz.plot_latency([])


def test_frames_strip_keeps_at_most_max_frames(batch_trace):
    fig = viz.draw_frames(batch_trace, max_frames=3)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert len(titles) == 3
    assert titles[0].startswith("step 0:") and titles[-1].startswith("step 5:")


def test_bad_frame_or_row_raises(decode_trace):
    with pytest.raises(ValueError, match="frame 99 out of range"):
        viz.draw_ring_row(decode_trace, 99)
    with pytest.raises(ValueError, match="row 1 out of range"):
        viz.draw_ring_circle(decode_trace, row=1)
    with pytest.raises(TypeError, match="Trace"):
        viz.draw_batch(decode_trace.to_dict())


def test_stepper_embeds_the_whole_trace():
    stepper = viz.RingStepper.from_scenario(window=4, prompt=6, decode_steps=2)
    expected = trace_scenario(Scenario(window=4, prompt=6, decode_steps=2))
    assert unpack(stepper.frames, stepper.views) == [view(expected)] and stepper.params == []
    assert json.loads(json.dumps(stepper.views)) == stepper.views  # what the page embeds
    assert json.loads(json.dumps(stepper.frames)) == stepper.frames
    assert stepper.to_trace() == expected
    assert "export default" in stepper._esm
    assert ".ringviz-stepper" in stepper._css
    assert stepper.colors["visible"] == viz.STATE_COLORS["visible"]
    stepper.frame = 3
    with pytest.raises(traitlets.TraitError, match=r"0\.\.3"):
        stepper.frame = 4
    assert isinstance(stepper.static_figure(), Figure)


def test_view_keeps_what_the_js_draws_compactly():
    trace = trace_scenario(Scenario(window=4, prompt=10, chunk=3, decode_steps=1))
    v = view(trace)
    for f, g in zip(trace.frames, v["frames"], strict=True):
        assert g["positions"] == f.positions and g["caption"] == f.caption
        assert g["arithmetic"] == f.arithmetic and g["keys"] == f.keys
        assert [[[c == "1" for c in q] for q in row] for row in g["band"]] == f.band
        assert [[STATE_NAMES[c] for c in row] for row in g["states"]] == f.slot_state
    assert len(json.dumps(v)) < 0.7 * len(trace.to_json())


def test_pack_stores_each_distinct_frame_once():
    views = [view(trace_scenario(Scenario(window=4, prompt=p, chunk=c, decode_steps=3)))
             for p in (6, 9) for c in (2, 3)]
    frames, packed = pack(views)
    assert unpack(frames, packed) == views
    distinct = {json.dumps(f, sort_keys=True) for v in views for f in v["frames"]}
    assert len(frames) == len(distinct) < sum(len(v["frames"]) for v in views)
    assert len(json.dumps([frames, packed])) < 0.8 * len(json.dumps(views))


def test_grid_holds_one_real_trace_per_setting():
    stepper = viz.RingStepper.from_scenario(window=4, prompt=7, chunk=3, decode_steps=2,
                                            vary={"window": (3, 4), "chunk": (2, 3, None)})
    assert [p["values"] for p in stepper.params] == [["3", "4"], ["2", "3", "all"]]
    assert len(stepper.views) == 6 and stepper.choice == 4  # window 4 (row 1), chunk 3 (col 1)
    assert stepper.to_trace() == trace_scenario(Scenario(window=4, prompt=7, chunk=3,
                                                         decode_steps=2))
    for i, (w, chunk) in enumerate([(w, c) for w in (3, 4) for c in (2, 3, None)]):
        expected = trace_scenario(Scenario(window=w, prompt=7, chunk=chunk, decode_steps=2))
        assert unpack(stepper.frames, stepper.views)[i] == view(expected)
    stepper.choice = 5
    assert stepper.to_trace().scenario["chunk"] is None
    with pytest.raises(traitlets.TraitError, match="choice"):
        stepper.choice = 6
    ring = viz.RingStepper.from_ring(window=4, tokens=6, vary={"window": range(2, 6)})
    assert [v["window"] for v in ring.views] == [2, 3, 4, 5] and ring.choice == 2


@pytest.mark.parametrize(("vary", "match"), [
    ({"window": (3, 5)}, "window=4 is not among"),
    ({"prompt_len": (3, 4)}, "settings do not set"),
    ({"window": ()}, "distinct values"),
    ({"window": (4, 4)}, "distinct values"),
    ({"window": range(1, 11), "chunk": range(1, 11)}, "too heavy"),
])
def test_bad_grids_raise(vary, match):
    with pytest.raises(ValueError, match=match):
        viz.RingStepper.from_scenario(window=4, prompt=7, chunk=1, vary=vary)


def test_stepper_accepts_only_traces():
    with pytest.raises(TypeError, match="Trace"):
        viz.RingStepper({"frames": []})
    with pytest.raises(ValueError, match="2 traces for a grid of 3"):
        viz.RingStepper([trace_ring(2, 2)] * 2, params=[{"name": "w", "values": [1, 2, 3]}])
    viz.RingStepper(trace_shift(4, 5))  # any trace, including the shift window


def test_controls_rebuild_and_reject_bad_input():
    controls = viz.interactive_stepper(window=4, prompt=6)
    controls.stepper.frame = 2
    controls.window.value = 3
    assert controls.stepper.views[0]["window"] == 3 and controls.stepper.frame == 0
    controls.batch.value = "5, 2"
    assert controls.stepper.views[0]["rows"] == 2
    before = controls.stepper.views
    controls.batch.value = "5, x"
    assert "integers" in controls.message.value
    controls.batch.value = "5, 0"
    assert "batch_lengths[1]" in controls.message.value
    assert controls.stepper.views is before
    controls.batch.value = ""
    assert controls.message.value == "" and controls.stepper.views[0]["rows"] == 1


def test_vendored_js_matches_pinned_checksums():
    assert vendor.check() == []
    versions = json.loads((vendor.TARGET / "VERSIONS.json").read_text())
    assert versions["requirejs"]["version"].startswith("2.3.")
    assert versions["@jupyter-widgets/html-manager"]["version"].startswith("1.0.")
    assert versions["anywidget"]["version"] == vendor.ANYWIDGET[0]
    for name in ("requirejs", "html-manager", "anywidget", "fontawesome-free"):
        assert (vendor.TARGET / "LICENSES" / f"{name}.txt").read_text().strip()
    loader = (vendor.TARGET / "ringviz-widgets.js").read_text()
    assert "anywidget/index" in loader and 'here + "html-manager"' in loader
    # every font file the bundle's CSS names is served in the folder the loader maps it to
    bundle = (vendor.TARGET / "embed-amd.js").read_text()
    for woff2 in set(re.findall(r'\.p\+"([0-9a-f]{20}\.woff2)"', bundle)):
        assert (vendor.TARGET / "html-manager" / woff2).is_file(), woff2


class _Script:
    def __init__(self, filename, **attributes):
        self.filename, self.attributes = filename, attributes


def test_offline_extension_dedupes_and_flags_remote_assets(caplog):
    thebe = "const THEBE_JS_URL = 1"
    context = {"script_files": [_Script(None, body=thebe), _Script("a.js"),
                                _Script("", body=thebe), _Script("https://cdn.example/x.js")],
               "css_files": [_Script("b.css")]}
    with caplog.at_level(logging.WARNING):
        offline._check_page(None, "page", "page.html", context, None)
    assert [s.filename for s in context["script_files"]] == [None, "a.js",
                                                             "https://cdn.example/x.js"]
    assert "loads https://cdn.example/x.js from the web" in caplog.text


def test_strip_of_a_single_row_ring_shows_each_step_mask():
    trace = trace_scenario(Scenario(window=4, prompt=10, chunk=3, decode_steps=1))
    fig = viz.draw_frames(trace)
    masks = fig.axes[1::2]
    assert len(masks) == len(trace.frames)
    # step 2: chunk 3..5 over a ring holding 0..2 -> 3 x 6 cells, ring and chunk bracketed
    assert len(masks[2].patches) == 18
    assert {"slots", "chunk"} <= set(_texts(masks[2]))
    assert "stale" in _legend(fig.axes[-2])  # the last ring axes holds the legend


def test_chunk_keys_strike_the_tokens_never_stored():
    trace = trace_scenario(Scenario(window=4, prompt=11, chunk=6, decode_steps=0))
    ax = viz.draw_chunk_keys(trace, 2)  # chunk 6..10 over a ring holding 2..5
    keys = [t for t in ax.texts if t.get_position()[1] == pytest.approx(0.15)]
    # the ring's keys in slot order (slot 0 holds 4), as attention reads them, then the chunk
    assert [t.get_text() for t in keys] == ["4", "5", "2", "3", "6", "7", "8", "9", "10"]
    struck = [t.get_text() for t in keys if t.get_color() == viz.style.EVICT_COLOR]
    assert struck == ["6"] and len(ax.patches) == 5 * 9
    with pytest.raises(ValueError, match="not a chunk step"):
        viz.draw_chunk_keys(trace_scenario(Scenario(window=4, prompt=3, decode_steps=1)), 2)


def test_padded_batch_reads_slots_from_the_ring():
    import torch

    from ringviz import RingKVCache
    pos = torch.tensor([[0, 1, 2, 3, 4], [-1, -1, -1, 0, 1]])
    cache = RingKVCache(2, 1, 4, 2)
    x = torch.zeros(2, 1, 5, 2)
    cache.step(x, x, x, pos)
    ax = viz.draw_padded_batch(pos.numpy(), cache.positions.numpy(), 4)
    texts = _texts(ax)
    assert texts.count("pad") == 0 and "hatched: padding" in " ".join(texts)  # hatch, no label
    assert [t for t in texts if t.startswith("s") and t[1:].isdigit()] == [
        "s1", "s2", "s3", "s0", "s0", "s1"]  # row 0 keeps 1..4, token 0 displaced by 4
    assert texts.count("-") == 1
    with pytest.raises(ValueError, match=r"\(B, 4\)"):
        viz.draw_padded_batch(pos.numpy(), cache.positions.numpy()[:, :3], 4)


def test_rotation_shows_the_distance_the_query_sees():
    right, wrong = viz.draw_rotation(query_pos=9, key_pos=6, window=4)
    assert "3 tokens back" in " ".join(_texts(right))
    assert "7 tokens back" in " ".join(_texts(wrong))  # slot 6 % 4 = 2, so 9 - 2
    assert "6 % 4 = 2" in wrong.get_title()
    with pytest.raises(ValueError, match="key_pos"):
        viz.draw_rotation(query_pos=3, key_pos=6, window=4)


def _contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two ``#rrggbb`` colours."""
    def lum(c: str) -> float:
        ch = [int(c[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        ch = [x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4 for x in ch]
        return 0.2126 * ch[0] + 0.7152 * ch[1] + 0.0722 * ch[2]
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_packed_views_carry_the_sink_slots():
    stepper = viz.RingStepper.from_scenario(window=4, prompt=3, decode_steps=6, sinks=2,
                                            vary={"sinks": (0, 1, 2), "window": (3, 4)})
    assert [p["label"] for p in stepper.params] == ["sink slots S", "window W"]
    assert stepper.choice == 5 and stepper.to_trace().scenario["sinks"] == 2
    views = unpack(stepper.frames, stepper.views)
    for i, (sinks, w) in enumerate([(s, w) for s in (0, 1, 2) for w in (3, 4)]):
        trace = trace_scenario(Scenario(window=w, prompt=3, decode_steps=6, sinks=sinks))
        assert views[i] == view(trace)
        assert views[i]["sinks"] == sinks  # every view says how many sink slots it has
        last = views[i]["frames"][-1]
        assert len(last["positions"][0]) == sinks + w
        assert last["states"][0] == "k" * sinks + "v" * w  # the sink state, one letter per slot
        assert [STATE_NAMES[c] for c in last["states"][0]] == trace.frames[-1].slot_state[0]
    # the JS draws sink slots in the widget palette; black slot text on them reads at AA
    assert stepper.colors["sink"] == viz.STATE_COLORS["sink"]
    assert len(set(viz.STATE_COLORS.values())) == len(viz.STATE_COLORS)
    assert _contrast("#000000", viz.STATE_COLORS["sink"]) >= 4.5
