"""Nothing leaks into other forwards: while a ring call runs, every other forward of the same model
(a logits processor's or stopping criterion's plain call, another thread's call, the RoPE
probe) is Hugging Face's own, bit for bit, never touches the ring call's cache, and leaves the
ring call's result as it is without it (issue 34, item 1).

Each test fails on dab2ed4: there the ring's attention was set on the model for the whole
call, so a nested plain forward went through the ring (logits 0.27 off, the ring's cache took
its tokens too), and the probe switched the model outside the lock (``KeyError: 'rope_probe'``,
a model left on the probe's attention).
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from ringviz import hf
from tests.tiny_models import prompt, run, tiny_family, tiny_gemma

NEW = 8


class PlainForward:
    """Runs ``model(ids, use_cache=False)`` at every call and keeps its logits."""

    def __init__(self, model, ids: torch.Tensor) -> None:
        self.model, self.ids, self.logits = model, ids, []

    def forward(self) -> None:
        with torch.no_grad():
            self.logits.append(self.model(self.ids, use_cache=False).logits)


class ForwardingProcessor(PlainForward, LogitsProcessor):
    def __call__(self, input_ids, scores):
        self.forward()
        return scores


class ForwardingCriterion(PlainForward, StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        self.forward()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.fixture(scope="module")
def model():
    return tiny_gemma()


def ring_run(model, **kwargs):
    cache = hf.RingCache(model)
    out = run(hf.generate, model, prompt(11), cache=cache, max_new_tokens=NEW, **kwargs)
    return out, cache


@pytest.mark.parametrize("where", ["logits_processor", "stopping_criteria"])
def test_a_plain_forward_inside_a_ring_call(model, where):
    inner_ids = prompt(9, seed=3)
    with torch.no_grad():
        plain = model(inner_ids, use_cache=False).logits
    alone, alone_cache = ring_run(model)
    nested = (ForwardingProcessor if where == "logits_processor" else ForwardingCriterion)(
        model, inner_ids)
    listed = (LogitsProcessorList if where == "logits_processor" else StoppingCriteriaList)(
        [nested])
    out, cache = ring_run(model, **{where: listed})
    assert len(nested.logits) == NEW
    for logits in nested.logits:  # the inner call is Hugging Face's own, bit for bit
        assert torch.equal(logits, plain)
    # the ring call is unchanged by it: tokens, scores and what its cache took
    assert torch.equal(out.sequences, alone.sequences)
    for a, b in zip(out.scores, alone.scores, strict=True):
        assert torch.equal(a, b)
    assert cache.seen_columns() == alone_cache.seen_columns() == 11 + NEW - 1
    assert cache.nbytes == alone_cache.nbytes


def test_a_plain_call_with_its_own_cache_inside_a_ring_call(model):
    """Hugging Face's own cached call (a DynamicCache, as classifier-free guidance runs its
    unconditional pass) inside a ring call: Hugging Face's tokens, the ring call unchanged."""
    inner_ids = prompt(7, seed=4)
    theirs = model.generate(inner_ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    inner = []

    class Generating(LogitsProcessor):
        def __call__(self, input_ids, scores):
            inner.append(model.generate(inner_ids, max_new_tokens=3, do_sample=False,
                                        pad_token_id=0))
            return scores

    alone, _ = ring_run(model)
    out, _ = ring_run(model, logits_processor=LogitsProcessorList([Generating()]))
    assert torch.equal(out.sequences, alone.sequences)
    assert all(torch.equal(tokens, theirs) for tokens in inner) and len(inner) == NEW


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_threads_mixing_ring_calls_sinks_and_probes(family):
    """Three threads on one model, at once and over and over: two ring calls with
    StreamingLLM's sinks (each builds its cache: the RoPE probe), one building caches and
    running plain forwards. Every call is served and exact; the model is HF's afterwards."""
    model = tiny_family(family, layers=2) if family != "gemma3_text" else tiny_gemma()
    window = None if family == "gemma3_text" else 4
    ids = {name: prompt(10, seed=seed) for seed, name in enumerate(("a", "b", "plain"))}

    def ring(i):
        return hf.generate(model, i, window=window, sinks=2, sink_convention="cache",
                           max_new_tokens=4, do_sample=False, pad_token_id=0)

    with torch.no_grad():
        plain = model(ids["plain"], use_cache=False).logits
    expected = {name: ring(ids[name]) for name in ("a", "b")}
    cache = hf.RingCache(model, window=window, sinks=2, sink_convention="cache")
    ropes = [layer.sink_rope is None for layer in cache.layers if isinstance(layer, hf.RingLayer)]
    errors, start = [], threading.Barrier(3)

    def worker(name):
        try:
            start.wait(30)
            for _ in range(3):
                if name == "plain":
                    built = hf.RingCache(model, window=window, sinks=2, sink_convention="cache")
                    assert [layer.sink_rope is None for layer in built.layers
                            if isinstance(layer, hf.RingLayer)] == ropes
                    with torch.no_grad():
                        assert torch.equal(model(ids["plain"], use_cache=False).logits, plain)
                else:
                    assert torch.equal(ring(ids[name]), expected[name])
        except BaseException as error:  # noqa: BLE001 - reported below, with its type
            errors.append(f"{name}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("a", "b", "plain")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == []
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():  # a plain forward afterwards is Hugging Face's, bit for bit
        assert torch.equal(model(ids["plain"], use_cache=False).logits, plain)
    assert hf.attention._HELD == {} and hf.attention._OWN == {}


def test_one_cache_serves_one_call_at_a_time(model):
    """Two calls handed one cache at once: the second is refused before anything runs."""
    cache, refused = hf.RingCache(model), []

    class Again(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not refused:
                with pytest.raises(RuntimeError, match="serving another call") as error:
                    hf.generate(model, prompt(30), cache=cache, max_new_tokens=2)
                refused.append(str(error.value))
            return scores

    out = hf.generate(model, prompt(11), cache=cache, max_new_tokens=4, do_sample=False,
                      logits_processor=LogitsProcessorList([Again()]))
    assert refused and torch.equal(out, hf.generate(model, prompt(11), max_new_tokens=4,
                                                    do_sample=False))
