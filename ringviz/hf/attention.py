"""The hooks transformers calls: a mask function and an attention function, one name.

transformers looks both up by the model's attention implementation. :func:`register` puts
:func:`ring_mask` in ``AttentionMaskInterface`` and :func:`attention_hook` in
``AttentionInterface`` under :data:`ATTN_NAME`; :func:`ring_active` switches a model to that name
for a block and tells the hooks which :class:`~ringviz.hf.cache.RingCache` this call serves.

Nothing outlives a call. transformers hands its mask hook no cache, so the cache travels in a
slot of the calling thread (:func:`serving_cache`), set on entry and cleared on exit; another
thread sees its own slot, never this call's cache. The model is a shared object: one ring call
holds it at a time (a second, from any thread, is refused before anything runs), and every exit
(return, exception, KeyboardInterrupt) restores each config's attention implementation to the
value it had on entry, so a plain Hugging Face call afterwards is Hugging Face's, bit for bit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PreTrainedConfig
from transformers.masking_utils import AttentionMaskInterface

from ringviz.hf.cache import NOT_THROUGH_GENERATE, RingCache
from ringviz.masks import band_mask

ATTN_NAME = "ringviz_hf"  # the attention and mask functions' name in transformers' registries


class _Serving(threading.local):
    """The cache this thread's ring call serves: a plain attribute (torch.compile reads it)."""

    cache: RingCache | None = None


_SERVING = _Serving()  # one slot per thread, set and cleared by ring_active
_TAKE = threading.Lock()  # makes "is the model free? then switch it" one step across threads

IN_USE = ("{model} is serving a ringviz.hf call already (another thread's, or a call inside a "
          "call): one ring call per model at a time; give each thread its own model "
          "(copy.deepcopy(model))")


def serving_cache(config=None) -> RingCache:
    """The RingCache this thread's ring call serves (for ``config``'s model, when given)."""
    cache = _SERVING.cache
    if cache is None or (config is not None and cache.config is not config):
        raise RuntimeError(NOT_THROUGH_GENERATE + " (Or another thread is running a ringviz.hf "
                           "call on this model: one ring call per model at a time.)")
    return cache


def attention_dropout(model) -> float:
    """The largest attention dropout any module of ``model`` would apply in train()."""
    rates = [getattr(model.config, "attention_dropout", 0.0)]
    rates += [getattr(m, "attention_dropout", 0.0) for m in model.modules()]
    return max(float(r) for r in rates if isinstance(r, (int, float)))


def check_eval_mode(model) -> None:
    """Raise if ``model`` is in train() with attention dropout (the ring attention has none)."""
    if model.training and attention_dropout(model) > 0:
        raise ValueError(f"{type(model).__name__} is in train() with attention dropout "
                         f"{attention_dropout(model)}: the ring attention has no dropout; call "
                         f"model.eval()")


def check_no_grad() -> None:
    """Raise if gradients are enabled: a ring writes its storage in place (fixed memory),
    which autograd cannot differentiate through. Asked at the start of every ring forward."""
    if torch.is_grad_enabled():
        raise ValueError("a RingCache writes its storage in place, so gradients cannot flow "
                         "through it: run the forward under torch.no_grad() (generate does)")


def _is_plain_causal(mask_function: Callable, local_size: int | None,
                     device: torch.device) -> bool:
    """True if ``mask_function`` is the plain causal (or sliding causal) rule: nothing else."""
    n = (local_size or 4) + 3
    idx = torch.arange(n, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    expected = band_mask(idx, idx, local_size or None)  # (q, kv): the window rule
    return bool(torch.equal(mask_function(zero, zero, idx[:, None], idx[None, :]).expand(n, n),
                            expected))


def ring_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
              kv_offset: int = 0, mask_function: Callable | None = None,
              attention_mask: torch.Tensor | None = None, local_size: int | None = None,
              config=None, device: torch.device | str = "cpu", **kwargs) -> torch.Tensor:
    """transformers' mask hook: the active RingCache's mask for this forward and layer kind.

    transformers calls it once per layer kind and forward (``local_size`` set for sliding
    layers), before any layer runs; the first call of a forward makes the cache's forward
    plan (positions and every kind's mask), the others read it.
    """
    cache = serving_cache(config)
    check_no_grad()  # before any layer of this forward runs
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


def attention_hook(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor, scaling: float,
                   dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: the layer's ring step (write, then attend) on its new
    tokens.

    ``key``/``value`` are the new tokens' (``RingCache.update`` hands them on); the layer's
    store writes them and attends with the forward plan's mask for its kind
    (:meth:`RingCache.attend`): SDPA, or the core's sink attention for a ring with
    StreamingLLM's sink convention.
    """
    if dropout:
        raise ValueError("RingCache attention has no dropout: generate in eval mode")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"attention argument {name!r} (soft-capping / learned sinks) "
                             f"is not implemented by the ring attention path")
    if attention_mask is not None and (attention_mask.dtype != torch.bool
                                       or attention_mask.shape[1] != 1):
        raise ValueError(f"the model changed the ring's mask into a {attention_mask.dtype} "
                         f"mask over {attention_mask.shape[1]} heads (a learned per-head "
                         f"mask, as in Doge): the ring attention path does not "
                         f"implement it")
    out = serving_cache().attend(module.layer_idx, query, key, value, attention_mask,
                                 scaling)
    # HF expects (B, T, Hq, D), contiguous as its own SDPA hands it (AfMoE views it)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Put the mask and attention functions in transformers' registries (idempotent)."""
    AttentionInterface.register(ATTN_NAME, attention_hook)
    AttentionMaskInterface.register(ATTN_NAME, ring_mask)


def attention_configs(model) -> list[PreTrainedConfig]:
    """Every config whose attention implementation ``set_attn_implementation`` may change: the
    model's, its sub-configs at any depth, and each sub-model's."""
    found: dict[int, PreTrainedConfig] = {}
    todo = [model.config] + [getattr(m, "config", None) for m in model.modules()]
    while todo:
        config = todo.pop()
        if isinstance(config, PreTrainedConfig) and id(config) not in found:
            found[id(config)] = config
            todo += [getattr(config, key, None) for key in config.sub_configs]
    return list(found.values())


@contextmanager
def attention_implementation(model, name: str, configs: list | None = None) -> Iterator[None]:
    """Switch the model's attention implementation to ``name`` for a block, then restore it.

    On exit, however the block ends, every config in ``configs`` (default:
    :func:`attention_configs`) gets back the exact value it had on entry. Given ``configs``
    (the ones an earlier ``set_attn_implementation(name)`` changed, the name validated then),
    the switch sets their one attribute; otherwise it goes through ``set_attn_implementation``.
    Refused, changing nothing, while the model already runs under ``name``.
    """
    with _TAKE:
        if model.config._attn_implementation == name:
            raise RuntimeError(IN_USE.format(model=type(model).__name__))
        saved = [(c, c._attn_implementation_internal)
                 for c in (attention_configs(model) if configs is None else configs)]
        try:
            if configs is None:
                model.set_attn_implementation(name)
            else:
                for config in configs:
                    config._attn_implementation_internal = name
        except BaseException:
            _restore(saved)
            raise
    try:
        yield
    finally:
        with _TAKE:
            _restore(saved)


def _restore(saved: list) -> None:
    for config, value in saved:
        config._attn_implementation_internal = value


@contextmanager
def ring_active(model, cache: RingCache) -> Iterator[None]:
    """Serve ``cache`` to the model's forwards in a block: what :func:`generate` wraps.

    Inside, ``model(input_ids, cache=cache)`` runs the ring path (masks from the cache's stored
    positions), in this thread only. On exit the model's attention implementation is what it
    was and this thread serves no cache, also on error; a forward that raised after some of
    its layers had stepped leaves ``cache`` refused (:meth:`RingCache.check_usable`), never
    half-written and silently reused. The first block for a cache validates the switch through
    ``set_attn_implementation``; later ones set the configs it changed.
    """
    cache.check_usable()
    check_eval_mode(model)
    register()
    configs = cache.attention_configs
    with attention_implementation(model, ATTN_NAME, configs):
        if configs is None:
            cache.attention_configs = [c for c in attention_configs(model)
                                       if c._attn_implementation_internal == ATTN_NAME]
        before, _SERVING.cache = _SERVING.cache, cache
        try:
            yield
        except BaseException as error:
            cache.forward_failed(error)
            raise
        finally:
            _SERVING.cache = before
            cache.end_forward()
