"""The hooks transformers calls: a mask function and an attention function, one name.

transformers looks both up by the model's attention implementation, read from its config in
every forward. :func:`register` puts :func:`mask_hook` in ``AttentionMaskInterface`` and
:func:`attention_hook` in ``AttentionInterface`` under :data:`ATTN_NAME`; :func:`hold` switches
a model to that name while any ring call (or probe) needs it, and the hooks decide per forward:

* a forward of this thread's ring call (:func:`ring_active`) runs the ring path: transformers
  sized its mask on that :class:`~ringviz.hf.cache.RingCache` (``cache.sized``), so the mask
  hook makes the forward's plan, and its layers then step with that plan while it is live;
* every other forward of the model meanwhile (a logits processor's or a stopping criterion's
  plain call, classifier-free guidance's unconditional pass, another thread's call) runs the
  model's own mask and attention functions, those of the implementation its config had
  before: Hugging Face's result, bit for bit, and the ring call's cache is never touched;
* a forward run inside :func:`forwards_through` (the RoPE probe, the StreamingLLM reference)
  runs the attention function it names, in this thread only.

Nothing outlives a call. The cache a call serves and a probe's function travel in a slot of
the calling thread (:data:`_SERVING`), set on entry and restored on exit; another thread sees
its own slot. What is set on a model is set and restored under one lock with a count: the
first holder switches each config, the last restores the exact value it had, whatever the
interleaving of threads, so a plain Hugging Face call afterwards is Hugging Face's. Ring calls
on one model may run at once (each thread its own cache); one cache serves one call at a time.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ringviz.hf.cache import NOT_THROUGH_GENERATE, FullLayer, RingCache
from ringviz.masks import band_mask

ATTN_NAME = "ringviz_hf"  # the attention and mask functions' name in transformers' registries


class _Serving(threading.local):
    """What this thread's forwards run: plain attributes (torch.compile reads them)."""

    cache: RingCache | None = None  # the ring call this thread runs
    attention: Callable | None = None  # run by every forward of the block (a probe)
    mask: Callable | None = None  # its mask function (None: no mask)
    weights: bool = False  # the ring call asked for attention weights (output_attentions)


@dataclass
class _Held:
    """A model held under :data:`ATTN_NAME`: by how many blocks, and what to restore."""

    count: int
    saved: list[tuple[PreTrainedConfig, str | None]]  # each switched config, its own value


_SERVING = _Serving()  # one slot per thread, set and restored by ring_active, forwards_through
_TAKE = threading.Lock()  # guards _HELD, _OWN, _BUSY and every switch of a model
_HELD: dict[int, _Held] = {}  # id(model.config) -> its hold, only while held
_OWN: dict[int, str | None] = {}  # id(config) -> its own implementation, only while held
_BUSY: set[int] = set()  # id of each RingCache serving a call now
_NOT_HELD = object()  # what _OWN gives for a config that is not held

CACHE_BUSY = ("this RingCache is serving another call now (another thread's, or a call inside "
              "a call): a cache serves one call at a time; give each call its own "
              "(copy.deepcopy(cache))")


def serving_cache(config=None) -> RingCache:
    """The RingCache this thread's ring call serves (for ``config``'s model, when given)."""
    cache = _SERVING.cache
    if cache is None or (config is not None and cache.config is not config):
        raise RuntimeError(NOT_THROUGH_GENERATE)
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


def own_implementation(config) -> str | None:
    """The attention implementation ``config`` had before it was held (its current one once
    restored: a forward that read :data:`ATTN_NAME` just before the restore still finds it)."""
    own = _OWN.get(id(config), _NOT_HELD)  # one read: another thread may restore meanwhile
    if own is not _NOT_HELD:
        return own
    with _TAKE:  # not held now, or being restored: the lock makes the two reads agree
        return _OWN.get(id(config), config._attn_implementation)


def mask_hook(*args, config=None, **kwargs):
    """transformers' mask hook: the ring's mask for a forward of this thread's ring call (see
    :func:`ring_mask`), else the mask the model's own implementation makes."""
    serving = _SERVING
    if serving.attention is not None:  # a probe's forward
        return None if serving.mask is None else serving.mask(*args, config=config, **kwargs)
    cache = serving.cache
    if cache is not None and cache.sized:  # transformers sized this mask on the ring's cache
        cache.sized = False
        return ring_mask(*args, config=config, **kwargs)
    own = own_implementation(config)
    if own not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # as transformers' early exit
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[own](*args, config=config, **kwargs)


def ring_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
              kv_offset: int = 0, mask_function: Callable | None = None,
              attention_mask: torch.Tensor | None = None, local_size: int | None = None,
              config=None, device: torch.device | str = "cpu", **kwargs) -> torch.Tensor:
    """The active RingCache's mask for this forward and layer kind.

    transformers asks once per layer kind and forward (``local_size`` set for sliding
    layers), before any layer runs; the first ask of a forward makes the cache's forward
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


def _live(cache: RingCache) -> bool:
    """Whether a forward of ``cache``'s call is under way: its plan made, a layer yet to step."""
    plan = cache.plan
    return plan.positions is not None and plan.last_layer < len(cache.layers) - 1


def own_attention(module: torch.nn.Module) -> Callable:
    """The attention function ``module`` would call under its config's own implementation
    (its modeling file's ``eager_attention_forward`` for eager, as transformers' lookup)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(own_implementation(module.config), eager)


def attention_hook(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask, *args, **kwargs):
    """transformers' attention hook: the ring step for a layer of this thread's ring forward
    (:func:`ring_attention`), a probe's function inside :func:`forwards_through`, else the
    model's own attention function."""
    serving = _SERVING
    if serving.attention is not None:
        return serving.attention(module, query, key, value, attention_mask, *args, **kwargs)
    cache = serving.cache
    if cache is not None and _live(cache):
        return ring_attention(module, query, key, value, attention_mask, *args, **kwargs)
    return own_attention(module)(module, query, key, value, attention_mask, *args, **kwargs)


def ring_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor, scaling: float,
                   dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's ring step (write, then attend) on its new tokens; with the weights each
    query gave each key (:func:`hf_weights`) when the call asked for them.

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
    cache = serving_cache()
    seen = _keys_seen(cache, module.layer_idx, key, value) if _SERVING.weights else None
    out = cache.attend(module.layer_idx, query, key, value, attention_mask, scaling)
    weights = None if seen is None else hf_weights(cache, module.layer_idx, query, scaling,
                                                   *seen)
    # HF expects (B, T, Hq, D), contiguous as its own SDPA hands it (AfMoE views it)
    return out.transpose(1, 2).contiguous(), weights


def _keys_seen(cache: RingCache, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
    """Before layer ``layer_idx`` steps: its column count, and for a ring's chunk the keys and
    their positions the chunk attends over (a chunk's write evicts keys its first queries
    see; a decode step's and a full layer's keys are read after the step)."""
    layer, positions = cache.layers[layer_idx], cache.plan.positions
    columns = int(layer.get_seq_length())
    if isinstance(layer, FullLayer) or key.shape[2] == 1:
        return columns, None, None
    if layer.ring is None:  # nothing stored yet: the chunk alone
        return columns, key, positions
    keys, _, key_pos = layer.ring.keys_with_chunk(key, value, positions)
    return columns, keys, key_pos


def hf_weights(cache: RingCache, layer_idx: int, query: torch.Tensor, scale: float,
               columns: int, keys: torch.Tensor | None, key_pos: torch.Tensor | None
               ) -> torch.Tensor:
    """``(B, Hq, T, K)``: the weights each query gave each key, in Hugging Face's layout.

    Its keys are columns in temporal order, padding included: a full layer's ``K = seen + T``
    (every column so far), a sliding layer's ``K = min(seen, W - 1) + T`` (what
    ``DynamicSlidingWindowLayer`` keeps, then the new tokens). A ring's key at position ``p``
    of row ``b`` is column ``p + pad_b`` (left padding only, so ``pad_b`` is the row's
    padding: the forward's last column is each row's newest real token). Softmax in float32,
    as Hugging Face's eager attention takes it; padding queries' rows are zero.
    """
    layer, positions = cache.layers[layer_idx], cache.plan.positions
    B, Hq, T, _ = query.shape
    if keys is None:  # read after the step: what the query saw is stored now
        if isinstance(layer, FullLayer):
            keys = layer.keys[:, :, :columns + T]
            key_pos = torch.arange(columns + T, device=query.device).expand(B, -1)
        else:
            keys, key_pos = layer.ring.k, layer.ring.positions
    keys = keys.repeat_interleave(Hq // keys.shape[1], dim=1)
    window = None if isinstance(layer, FullLayer) else layer.window
    visible = band_mask(positions, key_pos, window)[:, None] & (positions >= 0)[:, None, :, None]
    scores = (query @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    ours = torch.softmax(scores, dim=-1, dtype=torch.float32).nan_to_num(0.0).to(query.dtype)
    kept = columns if window is None else min(columns, window - 1)
    pad = (columns + T) - (positions.max(dim=-1).values + 1)  # (B,)
    index = key_pos + pad[:, None] - (columns - kept)  # (B, K): the key's place in HF's keys
    inside = (key_pos >= 0) & (index >= 0) & (index < kept + T)
    if bool((visible.any(dim=2).any(dim=1) & ~inside).any()):
        raise RuntimeError("a key the ring attended to has no place among Hugging Face's keys "
                           "(output_attentions): never returned misplaced")
    out = ours.new_zeros(B, Hq, T, kept + T + 1)  # the last column takes what has no place
    where = torch.where(inside, index, kept + T)[:, None, None, :].expand_as(ours)
    return out.scatter_(-1, where, ours)[..., :kept + T]


def register() -> None:
    """Put the mask and attention functions in transformers' registries (idempotent)."""
    AttentionInterface.register(ATTN_NAME, attention_hook)
    AttentionMaskInterface.register(ATTN_NAME, mask_hook)


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
def hold(model, configs: list | None = None) -> Iterator[list[PreTrainedConfig]]:
    """Keep ``model`` switched to :data:`ATTN_NAME` for a block; yield the configs switched.

    The first block to hold a model switches it (through ``set_attn_implementation``, which
    validates the name, unless ``configs`` lists the ones an earlier switch changed: then their
    one attribute is set), remembering each config's own value; the last to leave restores
    those exact values. Both under :data:`_TAKE`, so no interleaving of threads can leave the
    model switched, or restore it while a block still runs.
    """
    register()
    key = id(model.config)
    with _TAKE:
        held = _HELD.get(key)
        if held is None:
            held = _HELD[key] = _switch(model, configs)
        held.count += 1
    try:
        yield [config for config, _ in held.saved]
    finally:
        with _TAKE:
            held.count -= 1
            if not held.count:
                del _HELD[key]
                for config, value in held.saved:
                    config._attn_implementation_internal = value
                    _OWN.pop(id(config), None)


def _switch(model, configs: list | None) -> _Held:
    """Switch ``model``'s configs to :data:`ATTN_NAME` (under :data:`_TAKE`), or raise having
    changed nothing."""
    every = attention_configs(model) if configs is None else configs
    if any(c._attn_implementation_internal == ATTN_NAME for c in every):
        raise RuntimeError(f"{type(model).__name__}'s attention implementation is already "
                           f"{ATTN_NAME!r} outside any ring call (set by hand?): set it back "
                           f"to the model's own (e.g. model.set_attn_implementation('sdpa'))")
    before = [(c, c._attn_implementation_internal) for c in every]
    try:
        if configs is None:
            model.set_attn_implementation(ATTN_NAME)
        else:
            for config in configs:
                config._attn_implementation_internal = ATTN_NAME
    except BaseException:
        for config, value in before:
            config._attn_implementation_internal = value
        raise
    saved = [(c, value) for c, value in before if c._attn_implementation_internal == ATTN_NAME]
    _OWN.update({id(c): value for c, value in saved})
    return _Held(0, saved)


@contextmanager
def forwards_through(model, attention: Callable, mask: Callable | None = None
                     ) -> Iterator[None]:
    """In the block, every forward of ``model`` in this thread runs ``attention`` (called as
    transformers calls an attention function) and ``mask`` (default: no mask); other threads'
    forwards run the model's own. What the RoPE probe and the StreamingLLM reference run."""
    serving = _SERVING
    with hold(model):
        before = serving.cache, serving.attention, serving.mask
        serving.cache, serving.attention, serving.mask = None, attention, mask
        try:
            yield
        finally:
            serving.cache, serving.attention, serving.mask = before


def attention_implementation(model, name: str):
    """:func:`forwards_through` the attention function registered under ``name`` (and its
    mask function, if one is registered): this thread's forwards only."""
    return forwards_through(model, ALL_ATTENTION_FUNCTIONS[name],
                            ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name))


@contextmanager
def _serving_one_call(cache: RingCache) -> Iterator[None]:
    with _TAKE:
        if id(cache) in _BUSY:
            raise RuntimeError(CACHE_BUSY)
        _BUSY.add(id(cache))
    try:
        yield
    finally:
        with _TAKE:
            _BUSY.discard(id(cache))


@contextmanager
def ring_active(model, cache: RingCache, *, weights: bool = False) -> Iterator[None]:
    """Serve ``cache`` to this thread's ring forwards of ``model`` in a block: what
    :func:`generate` wraps.

    Inside, ``model(input_ids, cache=cache)`` runs the ring path (masks from the cache's stored
    positions); any other forward of the model, here or in another thread, runs the model's
    own. ``weights``: the ring's attention also returns the weights each query gave each
    key (:func:`hf_weights`, for ``output_attentions``). On exit the model's attention
    implementation is what it was (once no other call holds it) and this thread serves what
    it served before, also on error; a forward that
    raised after some of its layers had stepped leaves ``cache`` refused
    (:meth:`RingCache.check_usable`), never half-written and silently reused.
    """
    cache.check_usable()
    check_eval_mode(model)
    serving = _SERVING
    with _serving_one_call(cache), hold(model, cache.attention_configs) as configs:
        cache.attention_configs = configs
        before = serving.cache, serving.attention, serving.mask, serving.weights
        serving.cache, serving.attention, serving.mask = cache, None, None
        serving.weights = weights
        cache.sized = False
        try:
            yield
        except BaseException as error:
            cache.forward_failed(error)
            raise
        finally:
            serving.cache, serving.attention, serving.mask, serving.weights = before
            cache.end_forward()
