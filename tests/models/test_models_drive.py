"""The ring decode path and the bug runners on tiny random Llama / Gemma 3 models (seconds)."""

import hashlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import FAMILIES, tiny_gemma, tiny_llama, tokens  # noqa: E402

from ringviz import hf  # noqa: E402
from ringviz.hf import PREFILL_CHUNK  # noqa: E402
from ringviz.hf.config import layer_windows  # noqa: E402
from ringviz.models.bugs import bug_ring, first_divergence  # noqa: E402
from ringviz.models.drive import (  # noqa: E402
    RingRunner,
    left_pad,
    ring_generate,
    ring_logits,
)
from ringviz.models.equivalence import compare, full_cache_bytes, ragged_rows  # noqa: E402
from ringviz.models.reference import band_bias, reference_greedy, reference_logits  # noqa: E402

EXACT = 1e-10  # float64: the ring and one full forward differ only by summation order


@pytest.mark.parametrize("prompt", [3, 8, 20])  # shorter than, equal to, longer than W
def test_llama_ring_matches_band_mask(device, prompt):
    model, window = tiny_llama(device), 8
    ids = tokens(prompt + 12, device)
    runner = RingRunner(model, 1, window, length=len(ids))
    ring = ring_logits(runner, [ids], [prompt])[0]
    ref = reference_logits(model, ids, window)
    assert (ring - ref).abs().max() < EXACT
    assert runner.caches[0].positions.max() == len(ids) - 1  # the ring holds the last W


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma])
def test_later_switches_set_the_configs_the_first_changed_and_restore(device, make):
    model = make(device)
    ids = tokens(20, device)
    runner = RingRunner(model, 1, 6, length=len(ids))
    first = ring_logits(runner, [ids], [9])[0]
    assert runner.cache.attention_configs == [model.config]  # causal LMs: one config
    runner.reset()
    assert torch.equal(ring_logits(runner, [ids], [9])[0], first)
    assert model.config._attn_implementation == "sdpa"
    assert all(m.config._attn_implementation == "sdpa" for m in model.modules()
               if hasattr(m, "config"))


def test_gemma_ring_matches_hf_native_sliding_window(device):
    model = tiny_gemma(device, window=6)
    ids = tokens(30, device)
    runner = RingRunner(model, 1, None, length=len(ids))
    assert runner.windows == [6, None, 6]
    assert runner.caches[1].allocated == 30  # the full layer holds every position, never regrown
    ring = ring_logits(runner, [ids], [11])[0]
    assert (ring - reference_logits(model, ids, None)).abs().max() < EXACT


def test_ragged_batch_rows_match_their_own_references(device):
    model, window = tiny_llama(device), 5
    rows, lengths = ragged_rows(tokens(60, device), batch=3, prompt_tokens=12, new_tokens=9)
    assert lengths == [12, 10, 8]
    ring = ring_logits(RingRunner(model, 3, window, length=21), rows, lengths)
    result = compare(ring, [reference_logits(model, r, window) for r in rows])
    assert result["compared_positions"] == sum(len(r) for r in rows)
    assert result["max_abs_logit_diff"] < EXACT and result["argmax_agreement"] == 1.0


def test_greedy_generation_equals_reference(device):
    model, window = tiny_llama(device), 4
    prompt = tokens(9, device)
    ring = ring_generate(RingRunner(model, 1, window, length=30), [prompt], 12)[0]
    assert torch.equal(ring, reference_greedy(model, prompt, 12, window))


def test_llama_ignores_config_sliding_window_trap(device):
    """Why the SmolLM2 reference needs the explicit band: Llama's mask ignores the config."""
    model, window = tiny_llama(device), 4
    ids = tokens(16, device)
    model.config.sliding_window = window
    plain = model(input_ids=ids[None], use_cache=False).logits[0]
    assert (plain - reference_logits(model, ids, None)).abs().max() < EXACT  # still full causal
    assert (plain - reference_logits(model, ids, window)).abs().max() > 1e-3


def test_band_bias_sinks_and_window():
    seen = band_bias(6, window=2, sinks=1, dtype=torch.float64)[0, 0] == 0
    assert seen.int().tolist() == [[1, 0, 0, 0, 0, 0],
                                   [1, 1, 0, 0, 0, 0],
                                   [1, 1, 1, 0, 0, 0],
                                   [1, 0, 1, 1, 0, 0],
                                   [1, 0, 0, 1, 1, 0],
                                   [1, 0, 0, 0, 1, 1]]


def test_band_bias_without_a_window_is_causal_and_ignores_sinks():
    seen = band_bias(5, window=None, sinks=2, dtype=torch.float32)[0, 0] == 0
    assert torch.equal(seen, torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize(("bug", "first"), [("slot_rope", 8), ("off_by_one", 7),
                                            ("chunk_first", 0), ("no_stale_mask", 8)])
def test_bugs_diverge_where_predicted(device, bug, first):
    model, window = tiny_llama(device), 8
    ids = tokens(30, device)
    runner = RingRunner(model, 1, window, len(ids), ring=bug_ring(model, bug))
    ring = ring_logits(runner, [ids], [12], prefill_chunk=12)[0]  # the prompt in one call
    assert first_divergence(ring, reference_logits(model, ids, window), tol=1e-9) == first


def test_chunked_prefill_delays_chunk_first_to_the_second_chunk(device):
    """Chunks of W fit the ring, so write-before-attend first loses keys in chunk 2."""
    model, window = tiny_llama(device), 8
    ids = tokens(30, device)
    runner = RingRunner(model, 1, window, len(ids), ring=bug_ring(model, "chunk_first"))
    ring = ring_logits(runner, [ids], [12], prefill_chunk=window)[0]
    assert first_divergence(ring, reference_logits(model, ids, window), tol=1e-9) == window


def test_shared_ring_crosstalk_hits_the_second_row(device):
    model, window = tiny_llama(device), 8
    rows = [tokens(20, device), tokens(20, device, offset=1)]
    runner = RingRunner(model, 2, window, 20, ring=bug_ring(model, "shared_ring"))
    ring = ring_logits(runner, rows, [12, 12], prefill_chunk=12)
    refs = [reference_logits(model, r, window) for r in rows]
    assert first_divergence(ring[1], refs[1], tol=1e-9) == 12 - window  # sees row 0's keys
    assert first_divergence(ring[0], refs[0], tol=1e-9) == 12  # then row 0 sees row 1's


def test_slot_rope_is_harmless_before_the_first_wrap(device):
    model = tiny_llama(device)
    ids = tokens(8, device)
    ring = ring_logits(RingRunner(model, 1, 8, 8, ring=bug_ring(model, "slot_rope")), [ids],
                       [3])[0]
    assert (ring - reference_logits(model, ids, 8)).abs().max() < EXACT


def test_left_pad_and_full_cache_bytes(device):
    ids, pos = left_pad([torch.arange(3, device=device), torch.arange(1, device=device)], 0)
    assert pos.tolist() == [[0, 1, 2], [-1, -1, 0]]
    model = tiny_llama(device)
    # 2 (k, v) x 2 layers x batch 3 x 2 kv heads x 10 tokens x head_dim 8 x 8 bytes
    assert full_cache_bytes(model, 3, 10) == 2 * 2 * 3 * 2 * 10 * 8 * 8


def test_bad_inputs_raise(device):
    model = tiny_llama(device)
    with pytest.raises(ValueError, match="no native sliding window"):
        layer_windows(model, None)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        layer_windows(model, 0)
    with pytest.raises(ValueError, match="same number of new tokens"):
        ring_logits(RingRunner(model, 2, 4, 10), [tokens(5, device), tokens(6, device)], [2, 2])
    with pytest.raises(ValueError, match="one sequence"):
        reference_logits(model, tokens(4, device)[None], 4)


# ---------------------------------------------------------------- hardening (issue 9)
def runner_hash(runner) -> str:
    """sha256 over every stored tensor of every layer (spare slots included)."""
    digest = hashlib.sha256()
    for c in runner.caches:  # a ring's stores, or a full layer's (slot = position)
        stores = (c._k_store, c._v_store, c._pos_store, c._last_pos) if hasattr(c, "_pos_store") \
            else (c._k_store, c._v_store, torch.tensor(c.columns))
        for t in stores:
            digest.update(t.cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_position_past_the_length_refused_before_any_layer_writes(device):
    model = tiny_gemma(device, window=6)
    ids = tokens(30, device)
    runner = RingRunner(model, 1, None, length=12)
    ring_logits(runner, [ids[:12]], [8])  # positions 0..11 fit
    before = runner_hash(runner)
    with pytest.raises(ValueError, match="position 12 is at or past the runner's length=12"):
        runner.forward(ids[None, 12:13], torch.tensor([[12]], device=device))
    assert runner_hash(runner) == before
    with pytest.raises(ValueError, match="length=12"):
        ring_logits(RingRunner(model, 1, None, length=12), [ids], [11])
    fresh = RingRunner(model, 1, None, length=5)
    with pytest.raises(ValueError, match="length=5"):
        ring_generate(fresh, [ids[:3]], 4)  # would feed positions up to 5
    assert all(int(layer.columns) == 0 for layer in fresh.cache.layers)  # nothing written
    assert all(int(c.positions.max()) == -1 for c in fresh.caches if hasattr(c, "positions"))


class Interrupt(KeyboardInterrupt):
    pass


def test_interrupted_forward_refuses_until_reset_then_equals_clean_run(device, monkeypatch):
    model = tiny_gemma(device, window=6)
    ids = tokens(12, device)
    clean = ring_logits(RingRunner(model, 1, None, length=12), [ids], [8])[0]
    runner = RingRunner(model, 1, None, length=12)
    runner.prefill(ids[None, :8], torch.arange(8, device=device)[None])
    layer1 = runner.caches[1]
    monkeypatch.setattr(layer1, "step", lambda *a, **k: (_ for _ in ()).throw(Interrupt()))
    with pytest.raises(Interrupt):  # Ctrl-C in layer 1: layer 0 already holds position 8
        runner.forward(ids[None, 8:9], torch.tensor([[8]], device=device))
    monkeypatch.undo()
    assert int(runner.caches[0]._last_pos) == 8 and layer1.columns == 8  # 0..7, not 8
    for pos in (8, 9):  # neither the retry nor the next position is silently decoded
        with pytest.raises(RuntimeError, match=r"cannot be used again.*runner.reset\(\)"):
            runner.forward(ids[None, pos:pos + 1], torch.tensor([[pos]], device=device))
    runner.reset()
    assert torch.equal(ring_logits(runner, [ids], [8])[0], clean)


def test_refused_input_does_not_refuse_the_runner(device):
    model = tiny_llama(device)
    ids = tokens(10, device)
    runner = RingRunner(model, 1, 4, length=10)
    runner.prefill(ids[None, :5], torch.arange(5, device=device)[None])
    before = runner_hash(runner)
    with pytest.raises(ValueError, match="not after the row's cached positions"):
        runner.forward(ids[None, 5:6], torch.tensor([[3]], device=device))
    assert runner_hash(runner) == before
    runner.forward(ids[None, 5:6], torch.tensor([[5]], device=device))  # still usable


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma])
@pytest.mark.parametrize("chunk", [1, 3, 6, 7, 40])
def test_chunked_prefill_equals_one_call(device, make, chunk):
    model = make(device)
    rows, lengths = ragged_rows(tokens(80, device), batch=3, prompt_tokens=21, new_tokens=4)
    one = ring_logits(RingRunner(model, 3, 6, length=25), rows, lengths, prefill_chunk=21)
    chunked = ring_logits(RingRunner(model, 3, 6, length=25), rows, lengths,
                          prefill_chunk=chunk)
    for a, b in zip(one, chunked):
        assert (a - b).abs().max() < 1e-12  # float64: summation order only


def test_prefill_default_chunk_and_last_only(device):
    model = tiny_gemma(device, window=6)
    ids = tokens(20, device)
    runner = RingRunner(model, 1, None, length=20)
    assert runner.prefill_chunk == PREFILL_CHUNK  # generate's: one prefill default
    pos = torch.arange(20, device=device)[None]
    last = runner.prefill(ids[None], pos, last_only=True)
    assert last.shape == (1, 1, model.config.vocab_size)
    full = RingRunner(model, 1, None, length=20).prefill(ids[None], pos)
    assert (last[0, 0] - full[0, -1]).abs().max() < 1e-12
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        runner.prefill(ids[None], pos, chunk=0)


def test_chunked_prefill_checks_the_whole_prompt_first(device):
    model = tiny_llama(device)
    ids = tokens(12, device)
    runner = RingRunner(model, 1, 4, length=12)
    before = runner_hash(runner)
    bad = torch.tensor([list(range(8)) + [7, 8, 9, 10]], device=device)  # repeat in chunk 3
    with pytest.raises(ValueError, match="strictly increase"):
        runner.prefill(ids[None], bad)
    assert runner_hash(runner) == before


def test_window_imposed_on_a_model_whose_layers_are_all_full():
    """Qwen2 without sliding lists every layer as full_attention: window= must still apply."""
    config = transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_sliding_window=False)
    assert set(config.layer_types) == {"full_attention"}
    model = transformers.Qwen2ForCausalLM(config).eval()
    assert layer_windows(model, 4) == [4, 4]
    with pytest.raises(ValueError, match="no native sliding window"):
        layer_windows(model, None)


# ------------------------------------------------------------ one road (issue 16)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ring_runner_serves_every_family_ringviz_hf_serves(family):
    """RingRunner drives ringviz.hf: on every family the same tokens and logits as
    ``ringviz.hf.generate``, and exact against one full forward (Qwen2 and Phi-3 configs have
    no ``head_dim``; Mistral and Phi-3 slide without ``layer_types``)."""
    build, window = FAMILIES[family]
    model = build()
    ids = tokens(14)
    out = hf.generate(model, ids[None], window=window, max_new_tokens=9, do_sample=False,
                      prefill_chunk_size=4, output_logits=True, return_dict_in_generate=True,
                      pad_token_id=0)
    seq, new = out.sequences[0], out.sequences.shape[1] - len(ids)  # 9, or fewer at an EOS
    runner = RingRunner(model, 1, window, length=len(seq))
    ring = ring_logits(runner, [seq], [len(ids)], prefill_chunk=4)[0]
    assert (ring - reference_logits(model, seq, window)).abs().max() < EXACT
    generated = torch.stack([step[0] for step in out.logits])  # float32 in generate's output
    assert (ring[len(ids) - 1:-1].float() - generated).abs().max() < 1e-5
    assert torch.equal(ring_generate(RingRunner(model, 1, window, len(seq)), [ids], new)[0],
                       seq[len(ids):])
