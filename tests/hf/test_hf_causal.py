"""ringviz.hf's first chunk without padding: SDPA's own causal mask, bit for bit the masked path.

A prompt with no padding, into layers that hold nothing yet, is the plain causal pattern: each
query sees the chunk's keys up to its own (a ring's window covering the chunk). The plan then
hands those layers ``causal`` and they skip the ``(T, T)`` boolean mask. These tests run
generate with the plan and with a plan forced to mask everything, and compare every score and
every stored key (the reference also never vouches a forward real, so the layers' plain
writes of a first chunk are checked against their generic scatter).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from host_reads import HostReads  # noqa: E402
from tiny_models import prompt, run, tiny_gemma, tiny_llama, tiny_mistral  # noqa: E402

from ringviz import hf  # noqa: E402
from ringviz.attention import attend, masked_attention  # noqa: E402
from ringviz.hf.cache import RingCache  # noqa: E402


@pytest.fixture
def chunks(monkeypatch):
    """Record each multi-token forward's causal kinds."""
    seen = []
    real = RingCache.make_plan

    def spy(self, attention_mask, batch, T, device):
        plan = real(self, attention_mask, batch, T, device)
        if T > 1:
            seen.append(plan.causal)
        return plan

    monkeypatch.setattr(RingCache, "make_plan", spy)
    return seen


def masked_everywhere(monkeypatch):
    """Every chunk masked, and no forward vouched real (the layers' generic writes too)."""
    plan = RingCache._plan
    monkeypatch.setattr(RingCache, "_causal", lambda self, T: frozenset())
    monkeypatch.setattr(RingCache, "_plan", lambda self, *args: (False, plan(self, *args)[1]))


def stores(cache: RingCache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        ring = getattr(layer, "ring", None)
        out += [ring._k_store, ring._v_store, ring._pos_store] if ring is not None \
            else [layer._k_store, layer._v_store]
    return out


def generate_both(monkeypatch, model, ids, **kwargs):
    """generate with the plan, then with every chunk masked: outputs and caches."""
    outs = []
    for fast in (True, False):
        if not fast:
            monkeypatch.undo()
            masked_everywhere(monkeypatch)
        cache = hf.RingCache(model)
        outs.append((run(hf.generate, model, ids, cache=cache, **kwargs), cache))
    return outs


def assert_bitwise(a, b):
    (out_a, cache_a), (out_b, cache_b) = a, b
    assert torch.equal(out_a.sequences, out_b.sequences)
    for x, y in zip(out_a.scores, out_b.scores, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(stores(cache_a), stores(cache_b), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("length", "kinds"), [(5, {"sliding", "full"}), (6, {"sliding", "full"}),
                                               (9, {"full"})])
def test_first_chunk_is_causal_and_bitwise(monkeypatch, chunks, dtype, length, kinds):
    """Gemma-like (sliding W=6 + full): a prompt within the window is causal for both kinds;
    a longer one only for the full layers (the ring's band is narrower than the chunk)."""
    model = tiny_gemma(dtype=dtype)
    kwargs = {"attention_mask": torch.ones(2, length, dtype=torch.long),
              "max_new_tokens": 8, "min_new_tokens": 8}
    fast, masked = generate_both(monkeypatch, model, prompt(length, batch=2), **kwargs)
    assert chunks == [frozenset(kinds)]
    assert_bitwise(fast, masked)


def test_without_a_mask_the_prompt_is_real_too(monkeypatch, chunks):
    """No attention_mask (HF's all-ones): generate tells the cache a prompt without padding,
    so its chunk is causal and counts its real tokens without reading anything back."""
    model = tiny_mistral()  # every layer a ring of 5

    def prefill(told):
        cache = hf.RingCache(model)
        with torch.no_grad(), hf.ring_active(model, cache), HostReads() as mode:
            cache.prompt = told  # (columns, fewest real tokens of a row), as generate tells it
            model(input_ids=prompt(4), cache=cache, attention_mask=torch.ones(1, 4))
            ring = cache.layers[0].ring  # grown to its 4 tokens, every slot known to be held
            return mode.count, cache.plan.causal, (ring.capacity, ring.window_full)

    reads, causal, full = prefill((4, 4))
    assert (causal, full) == (frozenset({"sliding"}), (4, True))
    padded_reads, causal, full = prefill((4, 3))  # told it may hold padding: it reads back
    assert (causal, full) == (frozenset(), (4, True)) and padded_reads > reads
    chunks.clear()
    fast, masked = generate_both(monkeypatch, model, prompt(4), max_new_tokens=6,
                                 min_new_tokens=6)
    assert chunks == [frozenset({"sliding"})]
    assert_bitwise(fast, masked)


def test_padding_keeps_the_mask(monkeypatch, chunks):
    """A left-padded row: its padding queries see nothing, which is not the causal pattern."""
    model = tiny_gemma()
    ids = prompt(5, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 4, "min_new_tokens": 4}
    fast, masked = generate_both(monkeypatch, model, ids.masked_fill(mask == 0, 0), **kwargs)
    assert chunks == [frozenset()]
    assert_bitwise(fast, masked)


def test_sinks_and_second_chunks_keep_the_mask(monkeypatch, chunks):
    """Sinks take their own columns; a second chunk (a conversation's next turn, or a chunked
    prefill) meets keys already stored."""
    model = tiny_gemma()
    run(hf.generate, model, prompt(5), sinks=2, max_new_tokens=2)
    assert chunks == [frozenset({"full"})]
    chunks.clear()
    run(hf.generate, model, prompt(10), prefill_chunk_size=4, max_new_tokens=2)
    assert chunks == [frozenset({"sliding", "full"}), frozenset(), frozenset()]
    chunks.clear()
    ids = prompt(4)
    first = run(hf.generate, model, ids, max_new_tokens=3, min_new_tokens=3)
    fast = run(hf.generate, model, torch.cat([first.sequences, prompt(3, seed=1)], 1),
               cache=first.past_key_values, max_new_tokens=3, min_new_tokens=3)
    assert chunks == [frozenset({"sliding", "full"}), frozenset()]
    monkeypatch.undo()
    masked_everywhere(monkeypatch)
    first = run(hf.generate, model, ids, max_new_tokens=3, min_new_tokens=3)
    masked = run(hf.generate, model, torch.cat([first.sequences, prompt(3, seed=1)], 1),
                 cache=first.past_key_values, max_new_tokens=3, min_new_tokens=3)
    assert torch.equal(fast.sequences, masked.sequences)
    for x, y in zip(fast.scores, masked.scores, strict=True):
        assert torch.equal(x, y)


def test_an_allocated_ring_keeps_the_mask(chunks):
    """A ring allocated before the first chunk (RingCache.allocate, or a reset) may hold keys
    the host did not count (compiled steps): the plan never calls it empty."""
    model = tiny_llama()
    cache = hf.RingCache(model, window=8)
    cache.allocate(1, 4, torch.float64, "cpu")
    run(hf.generate, model, prompt(4), cache=cache, max_new_tokens=2)
    assert chunks == [frozenset()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("B", "Hq", "Hkv", "T", "D"), [(1, 4, 1, 600, 256), (2, 8, 2, 37, 64),
                                                          (3, 6, 3, 129, 32), (2, 4, 4, 2, 16)])
def test_causal_attention_is_the_masked_chunk_attention(dtype, B, Hq, Hkv, T, D):
    """The kernel-level claim, on strided keys as transformers hands them (B, T, H, D)
    transposed: SDPA's causal mask gives the boolean tril mask's bits."""
    g = torch.Generator().manual_seed(T)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    tril = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    masked = masked_attention(q, k, v, tril, scale=0.3, empty=torch.zeros(B, T, dtype=torch.bool))
    assert torch.equal(attend(q, k, v, scale=0.3, causal=True), masked)
