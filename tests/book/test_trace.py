"""Traces must record the real caches' states, and say in words what each step did."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ringviz import RingKV, RingKVCache
from ringviz.book.trace import (
    MAX_TOKENS,
    Scenario,
    Trace,
    slot_states,
    spans,
    trace_ring,
    trace_scenario,
    trace_shift,
)
from ringviz.masks import band_mask

SCENARIOS = {
    "prompt_longer_than_window": Scenario(window=8, prompt=13, decode_steps=5),
    "chunk_longer_than_window": Scenario(window=4, prompt=11, chunk=6, decode_steps=3),
    "small_chunks": Scenario(window=5, prompt=9, chunk=2, decode_steps=4),
    "ragged_batch": Scenario(window=4, chunk=3, decode_steps=3, batch_lengths=(7, 2, 5)),
    "ragged_one_shot": Scenario(window=6, decode_steps=2, batch_lengths=(9, 1, 6, 3)),
}


def _replay(s: Scenario) -> list[tuple[np.ndarray, list[int]]]:
    """Drive a fresh RingKVCache with the scenario's steps (written out here independently)."""
    lengths = np.array(s.lengths)
    longest, chunk = int(lengths.max()), s.chunk or int(lengths.max())
    cache = RingKVCache(len(lengths), 1, s.window, 2)
    states = [(cache.positions.numpy().copy(), cache.start.tolist())]
    steps = [np.array([[p if p < n else -1 for p in range(a, min(a + chunk, longest))]
                       for n in lengths]) for a in range(0, longest, chunk)]
    steps += [(lengths + d)[:, None] for d in range(s.decode_steps)]
    for pos in steps:
        x = torch.zeros(len(lengths), 1, pos.shape[1], 2)
        cache.step(x, x, x, torch.as_tensor(pos))
        states.append((cache.positions.numpy().copy(), cache.start.tolist()))
    return states


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_frames_are_the_cache_states(name):
    s = SCENARIOS[name]
    trace = trace_scenario(s)
    states = _replay(s)
    assert len(trace.frames) == len(states)
    for frame, (positions, start) in zip(trace.frames, states, strict=True):
        assert frame.positions == positions.tolist()
        assert frame.start == start


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_row_holds_its_last_window_positions(name):
    """Independent of the cache: after each step a row holds its newest W positions, slot = pos % W."""
    s = SCENARIOS[name]
    trace = trace_scenario(s)
    seen = [set() for _ in s.lengths]
    for frame in trace.frames:
        for row, (queries, positions) in enumerate(zip(frame.queries, frame.positions,
                                                       strict=True)):
            seen[row] |= set(queries)
            newest = sorted(seen[row])[-s.window:]
            assert sorted(p for p in positions if p >= 0) == newest
            assert all(p % s.window == slot for slot, p in enumerate(positions) if p >= 0)


def test_nothing_is_lost_or_stored_twice():
    """Every token of every row ends up stored, evicted or (chunk > W) never stored; once."""
    s = SCENARIOS["chunk_longer_than_window"]
    trace = trace_scenario(s)
    evicted = [p for f in trace.frames for p in f.evicted[0]]
    final = [p for p in trace.frames[-1].positions[0] if p >= 0]
    assert len(set(evicted)) == len(evicted)
    assert not set(evicted) & set(final)
    dropped = set(range(s.prompt + s.decode_steps)) - set(evicted) - set(final)
    assert dropped == {0, 1, 6}  # chunk 0..5 keeps 2..5; chunk 6..10 keeps 7..10


def test_padding_takes_no_slot():
    trace = trace_scenario(SCENARIOS["ragged_batch"])
    prefill_end = trace.frames[3]  # three chunks of 3 cover the longest prompt (7)
    assert prefill_end.positions[1] == [0, 1, -1, -1]
    assert "padding only, nothing written" in prefill_end.caption


def test_teaching_ring_trace_matches_push():
    trace = trace_ring(window=4, tokens=10)
    ring = RingKV(4, 2)
    for pos, frame in enumerate(trace.frames[1:]):
        evicted = ring.push(np.zeros(2), np.zeros(2), pos)
        assert frame.positions == [ring.positions.tolist()]
        assert frame.start == [ring.start]
        assert frame.written == [[ring.last_slot]]
        assert frame.evicted == [[evicted] if evicted >= 0 else []]
        assert frame.moved == [0]


def test_decode_caption_in_words():
    trace = trace_scenario(Scenario(window=8, prompt=13, decode_steps=1))
    assert trace.frames[1].caption == (
        "tokens 0..12 (13 > W=8) all attended inside the chunk; tokens 5..12 kept in slots "
        "5..7, 0..4; tokens 0..4 never stored; start -> slot 5")
    assert trace.frames[2].caption == "token 13 written to slot 5, evicting token 5; start -> slot 6"


def test_band_of_a_chunk_covers_ring_and_chunk():
    s = Scenario(window=4, prompt=10, chunk=3, decode_steps=0)
    frame = trace_scenario(s).frames[3]  # chunk 6..8 over a ring holding 2..5
    assert frame.queries == [[6, 7, 8]]
    assert frame.keys == [[4, 5, 2, 3, 6, 7, 8]]  # slots 0..3 (4 % 4 = 0), then the chunk
    expected = band_mask(np.array([6, 7, 8]), np.array(frame.keys[0]), 4)
    assert frame.band == [expected.tolist()]
    assert [sum(r) for r in frame.band[0]] == [4, 4, 4]


def test_slot_states_classify_every_case():
    assert slot_states(9, np.array([8, 9, 2, -1, 10]), window=4) == [
        "visible", "visible", "stale", "empty", "future"]


def test_rope_angles_absolute_vs_slot():
    trace = trace_scenario(Scenario(window=4, prompt=8, decode_steps=0))
    frame = trace.frames[-1]  # slots hold 4, 5, 6, 7; pair 0 turns by 1 radian per position
    assert frame.rope_abs[0] == pytest.approx([4.0, 5.0, 6.0, 7.0 - 2 * np.pi])
    assert frame.rope_slot[0] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    assert trace.frames[0].rope_abs == [[None] * 4]


def test_shift_trace_reads_the_real_buffer():
    trace = trace_shift(window=4, tokens=7)
    assert trace.frames[-1].positions == [[3, 4, 5, 6]]
    assert [f.moved[0] for f in trace.frames] == [0, 0, 0, 0, 0, 3, 3, 3]
    assert trace.frames[-1].evicted == [[2]]
    roll = trace_shift(window=4, tokens=7, mode="roll")
    assert [f.positions for f in roll.frames] == [f.positions for f in trace.frames]


def test_trace_survives_json():
    trace = trace_scenario(SCENARIOS["ragged_batch"])
    again = Trace.from_dict(json.loads(trace.to_json()))
    assert again == trace


def test_spans():
    assert spans([0, 1, 2, 5, 7, 8]) == "0..2, 5, 7..8"
    assert spans([6, 7, 0, 1]) == "6..7, 0..1"
    assert spans([]) == ""


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"window": 0}, ValueError, "window"),
    ({"window": 2.5}, TypeError, "window"),
    ({"chunk": 0}, ValueError, "chunk"),
    ({"decode_steps": -1}, ValueError, "decode_steps"),
    ({"batch_lengths": ()}, ValueError, "batch_lengths"),
    ({"batch_lengths": (3, 0)}, ValueError, r"batch_lengths\[1\]"),
    ({"head_dim": 7}, ValueError, "head_dim"),
    ({"rope_pair": 4, "head_dim": 8}, ValueError, "rope_pair"),
    ({"prompt": MAX_TOKENS}, ValueError, "at most"),
])
def test_bad_scenarios_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        Scenario(**kwargs)


def test_bad_trace_arguments_raise():
    with pytest.raises(TypeError, match="Scenario"):
        trace_scenario({"window": 4})
    with pytest.raises(ValueError, match="tokens"):
        trace_ring(4, 0)
    with pytest.raises(ValueError, match="mode"):
        trace_shift(4, 3, mode="copy")


def test_arithmetic_shows_each_step_index_sum():
    trace = trace_scenario(Scenario(window=4, prompt=10, chunk=3, decode_steps=1))
    assert trace.frames[0].arithmetic == ""
    assert trace.frames[1].arithmetic == (
        "pos 0 -> slot 0 % 4 = 0 ... pos 2 -> slot 2 % 4 = 2; start = 0 (ring not full)")
    assert trace.frames[-1].arithmetic == (
        "pos 10 -> slot 10 % 4 = 2; evicts 6 = 10 - 4; start = (10 + 1) % 4 = 3")
    long = trace_scenario(Scenario(window=4, prompt=11, chunk=6, decode_steps=0))
    assert long.frames[2].arithmetic == (
        "pos 7 -> slot 7 % 4 = 3 ... pos 10 -> slot 10 % 4 = 2; "
        "evicts 2..5 (older than 10 - 4 + 1 = 7); start = (10 + 1) % 4 = 3")
    batch = trace_scenario(SCENARIOS["ragged_batch"])
    assert batch.frames[2].arithmetic == (
        "row 0: pos 3 -> slot 3 % 4 = 3 ... pos 5 -> slot 5 % 4 = 1; evicts 0..1 (older than "
        "5 - 4 + 1 = 2); row 2: pos 3 -> slot 3 % 4 = 3, pos 4 -> slot 4 % 4 = 0; "
        "evicts 0 = 4 - 4")  # row 1 was padding only: no arithmetic


def test_arithmetic_checks_the_observed_slot():
    from ringviz.book.captions import slot_sum
    assert slot_sum(10, 2, 4) == "pos 10 -> slot 10 % 4 = 2"
    with pytest.raises(RuntimeError, match="slot 1, not 10 % 4 = 2"):
        slot_sum(10, 1, 4)


SINK_SCENARIOS = {
    "decode_after_prompt": Scenario(window=4, prompt=7, decode_steps=5, sinks=2),
    "chunks_shorter_than_sinks": Scenario(window=3, prompt=8, chunk=1, decode_steps=2, sinks=3),
    "chunk_longer_than_window": Scenario(window=3, prompt=9, chunk=5, decode_steps=3, sinks=1),
    "ragged_batch": Scenario(window=3, chunk=2, decode_steps=3, sinks=2, batch_lengths=(6, 1, 4)),
}


@pytest.mark.parametrize("name", SINK_SCENARIOS)
def test_sink_frames_are_the_cache_states(name):
    """Positions as a fresh ``RingKVCache(sinks=S)`` holds them; the start is the ring's oldest."""
    s = SINK_SCENARIOS[name]
    lengths = np.array(s.lengths)
    longest, chunk = int(lengths.max()), s.chunk or int(lengths.max())
    cache = RingKVCache(len(lengths), 1, s.window, 2, sinks=s.sinks)
    steps = [np.array([[p if p < n else -1 for p in range(a, min(a + chunk, longest))]
                       for n in lengths]) for a in range(0, longest, chunk)]
    steps += [(lengths + d)[:, None] for d in range(s.decode_steps)]
    states = [cache.positions.numpy().copy()]
    for pos in steps:
        x = torch.zeros(len(lengths), 1, pos.shape[1], 2)
        cache.step(x, x, x, torch.as_tensor(pos))
        states.append(cache.positions.numpy().copy())
    trace = trace_scenario(s)
    assert [f.positions for f in trace.frames] == [p.tolist() for p in states]
    for frame in trace.frames:
        for row, start in zip(frame.positions, frame.start, strict=True):
            ring = {p: s.sinks + slot for slot, p in enumerate(row[s.sinks:]) if p >= 0}
            assert start == (ring[min(ring)] if ring else 0)


@pytest.mark.parametrize("name", SINK_SCENARIOS)
def test_sink_slots_hold_the_first_positions_for_good(name):
    """Independent of the cache: slots 0..S-1 hold 0..S-1 once seen and are never overwritten;
    the ring after them holds the newest W later positions at slot S + pos % W."""
    s = SINK_SCENARIOS[name]
    trace = trace_scenario(s)
    S, W = s.sinks, s.window
    seen = [set() for _ in s.lengths]
    for frame in trace.frames:
        for row, (queries, positions) in enumerate(zip(frame.queries, frame.positions,
                                                       strict=True)):
            seen[row] |= set(queries)
            assert positions[:S] == [p if p in seen[row] else -1 for p in range(S)]
            assert not [p for p in frame.evicted[row] if p < S]
            ring = sorted(p for p in seen[row] if p >= S)[-W:]
            assert sorted(p for p in positions[S:] if p >= 0) == ring
            assert all(S + p % W == S + slot for slot, p in enumerate(positions[S:]) if p >= 0)
    first_write = {}
    for i, frame in enumerate(trace.frames):
        for row, positions in enumerate(frame.positions):
            for slot in range(S):
                if positions[slot] >= 0:
                    first_write.setdefault((row, slot), i)
                    assert slot not in frame.written[row] or first_write[(row, slot)] == i


def test_sink_states_and_masks_include_the_sinks():
    s = SINK_SCENARIOS["decode_after_prompt"]
    trace = trace_scenario(s)
    last = trace.frames[-1]  # query 11: sinks 0, 1 and ring 8..11
    assert last.positions == [[0, 1, 8, 9, 10, 11]]
    assert last.slot_state == [["sink", "sink", "visible", "visible", "visible", "visible"]]
    assert last.keys == [[0, 1, 8, 9, 10, 11]] and last.band == [[[True] * 6]]
    prefill = trace.frames[1]
    expected = band_mask(np.arange(7), np.arange(7), 4, sinks=2)
    assert prefill.band == [expected.tolist()] and prefill.band[0][6][0]  # 6 sees sink 0
    assert slot_states(9, np.array([0, -1, 8, 9, 2, 10]), window=2, sinks=2) == [
        "sink", "empty", "visible", "visible", "stale", "future"]


def test_sink_arithmetic_and_captions():
    trace = trace_scenario(Scenario(window=4, prompt=1, decode_steps=9, sinks=2))
    assert [f.arithmetic for f in trace.frames[1:4]] == [
        "pos 0 -> sink slot 0", "pos 1 -> sink slot 1",
        "pos 2 -> slot 2 + 2 % 4 = 4; ring start = 2 + 2 % 4 = 4 (ring not full)"]
    assert trace.frames[2].caption == "token 1 written to slot 1; the ring is still empty"
    assert trace.frames[-1].arithmetic == (
        "pos 9 -> slot 2 + 9 % 4 = 3; evicts 5 = 9 - 4; ring start = 2 + (9 + 1) % 4 = 4")
    assert trace.frames[-1].caption == (
        "token 9 written to slot 3, evicting token 5; ring start -> slot 4")
    chunked = trace_scenario(Scenario(window=3, prompt=9, chunk=5, decode_steps=0, sinks=1))
    assert chunked.frames[1].arithmetic == (
        "pos 0 -> sink slot 0 ... pos 4 -> slot 1 + 4 % 3 = 2; ring start = 1 + (4 + 1) % 3 = 3")
    assert chunked.frames[1].caption == (  # 1 = 4 - 3 shares slot 1 + 1 % 3 with 4: overwritten
        "tokens 0..4 (5 > W=3) all attended inside the chunk; tokens 0, 2..4 kept in slots 0, "
        "3, 1..2; token 1 never stored; ring start -> slot 3")
    assert chunked.frames[2].arithmetic == (
        "pos 6 -> slot 1 + 6 % 3 = 1 ... pos 8 -> slot 1 + 8 % 3 = 3; evicts 2..4 (older than "
        "8 - 3 + 1 = 6); ring start = 1 + (8 + 1) % 3 = 1")
    from ringviz.book.captions import slot_sum
    assert slot_sum(1, 1, 4, sinks=2) == "pos 1 -> sink slot 1"
    with pytest.raises(RuntimeError, match="slot 2, not slot 2 \\+ 9 % 4"):
        slot_sum(9, 2, 4, sinks=2)
    with pytest.raises(RuntimeError, match="slot 3, not sink slot 1"):
        slot_sum(1, 3, 4, sinks=2)


def test_no_sinks_is_the_plain_ring():
    """``sinks=0`` is the default and the plain ring: W slots, no sink state, the plain caption."""
    for s in SCENARIOS.values():
        plain = Scenario(**{**s.to_dict(), "sinks": 0})
        trace = trace_scenario(plain)
        assert trace.scenario["sinks"] == 0 and trace.scenario == plain.to_dict()
        assert all(len(row) == plain.window for f in trace.frames for row in f.positions)
        assert not any("sink" in row for f in trace.frames for row in f.slot_state)
        assert not any("ring start" in f.caption for f in trace.frames)
    assert Scenario(sinks=1).to_dict()["sinks"] == 1


@pytest.mark.parametrize(("sinks", "error"), [(-1, ValueError), (1.5, TypeError)])
def test_bad_sinks_raise(sinks, error):
    with pytest.raises(error, match="sinks"):
        Scenario(sinks=sinks)
