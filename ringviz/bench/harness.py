"""Timing harness: warm-up, interleaved repetitions, median and spread, machine facts.

Every implementation in a comparison is timed in the same repetition blocks, round-robin and in
a rotated order (block r starts with impl r mod n), so a burst of machine noise lands on all of
them rather than on whichever ran last. One sample times ``inner`` back-to-back calls (chosen in
warm-up so a sample lasts about ``min_sample_s``); the row reports the median per-call time over
the samples and the 10th/90th percentiles as spread, and keeps every sample (block by block,
so two cases' samples of the same block can be paired). On CUDA the clock is a pair of CUDA events
around the block, read after a synchronize; on the CPU it is ``time.perf_counter_ns``. The
garbage collector is off inside a timed block, as in ``timeit``.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version

import numpy as np
import torch


@dataclass(frozen=True)
class Case:
    """One implementation at one window: ``step()`` performs one measured call (one decode)."""

    impl: str
    window: int
    step: Callable[[], object]

    @property
    def key(self) -> tuple[str, int]:
        return self.impl, self.window


@dataclass(frozen=True)
class Timing:
    """Per-call time statistics of one case, in microseconds."""

    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    reps: int  # samples (repetition blocks)
    inner: int  # calls per sample
    samples_us: tuple[float, ...] = ()  # per-call time of each sample, block by block

    def as_row(self) -> dict:
        return {**asdict(self), "samples_us": list(self.samples_us)}


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(call: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """``call()``'s result and wall seconds, the device synchronised on both sides."""
    synchronize(device)
    t0 = time.perf_counter()
    out = call()
    synchronize(device)
    return out, time.perf_counter() - t0


def time_block(step: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds taken by ``calls`` back-to-back calls of ``step`` (GC off, device synchronised)."""
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        synchronize(device)
        if device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                step()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / 1e3
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            step()
        return (time.perf_counter_ns() - t0) / 1e9
    finally:
        if gc_was_on:
            gc.enable()


def _calls_per_sample(step: Callable[[], object], warmup: int, min_sample_s: float,
                      device: torch.device, max_inner: int = 10_000) -> int:
    """Run the warm-up calls, then find how many back-to-back calls last ``min_sample_s``.

    Like ``timeit``'s autorange: a block is timed and scaled up until it is long enough, so the
    first, cache-cold call of a sample weighs little in a fast step's per-call time.
    """
    for _ in range(warmup):
        step()
    calls = 1
    while calls < max_inner:
        elapsed = time_block(step, calls, device)
        if elapsed >= min_sample_s:
            break
        grow = math.ceil(calls * 1.2 * min_sample_s / max(elapsed, 1e-9))
        calls = min(max_inner, max(2 * calls, grow))
    return calls


def summarize(per_call_s: Sequence[float], inner: int) -> Timing:
    """Median, p10, p90 and min of per-call times (seconds in, microseconds out)."""
    us = np.asarray(per_call_s, dtype=np.float64) * 1e6
    p10, median, p90 = np.percentile(us, [10, 50, 90])
    return Timing(median_us=float(median), p10_us=float(p10), p90_us=float(p90),
                  min_us=float(us.min()), reps=len(us), inner=inner,
                  samples_us=tuple(float(x) for x in us))


def spread(us: np.ndarray) -> dict:
    """Row fields of single-call times in microseconds: median, p10, p90 and their count."""
    return {"median_us": float(np.median(us)), "p10_us": float(np.percentile(us, 10)),
            "p90_us": float(np.percentile(us, 90)), "reps": len(us)}


def measure_interleaved(cases: Sequence[Case], *, reps: int, warmup: int,
                        min_sample_s: float, device: torch.device
                        ) -> dict[tuple[str, int], Timing]:
    """Time every case in the same rotated round-robin blocks:
    ``{(impl, window): Timing}``."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    keys = [c.key for c in cases]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate (impl, window) cases in {keys}")
    inner = {c.key: _calls_per_sample(c.step, warmup, min_sample_s, device) for c in cases}
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    n = len(cases)
    for r in range(reps):
        for i in range(n):
            case = cases[(r + i) % n]
            calls = inner[case.key]
            samples[case.key].append(time_block(case.step, calls, device) / calls)
    return {key: summarize(s, inner[key]) for key, s in samples.items()}


def in_fresh_process(function: str, params: dict, what: str,
                     timeout_s: float | None = None) -> object:
    """``function(**params)`` (``"module:name"``) in a fresh interpreter, its result read back as
    JSON: nothing that ran earlier in this process shows up in what it measures."""
    module, name = function.split(":")
    main = (f"import json, sys; from {module} import {name}; "
            f"print(json.dumps({name}(**json.loads(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", main, json.dumps(params)], capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else platform's best guess."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    """The commit of the ringviz checkout being measured (``+dirty`` if edited), if any."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ringviz package
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=here,
                               text=True, capture_output=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def machine_info(device: torch.device) -> dict:
    """Facts a reader needs to weigh the numbers: date, CPU, cores, threads, versions, GPU."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "ringviz_commit": _git_commit(),
        # how busy the machine was: run queue over the last 1, 5, 15 minutes (at the run's end)
        "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    for name in ("transformers", "mlx", "mlx-lm"):  # from package metadata, nothing imported
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    return info
