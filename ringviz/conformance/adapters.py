"""Ready ``make_step`` factories: ringviz's own caches and other libraries', driven as their
models drive them.

A factory takes the cache's settings and returns ``make_step(*, batch_size, num_heads,
num_kv_heads, head_dim)``, which builds one fresh cache and returns its
``step(q, k, v, positions) -> out`` (see :mod:`ringviz.conformance`). Storage is made on the
first call, on the inputs' device and in their dtype.
"""

from __future__ import annotations

from ringviz import RingKVCache
from ringviz.conformance.probe import MakeStep, Step


def ringviz_ring(window: int, sinks: int = 0) -> MakeStep:
    """ringviz's :class:`~ringviz.RingKVCache`: one ``step`` per chunk, absolute-position sinks.

    >>> import torch
    >>> step = ringviz_ring(4)(batch_size=1, num_heads=2, num_kv_heads=1, head_dim=8)
    >>> x = torch.zeros(1, 1, 3, 8)
    >>> step(torch.zeros(1, 2, 3, 8), x, x, torch.arange(3)[None]).shape
    torch.Size([1, 2, 3, 8])
    """
    def make_step(*, batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> Step:
        cache: list[RingKVCache] = []

        def step(q, k, v, positions):
            if not cache:
                cache.append(RingKVCache(batch_size, num_kv_heads, window, head_dim,
                                         sinks=sinks, dtype=k.dtype, device=k.device))
            return cache[0].step(q, k, v, positions)

        return step

    return make_step
