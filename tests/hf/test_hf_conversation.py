"""ringviz.hf in real use: conversations, settings given once, copies, every input path, memory.

Tiny random float64 models (``test_hf``'s). A conversation passes the returned cache back with the
whole conversation as ``input_ids`` (Hugging Face's multi-turn convention); each turn must equal
a fresh run over the whole conversation: HF's own generate for native windows, the band-mask
recompute for imposed ones, a fresh ring for sinks (which HF does not have).
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ring_state import hf_state  # noqa: E402
from tiny_models import (  # noqa: E402
    F64,
    VOCAB,
    max_score_diff,
    prompt,
    ring_bytes,
    run,
    tiny_gemma,
    tiny_llama,
    tiny_mistral,
)

from ringviz import hf  # noqa: E402
from ringviz.models.reference import reference_logits  # noqa: E402


def extend(sequences: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """The conversation so far plus a user turn of ``n`` random tokens (never the pad, 0)."""
    turn = 1 + prompt(n, batch=sequences.shape[0], seed=seed) % (VOCAB - 1)
    return torch.cat([sequences, turn], dim=1)


# ------------------------------------------------------------------------- conversations
@pytest.mark.parametrize("make", [tiny_gemma, tiny_mistral])
def test_conversation_continues_the_returned_cache_like_a_fresh_hf_generate(make):
    """Three turns; turn 2's user text is longer than the window, turn 3's one token."""
    model = make()
    W = model.config.sliding_window
    ids, cache = prompt(2 * W + 1), None
    for turn, (user, new) in enumerate(((0, 2 * W), (3 * W, W), (1, 3 * W))):
        if turn:
            ids = extend(ids, user, seed=turn)
        ref = run(None, model, ids, max_new_tokens=new)
        kwargs = {} if cache is None else {"cache": cache}
        out = run(hf.generate, model, ids, max_new_tokens=new, prefill_chunk_size=4, **kwargs)
        assert torch.equal(out.sequences, ref.sequences)
        assert max_score_diff(out, ref) < F64
        assert cache is None or out.cache is cache
        cache, ids = out.cache, out.sequences
        assert cache.get_seq_length() == ids.shape[1] - 1  # the last token is fed next turn


def test_conversation_prefills_only_the_new_tokens(monkeypatch):
    model = tiny_mistral()
    out = run(hf.generate, model, prompt(9), max_new_tokens=4)
    queries = []
    real = hf.RingCache.attend

    def spy(self, layer_idx, query, *args, **kwargs):
        queries.append(query.shape[2])
        return real(self, layer_idx, query, *args, **kwargs)

    monkeypatch.setattr(hf.RingCache, "attend", spy)
    ids = extend(out.sequences, 6, seed=1)
    run(hf.generate, model, ids, cache=out.cache, max_new_tokens=1)
    assert set(queries) == {7}  # the last answer token and the 6 new ones, in every layer


def test_left_padded_batch_conversation_matches_hf():
    model = tiny_gemma()
    ids = prompt(10, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # 10 and 3 real tokens (W = 6)
    ids = ids.masked_fill(mask == 0, 0)
    out = run(hf.generate, model, ids, attention_mask=mask, max_new_tokens=8)
    ids2 = extend(out.sequences, 9, seed=3)
    mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    ref = run(None, model, ids2, attention_mask=mask2, max_new_tokens=10)
    got = run(hf.generate, model, ids2, attention_mask=mask2, cache=out.cache,
              max_new_tokens=10, prefill_chunk_size=4)
    assert torch.equal(got.sequences, ref.sequences)
    assert max_score_diff(got, ref) < F64


def test_imposed_window_conversation_matches_band_mask_recompute():
    model, W = tiny_llama(), 4
    out = run(hf.generate, model, prompt(7), window=W, max_new_tokens=5)
    ids = extend(out.sequences, 9, seed=2)
    got = run(hf.generate, model, ids, cache=out.cache, max_new_tokens=12, prefill_chunk_size=3)
    with torch.no_grad():
        ref = reference_logits(model, got.sequences[0], W)
    scores = torch.stack(got.scores)[:, 0]
    assert (scores - ref[ids.shape[1] - 1:-1]).abs().max() < F64


def test_sinks_conversation_runs_in_fixed_memory_and_equals_a_fresh_ring():
    """Sinks on the sliding layers: five turns, ring bytes the same after each; the last turn
    equals one fresh ring run over the whole conversation."""
    model = tiny_gemma()
    cache = hf.RingCache(model, sinks=2, sink_convention="cache")
    ids, sizes = prompt(8), []
    for turn in range(5):
        out = run(hf.generate, model, ids, cache=cache, max_new_tokens=7)
        sizes.append(ring_bytes(cache))
        ids = extend(out.sequences, 5, seed=turn)
    assert len(set(sizes)) == 1 and cache.get_seq_length() > 5 * model.config.sliding_window
    last = run(hf.generate, model, ids, cache=cache, max_new_tokens=6)
    fresh = run(hf.generate, model, ids, sinks=2, sink_convention="cache", max_new_tokens=6)
    assert torch.equal(last.sequences, fresh.sequences)
    assert max_score_diff(last, fresh) < F64


def test_settings_given_once_at_construction_serve_every_call():
    model = tiny_gemma()
    cache = hf.RingCache(model, sinks=2, sink_convention="cache")
    out = run(hf.generate, model, prompt(9), cache=cache, max_new_tokens=4)  # no sinks= again
    fresh = run(hf.generate, model, prompt(9), sinks=2, sink_convention="cache", max_new_tokens=4)
    assert torch.equal(out.sequences, fresh.sequences)
    again = run(hf.generate, model, prompt(9), cache=hf.RingCache(model, sinks=2,
                sink_convention="cache"), sinks=2, max_new_tokens=4)  # repeating the same: fine
    assert torch.equal(again.sequences, fresh.sequences)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sinks": 3}, "sinks=3 differs"),
    ({"sinks": 1}, "sinks=1 differs"),
    ({"sink_convention": "absolute"}, "sink_convention='absolute' differs"),
    ({"window": 4}, "window=4 differs"),
])
def test_conflicting_settings_raise_and_change_nothing(kwargs, match):
    model = tiny_gemma()
    cache = hf.RingCache(model, sinks=2, sink_convention="cache")
    run(hf.generate, model, prompt(9), cache=cache, max_new_tokens=2)
    before = hf_state(model, cache)
    with pytest.raises(ValueError, match=match):
        hf.generate(model, extend(prompt(10), 2, 0), cache=cache, max_new_tokens=2, **kwargs)
    assert hf_state(model, cache) == before


@pytest.mark.parametrize("case", ["shorter", "batch", "padding lost"])
def test_a_call_that_does_not_continue_the_cache_raises_and_changes_nothing(case):
    model = tiny_gemma()
    ids = prompt(10, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = run(hf.generate, model, ids.masked_fill(mask == 0, 0), attention_mask=mask,
              max_new_tokens=3)
    seq = out.sequences  # 13 columns, 12 in the cache
    call, match = {
        "shorter": ({"input_ids": seq[:, :12]}, "longer than that"),
        "batch": ({"input_ids": seq[:1]}, "holds 2 rows"),
        "padding lost": ({"input_ids": extend(seq, 2, 0).clamp_min(1)}, "attention_mask"),
    }[case]
    before = hf_state(model, out.cache)
    with pytest.raises(ValueError, match=match):
        hf.generate(model, cache=out.cache, max_new_tokens=2, pad_token_id=0, **call)
    assert hf_state(model, out.cache) == before


# ------------------------------------------------------------------------- copies
def test_deepcopy_of_a_prompt_cache_gives_independent_continuations():
    model = tiny_gemma()
    system = prompt(15)
    prompt_cache = run(hf.generate, model, system, max_new_tokens=1).cache  # holds the 15
    empty = copy.deepcopy(hf.RingCache(model))
    for seed, cache in ((1, copy.deepcopy(prompt_cache)), (2, copy.deepcopy(prompt_cache)),
                        (3, empty)):
        ids = extend(system, 4 + seed, seed)
        ref = run(None, model, ids, max_new_tokens=9)
        out = run(hf.generate, model, ids, cache=cache, max_new_tokens=9)
        assert torch.equal(out.sequences, ref.sequences)
        assert max_score_diff(out, ref) < F64
    assert prompt_cache.get_seq_length() == 15  # the copies' writes never reached it
    copied = copy.deepcopy(prompt_cache)
    assert copied.config is model.config
    assert copied.layers[0].ring.k.data_ptr() != prompt_cache.layers[0].ring.k.data_ptr()
    assert copied.layers[0].keys.data_ptr() == copied.layers[0].ring.k.data_ptr()  # still views


# ------------------------------------------------------------------------- input paths
def test_a_hole_in_attention_mask_is_refused_before_anything_runs():
    model = tiny_gemma()
    ids = prompt(12, batch=2)
    mask = torch.ones_like(ids)
    mask[1, 4:6] = 0  # a hole: HF's window would count its columns, the ring does not
    cache = hf.RingCache(model)
    before = hf_state(model, cache)
    with pytest.raises(ValueError, match="attention_mask"):
        hf.generate(model, ids, attention_mask=mask, cache=cache, max_new_tokens=3)
    assert hf_state(model, cache) == before
    ids[1, 4:6] = 0  # the same hole inferred from pad tokens in input_ids
    with pytest.raises(ValueError, match="attention_mask"):
        hf.generate(model, ids, cache=cache, max_new_tokens=3, pad_token_id=0)


def test_inputs_embeds_alone_matches_hf():
    model = tiny_gemma()
    W = model.config.sliding_window
    embeds = model.get_input_embeddings()(prompt(3 * W))
    ref = model.generate(inputs_embeds=embeds, max_new_tokens=2 * W, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    out = hf.generate(model, inputs_embeds=embeds, max_new_tokens=2 * W, do_sample=False,
                      output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_score_diff(out, ref) < F64
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        hf.generate(model, inputs_embeds=embeds, max_new_tokens=2, prefill_chunk_size=4)


# ------------------------------------------------------------------------- memory
def test_full_layers_grow_with_tokens_that_arrive_not_max_new_tokens():
    """max_new_tokens=2_000_000 but EOS after 5 tokens: the full layer holds what came."""
    model = tiny_gemma()
    ids = prompt(10)
    first = run(hf.generate, model, ids, max_new_tokens=5).sequences[0, -1]
    out = run(hf.generate, model, ids, max_new_tokens=2_000_000, eos_token_id=int(first))
    assert out.sequences.shape[1] <= 15
    full = out.cache.layers[1]
    assert isinstance(full, hf.FullLayer) and full.allocated < 32
