"""The RoPE pitfalls of chapter 4 (the catalogue's, through the seam) on tiny random Llama /
Gemma 3 models: symptom, then the fix."""

import pytest

transformers = pytest.importorskip("transformers")

from tiny_models import tiny_gemma, tiny_llama, tokens  # noqa: E402

from ringviz.models.bugs import bug_ring, first_divergence, rope_bases  # noqa: E402
from ringviz.models.drive import RingRunner, ring_logits  # noqa: E402
from ringviz.models.reference import reference_logits  # noqa: E402

EXACT = 1e-10  # float64: the ring and one full forward differ only by summation order


def test_double_rotation_is_right_only_at_position_0(device):
    model, window = tiny_llama(device), 8
    ids = tokens(20, device)
    ref = reference_logits(model, ids, window)
    runner = RingRunner(model, 1, window, len(ids), ring=bug_ring(model, "double_rope"))
    twice = ring_logits(runner, [ids], [6])[0]
    once = ring_logits(RingRunner(model, 1, window, len(ids)), [ids], [6])[0]
    assert (twice[0] - ref[0]).abs().max() < EXACT  # angle 0: rotating twice changes nothing
    assert first_divergence(twice, ref, tol=1e-6) == 1
    assert (once - ref).abs().max() < EXACT  # the fix: rotate once


@pytest.mark.parametrize("chunk", [None, 11, 12])  # chunks of W, a 1-column last chunk, one call
def test_batch_counter_breaks_only_the_padded_row(device, chunk):
    """A one-token step takes the batch's column counter: the first decode step, or a 1-column
    last prefill chunk (the counter cannot tell them apart), is where the padded row breaks."""
    model, window = tiny_llama(device), 8
    rows = [tokens(22, device), tokens(16, device, offset=1)]  # prompts 12 and 6: row 1 padded
    lengths = [12, 6]
    refs = [reference_logits(model, r, window) for r in rows]
    bad = ring_logits(RingRunner(model, 2, window, 30, ring=bug_ring(model, "batch_counter")),
                      rows, lengths, prefill_chunk=chunk)
    good = ring_logits(RingRunner(model, 2, window, 30), rows, lengths, prefill_chunk=chunk)
    first = lengths[1] - (chunk == 11)  # the last prompt token, or the first decode step
    assert (bad[0] - refs[0]).abs().max() < EXACT  # no padding, counter == its own position
    assert first_divergence(bad[1], refs[1], tol=1e-6) == first
    assert (bad[1][:first] - refs[1][:first]).abs().max() < EXACT  # right until then
    assert all((g - r).abs().max() < EXACT for g, r in zip(good, refs, strict=True))


def test_one_base_for_gemma_breaks_local_layers(device):
    model = tiny_gemma(device)
    assert rope_bases(model) == {"sliding_attention": 1e4, "full_attention": 1e6}
    ids = tokens(20, device)
    ref = reference_logits(model, ids, None)
    bad = ring_logits(RingRunner(model, 1, None, len(ids), ring=bug_ring(model, "one_base")),
                      [ids], [8])[0]
    good = ring_logits(RingRunner(model, 1, None, len(ids)), [ids], [8])[0]
    assert (bad[0] - ref[0]).abs().max() < EXACT  # position 0: angle 0 in any base
    assert first_divergence(bad, ref, tol=1e-6) == 1
    assert (good - ref).abs().max() < EXACT


def test_one_base_needs_two_layer_types(device):
    with pytest.raises(ValueError, match="sliding and full"):
        bug_ring(tiny_llama(device), "one_base")
