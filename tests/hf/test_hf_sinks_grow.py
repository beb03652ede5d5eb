"""Sinks grow with their tokens, as the window does: a ring that has seen ``n`` tokens holds at
most ``n`` sink slots, so ``sinks=10**6`` on a short prompt costs what no sinks cost, and the
results are those of a ring allocated whole from the first token (bit for bit)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import max_score_diff, prompt, ring_bytes, run, tiny_gemma  # noqa: E402

from ringviz import hf  # noqa: E402


def test_huge_sinks_on_a_short_prompt_hold_what_no_sinks_hold():
    """The issue's case: 5 tokens, sinks=10**6 held 272 MB against 2,800 bytes without sinks."""
    model = tiny_gemma(dtype=torch.float32)
    held, caches = {}, {}
    for sinks in (0, 10**6):
        cache = caches[sinks] = hf.RingCache(model, sinks=sinks)
        hf.generate(model, prompt(5), cache=cache, max_new_tokens=1, do_sample=False)
        held[sinks] = ring_bytes(cache)
    assert held[0] > 0 and held[10**6] <= 2 * held[0]
    assert {layer.sinks_held for layer in caches[10**6].layers if layer.is_sliding} == {5}


@pytest.mark.parametrize("convention", ["absolute", "cache"])
def test_sinks_that_grew_equal_sinks_allocated_whole(convention):
    """Sinks larger than the prompt, grown token by token (past the sinks, then the window):
    the same tokens and scores as a ring holding every sink slot from the first token, on a
    left-padded batch."""
    model = tiny_gemma()
    ids = prompt(3, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :1] = 0
    runs, slots = [], []
    for whole in (False, True):
        cache = hf.RingCache(model, sinks=5, sink_convention=convention)
        if whole:
            cache.fit_full()
        runs.append(run(hf.generate, model, ids, cache=cache, attention_mask=mask,
                        max_new_tokens=16))
        slots.append({(layer.sinks_held, layer.slots) for layer in cache.layers
                      if layer.is_sliding})
    assert slots == [{(5, 6)}, {(5, 6)}]  # both whole by the end: 3 + 16 > 5 sinks + 6
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert max_score_diff(runs[0], runs[1]) == 0.0


def test_sinks_grow_one_token_at_a_time_while_the_tokens_fit_them():
    model = tiny_gemma(dtype=torch.float32)
    cache = hf.RingCache(model, sinks=100)
    ids, sizes = prompt(8), []
    for n in range(4, 9):  # a conversation: each call adds a token (its last one is not fed)
        hf.generate(model, ids[:, :n], cache=cache, max_new_tokens=1, do_sample=False)
        sizes.append(cache.layers[0].sinks_held)
    assert sizes == [4, 5, 6, 7, 8]
