import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ringviz import band_mask, decode_mask
from ringviz.masks import visible


def by_definition(q: int, k: int, window: int) -> bool:
    """A query at p sees p-W+1 .. p; -1 (empty/padding) is never visible and sees nothing."""
    return q >= 0 and k >= 0 and q - window < k <= q


def by_definition_with(q: int, k: int, window: int | None, sinks: int) -> bool:
    """Sinks ``0 .. S-1`` stay visible to every later query; ``window=None``: causal only."""
    causal = q >= 0 and 0 <= k <= q
    return causal and (window is None or k > q - window or k < sinks)


positions = st.lists(st.integers(-1, 30), min_size=1, max_size=12)


@given(q=positions, k=positions, window=st.integers(1, 10))
def test_band_mask_matches_definition_numpy_and_torch(q, k, window):
    want = np.array([[by_definition(a, b, window) for b in k] for a in q])
    got_np = band_mask(np.array(q), np.array(k), window)
    got_t = band_mask(torch.tensor(q), torch.tensor(k), window)
    assert got_np.dtype == bool and got_np.shape == (len(q), len(k))
    np.testing.assert_array_equal(got_np, want)
    np.testing.assert_array_equal(got_t.numpy(), want)


@given(cur=st.integers(0, 40), k=positions, window=st.integers(1, 10))
def test_decode_mask_matches_definition(cur, k, window):
    want = np.array([by_definition(cur, b, window) for b in k])
    np.testing.assert_array_equal(decode_mask(cur, np.array(k), window), want)


def test_decode_mask_window_is_w_not_w_minus_1():
    # slots of a full ring of W=4 after token 9: positions 6..9 all visible, 5 (stale) is not
    np.testing.assert_array_equal(decode_mask(9, np.array([8, 9, 6, 7]), 4), [True] * 4)
    np.testing.assert_array_equal(decode_mask(9, np.array([8, 9, 5, 7]), 4),
                                  [True, True, False, True])


def test_decode_mask_batched_rows_and_future():
    cache_positions = torch.tensor([[4, 5, 2, 3], [-1, 1, 2, -1]])
    got = decode_mask(torch.tensor([5, 1]), cache_positions, 3)
    assert got.tolist() == [[True, True, False, True], [False, True, False, False]]


@pytest.mark.parametrize("window", [0, -3])
def test_nonpositive_window_rejected(window):
    with pytest.raises(ValueError, match="window must be >= 1"):
        band_mask(np.arange(3), np.arange(3), window)


def test_non_integer_window_rejected():
    with pytest.raises(TypeError, match="window must be an int"):
        decode_mask(3, np.arange(3), 2.0)


@given(q=positions, k=positions, window=st.one_of(st.none(), st.integers(1, 10)),
       sinks=st.integers(0, 4))
def test_band_mask_with_sinks_or_no_window_matches_definition(q, k, window, sinks):
    want = np.array([[by_definition_with(a, b, window, sinks) for b in k] for a in q])
    np.testing.assert_array_equal(band_mask(np.array(q), np.array(k), window, sinks), want)
    got_t = band_mask(torch.tensor(q), torch.tensor(k), window, sinks)
    np.testing.assert_array_equal(got_t.numpy(), want)


def test_visible_on_plain_ints():
    assert visible(7, 5, 3) and not visible(7, 4, 3) and not visible(7, 8, 3)
    assert visible(7, 0, 3, sinks=1) and visible(7, 0, None) and not visible(-1, -1, None)


def test_sinks_checked_even_without_a_window():
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        band_mask(np.arange(3), np.arange(3), None, sinks=-1)
