"""The honest baselines the ring is measured against, and the ground truth it must equal.

* :class:`GrowingKVCache` — append every token (``torch.cat``, as HF's ``DynamicLayer`` does):
  exact full attention, memory O(n).
* :class:`ShiftWindowKVCache` — keep the last ``window`` tokens in order by copying: ``cat`` then
  slice (HF's ``DynamicSlidingWindowLayer``) or ``roll`` then assign (HF's
  ``StaticSlidingWindowLayer``). Fixed memory, but O(window) bytes moved per token.
* :func:`windowed_attention_reference` — recompute attention over the whole sequence with a band
  mask, written out as plain matmul + softmax (no SDPA), so it shares no code path with the ring.
* :class:`StreamingLLMCache` — StreamingLLM's own scheme for attention sinks: keys cached *before*
  RoPE, cut to ``[sinks | last window]``, and every key and the query re-rotated at their positions
  inside the cache (0 .. n-1) on every step: O(S + W) rotation work per token.
"""

from __future__ import annotations

import math

import torch

from ringviz.checks import check_int, check_kv, check_scale
from ringviz.masks import band_mask
from ringviz.rope import Rope, apply_rope


class _KVBuffer:
    """What the baselines share: their ``update(k, v)`` input checks."""

    batch_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        check_kv(k, v, batch_size=self.batch_size, num_kv_heads=self.num_kv_heads,
                 head_dim=self.head_dim, dtype=self.dtype, device=self.device)


class GrowingKVCache(_KVBuffer):
    """Full-attention cache that appends every token: memory grows linearly with the sequence."""

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            check_int(name, value)
        self.batch_size, self.num_kv_heads, self.head_dim = batch_size, num_kv_heads, head_dim
        empty = torch.empty(batch_size, num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.k, self.v = empty, empty.clone()  # (B, num_kv_heads, n, head_dim)
        self.dtype, self.device = self.k.dtype, self.k.device

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``T`` tokens; return all cached keys and values."""
        self._check(k, v)
        self.k = torch.cat([self.k, k], dim=2)  # reallocates and copies all n tokens
        self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def __len__(self) -> int:
        return self.k.shape[2]


class ShiftWindowKVCache(_KVBuffer):
    """The naive window: the last ``window`` tokens kept in order by shifting every step."""

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int, *,
                 mode: str = "cat", dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                            ("window", window), ("head_dim", head_dim)):
            check_int(name, value)
        if mode not in ("cat", "roll"):
            raise ValueError(f"mode must be 'cat' or 'roll', got {mode!r}")
        self.batch_size, self.num_kv_heads, self.head_dim = batch_size, num_kv_heads, head_dim
        self.window, self.mode, self.length = window, mode, 0
        n = 0 if mode == "cat" else window  # roll keeps a full-size buffer from the start
        self.k = torch.zeros(batch_size, num_kv_heads, n, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)  # (B, num_kv_heads, n, head_dim)
        self.dtype, self.device = self.k.dtype, self.k.device

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shift ``T`` tokens in (oldest out); return the window's keys and
        values, oldest first."""
        self._check(k, v)
        T, W = k.shape[2], self.window
        if self.mode == "cat":
            self.k = torch.cat([self.k, k], dim=2)[:, :, -W:]  # copies up to W tokens
            self.v = torch.cat([self.v, v], dim=2)[:, :, -W:]
        else:
            n = min(T, W)
            for store, new in ((self.k, k), (self.v, v)):
                rolled = store.roll(-n, dims=2)  # copies all W slots
                rolled[:, :, W - n:] = new[:, :, T - n:]
                store.copy_(rolled)
        self.length = min(self.length + T, W)
        return self.k[:, :, -self.length:], self.v[:, :, -self.length:]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def windowed_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 positions: torch.Tensor, window: int, *,
                                 scale: float | None = None) -> torch.Tensor:
    """Sliding-window attention recomputed over the whole sequence: ``(B, Hq, T, D)``.

    ``q`` (B, Hq, T, D), ``k``/``v`` (B, Hkv, T, D), ``positions`` (B, T) absolute, -1 = padding.
    Query heads are grouped onto KV heads as HF's ``repeat_kv`` does. Queries that see nothing
    (padding) return zeros.
    """
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q, k, v must be 4-D with k and v equal: {q.shape}, {k.shape}, {v.shape}")
    B, Hq, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if Hq == 0 or Hq % k.shape[1]:
        raise ValueError(f"Hq={Hq} is not a positive multiple of num_kv_heads={k.shape[1]}")
    scale = check_scale(scale)
    if positions.shape != (B, T):
        raise ValueError(f"positions must be (B, T) = {(B, T)}, got {tuple(positions.shape)}")
    group = Hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, Hq, T, D)
    v = v.repeat_interleave(group, dim=1)
    mask = band_mask(positions, positions, window)[:, None]  # (B, 1, T, T)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(D))
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (weights.nan_to_num(0.0) @ v).masked_fill(~mask.any(-1, keepdim=True), 0.0)


class StreamingLLMCache:
    """StreamingLLM (Xiao et al., 2023): unrotated ``[sinks | recent]``, re-rotated every step.

    ``rope(x, positions)`` rotates ``x`` (B, H, n, D) at ``positions`` (B, n), which are the same
    ``0 .. n-1`` in every row; pass a model's own rotary to match it. ``window=None`` keeps every
    token (a full-attention layer: cache positions are absolute).

    >>> import torch
    >>> cache = StreamingLLMCache(sinks=1, window=2)
    >>> for t in range(5):
    ...     keys, values = cache.update(torch.zeros(1, 1, 1, 4), torch.full((1, 1, 1, 4), float(t)))
    >>> values[0, 0, :, 0].tolist()  # sink 0, then the last window of 2
    [0.0, 3.0, 4.0]
    """

    def __init__(self, sinks: int, window: int | None, rope: Rope = apply_rope) -> None:
        self.sinks = check_int("sinks", sinks, minimum=0)
        self.window = None if window is None else check_int("window", window)
        self.rope = rope
        self.k: torch.Tensor | None = None  # (B, Hkv, n, D), unrotated
        self.v: torch.Tensor | None = None

    def _keep(self, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """``old ++ new`` cut to ``[first sinks | last window]``, in one copy on a decode step."""
        if old is None:
            old = new[:, :, :0]
        S, W, n = self.sinks, self.window, old.shape[2] + new.shape[2]
        if W is None or n <= S + W:
            return torch.cat([old, new], dim=2)
        if old.shape[2] >= S and new.shape[2] <= W:
            return torch.cat([old[:, :, :S], old[:, :, n - W:], new], dim=2)
        both = torch.cat([old, new], dim=2)
        return torch.cat([both[:, :, :S], both[:, :, n - W:]], dim=2)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append unrotated ``k``/``v`` (B, Hkv, T, D), evict, return keys rotated at 0 .. n-1."""
        if k.ndim != 4 or v.shape != k.shape:
            raise ValueError(f"k and v must be equal 4-D shapes, got {k.shape} and {v.shape}")
        if self.k is not None and (k.shape[:2] + k.shape[3:]) != (
                self.k.shape[:2] + self.k.shape[3:]):
            raise ValueError(f"k {tuple(k.shape)} does not match the cache's {tuple(self.k.shape)}")
        self.k, self.v = self._keep(self.k, k), self._keep(self.v, v)
        return self.rope(self.k, self.positions()), self.v

    def positions(self) -> torch.Tensor:
        """The cache positions ``0 .. n-1`` (B, n) every key is rotated at."""
        if self.k is None:
            raise ValueError("the cache is empty: update it first")
        B, n = self.k.shape[0], self.k.shape[2]
        return torch.arange(n, device=self.k.device).expand(B, n)

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """Rotate unrotated ``q`` (B, Hq, 1, D) at the cache's last position (the query's own)."""
        last = self.positions()[:, -1:]
        return self.rope(q, last)
