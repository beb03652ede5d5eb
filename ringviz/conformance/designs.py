"""The design space: how each ring keeps a chunk's write from clobbering its own queries' keys.

A chunk of ``C`` tokens written into a ring of ``W`` slots before it attends overwrites keys
that its first queries still need (their windows reach ``W - 1`` positions back, into what the
chunk just overwrote). Every ring in the field answers this one way or another:

* **attend first** over ``[ring | chunk]``, then write (ringviz: ``W + 1`` slots, the cost is
  the concatenation of the chunk onto the ring for that one step);
* **oversize** the ring so that a chunk's write cannot reach the keys it needs
  (``W + C - 1`` slots are enough; ExecuTorch's 2W ring is enough for ``C <= W + 1``);
* **concatenate** and trim back to the window after the step (transformers, mlx-lm);
* **refuse** chunks over a limit (and rewinds once anything is evicted).

:data:`DESIGNS` lists the rings of 2025-2026 with the source each claim is read from.
Where the package runs here, :func:`measured_slots` counts the key rows a layer holds at its
peak, on the real package; the others are cited, not run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_ET = "https://github.com/pytorch/executorch"


@dataclass(frozen=True)
class Design:
    """One ring: how it spares a chunk's keys, its slots, what it refuses, where that is read."""

    ring: str
    how: str  # how a chunk's write spares the keys its own queries need
    slots: str  # slots per layer, in W (window) and C (the largest chunk)
    refuses: str
    source: str  # "[text](url)": the file or pull request the row is read from
    peer: str | None = None  # its name in ringviz.conformance.peers, if the kit runs it here
    count: Callable[[int, int], int] | None = None  # (W, C) -> peak key rows, measured

    def kit(self) -> str:
        """Which the kit has run: the real package here, or a citation only."""
        return "real package, here" if self.peer else "cited, not run"


def _ringviz_slots(window: int, chunk: int) -> int:
    """Key rows per row of ringviz's ring: from its storage bytes (k, v, positions)."""
    from ringviz import RingKVCache

    ring = RingKVCache(1, 1, window, 8, dtype=torch.float32)
    per_slot = 2 * 8 * 4 + 8  # a key and a value of 8 float32, one int64 position
    return ring.nbytes // per_slot


def _executorch_slots(window: int, chunk: int) -> int:
    """Key rows of ExecuTorch's ``RingKVCache(max_context_length=window)``."""
    from executorch.examples.models.llama.attention import RingKVCache

    return RingKVCache(1, window, 1, 8, enable_dynamic_shape=True).k_cache.shape[2]


def _mlx_slots(window: int, chunk: int) -> int:
    """Peak key rows of mlx-lm's ``RotatingKVCache(window)``: the window filled one token at a
    time, then a chunk of ``chunk`` (its concatenate-and-trim path)."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    cache, peak = RotatingKVCache(max_size=window), 0
    for n in [1] * window + [chunk]:
        x = mx.zeros((1, 1, n, 8))
        keys, _ = cache.update_and_fetch(x, x)
        peak = max(peak, cache.keys.shape[2], keys.shape[2])
    return peak


def _hf_slots(window: int, chunk: int) -> int:
    """Peak key rows of transformers' ``DynamicSlidingWindowLayer``: what ``update`` returns
    for a chunk of ``chunk`` after the window filled."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    layer, peak = DynamicSlidingWindowLayer(sliding_window=window), 0
    for n in [1] * window + [chunk]:
        x = torch.zeros(1, 1, n, 8)
        keys, _ = layer.update(x, x)
        peak = max(peak, keys.shape[2])
    return peak


DESIGNS: list[Design] = [
    Design("ringviz RingKVCache", "attends over [ring | chunk] first, then writes",
           "W + 1", "nothing",
           "ringviz/cache.py, RingKVCache.step", peer="ringviz_ring", count=_ringviz_slots),
    Design("ExecuTorch RingKVCache 1.5.1",
           "oversized: writes first into 2W slots, masks by stored positions",
           "2W, enough for C <= W + 1", "chunks over 2W",
           "executorch/examples/models/llama/attention.py; the runner's cap at W: "
           f"[PR #20346]({_ET}/pull/20346)", peer="executorch_ring", count=_executorch_slots),
    Design("ExecuTorch RingPolicy, MLX ring",
           "oversized for the largest write", "W + C - 1",
           "a step over C; rewinds past the window",
           f"[PR #21447]({_ET}/pull/21447), [#20341]({_ET}/pull/20341), "
           f"[#21532]({_ET}/pull/21532)"),
    Design("mlx-lm RotatingKVCache",
           "concatenates in temporal order, trims to W - 1 + C",
           "W; W - 1 + C after a chunk", "nothing",
           "mlx_lm/models/cache.py, RotatingKVCache._update_concat",
           peer="mlx_rotating_window", count=_mlx_slots),
    Design("transformers dynamic sliding layer",
           "cat, then keep the last W - 1", "W - 1; W - 1 + C attended", "nothing",
           "transformers/cache_utils.py, DynamicSlidingWindowLayer.update",
           peer="hf_dynamic_sliding", count=_hf_slots),
    Design("tt-metal bounded sliding cache", "oversized: twice the largest chunk",
           "2C", "chunks that do not divide 2C",
           "[PR #53773](https://github.com/tenstorrent/tt-metal/pull/53773), "
           "[#54935](https://github.com/tenstorrent/tt-metal/pull/54935)"),
    Design("onnxruntime-genai windowed cache", "a window-sized cache, shifted in place",
           "W + a set slack", "rewinds once anything is evicted",
           "[PR #2334](https://github.com/microsoft/onnxruntime-genai/pull/2334)"),
    Design("ROCm hip-ep ring append", "writes position p at p % capacity",
           "the window", "a present that contradicts the buffer",
           "[PR #808](https://github.com/ROCm/hip-ep/pull/808)"),
    Design("colibri (inkling.c)", "a ring of W rows at t % W", "W", "-", "[PR #830](https://github.com/JustVugg/colibri/pull/830)"),
    Design("SKaiNET", "hands attention the wrapped window as two views", "the window", "-",
           "[PR #1090](https://github.com/SKaiNET-developers/SKaiNET/pull/1090)"),
]


def measured_slots(design: Design, window: int, chunk: int) -> int | None:
    """Peak key rows per layer of ``design`` at ``window`` and a chunk of ``chunk``, counted
    on the installed package; None where the package is not run here or not installed."""
    if design.count is None:
        return None
    try:
        return design.count(window, chunk)
    except ImportError:
        return None
