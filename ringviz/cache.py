"""The batched ring KV cache (torch): fixed storage, one slot write per token, exact attention.

Storage ``k``/``v`` ``(B, n_kv_heads, S + C, head_dim)`` is allocated once and only ever
written in place (its address never changes: CUDA-graph friendly); ``positions`` ``(B, S + C)``
records the absolute position each slot holds (-1 = empty), and masks come from it, never from
slot order. Slots, per row: ``[ S sink slots | C ring slots | spare ]`` (:mod:`ringviz.slots`):
position ``pos`` goes to slot ``pos % C``, or with ``sinks=S`` (StreamingLLM's attention sinks)
positions ``0 .. S-1`` to slots ``0 .. S-1`` for good and the rest to ``S + pos % C``. ``C`` is
``capacity``, the ring's slots per row: the window ``W`` unless speculative decoding asks for
spare slots. Tokens that must not be stored (padding, chunk tokens a later token of the same
chunk overwrites) go to the spare slot, so a write is one scatter with no host sync.

One call, :meth:`RingKVCache.step`, takes a chunk of ``T`` new tokens per row (``T = 1`` is
decode) and returns their attention output:

* ``T == 1``: write the token into its slot, then attend over the raw storage
  (``S + window`` keys, in slot order, masked by stored positions). No copy, no reordering.
* ``T > 1`` (prefill, chunks, also ``T > window``): attend over ``[sinks | ring | chunk]``
  first, then write. A chunk longer than the window would otherwise overwrite keys its own
  early queries still need (the executorch #20346 failure). The chunk's own sink tokens are
  scored in the sink columns, from a copy of the S sink slots.

Keys arrive rotated at their absolute positions and stay so; ``sink_rope`` picks how the sinks
are scored (absolute positions, or StreamingLLM's positions inside the cache: :mod:`ringviz.sinks`).
Attention itself is :mod:`ringviz.attention`'s; every argument check is :mod:`ringviz.checks`'.

Padding (position -1, left or right) never takes a slot; a query with nothing visible gets
zeros, never NaN. Every check runs before anything is written: a rejected call changes nothing.

Things to know (by design, not checked):

* Inputs that require grad pull the storage into the autograd graph (it is written in place);
  run decode under ``torch.no_grad()`` or ``torch.inference_mode()``.
* A cache created under ``inference_mode`` holds inference tensors and cannot be stepped
  outside it.
* Padding keys/values are zeroed before they meet a query, but a real token's non-finite k/v
  (inf, NaN) can reach queries that cannot see it: a masked key still enters SDPA's
  ``weights @ values`` with weight 0, and ``0 * NaN`` is NaN. Whether it does depends on the
  chunking (which masked slots share a call). Keep k/v finite.

Speculative decoding (chapter 13) adds ``capacity > window`` (masks still use ``window``) and
:meth:`RingKVCache.truncate`, which forgets rejected draft tokens.

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

from ringviz.attention import ring_attention
from ringviz.checks import (
    check_int,
    check_kv,
    check_positions,
    check_query,
    check_scale,
    check_sink_rope,
    check_tensor,
    check_truncate,
    missing_positions,
)
from ringviz.masks import band_mask
from ringviz.rope import Rope
from ringviz.sinks import sinks_with_chunk
from ringviz.slots import chunk_key_positions, home_slots, step_key_positions

_NEVER = torch.iinfo(torch.int64).max  # a position no key reaches


class RingKVCache:
    """A batch of rings, one per row, holding each row's last ``window`` keys and values.

    ``sinks=S`` keeps each row's positions ``0 .. S-1`` too, in ``S`` slots before the ring;
    ``sink_rope`` picks their RoPE convention (module docstring): None = absolute positions,
    a rotation ``f(x, positions)`` = StreamingLLM's positions inside the cache.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int, *,
                 sinks: int = 0, sink_rope: Rope | None = None, capacity: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                            ("window", window), ("head_dim", head_dim)):
            check_int(name, value)
        self.sinks = check_int("sinks", sinks, minimum=0)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.sink_rope = check_sink_rope(sink_rope, self.sinks, head_dim, dtype,
                                         torch.empty(0, device=device).device)
        self.batch_size, self.num_kv_heads = batch_size, num_kv_heads
        self.window, self.head_dim = window, head_dim
        # ring slots per row: the window, plus any spare slots that rejected drafts may overwrite
        self.capacity = window if capacity is None else check_int("capacity", capacity, window)
        n = self.sinks + self.capacity  # [sinks | ring]; slot n, outside the views, the spare
        self._spare = n
        store = (batch_size, num_kv_heads, n + 1, head_dim)
        self._k_store = torch.zeros(store, dtype=dtype, device=device)
        self._v_store = torch.zeros(store, dtype=dtype, device=device)
        self._pos_store = torch.full((batch_size, n + 1), -1, dtype=torch.int64,
                                     device=self._k_store.device)
        self.k = self._k_store[:, :, :n]  # (B, n_kv_heads, S + capacity, head_dim)
        self.v = self._v_store[:, :, :n]  # (B, n_kv_heads, S + capacity, head_dim)
        self.positions = self._pos_store[:, :n]  # (B, S + capacity), -1 = empty
        # newest position per row: kept beside the ring so a decode step never scans all W slots
        self._last_pos = torch.full((batch_size,), -1, dtype=torch.int64, device=self.k.device)
        self._rows = torch.arange(batch_size, device=self.k.device)  # row index of a decode write

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        """Bytes of k, v and positions storage (spare slot included): fixed at construction."""
        stores = (self._k_store, self._v_store, self._pos_store)
        return sum(t.numel() * t.element_size() for t in stores)

    @property
    def kv_seqlens(self) -> torch.Tensor:
        """``(B,)`` number of cached entries visible to each row's newest position."""
        return self._visible_now().sum(dim=-1)

    @property
    def start(self) -> torch.Tensor:
        """``(B,)`` slot of each row's oldest visible entry (0 for an empty row)."""
        big = torch.iinfo(torch.int64).max
        oldest = torch.where(self._visible_now(), self.positions, big).argmin(dim=-1)
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

    def reset(self) -> None:
        """Empty every row (storage stays where it is)."""
        self._k_store.zero_()
        self._v_store.zero_()
        self._pos_store.fill_(-1)
        self._last_pos.fill_(-1)

    # ------------------------------------------------------------------ validation
    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Raise on any malformed input, before anything is written."""
        check_kv(k, v, batch_size=self.batch_size, num_kv_heads=self.num_kv_heads,
                 head_dim=self.head_dim, dtype=self.dtype, device=self.device)
        check_positions(check_tensor("positions", positions, self.device), self._last_pos,
                        k.shape[2])

    def _check_q(self, q: torch.Tensor, T: int, q_positions: object = None) -> None:
        check_query(q, T, batch_size=self.batch_size, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim, dtype=self.dtype, device=self.device,
                    q_positions=q_positions)

    def check_positions(self, positions: torch.Tensor) -> None:
        """Raise if ``positions`` (B, T) could not be written next, writing nothing."""
        check_tensor("positions", positions, self.device)
        check_positions(positions, self._last_pos, positions.shape[-1] if positions.ndim else -1)

    def check_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, *, scale: float | None = None) -> None:
        """Raise exactly what :meth:`step` would reject, writing nothing."""
        check_scale(scale)
        self._check_kv(k, v, positions)
        self._check_q(q, k.shape[2])

    # ------------------------------------------------------------------ the ring
    def _slots(self, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Slot of a token: its :func:`home_slots` slot if kept, the spare if dropped."""
        return torch.where(keep, home_slots(positions, self.sinks, self.capacity), self._spare)

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
              check: bool = True) -> None:
        """Write ``T`` tokens per row into slots ``pos % capacity``; keep each row's last C.

        Positions below ``sinks`` go to their sink slots instead, kept for good. Tokens of a
        chunk that would be overwritten by a later token of the same chunk, and
        padding (-1), are not stored. ``check=False`` skips validation (and its host sync),
        for CUDA-graph capture of a trusted decode loop.
        """
        if check:
            self._check_kv(k, v, positions)
        positions = positions.to(torch.int64)
        B, H, T, D = k.shape
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
        slot = self._slots(positions, keep)  # (B, T)
        if T == 1:  # index_put: about half the cost of scatter_ for one token per row
            self._k_store[self._rows, :, slot[:, 0]] = k[:, :, 0]  # (B, n_kv_heads, head_dim)
            self._v_store[self._rows, :, slot[:, 0]] = v[:, :, 0]
            self._pos_store[self._rows, slot[:, 0]] = positions[:, 0]
        else:
            self._k_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), k)
            self._v_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), v)
            self._pos_store.scatter_(1, slot, positions)
        self._last_pos.copy_(newest)

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
             *, scale: float | None = None, check: bool = True,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend ``T`` new tokens per row to their windows and store them: ``(B, Hq, T, D)``.

        ``check=False`` skips the tensor checks (and their one host sync) for a trusted loop;
        ``scale`` is checked either way (plain Python, no sync). ``mask`` ``(B, T, K)``, trusted,
        is the visibility of :meth:`key_positions` ``(positions)`` when the caller has built it
        once for many layers (``ringviz.hf``'s forward plan); by default the step builds it.
        """
        if check:
            self.check_step(q, k, v, positions, scale=scale)
        else:
            check_scale(scale)
        positions = positions.to(torch.int64)
        if k.shape[2] == 1:  # decode: write first, then one attention over the raw ring
            self.write(k, v, positions, check=False)
            mask = self._decode_mask(positions) if mask is None else mask  # (B, 1, S + C)
            return self.attend_keys(q, positions, self.k, self.v, mask, scale)
        out = self.attend_chunk(q, k, v, positions, scale=scale, mask=mask)
        self.write(k, v, positions, check=False)
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
        mask = self._mask(positions, key_pos) if mask is None else mask  # (B, T, K)
        return self.attend_keys(q, positions, keys, values, mask, check_scale(scale))

    def keys_with_chunk(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys, values and positions a chunk attends over before it is written.

        ``[ring | chunk]``: the storage as it is, then the chunk's own tokens, padding zeroed
        (it is masked out, but ``0 * NaN`` is NaN). With sinks, the chunk's sink tokens take
        the sink columns and are masked in the chunk part, so none is scored twice. Shapes
        ``(B, Hkv, S + C + T, D)`` twice and ``(B, S + C + T)``; into an empty ring without
        sinks, just the chunk (``T`` keys: the ring's would all be masked). The positions are
        :func:`step_key_positions`'.
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

    # ------------------------------------------------------------------ taking tokens back
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
            self._check_truncate(lengths)
        lengths = lengths.to(torch.int64)
        self._pos_store.masked_fill_(self._pos_store >= lengths[:, None], -1)
        torch.minimum(self._last_pos, lengths - 1, out=self._last_pos)

    def missing_positions(self, lengths: torch.Tensor) -> list[list[int]]:
        """Per row b: positions a query at ``lengths[b]`` needs, ``lengths[b] - W + 1 ..
        lengths[b] - 1``, that the cache does not hold (a host sync; for checks and reports)."""
        return missing_positions(self.positions, lengths, self.window)

    def _check_truncate(self, lengths: torch.Tensor) -> None:
        check_truncate(lengths, self.positions, self._last_pos, window=self.window,
                       capacity=self.capacity)

    def __repr__(self) -> str:
        return (f"RingKVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"window={self.window}, capacity={self.capacity}, head_dim={self.head_dim}, "
                f"sinks={self.sinks}, "
                f"sink_rope={getattr(self.sink_rope, '__name__', self.sink_rope)}, "
                f"dtype={self.dtype}, device={self.device})")
