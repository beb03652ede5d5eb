"""RingCache: a ``transformers.Cache`` made of ring layers and growing full layers."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ringviz.checks import check_sinks
from ringviz.hf.config import read_layout
from ringviz.hf.layers import NOT_THROUGH_GENERATE, FullLayer, RingLayer
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
        rope = model_sink_rope(model, "sliding_attention") if sink_rope == "cache" else None
        super().__init__(layers=[RingLayer(w, sinks=sinks, sink_rope=rope) if w else FullLayer()
                                 for w in windows])
        self.config = model.config
        self.kinds = kinds  # per layer: the mask kind transformers builds for it
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
        # What the cache was told, on the host (never read back in a decode step): columns so
        # far, the fewest real tokens any row has, and generate's prompt (columns, fewest real)
        # after which every column is a real token (generate appends one per row and step).
        self._columns = 0
        self._real_least = 0
        self.prompt: tuple[int, int] | None = None
        self.unmasked: frozenset[str] = frozenset()  # layer kinds attending without a mask
        self.step_real = False  # whether every new token of this forward is known to be real

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's storage (keys, values, stored positions)."""
        return sum(layer.nbytes for layer in self.layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's write, at the positions this forward's mask function computed."""
        positions = self._pending
        if positions is None or positions.shape != (key_states.shape[0], key_states.shape[2]):
            raise RuntimeError(NOT_THROUGH_GENERATE)
        out = self.layers[layer_idx].update(key_states, value_states, positions=positions,
                                            padded=self.chunk_padded, real=self.step_real)
        self._updated += 1
        if self._updated == len(self.layers):  # every write done: its positions are spent
            self._pending, self._updated = None, 0  # (padding stays for the last attention)
        return out

    def start_forward(self, positions: torch.Tensor, *, no_mask: bool = False) -> None:
        """Take ``positions`` (B, T) for the layers' writes in the forward about to run, and
        plan it (transformers asks once per layer kind; the first call plans).

        ``no_mask``: the forward came without an attention mask (every token real). A chunk
        asks once whether it holds padding (one host sync per prefill chunk, none per decode
        step), so its layers can skip zeroing padded keys when there is none. A decode step
        whose rings all hold their last W positions attends without a mask (:meth:`_plan`).
        """
        first = self._pending is None
        self._pending, self._updated = positions, 0
        if first:
            self.padding = positions < 0
            self._plan(positions, no_mask)

    def _plan(self, positions: torch.Tensor, no_mask: bool) -> None:
        """Count what this forward tells the host and decide which layer kinds need a mask.

        Every real token of a row takes the next position (``attention_mask.cumsum``), so a
        ring is full, holding its last W positions, once its row has had W real tokens. The
        host keeps a lower bound of the fewest real tokens of any row: +T for a forward known
        to be all real (no mask, or a column after generate's prompt), a prefill chunk's own
        bound read in the sync it makes anyway. A decode step then attends without a mask in
        every sliding layer once that bound reaches W (no sinks), and in every full layer
        while no row has had padding. Under torch.compile nothing is counted (a host int read
        in the graph would recompile it every step): the masks stay, and the compiler fuses
        them.
        """
        T = positions.shape[1]
        self.chunk_padded, self.step_real, self.unmasked = T > 1, False, frozenset()
        if torch.compiler.is_compiling():
            self.chunk_padded = T > 1 and bool(self.padding.any())
            return
        before, self._columns = self._columns, self._columns + T
        self.step_real = no_mask or (self.prompt is not None and before >= self.prompt[0])
        if self.step_real:
            self._real_least += T
            self.chunk_padded = False
        elif T > 1:  # the chunk's one host sync: padding, and the fewest real tokens of a row
            padded, least = torch.stack([self.padding.any(),
                                         (positions.amax(dim=1) + 1).min()]).tolist()
            self.chunk_padded = bool(padded)
            self._real_least = max(self._real_least, least)
        if self.prompt is not None and self._columns >= self.prompt[0]:
            self._real_least = max(self._real_least,
                                   self.prompt[1] + self._columns - self.prompt[0])
        if T == 1:
            self.unmasked = frozenset(kind for kind, i in self.kind_layer.items()
                                      if self._sees_everything(self.layers[i]))

    def _sees_everything(self, layer: RingLayer | FullLayer) -> bool:
        """Whether this decode step's query sees every key ``layer`` returns (host counts)."""
        if isinstance(layer, RingLayer):  # full: every row holds its last W positions
            return not layer.sinks and self._real_least >= layer.window
        return self._real_least >= self._columns  # no row has had padding: slot j holds j

    def end_forward(self) -> None:
        """Forget the last forward's positions (a write without new ones is then refused)."""
        self._pending, self.padding, self.chunk_padded, self._updated = None, None, False, 0

    def reset(self) -> None:
        """Empty every layer; the host's counts start again."""
        super().reset()
        self._columns = self._real_least = 0
        self.end_forward()

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
        """Bool ``(B, 1, T, K)`` visibility of the keys the layers of ``kind`` will return.

        All True, a broadcast view with nothing computed, when this forward's plan found that
        every key is visible (the attention then ignores it: :attr:`unmasked`).
        """
        layer = self.layers[self.kind_layer[kind]]
        if kind in self.unmasked:
            B, T = q_positions.shape
            K = layer.get_mask_sizes(T)[0]
            return torch.ones((), dtype=torch.bool, device=q_positions.device).expand(B, 1, T, K)
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
