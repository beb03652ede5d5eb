"""Attention sinks on tiny random Llama / Gemma 3 models: both conventions against references.

Absolute convention: the band-with-sinks full forward (``reference_logits``). StreamingLLM's
convention: ``streaming_llm_logits``, the paper's algorithm run token by token (unrotated keys,
``[sinks | recent]``, all re-rotated inside the cache each step). Hugging Face's float32 RoPE
angles make the two conventions' rotations differ by ~p * 2**-24 rad, so the exact comparisons
run inside ``float64_rope_angles`` (both sides).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")


from tiny_models import tiny_gemma, tiny_llama, tokens  # noqa: E402

from ringviz.hf import FullLayer  # noqa: E402
from ringviz.hf.rotary import float64_rope_angles, model_sink_rope  # noqa: E402
from ringviz.models.drive import RingRunner, ring_logits  # noqa: E402
from ringviz.models.reference import reference_logits  # noqa: E402
from ringviz.models.sinks import streaming_llm_logits  # noqa: E402
from ringviz.rope import apply_rope  # noqa: E402

EXACT = 1e-10


def run_ring(model, ids, window, sinks, sink_convention, prompt):
    runner = RingRunner(model, 1, window, length=len(ids), sinks=sinks,
                        sink_convention=sink_convention)
    return ring_logits(runner, [ids], [prompt], prefill_chunk=5)[0], runner


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma])
@pytest.mark.parametrize("prompt", [1, 7, 20])  # decode only, prefill < W, prefill > S + W
def test_absolute_sinks_equal_band_with_sinks(device, make, prompt):
    model, window, sinks = make(device), 6, 2
    ids = tokens(32, device)
    ring, runner = run_ring(model, ids, window, sinks, "absolute", prompt)
    assert (ring - reference_logits(model, ids, window, sinks)).abs().max() < EXACT
    sliding = [c for c, w in zip(runner.caches, runner.windows, strict=True) if w]
    assert all(c.positions[0, :sinks].tolist() == [0, 1] for c in sliding)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma])
@pytest.mark.parametrize("prompt", [1, 7, 20])
def test_cache_position_sinks_equal_streaming_llm(device, make, prompt):
    model, window, sinks = make(device), 6, 2
    ids = tokens(32, device)
    with float64_rope_angles(model):
        ring, _ = run_ring(model, ids, window, sinks, "cache", prompt)
        ref = streaming_llm_logits(model, ids, window, sinks)
        band = reference_logits(model, ids, window, sinks)
    assert (ring - ref).abs().max() < EXACT
    # the conventions agree until the cache is full (S + W tokens), then part
    gap = (ring - band).abs().amax(dim=-1)
    assert gap[: sinks + window].max() < EXACT and gap[sinks + window:].min() > 1e-6


def test_streaming_reference_without_sinks_is_the_plain_window(device):
    model = tiny_llama(device)
    ids = tokens(24, device)
    with float64_rope_angles(model):
        ref = streaming_llm_logits(model, ids, 6, 0)
        band = reference_logits(model, ids, 6)
    assert (ref - band).abs().max() < EXACT


def test_hf_float32_angles_leave_a_small_gap(device):
    """Without float64 angles the conventions' rotations disagree at float32 angle precision."""
    model = tiny_llama(device)
    ids = tokens(32, device)
    ring, _ = run_ring(model, ids, 6, 2, "cache", 7)
    gap = float((ring - streaming_llm_logits(model, ids, 6, 2)).abs().max())
    assert 0 < gap < 1e-4


def test_ragged_padded_batch_with_sinks(device):
    model, window, sinks = tiny_llama(device), 5, 2
    rows = [tokens(26, device), tokens(21, device, offset=1)]
    with float64_rope_angles(model):
        for sink_convention in ("absolute", "cache"):
            runner = RingRunner(model, 2, window, length=26, sinks=sinks, sink_convention=sink_convention)
            got = ring_logits(runner, rows, [14, 9])
            for row, logits in zip(rows, got, strict=True):
                ref = (reference_logits(model, row, window, sinks) if sink_convention == "absolute"
                       else streaming_llm_logits(model, row, window, sinks))
                assert (logits - ref).abs().max() < EXACT


def test_gemma_sinks_rotate_with_the_local_base(device):
    model = tiny_gemma(device)
    local = model.config.rope_parameters["sliding_attention"]["rope_theta"]
    glob = model.config.rope_parameters["full_attention"]["rope_theta"]
    assert local != glob
    x = torch.randn(2, 1, 3, 16, dtype=torch.float64, device=device)
    pos = torch.tensor([[0, 5, 900], [1, 2, 3]], device=device)
    with float64_rope_angles(model):
        got = model_sink_rope(model)(x, pos)
    # HF keeps inv_freq in float32: ~4e-6 off at position 900, far from the global base's gap
    assert (got - apply_rope(x, pos, theta=local)).abs().max() < 1e-4
    assert (got - apply_rope(x, pos, theta=glob)).abs().max() > 1e-2
    runner = RingRunner(model, 1, None, length=40, sinks=2, sink_convention="cache")
    assert [getattr(c, "sinks", None) for c in runner.caches] == [2, None, 2]
    assert isinstance(runner.caches[1], FullLayer)  # the full layer keeps everything


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"sinks": -1}, ValueError),
    ({"sinks": 2.0}, TypeError),
    ({"sinks": 2, "sink_convention": "streaming"}, ValueError),
    ({"sinks": 0, "sink_convention": "cache"}, ValueError),
])
def test_runner_rejects_bad_sinks(device, kwargs, error):
    with pytest.raises(error):
        RingRunner(tiny_llama(device), 1, 6, length=10, **kwargs)


def test_stream_nll_equals_the_references(device):
    from ringviz.models.perplexity import nll
    from ringviz.models.streaming import stream_nll

    model, ids = tiny_llama(device), tokens(30, device)
    with float64_rope_angles(model):
        got = {c: stream_nll(model, ids, 6, 2, c, chunk=7) for c in ("absolute", "cache")}
        band = nll(reference_logits(model, ids, 6, 2), ids)
        streaming = nll(streaming_llm_logits(model, ids, 6, 2), ids)
    assert (got["absolute"] - band).abs().max() < EXACT
    assert (got["cache"] - streaming).abs().max() < EXACT


def test_streaming_settings_and_long_tokens():
    from ringviz.models.streaming import long_tokens, settings

    assert settings([8, 16], [0, 2]) == [(8, 0, "absolute"), (8, 2, "absolute"), (8, 2, "cache"),
                                         (16, 0, "absolute"), (16, 2, "absolute"),
                                         (16, 2, "cache")]

    def tokenizer(text):
        return {"input_ids": [ord(c) for c in text]}

    ids, copy = long_tokens(tokenizer, 3 * copy_len(tokenizer) + 5)
    assert copy == copy_len(tokenizer) and len(ids) == 3 * copy + 5
    assert torch.equal(ids[:copy], ids[copy:2 * copy])  # the story, repeated


def test_run_streaming_rejects_a_negative_past_extra():
    from ringviz.models.streaming import run_streaming

    with pytest.raises(ValueError, match="past_extra"):
        run_streaming(past_extra=-1)  # refused before any model is loaded


def copy_len(tokenizer) -> int:
    from ringviz.models.text import eval_text

    return len(tokenizer(eval_text().strip() + "\n\n")["input_ids"])
