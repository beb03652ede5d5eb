"""Speculative greedy decoding on a tiny random Llama: the fixes equal plain greedy decoding."""

import pytest
import torch

transformers = pytest.importorskip("transformers")


from tiny_models import tiny_gemma, tiny_llama, tokens  # noqa: E402

from ringviz.book.speculative import CommitAcceptedRing, OverwritingRing, SpareSlotsRing  # noqa: E402
from ringviz.models.reference import reference_greedy, reference_logits  # noqa: E402
from ringviz.models.speculative import DraftRunner, speculative_generate  # noqa: E402

EXACT = 1e-10


def oracle(model, prompt, window, new, k):
    """A draft that knows the greedy continuation but gets every third guess wrong."""
    truth = torch.cat([prompt, reference_greedy(model, prompt, new + k + 1, window)]).tolist()

    def draft(seq, k):
        n = len(seq)
        return [truth[n + j] if (n + j) % 3 else (truth[n + j] + 1) % 97 for j in range(k)]
    return draft


def run(model, engine, prompt, window, k=4, new=24):
    runner = DraftRunner(model, engine, window, k, length=len(prompt) + new + k + 1)
    out, logits, kept = speculative_generate(runner, prompt, new,
                                             draft=oracle(model, prompt, window, new, k))
    ref = reference_logits(model, torch.cat([prompt, out[:-1]]), window)
    return out, float((logits - ref).abs().max()), kept


@pytest.mark.parametrize("engine", [SpareSlotsRing, CommitAcceptedRing])
def test_fixes_generate_exactly_what_greedy_decoding_does(device, engine):
    model, window = tiny_llama(device), 6
    prompt = tokens(18, device)
    out, err, kept = run(model, engine, prompt, window)
    assert torch.equal(out, reference_greedy(model, prompt, 24, window))
    assert err < EXACT
    assert max(kept) > 1 and min(kept) < 5  # some drafts accepted, some rejected


def test_fixes_on_gemma_hybrid_layers(device):
    model = tiny_gemma(device, window=6)  # sliding layers of 6, a full layer in between
    prompt = tokens(14, device)
    for engine in (SpareSlotsRing, CommitAcceptedRing):
        out, err, _ = run(model, engine, prompt, None, k=3, new=16)
        assert err < EXACT and torch.equal(out, reference_greedy(model, prompt, 16, None))


def test_naive_ring_gets_the_target_logits_wrong(device):
    model, window = tiny_llama(device), 6
    prompt = tokens(18, device)
    _, err, kept = run(model, OverwritingRing, prompt, window)
    assert min(kept) <= 5 - 2  # a cycle rejected two or more tokens
    assert err > 1e-3


def test_bad_calls():
    model = tiny_llama("cpu")
    runner = DraftRunner(model, SpareSlotsRing, 6, 2, length=40, batch_size=2)
    with pytest.raises(ValueError, match="decodes one row"):
        speculative_generate(runner, tokens(5, "cpu"), 4)
    one = DraftRunner(model, SpareSlotsRing, 6, 2, length=40)
    with pytest.raises(ValueError, match="draft proposed 1 tokens, not k = 2"):
        speculative_generate(one, tokens(5, "cpu"), 4, draft=lambda seq, k: [0])
    runner = DraftRunner(model, SpareSlotsRing, 6, 2, length=40)
    runner.forward(tokens(5, "cpu")[None], torch.arange(5)[None])
    with pytest.raises(ValueError, match="at most max_draft \\+ 1 = 3 tokens"):
        runner.verify(tokens(4, "cpu")[None], torch.arange(5, 9)[None])
    assert all(ring.lengths.tolist() == [5] for ring in runner.engines)  # nothing changed
    with pytest.raises(ValueError, match="commit\\(\\) needs a verify\\(\\) first"):
        runner.commit(torch.tensor([1]))


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma])
def test_a_reset_runner_decodes_as_a_fresh_one(make):
    model, prompt, k, new = make("cpu"), tokens(14, "cpu"), 3, 12
    runner = DraftRunner(model, SpareSlotsRing, 6, k, length=len(prompt) + new + k + 1)
    draft = oracle(model, prompt, 6, new, k)
    first = speculative_generate(runner, prompt, new, draft=draft)
    runner.reset()  # the engines go with the layers they served: the next run makes new ones
    again = speculative_generate(runner, prompt, new, draft=draft)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert first[2] == again[2] and len(runner.engines) == sum(w is not None for w in runner.windows)
