"""Where a decode step's time goes: the masked step against the full ring's unmasked one.

``bench="decode_profile"`` rows split one ``RingKVCache`` decode step on a full ring into its
stages and time each, for the two paths:

* ``masked`` (every step on a ring not known to be full): validation (shapes, then every
  position after its row's newest, one host sync), the guarded write (padding to the spare
  slot, the newest kept by ``maximum``), the mask from stored positions, masked attention (SDPA
  with a boolean mask, then the rows that see nothing zeroed);
* ``unmasked`` (:attr:`ringviz.RingKVCache.window_full`): validation that reads the positions
  once with ``tolist`` (the one host sync; the rows' newest with them if the host does not
  already hold those) and finds each its row's newest + 1
  (``RingKVCache._look``), the write of every row's next slot, SDPA with no mask.

A stage's time is the difference between two cumulative runs (the stages before it, then one
more), all timed in the same interleaved blocks as the other benches, with ``attention_only``
beside them; ``loop`` is the decode loop's own ``pos += 1``. The ``masked`` path is written out
here from the cache's own pieces (the cache takes it whenever it cannot know the ring is full);
``tests/bench/test_bench.py`` checks it returns the step's output and state bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringviz.bench.cases import Prefill, Shape, Token, _full_ring, decode_step
from ringviz.bench.harness import Case, measure_interleaved
from ringviz.cache import RingKVCache, Rows
from ringviz.checks import check_positions

STAGES = {"masked": ("loop", "validation", "write", "mask", "attention"),
          "unmasked": ("loop", "validation", "write", "attention")}


def masked_step(cache: RingKVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pos: torch.Tensor, upto: str = "attention") -> torch.Tensor | None:
    """The masked decode step, stage by stage up to ``upto`` (validation .. attention)."""
    cache._check_q(q, 1)
    check_positions(pos, cache._last_pos, 1)  # the general check: one host sync
    if upto == "validation":
        return None
    cache._write(k, v, pos, Rows([0] * cache.batch_size, None), False)  # the guarded write
    if upto == "write":
        return None
    mask = cache._decode_mask(pos)
    if upto == "mask":
        return None
    return cache.attend_keys(q, pos, cache.k, cache.v, mask, None)


def unmasked_step(cache: RingKVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  pos: torch.Tensor, upto: str = "attention") -> torch.Tensor | None:
    """The full ring's step up to ``upto``; ``"attention"`` is :meth:`RingKVCache.step`."""
    if upto == "attention":
        return cache.step(q, k, v, pos)
    rows, nxt = cache._check_call(k, v, pos, check=True, contiguous=False, q=q)
    if upto == "write":
        cache._write(k, v, pos, rows, nxt)
    return None


def _prefix(path: str, upto: str, shape: Shape, window: int, pre: Prefill,
            tok: Token) -> Callable[[], object]:
    """One call of ``path``'s stages up to ``upto``, on a full ring of its own."""
    ring, pos = _full_ring(shape, window, pre)
    if upto == "loop":
        return lambda: pos.add_(1)
    run = masked_step if path == "masked" else unmasked_step
    if upto == "validation":  # nothing written: the position stays every row's next
        pos.add_(1)
        return lambda: run(ring, tok.q, tok.k, tok.v, pos, "validation")

    def call() -> object:
        pos.add_(1)
        return run(ring, tok.q, tok.k, tok.v, pos, upto)

    return call


def profile_rows(shape: Shape, window: int, pre: Prefill, tok: Token, *, reps: int,
                 warmup: int, min_sample_s: float) -> list[dict]:
    """Rows ``bench="decode_profile"``: per path and stage, its median us (a difference of
    cumulative medians), and the cumulative runs themselves; ``attention_only`` beside."""
    cases = [Case(f"{path}:{upto}", window, _prefix(path, upto, shape, window, pre, tok))
             for path, stages in STAGES.items() for upto in stages]
    cases.append(Case("attention_only", window,
                      decode_step("attention_only", shape, window, pre, tok)))
    t = measure_interleaved(cases, reps=reps, warmup=warmup, min_sample_s=min_sample_s,
                            device=shape.device)
    base = {"bench": "decode_profile", "window": window, **shape.fields(),
            "threads": torch.get_num_threads()}
    att = t[("attention_only", window)]
    rows = [{**base, "impl": "attention_only", "stage": "attention", "stage_us": att.median_us,
             **att.as_row()}]
    for path, stages in STAGES.items():
        before = 0.0  # cumulative time of the stages so far
        for upto in stages:
            timing = t[(f"{path}:{upto}", window)]
            # loop and validation are timed alone; each later prefix runs all stages before it
            alone = upto in ("loop", "validation")
            stage_us = timing.median_us if alone else timing.median_us - before
            before = before + stage_us
            rows.append({**base, "impl": path, "stage": upto, "stage_us": stage_us,
                         **timing.as_row()})
    return rows
