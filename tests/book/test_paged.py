"""Tests for ringviz.book.paged: block accounting, freeing outside the window, exhaustion, bad input."""

import doctest
import math

import numpy as np
import pytest

import ringviz.book.paged
from ringviz.book.paged import BlockPool, PagedSequence


def test_docstring_examples():
    assert doctest.testmod(ringviz.book.paged).failed == 0


def test_without_window_every_block_is_kept():
    pool = BlockPool(64, 16)
    seq = PagedSequence(pool)
    for _ in range(100):
        seq.append()
    assert seq.num_blocks_held == math.ceil(100 / 16) == pool.num_used
    assert all(seq.locate(p)[0] is not None for p in range(100))


@pytest.mark.parametrize(("window", "block_size"), [(1, 1), (5, 4), (8, 4), (64, 16), (33, 8)])
def test_window_bounds_the_blocks_held(window, block_size):
    pool = BlockPool(64, block_size)
    seq = PagedSequence(pool, window=window)
    peak = 0
    for _ in range(10 * window + 7):
        seq.append()
        peak = max(peak, seq.num_blocks_held)
    assert peak <= math.ceil(window / block_size) + 1
    assert pool.num_used == seq.num_blocks_held


@pytest.mark.parametrize("chunk", [1, 3, 7, 20])
def test_every_position_the_next_query_sees_is_still_held(chunk):
    """Freeing never drops a visible key, for token-by-token decode and chunks alike."""
    window, block_size = 10, 4
    seq = PagedSequence(BlockPool(32, block_size), window=window)
    for _ in range(12):
        seq.append(chunk)
        next_pos = seq.num_tokens
        for pos in range(max(0, next_pos - window + 1), next_pos):
            block, offset = seq.locate(pos)
            assert offset == pos % block_size


def test_freed_positions_raise_and_blocks_are_reused():
    pool = BlockPool(4, 2)
    seq = PagedSequence(pool, window=3)
    seq.append(6)  # positions 0..5 in blocks 0, 1, 2
    seq.append()  # query at 6 sees 4..6: blocks 0 and 1 (positions 0..3) go back
    assert seq.block_table[:2] == [None, None]
    with pytest.raises(ValueError, match="freed"):
        seq.locate(1)
    assert seq.block_table == [None, None, 2, 3]  # position 6 took block 3, the last fresh one
    seq.append(2)  # position 8 needs a fifth logical block: physical block 0, recycled (FIFO)
    assert seq.block_table == [None, None, 2, 3, 0]
    assert pool.num_used == 3


def test_sequences_share_one_pool_and_release_returns_everything():
    rng = np.random.default_rng(42)
    pool = BlockPool(40, 4)
    seqs = [PagedSequence(pool, window=6) for _ in range(5)]
    for _ in range(200):
        seqs[int(rng.integers(len(seqs)))].append(int(rng.integers(1, 4)))
    assert pool.num_used == sum(s.num_blocks_held for s in seqs)
    physical = [b for s in seqs for b in s.block_table if b is not None]
    assert len(physical) == len(set(physical))  # no block owned twice
    for s in seqs:
        s.release()
    assert pool.num_free == 40 and pool.num_used == 0


def test_exhaustion_raises_and_changes_nothing():
    pool = BlockPool(2, 4)
    seq = PagedSequence(pool)
    seq.append(8)
    table, n = list(seq.block_table), seq.num_tokens
    with pytest.raises(RuntimeError, match="exhausted"):
        seq.append()
    assert seq.block_table == table and seq.num_tokens == n and pool.num_free == 0
    lone = BlockPool(1, 1)
    lone.allocate()
    with pytest.raises(RuntimeError, match="exhausted"):
        lone.allocate()


@pytest.mark.parametrize(("call", "error"), [
    (lambda: BlockPool(0, 4), ValueError),
    (lambda: BlockPool(4, 2.0), TypeError),
    (lambda: PagedSequence("pool"), TypeError),
    (lambda: PagedSequence(BlockPool(4, 4), window=0), ValueError),
    (lambda: PagedSequence(BlockPool(4, 4)).append(0), ValueError),
    (lambda: PagedSequence(BlockPool(4, 4)).locate(0), ValueError),
    (lambda: BlockPool(4, 4).free(0), ValueError),
])
def test_bad_input_raises(call, error):
    with pytest.raises(error):
        call()
