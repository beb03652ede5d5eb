"""RingCache: a ``transformers.Cache`` made of ring layers and growing full layers, and its plan."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from ringviz.checks import check_int, check_sinks, sink_convention_from
from ringviz.hf.config import read_layout
from ringviz.hf.layers import FullLayer, RingLayer
from ringviz.hf.plan import NOT_THROUGH_GENERATE, ForwardPlan, positions_from_mask
from ringviz.hf.refuse import check_rope
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
        "a learned per-head attention mask (as in Doge)": any(
            callable(getattr(m, "prepare_dynamic_mask", None)) for m in model.modules()),
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

    ``draft=K`` gives every ring ``K`` spare slots (capacity ``window + K``, masks still
    ``window``), so :meth:`crop` can take back a rejected draft of up to ``K`` tokens: assisted
    decoding and prompt lookup (chapter 13's rollback), which :func:`~ringviz.hf.generate`
    sizes from the call.

    One forward: transformers asks the mask hook for each layer kind's mask, and the first ask
    fills :attr:`plan` (:meth:`make_plan`); each layer's ``update`` then hands its new tokens on,
    and the attention hook calls :meth:`attend`: the layer's step (ring write + attention) with
    the plan's mask.
    """

    def __init__(self, model, *, window: int | None = None, sinks: int = 0,
                 sink_convention: str = "absolute", sink_rope: str | None = None,
                 draft: int = 0) -> None:
        """``sink_rope=None | "cache"``: the deprecated spelling of ``sink_convention``."""
        sink_convention = sink_convention_from(sink_convention, sink_rope)
        sinks = check_sinks(sinks, sink_convention)
        self.draft = check_int("draft", draft, minimum=0)
        check_model(model)
        layout = read_layout(model.config)
        windows = layout.windows(window)  # ValueError on a bad window
        rope = None
        if sink_convention == "cache":
            rope = model_sink_rope(model, "sliding_attention")
            check_rope(model, rope, "sliding_attention")
        check_kv_sharing(model.config)
        super().__init__(layers=[RingLayer(w, sinks=sinks, sink_rope=rope, draft=self.draft)
                                 if w else FullLayer() for w in windows])
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
        # the configs ring_active switches (found by its first, validated switch)
        self.attention_configs: list | None = None
        self.refused: str | None = None  # why this cache may not be used again, if it may not
        self._checked_kinds: set[str] = set()
        # What the cache was told, on the host (never read back in a decode step): columns so
        # far, the fewest real tokens any row has, and generate's prompt (columns, fewest real)
        # after which every column is a real token (generate appends one per row and step).
        self._columns = 0
        self._real_least = 0
        self.prompt: tuple[int, int] | None = None
        self._visible: dict[str, torch.Tensor] = {}  # per kind: its all-True decode mask

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's storage (keys, values, stored positions)."""
        return sum(layer.nbytes for layer in self.layers)

    def __deepcopy__(self, memo: dict) -> RingCache:
        """An independent cache for the same model (Hugging Face's prompt-cache reuse).

        Every tensor is copied; the model's config (the identity the hooks check) and the sink
        rotation (the model's own rotary embedding) are shared, not copied.
        """
        for config in (self.config, *(self.attention_configs or ())):
            memo[id(config)] = config
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def seen_columns(self) -> int:
        """Columns (tokens, padding included) every layer has taken so far (a host sync)."""
        self.check_usable()
        return int(self.layers[0].get_seq_length())

    def check_usable(self) -> None:
        """Raise if a call that failed part-way left this cache refused (:meth:`forward_failed`)."""
        if self.refused is not None:
            raise RuntimeError(self.refused)

    def forward_failed(self, error: BaseException) -> None:
        """A ring call raised ``error``: refuse this cache from now on if it stopped a forward
        part-way, some layers written and the rest not.

        Decoding on would mix two states. Nothing is rolled back (a ring has overwritten what
        it would need).
        """
        if 0 <= self.plan.done < len(self.layers) - 1:
            self.refuse(f"a forward raised {type(error).__name__} after {self.plan.done + 1} "
                        f"of {len(self.layers)} layers had written its tokens")

    def refuse(self, what: str) -> None:
        """Mark this cache unusable, saying why, until :meth:`reset` empties it."""
        self.refused = (f"this RingCache cannot be used again: {what}. Build a new one, or "
                        f"copy.deepcopy a cache before a call that may fail")

    def row_tokens(self) -> torch.Tensor:
        """``(B,)`` real (unpadded) tokens each row holds: its newest position + 1."""
        ring = next(layer.ring for layer in self.layers if isinstance(layer, RingLayer))
        if ring is None:
            raise ValueError("row_tokens: this RingCache holds no tokens yet")
        return ring.lengths

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
        out = self.step_layer(layer_idx, query, key, value, mask, scale)
        self.plan.done = layer_idx
        return out

    def step_layer(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """The ring path of one layer: its store's step (write, then attention). Handed the
        plan's own mask for the layer's kind, its all-True one (:meth:`_plan`) attends without
        a mask and a causal first chunk's (:meth:`_causal`) with SDPA's causal mask; any other
        mask (a replaced mask hook's) is used as given."""
        plan, kind = self.plan, self.layout.kinds[layer_idx]
        planned = mask is plan.masks[kind]
        return self.layers[layer_idx].step(query, key, value, plan.positions, mask, scale,
                                           unmasked=planned and kind in plan.unmasked,
                                           causal=planned and kind in plan.causal,
                                           real=plan.real)

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
        no_mask = attention_mask is None and self.given_positions is None
        real, unmasked = self._plan(positions, no_mask)
        masks = {kind: self._all_visible(kind, batch, positions.device) if kind in unmasked
                 else self.layers[i].mask(positions) for kind, i in self.kind_layer.items()}
        causal = self._causal(T) if real else frozenset()
        self.plan.fill(positions, masks, unmasked=unmasked, causal=causal, real=real)
        return self.plan

    def _plan(self, positions: torch.Tensor, no_mask: bool) -> tuple[bool, frozenset[str]]:
        """Count what this forward tells the host; return whether its tokens are all real and
        the layer kinds whose query sees every key (no mask needed).

        Every real token of a row takes the next position (``attention_mask.cumsum``), so a
        ring holds its last W positions once its row has had W real tokens. The host keeps a
        lower bound of the fewest real tokens of any row: +T for a forward known to be all real
        (no mask, generate's prompt when no row of it has padding, or a column after it), a
        prefill chunk's own bound in one host sync (none in a decode step). A decode step then
        needs no mask in a ring layer once that bound reaches W (no sinks), and in a full layer
        while no row has had padding.
        Under torch.compile nothing is counted (a host int read in the graph would recompile
        it every step): the masks stay, and the compiler fuses them.
        """
        T = positions.shape[1]
        if torch.compiler.is_compiling():
            return False, frozenset()
        before, self._columns = self._columns, self._columns + T
        real = no_mask or (self.prompt is not None
                           and (before >= self.prompt[0] or self.prompt[1] == self.prompt[0]))
        if real:
            self._real_least += T
        elif T > 1:  # a chunk's one host sync: the fewest real tokens of a row, at least
            least = int((positions.amax(dim=1) + 1).min())
            self._real_least = max(self._real_least, least)
        if self.prompt is not None and self._columns >= self.prompt[0]:
            self._real_least = max(self._real_least,
                                   self.prompt[1] + self._columns - self.prompt[0])
        if T > 1:
            return real, frozenset()
        return real, frozenset(kind for kind, i in self.kind_layer.items()
                               if self._sees_everything(self.layers[i]))

    def _causal(self, T: int) -> frozenset[str]:
        """The kinds whose chunk of ``T`` real tokens sees the plain causal mask: a first
        chunk, into layers that hold nothing (their ``plain_causal``, known on the host)."""
        if T == 1:
            return frozenset()
        return frozenset(kind for kind, i in self.kind_layer.items()
                         if self.layers[i].plain_causal(T))

    def _all_visible(self, kind: str, batch: int, device: torch.device) -> torch.Tensor:
        """An all-True decode mask ``(B, 1, 1, K)`` for ``kind``, kept while its shape holds:
        contiguous, so transformers' ``.contiguous()`` hands this very tensor to the layers."""
        K = self.layers[self.kind_layer[kind]].get_mask_sizes(1)[0]
        mask = self._visible.get(kind)
        if mask is None or mask.shape != (batch, 1, 1, K) or mask.device != device:
            mask = self._visible[kind] = torch.ones(batch, 1, 1, K, dtype=torch.bool,
                                                    device=device)
        return mask

    def _sees_everything(self, layer: RingLayer | FullLayer) -> bool:
        """Whether this decode step's query sees every key ``layer`` holds (host counts)."""
        if isinstance(layer, RingLayer):  # full: every row holds its last W positions
            return (not layer.sinks and layer.capacity == layer.window
                    and self._real_least >= layer.window)  # (draft slots hold older keys)
        return self._real_least >= self._columns  # no row has had padding: slot j holds j

    def end_forward(self) -> None:
        """Forget the last forward's plan (a write without a new one is then refused)."""
        self.plan.clear()
        self.given_positions = None

    def reset(self) -> None:
        """Empty every layer; the host's counts start again."""
        super().reset()
        self._columns = self._real_least = 0
        self.refused = None
        self.end_forward()

    def reserve(self, tokens: int) -> None:
        """Size the full layers for ``tokens`` at first use (they still grow past it)."""
        for layer in self.layers:
            if isinstance(layer, FullLayer) and not layer.is_initialized:
                layer.reserve = tokens

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (assisted decoding's rejected drafts).

        Served for up to :attr:`draft` tokens, the rings' spare slots; more raises (changing
        nothing): the ring has evicted what it would roll back to.
        """
        n = -int(tokens_to_remove)
        if tokens_to_remove > 0 or n > self.draft:
            raise NotImplementedError(
                f"RingCache.crop({tokens_to_remove}): this cache's rings have spare slots for "
                f"{self.draft} rejected draft tokens; past that a ring has evicted the tokens a "
                f"crop would roll back to (build RingCache(model, draft=K) for drafts up to K)")
        if n:
            for layer in self.layers:
                layer.crop(-n)
            # each row lost at most n real tokens: the host's counts stay lower bounds
            self._columns -= n
            self._real_least = max(0, self._real_least - n)


def check_kv_sharing(config) -> None:
    """Raise if a KV-shared layer reads keys no layer of this model writes.

    Gemma 3n and Gemma 4 share keys: their last layers attend over the new keys of an earlier
    layer of their type, which each such layer's own ring then stores as well (exact; it
    costs the memory the sharing would save). A draft assistant's layers read its target
    model's keys: nothing here writes them.
    """
    modes = getattr(config, "kv_sharing_modes", None) or []
    types = getattr(config, "layer_types", None) or ["full_attention"] * len(modes)
    for i, mode in enumerate(modes):
        first = modes.index("reuse") if mode == "reuse" else None
        if first is not None and types[i] not in types[:first]:
            raise ValueError(f"layer {i} reads keys no layer of this model writes (a draft "
                             f"assistant's layers read its target model's): RingCache cannot "
                             f"serve it")


def windows_of(windows: list[int | None]) -> int | None:
    """The one ring window of a cache (None if it has no ring)."""
    rings = {w for w in windows if w is not None}
    if len(rings) > 1:
        raise ValueError(f"RingCache supports one window per model, got {sorted(rings)}")
    return rings.pop() if rings else None
