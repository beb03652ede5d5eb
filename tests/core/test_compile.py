"""A ring step compiles: ``torch.compile(fullgraph=True)`` of a trusted chunk and decode step
traces with no host read, equals eager, and compiles once per shape (no recompile as the ring
fills, wraps and its positions move on).

A validated step reads the positions on the host (that is what checking them means), so the
compiled step is the trusted one, ``check=False``, as ``ringviz.hf``'s compiled decode calls it.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from ringviz import RingKVCache
from ringviz.rope import apply_rope

B, H, D, W = 2, 2, 8, 6


def trusted_step(cache: RingKVCache, q, k, v, pos) -> torch.Tensor:
    return cache.step(q, k, v, pos, check=False)


def calls(decode: int) -> list[tuple[torch.Tensor, ...]]:
    """(q, k, v, positions): a prompt of 4 (row 1 left-padded by one) into the empty ring, a
    decode step, a chunk of 3 that wraps the ring, then ``decode`` more decode steps."""
    gen = torch.Generator().manual_seed(0)
    nxt = torch.tensor([[5], [4]])
    positions = [torch.tensor([[0, 1, 2, 3], [-1, 0, 1, 2]]), nxt - 1, nxt + torch.arange(3)]
    positions += [nxt + 3 + i for i in range(decode)]
    return [(torch.randn(B, 2 * H, p.shape[1], D, generator=gen),
             torch.randn(B, H, p.shape[1], D, generator=gen),
             torch.randn(B, H, p.shape[1], D, generator=gen), p) for p in positions]


@pytest.mark.parametrize("kwargs", [{}, {"sinks": 2}, {"capacity": W + 2},
                                    {"sinks": 1, "sink_rope": apply_rope}],
                         ids=["plain", "sinks", "draft", "sink_rope"])
def test_compiled_trusted_steps_equal_eager_and_never_recompile(kwargs):
    """Inductor for the plain ring; dynamo alone (backend="eager", the same tracing, no
    host read allowed) for the others, to keep the test short."""
    torch._dynamo.reset()
    counters.clear()
    inputs = calls(3 * W)
    compiled = torch.compile(trusted_step, fullgraph=True,
                             backend="eager" if kwargs else "inductor")
    cache, ref = RingKVCache(B, H, W, D, **kwargs), RingKVCache(B, H, W, D, **kwargs)
    for i, args in enumerate(inputs):
        if i == 3:  # warm-up done: one graph per shape (chunk into empty ring, decode, chunk)
            graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=i >= 3):
            out = compiled(cache, *args)
        torch.testing.assert_close(out, trusted_step(ref, *args), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == graphs == 3
    for a, b in zip((cache.k, cache.v, cache.positions), (ref.k, ref.v, ref.positions),
                    strict=True):
        assert torch.equal(a, b)
