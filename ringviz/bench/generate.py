"""End-to-end ``generate()`` throughput: ``ringviz.hf.generate`` vs Hugging Face's own caches.

Gemma-3-270M generates greedily from the same prompt (repeated ``batch`` times) through three
paths, all inside transformers' ``generate`` with the same arguments:

* ``ring`` — :func:`ringviz.hf.generate` (a fresh :class:`ringviz.hf.RingCache` per call);
* ``hf_default`` — ``model.generate`` with its default ``DynamicCache`` (sliding layers cat +
  slice, full layers cat their whole history every step);
* ``hf_static`` — ``model.generate(cache_implementation="static")`` (preallocated; its sliding
  layers roll + copy the window every step).

One repetition runs each path once, in a rotated order (repetition r starts with path r mod 3),
so machine noise lands on all of them; the ratios ring/other are taken inside each repetition
and their median and range reported. Each path first runs once untimed at the case's batch
(2 new tokens). Wall time covers the whole call (prefill included); the tokens of every path
must be the same, or the row says they are not. Every path runs eager (``disable_compile``: on
CUDA, transformers would otherwise compile the static cache's decode on its own).

Two more parts:

* ``generate_compiled`` (:func:`compiled_rows`): ``ringviz.hf.generate`` eager against the same
  call compiled by inductor (``fullgraph=True``: prefill chunks and decode steps) through
  transformers' own ``compile_config``, on SmolLM2 with every layer a ring of ``window`` and on
  Gemma 3 (hybrid: its own window on its sliding layers, static full layers).
* ``generate_memory`` (:func:`generate_memory_rows`): on SmolLM2 with every layer a ring of
  ``window``, peak RSS and cache bytes of a ring and of Hugging Face's default cache after 20
  and 2,000 new tokens, each run in a fresh process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from ringviz.bench.harness import in_fresh_process, timed_call
from ringviz.bench.memory import _reset_peak, _status_bytes
from ringviz.bench.model import load_with_prompt

GENERATE_IMPLS = ("ring", "hf_default", "hf_static")
COMPILED_IMPLS = ("ring_eager", "ring_inductor")
GENERATE_MEMORY_IMPLS = ("ring", "hf_default")


def _greedy(ids: torch.Tensor, new_tokens: int) -> dict:
    """Greedy ``generate`` arguments for exactly ``new_tokens`` tokens, eager."""
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
            "attention_mask": torch.ones_like(ids), "disable_compile": True}


def _call(impl: str, model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    from ringviz import hf

    kwargs = _greedy(ids, new_tokens)
    if impl == "ring":
        return hf.generate(model, ids, **kwargs)
    if impl == "hf_static":
        kwargs["cache_implementation"] = "static"
    return model.generate(ids, **kwargs)


def _timed_reps(calls: dict[str, Callable[[], torch.Tensor]], reps: int, device: torch.device,
                log: Callable[[str], None], what: str) -> tuple[dict, dict]:
    """Every call once per repetition, in a rotated order: ``({name: seconds of each
    repetition}, {name: its last output})``."""
    names = list(calls)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, torch.Tensor] = {}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            outputs[name], dt = timed_call(calls[name], device)
            seconds[name].append(dt)
        log(f"{what} rep {r + 1}/{reps}: " + ", ".join(
            f"{name} {seconds[name][-1]:.2f} s" for name in names))
    return seconds, outputs


def _paired_ratios(key: str, numerator_s: list[float], denominator_s: list[float]) -> dict:
    """``key``: median of the per-repetition ratios ``numerator / denominator`` (seconds, so a
    tokens/s ratio of the denominator's path over the numerator's); ``key_min``, ``key_max``."""
    ratio = np.asarray(numerator_s) / np.asarray(denominator_s)
    return {key: float(np.median(ratio)), f"{key}_min": float(ratio.min()),
            f"{key}_max": float(ratio.max())}


@torch.no_grad()
def generate_rows(*, name: str = "gemma3", prompt_tokens: int, cases: tuple[tuple[int, int], ...],
                  reps: int, device: torch.device, log=print) -> list[dict]:
    """``bench="generate"`` rows: one per (impl, batch, new_tokens), seconds of each repetition."""
    if reps < 1 or prompt_tokens < 1 or any(b < 1 or n < 2 for b, n in cases):
        raise ValueError(f"need reps, prompt_tokens, batch >= 1 and new_tokens >= 2; got "
                         f"{reps}, {prompt_tokens}, {cases}")
    model, prompt = load_with_prompt(name, prompt_tokens, device)
    config = model.config
    rows = []
    for batch, new_tokens in cases:
        ids = prompt.expand(batch, -1).contiguous()  # (B, P)
        for impl in GENERATE_IMPLS:  # untimed, at this batch: first calls fault in memory
            _call(impl, model, ids, 2)
        seconds, outputs = _timed_reps(
            {impl: partial(_call, impl, model, ids, new_tokens) for impl in GENERATE_IMPLS},
            reps, device, log, f"generate B={batch} N={new_tokens}")
        rows += [{"bench": "generate", "impl": impl, "model": name,
                  "window": config.sliding_window, "batch": batch,
                  "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                  "dtype": "float32", "device": device.type, "threads": torch.get_num_threads(),
                  "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                  "seconds": s, "reps": len(s),
                  "tokens_per_s": float(batch * new_tokens / np.median(s)),
                  "tokens_match_ring": bool(torch.equal(outputs[impl], outputs["ring"]))}
                 for impl, s in seconds.items()]
    return rows


def generate_figures(rows: list[dict]) -> dict:
    """Per case: ring tokens/s over each HF cache's, median and range over repetitions."""
    out = {}
    cases = sorted({(r["batch"], r["new_tokens"]) for r in rows if r["bench"] == "generate"})
    for batch, n in cases:
        by = {r["impl"]: r for r in rows if r["bench"] == "generate"
              and (r["batch"], r["new_tokens"]) == (batch, n)}
        if "ring" in by:
            out.update(ring_case_figures(by, "generate", f"B{batch}_N{n}",
                                         ("hf_default", "hf_static")))
    return out


def ring_case_figures(by: dict, bench: str, tag: str, others: tuple[str, ...]) -> dict:
    """One case's rows by impl: the ring's tokens/s over each of ``others`` (paired per
    repetition, median and range) and whether every impl's tokens matched the ring's."""
    out = {}
    for impl in others:
        if impl in by:
            out.update(_paired_ratios(f"{bench}_ring_over_{impl}_{tag}",
                                      by[impl]["seconds"], by["ring"]["seconds"]))
    out[f"{bench}_tokens_match_{tag}"] = all(r["tokens_match_ring"] for r in by.values())
    return out


def inductor_config(device: torch.device):
    """transformers' ``CompileConfig`` for an inductor-compiled decode step, ``fullgraph=True``.

    On CUDA, transformers' default mode (``reduce-overhead``: CUDA graphs); on CPU, inductor's
    default mode, and compiling allowed there (transformers compiles only on accelerators).
    """
    from transformers import CompileConfig

    if device.type == "cuda":
        return CompileConfig(fullgraph=True)
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # not an __init__ argument in transformers 5.24
    return config


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@torch.no_grad()
def compiled_rows(*, name: str | None = None, window: int = 256, prompt_tokens: int,
                  new_tokens: int, reps: int, device: torch.device, log=print) -> list[dict]:
    """``bench="generate_compiled"`` rows: ring generate eager vs inductor-compiled.

    ``name=None``: SmolLM2 (every layer a ring of ``window``) and Gemma 3 (its own window on
    its sliding layers; hybrid). The first compiled call compiles (its time is reported as
    ``compile_s``); the timed repetitions then alternate eager and compiled, and must compile
    no new graph. Each call gets a fresh cache; a compiled call's is allocated whole first
    (``RingCache.allocate``, static full layers: a compiled step can neither grow nor
    allocate), an eager call's grows as ``ringviz.hf.generate`` grows it.
    """
    if name is None:
        return [row for model, w in (("smollm2", window), ("gemma3", None))
                for row in compiled_rows(name=model, window=w, prompt_tokens=prompt_tokens,
                                         new_tokens=new_tokens, reps=reps, device=device,
                                         log=log)]
    from ringviz import hf

    if reps < 1 or prompt_tokens < 1 or new_tokens < 2:
        raise ValueError(f"need reps, prompt_tokens >= 1 and new_tokens >= 2; got {reps}, "
                         f"{prompt_tokens}, {new_tokens}")
    model, prompt = load_with_prompt(name, prompt_tokens, device)
    ids = prompt[None]  # (1, P)
    kwargs = {"eager": _greedy(ids, new_tokens),
              "inductor": {**_greedy(ids, new_tokens), "disable_compile": False,
                           "compile_config": inductor_config(device)}}
    if not hf.RingCache(model, window=window).is_compileable:
        raise ValueError(f"RingCache({name}, window={window}) is not compileable")

    def call(way: str) -> torch.Tensor:
        cache = hf.RingCache(model, window=window)
        if way == "inductor":
            cache.allocate(1, prompt_tokens + new_tokens, model.dtype, device, static=True)
        return hf.generate(model, ids, cache=cache, **kwargs[way])

    calls = {way: partial(call, way) for way in ("eager", "inductor")}
    calls["eager"]()  # untimed: faults the weights in
    graphs_before = _graphs_compiled()
    _, compile_s = timed_call(calls["inductor"], device)
    graphs_compiled = _graphs_compiled() - graphs_before
    seconds, outputs = _timed_reps(calls, reps, device, log, "generate_compiled")
    recompiled = _graphs_compiled() - graphs_before - graphs_compiled
    same = bool(torch.equal(outputs["eager"], outputs["inductor"]))
    return [{"bench": "generate_compiled", "impl": f"ring_{way}", "model": name,
             "window": window, "batch": 1, "dtype": "float32", "device": device.type,
             "threads": torch.get_num_threads(), "prompt_tokens": prompt_tokens,
             "new_tokens": new_tokens, "seconds": s, "reps": len(s),
             "tokens_per_s": float(new_tokens / np.median(s)),
             "compile_s": compile_s if way == "inductor" else None,
             "graphs_compiled": graphs_compiled if way == "inductor" else None,
             "graphs_compiled_while_timed": recompiled if way == "inductor" else None,
             "tokens_match_eager": same} for way, s in seconds.items()]


def compiled_figures(rows: list[dict]) -> dict:
    """Inductor tokens/s over eager, paired per repetition: median and range, per model
    (SmolLM2's, or a row's without a model, unsuffixed; another model's suffixed
    ``_<model>``)."""
    out: dict = {}
    for model in dict.fromkeys(r.get("model", "smollm2") for r in rows
                               if r["bench"] == "generate_compiled"):
        by = {r["impl"]: r for r in rows if r["bench"] == "generate_compiled"
              and r.get("model", "smollm2") == model}
        if set(by) != set(COMPILED_IMPLS):
            continue
        tail = "" if model == "smollm2" else f"_{model}"
        out.update({
            **_paired_ratios(f"generate_compiled_inductor_over_eager{tail}",
                             by["ring_eager"]["seconds"], by["ring_inductor"]["seconds"]),
            f"generate_compiled_tokens_match{tail}": by["ring_inductor"]["tokens_match_eager"],
            f"generate_compiled_recompiles{tail}":
                by["ring_inductor"]["graphs_compiled_while_timed"]})
    return out


@torch.no_grad()
def memory_worker(impl: str, name: str, window: int, prompt_tokens: int, new_tokens: int,
                  threads: int) -> dict:
    """One generate in this (fresh) process: peak RSS growth over the call, cache bytes after."""
    from ringviz import hf
    from ringviz.models.chat import cache_bytes

    torch.set_num_threads(threads)
    model, prompt = load_with_prompt(name, prompt_tokens)
    ids = prompt[None]  # (1, P)

    def run(n: int):
        kwargs = {**_greedy(ids, n), "return_dict_in_generate": True}
        if impl == "ring":
            cache = hf.RingCache(model, window=window)
            hf.generate(model, ids, cache=cache, **kwargs)
            return cache
        return model.generate(ids, **kwargs).past_key_values

    run(2)  # pages the weights in and warms the allocator, at this process's shapes
    baseline = _status_bytes("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    cache = run(new_tokens)
    seconds = time.perf_counter() - start
    return {"bench": "generate_memory", "impl": impl, "model": name,
            "window": window if impl == "ring" else None, "batch": 1, "dtype": "float32",
            "device": "cpu", "threads": threads, "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "seconds": seconds, "cache_bytes": cache_bytes(cache),
            "peak_rss_growth_bytes": _status_bytes("VmHWM") - baseline,
            "rss_growth_bytes": _status_bytes("VmRSS") - baseline}


def generate_memory_rows(*, name: str = "smollm2", window: int = 256, prompt_tokens: int = 64,
                         new_tokens: tuple[int, ...] = (20, 2000), threads: int = 1,
                         log=print) -> list[dict]:
    """``bench="generate_memory"`` rows: each (impl, new_tokens) in its own fresh process (CPU).

    RSS (``VmRSS``; peak ``VmHWM``, reset after a warm-up call) is measured around one
    ``generate``; ``cache_bytes`` is what the returned cache holds.
    """
    if prompt_tokens < 1 or not new_tokens or min(new_tokens) < 2:
        raise ValueError(f"need prompt_tokens >= 1 and new_tokens >= 2, got {prompt_tokens}, "
                         f"{new_tokens}")
    rows = []
    for impl in GENERATE_MEMORY_IMPLS:
        for n in new_tokens:
            params = {"impl": impl, "name": name, "window": window,
                      "prompt_tokens": prompt_tokens, "new_tokens": n, "threads": threads}
            row = in_fresh_process("ringviz.bench.generate:memory_worker", params,
                                   f"generate_memory worker {params}")
            log(f"generate_memory {impl} N={n}: cache {row['cache_bytes'] / 2**20:.1f} MiB, "
                f"peak RSS +{row['peak_rss_growth_bytes'] / 2**20:.1f} MiB "
                f"({row['seconds']:.1f} s)")
            rows.append(row)
    return rows


def generate_memory_figures(rows: list[dict]) -> dict:
    """Per impl: cache bytes and peak RSS growth at the largest new-token count over the
    smallest (1.0 = flat), and their differences in MiB."""
    out = {}
    for impl in GENERATE_MEMORY_IMPLS:
        mine = sorted((r for r in rows if r["bench"] == "generate_memory"
                       and r["impl"] == impl), key=lambda r: r["new_tokens"])
        if len(mine) < 2:
            continue
        lo, hi = mine[0], mine[-1]
        tag = f"generate_memory_{impl}_N{hi['new_tokens']}_vs_N{lo['new_tokens']}"
        for field in ("cache_bytes", "peak_rss_growth_bytes"):
            out[f"{tag}_{field.removesuffix('_bytes')}_MiB"] = (hi[field] - lo[field]) / 2**20
    return out
