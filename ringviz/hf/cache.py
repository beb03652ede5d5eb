"""RingCache: a ``transformers.Cache`` made of ring layers and growing full layers."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from ringviz.checks import check_sinks
from ringviz.hf.config import read_layout
from ringviz.hf.layers import NOT_THROUGH_GENERATE, FullLayer, RingLayer
from ringviz.hf.refuse import check_rope
from ringviz.hf.rotary import model_sink_rope
from ringviz.masks import band_mask


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
        "a learned per-head attention mask (as in Doge)": any(
            callable(getattr(m, "prepare_dynamic_mask", None)) for m in model.modules()),
    }
    found = [name for name, present in features.items() if present]
    if found:
        raise ValueError(f"{config.model_type} uses {', '.join(found)}, which the ring "
                         f"attention path does not implement")


def kv_sources(config) -> list[int]:
    """Per layer, the layer whose cache it reads: itself, or for a KV-shared layer (Gemma 3n,
    Gemma 4: ``kv_sharing_modes`` "reuse") the last unshared layer of its type, as the model's
    attention reads it."""
    modes = getattr(config, "kv_sharing_modes", None) or [None] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * len(modes)
    sources = []
    for i, mode in enumerate(modes):
        if mode != "reuse":
            sources.append(i)
            continue
        owners = [j for j in range(modes.index("reuse")) if types[j] == types[i]]
        if not owners:
            raise ValueError(f"layer {i} reads keys no layer of this model writes (a draft "
                             f"assistant's layers read its target model's): RingCache cannot "
                             f"serve it")
        sources.append(owners[-1])
    return sources


class RingCache(Cache):
    """A ``transformers.Cache`` of rings (sliding layers) and growing full layers.

    ``window=None`` keeps a model's own sliding window on its sliding layers; ``window=W`` sets
    it, and on a model without one (Llama, SmolLM2) makes every layer a ring of ``W``.

    ``sinks=S`` keeps each row's first ``S`` positions in every ring beside its window (attention
    sinks; full-attention layers keep everything anyway). ``sink_rope=None`` scores them at their
    absolute positions; ``sink_rope="cache"`` at StreamingLLM's positions inside the cache, the
    sink keys turned by the model's own rotary embedding for sliding layers (Gemma 3: the local
    base, not the global one). The same choices as :class:`ringviz.models.drive.RingRunner`.
    """

    def __init__(self, model, *, window: int | None = None, sinks: int = 0,
                 sink_rope: str | None = None) -> None:
        sinks = check_sinks(sinks, sink_rope)
        check_model(model)
        layout = read_layout(model.config)
        windows = layout.windows(window)  # ValueError on a bad window
        kinds = layout.kinds
        rope = None
        if sink_rope == "cache":
            rope = model_sink_rope(model, "sliding_attention")
            check_rope(model, rope, "sliding_attention")
        layers = [RingLayer(w, sinks=sinks, sink_rope=rope) if w else FullLayer()
                  for w in windows]
        sources = kv_sources(model.config)
        # a KV-shared layer (Gemma 3n, Gemma 4) reads the keys of the layer it shares: one object
        super().__init__(layers=[layers[j] for j in sources])
        self.owners = [layers[i] for i in sorted(set(sources))]  # the layers that write
        self.config = model.config
        self.window = windows_of(windows)
        self.sinks, self.sink_rope = sinks, sink_rope
        self.kind_layer: dict[str, int] = {}  # kind -> first layer of that kind
        for i, (kind, w) in enumerate(zip(kinds, windows, strict=True)):
            first = self.kind_layer.setdefault(kind, i)
            if windows[first] != w:
                raise ValueError(f"layers {first} and {i} get the same mask but windows "
                                 f"{windows[first]} and {w}")
        self._pending: torch.Tensor | None = None  # positions of this forward's new tokens
        self.padding: torch.Tensor | None = None  # (B, T) which of them are padding
        self.chunk_padded = False  # whether this forward's chunk (T > 1) has any padding
        self._updated = 0  # layers updated in the current forward
        self._checked_kinds: set[str] = set()

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's storage (keys, values, stored positions)."""
        return sum(layer.nbytes for layer in self.owners)

    def __deepcopy__(self, memo: dict) -> RingCache:
        """An independent cache for the same model (Hugging Face's prompt-cache reuse).

        Every tensor is copied; the model's config (the identity the hooks check) and the sink
        rotation (the model's own rotary embedding) are shared, not copied.
        """
        memo[id(self.config)] = self.config
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def seen_columns(self) -> int:
        """Columns (tokens, padding included) every layer has taken so far (a host sync).

        Raises if the layers disagree: a forward stopped part-way (an exception inside the
        model, Ctrl-C) left some layers a step ahead, and decoding on would mix two states.
        """
        counts = {int(layer.get_seq_length()) for layer in self.owners}
        if len(counts) > 1:
            raise ValueError(f"this RingCache's layers hold different token counts "
                             f"{sorted(counts)}: a forward was stopped part-way; build a new "
                             f"cache (or copy.deepcopy one before a call that may be stopped)")
        return counts.pop()

    def row_tokens(self) -> torch.Tensor:
        """``(B,)`` real (unpadded) tokens each row holds: its newest position + 1."""
        ring = next(layer.ring for layer in self.layers if isinstance(layer, RingLayer))
        if ring is None:
            raise ValueError("row_tokens: this RingCache holds no tokens yet")
        return ring.lengths

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's write, at the positions this forward's mask function computed."""
        positions = self._pending
        if positions is None or positions.shape != (key_states.shape[0], key_states.shape[2]):
            raise RuntimeError(NOT_THROUGH_GENERATE)
        out = self.layers[layer_idx].update(key_states, value_states, positions=positions,
                                            padded=self.chunk_padded)
        self._updated += 1
        if self._updated == len(self.owners):  # every write done: its positions are spent
            self._pending, self._updated = None, 0  # (padding stays for the last attention)
        return out

    def start_forward(self, positions: torch.Tensor) -> None:
        """Take ``positions`` (B, T) for the layers' writes in the forward about to run.

        A chunk asks once whether it holds padding (one host sync per prefill chunk, none per
        decode step), so its layers can skip zeroing padded keys when there is none.
        """
        self._pending, self._updated = positions, 0
        self.padding = positions < 0
        self.chunk_padded = positions.shape[1] > 1 and bool(self.padding.any())

    def end_forward(self) -> None:
        """Forget the last forward's positions (a write without new ones is then refused)."""
        self._pending, self.padding, self.chunk_padded, self._updated = None, None, False, 0

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        for layer in self.owners:  # a shared layer is its source: gathered once
            layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.owners:
            layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.owners:
            layer.batch_select_indices(indices)

    def reset(self) -> None:
        for layer in self.owners:
            layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "RingCache.crop: a ring without spare slots has evicted the tokens a crop would "
            "roll back to (assisted decoding and prompt lookup need a ring with spare capacity)")

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
            keys = layer.key_positions(q_positions)
            return band_mask(q_positions, keys, layer.window, layer.sinks)[:, None]
        slots = torch.arange(layer.seen + q_positions.shape[1], device=q_positions.device)
        return ((slots <= q_positions[..., None]) & (q_positions[..., None] >= 0))[:, None]


def windows_of(windows: list[int | None]) -> int | None:
    """The one ring window of a cache (None if it has no ring)."""
    rings = {w for w in windows if w is not None}
    if len(rings) > 1:
        raise ValueError(f"RingCache supports one window per model, got {sorted(rings)}")
    return rings.pop() if rings else None
