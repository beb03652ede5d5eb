"""``torch.export`` of a ring decode step: static shapes, the ring's state as module buffers.

The step is ``RingKVCache.step`` trusted (``check=False``: no host read), inside a module whose
buffers are the ring's state (every tensor of it that owns its storage). The exported program's
decomposed signature writes the keys, values and stored positions as buffer mutations, and it
decodes past several wraps of the window bit for bit as the eager ring does, its keys, values
and stored positions ending equal to the eager ring's. The module rebinds the ring to
its buffers and makes the ring's views inside ``forward``, so the writes are traced as
mutations of the buffers rather than of constants that merely alias them.
"""

import copy

import pytest
import torch

from ringviz import RingKVCache


def own_tensors(ring: RingKVCache) -> dict[str, torch.Tensor]:
    """The ring's tensors that own their storage (not views of another): its state."""
    return {name: t for name, t in vars(ring).items()
            if isinstance(t, torch.Tensor) and t._base is None}


class RingDecodeStep(torch.nn.Module):
    """One trusted decode step of ``ring``, its state the module's buffers (``ring.k``,
    ``ring.v`` and ``ring.positions`` views of them, made again inside ``forward``)."""

    def __init__(self, ring: RingKVCache) -> None:
        super().__init__()
        self.ring = ring
        self.names = sorted(own_tensors(ring))
        for name in self.names:
            self.register_buffer(name.strip("_"), getattr(ring, name))

    def forward(self, q, k, v, positions):
        for name in self.names:
            setattr(self.ring, name, getattr(self, name.strip("_")))
        self.ring._views()
        return self.ring.step(q, k, v, positions, check=False)


def storage_of(module: torch.nn.Module, view: torch.Tensor) -> str:
    """The name of the module's buffer whose storage ``view`` shares."""
    return next(name for name, b in module.named_buffers()
                if b.untyped_storage().data_ptr() == view.untyped_storage().data_ptr())


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
    module = RingDecodeStep(exported_ring)
    state = {storage_of(module, t) for t in (exported_ring.k, exported_ring.v,
                                              exported_ring.positions)}
    program = torch.export.export(module, (q, q, q, torch.full((B, 1), 6)), strict=strict)
    mutated = set(program.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert state <= mutated  # keys, values and stored positions: written as buffers
    step = program.module()
    for p in range(6, 6 + 3 * W):  # three wraps
        t = torch.randn(B, H, 1, D)
        pos = torch.full((B, 1), p)
        assert torch.equal(step(t, t, t, pos), eager.step(t, t, t, pos, check=False))
    buffers = dict(step.named_buffers())
    for name in state:  # the exported state ends where the eager ring's does
        assert torch.equal(buffers[name], getattr(eager, "_" + name)), name
