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

from ringviz.hf.cache import RingCache
from ringviz.hf.plan import NOT_THROUGH_GENERATE

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

    transformers calls it once per layer kind and forward (``local_size`` set for sliding
    layers), before any layer runs; the first call of a forward makes the cache's forward plan
    (positions and every kind's mask), the others read it.
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
    plan = cache.plan
    if not plan.fresh:  # the first ask of this forward
        plan = cache.make_plan(attention_mask, batch_size, q_length, torch.device(device))
    return plan.masks[kind]


def ring_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor, scaling: float,
                   dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: the layer's ring step (write, then attend) on its new tokens.

    ``key``/``value`` are the new tokens' (``RingCache.update`` hands them on); the layer's
    store writes them and attends with the forward plan's mask for its kind
    (:meth:`RingCache.attend`): SDPA, or the core's sink attention for a ring with
    StreamingLLM's sink convention.
    """
    if dropout:
        raise ValueError("RingCache attention has no dropout: generate in eval mode")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"attention argument {name!r} (soft-capping / learned sinks) is "
                             f"not implemented by the ring attention path")
    cache = _ACTIVE.cache
    if cache is None:
        raise RuntimeError(NOT_THROUGH_GENERATE)
    out = cache.attend(module.layer_idx, query, key, value, attention_mask, scaling)
    return out.transpose(1, 2), None  # HF expects (B, T, Hq, D)


def register() -> None:
    """Put the mask and attention functions in transformers' registries (idempotent)."""
    AttentionInterface.register(ATTN_NAME, ring_attention)
    AttentionMaskInterface.register(ATTN_NAME, ring_mask)


@contextmanager
def attention_implementation(model, name: str, *, one_config: bool = False) -> Iterator[None]:
    """Switch the model's attention implementation for a block, then restore it.

    ``set_attn_implementation`` validates the name and walks every module: 0.42 ms a call on
    Gemma 3 (measured, CPU), twice per ring forward. With ``one_config=True`` (every module
    reads ``model.config`` itself, see :func:`shares_one_config`; the name validated once
    already) the switch is the one config attribute ``set_attn_implementation`` itself sets.
    """
    before = model.config._attn_implementation

    def switch(impl: str) -> None:
        if one_config:
            model.config._attn_implementation_internal = impl
        else:
            model.set_attn_implementation(impl)

    switch(name)
    try:
        yield
    finally:
        switch(before)


def shares_one_config(model) -> bool:
    """True when every module reads ``model.config`` itself and it has no sub-configs."""
    config = model.config
    return not config.sub_configs and all(
        getattr(module, "config", config) is config for module in model.modules())


@contextmanager
def ring_active(model, cache: RingCache, *, fast_switch: bool = True) -> Iterator[None]:
    """Serve ``cache`` to the model's forwards in a block: what :func:`generate` wraps.

    Inside, ``model(input_ids, cache=cache)`` runs the ring path (masks from the cache's stored
    positions); on exit the attention implementation is restored, also on error. The first
    switch for a cache goes through ``set_attn_implementation`` (it validates the name); later
    ones, with ``fast_switch``, set the one config attribute (:func:`attention_implementation`).
    """
    register()
    before, _ACTIVE.cache = _ACTIVE.cache, cache
    try:
        with attention_implementation(model, ATTN_NAME,
                                      one_config=fast_switch and cache.switch_fast):
            cache.switch_fast = shares_one_config(model) if not cache.switch_fast \
                else cache.switch_fast
            yield
    finally:
        _ACTIVE.cache = before
        cache.end_forward()
