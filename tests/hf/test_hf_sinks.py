"""ringviz.hf with attention sinks: generate() equals RingRunner's ring, in both conventions.

The reference is :class:`ringviz.models.drive.RingRunner` with the same ``sinks`` and
``sink_convention``, teacher-forced on the sequence ``generate`` produced (``ring_logits``); it is
itself checked against the band-with-sinks recompute and StreamingLLM's algorithm in
``test_models_sinks.py``. Both sides use the model's own (float32-angle) RoPE, so they agree to
float64 rounding. Tiny random float64 models: Llama with an imposed window, Gemma 3 with its own.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ring_state import hf_state  # noqa: E402
from tiny_models import Collect, prompt, run, tiny_gemma, tiny_llama  # noqa: E402

from ringviz import hf  # noqa: E402
from ringviz.models.drive import RingRunner, ring_logits  # noqa: E402
from ringviz.models.load import norms_in_model_dtype  # noqa: E402

EXACT = 1e-10
SINKS = 2
MODELS = {"llama": (tiny_llama, 5), "gemma3": (tiny_gemma, 6)}  # imposed W=5; native W=6


def make(name: str):
    """A tiny float64 model whose RMSNorms compute in float64 (HF casts them to float32, which
    turns summation-order noise into ~1e-8 differences), and its window."""
    build, window = MODELS[name]
    model = build()
    assert norms_in_model_dtype(model) > 0
    return model, window


def generate(model, ids, window, sink_convention, new, **kwargs):
    """Greedy ``hf.generate`` with sinks; Gemma 3 keeps its native window (window=None).

    ``generate`` casts its scores to float32, so a hook keeps the model's own float64 logits
    of each forward: ``out.logits64`` ``(B, new, vocab)``, the last column of the last prefill
    chunk and of every decode step.
    """
    imposed = window if model.config.model_type == "llama" else None
    seen = []
    hook = model.register_forward_hook(lambda m, args, out: seen.append(out.logits[:, -1]))
    try:
        out = run(hf.generate, model, ids, window=imposed, sinks=SINKS,
                  sink_convention=sink_convention, max_new_tokens=new, min_new_tokens=new,
                  **kwargs)
    finally:
        hook.remove()
    out.logits64 = torch.stack(seen[-new:], dim=1)
    assert out.logits64.dtype == torch.float64
    return out


def runner_logits(model, seq, window, prompt_len, sink_convention):
    """RingRunner's teacher-forced logits ``(L, vocab)`` for one row ``seq``."""
    runner = RingRunner(model, 1, window, len(seq), sinks=SINKS, sink_convention=sink_convention)
    return ring_logits(runner, [seq], [prompt_len])[0]


def score_gap(out, ref_logits, prompt_len, row=0) -> torch.Tensor:
    """Per generated token: max |generate's float64 logits - the reference logits| (new,)."""
    ref = ref_logits[prompt_len - 1:-1]  # (new, vocab): the logits that chose each new token
    return (out.logits64[row] - ref).abs().amax(dim=-1)


def assert_equal_run(out, ref_logits, prompt_len, row=0) -> None:
    """``out`` is the reference's run: float64 logits <= EXACT, the same greedy tokens, and
    generate's float32 scores at float32 rounding (but the EOS column, which
    ``min_new_tokens`` sets to -inf so that every run has its full length)."""
    assert score_gap(out, ref_logits, prompt_len, row).max() <= EXACT
    ref = ref_logits[prompt_len - 1:-1]
    new = out.sequences[row, -ref.shape[0]:]
    assert torch.equal(new, ref.argmax(-1))
    scores = torch.stack(out.scores, dim=1)[row]
    finite = torch.isfinite(scores)
    assert finite.sum(-1).min() >= scores.shape[-1] - 1  # at most the EOS column per step
    assert (scores - ref).abs().masked_fill(~finite, 0.0).max() < 1e-6


# ------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("sink_convention", ["absolute", "cache"])
@pytest.mark.parametrize(("prompt_len", "chunk"), [(3, 512), (13, 4), (13, 9)])
def test_generate_equals_ring_runner(name, sink_convention, prompt_len, chunk):
    """Prompts shorter and longer than S + W, prefill chunks < and > W, 5 W new tokens."""
    model, W = make(name)
    ids = prompt(prompt_len)
    out = generate(model, ids, W, sink_convention, 5 * W, prefill_chunk_size=chunk)
    seq = out.sequences[0]
    ref = runner_logits(model, seq, W, prompt_len, sink_convention)
    assert_equal_run(out, ref, prompt_len)
    rings = [layer.ring for layer in out.cache.layers if isinstance(layer, hf.RingLayer)]
    assert rings and all(r.positions[0, :SINKS].tolist() == [0, 1] for r in rings)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_two_conventions_part_after_the_cache_fills(name):
    """The same tokens under the other convention: equal up to position S + W - 1, then not."""
    model, W = make(name)
    prompt_len = 4
    out = generate(model, prompt(prompt_len), W, "cache", 4 * W)
    other = runner_logits(model, out.sequences[0], W, prompt_len, "absolute")
    gap = score_gap(out, other, prompt_len)  # gap[i]: the query at position prompt_len - 1 + i
    full = SINKS + W - 1 - (prompt_len - 1)  # first query whose sinks are shifted
    assert gap[:full + 1].max() <= EXACT and gap[full + 1:].min() > 1e-6


def test_sinks_change_the_output_past_the_window():
    """sinks=2 is not the plain ring: the scores part once the first tokens leave the window."""
    model, W = make("llama")
    out = generate(model, prompt(3), W, "absolute", 4 * W)
    plain = RingRunner(model, 1, W, out.sequences.shape[1])
    gap = score_gap(out, ring_logits(plain, [out.sequences[0]], [3])[0], 3)
    assert gap[:W - 2].max() <= EXACT and gap[W - 2:].min() > 1e-6  # query at W sees 0 no more


@pytest.mark.parametrize("sink_convention", ["absolute", "cache"])
def test_left_padded_batch_rows_match_their_own_runs(sink_convention):
    """Rows of 14, 9 and 3 real tokens (W = 6): each equals RingRunner on that row alone."""
    model, W = make("gemma3")
    ids = prompt(14, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :5], mask[2, :11] = 0, 0
    out = generate(model, ids.masked_fill(mask == 0, 0), W, sink_convention, 4 * W,
                   attention_mask=mask, prefill_chunk_size=4)
    for b, start in enumerate((0, 5, 11)):
        seq = out.sequences[b, start:]
        ref = runner_logits(model, seq, W, 14 - start, sink_convention)
        assert_equal_run(out, ref, 14 - start, row=b)


def test_ring_memory_is_fixed_with_sinks():
    """Every ring holds S + W slots per row (+ the spare): the same bytes at 20 and 210 tokens."""
    model, W = make("gemma3")
    cache = hf.RingCache(model, sinks=SINKS, sink_convention="cache")
    streamer = Collect(cache)
    hf.generate(model, prompt(10), cache=cache, sinks=SINKS, sink_convention="cache",
                max_new_tokens=201, min_new_tokens=201, do_sample=False, streamer=streamer)
    rings = [layer.ring for layer in cache.layers if isinstance(layer, hf.RingLayer)]
    assert all(r.k.shape[2] == SINKS + W for r in rings)
    H, D = model.config.num_key_value_heads, model.config.head_dim
    per_ring = (SINKS + W + 1) * (2 * H * D * 8 + 8)  # k, v in float64, positions in int64
    assert streamer.ring_bytes[20] == streamer.ring_bytes[210] == len(rings) * per_ring


# ------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"sinks": -1}, ValueError, "sinks must be >= 0"),
    ({"sinks": 1.5}, TypeError, "sinks must be an int"),
    ({"sinks": True}, TypeError, "sinks must be an int"),
    ({"sinks": 2, "sink_convention": None}, ValueError, "sink_convention must be one of"),
    ({"sinks": 2, "sink_convention": lambda x, p: x}, ValueError, "sink_convention must be one of"),
    ({"sink_convention": "cache"}, ValueError, "needs sinks >= 1"),
])
def test_bad_sink_arguments_raise_and_change_nothing(kwargs, error, match):
    model = tiny_gemma(dtype=torch.float32)
    with pytest.raises(error, match=match):
        hf.RingCache(model, **kwargs)
    with pytest.raises(error, match=match):
        RingRunner(model, 1, None, 16, **kwargs)  # the same rule, the same words
    cache = hf.RingCache(model)
    state = hf_state(model, cache)
    with pytest.raises(error, match=match):
        hf.generate(model, prompt(8), max_new_tokens=3, **kwargs)
    with pytest.raises(error, match=match):
        hf.generate(model, prompt(8), cache=cache, max_new_tokens=3, **kwargs)
    assert state == hf_state(model, cache)


@pytest.mark.parametrize("kwargs", [{"sinks": 1}, {"sinks": 2, "sink_convention": "absolute"},
                                    {"sinks": 3, "sink_convention": "cache"}])
def test_a_cache_with_other_sinks_is_refused(kwargs):
    model = tiny_gemma(dtype=torch.float32)
    cache = hf.RingCache(model, sinks=2, sink_convention="cache")
    with pytest.raises(ValueError, match="differs from the cache's"):
        hf.generate(model, prompt(8), cache=cache, max_new_tokens=3, **kwargs)
    assert cache.get_seq_length() == 0 and cache.nbytes == 0


# ------------------------------------------------------------------------- the real model
@pytest.mark.slow
@pytest.mark.parametrize("sink_convention", ["absolute", "cache"])
def test_gemma3_270m_with_sinks_equals_ring_runner_past_its_window(sink_convention):
    """Gemma 3 270M (float32, local RoPE base for the sinks): a 600-token prompt, 64 new."""
    from ringviz.models.load import load_model
    from ringviz.models.text import eval_tokens

    model, tokenizer = load_model("gemma3")
    ids = eval_tokens(tokenizer, 600)[None]  # longer than the window of 512
    new = 64
    seen = []
    hook = model.register_forward_hook(lambda m, args, out: seen.append(out.logits[:, -1]))
    try:
        out = run(hf.generate, model, ids, sinks=4, sink_convention=sink_convention, max_new_tokens=new,
                  min_new_tokens=new)
    finally:
        hook.remove()
    seq = out.sequences[0]
    runner = RingRunner(model, 1, None, len(seq), sinks=4, sink_convention=sink_convention)
    ref = ring_logits(runner, [seq], [ids.shape[1]])[0][ids.shape[1] - 1:-1]
    assert (torch.stack(seen[-new:], dim=1)[0] - ref).abs().max() < 1e-3
    assert torch.equal(seq[ids.shape[1]:], ref.argmax(-1))
