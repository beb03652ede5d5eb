"""``conform`` rows: wall time of ``ringviz.conformance.check(examples=100)`` on W = 6 caches.

The target: under 30 s on one CPU thread, so a reader runs a check in a notebook
without waiting. Each cache's whole check is one sample (hypothesis draws, runs and, for a
failing cache, shrinks the schedules); the caches are interleaved round-robin so machine noise
hits them alike. A correct cache runs all ``examples`` schedules, the slow case; a failing one
stops at its first failure and shrinks it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ringviz.bench.harness import summarize

# ringviz.conformance (and so hypothesis) is imported by conform_rows alone: `import
# ringviz.bench`, and the CLI that lists its parts, do not need it
CONFORM_CACHES = ("ringviz_ring", "ringviz_hf", "hf_static_sliding", "mlx_rotating_window")


def conform_rows(*, caches: tuple[str, ...], window: int, examples: int, reps: int,
                 log: Callable[[str], None]) -> list[dict]:
    """One row per cache: seconds per whole check (median, p10, p90 over ``reps``)."""
    from ringviz.conformance.peers import get, run
    from ringviz.conformance.probe import NUM_HEADS, NUM_KV_HEADS, head_dim_for
    from ringviz.conformance.schedule import default_limits

    times: dict[str, list[float]] = {name: [] for name in caches}
    reports = {}
    for _ in range(reps):
        for name in caches:
            t0 = time.perf_counter()
            reports[name] = run(name, window=window, examples=examples)
            times[name].append(time.perf_counter() - t0)
    rows = []
    for name in caches:
        peer, report = get(name), reports[name]
        tokens, _ = default_limits(window, report.sinks)
        timing = summarize(times[name], inner=1)
        rows.append({"bench": "conform", "impl": name, "window": window, "sinks": report.sinks,
                     "batch": report.batch_size, "ragged": report.ragged,
                     "kv_heads": NUM_KV_HEADS, "q_heads": NUM_HEADS,
                     "head_dim": head_dim_for(report.batch_size * tokens),
                     "dtype": str(peer.dtype).removeprefix("torch."), "device": "cpu",
                     "threads": torch.get_num_threads(), "examples": report.examples,
                     "ok": report.ok, "version": peer.version(), **timing.as_row()})
        log(f"conform {name}: {np.median(times[name]):.1f} s for {report.examples} schedules "
            f"({'pass' if report.ok else 'FAIL ' + ', '.join(report.properties())})")
    return rows


def conform_figures(rows: list[dict]) -> dict:
    """The slowest check's median seconds, and its share of the 30 s target."""
    seconds = [r["median_us"] / 1e6 for r in rows if r["bench"] == "conform"]
    if not seconds:
        return {}
    return {"conform_slowest_check_s": max(seconds),
            "conform_slowest_over_30s_target": max(seconds) / 30.0}
