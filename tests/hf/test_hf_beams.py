"""ringviz.hf with beams: reorder, repeat and select the ring's rows, as HF's caches do.

Beam search gathers cache rows on the batch axis (``reorder_cache``) and never crops, so a ring
serves it exactly: tiny random float64 models, against Hugging Face's own beam search.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import F64, prompt, tiny_gemma, tiny_mistral  # noqa: E402

from ringviz import hf  # noqa: E402


def beams(fn, model, ids, **kwargs):
    kwargs = {"num_beams": 3, "max_new_tokens": 24, "output_scores": True,
              "return_dict_in_generate": True, "pad_token_id": 0, "early_stopping": True,
              **kwargs}
    return fn(model, ids, **kwargs) if fn is hf.generate else model.generate(ids, **kwargs)


@pytest.mark.parametrize("make", [tiny_gemma, tiny_mistral])
@pytest.mark.parametrize("extra", [{}, {"num_return_sequences": 2}, {"length_penalty": 0.0}])
def test_beam_search_matches_hf(make, extra):
    model = make()
    ids = prompt(2 * model.config.sliding_window + 3)
    ref = beams(None, model, ids, **extra)
    out = beams(hf.generate, model, ids, prefill_chunk_size=4, **extra)
    assert torch.equal(out.sequences, ref.sequences)
    assert (out.sequences_scores - ref.sequences_scores).abs().max() < F64


def test_beam_search_left_padded_batch_matches_hf():
    model = tiny_gemma()
    ids = prompt(11, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref = beams(None, model, ids, attention_mask=mask, num_return_sequences=3)
    out = beams(hf.generate, model, ids, attention_mask=mask, num_return_sequences=3)
    assert torch.equal(out.sequences, ref.sequences)
    assert (out.sequences_scores - ref.sequences_scores).abs().max() < F64


def test_beam_sampling_same_seed_matches_hf():
    model = tiny_mistral()
    ids = prompt(13)
    kwargs = {"do_sample": True, "top_k": 30, "num_return_sequences": 2}
    torch.manual_seed(5)
    ref = beams(None, model, ids, **kwargs)
    torch.manual_seed(5)
    out = beams(hf.generate, model, ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert (out.sequences_scores - ref.sequences_scores).abs().max() < F64


def test_beam_search_with_sinks_keeps_ring_bytes_fixed():
    model = tiny_gemma()
    cache = hf.RingCache(model, sinks=2)
    beams(hf.generate, model, prompt(9), cache=cache, max_new_tokens=4)
    size = cache.nbytes - sum(layer.nbytes for layer in cache.layers
                              if isinstance(layer, hf.FullLayer))
    assert cache.layers[0].ring.batch_size == 3
    assert size == 2 * cache.layers[0].ring.nbytes


def _next_logits(model, cache, tokens):
    with torch.no_grad(), hf.ring_active(model, cache):
        return model(input_ids=tokens, cache=cache).logits[:, -1]


@pytest.mark.parametrize("op", ["repeat", "select", "select_mask", "reorder"])
def test_row_operations_equal_a_cache_built_on_those_rows(op):
    """Each op on a prefilled cache, then one decode step: the same logits as a cache that
    was prefilled on the rows the op names (ring, full layer, sinks)."""
    model = tiny_gemma()
    ids = prompt(15, batch=3)
    rows = {"repeat": torch.tensor([0, 0, 1, 1, 2, 2]), "select": torch.tensor([2, 0]),
            "select_mask": torch.tensor([0, 2]), "reorder": torch.tensor([2, 2, 0])}[op]
    cache = hf.RingCache(model, sinks=1)
    _next_logits(model, cache, ids)
    if op == "repeat":
        cache.batch_repeat_interleave(2)
    elif op == "select":
        cache.batch_select_indices(rows)
    elif op == "select_mask":
        cache.batch_select_indices(torch.tensor([True, False, True]))
    else:
        cache.reorder_cache(rows)
    fresh = hf.RingCache(model, sinks=1)
    _next_logits(model, fresh, ids[rows])
    tokens = prompt(1, batch=len(rows), seed=9)
    assert (_next_logits(model, cache, tokens) - _next_logits(model, fresh, tokens)).abs().max() \
        < F64
    ring = cache.layers[0].ring
    assert ring.batch_size == len(rows) and cache.layers[0].keys is ring.k


def test_reorder_keeps_the_storage_in_place():
    model = tiny_gemma()
    cache = hf.RingCache(model)
    _next_logits(model, cache, prompt(8, batch=2))
    before = [cache.layers[0].ring.k.data_ptr(), cache.layers[1]._k_store.data_ptr()]
    cache.reorder_cache(torch.tensor([1, 0]))
    assert before == [cache.layers[0].ring.k.data_ptr(), cache.layers[1]._k_store.data_ptr()]
