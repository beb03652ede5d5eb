"""The ring path compiled as transformers 5.24 compiles it: through ``generate``.

transformers compiles the forward its ``generate`` calls, the chunked prefill's chunks as well
as the decode steps, and builds the masks of a compileable cache outside the graph
(``prepare_inputs_for_generation``). A test that compiles ``model.forward`` for decode steps
after an eager prefill (``test_hf.py``) misses both: the chunk's data-dependent reads and the
masks' shapes. Here a tiny model's ring ``generate`` runs with ``compile_config``
(``fullgraph=True``: a graph break raises), on a sliding-only model and on a hybrid one (Gemma
3: its full layers static, :meth:`~ringviz.hf.RingCache.allocate`), against the same call
eager: the same tokens, and no graph compiled after the first call.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import prompt, tiny_gemma, tiny_mistral  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from ringviz import hf  # noqa: E402

NEW = 14  # decode steps: past several wraps of each tiny window (5 and 6)


def compile_config(backend: str) -> CompileConfig:
    config = CompileConfig(fullgraph=True, backend=backend,
                           mode="default" if backend == "inductor" else None)
    config._compile_all_devices = True  # transformers compiles on accelerators only
    return config


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def ring_generate(model, ids, mask, backend: str | None, **cache_kwargs) -> torch.Tensor:
    """Greedy ring generate, compiled with ``backend`` (None: eager), into a fresh cache
    allocated whole for the call (a compiled step can neither grow nor allocate)."""
    cache = hf.RingCache(model, **cache_kwargs)
    cache.allocate(ids.shape[0], ids.shape[1] + NEW, model.dtype, model.device, static=True)
    kwargs = {} if backend is None else {"compile_config": compile_config(backend),
                                         "disable_compile": False}
    return hf.generate(model, ids, cache=cache, attention_mask=mask, max_new_tokens=NEW,
                       min_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)


CASES = {
    "mistral": (tiny_mistral, {}, 1),  # every layer a ring
    "gemma3": (tiny_gemma, {}, 1),  # sliding and full layers
    "gemma3_sinks_padded": (tiny_gemma, {"sinks": 2, "sink_convention": "cache"}, 2),
}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor",
                                                               marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_ring_generate_matches_eager_and_never_recompiles(case, backend):
    make, cache_kwargs, batch = CASES[case]
    torch._dynamo.reset()
    model = make(dtype=torch.float32)
    ids = prompt(9, batch=batch)
    mask = torch.ones_like(ids)
    mask[1:, :3] = 0  # the second row (if any) left-padded
    eager = ring_generate(model, ids, mask, None, **cache_kwargs)
    before = graphs()
    first = ring_generate(model, ids, mask, backend, **cache_kwargs)
    compiled = graphs() - before
    again = [ring_generate(model, ids, mask, backend, **cache_kwargs) for _ in range(2)]
    assert compiled == 2  # the prefill chunk and the decode step, each one graph
    assert graphs() - before == compiled  # warm: no recompile
    for out in (first, *again):
        assert torch.equal(out, eager)


def test_generate_allocates_the_cache_a_compiled_call_needs():
    """Without ``cache=``, ``ringviz.hf.generate`` allocates its fresh cache whole for a call
    that may compile: the eager tokens, no recompile on the next call."""
    torch._dynamo.reset()
    model = tiny_gemma(dtype=torch.float32)
    ids = prompt(9)
    kwargs = {"max_new_tokens": NEW, "min_new_tokens": NEW, "do_sample": False}
    eager = hf.generate(model, ids, **kwargs)
    compiled = [hf.generate(model, ids, compile_config=compile_config("aot_eager"),
                            disable_compile=False, **kwargs) for _ in range(2)]
    before = graphs()
    compiled.append(hf.generate(model, ids, compile_config=compile_config("aot_eager"),
                                disable_compile=False, **kwargs))
    assert graphs() == before
    assert all(torch.equal(out, eager) for out in compiled)


def test_a_compiled_forward_without_whole_storage_is_refused():
    """A decode step compiled into a cache that was not allocated for it (its rings grown to
    the eager prefill's 3 tokens, not their window): refused with the way out, not a wrong
    result (nothing can grow or allocate inside the graph)."""
    torch._dynamo.reset()
    model = tiny_gemma(dtype=torch.float32)
    forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    cache = hf.RingCache(model)
    with torch.no_grad(), hf.ring_active(model, cache):
        token = model(input_ids=prompt(3), cache=cache).logits[:, -1:].argmax(-1)
        assert cache.layers[0].slots == 3
        with pytest.raises(Exception, match="allocate"):
            forward(input_ids=token, cache=cache)
