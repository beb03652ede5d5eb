"""Rotary position embedding (RoPE), Hugging Face's ``rotate_half`` layout.

A key is rotated once, at its *absolute* position, before it is written into the ring. Because
``<R(p) q, R(s) k>`` depends only on ``p - s``, a query rotated at its own position then scores
every cached key correctly wherever its slot is. Rotating by slot index instead breaks this after
the first wrap-around (chapter 4 measures the damage on a real model).

Angles are computed in float64 so that float64 inputs match the textbook formula to ~1e-15; for
float32/bfloat16 inputs the rotation is then rounded once, to the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Rope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # f(x (B, H, T, D), positions (B, T))


def rope_angles(positions: torch.Tensor, head_dim: int,
                theta: float = 10000.0) -> torch.Tensor:
    """The angles ``pos * theta^(-2i/head_dim)``, float64 ``(..., T, head_dim // 2)``."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if theta <= 0:
        raise ValueError(f"theta must be positive, got {theta}")
    even = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = theta ** -(even / head_dim)  # (head_dim // 2,)
    return positions.to(torch.float64)[..., None] * inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim, as HF's Llama/Gemma weights expect."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The RoPE rotation ``x cos + rotate_half(x) sin``, HF's layout; ``-sin`` undoes it."""
    return x * cos + rotate_half(x) * sin


def apply_rope(x: torch.Tensor, positions: torch.Tensor,
               theta: float = 10000.0) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D) by the absolute ``positions`` (B, T); returns a new tensor.

    Padding positions (-1) are rotated by a negative angle like any other number; their
    outputs are never attended to, so no special case is needed.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(positions, torch.Tensor):
        raise TypeError("x and positions must be torch tensors")
    if x.ndim != 4:
        raise ValueError(f"x must be (B, H, T, D), got shape {tuple(x.shape)}")
    B, _, T, D = x.shape
    if positions.shape != (B, T):
        raise ValueError(f"positions must be (B, T) = {(B, T)}, "
                         f"got {tuple(positions.shape)}")
    if positions.is_floating_point():
        raise TypeError(f"positions must be integers, got {positions.dtype}")
    angles = rope_angles(positions, D, theta)  # (B, T, D/2) float64
    emb = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, T, D)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = emb.cos().to(work), emb.sin().to(work)
    xw = x.to(work)
    return rotate(xw, cos, sin).to(x.dtype)


def float32_angles(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Angles as Hugging Face's rotary modules compute them (transformers 5.24), in float32.

    ``inv_freq = 1 / theta ** (arange(0, D, 2) / D)`` and ``pos * inv_freq`` are both float32,
    whatever the model's dtype, so an angle of ``a`` radians carries an error up to ~``a * 6e-8``.
    """
    rope_angles(positions[:1], head_dim, theta)  # same argument checks
    even = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (theta ** (even.float() / head_dim))  # (head_dim // 2,) float32
    return positions[..., None].float() * inv_freq


def rotation_error(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Per position, how far a unit pair rotated with float32 angles lands from the exact one.

    ``|e^{i a32} - e^{i a64}| = 2 |sin((a32 - a64) / 2)|``, the worst pair of the head (float64
    ``(...,)``). A key and a query at large positions each carry such an error, so their score
    is computed for a slightly wrong distance.

    >>> err = rotation_error(torch.tensor([10, 10**7]), head_dim=64, theta=1e4)
    >>> bool(err[0] < 1e-5 < 1e-2 < err[1])
    True
    """
    exact = rope_angles(positions, head_dim, theta)  # float64
    delta = float32_angles(positions, head_dim, theta).double() - exact
    return (2 * (delta / 2).sin().abs()).amax(dim=-1)
