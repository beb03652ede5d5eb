from collections import deque

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringviz import RingKV


@given(window=st.integers(1, 8), gaps=st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_ring_matches_a_deque_of_the_last_window(window, gaps):
    ring = RingKV(window, head_dim=3, dtype=np.float64)
    k_store, v_store, storage_ptr = ring.k, ring.v, ring.k.ctypes.data
    pushed: deque[int] = deque()
    pos = -1
    for gap in gaps:
        pos += gap
        slot_before = ring.positions[pos % window]
        evicted = ring.push(np.full(3, pos), np.full(3, -pos), pos)
        assert evicted == slot_before and ring.last_slot == pos % window
        pushed.append(pos)
        visible = [p for p in pushed if p > pos - window]
        k, v, positions = ring.read()
        assert positions.tolist() == visible
        np.testing.assert_array_equal(k[:, 0], visible)
        np.testing.assert_array_equal(v[:, 0], [-p for p in visible])
        assert len(ring) == len(visible)
        assert ring.positions[ring.start] == visible[0]
    assert ring.k is k_store and ring.v is v_store and ring.k.ctypes.data == storage_ptr
    assert ring.nbytes == 2 * window * 3 * 8 + window * 8


def test_read_at_a_later_query_position_drops_stale_entries():
    ring = RingKV(4, 1)
    for pos in range(6):
        ring.push(np.zeros(1), np.zeros(1), pos)
    assert ring.read(current_pos=7)[2].tolist() == [4, 5]
    assert ring.read(current_pos=3)[2].tolist() == [2, 3]  # future positions hidden


def test_empty_ring():
    ring = RingKV(3, 2)
    assert len(ring) == 0 and ring.start == 0 and ring.last_slot == -1
    k, v, positions = ring.read()
    assert k.shape == (0, 2) and positions.shape == (0,)


def _state(ring: RingKV):
    return ring.k.copy(), ring.v.copy(), ring.positions.copy(), ring.last_slot


@pytest.mark.parametrize(("k", "pos", "error", "match"), [
    (np.zeros(3), 5, ValueError, "shape"),
    (np.zeros(2), 2, ValueError, "strictly increase"),
    (np.zeros(2), 3, ValueError, "strictly increase"),
    (np.zeros(2), -1, ValueError, ">= 0"),
    (np.zeros(2), 4.0, TypeError, "pos must be an int"),
    (np.zeros(2), True, TypeError, "pos must be an int"),
])
def test_bad_push_raises_and_changes_nothing(k, pos, error, match):
    ring = RingKV(4, 2)
    for p in range(4):
        ring.push(np.ones(2) * p, np.ones(2), p)
    before = _state(ring)
    with pytest.raises(error, match=match):
        ring.push(k, np.zeros(2), pos)
    after = _state(ring)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("window", "head_dim", "error"), [
    (0, 2, ValueError), (-1, 2, ValueError), (2, 0, ValueError), (2.5, 2, TypeError),
])
def test_bad_construction(window, head_dim, error):
    with pytest.raises(error):
        RingKV(window, head_dim)
