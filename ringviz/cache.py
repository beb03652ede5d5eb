"""The batched ring KV cache (torch): fixed storage, one slot write per token, exact attention.

Storage (:mod:`ringviz.storage`) is allocated once and only written in place; ``positions``
records the absolute position each slot holds (-1 = empty), and masks come from it, never from
slot order. Position ``pos`` goes to slot ``pos % C``, or with ``sinks=S`` (StreamingLLM's
attention sinks) positions ``0 .. S-1`` to slots ``0 .. S-1`` for good and the rest to
``S + pos % C`` (:mod:`ringviz.slots`). ``C`` is ``capacity``: the window ``W`` unless
speculative decoding asks for spare slots (chapter 13: masks still use ``W``, and
:meth:`~ringviz.storage.RingStorage.truncate` forgets rejected draft tokens).

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

Keys arrive rotated at their absolute positions and stay so; ``sink_rope`` picks how the sinks
are scored (absolute positions, or StreamingLLM's positions inside the cache: :mod:`ringviz.sinks`).
Attention is :mod:`ringviz.attention`'s, argument checks :mod:`ringviz.checks`'. Padding
(position -1, left or right) never takes a slot; a query with nothing visible gets zeros, never
NaN. Every check runs before anything is written: a rejected call changes nothing.

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

import torch

from ringviz.attention import ring_attention, unmasked_attention
from ringviz.checks import (
    check_int,
    check_scale,
    check_sink_rope,
)
from ringviz.masks import band_mask
from ringviz.rope import Rope
from ringviz.runs import Told
from ringviz.sinks import sinks_with_chunk
from ringviz.slots import chunk_key_positions, home_slots, step_key_positions
from ringviz.storage import RingStorage

_NEVER = torch.iinfo(torch.int64).max  # a position no key reaches


class RingKVCache(RingStorage):
    """A batch of rings, one per row, holding each row's last ``window`` keys and values.

    ``sinks=S`` keeps each row's positions ``0 .. S-1`` too, in ``S`` slots before the ring;
    ``sink_rope`` picks their RoPE convention (module docstring): None = absolute positions,
    a rotation ``f(x, positions)`` = StreamingLLM's positions inside the cache. The storage and
    its row operations (``take_rows``, ``truncate``) are :class:`ringviz.storage.RingStorage`'s.
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
        self.sink_rope = check_sink_rope(sink_rope, sinks, head_dim, dtype,
                                         torch.empty(0, device=device).device)
        # ring slots per row: the window, plus any spare slots that rejected drafts may overwrite
        capacity = window if capacity is None else check_int("capacity", capacity, window)
        super().__init__(batch_size, num_kv_heads, window, head_dim, sinks, capacity, dtype,
                         device)

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
        """``(B, 1, S + C)`` visibility for a decode query ``positions`` (B, 1) just written.

        Its write made it its row's newest position, so no stored key lies in its future and
        one comparison with the window's lower edge decides (empty slots hold -1, never above
        it; a padding query's edge is past every position). Same result as :meth:`_mask`,
        in two elementwise ops over the slots instead of seven.
        """
        if self.sinks:
            return self._mask(positions, self.positions)
        edge = torch.where(positions >= 0, (positions - self.window).clamp_min(-1), _NEVER)
        return (self.positions > edge)[:, None]  # (B, 1, C): key > q - W and key >= 0

    def _mask(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """``(B, Tq, Tk)`` visibility: the window, plus the sinks when there are any."""
        return band_mask(q_positions, k_positions, self.window, self.sinks)

    def check_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, *, scale: float | None = None) -> None:
        """Raise exactly what :meth:`step` would reject, writing nothing."""
        check_scale(scale)
        self._told(k, v, positions, check=True, contiguous=False, q=q)

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
        self._write(k, v, positions.to(torch.int64),
                    self._told(k, v, positions, check=check, contiguous=contiguous))

    def _told(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *, check: bool,
              contiguous: bool, q: torch.Tensor | None = None) -> Told:
        """Validate a call (``check``), or take the caller's word: what it tells the runs."""
        if not check:  # (under torch.compile, a host int read in the graph would recompile it)
            vouched = contiguous and not torch.compiler.is_compiling()
            return self._runs.grown(k.shape[2]) if vouched else Told()
        told = self._check_kv(k, v, positions)
        if q is not None:
            self._check_q(q, k.shape[2])
        if contiguous and not told.next:
            raise ValueError("contiguous=True, but some row's positions are not its newest + 1, "
                             "+ 2, ... (padding or a gap)")
        return told

    def _write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               told: Told) -> None:
        """:meth:`write` of trusted int64 ``positions``, then the runs take what ``told`` says."""
        B, H, T, D = k.shape
        if T == 1 and told.next and not self.sinks:  # every row's newest + 1: stored, no guard
            slots = {p % self.capacity for p in told.newest or ()}  # one, known on the host?
            self._write_one(k, v, positions, slots.pop() if len(slots) == 1
                            else positions[:, 0] % self.capacity)
            self._last_col.copy_(positions)
            self._runs.commit(told)
            return
        if T == 1:  # decode: a real token is always the row's newest, so it is always kept
            newest = torch.maximum(self._last_pos, positions[:, 0])  # (B,)
            keep = positions >= 0
        else:
            newest = torch.maximum(self._last_pos, positions.max(dim=1).values)  # (B,)
            recent = positions > newest[:, None] - self.capacity  # (B, T)
            if self.sinks:
                recent = recent | (positions < self.sinks)
            keep = (positions >= 0) & recent
        # kept ring tokens of a row span < C positions, so their slots are distinct; the rest
        # share the spare slot, whose contents are never read
        slot = torch.where(keep, home_slots(positions, self.sinks, self.capacity), self._spare)
        if T == 1:
            self._write_one(k, v, positions, slot[:, 0])
        else:
            self._k_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), k)
            self._v_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), v)
            self._pos_store.scatter_(1, slot, positions)
        self._last_pos.copy_(newest)
        self._runs.commit(told)

    @property
    def window_full(self) -> bool:
        """Every row holds its last ``window`` positions, and nothing else.

        Known on the host, from what the cache was told: then a decode query
        at each row's next position sees every stored key, and :meth:`step`
        attends without a mask. Never with sinks, nor with spare slots
        (``capacity > window``: they hold keys that have left the window).
        """
        return (not self.sinks and self.capacity == self.window
                and self._runs.least >= self.capacity)

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
        return ring_attention(q, q_positions, keys, values, mask, sinks=self.sinks,
                              window=self.window, sink_rope=self.sink_rope, scale=scale,
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
        told = self._told(k, v, positions, check=check, contiguous=contiguous, q=q)
        if positions.dtype != torch.int64:
            positions = positions.to(torch.int64)
        if k.shape[2] == 1:  # decode: write first, then one attention over the raw ring
            self._write(k, v, positions, told)
            if told.next and mask is None and self.window_full:  # every key in its window
                return unmasked_attention(q, self.k, self.v, scale=scale)
            mask = self._decode_mask(positions) if mask is None else mask  # (B, 1, S + C)
            return self.attend_keys(q, positions, self.k, self.v, mask, scale)
        out = self.attend_chunk(q, k, v, positions, scale=scale, mask=mask)
        self._write(k, v, positions, told)
        return out

    def attend_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor, *, scale: float | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of a chunk's queries over ``[ring | chunk]``, writing nothing.

        The first half of :meth:`step` for ``T > 1`` (``step`` then writes the chunk), and on
        its own the verify pass of speculative decoding, which commits only accepted tokens.
        Inputs as for :meth:`step`, trusted (call :meth:`check_step` first).
        """
        positions = positions.to(torch.int64)
        keys, values, key_pos = self.keys_with_chunk(k, v, positions)
        # q may hold only the chunk's last queries (Gemma 4's KV-shared layers drop the rest)
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
        return step_key_positions(self.positions, q_positions, self.sinks, self.capacity)

    def __repr__(self) -> str:
        rope = getattr(self.sink_rope, "__name__", self.sink_rope)
        return (f"RingKVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"window={self.window}, capacity={self.capacity}, head_dim={self.head_dim}, "
                f"sinks={self.sinks}, sink_rope={rope}, dtype={self.dtype}, device={self.device})")
