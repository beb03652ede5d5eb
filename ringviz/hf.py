"""The ring inside Hugging Face's ``generate()``: :class:`RingCache` and :func:`generate`.

``RingCache(model)`` is a real ``transformers.Cache``. Its sliding layers are rings
(:class:`ringviz.cache.RingKVCache`: slot ``pos % W``, stored positions, one slot written per
token, never a copy of the window); its full-attention layers keep every token in storage that
grows geometrically, so no step copies their history. The data path of one layer::

    q, k, v (RoPE at absolute positions, by HF) -> cache.update: ring write at slot pos % W
        -> mask from stored positions (built once per forward per window) -> attention

Hugging Face's stock masks assume key ``i`` holds position ``kv_offset + i`` (keys in temporal
order); a ring's slots break that as soon as it wraps, is not full, takes a chunk or a padded row.
So the masks come from ringviz: a mask function registered in ``AttentionMaskInterface`` under
:data:`ATTN_NAME` (transformers calls it once per layer type and forward) reads the ring's stored
positions, and an attention function registered in ``AttentionInterface`` under the same name
applies them. :func:`generate` switches the model to that name for the call and back afterwards.
Plain ``model.generate(cache=RingCache(model))`` keeps the stock masks, so the first cache write
raises an error that names :func:`generate`; it is never silently wrong.

Positions: a row's token at absolute position ``p`` is the ``p``-th real token of that row
(``attention_mask.cumsum(-1) - 1``, what ``generate`` feeds RoPE); padding is ``-1`` and never
takes a slot.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, GenerationConfig
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.masking_utils import AttentionMaskInterface

from ringviz.cache import RingKVCache, masked_attention
from ringviz.masks import band_mask
from ringviz.models.drive import attention_implementation

ATTN_NAME = "ringviz_hf"  # the attention and mask functions' name in transformers' registries
PREFILL_CHUNK = 512  # default prefill chunk: a prompt is prefilled in chunks of this many tokens
KINDS = {"full_attention": "full", "sliding_attention": "sliding"}
SERVED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)

class _Active:
    """The cache the mask function serves (a plain attribute, which torch.compile can read)."""

    cache: RingCache | None = None


_ACTIVE = _Active()
_NOT_THROUGH_GENERATE = (
    "a RingCache's masks must come from its stored positions, but this forward used Hugging "
    "Face's stock masks (keys assumed in temporal order). Call ringviz.hf.generate(model, "
    "input_ids, ...) instead of model.generate(..., cache=RingCache(model)).")


# ---------------------------------------------------------------------------------- layers
class RingLayer(CacheLayerMixin):
    """A sliding layer: a :class:`RingKVCache` of ``window`` slots per row, made on first use."""

    is_sliding = True
    is_compileable = True  # fixed shapes; the token count is a tensor, as in HF's StaticLayer

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.ring: RingKVCache | None = None
        # tokens (columns, padding included) given so far: a 0-d tensor updated in place, so a
        # compiled decode step does not specialise (and recompile) on its value
        self.seen = torch.zeros((), dtype=torch.int64)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.ring = RingKVCache(B, H, self.window, D, dtype=key_states.dtype,
                                device=key_states.device)
        self.keys, self.values = self.ring.k, self.ring.v
        self.seen = self.seen.to(key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               positions: torch.Tensor | None = None, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``T`` tokens; return the keys/values their queries attend over.

        ``T == 1``: write the slot, return the ring itself (``window`` keys, slot order). ``T > 1``
        (a prefill chunk, possibly longer than the window): return ``[ring | chunk]`` as it was
        before the write (just the chunk into an empty ring), then write (a chunk's early
        queries still need keys it overwrites).
        """
        if positions is None:
            raise RuntimeError(_NOT_THROUGH_GENERATE)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ring, T = self.ring, key_states.shape[2]
        if T == 1:
            ring.write(key_states, value_states, positions, check=False)
            out = ring.k, ring.v
        else:
            pad = (positions < 0)[:, None, :, None]  # 0 * NaN is NaN: zero padded keys
            out = key_states.masked_fill(pad, 0.0), value_states.masked_fill(pad, 0.0)
            if not self.fresh():  # an empty ring adds nothing but W masked keys
                out = torch.cat([ring.k, out[0]], dim=2), torch.cat([ring.v, out[1]], dim=2)
            ring.write(key_states, value_states, positions, check=False)
        self.seen.add_(T)
        return out

    def fresh(self) -> bool:
        """True before the first token (a host sync: asked only for prefill chunks)."""
        return self.ring is None or int(self.seen) == 0

    def key_positions(self, q_positions: torch.Tensor) -> torch.Tensor:
        """``(B, K)`` position of each key :meth:`update` will return for these queries."""
        if q_positions.shape[1] > 1:  # a chunk: [ring | chunk], or the chunk alone at first
            if self.fresh():
                return q_positions
            return torch.cat([self.ring.positions, q_positions], dim=1)
        before = self.ring.positions if self.ring is not None else torch.full(
            (q_positions.shape[0], self.window), -1, dtype=torch.int64, device=q_positions.device)
        slots = torch.arange(self.window, device=before.device)
        return torch.where(slots == q_positions % self.window, q_positions, before)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length == 1:
            return self.window, 0
        return (0 if self.fresh() else self.window) + query_length, 0

    def get_seq_length(self) -> torch.Tensor:
        return self.seen

    def get_max_length(self) -> int:
        return self.window

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes if self.ring is not None else 0

    def reset(self) -> None:
        if self.ring is not None:
            self.ring.reset()
        self.seen.zero_()


class FullLayer(CacheLayerMixin):
    """A full-attention layer: row ``b``'s token at position ``p`` lives in slot ``p``.

    Storage grows by doubling (amortised O(1) per token, never a copy of the whole history per
    step); one spare slot past the end takes padding writes. Slot ``j`` holds position ``j``, so
    the stored positions are implicit and a query at ``p`` sees slots ``0..p``.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        self.capacity = 0
        self.capacity_hint = 0  # tokens to allocate for at first use (set by generate)
        self._k_store: torch.Tensor | None = None
        self._v_store: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, T, D = key_states.shape
        self._allocate(key_states.new_zeros(B, H, 0, D), value_states.new_zeros(B, H, 0, D),
                       max(self.capacity_hint, T))
        self.is_initialized = True

    def _allocate(self, k_old: torch.Tensor, v_old: torch.Tensor, capacity: int) -> None:
        B, H, n, D = k_old.shape
        self._k_store = k_old.new_zeros(B, H, capacity + 1, D)  # + the spare slot
        self._v_store = v_old.new_zeros(B, H, capacity + 1, v_old.shape[3])
        self._k_store[:, :, :n] = k_old
        self._v_store[:, :, :n] = v_old
        self.capacity = capacity
        self.keys, self.values = self._k_store[:, :, :capacity], self._v_store[:, :, :capacity]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               positions: torch.Tensor | None = None, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``T`` tokens at slots = their positions; return slots ``0 .. seen+T-1``."""
        if positions is None:
            raise RuntimeError(_NOT_THROUGH_GENERATE)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, T, D = key_states.shape
        need = self.seen + T  # positions never exceed column indices, so slots stay < need
        if need > self.capacity:
            self._allocate(self.keys[:, :, :self.seen], self.values[:, :, :self.seen],
                           max(need, 2 * self.capacity))
        slot = torch.where(positions >= 0, positions, self.capacity)  # (B, T); spare for pads
        if T == 1:
            rows = torch.arange(B, device=slot.device)
            self._k_store[rows, :, slot[:, 0]] = key_states[:, :, 0]
            self._v_store[rows, :, slot[:, 0]] = value_states[:, :, 0]
        else:
            self._k_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), key_states)
            self._v_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), value_states)
        self.seen = need
        return self._k_store[:, :, :need], self._v_store[:, :, :need]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    @property
    def nbytes(self) -> int:
        stores = [t for t in (self._k_store, self._v_store) if t is not None]
        return sum(t.numel() * t.element_size() for t in stores)

    def reset(self) -> None:
        if self._k_store is not None:
            self._k_store.zero_()
            self._v_store.zero_()
        self.seen = 0


# ---------------------------------------------------------------------------------- the cache
def _layer_kinds(config) -> list[str]:
    """Per layer, which mask transformers builds for it: ``"full"`` or ``"sliding"``."""
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral-style: one kind for all layers, set by config.sliding_window
        kind = "sliding" if getattr(config, "sliding_window", None) is not None else "full"
        return [kind] * config.num_hidden_layers
    unknown = sorted(set(types) - KINDS.keys())
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported by RingCache "
                         f"(only {sorted(KINDS)})")
    return [KINDS[t] for t in types]


def layer_windows(config, window: int | None) -> list[int | None]:
    """Per layer: its ring's window, or None for a full layer that keeps every token.

    A model with sliding layers keeps its split (their window: ``window``, default its own); a
    model with none (Llama, Qwen2 without sliding) gets ``window`` on every layer.
    """
    kinds = _layer_kinds(config)
    native = "sliding" in kinds
    if window is None:
        if not native:
            raise ValueError(f"{config.model_type} has no native sliding window: pass window=W")
        window = config.sliding_window
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be a positive int, got {window!r}")
    return [window if kind == "sliding" or not native else None for kind in kinds]


def check_model(model) -> None:
    """Raise on attention features the ring path does not implement, naming the feature."""
    config = model.config
    if config.get_text_config() is not config or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__}: RingCache serves decoder-only text models")
    features = {
        "attention logit soft-capping (as in Gemma 2)":
            getattr(config, "attn_logit_softcapping", None) is not None,
        "learned attention sinks (as in gpt-oss)": any(
            isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()),
        "ALiBi position biases": bool(getattr(config, "alibi", False))
            or config.model_type in ("bloom", "mpt") or "alibi" in str(
                getattr(config, "position_embedding_type", "")),
        "bidirectional attention": bool(getattr(config, "use_bidirectional_attention", False)),
        "chunked attention": getattr(config, "attention_chunk_size", None) is not None,
    }
    found = [name for name, present in features.items() if present]
    if found:
        raise ValueError(f"{config.model_type} uses {', '.join(found)}, which the ring "
                         f"attention path does not implement")


class RingCache(Cache):
    """A ``transformers.Cache`` of rings (sliding layers) and growing full layers.

    ``window=None`` keeps a model's own sliding window on its sliding layers; ``window=W`` sets
    it, and on a model without one (Llama, SmolLM2) makes every layer a ring of ``W``.
    """

    def __init__(self, model, *, window: int | None = None) -> None:
        check_model(model)
        windows = layer_windows(model.config, window)  # ValueError on a bad window
        kinds = _layer_kinds(model.config)
        super().__init__(layers=[RingLayer(w) if w else FullLayer() for w in windows])
        self.config = model.config
        self.window = windows_of(windows)
        self.kind_layer: dict[str, int] = {}  # kind -> first layer of that kind
        for i, (kind, w) in enumerate(zip(kinds, windows, strict=True)):
            first = self.kind_layer.setdefault(kind, i)
            if windows[first] != w:
                raise ValueError(f"layers {first} and {i} get the same mask but windows "
                                 f"{windows[first]} and {w}")
        self._pending: torch.Tensor | None = None  # positions of this forward's new tokens
        self._updated = 0  # layers updated in the current forward
        self._checked_kinds: set[str] = set()

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's storage (keys, values, stored positions)."""
        return sum(layer.nbytes for layer in self.layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's write, at the positions this forward's mask function computed."""
        positions = self._pending
        if positions is None or positions.shape != (key_states.shape[0], key_states.shape[2]):
            raise RuntimeError(_NOT_THROUGH_GENERATE)
        out = self.layers[layer_idx].update(key_states, value_states, positions=positions)
        self._updated += 1
        if self._updated == len(self.layers):  # the forward is done: its positions are spent
            self._pending, self._updated = None, 0
        return out

    def reserve(self, tokens: int) -> None:
        """Size the full layers for ``tokens`` at first use (they still grow past it)."""
        for layer in self.layers:
            if isinstance(layer, FullLayer) and not layer.is_initialized:
                layer.capacity_hint = tokens

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(
            "RingCache cannot crop, reorder or repeat its rows: a ring has evicted the tokens "
            "that beam search and assisted decoding would roll back to; use greedy or sampling")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported

    # ------------------------------------------------------------------ masks
    def new_positions(self, attention_mask: torch.Tensor | None, batch: int, T: int,
                      device: torch.device) -> torch.Tensor:
        """``(B, T)`` absolute positions of the new tokens (-1 = padding), from the 2D mask."""
        seen = self.layers[0].get_seq_length()  # a tensor for a ring layer: no host sync
        if attention_mask is None:
            return (seen + torch.arange(T, device=device)).expand(batch, T)
        if attention_mask.shape != (batch, int(seen) + T):
            raise ValueError(f"attention_mask must cover every token so far: (B, seen + T) = "
                             f"{(batch, int(seen) + T)}, got {tuple(attention_mask.shape)}")
        mask = attention_mask.to(device=device, dtype=torch.bool)
        positions = mask.long().cumsum(-1)[:, -T:] - 1
        return positions.masked_fill(~mask[:, -T:], -1)

    def build_mask(self, kind: str, q_positions: torch.Tensor) -> torch.Tensor:
        """Bool ``(B, 1, T, K)`` visibility of the keys the layers of ``kind`` will return."""
        layer = self.layers[self.kind_layer[kind]]
        if isinstance(layer, RingLayer):
            return band_mask(q_positions, layer.key_positions(q_positions), layer.window)[:, None]
        slots = torch.arange(layer.seen + q_positions.shape[1], device=q_positions.device)
        return ((slots <= q_positions[..., None]) & (q_positions[..., None] >= 0))[:, None]


def windows_of(windows: list[int | None]) -> int | None:
    """The one ring window of a cache (None if it has no ring)."""
    rings = {w for w in windows if w is not None}
    if len(rings) > 1:
        raise ValueError(f"RingCache supports one window per model, got {sorted(rings)}")
    return rings.pop() if rings else None


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
        raise RuntimeError(_NOT_THROUGH_GENERATE)
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
    cache._pending, cache._updated = positions, 0
    return cache.build_mask(kind, positions)


def ring_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor, scaling: float,
                   dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: SDPA over the layer's cache keys with the ring's mask."""
    if dropout:
        raise ValueError("RingCache attention has no dropout: generate in eval mode")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"attention argument {name!r} (soft-capping / learned sinks) is "
                             f"not implemented by the ring attention path")
    out = masked_attention(query, key, value, attention_mask[:, 0], scale=scaling)
    return out.transpose(1, 2), None  # HF expects (B, T, Hq, D)


def register() -> None:
    """Put the mask and attention functions in transformers' registries (idempotent)."""
    AttentionInterface.register(ATTN_NAME, ring_attention)
    AttentionMaskInterface.register(ATTN_NAME, ring_mask)


# ---------------------------------------------------------------------------------- generate
def _generation_config(model, kwargs: dict) -> GenerationConfig:
    """The generation config this call would use (a copy: the model's stays untouched)."""
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config


def _check_call(model, kwargs: dict, config: GenerationConfig) -> None:
    """Raise on what a ring cannot serve, before anything runs."""
    for name, why in (("past_key_values", "pass cache= (a RingCache) instead"),
                      ("position_ids", "positions come from attention_mask"),
                      ("cache_implementation", "the cache is a RingCache")):
        if kwargs.get(name) is not None:
            raise ValueError(f"ringviz.hf.generate does not take {name}: {why}")
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    if mode not in SERVED_MODES:
        raise ValueError(f"generation mode {mode.value!r} is not supported by RingCache: it "
                         f"needs crop/reorder of tokens a ring has evicted; use greedy or "
                         f"sampling (num_beams=1, no assistant)")
    if config.output_attentions:
        raise ValueError("output_attentions is not supported: the ring attention returns no "
                         "weights")
    if config.use_cache is False:
        raise ValueError("use_cache=False would bypass the RingCache")


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
        cache._pending, cache._updated = None, 0


def generate(model, input_ids: torch.Tensor | None = None, *, window: int | None = None,
             **kwargs):
    """``model.generate(input_ids, **kwargs)`` decoded through a :class:`RingCache`.

    A fresh ``RingCache(model, window=window)`` unless ``cache=`` passes one (unused, built for
    this model). The prompt is prefilled in chunks of ``prefill_chunk_size`` tokens
    (default :data:`PREFILL_CHUNK`). Greedy and sampling only.
    """
    cache = kwargs.pop("cache", None)
    config = _generation_config(model, kwargs)
    _check_call(model, kwargs, config)
    if cache is None:
        cache = RingCache(model, window=window)
    elif not isinstance(cache, RingCache) or cache.config is not model.config:
        raise ValueError("cache= must be a RingCache built for this model")
    elif window is not None and window != cache.window:
        raise ValueError(f"window={window} differs from the cache's window {cache.window}")
    elif cache.get_seq_length() > 0:
        raise ValueError("this RingCache already holds tokens: pass a fresh one")
    if config.prefill_chunk_size is None:
        kwargs["prefill_chunk_size"] = PREFILL_CHUNK
    if config.cache_implementation is not None:  # a model default (e.g. Gemma 3's "hybrid")
        kwargs["cache_implementation"] = None  # would clash with cache=: the ring replaces it
    if input_ids is not None and config.max_new_tokens is not None:
        cache.reserve(input_ids.shape[-1] + config.max_new_tokens)
    with ring_active(model, cache):
        return model.generate(input_ids, cache=cache, **kwargs)


__all__ = ["ATTN_NAME", "PREFILL_CHUNK", "FullLayer", "RingCache", "RingLayer", "generate",
           "register", "ring_active"]
