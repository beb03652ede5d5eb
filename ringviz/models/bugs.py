"""The catalogue's bugs on a real model: each pitfall of :mod:`ringviz.conformance.pitfalls`
under the model's sliding layers through the seam (:func:`bug_ring`, its RoPE pitfalls turning
with the model's own rotary embedding), and :func:`run_bugs`, which shows each one's symptom
against the band-mask reference next to the correct ring agreeing.

=============  =========================================================  ================
bug            what the code does wrong                                   first symptom
=============  =========================================================  ================
slot_rope      rotates keys by their slot ``pos % W``, not ``pos``         position W
off_by_one     sizes the ring (and so the window) W-1 instead of W        position W-1
chunk_first    writes a prompt longer than W, then attends (overwritten)  position 0
no_stale_mask  spare slots (capacity > W), mask checks "filled" only       position W
shared_ring    two batch rows take turns in one ring                      row 1, pos P-W
=============  =========================================================  ================
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringviz.cache import MakeStep
from ringviz.conformance.pitfalls import PITFALLS
from ringviz.hf.config import KIND_TYPES, read_layout
from ringviz.hf.rotary import model_sink_rope
from ringviz.models.drive import RingRunner, ring_generate, ring_logits
from ringviz.models.reference import reference_greedy, reference_logits
from ringviz.models.text import eval_tokens

DIVERGENCE_TOL = 1e-2  # |dlogit| above this counts as diverged (float32 ring noise is ~1e-4)
BUGS = ("slot_rope", "off_by_one", "chunk_first", "no_stale_mask", "shared_ring")  # run_bugs'
TURNS = ("slot_rope", "double_rope", "batch_counter")  # pitfalls that turn with one RoPE


def rope_bases(model) -> dict[str, float]:
    """RoPE base per layer type, from the config the model's rotary module was built with."""
    layout = read_layout(model)
    return {KIND_TYPES[kind]: layout.rope_theta(kind) for kind in dict.fromkeys(layout.kinds)}


def bug_ring(model, name: str) -> Callable[[int], MakeStep]:
    """The catalogue's pitfall ``name`` as a ring factory for ``model``: its RoPE turns are the
    model's own (a sliding layer's; ``one_base``: to the full layers' base, Gemma 3)."""
    if name not in PITFALLS:
        raise ValueError(f"no pitfall {name!r}: the catalogue holds {sorted(PITFALLS)}")
    factory = PITFALLS[name].factory
    if name == "one_base":
        if set(rope_bases(model)) != {"sliding_attention", "full_attention"}:
            raise ValueError("one_base needs a model with sliding and full layers (Gemma 3)")
        own, other = (model_sink_rope(model, t) for t in ("sliding_attention", "full_attention"))
        return lambda window: factory(window, own, other)
    if name in TURNS:
        rope = model_sink_rope(model, "sliding_attention")
        return lambda window: factory(window, rope)
    return factory


def first_divergence(ring: torch.Tensor, ref: torch.Tensor, tol: float = DIVERGENCE_TOL) -> int:
    """First position whose max |dlogit| exceeds ``tol``; -1 if none."""
    bad = ((ring - ref).abs().amax(dim=-1) > tol).nonzero()
    return int(bad[0, 0]) if len(bad) else -1


def _score(logits: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    pairs = list(zip(logits, refs, strict=True))
    firsts = [first_divergence(a, b) for a, b in pairs]
    first = min((f for f in firsts if f >= 0), default=-1)
    same = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in pairs])
    return {"max_abs_logit_diff": max(float((a - b).abs().max()) for a, b in pairs),
            "first_diverging_position": first,
            "first_diverging_row": firsts.index(first) if first >= 0 else -1,
            "argmax_agreement": float(same.double().mean())}


def _decode(ring: Callable[[int], MakeStep] | None, window: int, model,
            rows: list[torch.Tensor], prompt_tokens: int, gen_tokens: int
            ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Teacher-forced logits of both rows, and row 0's greedy continuation.

    The prompt goes in as one call (``prefill_chunk=prompt_tokens``), as the table above
    describes; chunked prefill would delay chunk_first's symptom to the second chunk.
    """
    total = prompt_tokens + max(len(rows[0]) - prompt_tokens, gen_tokens)
    logits = ring_logits(RingRunner(model, 2, window, total, ring=ring), rows,
                         [prompt_tokens] * 2, prefill_chunk=prompt_tokens)
    prompts = [r[:prompt_tokens] for r in rows]
    words = ring_generate(RingRunner(model, 2, window, total, ring=ring), prompts, gen_tokens,
                          prefill_chunk=prompt_tokens)[0]
    return logits, words


def run_bugs(model, tokenizer, bugs: tuple[str, ...] = BUGS, *, window: int = 16,
             prompt_tokens: int = 24, new_tokens: int = 16, gen_tokens: int = 8,
             start: int = 120) -> dict:
    """Run bugs and the correct ring on ``model`` (Llama-style: window imposed on all layers).

    Two rows of the evaluation text (from token ``start``; the second 7 tokens later) are
    prefilled with ``prompt_tokens`` tokens and decoded ``new_tokens`` more, teacher-forced,
    against the band-mask reference; each runner then greedily continues row 0's prompt by
    ``gen_tokens`` tokens. Returns ``{"correct": ..., "bugs": {name: ...}, "words": ...}``.
    """
    unknown = [b for b in bugs if b not in PITFALLS]
    if unknown or window < 4:
        raise ValueError(f"bugs must come from {sorted(PITFALLS)} (got {unknown}) and window "
                         f">= 4 (got {window})")
    ids = eval_tokens(tokenizer, start + 7 + prompt_tokens + new_tokens, device=model.device)
    rows = [ids[start:start + prompt_tokens + new_tokens], ids[start + 7:]]
    refs = [reference_logits(model, r, window) for r in rows]
    words = {"prompt": tokenizer.decode(rows[0][:prompt_tokens]),
             "reference": tokenizer.decode(
                 reference_greedy(model, rows[0][:prompt_tokens], gen_tokens, window))}
    logits, gen = _decode(None, window, model, rows, prompt_tokens, gen_tokens)
    out = {"window": window, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
           "correct": _score(logits, refs), "bugs": {}, "words": words}
    words["correct"] = tokenizer.decode(gen)
    for bug in bugs:
        logits, gen = _decode(bug_ring(model, bug), window, model, rows, prompt_tokens,
                              gen_tokens)
        out["bugs"][bug] = {"what": PITFALLS[bug].what, **_score(logits, refs)}
        words[bug] = tokenizer.decode(gen)
    return out
