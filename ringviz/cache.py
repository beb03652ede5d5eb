"""The batched ring KV cache (torch): fixed storage, one slot write per token, exact attention.

Chapter 7's ``BatchRing`` and chapter 8's ``SinkRing`` plus named deltas, in the order this
module reads:

* **storage**: keys and values ``(B, Hkv, S + C + 1, D)`` and the absolute position each slot
  holds ``(B, S + C + 1)`` (-1 = empty), allocated once and only written in place; per row
  ``[ S sink slots | C ring slots | spare ]``. Masks come from the stored positions, never from
  slot order. The spare slot (outside the views ``k``, ``v``, ``positions``) takes the tokens a
  chunk must not store, so a chunk's write is one scatter with no host sync.
* **the slot rule** (:func:`home_slots`): position ``pos`` goes to slot ``pos % C``; with
  ``sinks=S`` (StreamingLLM's attention sinks) positions ``0 .. S-1`` to slots ``0 .. S-1`` for
  good and the rest to ``S + pos % C``. ``C`` is ``capacity``: the window ``W`` unless
  speculative decoding asks for **draft slots** (chapter 13: masks still use ``W``, and
  :meth:`RingKVCache.truncate` forgets rejected draft tokens).
* **validation**: every check runs before anything is written (a rejected call changes
  nothing), in one host read of the positions, which also keeps what the host knows of each
  row without reading the ring back (:class:`Rows`, two lists of ints): its run of
  consecutive positions, so a full ring decodes with no mask (chapter 10), and its newest
  position, so a decode write picks its slot on the host. A trusted call (``check=False``)
  reads nothing: its rows' runs grow if it vouches for them (``contiguous=True``), else
  restart from 0.
* **sinks' two conventions** (``sink_rope``: absolute positions, or StreamingLLM's positions
  inside the cache, :mod:`ringviz.sinks`), and the **row operations** of beam search
  (:meth:`RingKVCache.take_rows`) and speculative rollback (:meth:`RingKVCache.truncate`).

One call, :meth:`RingKVCache.step`, takes a chunk of ``T`` new tokens per row (``T = 1`` is
decode) and returns their attention output:

* ``T == 1``: write the token into its slot, then attend over the raw storage
  (``S + window`` keys, in slot order, masked by stored positions). No copy, no reordering.
  Once every row holds its last W positions (no sinks, no spare slots) and the step writes
  every row's next one, each stored key is inside each query's window: the step attends with
  no mask at all (:attr:`RingKVCache.window_full`, known on the host, never read back).
* ``T > 1`` (prefill, chunks, also ``T > window``): attend over ``[sinks | ring | chunk]``
  first, then write. A chunk longer than the window would otherwise overwrite keys its own
  early queries still need (the executorch #20346 failure). The chunk's own sink tokens are
  scored in the sink columns, from a copy of the S sink slots.

Keys arrive rotated at their absolute positions and stay so. Attention is
:mod:`ringviz.attention`'s, the window rule :mod:`ringviz.masks`', argument checks
:mod:`ringviz.checks`'. Padding (position -1, left or right) never takes a slot; a query with
nothing visible gets zeros, never NaN.

Things to know (by design, not checked):

* Inputs that require grad pull the storage into the autograd graph (it is written in place);
  run decode under ``torch.no_grad()`` or ``torch.inference_mode()``. A cache created under
  ``inference_mode`` holds inference tensors and cannot be stepped outside it.
* Padding keys/values are zeroed before they meet a query, but a real token's non-finite k/v
  (inf, NaN) can reach queries that cannot see it: a masked key still enters SDPA's
  ``weights @ values`` with weight 0, and ``0 * NaN`` is NaN. Whether it does depends on the
  chunking (which masked slots share a call). Keep k/v finite.

>>> import torch
>>> cache = RingKVCache(batch_size=1, num_kv_heads=1, window=4, head_dim=2)
>>> x = torch.zeros(1, 1, 6, 2)
>>> _ = cache.step(x, x, x, torch.arange(6)[None])    # a 6-token prompt into a 4-slot ring
>>> cache.positions                                     # slot s holds pos with pos % 4 == s
tensor([[4, 5, 2, 3]])
>>> cache.start, cache.kv_seqlens
(tensor([2]), tensor([4]))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ringviz.attention import attend
from ringviz.checks import (
    check_fits,
    check_int,
    check_kv,
    check_positions,
    check_query,
    check_scale,
    check_sink_rope,
    check_tensor,
    missing_positions,
    position_faults,
    raise_position_fault,
)
from ringviz.masks import band_mask, visible
from ringviz.rope import Rope
from ringviz.sinks import rotate_sinks, sinks_with_chunk

_NEVER = torch.iinfo(torch.int64).max  # a position no key reaches

# The seam: a ring step takes q (B, Hq, T, D), k and v (B, Hkv, T, D) and positions (B, T)
# (absolute, -1 = padding), stores what it keeps and returns the attention output (B, Hq, T, D),
# scaled by 1/sqrt(D). A make_step(*, batch_size, num_heads, num_kv_heads, head_dim, dtype,
# device) builds one fresh step (dtype and device those of its inputs, so it can allocate up
# front; a caller that gives the four shapes alone leaves them to the first step:
# ringviz.conformance.seam); a ring factory(window) gives the make_step of a ring of that
# window. RingKVCache is one ring; ringviz.hf, RingRunner and the conformance kit take any
# other in its place.
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MakeStep = Callable[..., Step]


def check_truncate(lengths: object, stored: torch.Tensor, newest: torch.Tensor, *,
                   window: int, capacity: int) -> torch.Tensor:
    """Return ``lengths`` (B,) as int64 if every row b may forget its positions >= lengths[b].

    Row b must have seen ``lengths[b]`` positions and still hold every one a query at
    ``lengths[b]`` needs; otherwise ValueError names the row and the lost positions.
    """
    lengths = check_tensor("lengths", lengths, stored.device)
    B = stored.shape[0]
    if lengths.dtype not in (torch.int64, torch.int32) or lengths.shape != (B,):
        raise ValueError(f"lengths must be int64 or int32 of shape (B,) = ({B},),"
                         f" got {lengths.dtype} {tuple(lengths.shape)}")
    lengths = lengths.to(torch.int64)
    seen = newest + 1  # (B,)
    # kept keys a query at `lengths` sees (the window rule), other than its own position
    needed = visible(lengths[:, None], stored, window) & (stored < lengths[:, None])
    want = torch.minimum(lengths, torch.full_like(lengths, window - 1))
    bad = (lengths < 0) | (lengths > seen) | (needed.sum(-1) < want)  # (B,)
    if not bool(bad.any()):
        return lengths
    b = int(bad.nonzero()[0, 0])
    n = int(lengths[b])
    if n < 0 or n > int(seen[b]):
        raise ValueError(f"row {b}: cannot truncate to {n} positions; it has seen "
                         f"{int(seen[b])}")
    lost = missing_positions(stored, lengths, window)[b]
    raise ValueError(
        f"row {b}: truncating to {n} leaves out position(s) {lost}, which the query at {n} "
        f"needs: later tokens overwrote them (capacity {capacity}, window "
        f"{window}: the ring can take back at most {capacity - window + 1} token(s))")


def home_slots(positions: torch.Tensor, sinks: int, capacity: int) -> torch.Tensor:
    """The slot position ``pos`` is stored in: a sink's own slot ``pos`` if ``pos < sinks``,
    else ``sinks + pos % capacity`` (``pos % capacity`` without sinks).

    >>> home_slots(torch.tensor([0, 1, 5, 9]), sinks=2, capacity=4).tolist()
    [0, 1, 3, 3]
    """
    if not sinks:
        return positions % capacity
    return torch.where(positions < sinks, positions, sinks + positions % capacity)


def chunk_key_positions(stored: torch.Tensor, positions: torch.Tensor, sinks: int
                        ) -> torch.Tensor:
    """Positions ``(B, S + C + T)`` of ``RingKVCache.keys_with_chunk``'s keys.

    ``stored`` ``(B, S + C)`` is what the slots hold, ``positions`` ``(B, T)`` the chunk's. With
    sinks, the chunk's sink tokens take their sink columns and read -1 in the chunk part. A
    function of positions alone, so a mask can be built before the ring's storage exists.

    >>> chunk_key_positions(torch.full((1, 4), -1), torch.tensor([[0, 1, 2]]), sinks=1).tolist()
    [[0, -1, -1, -1, -1, 1, 2]]
    """
    positions = positions.to(torch.int64)
    if not sinks:
        return torch.cat([stored, positions], dim=1)
    B = stored.shape[0]
    slot = torch.where((positions >= 0) & (positions < sinks), positions, sinks)  # sinks: scratch
    scratch = torch.full((B, 1), -1, dtype=torch.int64, device=stored.device)
    sink_pos = torch.cat([stored[:, :sinks], scratch], dim=1).scatter_(1, slot, positions)
    return torch.cat([sink_pos[:, :sinks], stored[:, sinks:],
                      positions.masked_fill(positions < sinks, -1)], dim=1)


def step_key_positions(stored: torch.Tensor | None, q_positions: torch.Tensor, sinks: int,
                       capacity: int, *, empty: bool | None = None) -> torch.Tensor:
    """Positions ``(B, K)`` of the keys a ring step attends over, from positions alone.

    ``stored`` ``(B, S + C)`` is what the slots hold (None: an empty ring not yet allocated).
    Decode (``T == 1``): the slots as they will be once the query is written (its home slot
    holds it). A chunk: :func:`chunk_key_positions`, or the chunk alone into a ring without
    sinks that holds nothing. ``empty``: whether it holds nothing, as the host knows it
    (:attr:`RingKVCache.fresh`); None: found out from ``stored`` (a host sync, which
    ``torch.compile`` cannot trace: a compiled caller passes it). So one mask can be built
    before the write, once for every layer that shares it.

    >>> step_key_positions(torch.tensor([[4, 1, 2, 3]]), torch.tensor([[5]]), 0, 4).tolist()
    [[4, 5, 2, 3]]
    """
    q_positions = q_positions.to(torch.int64)
    B, T = q_positions.shape
    if stored is None:
        empty = True
    elif empty is None and T > 1 and not sinks:
        empty = not bool((stored >= 0).any())
    if T > 1 and empty and not sinks:
        return q_positions
    if stored is None:
        stored = torch.full((B, sinks + capacity), -1, dtype=torch.int64,
                            device=q_positions.device)
    if T > 1:
        return chunk_key_positions(stored, q_positions, sinks)
    slots = torch.arange(stored.shape[1], device=stored.device)
    home = home_slots(q_positions, sinks, capacity)  # (B, 1); a padding query writes nothing
    return torch.where((slots == home) & (q_positions >= 0), q_positions, stored)


def storage_bytes(batch_size: int, num_kv_heads: int, slots: int, head_dim: int,
                  dtype: torch.dtype) -> int:
    """Bytes of a ring's storage (:attr:`RingKVCache.nbytes`) for ``slots = S + C``: keys and
    values ``(B, Hkv, slots + 1, D)`` and positions ``(B, slots + 1)``, the spare included.

    >>> storage_bytes(1, 1, 4, 2, torch.float32)  # 2 * 5 * 2 * 4 + 5 * 8
    120
    """
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    return batch_size * (slots + 1) * (2 * num_kv_heads * head_dim * itemsize + 8)


class Rows(NamedTuple):
    """What the host knows of every row, without reading the ring back (chapter 7's
    ``BatchRing`` keeps its rows' lengths the same way).

    ``runs[b]``: how many of row b's newest positions the ring holds, consecutive (at most
    ``capacity``): exact after a validated call, a lower bound after a trusted one (0 when its
    positions were not vouched for). ``newest[b]``: row b's newest position, or None when the
    host does not know it (after a trusted call, whose positions are never read).
    """

    runs: list[int]
    newest: list[int] | None


class RingKVCache:
    """A batch of rings, one per row, holding each row's last ``window`` keys and values.

    ``sinks=S`` keeps each row's positions ``0 .. S-1`` too, in ``S`` slots before the ring;
    ``sink_rope`` picks their RoPE convention (module docstring): None = absolute positions,
    a rotation ``f(x, positions)`` = StreamingLLM's positions inside the cache. ``capacity``
    (default ``window``) adds draft slots that rejected drafts may overwrite.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int, *,
                 sinks: int = 0, sink_rope: Rope | None = None, capacity: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                            ("window", window), ("head_dim", head_dim)):
            check_int(name, value)
        sinks = check_int("sinks", sinks, minimum=0)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        capacity = window if capacity is None else check_int("capacity", capacity, window)
        device = torch.empty(0, device=device).device  # "cuda" -> cuda:0; None -> the default
        check_fits(f"RingKVCache(batch_size={batch_size}, num_kv_heads={num_kv_heads}, "
                      f"sinks + capacity={sinks + capacity}, head_dim={head_dim}, {dtype})",
                      storage_bytes(batch_size, num_kv_heads, sinks + capacity, head_dim, dtype),
                      device)
        self.sink_rope = check_sink_rope(sink_rope, sinks, head_dim, dtype, device)
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
        self._rows = Rows([0] * batch_size, [-1] * batch_size)  # every row empty, as reset()
        self._fresh = True  # no write since made or reset (:attr:`fresh`)

    # ------------------------------------------------------------------ storage
    def _views(self) -> None:
        """The views without the spare slot, and the flat views a decode write copies into
        (one index_copy_ per tensor: cheaper than an advanced-index assignment)."""
        B, H, n1, D = self._k_store.shape
        self.k = self._k_store[:, :, :self._spare]  # (B, num_kv_heads, S + C, head_dim)
        self.v = self._v_store[:, :, :self._spare]
        self.positions = self._pos_store[:, :self._spare]  # (B, S + C), -1 = empty
        self._k_rows = self._k_store.view(-1, D)  # (B * num_kv_heads * (S + C + 1), D)
        self._v_rows = self._v_store.view(-1, D)
        self._head_base = torch.arange(B * H, device=self.device).view(B, H) * n1
        self._pos_base = torch.arange(B, device=self.device) * n1
        self._pos_rows = self._pos_store.view(-1)  # (B * (S + C + 1),)
        self._last_col = self._last_pos[:, None]  # (B, 1): a decode write's positions copy in
        # what one decode token per row looks like (:meth:`_is_token`)
        self._token = (torch.Size((B, H, 1, D)), torch.Size((B, 1)), self._k_store.dtype,
                       self._k_store.device)

    _VIEWS = ("k", "v", "positions", "_k_rows", "_v_rows", "_head_base", "_pos_base",
              "_pos_rows", "_last_col", "_token")

    def __getstate__(self) -> dict:
        """The storage and what the host knows; the views are made again on unpickling
        (pickle copies each view's bytes on its own, so it would cut them off the storage)."""
        return {name: value for name, value in self.__dict__.items()
                if name not in self._VIEWS}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._views()

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
        self._rows = Rows([0] * self.batch_size, [-1] * self.batch_size)
        self._fresh = True

    # ------------------------------------------------------------------ the window
    @property
    def kv_seqlens(self) -> torch.Tensor:
        """``(B,)`` number of cached entries visible to each row's newest position."""
        return self._visible_now().sum(dim=-1)

    @property
    def start(self) -> torch.Tensor:
        """``(B,)`` slot of each row's oldest visible entry (0 for an empty row)."""
        oldest = torch.where(self._visible_now(), self.positions, _NEVER).argmin(dim=-1)
        return torch.where(self._visible_now().any(dim=-1), oldest, 0)

    def _visible_now(self) -> torch.Tensor:
        return self._mask(self._last_pos[:, None], self.positions)[:, 0]

    def _decode_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """``(B, 1, S + C)`` visibility for decode queries ``positions`` (B, 1) just written.

        Each query is now its row's newest position, so no stored key comes after it: a ring
        slot is visible if its position is inside the window, ``pos > q - W`` (the bound
        clamped to -1, so an empty slot never is; a padding query's above every position), a
        sink slot if it holds its position. One comparison over the slots, the rest on (B, 1).
        """
        bound = (positions - self.window).clamp_min_(-1).masked_fill_(positions < 0, _NEVER)
        mask = self.positions > bound  # (B, S + C)
        if self.sinks:
            mask[:, :self.sinks] = (self.positions[:, :self.sinks] >= 0) & (positions >= 0)
        return mask[:, None]

    def _mask(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """``(B, Tq, Tk)`` visibility: the window, plus the sinks when there are any."""
        return band_mask(q_positions, k_positions, self.window, self.sinks)


    # ------------------------------------------------------------------ what the rows accept
    def _check_q(self, q: torch.Tensor, T: int, q_positions: object = None, *,
                 last: bool = False) -> None:
        check_query(q, T, batch_size=self.batch_size, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim, dtype=self.dtype, device=self.device,
                    q_positions=q_positions, last=last)

    def check_positions(self, positions: torch.Tensor) -> bool:
        """Raise if ``positions`` (B, T) could not be written next, writing nothing; else
        whether they are one token per row at its next position. One host sync."""
        check_tensor("positions", positions, self.device)
        T = positions.shape[-1] if positions.ndim else -1
        return self._look(positions, T)[1] and T == 1

    def _check_call(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
                    check: bool, contiguous: bool, q: torch.Tensor | None = None
                    ) -> tuple[Rows, bool]:
        """Validate a call (``check``: one host read), or take the caller's word; change
        nothing. Returns what the host will know of the rows once the call is written, and
        whether its tokens are every row's next positions (newest + 1, + 2, ...)."""
        if not check:  # positions never read
            return self._vouched(k.shape[2]) if contiguous else (
                Rows([0] * self.batch_size, None), False)
        if self._is_token(q, k, v, positions):  # a decode loop's call
            rows, nxt = self._look_decode(positions)
        else:  # anything else, and every fault, named
            check_kv(k, v, batch_size=self.batch_size, num_kv_heads=self.num_kv_heads,
                     head_dim=self.head_dim, dtype=self.dtype, device=self.device)
            T = k.shape[2]
            check_tensor("positions", positions, self.device)
            if q is not None:  # a chunk's q may hold only its last queries (:meth:`attend_chunk`)
                self._check_q(q, T, last=T > 1)
            rows, nxt = self._look(positions, T)
        if contiguous and not nxt:
            raise ValueError("contiguous=True, but some row's positions are not its newest + 1, "
                             "+ 2, ... (padding or a gap)")
        return rows, nxt

    def _vouched(self, T: int) -> tuple[Rows, bool]:
        """A trusted call of ``T`` tokens that the caller vouches are every row's next
        positions (``contiguous=True``): each run grows by ``T``, each newest (if known) too.

        While a CUDA graph captures the call, the newest positions are forgotten: a slot
        picked on the host would be replayed for every later token, so the capture and every
        write after it pick their slots on the device until a validated call reads them
        again. While ``torch.compile`` traces it, the runs are forgotten too (a host int read
        in a graph is a guard: the graph would recompile as it changes).
        """
        if torch.compiler.is_compiling():
            return Rows([0] * self.batch_size, None), True
        runs = self._runs_after(T)
        newest = self._rows.newest
        if newest is None or self._capturing():
            return Rows(runs, None), True
        return Rows(runs, [n + T for n in newest]), True

    def _runs_after(self, T: int) -> list[int]:
        """Each row's run once it writes its next ``T`` positions (at most ``capacity``); a
        full ring's runs as they were (the same list: a ``Rows`` is never changed in place)."""
        runs, C = self._rows.runs, self.capacity
        return runs if min(runs, default=C) >= C else [min(C, r + T) for r in runs]

    def _capturing(self) -> bool:
        """Whether a CUDA graph is capturing this call (recording it, not only running it)."""
        return self._token[3].type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _is_token(self, q: object, k: object, v: object, positions: object) -> bool:
        """Whether ``k``, ``v``, ``positions`` (and ``q``, unless None) are one decode token per
        row, well formed: all that :func:`check_kv`, :func:`check_query` and the positions'
        dtype and shape checks ask at ``T = 1``, in one expression, as a decode loop's every
        call needs. A call it turns away takes those checks, which name what is wrong."""
        shape, rows, dtype, device = self._token  # (B, Hkv, 1, D), (B, 1)
        tensor = torch.Tensor
        return (isinstance(k, tensor) and isinstance(v, tensor) and isinstance(positions, tensor)
                and k.shape == shape and v.shape == shape and positions.shape == rows
                and k.dtype == dtype and v.dtype == dtype
                and positions.dtype in (torch.int64, torch.int32)
                and k.device == device and v.device == device and positions.device == device
                and (q is None or isinstance(q, tensor) and q.dtype == dtype
                     and q.device == device and q.ndim == 4 and q.shape[0] == shape[0]
                     and q.shape[2] == 1 and q.shape[3] == shape[3]
                     and q.shape[1] > 0 and q.shape[1] % shape[1] == 0))

    def _look(self, positions: torch.Tensor, T: int) -> tuple[Rows, bool]:
        """:func:`ringviz.checks.check_positions` of ``positions`` (B, T), and the rows after
        them (:meth:`_check_call`), from one host read when valid."""
        if T == 1 and positions.dtype in (torch.int64, torch.int32) \
                and positions.shape == (self.batch_size, 1):  # the decode loop's case
            return self._look_decode(positions)
        bad, before = position_faults(positions, self._last_pos, T)
        pos = positions.to(torch.int64)
        real = pos >= 0
        gaps = (real & (pos != before + 1)).cumsum(dim=1)  # (B, T) real tokens off their run
        tail = (real & (gaps == gaps[:, -1:])).sum(dim=1)  # real tokens since the last gap
        newest = torch.maximum(before[:, -1], pos[:, -1])  # padding (-1) never above
        n_bad, *rest = torch.cat([bad.sum()[None], tail, gaps[:, -1], newest]).tolist()
        if n_bad:
            raise_position_fault(positions, self._last_pos, bad, before)
        B, C = self.batch_size, self.capacity
        tails, gapped = rest[:B], rest[B:2 * B]
        runs = [min(C, t if g else r + t) for t, g, r in zip(tails, gapped, self._rows.runs)]
        return Rows(runs, rest[2 * B:]), not any(gapped) and min(tails) == T

    def _look_decode(self, positions: torch.Tensor) -> tuple[Rows, bool]:
        """:meth:`_look` of one position per row, in plain Python: the positions read once
        (with each row's newest, when the host does not know them). A decode loop's step,
        every row at its next position, is one comparison of two lists."""
        newest = self._rows.newest
        if newest is None:
            new, newest = torch.stack([positions[:, 0].to(torch.int64), self._last_pos]).tolist()
        else:
            new = [p for (p,) in positions.tolist()]
        if new == [n + 1 for n in newest]:  # every row's next position
            return Rows(self._runs_after(1), new), True
        if any(p <= n and p != -1 for p, n in zip(new, newest)):  # -1: padding, no write
            check_positions(positions, self._last_pos, 1)  # raises, naming the row
        runs = [r if p < 0 else min(self.capacity, r + 1) if p == n + 1 else 1
                for p, n, r in zip(new, newest, self._rows.runs)]
        return (Rows(runs, [max(p, n) for p, n in zip(new, newest)]),
                all(p == n + 1 for p, n in zip(new, newest)))

    # ------------------------------------------------------------------ the ring
    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
              check: bool = True, contiguous: bool = False) -> None:
        """Write ``T`` tokens per row into slots ``pos % capacity``; keep each row's last C.

        Positions below ``sinks`` go to their sink slots instead, kept for good. Tokens of a
        chunk that would be overwritten by a later token of the same chunk, and
        padding (-1), are not stored. ``check=False`` skips validation (and its host sync),
        for CUDA-graph capture of a trusted decode loop; ``contiguous=True`` then vouches that
        every row's positions are its newest + 1, + 2, ... (no padding, no gap), which is what
        lets a trusted loop's full ring decode without a mask (:meth:`step`).
        """
        rows, nxt = self._check_call(k, v, positions, check=check, contiguous=contiguous)
        self._write(k, v, positions.to(torch.int64), rows, nxt)

    def _write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, rows: Rows,
               nxt: bool) -> None:
        """:meth:`write` of checked (or trusted) int64 ``positions``; the host then knows
        ``rows``. ``nxt``: every row's token is its next position (:meth:`_check_call`)."""
        self._fresh = False
        if positions.shape[1] == 1:
            self._write_token(k, v, positions, rows.newest if nxt else None, nxt)
        else:
            self._write_chunk(k, v, positions)
        self._rows = rows

    def _write_token(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     newest: list[int] | None, nxt: bool) -> None:
        """A decode write, ``positions`` (B, 1). Each row's next position (``nxt``) is its
        newest and goes to its home slot; one slot for every row, known on the host
        (``newest``: validated or vouched), is three strided copies with no index arithmetic
        (a decode step's eager ops cost microseconds each). Anything else: padding to the
        spare slot."""
        S, C = self.sinks, self.capacity
        if newest is not None and min(newest) == max(newest):
            p = newest[0]
            slot = p if p < S else S + p % C
            self._k_store.narrow(2, slot, 1).copy_(k)
            self._v_store.narrow(2, slot, 1).copy_(v)
            self._pos_store.narrow(1, slot, 1).copy_(positions)
            self._last_col.copy_(positions)
            return
        pos = positions[:, 0]
        slot = home_slots(pos, S, C)
        if not nxt:  # padding (-1) writes the spare slot and leaves the row's newest
            slot = torch.where(pos >= 0, slot, self._spare)
        rows = (self._head_base + slot[:, None]).view(-1)  # (B * num_kv_heads,) storage rows
        self._k_rows.index_copy_(0, rows, k.reshape(-1, self.head_dim))
        self._v_rows.index_copy_(0, rows, v.reshape(-1, self.head_dim))
        self._pos_rows.index_copy_(0, self._pos_base + slot, pos)
        if nxt:
            self._last_col.copy_(positions)
        else:
            torch.maximum(self._last_pos, pos, out=self._last_pos)

    def _write_chunk(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """A chunk's write, ``positions`` (B, T): one scatter per tensor. A row keeps its
        newest ``C`` positions (and its sinks); the rest, padding too, go to the spare slot."""
        B, H, T, D = k.shape
        newest = torch.maximum(self._last_pos, positions.max(dim=1).values)  # (B,)
        recent = positions > newest[:, None] - self.capacity  # (B, T)
        if self.sinks:
            recent = recent | (positions < self.sinks)
        keep = (positions >= 0) & recent
        # kept ring tokens of a row span < C positions, so their slots are distinct; the rest
        # share the spare slot, whose contents are never read
        slot = torch.where(keep, home_slots(positions, self.sinks, self.capacity), self._spare)
        index = slot[:, None, :, None].expand(B, H, T, D)
        self._k_store.scatter_(2, index, k)
        self._v_store.scatter_(2, index, v)
        self._pos_store.scatter_(1, slot, positions)
        self._last_pos.copy_(newest)

    @property
    def fresh(self) -> bool:
        """Whether the ring has taken no write since it was made or :meth:`reset`: it holds
        nothing, known on the host without reading the positions (a trusted write's are never
        read), so a chunk into it without sinks attends over itself alone
        (:func:`step_key_positions`), validated or trusted alike."""
        return self._fresh

    @property
    def window_full(self) -> bool:
        """Every row holds its last ``window`` positions, and nothing else
        (:meth:`full_after`)."""
        return self.full_after(0)

    def full_after(self, grow: int) -> bool:
        """Whether every row holds its last ``window`` positions, and nothing else, once each
        writes its next ``grow`` positions: then a decode query at each row's next position
        sees every stored key, and attends without a mask (chapter 10).

        Known on the host, from each row's run (:class:`Rows`), never read back. Never
        with sinks, nor with draft slots (``capacity > window``: they hold keys that have left
        the window). ``ringviz.hf`` asks it before a decode step's write; :meth:`step` after.
        """
        return (not self.sinks and self.capacity == self.window
                and min(self._rows.runs, default=0) + grow >= self.capacity)

    def attend(self, q: torch.Tensor, q_positions: torch.Tensor, *,
               scale: float | None = None) -> torch.Tensor:
        """Attention of ``q`` (B, Hq, T, D) over the ring as it is now, masked by positions."""
        scale = check_scale(scale)
        self._check_q(q, q.shape[2] if q.ndim == 4 else -1, q_positions)
        q_positions = q_positions.to(torch.int64)
        mask = self._mask(q_positions, self.positions)  # (B, T, S + W)
        return self.attend_keys(q, q_positions, self.k, self.v, mask, scale)

    def attend_keys(self, q: torch.Tensor, q_positions: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, mask: torch.Tensor, scale: float | None
                    ) -> torch.Tensor:
        """Masked attention over ``keys`` whose first ``S`` are the sink slots, in this cache's
        sink convention (the storage, or :meth:`keys_with_chunk`'s keys; ringviz.hf calls it)."""
        sink_keys = None if self.sink_rope is None else rotate_sinks(
            keys[:, :, :self.sinks], q_positions, self.window, self.sink_rope)
        return attend(q, keys, values, mask, scale=scale, sink_keys=sink_keys,
                      empty=q_positions < 0)  # a real query always sees itself

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
             *, scale: float | None = None, check: bool = True, contiguous: bool = False,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend ``T`` new tokens per row to their windows and store them: ``(B, Hq, T, D)``.

        ``check=False`` skips the tensor checks (and their one host sync) for a trusted loop;
        ``scale`` is checked either way (plain Python, no sync). ``contiguous=True`` vouches
        that every row's positions are its newest + 1, + 2, ... (a validated call finds it out
        in its own sync). A decode step at every row's next position into a ring that was
        already full (:attr:`window_full` after the write) is one slot write and attention over
        the raw ring with no mask: every stored key is inside every query's window, bit for
        bit what the mask gives. ``mask`` ``(B, T, K)``, trusted, is the visibility of
        :meth:`key_positions` ``(positions)`` when the caller has built it once for many layers
        (``ringviz.hf``'s forward plan); by default the step builds it.
        """
        check_scale(scale)
        rows, nxt = self._check_call(k, v, positions, check=check, contiguous=contiguous, q=q)
        if positions.dtype != torch.int64:
            positions = positions.to(torch.int64)
        if k.shape[2] > 1:  # a chunk: attend over [ring | chunk] first, then write
            out = self.attend_chunk(q, k, v, positions, scale=scale, mask=mask)
            self._write(k, v, positions, rows, nxt)
            return out
        self._write(k, v, positions, rows, nxt)  # decode: write, then attend over the raw ring
        if nxt and mask is None and self.window_full:  # every stored key in every window
            return attend(q, self.k, self.v, scale=scale)
        mask = self._decode_mask(positions) if mask is None else mask  # (B, 1, S + C)
        return self.attend_keys(q, positions, self.k, self.v, mask, scale)

    def attend_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor, *, scale: float | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of a chunk's queries over ``[ring | chunk]``, writing nothing.

        The first half of :meth:`step` for ``T > 1`` (``step`` then writes the chunk), and
        on its own the verify pass of speculative decoding, which commits only accepted
        tokens. Inputs as for :meth:`step`, trusted (not checked).
        """
        positions = positions.to(torch.int64)
        keys, values, key_pos = self.keys_with_chunk(k, v, positions)
        # q may hold only the chunk's last queries
        # (Gemma 4's KV-shared layers drop the rest)
        q_positions = positions[:, positions.shape[1] - q.shape[2]:]
        mask = self._mask(q_positions, key_pos) if mask is None else mask  # (B, Tq, K)
        return self.attend_keys(q, q_positions, keys, values, mask, check_scale(scale))

    def keys_with_chunk(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys, values and positions a chunk attends over before it is written.

        ``[ring | chunk]``: the storage as it is, then the chunk's tokens, padding zeroed (masked
        out, but ``0 * NaN`` is NaN). With sinks, the chunk's sink tokens take the sink columns
        and are masked in the chunk part. Shapes ``(B, Hkv, S + C + T, D)`` twice and
        ``(B, S + C + T)`` (:func:`step_key_positions`); into an empty ring without sinks, just
        the chunk (the ring's keys would all be masked).
        """
        positions = positions.to(torch.int64)
        pad = (positions < 0)[:, None, :, None]  # (B, 1, T, 1)
        k_new, v_new = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
        if positions.shape[1] > 1:  # as step attends: maybe the chunk alone
            key_pos = self.key_positions(positions)
        else:  # a verify of one token (speculative decoding): [ring | token], nothing written
            key_pos = chunk_key_positions(self.positions, positions, self.sinks)
        if key_pos.shape[1] == positions.shape[1]:  # the chunk alone
            return k_new, v_new, key_pos
        if not self.sinks:
            return torch.cat([self.k, k_new], dim=2), torch.cat([self.v, v_new], dim=2), key_pos
        S = self.sinks  # the sink slots as they will be once the chunk's sink tokens are in
        sink_k = sinks_with_chunk(self._k_store, k_new, positions, S)
        sink_v = sinks_with_chunk(self._v_store, v_new, positions, S)
        return (torch.cat([sink_k, self.k[:, :, S:], k_new], dim=2),
                torch.cat([sink_v, self.v[:, :, S:], v_new], dim=2), key_pos)

    def key_positions(self, q_positions: torch.Tensor) -> torch.Tensor:
        """``(B, K)`` positions of the keys :meth:`step` attends over for these queries: the
        slots once a decode token is written, ``[sinks | ring | chunk]`` before a chunk is."""
        return step_key_positions(self.positions, q_positions, self.sinks, self.capacity,
                                  empty=self.fresh)

    def grown(self, window: int, capacity: int) -> RingKVCache:
        """A ring of ``window`` and ``capacity`` holding what this one holds, each key in its
        home slot for the new capacity; this ring is left as it was.

        For a ring that grows with its tokens (``ringviz.hf``: never more slots than tokens).
        Each row holds at most its last ``self.capacity`` positions, so they stay distinct
        modulo a capacity as large or larger, and nothing is lost. What the host knew
        (:class:`Rows`) still holds: the same rows, the same positions.
        """
        capacity = check_int("capacity", capacity, self.capacity)
        window = check_int("window", window, self.window)
        if window > capacity:
            raise ValueError(f"window {window} is larger than capacity {capacity}")
        new = RingKVCache(self.batch_size, self.num_kv_heads, window, self.head_dim,
                          sinks=self.sinks, sink_rope=self.sink_rope, capacity=capacity,
                          dtype=self.dtype, device=self.device)
        held = self.positions >= 0  # (B, S + C)
        slot = torch.where(held, home_slots(self.positions, self.sinks, capacity), new._spare)
        B, H, n, D = self.k.shape
        index = slot[:, None, :, None].expand(B, H, n, D)
        new._k_store.scatter_(2, index, self.k)
        new._v_store.scatter_(2, index, self.v)
        new._pos_store.scatter_(1, slot, self.positions)
        for store in (new._k_store, new._v_store):  # empty slots wrote into the spare
            store[:, :, new._spare].zero_()
        new._pos_store[:, new._spare] = -1
        new._last_pos.copy_(self._last_pos)
        new._rows, new._fresh = self._rows, self._fresh
        return new

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
        if index.numel() > self.batch_size:  # more rows: new storage, checked before it is made
            check_fits(f"take_rows of {index.numel()} rows",
                          self.nbytes // self.batch_size * index.numel(), self.device)
        stores = (self._k_store, self._v_store, self._pos_store, self._last_pos)
        # the index is not read: every row keeps the smallest run (a lower bound), the newest
        # are forgotten
        self._rows = Rows([min(self._rows.runs, default=0)] * index.numel(), None)
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

        Row b may then write from position ``lengths[b]`` again. Nothing is restored: a key
        that a forgotten token overwrote is gone. So ``check`` (the default) raises
        ValueError, and changes nothing, unless row b still holds every position its next
        query needs, ``lengths[b] - window + 1 .. lengths[b] - 1`` (positions are a token
        sequence's, one per index). A ring can take back ``capacity - window + 1`` tokens:
        one without spare slots (chapter 13).
        ``check=False`` skips the check and its host sync.
        """
        if check:
            self.check_truncation(lengths)
        lengths = lengths.to(torch.int64)
        self._pos_store.masked_fill_(self._pos_store >= lengths[:, None], -1)
        torch.minimum(self._last_pos, lengths - 1, out=self._last_pos)
        self._rows = Rows([0] * self.batch_size, None)  # what each row holds now: not read

    def check_truncation(self, lengths: torch.Tensor) -> None:
        """Raise what :meth:`truncate` would refuse (:func:`check_truncate`), changing nothing."""
        check_truncate(lengths, self.positions, self._last_pos, window=self.window,
                       capacity=self.capacity)

    def missing_positions(self, lengths: torch.Tensor) -> list[list[int]]:
        """Per row b: positions a query at ``lengths[b]`` needs, ``lengths[b] - W + 1 ..
        lengths[b] - 1``, that the cache does not hold (a host sync; for checks and reports)."""
        return missing_positions(self.positions, lengths, self.window)

    def __repr__(self) -> str:
        rope = getattr(self.sink_rope, "__name__", self.sink_rope)
        return (f"RingKVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"window={self.window}, capacity={self.capacity}, head_dim={self.head_dim}, "
                f"sinks={self.sinks}, sink_rope={rope}, dtype={self.dtype}, device={self.device})")
