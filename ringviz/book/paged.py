"""Paged KV bookkeeping, vLLM-style: blocks from a shared pool, freed once outside the window.

Only the bookkeeping is simulated (which physical block holds which positions); no K/V data
moves, which is the point of paging. With a sliding window, a block whose every position lies
before the window of the next query is handed back to the pool, as vLLM v1's sliding-window
manager does (``remove_skipped_blocks``: ``num_computed_tokens - sliding_window + 1`` tokens are
skipped). A sequence then holds at most ``ceil(window / block_size) + 1`` blocks.

Taught in chapter 8 (``notebooks/08_memory.ipynb``).
"""

from __future__ import annotations

from collections import deque

from ringviz.checks import check_int


class BlockPool:
    """A fixed pool of ``num_blocks`` blocks of ``block_size`` token slots, shared by sequences."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        check_int("num_blocks", num_blocks, 1)
        self.block_size = check_int("block_size", block_size, 1)
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # FIFO reuse, like vLLM's free queue
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Blocks available to any sequence."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks currently owned by some sequence."""
        return len(self._used)

    def allocate(self) -> int:
        """Take a free block id; raise RuntimeError when the pool is exhausted."""
        if not self._free:
            raise RuntimeError(f"block pool exhausted: all {self.num_blocks} blocks in use")
        block = self._free.popleft()
        self._used.add(block)
        return block

    def free(self, block: int) -> None:
        """Return a block to the pool; freeing a block that is not in use is an error."""
        if block not in self._used:
            raise ValueError(f"block {block} is not in use")
        self._used.remove(block)
        self._free.append(block)


class PagedSequence:
    """One sequence's block table over a shared pool; ``window=None`` keeps every block.

    >>> pool = BlockPool(num_blocks=8, block_size=4)
    >>> seq = PagedSequence(pool, window=6)
    >>> seq.append(10)          # positions 0..9 fill blocks 0, 1, 2
    >>> seq.block_table
    [0, 1, 2]
    >>> seq.append(1)           # query at 10 sees 5..10: block 0 (positions 0..3) is freed
    >>> seq.block_table, pool.num_free
    ([None, 1, 2], 6)
    >>> seq.locate(9)           # position 9 lives in physical block 2, offset 1
    (2, 1)
    """

    def __init__(self, pool: BlockPool, window: int | None = None) -> None:
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a BlockPool, got {type(pool).__name__}")
        self.pool = pool
        self.window = None if window is None else check_int("window", window, 1)
        self.num_tokens = 0  # positions 0 .. num_tokens-1 have been written
        self.block_table: list[int | None] = []  # logical block -> physical block (None: freed)

    @property
    def num_blocks_held(self) -> int:
        """Physical blocks this sequence owns right now."""
        return sum(block is not None for block in self.block_table)

    def first_needed_pos(self, next_pos: int) -> int:
        """Oldest position the query at ``next_pos`` can see (0 without a window)."""
        return 0 if self.window is None else max(0, next_pos - self.window + 1)

    def append(self, n_tokens: int = 1) -> None:
        """Write ``n_tokens`` new positions: first free blocks the next query cannot see,
        then allocate blocks for the new positions. On pool exhaustion nothing is
        changed."""
        check_int("n_tokens", n_tokens, 1)
        blocks = -(-(self.num_tokens + n_tokens) // self.pool.block_size)  # ceil division
        needed = blocks - len(self.block_table)
        freeable = self._skipped_blocks(self.num_tokens)
        if needed > self.pool.num_free + len(freeable):
            raise RuntimeError(
                f"block pool exhausted: need {needed} blocks, {self.pool.num_free} free"
            )
        for logical in freeable:
            self.pool.free(self.block_table[logical])
            self.block_table[logical] = None
        self.block_table.extend(self.pool.allocate() for _ in range(needed))
        self.num_tokens += n_tokens

    def locate(self, pos: int) -> tuple[int, int]:
        """``(physical block, offset)`` of a written position that is still held."""
        check_int("pos", pos, 0)
        if pos >= self.num_tokens:
            raise ValueError(f"pos {pos} not written yet (num_tokens={self.num_tokens})")
        block = self.block_table[pos // self.pool.block_size]
        if block is None:
            raise ValueError(f"pos {pos} lies in a block freed outside the window")
        return block, pos % self.pool.block_size

    def release(self) -> None:
        """Free every held block (the request finished)."""
        for block in self.block_table:
            if block is not None:
                self.pool.free(block)
        self.block_table = []
        self.num_tokens = 0

    def _skipped_blocks(self, next_pos: int) -> list[int]:
        """Held logical blocks whose last position precedes the window of ``next_pos``."""
        n_skipped = self.first_needed_pos(next_pos) // self.pool.block_size
        return [i for i in range(min(n_skipped, len(self.block_table)))
                if self.block_table[i] is not None]
