"""How to write ``make_step`` for four shapes of cache: the guide's adapters, each run by a test.

A ``make_step`` builds one fresh cache and returns ``step(q, k, v, positions) -> out``; the
kit does the rest (:mod:`ringviz.conformance`). Writing one is three questions: how the cache
takes a chunk, which keys it hands back (and at which positions), and how its library masks
them. Each adapter here answers them for one shape of cache that runs in the field:

* :func:`hf_layer`: a transformers cache layer (``DynamicSlidingWindowLayer``): ``update``
  returns the keys to attend; their positions are the last ones of the timeline.
* :func:`mlx_cache`: an mlx-lm cache (``RotatingKVCache``): the mask is built *before*
  ``update_and_fetch``, as mlx-lm's models do; tensors cross between torch and mlx.
* :func:`server_rows`: a server whose rows join and leave (``layout="rows"``): each row is a
  request with its own cache; a request's prompt is prefilled alone, then the requests that
  decode are merged into one batch for the step and split again.
* :func:`speculative_layer`: a speculative decoder's cache, with ``rewind(n)``: transformers'
  layer recording its past, rolled back with ``crop(-n)`` as assisted decoding does.

**A window larger than a cache's constants.** The kit checks at a small window (4 to 8) so
that a failure shrinks to a schedule of a few tokens. A cache that allocates in fixed blocks
then runs another code path than in production: mlx-lm's ``RotatingKVCache`` grows its
buffer ``step = 256`` slots at a time, up to ``max_size``, so at W = 6 it takes all six slots
on its first write, and the grow-and-copy path that runs three times on the way to
W = 1024 never runs at all. A bug on that path (an overflow at a block's end, a copy that
drops the last block) is invisible to a check at W = 6: with a grow size of 512, only windows
over 512 reach it.
Scale such constants down with the window, in the adapter, so that the small window spans
several blocks: ``mlx_cache(6, block=2)`` sets ``cache.step = 2``, and the cache grows twice
before W = 6 fills. The same holds for a page size, a chunk limit, a
preallocation length: each number that a window of 6 never reaches.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention

from ringviz.cache import MakeStep
from ringviz.conformance.probe import Unsupported


def hf_layer(window: int) -> MakeStep:
    """transformers' ``DynamicSlidingWindowLayer``, one sequence (check it with
    ``batch_size=1``).

    >>> from ringviz.conformance import check
    >>> check(hf_layer(4), window=4, examples=5).ok
    True
    """
    from transformers.cache_utils import DynamicSlidingWindowLayer

    def make_step(*, batch_size, num_heads, num_kv_heads, head_dim, dtype, device):
        layer = DynamicSlidingWindowLayer(sliding_window=window)

        def step(q, k, v, positions):
            keys, values = layer.update(k, v)  # the last W - 1 kept keys, then the chunk's
            seen = layer.get_seq_length()  # tokens so far: keys hold the last ones
            key_pos = torch.arange(seen - keys.shape[2], seen)
            q_pos = positions[0, :, None]
            mask = (key_pos <= q_pos) & (q_pos - key_pos < window)  # HF's rule: q - k < W
            return scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                enable_gqa=True)

        return step

    return make_step


def mlx_cache(window: int, block: int | None = None) -> MakeStep:
    """mlx-lm's ``RotatingKVCache(W)``, one sequence, driven as mlx-lm's models drive it;
    ``block`` scales its grow size (the class's ``step = 256``) down to a small window's."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    def make_step(*, batch_size, num_heads, num_kv_heads, head_dim, dtype, device):
        cache = RotatingKVCache(max_size=window)
        if block is not None:
            cache.step = block  # this cache's blocks only; the class keeps 256

        def step(q, k, v, positions):
            mask = cache.make_mask(q.shape[2], window_size=window)  # before the update
            keys, values = cache.update_and_fetch(mx.array(k.numpy()), mx.array(v.numpy()))
            out = mx.fast.scaled_dot_product_attention(
                mx.array(q.numpy()), keys, values, scale=q.shape[-1] ** -0.5, mask=mask)
            return torch.from_numpy(np.array(out)).to(q.dtype)

        return step

    return make_step


def server_rows(window: int) -> MakeStep:
    """A server over mlx-lm's caches, in the rows layout (``check(..., layout="rows")``):
    row ``b`` is request ``b``, with its real tokens only. A chunk of several tokens (a
    prompt, or a request's first token) is prefilled in the request's own cache; the
    requests that decode one token are merged into a ``BatchRotatingKVCache``, stepped
    together, and extracted back, so the batch changes as requests join and leave."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

    def attend(q, keys, values, mask):
        out = mx.fast.scaled_dot_product_attention(
            mx.array(q.numpy()), keys, values, scale=q.shape[-1] ** -0.5, mask=mask)
        return torch.from_numpy(np.array(out)).to(q.dtype)

    def make_step(*, batch_size, num_heads, num_kv_heads, head_dim, dtype, device):
        requests = [RotatingKVCache(max_size=window) for _ in range(batch_size)]

        def step(q, k, v, positions):  # lists, one (H, n_b, D) per row
            out = [torch.zeros_like(x) for x in q]
            decoding = [b for b, p in enumerate(positions)
                        if len(p) == 1 and not requests[b].empty()]
            for b in range(batch_size):
                if len(positions[b]) and b not in decoding:  # prefill alone
                    c = requests[b]
                    mask = c.make_mask(len(positions[b]), window_size=window)
                    keys, values = c.update_and_fetch(mx.array(k[b][None].numpy()),
                                                      mx.array(v[b][None].numpy()))
                    out[b] = attend(q[b][None], keys, values, mask)[0]
            if decoding:  # join, step together, leave
                batch = BatchRotatingKVCache.merge([requests[b] for b in decoding])
                mask = batch.make_mask(1, window_size=window)
                keys, values = batch.update_and_fetch(
                    mx.array(torch.stack([k[b] for b in decoding]).numpy()),
                    mx.array(torch.stack([v[b] for b in decoding]).numpy()))
                outs = attend(torch.stack([q[b] for b in decoding]), keys, values, mask)
                for i, b in enumerate(decoding):
                    out[b], requests[b] = outs[i], batch.extract(i)
            return out

        return step

    return make_step


class SpeculativeStep:
    """transformers' ``DynamicSlidingWindowLayer`` recording its past, as assisted decoding
    keeps it: ``rewind(n)`` is ``crop(-n)``, which can take back only tokens fed since the
    last crop (older ones are already cut to the window)."""

    def __init__(self, window: int) -> None:
        from transformers.cache_utils import DynamicSlidingWindowLayer

        self.window, self.since_crop = window, 0
        self.layer = DynamicSlidingWindowLayer(sliding_window=window)
        self.layer.activate_past_recording()

    def __call__(self, q, k, v, positions):
        keys, values = self.layer.update(k, v)
        self.since_crop += k.shape[2]
        seen = self.layer.get_seq_length()
        key_pos = torch.arange(seen - keys.shape[2], seen)
        q_pos = positions[0, :, None]
        mask = (key_pos <= q_pos) & (q_pos - key_pos < self.window)
        return scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                            enable_gqa=True)

    def rewind(self, n: int) -> None:
        """Forget the newest ``n`` tokens: ``crop(-n)``."""
        if n > self.since_crop:
            raise Unsupported(f"crop can take back the {self.since_crop} tokens fed since "
                              f"the last crop, not {n}")
        self.layer.crop(-n)
        self.since_crop = 0


def speculative_layer(window: int) -> MakeStep:
    """A :class:`SpeculativeStep` per cache (check it with ``rewind=True``)."""
    def make_step(*, batch_size, num_heads, num_kv_heads, head_dim, dtype, device):
        return SpeculativeStep(window)

    return make_step
