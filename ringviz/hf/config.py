"""One reader of a Hugging Face model's config: what the ring path needs to know about a model.

Every caller (``RingCache``, ``RingRunner``, the references, the RoPE pitfalls, StreamingLLM)
reads layer kinds, windows, head_dim and RoPE bases here, so they agree on every config:

* ``layer_types`` (Gemma 3, Qwen2) names each layer ``"sliding_attention"`` or ``"full_attention"``;
* without it (Llama, Mistral, Phi-3) every layer is of one kind: sliding when the config class
  declares ``sliding_window`` and it is set (Mistral, Phi-3's 2047), full otherwise. Llama's
  config does not declare it, and its modeling ignores one set by hand (so does this reader);
* ``head_dim`` defaults to ``hidden_size // num_attention_heads`` (Qwen2 and Phi-3 configs have
  no ``head_dim``);
* ``rope_parameters`` holds one RoPE base, or one per layer type (Gemma 3: 1e4 local, 1e6 global).

>>> from transformers import MistralConfig
>>> layout = read_layout(MistralConfig(num_hidden_layers=2, sliding_window=8))
>>> layout.kinds, layout.native_window, layout.head_dim
(('sliding', 'sliding'), 8, 128)
>>> layout.windows(4)
[4, 4]
"""

from __future__ import annotations

from dataclasses import dataclass

from ringviz.checks import check_int

LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}  # HF type -> kind
KIND_TYPES = {kind: layer_type for layer_type, kind in LAYER_TYPES.items()}


@dataclass(frozen=True)
class Layout:
    """What a model's attention layers look like to a cache."""

    kinds: tuple[str, ...]  # per layer: "full" or "sliding" (the mask transformers builds)
    native_window: int | None  # the model's own sliding window; None if no layer slides
    num_kv_heads: int
    head_dim: int
    rope_thetas: dict[str, float]  # RoPE base per kind, "full" and "sliding" (equal if one)

    @property
    def has_native_window(self) -> bool:
        """True when the model's own layers slide (Gemma 3, Mistral), False for Llama."""
        return self.native_window is not None

    def windows(self, window: int | None) -> list[int | None]:
        """Per layer: the window of its ring, or None for a full layer that keeps every token.

        A model with sliding layers keeps its split, the sliding layers using ``window``
        (default: the model's own). A model with none (Llama/SmolLM2, Qwen2 without sliding)
        gets ``window`` imposed on every layer; it must be given.
        """
        if window is None:
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
    sliding_window = getattr(config, "sliding_window", None) if declared else None
    if types is None:  # Llama/Mistral-style: one kind for all layers, set by sliding_window
        kinds = ("sliding" if sliding_window is not None else "full",) * n
    else:
        unknown = sorted(set(types) - LAYER_TYPES.keys())
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported (only "
                             f"{sorted(LAYER_TYPES)})")
        kinds = tuple(LAYER_TYPES[t] for t in types)
    native = sliding_window if "sliding" in kinds else None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return Layout(kinds, native, kv_heads, head_dim, _rope_thetas(config))


def _rope_thetas(config) -> dict[str, float]:
    """``{"full": base, "sliding": base}`` from ``rope_parameters`` (one dict, or one per type)."""
    params = getattr(config, "rope_parameters", None) or {}
    out = {}
    for kind, layer_type in KIND_TYPES.items():
        p = params.get(layer_type, params)
        if "rope_theta" in p:
            out[kind] = float(p["rope_theta"])
    return out


def layer_windows(model, window: int | None) -> list[int | None]:
    """Per layer of ``model``: its ring's window, or None for a full layer (see ``Layout``)."""
    return read_layout(model).windows(window)
