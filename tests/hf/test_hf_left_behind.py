"""Nothing left behind: after any ``ringviz.hf`` call, however it ends, the model is exactly as it
was (a plain Hugging Face call afterwards gives Hugging Face's result bit for bit), and the
caller's cache is intact or refused with a message saying why.

Each test computes Hugging Face's own results first, then runs ring calls that return, raise
(from a stopping criterion, from inside a layer), are interrupted (KeyboardInterrupt), run
beside another thread's calls or inside another call, then asks the same plain calls again.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ringviz import hf
from ringviz.models.drive import RingRunner
from tests.tiny_models import prompt, run, tiny_gemma


def plain(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's own logits and greedy tokens for a fixed prompt, no ringviz involved."""
    ids = prompt(9, seed=5)
    with torch.no_grad():
        logits = model(ids).logits
    return logits, model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)


def configs_state(model) -> list[dict]:
    """Every config's attributes (the attention implementation among them)."""
    return [dict(vars(c)) for c in hf.attention.attention_configs(model)]


def assert_model_as_before(model, before_plain, before_configs) -> None:
    assert configs_state(model) == before_configs
    after = plain(model)
    assert torch.equal(after[0], before_plain[0]) and torch.equal(after[1], before_plain[1])


class Raise(StoppingCriteria):
    """A stopping criterion that raises ``error`` on its ``at``-th call."""

    def __init__(self, error: BaseException, at: int) -> None:
        self.error, self.at, self.calls = error, at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def raise_in_layer(model, layer: int, error: BaseException, at: int):
    """A forward hook on decoder layer ``layer``'s attention raising on its ``at``-th call."""
    calls = [0]

    def hook(module, args, output):
        calls[0] += 1
        if calls[0] == at:
            raise error

    return model.model.layers[layer].self_attn.register_forward_hook(hook)


@pytest.fixture
def model():
    return tiny_gemma()


@pytest.fixture
def reference(model):
    return plain(model), configs_state(model)


def test_a_returning_call_leaves_the_model_as_it_was(model, reference):
    out = run(hf.generate, model, prompt(12), max_new_tokens=8)
    assert out.sequences.shape[1] == 20
    assert_model_as_before(model, *reference)
    assert hf.attention._SERVING.cache is None


@pytest.mark.parametrize("error", [RuntimeError("criterion failed"), KeyboardInterrupt()])
def test_raise_from_a_stopping_criterion(model, reference, error):
    cache = hf.RingCache(model)
    with pytest.raises(type(error)):
        hf.generate(model, prompt(12), cache=cache, max_new_tokens=8, do_sample=False,
                    stopping_criteria=StoppingCriteriaList([Raise(error, at=3)]))
    assert_model_as_before(model, *reference)
    with pytest.raises(RuntimeError, match=f"raised {type(error).__name__} after the cache"):
        hf.generate(model, prompt(14), cache=cache, max_new_tokens=2)
    assert_model_as_before(model, *reference)


@pytest.mark.parametrize("error", [ValueError("layer failed"), KeyboardInterrupt()])
@pytest.mark.parametrize("at", [1, 4])  # in the prefill, in a decode step
def test_raise_from_inside_a_layer(model, reference, error, at):
    cache = hf.RingCache(model)
    handle = raise_in_layer(model, 1, error, at)
    try:
        with pytest.raises(type(error)):
            hf.generate(model, prompt(12), cache=cache, max_new_tokens=8, do_sample=False)
    finally:
        handle.remove()
    assert_model_as_before(model, *reference)
    # layers 0 and 1 wrote the forward's tokens, layer 2 did not: refused, saying so
    with pytest.raises(RuntimeError, match=f"raised {type(error).__name__} after 2 of 3 layers"):
        hf.generate(model, prompt(14), cache=cache, max_new_tokens=2)
    assert_model_as_before(model, *reference)


def test_a_refused_first_forward_leaves_a_cache_that_serves(model, reference):
    cache = hf.RingCache(model)
    handle = raise_in_layer(model, 0, ValueError("before any write"), at=1)
    try:
        with pytest.raises(ValueError, match="before any write"):
            hf.generate(model, prompt(12), cache=cache, max_new_tokens=3)
    finally:
        handle.remove()
    # the hook ran after layer 0 had written: the cache is refused ...
    with pytest.raises(RuntimeError, match="after 1 of 3 layers"):
        hf.generate(model, prompt(12), cache=cache, max_new_tokens=3)
    cache.reset()  # ... until emptied
    assert torch.equal(hf.generate(model, prompt(12), cache=cache, max_new_tokens=3),
                       hf.generate(model, prompt(12), max_new_tokens=3))
    assert_model_as_before(model, *reference)


class Meet(BaseStreamer):
    """A streamer that, at its ``at``-th token, lets another thread act and waits for it."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0
        self.inside, self.done = threading.Event(), threading.Event()

    def put(self, value):
        self.calls += 1
        if self.calls == self.at:
            self.inside.set()
            assert self.done.wait(60)

    def end(self):
        pass


def test_two_threads_on_one_model(model, reference):
    ids = prompt(12)
    alone = run(hf.generate, model, ids, max_new_tokens=8).sequences
    other_alone = hf.generate(model, prompt(7), max_new_tokens=3)
    meet, results = Meet(at=4), {}
    other = hf.RingCache(model)

    def first():
        results["first"] = run(hf.generate, model, ids, max_new_tokens=8, streamer=meet)

    def second():
        assert meet.inside.wait(60)
        try:
            results["ring"] = hf.generate(model, prompt(7), cache=other, max_new_tokens=3)
            results["plain"] = plain(model)
        finally:
            meet.done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # while the first call is part-way, the second thread's ring call (its own cache) and its
    # plain calls are served, each exactly; the first call's tokens are those of the call alone
    assert torch.equal(results["ring"], other_alone)
    before_plain = reference[0]
    assert torch.equal(results["plain"][0], before_plain[0])
    assert torch.equal(results["plain"][1], before_plain[1])
    assert torch.equal(results["first"].sequences, alone)
    assert_model_as_before(model, *reference)


def test_a_call_inside_a_call(model, reference):
    """A ring call from inside a ring call (a streamer) is served with its own cache; one that
    hands it the outer call's cache is refused before anything runs."""
    inner, outer_cache = {}, hf.RingCache(model)

    class Nested(BaseStreamer):
        def put(self, value):
            if "own" not in inner:
                inner["own"] = hf.generate(model, prompt(5), max_new_tokens=2)
                with pytest.raises(RuntimeError, match="serving another call"):
                    hf.generate(model, prompt(5), cache=outer_cache, max_new_tokens=2)

        def end(self):
            pass

    out = hf.generate(model, prompt(8), cache=outer_cache, max_new_tokens=3, streamer=Nested())
    assert torch.equal(out, hf.generate(model, prompt(8), max_new_tokens=3))
    assert torch.equal(inner["own"], hf.generate(model, prompt(5), max_new_tokens=2))
    assert_model_as_before(model, *reference)


def test_a_runner_left_part_way_is_refused_until_reset(model, reference):
    ids = prompt(12)[0]
    runner = RingRunner(model, 1, None, length=16)
    positions = torch.arange(12)[None]
    clean = runner.prefill(ids[None], positions)
    runner.reset()
    handle = raise_in_layer(model, 1, KeyboardInterrupt(), at=1)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.prefill(ids[None], positions)
    finally:
        handle.remove()
    with pytest.raises(RuntimeError, match=r"after 2 of 3 layers.*runner.reset\(\)"):
        runner.forward(ids[None, :1], positions[:, :1])
    runner.reset()
    assert torch.equal(runner.prefill(ids[None], positions), clean)
    assert_model_as_before(model, *reference)
