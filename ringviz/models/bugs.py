"""The classic ring-cache bugs, each run on a real model next to the correct ring.

Every bug is a small ``RingRunner`` variant (or a wrong size for it). ``run_bugs`` decodes the
same text through each buggy ring and the correct one, compares both with the band-mask reference
(reference.py) and lets both generate a few greedy words, so a chapter can show the symptom
(max |dlogit|, first diverging position, the words) and the fix agreeing.

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

import torch

from ringviz.cache import RingKVCache
from ringviz.hf.config import read_layout
from ringviz.models.drive import RingRunner, ring_generate, ring_logits
from ringviz.models.reference import reference_greedy, reference_logits
from ringviz.models.text import eval_tokens
from ringviz.rope import apply_rope

DIVERGENCE_TOL = 1e-2  # |dlogit| above this counts as diverged (float32 ring noise is ~1e-4)


class SlotRopeRunner(RingRunner):
    """Bug: keys rotated at their slot index ``pos % W`` instead of their position ``pos``.

    HF has already rotated ``k`` by ``pos``; rotating by ``slot - pos`` more gives ``R(slot) k``.
    Until the first wrap-around ``slot == pos``, so the bug hides for the first W tokens.
    """

    def attend(self, layer, q, k, v, positions, scale):
        cache = self.caches[layer]
        theta = read_layout(self.model).rope_theta("sliding")
        k_slot = apply_rope(k, positions % cache.window - positions, theta)  # (B, Hkv, T, D)
        return cache.step(q, k_slot, v, positions, scale=scale)


class ChunkFirstRunner(RingRunner):
    """Bug: write the whole chunk, then attend over the ring (executorch #20346).

    A chunk longer than W overwrites keys its own early queries still need.
    """

    def attend(self, layer, q, k, v, positions, scale):
        cache = self.caches[layer]
        cache.write(k, v, positions)
        return cache.attend(q, positions, scale=scale)


class SharedRingRunner(RingRunner):
    """Bug: one ring (batch size 1) serves every batch row in turn, as if rows were requests.

    The ring's own checks would refuse row 1 writing positions row 0 already wrote, so they
    are switched off (``check=False``), as in a trusted hot loop.
    """

    def _stores(self):  # one ring of batch size 1 per layer, whatever the batch
        layout, param = read_layout(self.model), next(self.model.parameters())
        return [RingKVCache(1, layout.num_kv_heads, w, layout.head_dim, dtype=param.dtype,
                            device=param.device) for w in self.windows]

    def attend(self, layer, q, k, v, positions, scale):
        cache = self.caches[layer]
        outs = [cache.step(q[b:b + 1], k[b:b + 1], v[b:b + 1], positions[b:b + 1], scale=scale,
                           check=False) for b in range(q.shape[0])]
        return torch.cat(outs, dim=0)  # (B, Hq, T, D)


BUGS = {  # name -> (what the code does wrong, runner class, ring capacity for window W)
    "slot_rope": ("keys rotated at slot pos % W instead of pos",
                  SlotRopeRunner, lambda w: w),
    "off_by_one": ("ring (and so window) sized W-1 instead of W", RingRunner, lambda w: w - 1),
    "chunk_first": ("chunk longer than W written before attending", ChunkFirstRunner, lambda w: w),
    # spare slots plus a mask that only asks "filled and not in the future" is exactly a ring of
    # window W + W//2: keys older than W (stale) stay visible
    "no_stale_mask": ("spare slots (capacity 1.5 W) not masked by the window", RingRunner,
                      lambda w: w + w // 2),
    "shared_ring": ("two batch rows take turns in one ring", SharedRingRunner, lambda w: w),
}


def first_divergence(ring: torch.Tensor, ref: torch.Tensor, tol: float = DIVERGENCE_TOL) -> int:
    """First position whose max |dlogit| exceeds ``tol``; -1 if none."""
    bad = ((ring - ref).abs().amax(dim=-1) > tol).nonzero()
    return int(bad[0, 0]) if len(bad) else -1


def _score(logits: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    firsts = [first_divergence(a, b) for a, b in zip(logits, refs, strict=True)]
    diverged = [f for f in firsts if f >= 0]
    same = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(logits, refs, strict=True)])
    return {"max_abs_logit_diff": max(float((a - b).abs().max())
                                      for a, b in zip(logits, refs, strict=True)),
            "first_diverging_position": min(diverged) if diverged else -1,
            "first_diverging_row": firsts.index(min(diverged)) if diverged else -1,
            "argmax_agreement": float(same.double().mean())}


def _decode(runner_cls: type[RingRunner], capacity: int, model, rows: list[torch.Tensor],
            prompt_tokens: int, gen_tokens: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Teacher-forced logits of both rows, and row 0's greedy continuation.

    The prompt goes in as one call (``prefill_chunk=prompt_tokens``), as the table above
    describes; chunked prefill would delay chunk_first's symptom to the second chunk.
    """
    total = prompt_tokens + max(len(rows[0]) - prompt_tokens, gen_tokens)
    logits = ring_logits(runner_cls(model, 2, capacity, total), rows, [prompt_tokens] * 2,
                         prefill_chunk=prompt_tokens)
    prompts = [r[:prompt_tokens] for r in rows]
    words = ring_generate(runner_cls(model, 2, capacity, total), prompts, gen_tokens,
                          prefill_chunk=prompt_tokens)[0]
    return logits, words


def run_bugs(model, tokenizer, bugs: tuple[str, ...] = tuple(BUGS), *, window: int = 16,
             prompt_tokens: int = 24, new_tokens: int = 16, gen_tokens: int = 8,
             start: int = 120) -> dict:
    """Run bugs and the correct ring on ``model`` (Llama-style: window imposed on all layers).

    Two rows of the evaluation text (from token ``start``; the second 7 tokens later) are
    prefilled with ``prompt_tokens`` tokens and decoded ``new_tokens`` more, teacher-forced,
    against the band-mask reference; each runner then greedily continues row 0's prompt by
    ``gen_tokens`` tokens. Returns ``{"correct": ..., "bugs": {name: ...}, "words": ...}``.
    """
    unknown = [b for b in bugs if b not in BUGS]
    if unknown or window < 4:
        raise ValueError(f"bugs must come from {sorted(BUGS)} (got {unknown}) and window >= 4 "
                         f"(got {window})")
    ids = eval_tokens(tokenizer, start + 7 + prompt_tokens + new_tokens, device=model.device)
    rows = [ids[start:start + prompt_tokens + new_tokens], ids[start + 7:]]
    refs = [reference_logits(model, r, window) for r in rows]
    words = {"prompt": tokenizer.decode(rows[0][:prompt_tokens]),
             "reference": tokenizer.decode(
                 reference_greedy(model, rows[0][:prompt_tokens], gen_tokens, window))}
    logits, gen = _decode(RingRunner, window, model, rows, prompt_tokens, gen_tokens)
    out = {"window": window, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
           "correct": _score(logits, refs), "bugs": {}, "words": words}
    words["correct"] = tokenizer.decode(gen)
    for bug in bugs:
        what, cls, capacity = BUGS[bug]
        logits, gen = _decode(cls, capacity(window), model, rows, prompt_tokens, gen_tokens)
        out["bugs"][bug] = {"what": what, **_score(logits, refs)}
        words[bug] = tokenizer.decode(gen)
    return out
