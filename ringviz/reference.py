"""The honest baselines the ring is measured against, and the ground truth it must equal.

* :class:`GrowingKVCache` — append every token (``torch.cat``, as HF's ``DynamicLayer`` does):
  exact full attention, memory O(n).
* :class:`ShiftWindowKVCache` — keep the last ``window`` tokens in order by copying: ``cat`` then
  slice (HF's ``DynamicSlidingWindowLayer``) or ``roll`` then assign (HF's
  ``StaticSlidingWindowLayer``). Fixed memory, but O(window) bytes moved per token.
* :func:`windowed_attention_reference` — recompute attention over the whole sequence with a band
  mask, written out as plain matmul + softmax (no SDPA), so it shares no code path with the ring.
"""

from __future__ import annotations

import math

import torch

from ringviz.checks import check_int, check_kv, check_scale
from ringviz.masks import band_mask


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
        self.k, self.v = empty, empty.clone()  # (B, n_kv_heads, n, head_dim)
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
        self.v = torch.zeros_like(self.k)  # (B, n_kv_heads, n, head_dim)
        self.dtype, self.device = self.k.dtype, self.k.device

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shift ``T`` tokens in (oldest out); return the window's keys and values, oldest first."""
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
        raise ValueError(f"Hq={Hq} is not a positive multiple of n_kv_heads={k.shape[1]}")
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
