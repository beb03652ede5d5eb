"""Generate features users reach for, and inputs that must be refused up front (issue 34, items 4
and 6): classifier-free guidance served as Hugging Face serves it, ``position_ids`` that agree
with the mask accepted (refused with the reason otherwise), a cache a refused call could not use
still usable; bad masks and chunk sizes refused before anything changes; the cache sink
convention refused before any probe forward for RoPEs it cannot turn, and served through an
attention that passes no extra arguments on (StableLM).

Each test fails on dab2ed4 (there guidance failed late and left the cache refused, any
``position_ids`` were refused, 2s in a mask were served 0.40 away, the other bad inputs ended in
torch errors, StableLM raised ``KeyError: 'rope_probe'``, and the five families below were
refused only after two probe forwards).
"""

from __future__ import annotations

import copy

import pytest
import torch

from ringviz import hf
from tests.ring_state import hf_state
from tests.tiny_models import prompt, run, tiny_family, tiny_gemma

EXACT = 1e-10


@pytest.fixture(scope="module")
def model():
    return tiny_gemma()


def same_run(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores, strict=True):
        assert torch.allclose(x, y, atol=EXACT, rtol=0)


# ------------------------------------------------------------ classifier-free guidance
def test_classifier_free_guidance_is_hugging_face_s(model):
    """HF's guidance processor runs the model's unconditional pass itself (its own cache):
    that pass is HF's own, the conditional one the ring's; together, HF's guided tokens."""
    ids = prompt(12)
    same_run(run(hf.generate, model, ids, max_new_tokens=8, guidance_scale=1.5),
             run(None, model, ids, max_new_tokens=8, guidance_scale=1.5))


def test_guidance_on_a_conversation_s_cache(model):
    """The issue's case: guidance on the cache a conversation passes back (it failed late,
    "attention_mask must cover every token so far", and left the cache refused for good)."""
    cache = hf.RingCache(model)
    first = hf.generate(model, prompt(9), cache=cache, max_new_tokens=4, do_sample=False,
                        pad_token_id=0)
    ids = torch.cat([first, prompt(5, seed=2)], dim=1)
    same_run(run(hf.generate, model, ids, cache=cache, max_new_tokens=6, guidance_scale=1.5),
             run(None, model, ids, max_new_tokens=6, guidance_scale=1.5))
    assert cache.refused is None


# ------------------------------------------------------------------- position_ids
def hf_positions(mask: torch.Tensor) -> torch.Tensor:
    """What Hugging Face's generate infers from a 2D mask (padding at 0)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def test_position_ids_that_agree_with_the_mask_are_served(model):
    ids = prompt(10, batch=2)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # row 1 left-padded
    ring = run(hf.generate, model, ids, attention_mask=mask, max_new_tokens=5)
    same_run(run(hf.generate, model, ids, attention_mask=mask, max_new_tokens=5,
                 position_ids=hf_positions(mask)), ring)
    same_run(run(None, model, ids, attention_mask=mask, max_new_tokens=5,
                 position_ids=hf_positions(mask)), ring)
    same_run(run(hf.generate, model, ids[:1], max_new_tokens=5,  # no mask: 0..L-1
                 position_ids=torch.arange(10)[None]),
             run(hf.generate, model, ids[:1], max_new_tokens=5))


@pytest.mark.parametrize(("position_ids", "error", "match"), [
    (torch.arange(10)[None] + 3, ValueError, "row 0, column 0: 3, but .* number 0"),
    (torch.arange(10).flip(0)[None], ValueError, "disagree with attention_mask"),
    (torch.arange(9)[None], ValueError, r"must be \(B, L\) = \(1, 10\)"),
    (torch.arange(10.0)[None], TypeError, "integer"),
    ([list(range(10))], TypeError, "integer torch.Tensor"),
])
def test_position_ids_that_disagree_are_refused_with_the_reason(model, position_ids, error,
                                                                 match):
    cache = hf.RingCache(model)
    before = hf_state(model, cache)
    with pytest.raises(error, match=match):
        hf.generate(model, prompt(10), cache=cache, max_new_tokens=2,
                    position_ids=position_ids)
    assert hf_state(model, cache) == before


# -------------------------------------------------------- refused up front, nothing changes
def bad_calls(L: int) -> list[tuple[dict, type, str]]:
    """Calls over ``L`` columns refused before the first forward: (kwargs, error, match)."""
    return [
        ({"attention_mask": torch.tensor([[1] * (L - 3) + [2] * 3])}, ValueError,
         r"only 0 .* got \[2\]"),
        ({"attention_mask": torch.tensor([[1.0] * (L - 1) + [0.5]])}, ValueError,
         r"got \[0\.5\]"),
        ({"attention_mask": [[1] * L]}, TypeError, "attention_mask must be a torch.Tensor"),
        ({"prefill_chunk_size": 0}, ValueError, "prefill_chunk_size must be >= 1"),
        ({"prefill_chunk_size": -1}, ValueError, "prefill_chunk_size must be >= 1"),
        ({"prefill_chunk_size": 1.5}, TypeError, "prefill_chunk_size must be an int"),
        ({"position_ids": torch.arange(L)[None] + 1}, ValueError, "position_ids disagree"),
    ]


@pytest.mark.parametrize("case", range(len(bad_calls(14))))
def test_bad_inputs_are_refused_and_change_nothing(model, case):
    kwargs, error, match = bad_calls(14)[case]
    cache = hf.RingCache(model)
    before = hf_state(model, cache)
    with pytest.raises(error, match=match):
        hf.generate(model, prompt(14), cache=cache, max_new_tokens=2, **kwargs)
    assert hf_state(model, cache) == before


def test_a_conversation_s_cache_survives_calls_refused_before_any_write(model):
    """Every refusal above, on a cache that holds a conversation: it goes on exactly as a twin
    that never saw them."""
    cache = hf.RingCache(model)
    ids = hf.generate(model, prompt(9), cache=cache, max_new_tokens=5, do_sample=False,
                      pad_token_id=0)
    twin = copy.deepcopy(cache)
    more = torch.cat([ids, prompt(5, seed=3)], dim=1)
    for kwargs, error, match in bad_calls(more.shape[1]):
        with pytest.raises(error, match=match):
            hf.generate(model, more, cache=cache, max_new_tokens=3, **kwargs)
    same_run(run(hf.generate, model, more, cache=cache, max_new_tokens=4),
             run(hf.generate, model, more, cache=twin, max_new_tokens=4))


# ---------------------------------------------------------- the cache sink convention
class Forwards:
    """Counts the model's forwards (a pre-hook on the whole model)."""

    def __init__(self, model) -> None:
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self.count)

    def count(self, module, args):
        self.calls += 1


@pytest.mark.parametrize(("family", "window"), [
    ("cohere", 4), ("cohere2", None), ("cohere2_moe", None), ("phi", 4), ("gpt_neox", 4),
    ("stablelm", 4),  # partial rotary by default (partial_rotary_factor=0.25)
])
def test_a_rope_the_cache_convention_cannot_turn_is_refused_before_any_forward(family, window):
    model = tiny_family(family, layers=2)
    forwards = Forwards(model)
    with pytest.raises(ValueError, match="sink_convention='cache' cannot (turn|check)"):
        hf.RingCache(model, window=window, sinks=2, sink_convention="cache")
    with pytest.raises(ValueError, match="sink_convention='cache' cannot (turn|check)"):
        hf.generate(model, prompt(8), window=window, sinks=2, sink_convention="cache",
                    max_new_tokens=2)
    assert forwards.calls == 0
    forwards.handle.remove()
    assert model.config._attn_implementation == "sdpa"


def test_stablelm_with_the_cache_convention_is_served():
    """StableLM's attention passes no extra arguments on: the RoPE probe no longer needs any
    (it was ``KeyError: 'rope_probe'``). With the window beyond the run no key is turned, so
    the ring is Hugging Face's own generate."""
    model = tiny_family("stablelm", layers=2, partial_rotary_factor=1.0)
    cache = hf.RingCache(model, window=64, sinks=2, sink_convention="cache")
    assert all(layer.sink_rope is not None for layer in cache.layers)
    same_run(run(hf.generate, model, prompt(10), cache=cache, max_new_tokens=5),
             run(None, model, prompt(10), max_new_tokens=5))


# -------------------------------------------------------------------- output_attentions
ATTENTION = 1e-6  # both take the softmax in float32 (Hugging Face's eager attention does)


def weights_run(fn, model, ids, **kwargs):
    return run(fn, model, ids, output_attentions=True, **kwargs)


def same_weights(ours, theirs, real: torch.Tensor | None = None) -> None:
    """Every step's every layer: HF's shape, and the same weights for each real query
    (``real`` (B, T0): the prompt's real tokens; a padding query's row is HF's garbage)."""
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.attentions) == len(theirs.attentions)
    for step, (a, b) in enumerate(zip(ours.attentions, theirs.attentions, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert x.shape == y.shape
            if step == 0 and real is not None:
                rows = real[:, -x.shape[2]:].bool()[:, None, :, None].expand_as(x)
                x, y = x[rows], y[rows]
            assert torch.allclose(x, y, atol=ATTENTION, rtol=0)


@pytest.fixture(scope="module")
def eager():
    """A tiny Gemma 3 on Hugging Face's eager attention (SDPA returns no weights)."""
    model = tiny_gemma()
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("chunk", [None, 4])
def test_output_attentions_are_hugging_face_s(eager, chunk):
    """Sliding layers' weights over the W - 1 kept keys and the new ones, the full layer's over
    every column, in temporal order, past the window and through a chunked prefill."""
    kwargs = {"max_new_tokens": 8} | ({"prefill_chunk_size": chunk} if chunk else {})
    same_weights(weights_run(hf.generate, eager, prompt(11), **kwargs),
                 weights_run(None, eager, prompt(11), **kwargs))


def test_output_attentions_of_a_left_padded_batch(eager):
    """A left-padded row's keys are Hugging Face's columns, padding included: its weights are
    those of the row run alone (HF's eager), after zeros for the padding columns. (Hugging
    Face's eager attention itself turns a left-padded row's logits into NaN, so the padded
    batch is checked row by row.)"""
    ids, mask = prompt(10, batch=2), torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    ours = weights_run(hf.generate, eager, ids, attention_mask=mask, max_new_tokens=6)
    alone = weights_run(None, eager, ids[1:, 4:], max_new_tokens=6)
    assert torch.equal(ours.sequences[1:, 4:], alone.sequences)
    for step, (a, b) in enumerate(zip(ours.attentions, alone.attentions, strict=True)):
        for x, y in zip(a, b, strict=True):
            x = x[1:, :, 4:] if step == 0 else x[1:]  # the row's real queries
            pad = x.shape[-1] - y.shape[-1]  # the padding columns HF's keys still hold
            assert pad in (0, 4)  # a sliding layer past its window holds no padding column
            assert torch.equal(x[..., :pad], torch.zeros_like(x[..., :pad]))
            assert torch.allclose(x[..., pad:], y, atol=ATTENTION, rtol=0)


def test_output_attentions_of_a_conversation_s_second_turn(eager):
    """A second call's prefill into rings that hold the first: the chunk's keys after the kept
    ones, as Hugging Face's own cache passed back gives them."""
    from transformers import DynamicCache

    ring, theirs = hf.RingCache(eager), DynamicCache(config=eager.config)
    first = run(hf.generate, eager, prompt(9), cache=ring, max_new_tokens=4).sequences
    run(None, eager, prompt(9), cache=theirs, max_new_tokens=4)
    ids = torch.cat([first, prompt(5, seed=2)], dim=1)
    same_weights(weights_run(hf.generate, eager, ids, cache=ring, max_new_tokens=5),
                 weights_run(None, eager, ids, cache=theirs, max_new_tokens=5))


def test_output_attentions_with_sinks_is_refused_before_anything_runs(eager):
    """Hugging Face's keys have no place for sink keys: refused, the cache untouched."""
    cache = hf.RingCache(eager, sinks=2)
    before = hf_state(eager, cache)
    with pytest.raises(ValueError, match="output_attentions is not served with sinks"):
        weights_run(hf.generate, eager, prompt(8), cache=cache, max_new_tokens=2)
    assert hf_state(eager, cache) == before


@pytest.mark.parametrize(("index", "error", "match"), [
    (torch.tensor([0, 2]), ValueError, r"row index \[2\] is outside the cache's 2 rows"),
    (torch.tensor([-1, 0]), ValueError, "outside the cache's 2 rows"),
    (torch.tensor([0.0, 1.0]), TypeError, "integer"),
])
def test_an_out_of_range_reorder_index_is_refused_and_changes_nothing(model, index, error,
                                                                      match):
    cache = hf.RingCache(model)
    hf.generate(model, prompt(9, batch=2), cache=cache, max_new_tokens=2, do_sample=False,
                pad_token_id=0)
    twin = copy.deepcopy(cache)
    with pytest.raises(error, match=match):
        cache.reorder_cache(index)
    for a, b in zip(cache.layers, twin.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
