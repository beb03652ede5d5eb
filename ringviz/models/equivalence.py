"""Ring decode vs an independent reference on a real model: logits at every position.

``python -m ringviz equivalence --model smollm2 --window 32 --prompt-tokens 48 --new-tokens 64
--dtype float64 --json`` prefills a prompt of the shipped text, decodes the rest one teacher-forced
token at a time through ``RingRunner`` (drive.py), and compares every logit with one full forward
(reference.py). With ``batch > 1`` the rows start at different places in the text and have
different prompt lengths (a ragged, left-padded batch); each row is compared with its own
single-sequence reference.
"""

from __future__ import annotations

import time

import torch

from ringviz.checks import check_int
from ringviz.hf.config import read_layout
from ringviz.models.drive import RingRunner, ring_logits
from ringviz.models.load import get_spec, load_model
from ringviz.models.reference import native_window, reference_logits
from ringviz.models.text import eval_tokens

DTYPES = {"float32": torch.float32, "float64": torch.float64}
ROW_OFFSET = 7  # row b starts 7*b tokens later in the text, so rows hold different tokens


def ragged_rows(tokens: torch.Tensor, batch: int, prompt_tokens: int,
                new_tokens: int) -> tuple[list[torch.Tensor], list[int]]:
    """Row b: prompt of ``P - b*d`` tokens from offset ``7*b``, then ``new_tokens`` more.

    ``d = max(1, P // (2*batch))`` so prompt lengths spread over P/2 .. P and stay >= 1.
    """
    d = max(1, prompt_tokens // (2 * batch))
    lengths = [max(1, prompt_tokens - b * d) for b in range(batch)]
    rows = [tokens[ROW_OFFSET * b: ROW_OFFSET * b + p + new_tokens] for b, p in enumerate(lengths)]
    return rows, lengths


def full_cache_bytes(model, batch: int, length: int) -> int:
    """Bytes of a full (unwindowed) KV cache for ``batch`` rows of ``length`` tokens.

    2 (k and v) x layers x batch x num_kv_heads x length x head_dim x bytes per element.
    """
    c = read_layout(model)
    itemsize = next(model.parameters()).element_size()
    return 2 * len(c.kinds) * batch * c.num_kv_heads * length * c.head_dim * itemsize


def compare(ring: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """Max |logit diff| and argmax agreement over all rows, and how many positions were compared."""
    diff = max(float((a - b).abs().max()) for a, b in zip(ring, ref, strict=True))
    same = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(ring, ref, strict=True)])
    return {"compared_positions": int(same.numel()), "max_abs_logit_diff": diff,
            "argmax_agreement": float(same.double().mean())}


def compare_model(lm, tokenizer, *, window: int | None, prompt_tokens: int, new_tokens: int,
                  batch: int, progress: bool = False) -> tuple[dict, list[torch.Tensor]]:
    """Ring decode vs reference on a loaded model: the result dict, and per row the max
    |dlogit| at each position ``(L_b,)`` (for plots)."""
    layout = read_layout(lm)
    layout.windows(window)  # raises early for SmolLM2 without a window
    tokens = eval_tokens(tokenizer, ROW_OFFSET * (batch - 1) + prompt_tokens + new_tokens,
                         device=lm.device)
    rows, lengths = ragged_rows(tokens, batch, prompt_tokens, new_tokens)
    with native_window(lm, window) as window:
        runner = RingRunner(lm, batch, window, length=max(len(r) for r in rows))
        t0 = time.perf_counter()
        ring = ring_logits(runner, rows, lengths, progress=progress)
        t1 = time.perf_counter()
        ref = [reference_logits(lm, r, window) for r in rows]
        t2 = time.perf_counter()
    result = {
        "window": window, "dtype": str(next(lm.parameters()).dtype).removeprefix("torch."),
        "batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "prompt_lengths": lengths,
        "reference": ("hf_native_sliding_window_full_forward" if layout.has_native_window
                      else "hf_full_forward_band_mask"),
        **compare(ring, ref),
        "ring_cache_bytes": runner.nbytes,
        "full_cache_bytes": full_cache_bytes(lm, batch, max(len(r) for r in rows)),
        "seconds": {"ring": round(t1 - t0, 2), "reference": round(t2 - t1, 2)},
    }
    per_position = [(a - b).abs().amax(dim=-1) for a, b in zip(ring, ref, strict=True)]
    return result, per_position


def run_equivalence(model: str, window: int | None, prompt_tokens: int, new_tokens: int,
                    batch: int, dtype: str) -> dict:
    """Load ``model`` in ``dtype`` and compare ring decode with its reference (the CLI's dict)."""
    get_spec(model)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_int("prompt_tokens", prompt_tokens)
    check_int("batch", batch)
    check_int("new_tokens", new_tokens, minimum=0)
    t0 = time.perf_counter()
    lm, tokenizer = load_model(model, dtype=DTYPES[dtype])
    load_s = time.perf_counter() - t0
    result, _ = compare_model(lm, tokenizer, window=window, prompt_tokens=prompt_tokens,
                              new_tokens=new_tokens, batch=batch, progress=True)
    result["seconds"]["load"] = round(load_s, 2)
    return {"model": model, **result}
