"""ringviz.hf with assisted decoding and prompt lookup: rejected drafts cropped inside rings
with spare slots (chapter 13's rollback, inside ``generate``).

Both are lossless: the tokens equal plain greedy decoding. Tiny random float64 models, far past
several wraps of the ring; the same model as its own assistant (every draft accepted) and an
unrelated one (most drafts rejected, so most steps crop).
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import F64, max_score_diff, prompt, run, tiny_gemma, tiny_mistral  # noqa: E402

from ringviz import hf  # noqa: E402


def _crops(monkeypatch):
    taken = []
    real = hf.RingCache.crop

    def spy(self, tokens_to_remove):
        taken.append(-tokens_to_remove)
        return real(self, tokens_to_remove)

    monkeypatch.setattr(hf.RingCache, "crop", spy)
    return taken


@pytest.mark.parametrize("make", [tiny_gemma, tiny_mistral])
@pytest.mark.parametrize("helper", ["prompt_lookup", "same_assistant", "other_assistant"])
def test_assisted_decoding_equals_plain_greedy(make, helper, monkeypatch):
    model = make()
    W = model.config.sliding_window
    ids = torch.cat([prompt(2 * W), prompt(2 * W)], dim=1)  # a repeat for prompt lookup
    ref = run(None, model, ids, max_new_tokens=8 * W)
    kwargs = {"prompt_lookup": {"prompt_lookup_num_tokens": 4},
              "same_assistant": {"assistant_model": copy.deepcopy(model)},
              "other_assistant": {"assistant_model": make()}}[helper]
    for assistant in [kwargs.get("assistant_model")] if "assistant_model" in kwargs else []:
        assistant.generation_config.assistant_confidence_threshold = 0.0  # full 20-token drafts
    crops = _crops(monkeypatch)
    out = run(hf.generate, model, ids, max_new_tokens=8 * W, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_score_diff(out, ref) < F64
    draft = 4 if helper == "prompt_lookup" else 20  # transformers' constant schedule
    assert out.cache.draft == draft and W < out.cache.layers[0].ring.capacity <= W + draft
    if helper == "other_assistant":
        assert max(crops) > 2 * W  # rejected drafts longer than the window were taken back


def test_heuristic_drafts_take_the_slots_they_use_not_max_new_tokens(monkeypatch):
    """The heuristic schedule may draft up to every new token, so the cache allows a draft of
    max_new_tokens; the rings grow draft slots only for the drafts that come (one verified
    chunk of T tokens may lose T - 1), not 500 slots up front (267,168 bytes before, on W = 5).
    """
    model = tiny_mistral()
    W, new = model.config.sliding_window, 120
    assistant = copy.deepcopy(model)  # every draft accepted: the schedule grows them by 2
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    chunks = []
    real = hf.RingCache._fit_rings

    def spy(self, T):
        chunks.append(min(T - 1, self._columns + T - self.prompt[0]))  # drafts in the chunk
        return real(self, T)

    monkeypatch.setattr(hf.RingCache, "_fit_rings", spy)
    ids = prompt(2 * W)
    out = run(hf.generate, model, ids, max_new_tokens=new, assistant_model=assistant)
    assert torch.equal(out.sequences, run(None, model, ids, max_new_tokens=new).sequences)
    longest = max(chunks)
    assert out.cache.draft == new and 5 < longest < new // 2
    assert out.cache.layers[0].ring.capacity == W + longest


def test_a_cache_without_enough_spare_slots_is_refused_up_front():
    model = tiny_gemma()
    cache = hf.RingCache(model, draft=2)
    with pytest.raises(ValueError, match="draft=4"):
        hf.generate(model, prompt(9), cache=cache, max_new_tokens=5, prompt_lookup_num_tokens=4)
    assert cache.nbytes == 0
    out = run(hf.generate, model, prompt(9), cache=cache, max_new_tokens=5,
              prompt_lookup_num_tokens=2)
    assert torch.equal(out.sequences, run(None, model, prompt(9), max_new_tokens=5).sequences)


def test_crop_past_the_spare_slots_raises_and_changes_nothing():
    """A crop past ``draft`` is refused by the cache; one past the draft slots the rings grew
    (for the drafts that came: none here, the lookup found no match) by the ring, naming the
    positions it no longer holds. Neither changes anything; a crop the ring can serve works."""
    model = tiny_gemma()
    out = run(hf.generate, model, prompt(20), max_new_tokens=3, prompt_lookup_num_tokens=3)
    cache = out.cache
    assert cache.layers[0].ring.capacity == model.config.sliding_window  # no draft came
    before = cache.layers[0].ring.positions.clone(), int(cache.get_seq_length())
    for n, error, match in ((4, NotImplementedError, "spare slots for 3"),
                            (3, ValueError, "overwrote them")):
        with pytest.raises(error, match=match):
            cache.crop(-n)
        assert torch.equal(cache.layers[0].ring.positions, before[0])
        assert int(cache.get_seq_length()) == before[1]
    cache.crop(-1)
    assert int(cache.get_seq_length()) == before[1] - 1
    assert int(cache.layers[1].get_seq_length()) == before[1] - 1


def test_other_candidate_generators_are_refused_with_the_reason():
    model = tiny_gemma()
    with pytest.raises(ValueError, match="assistant_early_exit"):
        hf.generate(model, prompt(9), max_new_tokens=3, assistant_early_exit=1)
    with pytest.raises(ValueError, match="the model itself"):
        hf.generate(model, prompt(9), max_new_tokens=3, assistant_model=model)
