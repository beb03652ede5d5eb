"""Benchmarks: the ring against copying windows, Hugging Face's sliding layers and the attention
bound, plus memory over a long decode and real models' tokens per second (chapter 10).

``python -m ringviz bench [--quick] [--device cpu|cuda] [--json]`` calls :func:`run_bench`; a
chapter or a test calls :func:`run` with its own :class:`BenchConfig`. Rows (``bench`` field;
which module measures each: ``ringviz/bench/README.md``):

* ``update``: one decode step's cache write (one token's K and V into a full window of W).
* ``decode_step``: that write plus one query's attention over the window (beside it, where
  mlx-lm is installed, its ``RotatingKVCache`` step on MLX's CPU backend).
* ``decode_profile``: a decode step's time stage by stage, masked and unmasked.
* ``memory``: cache bytes and process RSS at checkpoints of a long decode (ring vs growing).
* ``model``: Gemma-3-270M decode tokens/s, ring vs Hugging Face's default cache.
* ``sinks_update`` / ``sinks_decode``: attention sinks, the ring's O(S) sink rotation against
  StreamingLLM's re-rotation of the whole cache and a ``[sinks | ring]`` concat.
* ``generate``: Gemma-3-270M ``generate()`` tokens/s, ring vs Hugging Face's caches.
* ``generate_compiled``: SmolLM2 (every layer a ring) ``generate()``, eager vs inductor.
* ``generate_memory``: SmolLM2 peak RSS and cache bytes after 20 and 2,000 new tokens, ring vs
  Hugging Face's default cache (fresh processes, CPU).
* ``generate_long``: SmolLM2 in a sliding-window config, W = 1,024 to 8,192, ``generate()``
  tokens/s of the ring and of Hugging Face's dynamic and static sliding caches, against the
  bytes-bound floor of a decode step (the copy bandwidth measured in the same run).
* ``conform``: seconds of one ``ringviz.conformance.check(examples=100)`` on W = 6 caches.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ringviz.bench import mlx_peer
from ringviz.bench.cases import DECODE_IMPLS, UPDATE_IMPLS, Shape, build_cases, make_inputs
from ringviz.bench.conform import CONFORM_CACHES, conform_rows
from ringviz.bench.generate import compiled_rows, generate_memory_rows, generate_rows
from ringviz.bench.generate_long import GENERATE_LONG_CASES, generate_long_rows
from ringviz.bench.harness import Case, machine_info, measure_interleaved
from ringviz.bench.memory import MEMORY_IMPLS, run_memory
from ringviz.bench.model import model_rows
from ringviz.bench.profile import profile_rows
from ringviz.bench.report import figures, save_plots
from ringviz.bench.sinks import build_sink_cases


@dataclass(frozen=True)
class BenchConfig:
    """Everything a run measures; the defaults are the full run."""

    update_windows: tuple[int, ...] = (256, 1024, 4096, 16384)  # W for bench="update"
    decode_windows: tuple[int, ...] = (1024, 4096)  # W for bench="decode_step"
    decode_batches: tuple[int, ...] = (1, 8)  # B for bench="decode_step"
    mlx_peer: bool = True  # decode_step: mlx-lm's RotatingKVCache beside the ring (CPU)
    profile_windows: tuple[int, ...] = (1024,)  # W for bench="decode_profile" (at decode_batches)
    batch: int = 8  # B (update)
    kv_heads: int = 8  # num_kv_heads
    q_heads: int = 8  # Hq (decode_step); a multiple of kv_heads
    head_dim: int = 128  # D
    dtype: str = "float32"
    reps: int = 21  # timed samples per impl, interleaved round-robin
    warmup: int = 2  # untimed calls per case before the (also untimed) calibration blocks
    min_sample_s: float = 0.05  # a sample repeats a call until it lasts at least this long
    threads: int = 1  # torch.set_num_threads for the whole run (why 1: the appendix on the method)
    memory_window: int = 1024  # W of the ring in bench="memory"
    memory_steps: int = 100_000  # decode steps of the ring
    memory_growing_steps: int = 16_384  # decode steps of the growing cache (O(n^2) time)
    memory_batch: int = 1
    memory_kv_heads: int = 1
    memory_head_dim: int = 64
    memory: bool = True  # bench="memory": ring vs growing cache over a long decode
    model: bool = True  # bench="model": Gemma-3-270M, ring vs HF default cache
    model_prompt_tokens: int = 600  # longer than Gemma 3's window of 512
    model_new_tokens: int = 64
    sink_windows: tuple[int, ...] = (256, 1024, 4096, 16384)  # W for the sinks benches
    sinks: int = 4  # S
    sink_batch: int = 1  # one sequence, Llama-3-8B-like heads (GQA 4)
    sink_kv_heads: int = 8
    sink_q_heads: int = 32
    sink_head_dim: int = 128
    generate: bool = True  # bench="generate": Gemma-3-270M generate(), ring vs HF's caches
    generate_prompt_tokens: int = 600
    generate_cases: tuple[tuple[int, int], ...] = ((1, 96), (8, 2048))  # (batch, new tokens)
    generate_reps: int = 3
    compiled: bool = True  # bench="generate_compiled": SmolLM2 ring generate, eager vs inductor
    compiled_window: int = 256
    compiled_prompt_tokens: int = 300
    compiled_new_tokens: int = 64
    compiled_reps: int = 3
    generate_memory: bool = True  # bench="generate_memory": SmolLM2 RSS, ring vs HF default
    generate_memory_window: int = 256
    generate_memory_new_tokens: tuple[int, ...] = (20, 2000)
    generate_long: bool = True  # bench="generate_long": SmolLM2 sliding, long W, vs HF's caches
    generate_long_cases: tuple[tuple[int, int], ...] = GENERATE_LONG_CASES  # (W, B)
    generate_long_new_tokens: int = 64  # decode steps per repetition (after one prefill)
    generate_long_reps: int = 3
    conform_caches: tuple[str, ...] = CONFORM_CACHES  # bench="conform": check() wall time
    conform_window: int = 6
    conform_examples: int = 100
    conform_reps: int = 3


FULL = BenchConfig()
QUICK = replace(FULL, reps=5, warmup=0, min_sample_s=0.02, memory_growing_steps=4096,
                model=False, generate=False, compiled=False, generate_memory=False,
                generate_long=False, conform_reps=1)
_PART_FIELDS = {"decode_step": "decode_windows", "decode_profile": "profile_windows",
                "sinks": "sink_windows", "generate": "generate", "compiled": "compiled",
                "generate_memory": "generate_memory", "generate_long": "generate_long",
               "conform": "conform_caches"}
PARTS = tuple(_PART_FIELDS)  # ``--only`` keeps one
_ALL_OFF = {"update_windows": (), "decode_windows": (), "memory": False, "model": False,
            "sink_windows": (), "generate": False, "compiled": False, "generate_memory": False,
            "profile_windows": (), "conform_caches": (), "generate_long": False}


def only(config: BenchConfig, part: str) -> BenchConfig:
    """``config`` with one part's benches alone (``--only sinks``, ``generate``, ...)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    field = _PART_FIELDS[part]
    return replace(config, **{**_ALL_OFF, field: getattr(config, field)})


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _timed_rows(kind: str, cases: list[Case], shape: Shape, config: BenchConfig,
                **fields) -> list[dict]:
    """One ``bench=kind`` row per case, every case timed in the same interleaved blocks."""
    timings = measure_interleaved(cases, reps=config.reps, warmup=config.warmup,
                                  min_sample_s=config.min_sample_s, device=shape.device)
    return [{"bench": kind, "impl": impl, "window": window, **fields, **shape.fields(),
             "threads": torch.get_num_threads(), **timing.as_row()}
            for (impl, window), timing in timings.items()]


def _timing_rows(kind: str, impls: tuple[str, ...], windows: tuple[int, ...], shape: Shape,
                 config: BenchConfig) -> list[dict]:
    """Rows of one timed bench: every (impl, window) pair interleaved in the same blocks.

    All windows' caches are alive together so that machine noise hits every window alike; the
    ring's flatness in W is then a comparison inside one run, not across runs.
    """
    t0 = time.perf_counter()
    peer = kind == "decode_step" and config.mlx_peer
    rows = _timed_rows(kind, [case for window in windows
                              for case in build_cases(kind, impls, shape, window, peer=peer)],
                       shape, config)
    skipped = mlx_peer.skip_reason(shape.device.type) if peer else None
    if skipped:  # the peer's row says why it is missing
        rows += [{"bench": kind, "impl": impl, "window": window, **shape.fields(),
                  "skipped": skipped} for window in windows
                 for impl in (mlx_peer.IMPL, mlx_peer.ATTENTION_IMPL)]
        _log(f"{kind}: {mlx_peer.IMPL} skipped: {skipped}")
    for window in windows:
        summary = ", ".join(f"{r['impl']} {r['median_us']:.0f}" for r in rows
                            if r["window"] == window and "median_us" in r)
        _log(f"{kind} W={window}: {summary} us")
    _log(f"{kind}: {time.perf_counter() - t0:.1f} s")
    return rows


def _profile_rows(config: BenchConfig, shape: Shape) -> list[dict]:
    """``decode_profile`` rows: a decode step's stages, masked and unmasked, at each W."""
    rows = []
    for window in config.profile_windows:
        t0 = time.perf_counter()
        pre, tok = make_inputs(shape, window)
        rows += profile_rows(shape, window, pre, tok, reps=config.reps, warmup=config.warmup,
                             min_sample_s=config.min_sample_s)
        _log(f"decode_profile B={shape.batch} W={window}: " + ", ".join(
            f"{r['impl']}:{r['stage']} {r['stage_us']:.0f}" for r in rows[-10:]) +
            f" us ({time.perf_counter() - t0:.1f} s)")
    return rows


def _sink_rows(config: BenchConfig, device: torch.device) -> list[dict]:
    """``sinks_update`` and ``sinks_decode`` rows: each bench's impls and windows interleaved."""
    shape = Shape(config.sink_batch, config.sink_kv_heads, config.sink_q_heads,
                  config.sink_head_dim, getattr(torch, config.dtype), device)
    built = [build_sink_cases(shape, w, config.sinks) for w in config.sink_windows]
    rows = []
    for kind in ("sinks_update", "sinks_decode"):
        t0 = time.perf_counter()
        rows += _timed_rows(kind, [c for b in built for c in b[kind]], shape, config,
                            sinks=config.sinks)
        _log(f"{kind}: {time.perf_counter() - t0:.1f} s")
    return rows


def _memory_rows(config: BenchConfig, device: torch.device) -> list[dict]:
    rows = []
    for impl in MEMORY_IMPLS:
        steps = config.memory_steps if impl == "ring" else config.memory_growing_steps
        t0 = time.perf_counter()
        rows += run_memory(impl, steps=steps, window=config.memory_window,
                           batch=config.memory_batch, kv_heads=config.memory_kv_heads,
                           head_dim=config.memory_head_dim, dtype=config.dtype,
                           device=device.type, threads=config.threads)
        _log(f"memory {impl}: {steps} steps ({time.perf_counter() - t0:.1f} s)")
    return rows


def run(config: BenchConfig, device: str | torch.device = "cpu",
        plot_dir: str | Path | None = None) -> dict:
    """Run every bench ``config`` asks for; ``{"device", "machine", "config", "rows", ...}``."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' asked for, but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    if config.q_heads % config.kv_heads:
        raise ValueError(f"q_heads={config.q_heads} is not a multiple of "
                         f"kv_heads={config.kv_heads}")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    torch.manual_seed(123)
    t0 = time.perf_counter()
    try:
        shape = Shape(config.batch, config.kv_heads, config.q_heads, config.head_dim,
                      getattr(torch, config.dtype), device)
        with torch.inference_mode():
            rows = []
            if config.update_windows:
                rows += _timing_rows("update", UPDATE_IMPLS, config.update_windows, shape,
                                     config)
            for batch in config.decode_batches if config.decode_windows else ():
                rows += _timing_rows("decode_step", DECODE_IMPLS, config.decode_windows,
                                     replace(shape, batch=batch), config)
            for batch in config.decode_batches if config.profile_windows else ():
                rows += _profile_rows(config, replace(shape, batch=batch))
            if config.sink_windows:
                rows += _sink_rows(config, device)
        if config.memory:
            rows += _memory_rows(config, device)
        if config.model:
            rows += model_rows(prompt_tokens=config.model_prompt_tokens,
                               new_tokens=config.model_new_tokens, device=device)
        if config.generate:
            rows += generate_rows(prompt_tokens=config.generate_prompt_tokens,
                                  cases=config.generate_cases, reps=config.generate_reps,
                                  device=device, log=_log)
        if config.compiled:
            rows += compiled_rows(window=config.compiled_window,
                                  prompt_tokens=config.compiled_prompt_tokens,
                                  new_tokens=config.compiled_new_tokens,
                                  reps=config.compiled_reps, device=device, log=_log)
        if config.generate_memory:
            rows += generate_memory_rows(window=config.generate_memory_window,
                                         new_tokens=config.generate_memory_new_tokens,
                                         threads=config.threads, log=_log)
        if config.generate_long:
            rows += generate_long_rows(cases=config.generate_long_cases,
                                       new_tokens=config.generate_long_new_tokens,
                                       reps=config.generate_long_reps, device=device, log=_log)
        if config.conform_caches:
            rows += conform_rows(caches=config.conform_caches, window=config.conform_window,
                                 examples=config.conform_examples, reps=config.conform_reps,
                                 log=_log)
        result = {"device": device.type, "machine": machine_info(device),
                  "config": asdict(config), "rows": rows}
    finally:
        torch.set_num_threads(threads_before)
    result["figures"] = figures(rows)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if plot_dir is not None:
        result["plots"] = [str(p) for p in save_plots(rows, Path(plot_dir), device.type)]
    return result


def run_bench(quick: bool, device: str, plot_dir: str | Path | None, *,
              only_part: str | None = None,
              generate_cases: tuple[tuple[int, int], ...] | None = None,
              generate_reps: int | None = None,
              generate_long_cases: tuple[tuple[int, int], ...] | None = None,
              generate_long_reps: int | None = None) -> dict:
    """The CLI's entry: the quick configuration (every row but ``model`` and ``generate``) or
    the full one; ``only_part`` keeps one part's rows alone (:func:`only`), and the generate
    cases and repetitions, and generate_long's (W, B) cases and repetitions, can be overridden
    (the full cases take hours on a 2-core CPU)."""
    config = QUICK if quick else FULL
    if only_part is not None:
        config = only(config, only_part)
    if generate_cases is not None:
        config = replace(config, generate_cases=tuple(generate_cases))
    if generate_reps is not None:
        config = replace(config, generate_reps=generate_reps)
    if generate_long_cases is not None:
        config = replace(config, generate_long_cases=tuple(generate_long_cases))
    if generate_long_reps is not None:
        config = replace(config, generate_long_reps=generate_long_reps)
    return run(config, device=device, plot_dir=plot_dir)


__all__ = ["FULL", "PARTS", "QUICK", "BenchConfig", "only", "run", "run_bench"]
