"""The teaching ring: one sequence's keys and values in ``window`` fixed slots (NumPy).

The whole idea is one line: token ``pos`` goes to slot ``pos % window``. Once ``window`` tokens
have been written, each write overwrites the oldest one, which has just left the window; nothing
ever moves. Positions are stored beside the vectors, so visibility (chapter 5) is computed from
them rather than from slot order.

>>> import numpy as np
>>> ring = RingKV(window=4, head_dim=2)
>>> for pos in range(6):
...     _ = ring.push(np.full(2, pos), np.full(2, -pos), pos)
>>> ring.positions                     # slot s holds the newest pos with pos % 4 == s
array([4, 5, 2, 3])
>>> ring.start, ring.last_slot         # oldest visible entry, slot written last
(2, 1)
>>> ring.read()[2]                     # visible positions, oldest first (a gathering copy)
array([2, 3, 4, 5])
"""

from __future__ import annotations

import numpy as np

from ringviz.checks import check_int
from ringviz.masks import decode_mask


class RingKV:
    """A fixed-capacity ring of (k, v) vectors for one sequence, indexed by
    ``pos % window``."""

    def __init__(self, window: int, head_dim: int,
                 dtype: np.dtype | type = np.float32) -> None:
        self.window = check_int("window", window)
        self.head_dim = check_int("head_dim", head_dim)
        self.k = np.zeros((self.window, self.head_dim), dtype=dtype)  # (window, head_dim)
        self.v = np.zeros((self.window, self.head_dim), dtype=dtype)  # (window, head_dim)
        self.positions = np.full(self.window, -1, dtype=np.int64)  # (window,) -1 = empty
        self.last_slot = -1  # slot of the last push; -1 before any

    def push(self, k: np.ndarray, v: np.ndarray, pos: int) -> int:
        """Write one token at slot ``pos % window``; return the evicted
        position (-1 if none)."""
        k, v = np.asarray(k), np.asarray(v)
        if k.shape != (self.head_dim,) or v.shape != (self.head_dim,):
            raise ValueError(
                f"k and v must have shape ({self.head_dim},), got {k.shape} and {v.shape}")
        pos = check_int("pos", pos, minimum=0)
        if pos <= self.last_pos:
            raise ValueError(
                f"positions must strictly increase: got {pos} after {self.last_pos}")
        slot = pos % self.window
        evicted = int(self.positions[slot])
        self.k[slot] = k
        self.v[slot] = v
        self.positions[slot] = pos
        self.last_slot = slot
        return evicted

    @property
    def last_pos(self) -> int:
        """The newest stored position (-1 when empty)."""
        return int(self.positions.max())

    def visible(self, current_pos: int | None = None) -> np.ndarray:
        """Bool ``(window,)``: which slots a query at ``current_pos``
        (default: newest) sees."""
        if current_pos is None:
            current_pos = self.last_pos
        elif current_pos < 0:
            raise ValueError(f"current_pos must be >= 0, got {current_pos}")
        return decode_mask(current_pos, self.positions, self.window)

    @property
    def start(self) -> int:
        """Slot of the oldest visible entry (0 when empty): where an in-order
        read begins."""
        mask = self.visible()
        if not mask.any():
            return 0
        return int(np.where(mask, self.positions, np.iinfo(np.int64).max).argmin())

    def read(self, current_pos: int | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Visible ``(k, v, positions)``, oldest first.

        The result is a gathered *copy*: attention does not need it (softmax-weighted sums
        do not care about order), which is why the torch cache never calls anything like it.
        """
        slots = np.flatnonzero(self.visible(current_pos))
        order = slots[np.argsort(self.positions[slots])]  # oldest first
        return self.k[order], self.v[order], self.positions[order]

    @property
    def nbytes(self) -> int:
        """Storage bytes (k, v and positions): constant for the ring's whole life."""
        return self.k.nbytes + self.v.nbytes + self.positions.nbytes

    def __len__(self) -> int:
        return int(self.visible().sum())

    def __repr__(self) -> str:
        return (f"RingKV(window={self.window}, head_dim={self.head_dim}, "
                f"positions={self.positions.tolist()}, start={self.start})")
