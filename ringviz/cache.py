"""The batched ring KV cache (torch): fixed storage, one slot write per token, exact attention.

Storage ``k``/``v`` of shape ``(B, n_kv_heads, window, head_dim)`` is allocated once and only
ever written in place, so its address never changes (CUDA-graph friendly) and its size never
grows. Beside it, ``positions`` ``(B, window)`` records the absolute position held by each slot
(-1 = empty); masks are computed from it, never from slot order. One spare slot per row sits
just past the window (outside ``k``/``v``/``positions``, which are views): tokens that must not
be stored (padding, or chunk tokens that a later token of the same chunk overwrites) are written
there, so a write is a plain scatter that never reads old values back and needs no host sync.

One call, :meth:`RingKVCache.step`, takes a chunk of ``T`` new tokens per row (``T = 1`` is
decode) and returns their attention output:

* ``T == 1``: write the token into slot ``pos % window``, then attend over the raw ring
  (``window`` keys, in slot order, masked by stored positions). No copy, no reordering.
* ``T > 1`` (prefill, chunks, also ``T > window``): attend over ``[ring | chunk]`` first,
  then write. A chunk longer than the window would otherwise overwrite keys its own early
  queries still need (the executorch #20346 failure).

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

Speculative decoding (chapter 13) adds two things, both unused by default: ``capacity`` slots
per row (default ``window``; slot = ``pos % capacity``, masks still use ``window``), and
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
import torch.nn.functional as F

from ringviz.checks import check_int, check_kv, check_scale, check_tensor
from ringviz.masks import band_mask


class RingKVCache:
    """A batch of rings, one per row, holding each row's last ``window`` keys and values."""

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int, *,
                 capacity: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                            ("window", window), ("head_dim", head_dim)):
            check_int(name, value)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.batch_size, self.num_kv_heads = batch_size, num_kv_heads
        self.window, self.head_dim = window, head_dim
        # slots per row: the window, plus any spare slots that rejected drafts may overwrite
        self.capacity = window if capacity is None else check_int("capacity", capacity, window)
        # Slot `capacity` is a spare, outside the views below: padding tokens and chunk tokens
        # that a later token of the same chunk overwrites are written there, so a write never
        # has to read old values back and is one scatter per tensor.
        store = (batch_size, num_kv_heads, self.capacity + 1, head_dim)
        self._k_store = torch.zeros(store, dtype=dtype, device=device)
        self._v_store = torch.zeros(store, dtype=dtype, device=device)
        self._pos_store = torch.full((batch_size, self.capacity + 1), -1, dtype=torch.int64,
                                     device=self._k_store.device)
        self.k = self._k_store[:, :, :self.capacity]  # (B, n_kv_heads, capacity, head_dim)
        self.v = self._v_store[:, :, :self.capacity]  # (B, n_kv_heads, capacity, head_dim)
        self.positions = self._pos_store[:, :self.capacity]  # (B, capacity), -1 = empty
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
        return band_mask(self._last_pos[:, None], self.positions, self.window)[:, 0]

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
        self._check_positions(check_tensor("positions", positions, self.device), k.shape[2])

    def _check_positions(self, positions: torch.Tensor, T: int) -> None:
        if positions.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"positions must be int64 or int32, got {positions.dtype}")
        if positions.shape != (self.batch_size, T):
            raise ValueError(
                f"positions must be (B, T) = {(self.batch_size, T)}, got {tuple(positions.shape)}")
        valid = positions >= 0
        before = self._last_pos[:, None]  # (B, 1) newest position stored so far
        if T > 1:  # ... or earlier in this chunk
            running = torch.cummax(torch.where(valid, positions, -1), dim=1).values
            before = torch.maximum(torch.cat([before, running[:, :-1]], dim=1), before)
        bad = (positions < -1) | (valid & (positions <= before))  # (B, T)
        if not bool(bad.any()):  # the only host sync of a valid call
            return
        if bool((positions < -1).any()):
            raise ValueError("positions must be >= 0, or -1 for padding; got other negatives")
        b, t = (int(i) for i in bad.nonzero()[0])
        pos, newest = int(positions[b, t]), int(self._last_pos[b])
        if pos <= newest:
            raise ValueError(f"row {b}: position {pos} is not after the row's cached "
                             f"positions (newest {newest})")
        raise ValueError(f"row {b}: positions must strictly increase, got {pos} after "
                         f"{int(before.expand_as(positions)[b, t])}")

    def _check_q(self, q: torch.Tensor, T: int) -> None:
        """``q`` must be (B, Hq, T, head_dim) on the cache's device and dtype, Hq % Hkv == 0."""
        check_tensor("q", q, self.device)
        if q.dtype != self.dtype:
            raise TypeError(f"q has dtype {q.dtype}, the cache holds {self.dtype}")
        if q.ndim != 4 or q.shape[0] != self.batch_size or q.shape[2] != T \
                or q.shape[3] != self.head_dim:
            raise ValueError(f"q must be (B={self.batch_size}, Hq, T={T}, "
                             f"head_dim={self.head_dim}), got {tuple(q.shape)}")
        if q.shape[1] == 0 or q.shape[1] % self.num_kv_heads:
            raise ValueError(f"Hq={q.shape[1]} query heads is not a positive multiple of "
                             f"n_kv_heads={self.num_kv_heads}")

    def check_positions(self, positions: torch.Tensor) -> None:
        """Raise if ``positions`` (B, T) could not be written next, writing nothing."""
        check_tensor("positions", positions, self.device)
        self._check_positions(positions, positions.shape[-1] if positions.ndim else -1)

    def check_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, *, scale: float | None = None) -> None:
        """Raise exactly what :meth:`step` would reject, writing nothing."""
        check_scale(scale)
        self._check_kv(k, v, positions)
        self._check_q(q, k.shape[2])

    # ------------------------------------------------------------------ the ring
    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
              check: bool = True) -> None:
        """Write ``T`` tokens per row into slots ``pos % capacity``; keep each row's last C.

        Tokens of a chunk that would be overwritten by a later token of the same chunk, and
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
            keep = (positions >= 0) & (positions > newest[:, None] - self.capacity)  # (B, T)
        # kept tokens of a row span < C positions, so their slots are distinct; the rest share
        # the spare slot C, whose contents are never read
        slot = torch.where(keep, positions % self.capacity, self.capacity)  # (B, T)
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
        if not isinstance(q_positions, torch.Tensor):
            raise TypeError(f"q_positions must be a torch.Tensor, got {type(q_positions).__name__}")
        self._check_q(q, q.shape[2] if q.ndim == 4 else -1)
        if q_positions.shape != (self.batch_size, q.shape[2]) or q_positions.is_floating_point():
            raise ValueError(f"q_positions must be integer (B, T) = {(self.batch_size, q.shape[2])}"
                             f", got {q_positions.dtype} {tuple(q_positions.shape)}")
        mask = band_mask(q_positions.to(torch.int64), self.positions, self.window)  # (B, T, W)
        return masked_attention(q, self.k, self.v, mask, scale=scale)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
             *, scale: float | None = None, check: bool = True) -> torch.Tensor:
        """Attend ``T`` new tokens per row to their windows and store them: ``(B, Hq, T, D)``.

        ``check=False`` skips the tensor checks (and their one host sync) for a trusted loop;
        ``scale`` is checked either way (plain Python, no sync).
        """
        if check:
            self.check_step(q, k, v, positions, scale=scale)
        else:
            check_scale(scale)
        positions = positions.to(torch.int64)
        if k.shape[2] == 1:  # decode: write first, then one attention over the raw ring
            self.write(k, v, positions, check=False)
            mask = band_mask(positions, self.positions, self.window)  # (B, 1, W)
            return masked_attention(q, self.k, self.v, mask, scale=scale)
        # padding keys are masked out, but 0 * NaN is NaN: zero them so garbage cannot leak
        pad = (positions < 0)[:, None, :, None]  # (B, 1, T, 1)
        keys = torch.cat([self.k, k.masked_fill(pad, 0.0)], dim=2)  # (B, n_kv_heads, W+T, D)
        values = torch.cat([self.v, v.masked_fill(pad, 0.0)], dim=2)
        mask = band_mask(positions, torch.cat([self.positions, positions], dim=1), self.window)
        out = masked_attention(q, keys, values, mask, scale=scale)
        self.write(k, v, positions, check=False)
        return out

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

    def _check_truncate(self, lengths: torch.Tensor) -> None:
        check_tensor("lengths", lengths, self.device)
        if lengths.dtype not in (torch.int64, torch.int32) or lengths.shape != (self.batch_size,):
            raise ValueError(f"lengths must be int64 or int32 of shape (B,) = ({self.batch_size},),"
                             f" got {lengths.dtype} {tuple(lengths.shape)}")
        lengths = lengths.to(torch.int64)
        seen = self._last_pos + 1  # (B,)
        kept = (self.positions >= 0) & (self.positions < lengths[:, None])  # (B, C)
        needed = band_mask(lengths[:, None], self.positions, self.window)[:, 0] & kept
        want = torch.minimum(lengths, torch.full_like(lengths, self.window - 1))
        bad = (lengths < 0) | (lengths > seen) | (needed.sum(-1) < want)  # (B,)
        if not bool(bad.any()):
            return
        b = int(bad.nonzero()[0, 0])
        n = int(lengths[b])
        if n < 0 or n > int(seen[b]):
            raise ValueError(f"row {b}: cannot truncate to {n} positions; it has seen "
                             f"{int(seen[b])}")
        held = set(self.positions[b].tolist())
        lost = [p for p in range(max(0, n - self.window + 1), n) if p not in held]
        raise ValueError(
            f"row {b}: truncating to {n} leaves out position(s) {lost}, which the query at {n} "
            f"needs: later tokens overwrote them (capacity {self.capacity}, window "
            f"{self.window}: the ring can take back at most {self.capacity - self.window + 1} "
            f"token(s))")

    def __repr__(self) -> str:
        return (f"RingKVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"window={self.window}, capacity={self.capacity}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, device={self.device})")


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                     scale: float | None = None) -> torch.Tensor:
    """SDPA with a boolean ``(B, Tq, Tk)`` mask shared by all heads; GQA by head grouping.

    The ``G = Hq / Hkv`` query heads that share a KV head (HF ``repeat_kv`` order: head ``h``
    reads KV head ``h // G``) are packed into the query dimension, so each KV head is read once
    by a ``G * Tq``-row attention instead of being broadcast to G heads: for decode this is a
    free view, and measured ~1.7x faster than ``enable_gqa`` on Gemma 3's shapes (CPU).
    Rows with nothing visible come out as zeros, whatever the SDPA backend returns for them
    (torch 2.13's CPU kernel gives zeros; older releases' math kernel gave NaN).
    """
    B, Hq, T, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    packed = q.reshape(B, Hkv, G * T, D)  # (B, n_kv_heads, G * T, head_dim)
    if T == 1:  # decode: one mask row, broadcast over the G packed query heads
        mask = mask[:, None]  # (B, 1, 1, Tk)
    else:
        mask = mask[:, None, None].expand(B, 1, G, T, Tk).reshape(B, 1, G * T, Tk)
    out = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask, scale=scale)
    out = out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)  # broadcasts over heads
    return out.view(B, Hq, T, D)  # (B, Hq, T, head_dim)
