"""ringviz.hf decodes a full ring without a mask: bit for bit the masked path, inside generate().

Every row's real tokens take consecutive positions, so a row's ring holds its last W
positions once the row has had W real tokens; the cache counts them on the host from what it
was told (generate's prompt, forwards without a mask) and plans each forward once for all its
layers. These tests run generate with the plan and with a plan forced to mask everything.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from host_reads import HostReads  # noqa: E402
from tiny_models import prompt, run, tiny_gemma, tiny_llama  # noqa: E402

from ringviz import hf  # noqa: E402
from ringviz.hf.cache import RingCache  # noqa: E402


@pytest.fixture
def plans(monkeypatch):
    """Record each forward's plan: (T, unmasked kinds)."""
    seen = []
    real = RingCache._plan

    def spy(self, positions, no_mask):
        out = real(self, positions, no_mask)
        seen.append((positions.shape[1], out[1]))
        return out

    monkeypatch.setattr(RingCache, "_plan", spy)
    return seen


def masked_everywhere(monkeypatch):
    real = RingCache._plan

    def plan(self, positions, no_mask):
        return real(self, positions, no_mask)[0], frozenset()

    monkeypatch.setattr(RingCache, "_plan", plan)


def assert_bitwise(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ragged_rows_unmask_when_the_last_row_is_full(monkeypatch, plans, dtype):
    """Gemma-like (sliding W=6 + full): rows with 9, 4 and 1 real prompt tokens become full
    at decode steps 0, 2 and 5; the sliding layers unmask from step 5, the full layers never
    (their rows hold padding slots)."""
    model = tiny_gemma(dtype=dtype)
    ids = prompt(9, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :8] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 10, "min_new_tokens": 10}
    fast = run(hf.generate, model, ids.masked_fill(mask == 0, 0), **kwargs)
    decode = [kinds for T, kinds in plans if T == 1]
    assert decode == [frozenset()] * 4 + [frozenset({"sliding"})] * 5
    monkeypatch.undo()
    masked_everywhere(monkeypatch)
    assert_bitwise(fast, run(hf.generate, model, ids.masked_fill(mask == 0, 0), **kwargs))


def test_short_prompt_fills_the_ring_while_decoding(monkeypatch, plans):
    """No padding, a prompt of 3 into rings of 6: every layer unmasks at once. A ring grows
    with its tokens (to 6 slots), so each decode step sees every key it holds."""
    model = tiny_gemma()
    kwargs = {"attention_mask": torch.ones(2, 3, dtype=torch.long), "max_new_tokens": 9,
              "min_new_tokens": 9}
    fast = run(hf.generate, model, prompt(3, batch=2), **kwargs)
    decode = [kinds for T, kinds in plans if T == 1]
    assert decode == [frozenset({"full", "sliding"})] * 8
    assert [layer.ring.capacity for layer in fast.cache.layers if layer.is_sliding] == [6, 6]
    monkeypatch.undo()
    masked_everywhere(monkeypatch)
    assert_bitwise(fast, run(hf.generate, model, prompt(3, batch=2), **kwargs))


def test_sinks_keep_the_mask(plans):
    run(hf.generate, tiny_gemma(), prompt(20), sinks=2, max_new_tokens=4)
    assert all("sliding" not in kinds for _, kinds in plans)


def test_forwards_outside_generate_count_only_what_they_are_told():
    """ring_active forwards: without a mask every token is real (counted); with one, a decode
    column may be padding, so it is not counted (the cache never reads it back)."""
    model, W = tiny_llama(), 4
    cache = hf.RingCache(model, window=W)
    with torch.no_grad(), hf.ring_active(model, cache):
        model(input_ids=prompt(2), cache=cache)
        for n in range(3, 6):
            model(input_ids=prompt(1), cache=cache)
            assert cache.plan.unmasked == frozenset({"full"})  # a ring grown to its tokens
            assert cache.layers[0].ring.capacity == min(n, W)
    cache = hf.RingCache(model, window=W)
    with torch.no_grad(), hf.ring_active(model, cache):
        model(input_ids=prompt(2), cache=cache, attention_mask=torch.ones(1, 2))
        for n in range(3, 7):
            model(input_ids=prompt(1), cache=cache, attention_mask=torch.ones(1, n))
            assert cache.plan.unmasked == frozenset()


def test_unmasked_decode_adds_no_host_read(monkeypatch):
    """A decode forward's plan reads nothing back: the same host reads with and without it."""
    model = tiny_gemma()

    def decode_reads() -> tuple[int, frozenset[str]]:
        cache = hf.RingCache(model)
        with torch.no_grad(), hf.ring_active(model, cache):
            model(input_ids=prompt(8), cache=cache)
            with HostReads() as mode:
                model(input_ids=prompt(1), cache=cache)
            unmasked = cache.plan.unmasked
        return mode.count, unmasked

    fast, unmasked = decode_reads()
    assert unmasked == frozenset({"full", "sliding"})
    masked_everywhere(monkeypatch)
    assert decode_reads() == (fast, frozenset())


def test_one_padding_column_keeps_the_full_layers_masked(monkeypatch, plans):
    """A row with one padding slot: a full layer's query would see an empty slot unmasked."""
    model = tiny_gemma()
    ids = prompt(8, batch=2)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 4, "min_new_tokens": 4}
    fast = run(hf.generate, model, ids.masked_fill(mask == 0, 0), **kwargs)
    assert [kinds for T, kinds in plans if T == 1] == [frozenset({"sliding"})] * 3
    monkeypatch.undo()
    masked_everywhere(monkeypatch)
    assert_bitwise(fast, run(hf.generate, model, ids.masked_fill(mask == 0, 0), **kwargs))
