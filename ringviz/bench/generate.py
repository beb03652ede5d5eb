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
must be the same, or the row says they are not.
"""

from __future__ import annotations

import time

import numpy as np
import torch

GENERATE_IMPLS = ("ring", "hf_default", "hf_static")


def _call(impl: str, model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    from ringviz import hf

    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
              "attention_mask": torch.ones_like(ids)}
    if impl == "ring":
        return hf.generate(model, ids, **kwargs)
    if impl == "hf_static":
        kwargs["cache_implementation"] = "static"
    return model.generate(ids, **kwargs)


def _timed(impl: str, model, ids: torch.Tensor, new_tokens: int,
           device: torch.device) -> tuple[torch.Tensor, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = _call(impl, model, ids, new_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


@torch.no_grad()
def generate_rows(*, name: str = "gemma3", prompt_tokens: int, cases: tuple[tuple[int, int], ...],
                  reps: int, device: torch.device, log=print) -> list[dict]:
    """``bench="generate"`` rows: one per (impl, batch, new_tokens), seconds of each repetition."""
    from ringviz.models.load import load_model
    from ringviz.models.text import eval_tokens

    if reps < 1 or prompt_tokens < 1 or any(b < 1 or n < 2 for b, n in cases):
        raise ValueError(f"need reps, prompt_tokens, batch >= 1 and new_tokens >= 2; got "
                         f"{reps}, {prompt_tokens}, {cases}")
    model, tokenizer = load_model(name, device=device)
    prompt = eval_tokens(tokenizer, prompt_tokens, device=device)
    config = model.config
    rows = []
    for batch, new_tokens in cases:
        ids = prompt.expand(batch, -1).contiguous()  # (B, P)
        for impl in GENERATE_IMPLS:  # untimed, at this batch: first calls fault in memory
            _call(impl, model, ids, 2)
        seconds: dict[str, list[float]] = {impl: [] for impl in GENERATE_IMPLS}
        outputs: dict[str, torch.Tensor] = {}
        for r in range(reps):
            order = GENERATE_IMPLS[r % 3:] + GENERATE_IMPLS[:r % 3]
            for impl in order:
                outputs[impl], dt = _timed(impl, model, ids, new_tokens, device)
                seconds[impl].append(dt)
            log(f"generate B={batch} N={new_tokens} rep {r + 1}/{reps}: " + ", ".join(
                f"{impl} {seconds[impl][-1]:.1f} s" for impl in GENERATE_IMPLS))
        for impl, s in seconds.items():
            rows.append({
                "bench": "generate", "impl": impl, "model": name,
                "window": config.sliding_window, "batch": batch,
                "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                "dtype": "float32", "device": device.type, "threads": torch.get_num_threads(),
                "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                "seconds": s, "reps": len(s),
                "tokens_per_s": float(batch * new_tokens / np.median(s)),
                "tokens_match_ring": bool(torch.equal(outputs[impl], outputs["ring"])),
            })
    return rows


def generate_figures(rows: list[dict]) -> dict:
    """Per case: ring tokens/s over each HF cache's, median and range over repetitions."""
    out = {}
    cases = sorted({(r["batch"], r["new_tokens"]) for r in rows if r["bench"] == "generate"})
    for batch, n in cases:
        by = {r["impl"]: r for r in rows if r["bench"] == "generate"
              and (r["batch"], r["new_tokens"]) == (batch, n)}
        if "ring" not in by:
            continue
        ring = np.asarray(by["ring"]["seconds"])
        for impl in ("hf_default", "hf_static"):
            if impl not in by:
                continue
            ratio = np.asarray(by[impl]["seconds"]) / ring  # tokens/s ratio, per repetition
            key = f"generate_ring_over_{impl}_B{batch}_N{n}"
            out.update({key: float(np.median(ratio)), f"{key}_min": float(ratio.min()),
                        f"{key}_max": float(ratio.max())})
        out[f"generate_tokens_match_B{batch}_N{n}"] = all(
            r["tokens_match_ring"] for r in by.values())
    return out
