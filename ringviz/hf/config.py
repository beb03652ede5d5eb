"""One reader of a Hugging Face model's config: what the ring path needs to know about a model.

Every caller (``RingCache``, ``RingRunner``, the references, the RoPE pitfalls, StreamingLLM)
reads layer kinds, windows, head_dim and RoPE bases here, so they agree on every config:

* ``layer_types`` (Gemma 3, Qwen2) names each layer ``"sliding_attention"`` or ``"full_attention"``;
* without it (Llama, Mistral, Phi-3) every layer is of one kind: sliding when the config class
  declares ``sliding_window`` and it is set (Mistral, Phi-3's 2047), full otherwise. Llama's
  config does not declare it, and its modeling ignores one set by hand (so does this reader);
* a config with ``layer_types`` sets its window as an attribute it may not declare
  (ModernBERT-decoder: ``local_attention // 2``), read as such;
* ``head_dim`` (a key's size: ``qk_head_dim`` where a config has one) defaults to
  ``hidden_size // num_attention_heads`` (Qwen2 and Phi-3 configs have no ``head_dim``); a
  heterogeneous config (Gemma 4: 256 on sliding layers, 512 on full ones) gives it, and
  ``num_key_value_heads``, per layer (``config.per_layer_config[i]``), as transformers' own
  layers read them;
* ``rope_parameters`` holds one RoPE base, or one per layer type (Gemma 3: 1e4 local, 1e6 global;
  Beam: None, no RoPE, on its full layers).

Two kinds of model are refused here, naming what they do: keys and values of different head
sizes (multi-head latent attention: DeepSeek-V3, MiniCPM3), and a declared window that the
model's own attention ignores (:data:`IGNORED_WINDOW`), which serves only with ``window=W``.

>>> from transformers import MistralConfig
>>> layout = read_layout(MistralConfig(num_hidden_layers=2, sliding_window=8))
>>> layout.kinds, layout.native_window, layout.head_dims
(('sliding', 'sliding'), 8, (128, 128))
>>> layout.windows(4)
[4, 4]
"""

from __future__ import annotations

from dataclasses import dataclass

from ringviz.checks import check_int

LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}  # HF type -> kind
KIND_TYPES = {kind: layer_type for layer_type, kind in LAYER_TYPES.items()}
# model types whose config declares ``sliding_window`` but whose attention never applies it:
# Hugging Face's own forward is then full causal while its generate's cache keeps a window, so
# the two disagree and no window is "the model's own"
IGNORED_WINDOW = {"moshi": "Moshi's attention masks ignore it (its forward is full causal) "
                           "while Hugging Face's generate keeps only that window in its cache"}


@dataclass(frozen=True)
class Layout:
    """What a model's attention layers look like to a cache."""

    kinds: tuple[str, ...]  # per layer: "full" or "sliding" (the mask transformers builds)
    native_window: int | None  # the model's own sliding window; None if no layer slides
    kv_heads: tuple[int, ...]  # per layer
    head_dims: tuple[int, ...]  # per layer
    rope_thetas: dict[str, float]  # RoPE base per kind with RoPE, "full" and/or "sliding"
    ignored_window: str | None = None  # why a declared window is not the model's own

    @property
    def num_kv_heads(self) -> int:
        """The one KV-head count of every layer (ValueError where layers differ)."""
        return _one("num_key_value_heads", self.kv_heads)

    @property
    def head_dim(self) -> int:
        """The one head size of every layer (ValueError where layers differ, as in Gemma 4)."""
        return _one("head_dim", self.head_dims)

    @property
    def has_native_window(self) -> bool:
        """True when the model's own layers slide (Gemma 3, Mistral), False for Llama (and for
        a declared window the model's attention ignores, as Moshi's)."""
        return self.native_window is not None and self.ignored_window is None

    def windows(self, window: int | None) -> list[int | None]:
        """Per layer: the window of its ring, or None for a full layer that keeps every token.

        A model with sliding layers keeps its split, the sliding layers using ``window``
        (default: the model's own). A model with none (Llama/SmolLM2, Qwen2 without sliding)
        gets ``window`` imposed on every layer; it must be given.
        """
        if window is None:
            if self.ignored_window:
                raise ValueError(f"this config declares sliding_window={self.native_window}, "
                                 f"but {self.ignored_window}: the two disagree, so ringviz "
                                 f"does not guess; pass window=W for a window of W on every "
                                 f"layer")
            if not self.has_native_window:
                raise ValueError("this model has no native sliding window: pass window=W")
            window = self.native_window
        window = check_int("window", window)
        return [window if kind == "sliding" or not self.has_native_window else None
                for kind in self.kinds]

    def rope_theta(self, kind: str = "sliding") -> float:
        """RoPE base of a layer kind (the one base when the model has one for all layers)."""
        if kind not in self.rope_thetas:
            raise ValueError(f"this config names no RoPE base for {kind!r} layers")
        return self.rope_thetas[kind]


def read_layout(config) -> Layout:
    """The :class:`Layout` of a transformers config (or of ``model.config``)."""
    config = getattr(config, "config", config)  # a model: its config
    n = check_int("num_hidden_layers", config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    declared = "sliding_window" in getattr(type(config), "__dataclass_fields__", {})
    sliding_window = getattr(config, "sliding_window", None) if declared or types else None
    if types is None:  # Llama/Mistral-style: one kind for all layers, set by sliding_window
        kinds = ("sliding" if sliding_window is not None else "full",) * n
    else:
        unknown = sorted(set(types) - LAYER_TYPES.keys())
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported (only "
                             f"{sorted(LAYER_TYPES)})")
        kinds = tuple(LAYER_TYPES[t] for t in types)
    native = sliding_window if "sliding" in kinds else None
    check_equal_head_sizes(config)
    layers = _layer_configs(config, n)
    head_dims = tuple(getattr(c, "qk_head_dim", None) or getattr(c, "head_dim", None)
                      or c.hidden_size // c.num_attention_heads for c in layers)
    kv_heads = tuple(getattr(c, "num_key_value_heads", None) or c.num_attention_heads
                     for c in layers)
    ignored = IGNORED_WINDOW.get(config.model_type) if native is not None else None
    return Layout(kinds, native, kv_heads, head_dims, _rope_thetas(config), ignored)


def _layer_configs(config, n: int) -> list:
    """Each layer's config: ``per_layer_config[i]`` where attributes vary by layer (Gemma 4),
    else the one config."""
    if getattr(config, "is_heterogeneous", False):
        return [config.per_layer_config[i] for i in range(n)]
    return [config] * n


def _one(name: str, values: tuple[int, ...]) -> int:
    if len(set(values)) != 1:
        raise ValueError(f"{name} differs between layers ({sorted(set(values))}): read it per "
                         f"layer")
    return values[0]


def check_equal_head_sizes(config) -> None:
    """Raise if keys and values have different head sizes (multi-head latent attention)."""
    key = getattr(config, "qk_head_dim", None)
    value = getattr(config, "v_head_dim", None)
    if key is not None and value is not None and key != value:
        raise ValueError(f"{config.model_type} has keys of head size {key} and values of {value} "
                         f"(multi-head latent attention): a ring stores keys and values of one "
                         f"head size, so it cannot serve this model")


def _rope_thetas(config) -> dict[str, float]:
    """``{"full": base, "sliding": base}`` from ``rope_parameters`` (one dict, or one per type)."""
    params = getattr(config, "rope_parameters", None) or {}
    out = {}
    for kind, layer_type in KIND_TYPES.items():
        p = params.get(layer_type, params)
        if p is not None and "rope_theta" in p:  # None: that kind has no RoPE (Beam)
            out[kind] = float(p["rope_theta"])
    return out


def layer_windows(model, window: int | None) -> list[int | None]:
    """Per layer of ``model``: its ring's window, or None for a full layer (see ``Layout``)."""
    return read_layout(model).windows(window)
