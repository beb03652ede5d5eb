"""A ring's fixed storage: allocated once, written in place, rows reordered or taken back.

:class:`RingStorage` is what :class:`ringviz.RingKVCache` stores into: keys and values
``(B, n_kv_heads, S + C + 1, head_dim)``, the absolute position each slot holds ``(B, S + C + 1)``
(-1 = empty), each row's newest position, and what the host knows about the rows
(:mod:`ringviz.runs`). Per row, ``[ S sink slots | C ring slots | spare ]``: the views ``k``,
``v`` and ``positions`` leave out the spare slot, where tokens that must not be stored go, so a
chunk's write is one scatter with no host sync. Addresses never change while the batch keeps
its size (CUDA-graph friendly). Which slot a position takes, what a query sees and attention are
the cache's; the rows' bookkeeping (beam search's reorder, speculative decoding's take-back) is
here.
"""

from __future__ import annotations

import torch

from ringviz.checks import (
    check_kv,
    check_positions,
    check_query,
    check_tensor,
    check_truncate,
    missing_positions,
)
from ringviz.runs import Runs, Told


class RingStorage:
    """Fixed k/v/positions storage for ``batch_size`` rows of ``sinks + capacity`` slots."""

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int,
                 sinks: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        self.batch_size, self.num_kv_heads = batch_size, num_kv_heads
        self.window, self.head_dim, self.sinks, self.capacity = window, head_dim, sinks, capacity
        n = sinks + capacity  # [sinks | ring]; slot n, outside the views, the spare
        self._spare = n
        store = (batch_size, num_kv_heads, n + 1, head_dim)
        self._k_store = torch.zeros(store, dtype=dtype, device=device)
        self._v_store = torch.zeros(store, dtype=dtype, device=device)
        self._pos_store = torch.full((batch_size, n + 1), -1, dtype=torch.int64,
                                     device=self._k_store.device)
        # newest position per row: kept beside the ring so a decode step never scans all W slots
        self._last_pos = torch.full((batch_size,), -1, dtype=torch.int64, device=self.device)
        self._views()
        self._runs = Runs(batch_size, capacity, self.device)

    def _views(self) -> None:
        """The views without the spare slot, and the flat views a decode write copies into
        (one index_copy_ per tensor: about half an advanced-index assignment's cost)."""
        B, H, n1, D = self._k_store.shape
        self.k = self._k_store[:, :, :self._spare]  # (B, n_kv_heads, S + C, head_dim)
        self.v = self._v_store[:, :, :self._spare]
        self.positions = self._pos_store[:, :self._spare]  # (B, S + C), -1 = empty
        self._k_rows = self._k_store.view(-1, D)  # (B * n_kv_heads * (S + C + 1), D)
        self._v_rows = self._v_store.view(-1, D)
        self._head_base = torch.arange(B * H, device=self.device).view(B, H) * n1
        self._pos_base = torch.arange(B, device=self.device) * n1
        self._pos_rows = self._pos_store.view(-1)  # (B * (S + C + 1),)
        self._last_col = self._last_pos[:, None]  # (B, 1): a decode write's positions copy in

    @property
    def dtype(self) -> torch.dtype:
        return self._k_store.dtype

    @property
    def device(self) -> torch.device:
        return self._k_store.device

    @property
    def nbytes(self) -> int:
        """Bytes of k, v and positions storage (spare slot included): fixed at construction."""
        stores = (self._k_store, self._v_store, self._pos_store)
        return sum(t.numel() * t.element_size() for t in stores)

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` each row's newest position + 1: where its next token goes (0 when empty)."""
        return self._last_pos + 1

    def reset(self) -> None:
        """Empty every row (storage stays where it is)."""
        self._k_store.zero_()
        self._v_store.zero_()
        self._pos_store.fill_(-1)
        self._last_pos.fill_(-1)
        self._runs.reset()

    # ------------------------------------------------------------------ what the rows accept
    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> Told:
        """Raise on any malformed input, before anything is written; else what it tells
        (:meth:`ringviz.runs.Runs.validated`: one host sync)."""
        check_kv(k, v, batch_size=self.batch_size, num_kv_heads=self.num_kv_heads,
                 head_dim=self.head_dim, dtype=self.dtype, device=self.device)
        check_tensor("positions", positions, self.device)
        return self._runs.validated(positions, self._last_pos, k.shape[2])

    def _check_q(self, q: torch.Tensor, T: int, q_positions: object = None) -> None:
        check_query(q, T, batch_size=self.batch_size, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim, dtype=self.dtype, device=self.device,
                    q_positions=q_positions)

    def check_positions(self, positions: torch.Tensor) -> None:
        """Raise if ``positions`` (B, T) could not be written next, writing nothing."""
        check_tensor("positions", positions, self.device)
        check_positions(positions, self._last_pos, positions.shape[-1] if positions.ndim else -1)

    def _write_one(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   slot: torch.Tensor | int) -> None:
        """Store one token per row (``positions`` (B, 1)), row b's in slot ``slot[b]`` (B,),
        or in one slot known on the host for every row: then three strided copies and no
        index arithmetic (a decode step's eager ops cost microseconds each)."""
        if isinstance(slot, int):
            self._k_store.narrow(2, slot, 1).copy_(k)
            self._v_store.narrow(2, slot, 1).copy_(v)
            self._pos_store.narrow(1, slot, 1).copy_(positions)
            return
        rows = (self._head_base + slot[:, None]).view(-1)  # (B * n_kv_heads,) storage rows
        self._k_rows.index_copy_(0, rows, k.reshape(-1, self.head_dim))
        self._v_rows.index_copy_(0, rows, v.reshape(-1, self.head_dim))
        self._pos_rows.index_copy_(0, self._pos_base + slot, positions.view(-1))

    # ------------------------------------------------------------------ rows
    def take_rows(self, index: torch.Tensor, *, check: bool = True) -> None:
        """Make row ``i`` what row ``index[i]`` is now (beam search's reorder, repeat, select).

        ``index`` is 1-D, integer, on this device, any length (rows may repeat). The same
        length reorders in place (storage addresses unchanged, as a CUDA graph needs); another
        length allocates storage for the new batch. ``check=False`` skips the range check and
        its host sync (a beam step's indices are in range by construction).
        """
        check_tensor("index", index, self.device)
        if index.ndim != 1 or index.is_floating_point() or index.dtype == torch.bool:
            raise ValueError(f"index must be a 1-D integer tensor, got {index.dtype} "
                             f"{tuple(index.shape)}")
        if check and index.numel() and not bool(
                ((index >= 0) & (index < self.batch_size)).all()):
            raise ValueError(f"index must hold rows in [0, {self.batch_size}), got "
                             f"{index.tolist()}")
        stores = (self._k_store, self._v_store, self._pos_store, self._last_pos)
        self._runs.take_rows(index)
        if index.numel() == self.batch_size:
            for t in stores:
                t.copy_(t.index_select(0, index))
            return
        self._k_store, self._v_store, self._pos_store, self._last_pos = (
            t.index_select(0, index) for t in stores)
        self.batch_size = index.numel()
        self._views()

    def truncate(self, lengths: torch.Tensor, *, check: bool = True) -> None:
        """Forget every stored position ``>= lengths[b]`` of row b (rejected draft tokens).

        Row b may then write from position ``lengths[b]`` again. Nothing is restored: a key that
        a forgotten token overwrote is gone. So ``check`` (the default) raises ValueError, and
        changes nothing, unless row b still holds every position its next query needs,
        ``lengths[b] - window + 1 .. lengths[b] - 1`` (positions are a token sequence's, one
        per index). A ring can take back ``capacity - window + 1`` tokens: one without spare
        slots (chapter 13). ``check=False`` skips the check and its host sync.
        """
        if check:
            check_truncate(lengths, self.positions, self._last_pos, window=self.window,
                           capacity=self.capacity)
        lengths = lengths.to(torch.int64)
        self._pos_store.masked_fill_(self._pos_store >= lengths[:, None], -1)
        torch.minimum(self._last_pos, lengths - 1, out=self._last_pos)
        self._runs.forget()  # how many of each row's positions are left is not known here

    def missing_positions(self, lengths: torch.Tensor) -> list[list[int]]:
        """Per row b: positions a query at ``lengths[b]`` needs, ``lengths[b] - W + 1 ..
        lengths[b] - 1``, that the cache does not hold (a host sync; for checks and reports)."""
        return missing_positions(self.positions, lengths, self.window)
