"""Streaming with attention sinks on a real model: what S sinks buy, in each RoPE convention.

``python -m ringviz streaming --model smollm2`` decodes a long text through :class:`RingRunner`
with ``S`` sinks beside a window of ``W`` (chunked: the ring is exact for any chunking), in both
conventions (``absolute``: every key at its own position; ``cache``: StreamingLLM's positions
inside the cache), and records per-token loss. Two experiments:

* ``table``: perplexity for each ``W`` and ``S`` (and convention), plus the loss per position bin.
* ``past_context``: one ``W``, decoded past the model's ``max_position_embeddings``: with
  absolute positions a sink ends up further from the query than any distance seen in training;
  with cache positions no distance exceeds ``S + W - 1``.

The long input is the shipped CC0 story (``data/``) repeated, separated by blank lines: the
only text the project ships, and a window shorter than one copy never sees the previous copy.
A short float64 ``check`` first confirms the ring equals both references on this model.
"""

from __future__ import annotations

import math
import time

import torch

from ringviz.checks import SINK_CONVENTIONS, check_int
from ringviz.hf.rotary import float64_rope_angles
from ringviz.models.drive import RingRunner, ring_logits
from ringviz.models.load import load_model
from ringviz.models.perplexity import token_nll
from ringviz.models.reference import reference_logits
from ringviz.models.sinks import streaming_llm_logits
from ringviz.models.text import eval_text


def long_tokens(tokenizer, n: int) -> tuple[torch.Tensor, int]:
    """The first ``n`` tokens of the story repeated, and the token length of one copy."""
    copy = tokenizer(eval_text().strip() + "\n\n")["input_ids"]
    reps = math.ceil(n / len(copy))
    return torch.tensor((copy * reps)[:n], dtype=torch.int64), len(copy)


@torch.no_grad()
def stream_nll(model, ids: torch.Tensor, window: int, sinks: int, convention: str,
               chunk: int = 256) -> torch.Tensor:
    """Per-token loss ``(L-1,)`` of ``ids[1:]``, fed through the ring ``chunk`` tokens a call."""
    runner = RingRunner(model, 1, window, length=len(ids), sinks=sinks,
                        sink_convention=convention if sinks else "absolute")
    out = []
    for s in range(0, len(ids) - 1, chunk):
        e = min(s + chunk, len(ids) - 1)
        pos = torch.arange(s, e, device=ids.device)[None]
        logits = runner.forward(ids[None, s:e], pos)[0]  # (e - s, vocab)
        out.append(token_nll(logits, ids[s + 1:e + 1]))
    return torch.cat(out)


def binned(nll: torch.Tensor, bin_size: int) -> list[float]:
    """Mean loss per bin of ``bin_size`` predicted tokens (the last bin may be shorter)."""
    return [float(nll[i:i + bin_size].mean()) for i in range(0, len(nll), bin_size)]


def settings(windows: list[int], sinks: list[int]) -> list[tuple[int, int, str]]:
    """(W, S, convention) for every W and S; S = 0 has one convention (nothing to move)."""
    return [(w, s, c) for w in windows for s in sinks
            for c in (["absolute"] if s == 0 else list(SINK_CONVENTIONS))]


def run_check(name: str, window: int = 8, sinks: int = 4, n: int = 40) -> dict:
    """float64: ring vs band-with-sinks (absolute) and vs StreamingLLM (cache), max |logit diff|.

    Also the gap StreamingLLM's convention shows with Hugging Face's float32 RoPE angles.
    """
    model, tokenizer = load_model(name, dtype=torch.float64)
    ids, _ = long_tokens(tokenizer, n)

    def gap(convention: str) -> float:
        runner = RingRunner(model, 1, window, length=n, sinks=sinks,
                            sink_convention=convention)
        ring = ring_logits(runner, [ids], [17])[0]
        ref = (reference_logits(model, ids, window, sinks) if convention == "absolute"
               else streaming_llm_logits(model, ids, window, sinks))
        return float((ring - ref).abs().max())

    out = {"window": window, "sinks": sinks, "tokens": n}
    with float64_rope_angles(model):
        for conv in SINK_CONVENTIONS:
            out[f"{conv}_max_abs_logit_diff"] = gap(conv)
    out["cache_max_abs_logit_diff_hf_float32_angles"] = gap("cache")
    return out


def past_context(model, tokenizer, window: int, sinks: int, extra: int, chunk: int) -> dict:
    """Decode ``extra`` tokens past ``max_position_embeddings``: no sinks, then both conventions.

    Reported per run: the mean loss of the last ``extra`` queries inside the trained context
    and of the ``extra`` after it (``nll[i]`` is the loss of the query at position ``i``).
    """
    max_pos = model.config.max_position_embeddings
    ids, _ = long_tokens(tokenizer, max_pos + extra)
    runs = []
    for s, conv in ((0, "absolute"), (sinks, "absolute"), (sinks, "cache")):
        nll = stream_nll(model, ids, window, s, conv, chunk)
        inside, beyond = nll[:max_pos], nll[max_pos:]
        runs.append({"window": window, "sinks": s, "convention": conv,
                     "loss_inside_context": float(inside.mean()),
                     "loss_last_bin_inside": float(inside[-extra:].mean()),
                     "loss_beyond_context": float(beyond.mean()),
                     "loss_per_bin": binned(nll, 512)})
    return {"max_position_embeddings": max_pos, "tokens": len(ids), "bin_size": 512,
            "runs": runs}


def run_streaming(model: str = "smollm2", windows: tuple[int, ...] = (64, 256, 1024),
                  sinks: tuple[int, ...] = (0, 1, 4), tokens: int = 4096,
                  past_window: int = 256, past_sinks: int = 4, past_extra: int = 2048,
                  bin_size: int = 256, chunk: int = 256) -> dict:
    """The recorded run: the float64 check, the W x S table, the decode past the context.

    ``past_extra=0`` skips the decode past the context (Gemma 3's 32,768 positions are more
    than a CPU run can afford).
    """
    check_int("past_extra", past_extra, minimum=0)
    t0 = time.perf_counter()
    result = {"model": model, "check": run_check(model)}
    lm, tokenizer = load_model(model)
    ids, copy_len = long_tokens(tokenizer, tokens)
    table = []
    for w, s, conv in settings(list(windows), list(sinks)):
        nll = stream_nll(lm, ids, w, s, conv, chunk)
        table.append({"window": w, "sinks": s, "convention": conv,
                      "perplexity": math.exp(float(nll.mean())),
                      "perplexity_after_window": math.exp(float(nll[w:].mean())),
                      "loss_per_bin": binned(nll, bin_size)})
    result.update(tokens=tokens, copy_tokens=copy_len, bin_size=bin_size, chunk=chunk,
                  text="ringviz/models/data/harbor_light.txt (CC0), repeated", table=table,
                  past_context=(past_context(lm, tokenizer, past_window, past_sinks,
                                             past_extra, chunk) if past_extra else None),
                  seconds=round(time.perf_counter() - t0, 1),
                  torch_threads=torch.get_num_threads())
    return result
