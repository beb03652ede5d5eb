"""What a run shows: the ratios the book quotes, and its three plots (drawn with ringviz.book).

Every ratio is computed from the rows of one run (never typed in), so a chapter and the CLI
quote the same numbers. A ratio whose rows are missing (a tiny test config) is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ringviz.bench.conform import conform_figures
from ringviz.bench.generate import compiled_figures, generate_figures, generate_memory_figures
from ringviz.bench.generate_long import generate_long_figures


def _median(rows: Sequence[dict], bench: str, impl: str, window: int) -> float | None:
    for r in rows:
        if r["bench"] == bench and r["impl"] == impl and r["window"] == window:
            return r.get("median_us")  # None for a row that was skipped
    return None


def _windows(rows: Sequence[dict], bench: str) -> list[int]:
    return sorted({r["window"] for r in rows if r["bench"] == bench})


def _ratio_figures(rows: Sequence[dict], bench: str, base: str, impls: tuple[str, ...],
                   flat: tuple[str, ...]) -> dict:
    """Each of ``impls`` over ``base`` per W, and each of ``flat`` at its largest W over its
    smallest (1.0: flat in W)."""
    out = {}
    windows = _windows(rows, bench)
    for w in windows:
        ring = _median(rows, bench, base, w)
        for impl in impls:
            other = _median(rows, bench, impl, w)
            if ring and other:
                out[f"{bench}_{impl}_over_{base}_W{w}"] = other / ring
    if len(windows) > 1:
        for impl in flat:
            lo = _median(rows, bench, impl, windows[0])
            hi = _median(rows, bench, impl, windows[-1])
            if lo and hi:
                out[f"{bench}_{impl}_W{windows[-1]}_over_W{windows[0]}"] = hi / lo
    return out


def _decode_figures(rows: Sequence[dict]) -> dict:
    """Per batch size B and window W: naive_cat over ring; ring (and the eager floor,
    ``slot_copies``) over attention alone, mlx-lm's step over MLX's attention alone and over the
    ring, each with its spread (:func:`_paired`)."""
    out = {}
    decode = [r for r in rows if r["bench"] == "decode_step"]
    for b in sorted({r["batch"] for r in decode}):
        at_b = [r for r in decode if r["batch"] == b]
        for w in _windows(at_b, "decode_step"):
            ring = _median(at_b, "decode_step", "ring", w)
            other = _median(at_b, "decode_step", "naive_cat", w)
            if ring and other:
                out[f"decode_naive_cat_over_ring_W{w}_B{b}"] = other / ring
            for num, den in (("ring", "attention_only"), ("ring_trusted", "attention_only"),
                             ("ring_trusted", "ring"), ("slot_copies", "attention_only"),
                             ("mlx_rotating", "mlx_attention_only"), ("mlx_rotating", "ring")):
                out.update(_paired(at_b, num, den, w, f"decode_{num}_over_{den}_W{w}_B{b}"))
    return out


def _paired(rows: Sequence[dict], num: str, den: str, window: int, key: str) -> dict:
    """``key``: median of ``num`` over median of ``den``. ``key_p10``/``key_p90``: the 10th and
    90th percentiles of the ratios of their samples in the same repetition block (timed within
    a block, a burst of load hits both); for rows without samples, the ratio of their p10s and
    of their p90s."""
    a = next((r for r in rows if r["impl"] == num and r["window"] == window), None)
    b = next((r for r in rows if r["impl"] == den and r["window"] == window), None)
    if not a or not b or "median_us" not in a or "median_us" not in b:
        return {}
    out = {key: a["median_us"] / b["median_us"]}
    if a.get("samples_us") and len(a["samples_us"]) == len(b.get("samples_us") or ()):
        ratios = np.asarray(a["samples_us"]) / np.asarray(b["samples_us"])
        out[f"{key}_p10"], out[f"{key}_p90"] = (float(x) for x in np.percentile(ratios, [10, 90]))
    else:
        out[f"{key}_p10"] = a["p10_us"] / b["p10_us"]
        out[f"{key}_p90"] = a["p90_us"] / b["p90_us"]
    return out


def _memory_figures(rows: Sequence[dict]) -> dict:
    ring = [r for r in rows if r["bench"] == "memory" and r["impl"] == "ring"]
    growing = [r for r in rows if r["bench"] == "memory" and r["impl"] == "growing"]
    out = {}
    at_window = [r for r in ring if r["steps"] == r["window"]]
    if ring and at_window:
        first, last = at_window[0], ring[-1]
        out.update(memory_ring_steps=last["steps"],
                   memory_ring_cache_bytes_at_W=first["cache_bytes"],
                   memory_ring_cache_bytes_at_end=last["cache_bytes"],
                   memory_ring_rss_growth_after_W_bytes=last["rss_bytes"] - first["rss_bytes"],
                   memory_ring_peak_rss_growth_after_W_bytes=(
                       last["peak_rss_bytes"] - first["peak_rss_bytes"]))
    if growing:
        out.update(memory_growing_steps=growing[-1]["steps"],
                   memory_growing_cache_bytes_at_end=growing[-1]["cache_bytes"],
                   memory_growing_rss_growth_bytes=(
                       growing[-1]["rss_bytes"] - growing[-1]["baseline_rss_bytes"]))
    return out


def _model_figures(rows: Sequence[dict]) -> dict:
    by_impl = {r["impl"]: r for r in rows if r["bench"] == "model"}
    if {"ring", "hf_default"} <= by_impl.keys():
        return {"model_ring_over_hf_tokens_per_s": (by_impl["ring"]["tokens_per_s"]
                                                    / by_impl["hf_default"]["tokens_per_s"]),
                "model_tokens_match": by_impl["ring"]["tokens_match"]}
    return {}


def figures(rows: Sequence[dict]) -> dict:
    """The headline ratios of one run, named after what they divide."""
    sinks = ("ring_sinks_absolute", "streaming_llm", "sink_concat")
    flat_sinks = ("ring_sinks", "streaming_llm", "sink_concat")
    return {**_ratio_figures(rows, "update", "ring",
                             ("naive_cat", "naive_roll", "hf_dynamic", "hf_static"), ("ring",)),
            **_decode_figures(rows), **_memory_figures(rows), **_model_figures(rows),
            **_ratio_figures(rows, "sinks_update", "ring_sinks", sinks, flat_sinks),
            **_ratio_figures(rows, "sinks_decode", "ring_sinks", sinks, flat_sinks),
            **generate_figures(rows), **compiled_figures(rows), **generate_memory_figures(rows),
            **generate_long_figures(rows), **conform_figures(rows)}


def _plot_bench_latency(rows: Sequence[dict], bench: str, ylabel: str, title: str, ax=None):
    import ringviz.book as viz

    ms = [{**r, "ms_per_token": r["median_us"] / 1e3} for r in rows
          if r["bench"] == bench and "median_us" in r]
    ax = viz.plot_latency(ms, group="impl", ax=ax)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return ax


def plot_update(rows: Sequence[dict], ax=None):
    """Latency of one cache write vs W, log-log, one line per impl."""
    return _plot_bench_latency(rows, "update", "ms per cache write (median)",
                               "Storing one token in a full window", ax)


def plot_decode(rows: Sequence[dict], ax=None):
    """Latency of write + one query's attention vs W, one line per impl (and batch size)."""
    decode = [r for r in rows if r["bench"] == "decode_step"]
    if len({r["batch"] for r in decode}) > 1:
        rows = [{**r, "impl": f"{r['impl']}, B={r['batch']}"} for r in decode]
    return _plot_bench_latency(rows, "decode_step", "ms per decode step (median)",
                               "A whole decode step: store one token, attend over W keys", ax)


def plot_sinks_update(rows: Sequence[dict], ax=None):
    """Latency of everything but attention, with S sinks, vs W: one line per impl."""
    return _plot_bench_latency(rows, "sinks_update", "ms per step besides attention (median)",
                               "bench=sinks_update: write + make S + W keys ready", ax)


def plot_sinks_decode(rows: Sequence[dict], ax=None):
    """Latency of a whole decode step with S sinks vs W: one line per impl."""
    return _plot_bench_latency(rows, "sinks_decode", "ms per decode step (median)",
                               "bench=sinks_decode: write + attention over S + W keys", ax)


def plot_memory(rows: Sequence[dict], ax=None):
    """Cache bytes (solid) and RSS above the worker's baseline (dashed) vs decode steps, MiB."""
    import ringviz.book as viz

    mem = [r for r in rows if r["bench"] == "memory"]
    lines = ([{"series": f"{r['impl']}: cache bytes", "steps": r["steps"],
               "mib": r["cache_bytes"] / 2**20} for r in mem]
             + [{"series": f"{r['impl']}: process RSS - baseline", "steps": r["steps"],
                 "mib": (r["rss_bytes"] - r["baseline_rss_bytes"]) / 2**20} for r in mem])
    ax = viz.plot_memory(lines, x="steps", y="mib", group="series", ax=ax)
    colors: dict[str, str] = {}
    for line in ax.get_lines():  # one color per impl: solid = cache bytes, dashed = RSS
        impl = line.get_label().split(":")[0]
        line.set_color(colors.setdefault(impl, line.get_color()))
        line.set_linestyle("--" if "RSS" in line.get_label() else "-")
    ax.legend()
    ax.set_xscale("log")
    ax.set_xlabel("decode steps")
    ax.set_ylabel("MiB")
    ax.set_title("Memory over a long decode")
    return ax


def save_plots(rows: Sequence[dict], plot_dir: Path, device: str) -> list[Path]:
    """Write the plots this run has rows for as PNGs into ``plot_dir``; their paths."""
    import matplotlib.pyplot as plt

    import ringviz.book as viz

    viz.set_style()
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for bench, draw in (("update", plot_update), ("decode_step", plot_decode),
                        ("memory", plot_memory), ("sinks_update", plot_sinks_update),
                        ("sinks_decode", plot_sinks_decode)):
        if not any(r["bench"] == bench for r in rows):
            continue
        ax = draw(rows)
        path = plot_dir / f"bench_{bench}_{device}.png"
        ax.figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(ax.figure)
        paths.append(path)
    return paths
