"""What a window costs in quality: perplexity of full attention, windows, and windows with sinks.

``python -m ringviz perplexity --model smollm2 --windows 16,64,256 --sinks 0,4 --tokens 1000``
scores the shipped text once per setting with a full forward under a band mask (reference.py).
A query at p sees ``p-W+1 .. p`` plus, with ``S`` sinks, the first ``S`` positions (StreamingLLM's
attention sinks, here at their absolute positions: the cache holds ``S + W`` entries). The
smallest window, without sinks, is also decoded token by token through the ring
(drive.py), to show the ring reproduces the band-mask figure.
"""

from __future__ import annotations

import math
import time

import torch

from ringviz.checks import check_int
from ringviz.hf.config import read_layout
from ringviz.models.drive import RingRunner, ring_logits
from ringviz.models.load import load_model
from ringviz.models.reference import reference_logits
from ringviz.models.text import eval_tokens


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``-log p(target)`` in float64: ``logits`` (L, vocab), ``targets`` (L,)."""
    return -torch.log_softmax(logits.double(), dim=-1).gather(1, targets[:, None])[:, 0]


def nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood ``(L-1,)`` of ``ids[1:]`` under ``logits[:-1]``."""
    return token_nll(logits[:-1], ids[1:])


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """``exp(mean NLL)`` over the sequence."""
    return math.exp(float(nll(logits, ids).mean()))


def ring_check(model, ids: torch.Tensor, window: int, *, progress: bool = False) -> dict:
    """Decode ``ids`` one token at a time through the ring and compare with the band mask."""
    runner = RingRunner(model, 1, window, length=len(ids))
    ring = ring_logits(runner, [ids], [1], progress=progress)[0]  # (L, vocab)
    ref = reference_logits(model, ids, window)
    return {"window": window, "sinks": 0, "ring_perplexity": perplexity(ring, ids),
            "band_mask_perplexity": perplexity(ref, ids),
            "max_abs_logit_diff": float((ring - ref).abs().max()),
            "ring_cache_bytes": runner.nbytes}


def run_perplexity(model: str, windows: list[int], sinks: list[int], tokens: int) -> dict:
    """Perplexity table (full, each window, each window with sinks) plus one ring check."""
    if not windows or not sinks:
        raise ValueError(f"windows and sinks must be non-empty, got {windows!r}, {sinks!r}")
    for w in windows:
        check_int("window", w)
    for s in sinks:
        check_int("sinks", s, minimum=0)
    check_int("tokens", tokens, minimum=2)
    t0 = time.perf_counter()
    lm, tokenizer = load_model(model)
    ids = eval_tokens(tokenizer, tokens)
    # full attention; a native-window model gets a window covering the whole text
    full_window = tokens if read_layout(lm).has_native_window else None
    full = perplexity(reference_logits(lm, ids, full_window), ids)
    rows = []
    for w in windows:
        for s in sinks:
            ppl = perplexity(reference_logits(lm, ids, w, s), ids)
            rows.append({"window": w, "sinks": s, "perplexity": ppl,
                         "increase_pct": 100 * (ppl / full - 1)})
    t1 = time.perf_counter()
    check = ring_check(lm, ids, min(windows), progress=True)
    return {"model": model, "tokens": tokens, "full_attention_perplexity": full,
            "settings": rows, "ring_check": check,
            "seconds": {"band_masks": round(t1 - t0, 2),
                        "ring_check": round(time.perf_counter() - t1, 2)}}
