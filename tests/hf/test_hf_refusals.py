"""ringviz.hf never silently wrong: what a ring cannot serve is refused before anything runs,
and KV-shared layers (Gemma 3n, Gemma 4) work, with and without sinks.

Tiny random float64 models from configs.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ring_state import hf_state  # noqa: E402
from tiny_models import F64, VOCAB, max_score_diff, prompt, run, tiny_gemma, tiny_mistral  # noqa: E402

from ringviz import hf  # noqa: E402
from ringviz.hf import attention  # noqa: E402
from ringviz.models.reference import reference_logits  # noqa: E402


def tiny(model_cls, config_cls, **kwargs):
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, attn_implementation="sdpa", **kwargs)
    return model_cls(config).to(torch.float64).eval()


# ------------------------------------------------------------------------- model features
def test_a_learned_per_head_mask_is_refused_when_the_cache_is_built():
    """Doge adds a learned bias per head to the mask; the ring used head 0's for every head."""
    model = tiny(transformers.DogeForCausalLM, transformers.DogeConfig, sliding_window=5)
    with pytest.raises(ValueError, match="per-head attention mask"):
        hf.RingCache(model)
    with pytest.raises(ValueError, match="per-head"):
        hf.generate(model, prompt(8), max_new_tokens=2)


def test_a_changed_mask_reaching_the_attention_raises_never_serves():
    """The safety net behind the up-front check: a float or per-head mask is never applied."""
    q = torch.zeros(1, 4, 2, 8)
    for mask in (torch.zeros(1, 4, 2, 3, dtype=torch.bool), torch.zeros(1, 1, 2, 3)):
        with pytest.raises(ValueError, match="per-head mask"):
            attention.ring_attention(torch.nn.Module(), q, q[:, :1, :1].expand(1, 1, 3, 8),
                                     q[:, :1, :1].expand(1, 1, 3, 8), mask, 1.0)


@pytest.mark.parametrize("make", [
    lambda: tiny(transformers.Cohere2ForCausalLM, transformers.Cohere2Config, sliding_window=5,
                 layer_types=["sliding_attention", "full_attention"]),  # interleaved RoPE
    lambda: tiny(transformers.Phi3ForCausalLM, transformers.Phi3Config, sliding_window=5,
                 partial_rotary_factor=0.5, pad_token_id=0),  # partial rotary
], ids=["cohere2", "phi3"])
def test_a_rope_the_cache_convention_cannot_turn_is_refused_at_construction(make):
    model = make()
    with pytest.raises(ValueError, match="sink_convention='cache' cannot turn"):
        hf.RingCache(model, sinks=2, sink_convention="cache")
    hf.RingCache(model, sinks=2)  # absolute sinks never turn a key: fine


def test_attention_dropout_in_train_mode_is_refused_before_the_first_forward():
    model = tiny(transformers.MistralForCausalLM, transformers.MistralConfig, sliding_window=5,
                 head_dim=8, attention_dropout=0.1).train()
    cache = hf.RingCache(model)
    before = hf_state(model, cache)
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        hf.generate(model, prompt(8), cache=cache, max_new_tokens=2)
    assert hf_state(model, cache) == before
    model.eval()
    hf.generate(model, prompt(8), cache=cache, max_new_tokens=2)


def test_a_forward_with_grad_enabled_is_refused_before_any_layer_writes():
    model = tiny_mistral()
    cache = hf.RingCache(model)
    with hf.ring_active(model, cache), pytest.raises(ValueError, match=r"torch\.no_grad\(\)"):
        model(input_ids=prompt(8), cache=cache)
    assert cache.nbytes == 0 and cache.get_seq_length() == 0
    with torch.no_grad(), hf.ring_active(model, cache):
        model(input_ids=prompt(8), cache=cache)
    assert cache.get_seq_length() == 8


# ------------------------------------------------------------------------- KV-shared layers
def tiny_gemma3n():
    config = transformers.Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        sliding_window=5, hidden_size_per_layer_input=8, num_kv_shared_layers=2, laurel_rank=4,
        altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
        attn_implementation="sdpa")
    return transformers.Gemma3nForCausalLM(config).to(torch.float64).eval()


def tiny_gemma4():
    config = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        global_head_dim=16, sliding_window=5, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=512, attn_implementation="sdpa")
    return transformers.Gemma4ForCausalLM(config).to(torch.float64).eval()


def _padded(batch=2, n=14):
    ids = prompt(n, batch=batch)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("make", [tiny_gemma3n, tiny_gemma4], ids=["gemma3n", "gemma4"])
def test_kv_shared_layers_match_hf_in_prefill_and_decode(make):
    model = make()
    ids, mask = _padded()
    ref = run(None, model, ids, attention_mask=mask, max_new_tokens=12)
    out = run(hf.generate, model, ids, attention_mask=mask, max_new_tokens=12,
              prefill_chunk_size=4)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_score_diff(out, ref) < F64
    rings = out.cache.layers  # a shared layer stores its source's new keys: the same ring
    assert torch.equal(rings[2].ring.k, rings[0].ring.k)
    assert torch.equal(rings[2].ring.positions, rings[0].ring.positions)
    assert torch.equal(rings[3].keys, rings[1].keys)


@pytest.mark.parametrize("make", [tiny_gemma3n, tiny_gemma4], ids=["gemma3n", "gemma4"])
def test_kv_shared_layers_with_sinks(make):
    """Absolute sinks: equal to the band-with-sinks recompute; StreamingLLM's: the same for any
    chunk schedule (the shared layers turn their source ring's sinks)."""
    model = make()
    ids = prompt(14)
    out = run(hf.generate, model, ids, sinks=2, max_new_tokens=12, prefill_chunk_size=4)
    with torch.no_grad():
        ref = reference_logits(model, out.sequences[0], None, sinks=2)
    assert (torch.stack(out.scores)[:, 0] - ref[13:-1]).abs().max() < F64
    runs = [run(hf.generate, model, ids, sinks=2, sink_convention="cache", max_new_tokens=12,
                prefill_chunk_size=chunk) for chunk in (3, 14)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert max_score_diff(*runs) < F64


def test_kv_shared_beam_search_matches_hf():
    model = tiny_gemma3n()
    ids = prompt(9)
    kwargs = {"num_beams": 3, "max_new_tokens": 10, "early_stopping": True}
    ref = run(None, model, ids, **kwargs)
    out = run(hf.generate, model, ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert (out.sequences_scores - ref.sequences_scores).abs().max() < F64


def test_all_layers_reading_another_models_keys_are_refused():
    model = tiny_gemma4()
    model.config.num_kv_shared_layers = 4  # a draft assistant's layout
    with pytest.raises(ValueError, match="reads keys no layer of this model writes"):
        hf.RingCache(model)


def test_gemma3_still_builds_with_the_cache_convention():
    hf.RingCache(tiny_gemma(), sinks=2, sink_convention="cache")


# ------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize(("ids", "kwargs", "error", "match"), [
    (prompt(6).double(), {}, TypeError, "integer token ids"),
    (prompt(6)[:, :0], {}, ValueError, "at least one token"),
    (prompt(6)[0], {}, ValueError, "at least one token per row"),
    (prompt(6), {"attention_mask": torch.ones(1, 5, dtype=torch.long)}, ValueError,
     r"attention_mask must be \(B, L\) = \(1, 6\)"),
])
def test_bad_inputs_are_refused_before_any_forward(ids, kwargs, error, match):
    model = tiny_mistral()
    cache = hf.RingCache(model)
    with pytest.raises(error, match=match):
        hf.generate(model, ids, cache=cache, max_new_tokens=2, **kwargs)
    assert not any(layer.is_initialized for layer in cache.layers)  # nothing ran


def test_a_cache_continued_after_the_model_was_cast_is_refused():
    model = tiny_mistral()
    ids = prompt(6)
    out = hf.generate(model, ids, max_new_tokens=2, return_dict_in_generate=True,
                      pad_token_id=0)
    model.to(torch.float32)
    before = hf_state(model, out.cache)
    with pytest.raises(ValueError, match="holds torch.float64 keys.*computes in torch.float32"):
        hf.generate(model, torch.cat([out.sequences, prompt(2)], 1), cache=out.cache,
                    max_new_tokens=2)
    assert hf_state(model, out.cache) == before
