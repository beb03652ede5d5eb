"""``torch.export`` of a ring decode step: static shapes, the ring's state as module buffers.

The step is ``RingKVCache.step`` trusted (``check=False``: no host read), inside a module whose
buffers are the ring's storage (keys, values, stored positions, each row's newest position).
The exported program's decomposed signature mutates exactly those buffers, and it decodes past
several wraps of the window bit for bit as the eager ring does. The module rebinds the ring to
its buffers and makes the ring's views inside ``forward``, so the writes are traced as
mutations of the buffers rather than of constants that merely alias them.
"""

import copy

import pytest
import torch

from ringviz import RingKVCache

STORES = {"_k_store": "k_store", "_v_store": "v_store", "_pos_store": "positions",
          "_last_pos": "newest", "_runs": "runs"}


class RingDecodeStep(torch.nn.Module):
    """One trusted decode step of ``ring``, its storage the module's buffers."""

    def __init__(self, ring: RingKVCache) -> None:
        super().__init__()
        self.ring = ring
        for attr, name in STORES.items():
            self.register_buffer(name, getattr(ring, attr))

    def forward(self, q, k, v, positions):
        for attr, name in STORES.items():
            setattr(self.ring, attr, getattr(self, name))
        self.ring._views()
        return self.ring.step(q, k, v, positions, check=False)


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("strict", [False, True])
def test_exported_decode_step_mutates_the_ring_buffers_and_matches_eager(sinks, strict):
    B, H, W, D = 2, 2, 4, 8
    torch.manual_seed(0)
    x = torch.randn(B, H, 6, D)
    eager = RingKVCache(B, H, W, D, sinks=sinks)
    eager.step(x, x, x, torch.arange(6).expand(B, 6))
    exported_ring = copy.deepcopy(eager)
    q = torch.randn(B, H, 1, D)
    program = torch.export.export(RingDecodeStep(exported_ring), (q, q, q, torch.full((B, 1), 6)),
                                  strict=strict)
    mutated = set(program.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert mutated == {"k_store", "v_store", "positions", "newest"}  # runs: a trusted step
    step = program.module()
    for p in range(6, 6 + 3 * W):  # three wraps
        t = torch.randn(B, H, 1, D)
        pos = torch.full((B, 1), p)
        assert torch.equal(step(t, t, t, pos), eager.step(t, t, t, pos, check=False))
    buffers = dict(step.named_buffers())
    assert torch.equal(buffers["k_store"], eager._k_store)
    assert torch.equal(buffers["positions"], eager._pos_store)
