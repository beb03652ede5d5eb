"""ringviz.hf: RingCache inside transformers' generate(), on tiny random models (seconds).

Native windows are checked against Hugging Face's own generate (its default cache); imposed
windows against a full recompute with an explicit band mask (ringviz.models.reference).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")


from ring_state import hf_state  # noqa: E402
from tiny_models import (  # noqa: E402
    F64,
    Collect,
    max_score_diff,
    prompt,
    run,
    tiny_gemma,
    tiny_llama,
    tiny_mistral,
    tiny_qwen2,
    tiny_qwen2_full,
)

from ringviz import attention as core_attention  # noqa: E402
from ringviz import cache as core_cache  # noqa: E402
from ringviz import hf  # noqa: E402
from ringviz.hf import attention  # noqa: E402
from ringviz.hf import cache as hf_cache  # noqa: E402
from ringviz.models.reference import reference_logits  # noqa: E402

F32 = 1e-4  # float32 noise on these tiny models


NATIVE = {"gemma3": tiny_gemma, "mistral": tiny_mistral, "qwen2": tiny_qwen2}


# ------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("name", sorted(NATIVE))
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, F64), (torch.float32, F32)])
def test_native_window_matches_hf_generate(name, dtype, tol):
    """Prompt > W, chunked prefill (chunks < and > W), max_new_tokens = 8 W."""
    model = NATIVE[name](dtype=dtype)
    W = model.config.sliding_window
    ids = prompt(3 * W + 2)
    ref = run(None, model, ids, max_new_tokens=8 * W)
    for chunk in (4, 2 * W + 1):
        out = run(hf.generate, model, ids, max_new_tokens=8 * W, prefill_chunk_size=chunk)
        assert torch.equal(out.sequences, ref.sequences)
        assert max_score_diff(out, ref) < tol


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma, tiny_qwen2_full])
def test_imposed_window_matches_band_mask_recompute(make):
    """Llama, full Qwen2: every layer a ring of 5. Gemma 3: its sliding layers' 6 set to 4."""
    model, W = make(), 4 if make is tiny_gemma else 5
    ids = prompt(13)
    out = run(hf.generate, model, ids, window=W, max_new_tokens=6 * W, prefill_chunk_size=3)
    seq = out.sequences[0]
    with torch.no_grad():
        ref = reference_logits(model, seq, W)  # (L, vocab): band mask or HF's own at W
    scores = torch.stack(out.scores)[:, 0]  # (new, vocab)
    assert (scores - ref[ids.shape[1] - 1:-1]).abs().max() < F64
    assert torch.equal(seq[ids.shape[1]:], ref[ids.shape[1] - 1:-1].argmax(-1))


def test_sampling_same_seed_same_tokens():
    model = tiny_gemma(dtype=torch.float32)
    ids = prompt(9)
    kwargs = {"do_sample": True, "top_k": 20, "temperature": 0.9, "max_new_tokens": 30}
    torch.manual_seed(7)
    ref = run(None, model, ids, **kwargs)
    torch.manual_seed(7)
    out = run(hf.generate, model, ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_score_diff(out, ref) < F32


def test_left_padded_batch_matches_hf(device):
    """Also the CUDA path, when a GPU is present (``device`` fixture)."""
    model = tiny_gemma().to(device)
    ids = prompt(14, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :5], mask[2, :11] = 0, 0  # rows of 14, 9 and 3 real tokens (W = 6)
    ids, mask = ids.masked_fill(mask == 0, 0).to(device), mask.to(device)
    ref = run(None, model, ids, attention_mask=mask, max_new_tokens=20)
    out = run(hf.generate, model, ids, attention_mask=mask, max_new_tokens=20,
              prefill_chunk_size=4)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_score_diff(out, ref) < F64


def test_left_padded_imposed_window_rows_match_their_own_references():
    model, W = tiny_llama(), 4
    ids = prompt(10, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    out = run(hf.generate, model, ids.masked_fill(mask == 0, 0), window=W,
              attention_mask=mask, max_new_tokens=12)
    scores = torch.stack(out.scores, dim=1)  # (B, new, vocab)
    for b, start in ((0, 0), (1, 6)):
        seq = out.sequences[b, start:]
        ref = reference_logits(model, seq, W)
        assert (scores[b] - ref[10 - start - 1:-1]).abs().max() < F64


def test_streamer_sees_every_token():
    model = tiny_mistral()
    ids = prompt(12)
    streamer = Collect()
    out = hf.generate(model, ids, max_new_tokens=15, do_sample=False, streamer=streamer)
    assert streamer.ended
    assert torch.equal(torch.cat(streamer.tokens), out[0])  # the prompt first, then each token


def test_chunked_prefill_bounds_attention_size(monkeypatch):
    """A 60-token prompt in chunks of 7 through rings of 5: no attention over more than 12 keys."""
    seen, unmasked = [], []
    real = core_attention.attend

    def spy(q, k, v, mask=None, **kwargs):
        plain = mask is None and not kwargs.get("causal")
        (unmasked if plain else seen).append((q.shape[2], k.shape[2]))
        return real(q, k, v, mask, **kwargs)

    for module in (core_cache, hf_cache):  # every ring layer's attention
        monkeypatch.setattr(module, "attend", spy)
    model = tiny_llama()
    hf.generate(model, prompt(60), window=5, max_new_tokens=3, do_sample=False,
                prefill_chunk_size=7)
    assert max(q for q, _ in seen) == 7 and max(k for _, k in seen) == 5 + 7
    assert seen[0] == (7, 7)  # the first chunk goes into an empty ring: its own keys only
    # decode attends over the raw ring, full after the prompt: no mask, in both layers
    assert all(q > 1 for q, _ in seen) and unmasked == [(1, 5)] * 2 * 2


def test_masks_are_built_once_per_forward_per_layer_kind(monkeypatch):
    calls = []
    real = attention.ring_mask

    def spy(**kwargs):
        calls.append(kwargs.get("local_size"))
        return real(**kwargs)

    monkeypatch.setattr(attention, "ring_mask", spy)  # what register() hands to transformers
    hf.generate(tiny_gemma(), prompt(9), max_new_tokens=5, do_sample=False)
    assert sorted(calls, key=str) == [6] * 5 + [None] * 5  # 5 forwards x (sliding, full)


# ------------------------------------------------------------------------- memory
def test_ring_bytes_flat_from_20_to_2000_tokens():
    model = tiny_gemma(dtype=torch.float32)
    cache = hf.RingCache(model)
    streamer = Collect(cache)
    hf.generate(model, prompt(10), cache=cache, max_new_tokens=2000, do_sample=False,
                streamer=streamer, min_new_tokens=2000)
    assert cache.get_seq_length() == 10 + 2000 - 1  # the last token is never fed back
    assert streamer.ring_bytes[20] == streamer.ring_bytes[2000 + 9] > 0
    full = [layer for layer in cache.layers if isinstance(layer, hf.FullLayer)]
    assert full[0].allocated == 10 + 2000 - 1  # what it holds: not doubled, not reserved


def kv_slot_bytes(model) -> list[int]:
    """Per layer: bytes of one token's key and value."""
    layout = hf.read_layout(model)
    itemsize = next(model.parameters()).element_size()
    return [2 * h * d * itemsize for h, d in zip(layout.kv_heads, layout.head_dims, strict=True)]


def ring_kv_bytes(cache) -> int:
    """Keys and values a RingCache holds (its stored positions apart)."""
    total = 0
    for layer in cache.layers:
        store = layer.ring if isinstance(layer, hf.RingLayer) else layer
        if store is not None and getattr(store, "_k_store", None) is not None:
            total += sum(t.numel() * t.element_size() for t in (store._k_store, store._v_store))
    return total


@pytest.mark.parametrize(("window", "prompt_length", "new"), [(None, 3, 12), (None, 9, 8),
                                                              (100_000, 17, 6)])
def test_ring_memory_never_above_hf_default_cache(window, prompt_length, new):
    """At every length, the ring's keys and values are within two token slots per layer of
    what Hugging Face's default cache holds (its sliding layers keep W - 1, a ring W; a ring and
    a full layer each have one spare slot for padding writes): rings grow with their tokens to
    W, full layers hold exactly their tokens. Measured after every token generate hands over.
    A window of 100,000 on Llama (every layer a ring; HF's default cache keeps every token)
    holds the tokens it has, not its window (105.6 MB for 17 tokens on Gemma-3-270M before)."""
    from ringviz.models.chat import hf_cache_bytes
    model = (tiny_llama if window else tiny_gemma)(dtype=torch.float32)
    cache = hf.RingCache(model, window=window)
    seen = {}

    class Measure(Collect):
        def put(self, value):
            seen[int(cache.get_seq_length())] = ring_kv_bytes(cache)

    hf.generate(model, prompt(prompt_length), cache=cache, max_new_tokens=new,
                min_new_tokens=new, do_sample=False, streamer=Measure())
    allowance = 2 * sum(kv_slot_bytes(model))
    assert seen.pop(0) == 0  # the prompt is handed over before any forward
    assert sorted(seen) == list(range(prompt_length, prompt_length + new))
    for tokens, held in seen.items():
        assert held <= hf_cache_bytes(model, tokens) + allowance, tokens
    if window:  # a ring of 100,000 slots holds the tokens it has, not its window
        assert all(layer.slots <= prompt_length + new for layer in cache.layers
                   if isinstance(layer, hf.RingLayer))


def test_a_ring_that_grew_equals_one_allocated_whole():
    """Growing keeps every key where the slot rule puts it: logits equal to a ring that was
    allocated at its window (and draft slots) from the first token, with sinks of both
    conventions and a left-padded batch."""
    model = tiny_gemma()
    ids = prompt(7, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    for sinks, convention in ((0, "absolute"), (2, "absolute"), (2, "cache")):
        runs = []
        for whole in (False, True):
            cache = hf.RingCache(model, sinks=sinks, sink_convention=convention, draft=3)
            if whole:
                cache.fit_full()
            runs.append(run(hf.generate, model, ids, cache=cache, attention_mask=mask,
                            max_new_tokens=9))
            slots = {layer.slots for layer in cache.layers if isinstance(layer, hf.RingLayer)}
            assert slots == ({6 + 3} if whole else {6})  # no draft: nothing was taken back
        assert torch.equal(runs[0].sequences, runs[1].sequences)
        assert max_score_diff(runs[0], runs[1]) == 0.0


def test_full_layer_holds_exactly_its_tokens_without_a_reserve():
    layer = hf.FullLayer()
    k = torch.zeros(1, 1, 1, 2)
    allocated = set()
    for p in range(100):
        pos = torch.tensor([[p]])
        out = layer.step(k + 1, k + p, k + p, pos, layer.mask(pos), scale=1.0)
        allocated.add(layer.allocated)
    assert layer.columns == 100 and layer.keys[0, 0, :100, 0].tolist() == list(range(100))
    assert allocated == set(range(1, 101))
    assert 0 < float(out.max()) < 99  # the last query averaged over every stored value


def test_nbytes_counts_every_layer():
    model = tiny_gemma(dtype=torch.float32)
    cache = hf.RingCache(model)
    assert cache.nbytes == 0  # nothing allocated before the first forward
    hf.generate(model, prompt(10), cache=cache, max_new_tokens=4, do_sample=False)
    ring = cache.layers[0].ring
    assert ring.window == 6 and cache.layers[2].ring.window == 6
    full = cache.layers[1]
    assert cache.nbytes == 2 * ring.nbytes + 2 * full._k_store.numel() * 4


# ------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive_search"),
    ({"assistant_early_exit": 1}, "assistant_early_exit"),
    ({"past_key_values": object()}, "past_key_values"),
    ({"position_ids": torch.arange(8)[None] + 1}, "position_ids disagree"),  # (agreeing: served)
    ({"cache_implementation": "static"}, "cache_implementation"),
    ({"window": 3}, "differs"),
])
def test_rejected_calls_change_nothing(kwargs, match):
    model = tiny_gemma(dtype=torch.float32)
    cache = hf.RingCache(model)
    before = hf_state(model, cache)
    with pytest.raises(ValueError, match=match):
        hf.generate(model, prompt(8), cache=cache, max_new_tokens=3, **kwargs)
    assert hf_state(model, cache) == before


def test_a_model_default_cache_implementation_gives_way_to_the_ring():
    model = tiny_gemma()
    ids = prompt(9)
    ref = run(None, model, ids, max_new_tokens=10)
    model.generation_config.cache_implementation = "static"  # hub Gemma 3 ships "hybrid"
    out = run(hf.generate, model, ids, max_new_tokens=10)
    assert torch.equal(out.sequences, ref.sequences) and max_score_diff(out, ref) < F64
    assert isinstance(out.cache, hf.RingCache)
    assert model.generation_config.cache_implementation == "static"  # left as it was


def test_plain_generate_with_a_ring_cache_raises_naming_the_call():
    model = tiny_gemma(dtype=torch.float32)
    cache = hf.RingCache(model)
    with pytest.raises(RuntimeError, match=r"ringviz\.hf\.generate"):
        model.generate(prompt(8), cache=cache, max_new_tokens=3)
    assert cache.get_seq_length() == 0 and cache.nbytes == 0  # refused before any write


def test_interrupted_cache_is_refused_and_switch_restored():
    model = tiny_gemma(dtype=torch.float32)
    cache = hf.RingCache(model)
    with pytest.raises(KeyboardInterrupt):
        hf.generate(model, prompt(8), cache=cache, max_new_tokens=9,
                    streamer=Collect(fail_at=4))
    assert model.config._attn_implementation == "sdpa" and attention._SERVING.cache is None
    state = hf_state(model, cache)
    for ids in (prompt(8), prompt(20)):  # neither a retry nor a longer conversation goes on
        with pytest.raises(RuntimeError, match="raised KeyboardInterrupt after the cache had"):
            hf.generate(model, ids, cache=cache, max_new_tokens=3)
    assert hf_state(model, cache) == state
    cache.reset()  # emptied, it serves again
    assert torch.equal(hf.generate(model, prompt(8), cache=cache, max_new_tokens=3),
                       hf.generate(model, prompt(8), max_new_tokens=3))


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "8"])
def test_bad_window_raises(window):
    error = ValueError if isinstance(window, int) and not isinstance(window, bool) else TypeError
    with pytest.raises(error, match="window must be"):  # an int (TypeError), >= 1 (ValueError)
        hf.RingCache(tiny_llama(), window=window)


def test_model_without_a_native_window_needs_one():
    with pytest.raises(ValueError, match="pass window=W"):
        hf.RingCache(tiny_llama())


def test_unsupported_attention_features_are_named():
    gemma = tiny_gemma(dtype=torch.float32)
    gemma.config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="soft-capping"):
        hf.RingCache(gemma)
    llama = tiny_llama(dtype=torch.float32)
    llama.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(6))
    with pytest.raises(ValueError, match="sinks"):
        hf.RingCache(llama, window=4)
    llama = tiny_llama(dtype=torch.float32)
    llama.config.alibi = True
    with pytest.raises(ValueError, match="ALiBi"):
        hf.RingCache(llama, window=4)


def test_ring_cache_without_spare_slots_cannot_crop():
    cache = hf.RingCache(tiny_llama(), window=4)
    with pytest.raises(NotImplementedError, match="evicted"):
        cache.crop(-2)


# ------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize(("sinks", "sink_convention"), [(0, "absolute"), (2, "absolute"), (2, "cache")])
def test_decode_step_compiles_once_fullgraph_and_matches_eager(sinks, sink_convention):
    """All-ring cache, with and without sinks: one graph (fullgraph=True: a graph break would
    raise), no recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = tiny_mistral(dtype=torch.float32)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model.forward, fullgraph=True, backend=counter)
    runs = {}
    for name, forward in (("eager", model.forward), ("compiled", compiled)):
        cache = hf.RingCache(model, sinks=sinks, sink_convention=sink_convention)
        assert cache.is_compileable
        logits = []
        with torch.no_grad(), hf.ring_active(model, cache):
            tok = model(input_ids=prompt(9), cache=cache).logits[:, -1:].argmax(-1)  # prefill
            for _ in range(12):  # decode past two wraps of the ring of 5
                out = forward(input_ids=tok, cache=cache).logits[:, -1:]
                logits.append(out)
                tok = out.argmax(-1)
        runs[name] = torch.cat(logits, dim=1), cache.layers[0].ring.positions.clone()
    assert counter.frame_count == 1  # compiled at the first decode step, reused by the other 11
    torch.testing.assert_close(runs["compiled"][0], runs["eager"][0])
    assert torch.equal(runs["compiled"][1], runs["eager"][1])
    assert hf.RingCache(tiny_gemma()).is_compileable  # full layers too, once reserved


# ------------------------------------------------------------------------- the real model
@pytest.mark.slow
def test_gemma3_270m_matches_hf_default_cache_past_its_window():
    from ringviz.models.load import load_model
    from ringviz.models.text import eval_tokens

    model, tokenizer = load_model("gemma3")
    ids = eval_tokens(tokenizer, 600)[None]  # longer than the window of 512
    kwargs = {"max_new_tokens": 96, "min_new_tokens": 96}
    ref = run(None, model, ids, **kwargs)
    out = run(hf.generate, model, ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_score_diff(out, ref) < 1e-3
    assert model.config.sliding_window == 512
