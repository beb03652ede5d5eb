"""RingCache: a ``transformers.Cache`` made of ring layers and growing full layers, and its plan."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ringviz.checks import check_sinks, sink_convention_from
from ringviz.hf.config import read_layout
from ringviz.hf.layers import FullLayer, RingLayer
from ringviz.hf.plan import NOT_THROUGH_GENERATE, ForwardPlan, positions_from_mask
from ringviz.hf.rotary import model_sink_rope


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

    ``sinks=S`` keeps each row's first ``S`` positions in every ring beside its window (attention
    sinks; full-attention layers keep everything anyway). ``sink_convention="absolute"`` scores
    them at their own positions; ``"cache"`` at StreamingLLM's positions inside the cache, the
    sink keys turned by the model's own rotary embedding for sliding layers (Gemma 3: the local
    base, not the global one). The same choices as :class:`ringviz.models.drive.RingRunner`,
    which drives a RingCache too.

    One forward: transformers asks the mask hook for each layer kind's mask, and the first ask
    fills :attr:`plan` (:meth:`make_plan`); each layer's ``update`` then hands its new tokens on,
    and the attention hook calls :meth:`attend`: the layer's step (ring write + attention) with
    the plan's mask.
    """

    def __init__(self, model, *, window: int | None = None, sinks: int = 0,
                 sink_convention: str = "absolute", sink_rope: str | None = None) -> None:
        """``sink_rope=None | "cache"``: the deprecated spelling of ``sink_convention``."""
        sink_convention = sink_convention_from(sink_convention, sink_rope)
        sinks = check_sinks(sinks, sink_convention)
        check_model(model)
        layout = read_layout(model.config)
        windows = layout.windows(window)  # ValueError on a bad window
        rope = model_sink_rope(model, "sliding_attention") if sink_convention == "cache" else None
        super().__init__(layers=[RingLayer(w, sinks=sinks, sink_rope=rope) if w else FullLayer()
                                 for w in windows])
        self.config, self.layout = model.config, layout
        self.windows = windows
        self.window = windows_of(windows)
        self.sinks, self.sink_convention = sinks, sink_convention
        self.kind_layer: dict[str, int] = {}  # kind -> first layer of that kind
        for i, (kind, w) in enumerate(zip(layout.kinds, windows, strict=True)):
            first = self.kind_layer.setdefault(kind, i)
            if windows[first] != w:
                raise ValueError(f"layers {first} and {i} get the same mask but windows "
                                 f"{windows[first]} and {w}")
        self.plan = ForwardPlan()
        self.given_positions: torch.Tensor | None = None  # the next forward's, if set
        self.switch_fast = False  # set by ring_active once the attention switch is validated
        self._checked_kinds: set[str] = set()

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's storage (keys, values, stored positions)."""
        return sum(layer.nbytes for layer in self.layers)

    def allocate(self, batch_size: int, tokens: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        """Allocate every layer now (rings: their window; full layers: ``tokens`` slots)."""
        self.reserve(tokens)
        for layer in self.layers:
            x = torch.empty(batch_size, self.layout.num_kv_heads, 0, self.layout.head_dim,
                            dtype=dtype, device=device)
            layer.lazy_initialization(x, x)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' per-layer call after RoPE: refused unless a fresh plan awaits it."""
        plan = self.plan
        if plan.positions is None or layer_idx <= plan.last_layer \
                or plan.positions.shape != (key_states.shape[0], key_states.shape[2]):
            raise RuntimeError(NOT_THROUGH_GENERATE)
        return self.layers[layer_idx].update(key_states, value_states)

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Layer ``layer_idx``'s step in this forward: write its new tokens, attend with
        ``mask`` (what transformers hands the layer: the plan's mask for its kind)."""
        self.plan.enter(layer_idx)
        return self.step_layer(layer_idx, query, key, value, mask, scale)

    def step_layer(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """The ring path of one layer: its store's step (write, then attention)."""
        return self.layers[layer_idx].step(query, key, value, self.plan.positions, mask, scale)

    def plan_mask(self, layer_idx: int) -> torch.Tensor:
        """The plan's mask for layer ``layer_idx``'s kind ``(B, 1, T, K)``."""
        return self.plan.masks[self.layout.kinds[layer_idx]]

    def make_plan(self, attention_mask: torch.Tensor | None, batch: int, T: int,
                  device: torch.device) -> ForwardPlan:
        """Fill :attr:`plan` for the forward about to run: positions, then one mask per kind.

        Positions are :attr:`given_positions` when a driver set them (RingRunner), else from
        the 2D ``attention_mask`` (what ``generate`` feeds RoPE).
        """
        if self.given_positions is not None:
            positions = self.given_positions.to(device=device, dtype=torch.int64)
            if positions.shape != (batch, T):
                raise ValueError(f"positions {tuple(positions.shape)} do not fit the forward's "
                                 f"(B, T) = {(batch, T)}")
        else:
            seen = self.layers[0].get_seq_length()  # a tensor for a ring layer: no host sync
            positions = positions_from_mask(attention_mask, seen, batch, T, device)
        masks = {kind: self.layers[i].mask(positions) for kind, i in self.kind_layer.items()}
        self.plan.fill(positions, masks)
        return self.plan

    def end_forward(self) -> None:
        """Forget the last forward's plan (a write without a new one is then refused)."""
        self.plan.clear()
        self.given_positions = None

    def reserve(self, tokens: int) -> None:
        """Size the full layers for ``tokens`` at first use (they still grow past it)."""
        for layer in self.layers:
            if isinstance(layer, FullLayer) and not layer.is_initialized:
                layer.reserve = tokens

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(
            "RingCache cannot crop, reorder or repeat its rows: a ring has evicted the tokens "
            "that beam search and assisted decoding would roll back to; use greedy or sampling")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


def windows_of(windows: list[int | None]) -> int | None:
    """The one ring window of a cache (None if it has no ring)."""
    rings = {w for w in windows if w is not None}
    if len(rings) > 1:
        raise ValueError(f"RingCache supports one window per model, got {sorted(rings)}")
    return rings.pop() if rings else None
