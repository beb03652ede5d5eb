"""Argument checks shared across ringviz: a bad value raises an error that names the argument."""

from __future__ import annotations

import math

import numpy as np
import torch


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``; raise otherwise.

    >>> check_int("window", 4)
    4
    >>> check_int("window", 0)
    Traceback (most recent call last):
    ValueError: window must be >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_scale(scale: object) -> float | None:
    """Return ``scale`` as a float if it is None or a positive finite real number; raise otherwise.

    Checked before anything is written, so a bad scale never leaves a half-done step behind.

    >>> check_scale(0.125)
    0.125
    >>> check_scale(float("nan"))
    Traceback (most recent call last):
    ValueError: scale must be a positive finite number, got nan
    """
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be None or a real number, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def check_tensor(name: str, value: object, device: torch.device) -> torch.Tensor:
    """Return ``value`` if it is a tensor on ``device``; raise otherwise, naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}, the cache on {device}")
    return value


def check_kv(k: object, v: object, *, batch_size: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, device: torch.device) -> None:
    """New keys and values for a cache: one shape ``(B, n_kv_heads, T>=1, head_dim)``, its dtype.

    >>> x = torch.zeros(1, 2, 3, 4)
    >>> check_kv(x, x[:, :1], batch_size=1, num_kv_heads=2, head_dim=4, dtype=x.dtype,
    ...          device=x.device)
    Traceback (most recent call last):
    ValueError: v must be (B=1, n_kv_heads=2, T>=1, head_dim=4), got (1, 1, 3, 4)
    """
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, device)
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, the cache holds {dtype}")
        if t.ndim != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (batch_size, num_kv_heads,
                                                                     head_dim) or t.shape[2] == 0:
            raise ValueError(f"{name} must be (B={batch_size}, n_kv_heads={num_kv_heads}, T>=1, "
                             f"head_dim={head_dim}), got {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
