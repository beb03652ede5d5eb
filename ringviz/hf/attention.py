"""The hooks transformers calls: a mask function and an attention function, one name.

transformers looks both up by the model's attention implementation. :func:`register` puts
:func:`ring_mask` in ``AttentionMaskInterface`` and :func:`ring_attention` in
``AttentionInterface`` under :data:`ATTN_NAME`; :func:`ring_active` switches a model to that name
for a block and tells the mask function which :class:`~ringviz.hf.cache.RingCache` to serve.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ringviz.attention import masked_attention
from ringviz.hf.cache import RingCache
from ringviz.hf.layers import NOT_THROUGH_GENERATE, RingLayer
from ringviz.models.drive import attention_implementation

ATTN_NAME = "ringviz_hf"  # the attention and mask functions' name in transformers' registries


class _Active:
    """The cache the mask function serves (a plain attribute, which torch.compile can read)."""

    cache: RingCache | None = None


_ACTIVE = _Active()


def _is_plain_causal(mask_function: Callable, local_size: int | None,
                     device: torch.device) -> bool:
    """True if ``mask_function`` is the plain causal (or sliding causal) rule: nothing else."""
    n = (local_size or 4) + 3
    q = torch.arange(n, device=device)[:, None]
    kv = torch.arange(n, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.int64, device=device)
    expected = (kv <= q) & ((kv > q - local_size) if local_size else True)
    return bool(torch.equal(mask_function(zero, zero, q, kv).expand(n, n), expected))


def ring_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
              kv_offset: int = 0, mask_function: Callable | None = None,
              attention_mask: torch.Tensor | None = None, local_size: int | None = None,
              config=None, device: torch.device | str = "cpu", **kwargs) -> torch.Tensor:
    """transformers' mask hook: the active RingCache's mask for this forward and layer kind.

    transformers calls it once per layer type and forward (``local_size`` set for sliding
    layers). It also records the new tokens' positions, which the layers' writes then use.
    """
    cache = _ACTIVE.cache
    if cache is None or cache.config is not config:
        raise RuntimeError(NOT_THROUGH_GENERATE)
    kind = "full" if local_size is None else "sliding"
    if kind not in cache.kind_layer:
        raise RuntimeError(f"transformers asked for a {kind} mask, but the model's config "
                           f"declares no {kind} layer")
    if kind not in cache._checked_kinds:
        if mask_function is not None and not _is_plain_causal(mask_function, local_size,
                                                               torch.device(device)):
            raise ValueError("the model asks for a mask beyond causal/sliding causal (e.g. "
                             "bidirectional spans or image tokens): RingCache does not "
                             "implement it")
        cache._checked_kinds.add(kind)
    positions = cache.new_positions(attention_mask, batch_size, q_length, torch.device(device))
    cache.start_forward(positions)
    return cache.build_mask(kind, positions)


def ring_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor, scaling: float,
                   dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: SDPA over the layer's cache keys with the ring's mask.

    A ring with StreamingLLM's sink convention (``sink_rope="cache"``) attends through the
    core's own sink attention instead (:meth:`RingLayer.attention`), its sink columns turned per
    query; every other layer, and every layer of a cache without it, through SDPA.
    """
    if dropout:
        raise ValueError("RingCache attention has no dropout: generate in eval mode")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"attention argument {name!r} (soft-capping / learned sinks) is "
                             f"not implemented by the ring attention path")
    cache = _ACTIVE.cache
    if cache is not None and cache.sink_rope is not None:
        layer = cache.layers[module.layer_idx]
        if isinstance(layer, RingLayer):
            out = layer.attention(query, key, value, attention_mask[:, 0], scaling)
            return out.transpose(1, 2), None
    # the rows that see nothing are the padding queries, known once per forward (no reduction
    # over the mask in every layer)
    empty = cache.padding if cache is not None else None
    out = masked_attention(query, key, value, attention_mask[:, 0], scale=scaling, empty=empty)
    return out.transpose(1, 2), None  # HF expects (B, T, Hq, D)


def register() -> None:
    """Put the mask and attention functions in transformers' registries (idempotent)."""
    AttentionInterface.register(ATTN_NAME, ring_attention)
    AttentionMaskInterface.register(ATTN_NAME, ring_mask)


@contextmanager
def ring_active(model, cache: RingCache) -> Iterator[None]:
    """Serve ``cache`` to the model's forwards in a block: what :func:`generate` wraps.

    Inside, ``model(input_ids, cache=cache)`` runs the ring path (masks from the cache's stored
    positions); on exit the attention implementation is restored, also on error.
    """
    register()
    before, _ACTIVE.cache = _ACTIVE.cache, cache
    try:
        with attention_implementation(model, ATTN_NAME):
            yield
    finally:
        _ACTIVE.cache = before
        cache.end_forward()
