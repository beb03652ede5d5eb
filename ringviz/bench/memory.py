"""Memory over a long decode: the ring stays flat, a growing cache climbs with every token.

Each implementation runs in its own fresh Python process (:func:`worker`), so nothing that ran
earlier in the caller shows up in its numbers. Inside the worker, after torch is imported and
the inputs exist, the baseline RSS is read and the kernel's peak-RSS mark is reset to it
(``/proc/self/clear_refs`` = 5; otherwise torch's import transient would hide any smaller peak).
At checkpoints (log-spaced, plus ``window`` and the last step) the worker records the cache's
own byte count, the current RSS (``VmRSS``) and the peak since the baseline (``VmHWM``), all
from ``/proc/self/status`` (Linux). On CUDA it also reports torch's allocator counters
(``memory_allocated`` / ``max_memory_allocated``), which are exact for device memory.

The growing cache is :class:`ringviz.reference.GrowingKVCache` (``torch.cat`` per token, as Hugging
Face's ``DynamicLayer``): every step copies the whole cache, so its run is O(n^2) in time and is
given fewer steps than the ring (``growing_steps``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np
import torch

from ringviz.bench.harness import in_fresh_process, spread, synchronize

MEMORY_IMPLS = ("ring", "growing")
RSS_METHOD = ("one subprocess per impl; rss = VmRSS, peak = VmHWM (reset to the baseline via "
              "/proc/self/clear_refs) from /proc/self/status")


def checkpoints(steps: int, window: int, per_decade: int = 5) -> list[int]:
    """Log-spaced step counts from 1 to ``steps``, always including ``window`` and ``steps``.

    >>> checkpoints(1000, 64, per_decade=1)
    [1, 10, 64, 100, 1000]
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n = int(np.ceil(np.log10(steps) * per_decade)) + 1
    marks = {int(round(x)) for x in np.logspace(0, np.log10(steps), max(n, 2))}
    marks |= {steps} | ({window} if window <= steps else set())
    return sorted(marks)


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (e.g. VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _reset_peak() -> None:
    """Set the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def _make_step(impl: str, p: dict, device: torch.device, dtype: torch.dtype,
               k: torch.Tensor, v: torch.Tensor) -> tuple[Callable[[], object], object]:
    """The decode-step callable for ``impl`` and the cache object it writes into."""
    from ringviz.cache import RingKVCache
    from ringviz.reference import GrowingKVCache

    B, H, D = p["batch"], p["kv_heads"], p["head_dim"]
    if impl == "ring":
        cache = RingKVCache(B, H, p["window"], D, dtype=dtype, device=device)
        pos = torch.full((B, 1), -1, dtype=torch.int64, device=device)  # (B, 1)

        def step() -> None:
            pos.add_(1)
            cache.write(k, v, pos)

        return step, cache
    if impl == "growing":
        cache = GrowingKVCache(B, H, D, dtype=dtype, device=device)
        return (lambda: cache.update(k, v)), cache
    raise ValueError(f"unknown memory impl {impl!r}; expected one of {MEMORY_IMPLS}")


def worker(**p) -> list[dict]:
    """Run ``p["steps"]`` decode writes of one impl in this process; one row per checkpoint.

    Only memory is read inside the loop; step-time statistics are computed after it, so their
    temporary arrays never show up in the RSS readings.
    """
    torch.set_num_threads(p["threads"])
    device, dtype = torch.device(p["device"]), getattr(torch, p["dtype"])
    gen = torch.Generator(device=device).manual_seed(123)
    shape = (p["batch"], p["kv_heads"], 1, p["head_dim"])
    k = torch.randn(shape, generator=gen, dtype=dtype, device=device)  # (B, num_kv_heads, 1, D)
    v = torch.randn(shape, generator=gen, dtype=dtype, device=device)
    durations_ns = np.full(p["steps"], -1, dtype=np.int64)  # written now: resident before
    marks = checkpoints(p["steps"], p["window"])
    _warm_up(p, device, dtype, k, v)
    _reset_peak()
    baseline = _status_bytes("VmRSS")
    with torch.inference_mode():
        step, cache = _make_step(p["impl"], p, device, dtype, k, v)
        rows = []
        for i in range(1, p["steps"] + 1):
            t0 = time.perf_counter_ns()
            step()
            synchronize(device)
            durations_ns[i - 1] = time.perf_counter_ns() - t0
            if i == marks[len(rows)]:
                rows.append(_memory_now(i, cache, baseline, device))
    prev = 0
    for row in rows:
        row.update(spread(durations_ns[prev:row["steps"]] / 1e3))  # since the last checkpoint
        prev = row["steps"]
    return rows


def _warm_up(p: dict, device: torch.device, dtype: torch.dtype, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Run a tiny throwaway cache of the same impl past one full window, then drop it.

    The first call of each kernel faults in code pages and allocator arenas; doing that before
    the baseline keeps it out of the cache's numbers. The throwaway ring is tiny (window <= 8)
    so that the measured cache does not simply reuse its freed memory.
    """
    tiny = {**p, "window": min(p["window"], 8)}
    with torch.inference_mode():
        step, cache = _make_step(p["impl"], tiny, device, dtype, k, v)
        n = min(p["steps"], tiny["window"] + 2)
        for _ in range(n):
            step()
        _memory_now(n, cache, 0, device)
    del step, cache
    gc.collect()


def _memory_now(steps: int, cache, baseline: int, device: torch.device) -> dict:
    """The cache's bytes and the process's memory at this step."""
    row = {"steps": steps, "cache_bytes": cache.nbytes, "rss_bytes": _status_bytes("VmRSS"),
           "peak_rss_bytes": _status_bytes("VmHWM"), "baseline_rss_bytes": baseline}
    if device.type == "cuda":
        row.update(device_allocated_bytes=torch.cuda.memory_allocated(device),
                   device_peak_bytes=torch.cuda.max_memory_allocated(device))
    return row


def run_memory(impl: str, *, steps: int, window: int, batch: int, kv_heads: int, head_dim: int,
               dtype: str, device: str, threads: int, timeout_s: float = 600) -> list[dict]:
    """Run :func:`worker` for ``impl`` in a fresh interpreter; its rows, tagged as memory rows."""
    if impl not in MEMORY_IMPLS:
        raise ValueError(f"unknown memory impl {impl!r}; expected one of {MEMORY_IMPLS}")
    params = {"impl": impl, "steps": steps, "window": window, "batch": batch,
              "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype, "device": device,
              "threads": threads}
    rows = in_fresh_process("ringviz.bench.memory:worker", params,
                            f"memory worker for {impl!r}", timeout_s)
    fixed = {"bench": "memory", "impl": impl, "window": window, "batch": batch,
             "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype, "device": device,
             "threads": threads, "rss_method": RSS_METHOD}
    return [{**fixed, **row} for row in rows]

