"""Sliding-window visibility, computed from absolute positions (never from slot order).

A query at absolute position ``p`` sees the keys at positions ``p-W+1 .. p``: itself and the
``W-1`` before it (the Mistral / Hugging Face convention). Position ``-1`` marks an empty slot or a
padding token and is never visible, nor does a ``-1`` query see anything. With ``sinks=S``
(attention sinks) positions ``0 .. S-1`` also stay visible to every later query. ``window=None``
is full causal attention (no window; sinks then add nothing).

All three functions work on NumPy arrays and torch tensors alike and broadcast over leading dims.

>>> import numpy as np
>>> decode_mask(5, np.array([4, 5, 2, 3]), window=3)
array([ True,  True, False,  True])
>>> band_mask(np.array([2, 3]), np.array([0, 1, 2, 3]), window=2).astype(int)
array([[0, 1, 1, 0],
       [0, 0, 1, 1]])
>>> band_mask(np.array([3]), np.array([0, 1, 2, 3]), window=2, sinks=1).astype(int)
array([[1, 0, 1, 1]])
>>> band_mask(np.array([-1, 2]), np.array([0, 1, 2, 3]), window=None).astype(int)
array([[0, 0, 0, 0],
       [1, 1, 1, 0]])
>>> bool(visible(7, 5, window=3)), bool(visible(7, 4, window=3))
(True, False)
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from ringviz.checks import check_int

Array = TypeVar("Array", np.ndarray, torch.Tensor)


def visible(q_pos: Array, k_pos: Array, window: int | None, sinks: int = 0) -> Array:
    """Elementwise rule: key at ``k_pos`` is visible to a query at ``q_pos``.

    Both real (``>= 0``), the key not after the query, and inside the window:
    ``k_pos > q_pos - window``. With ``sinks=S`` the first ``S`` positions stay visible to
    every later query (attention sinks, StreamingLLM): ``k_pos < S`` or inside the window.
    ``window=None``: no window (full causal attention). Plain ints work too (a Python bool).
    """
    if window is not None:
        check_int("window", window)
    if sinks:
        sinks = check_int("sinks", sinks, minimum=0)
    causal = (k_pos >= 0) & (q_pos >= 0) & (k_pos <= q_pos)
    if window is None:
        return causal
    near = k_pos > q_pos - window
    if sinks:
        near = near | (k_pos < sinks)
    return causal & near


def decode_mask(current_pos: int | Array, cache_positions: Array, window: int) -> Array:
    """Which cache slots one decoding query at ``current_pos`` may attend to.

    ``cache_positions`` holds the absolute position stored in each slot (``-1`` = empty), in slot
    order; the result has its shape. Stale slots (older than the window), future positions and
    empty slots come out False. A ``current_pos`` of shape ``(B,)`` pairs with ``(B, W)`` positions.
    """
    if isinstance(cache_positions, torch.Tensor):
        q = torch.as_tensor(current_pos, device=cache_positions.device)
    else:
        q = np.asarray(current_pos)
    if q.ndim == 1 and cache_positions.ndim == 2:
        q = q[:, None]
    return visible(q, cache_positions, window)


def band_mask(q_positions: Array, k_positions: Array, window: int | None, sinks: int = 0
              ) -> Array:
    """Visibility of every key to every query: bool ``(..., Tq, Tk)``, True = attend.

    :func:`visible` between each query and each key; ``window=None`` is the causal mask.
    """
    return visible(q_positions[..., :, None], k_positions[..., None, :], window, sinks)
