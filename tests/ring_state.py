"""One helper for a ring's state, shared by the tests of every wing.

``ring_tensors`` is a ``RingKVCache``'s whole stored state (its layout is the subject of the
tests that compare it); ``MaskedRing`` is the ring forced onto its masked path, the twin the
no-mask fast path is compared with; ``hf_state`` is what a refused ``ringviz.hf`` call must
leave as it found: the model's attention implementation, what each layer of the cache holds,
its bytes, and the cache this thread serves.
"""

from __future__ import annotations

import torch

from ringviz import RingKVCache
from ringviz.cache import Rows
from ringviz.hf import attention


class MaskedRing(RingKVCache):
    """The masked path always: validates like the ring, then claims to know nothing."""

    def _check_call(self, *args, **kwargs) -> tuple[Rows, bool]:
        super()._check_call(*args, **kwargs)
        return Rows([0] * self.batch_size, None), False


def ring_tensors(cache: RingKVCache) -> tuple[torch.Tensor, ...]:
    """Keys, values, stored positions (spare slot included) and each row's newest position."""
    return cache._k_store, cache._v_store, cache._pos_store, cache._last_pos


def hf_state(model, cache) -> tuple:
    """The model's attention implementation, each layer's token count, the cache's bytes and
    the cache this thread serves (None outside a ring call)."""
    layers = [int(layer.get_seq_length()) for layer in cache.layers]
    return (model.config._attn_implementation, layers, cache.nbytes, attention._SERVING.cache)
