"""RingCache: a ``transformers.Cache`` of ring layers and growing full layers, and its plan.

The data path of one forward::

    plan (transformers' first mask ask, :meth:`RingCache.make_plan`): positions (B, T),
        per layer kind: key positions -> one mask (B, 1, T, K)
    layer i: q, k, v (RoPE by HF at plan.positions) -> update hands k, v on
        -> attention hook -> RingCache.attend -> the layer's step: write, attend

The two kinds of layer are ``transformers`` cache layers (``CacheLayerMixin``): a ring per
sliding layer (:class:`RingLayer`, a :class:`ringviz.RingKVCache`) and a growing store per full
one (:class:`FullLayer`). In a RingCache forward, ``RingCache.update(k, v, i)`` stores nothing
and hands the new tokens on, because the write and the attention are one step (``step``),
called with the query and the forward plan's mask (:class:`ForwardPlan`, computed once per
forward, the way mistral-inference computes its cache metadata once per step). A plan is spent
once a layer has stepped with it; the next ask for a mask starts a new one. Outside one (a
layer inside Hugging Face's own cache), a layer's own ``update`` keeps transformers' contract:
it stores the tokens and returns what HF's stock masks expect (:meth:`RingLayer.update`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from ringviz.attention import attend
from ringviz.cache import MakeStep, RingKVCache, home_slots, step_key_positions
from ringviz.checks import check_int, check_sinks
from ringviz.hf.config import read_layout
from ringviz.hf.rotary import check_rope, model_sink_rope, rope_layers
from ringviz.masks import band_mask
from ringviz.rope import Rope

NOT_THROUGH_GENERATE = (
    "a RingCache's masks must come from its stored positions, but this forward used Hugging "
    "Face's stock masks (keys assumed in temporal order). Call ringviz.hf.generate(model, "
    "input_ids, ...) instead of model.generate(..., cache=RingCache(model)).")


class ForwardPlan:
    """One forward's positions and masks (one object per cache, refilled by :meth:`fill`).

    ``positions`` ``(B, T)`` absolute, -1 = padding; ``masks`` bool ``(B, 1, T, K)`` per layer
    kind; ``last_layer``: the last layer that began its step with it (-1: none yet), so a stale
    plan (a forward that skipped the mask hook) is refused; ``done``: the last layer whose step
    (its write) completed, so a forward that raises part-way is known to have written.
    ``unmasked``: the kinds whose query sees every key (their mask an all-True view, skipped
    by their layers' step); ``real``: every new token is known to be real (no padding);
    ``causal``: the kinds whose chunk is a first chunk without padding, so each query sees the
    chunk's keys up to its own (the plain causal mask, which SDPA applies itself).
    """

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None
        self.masks: dict[str, torch.Tensor] = {}
        self.unmasked: frozenset[str] = frozenset()
        self.causal: frozenset[str] = frozenset()
        self.real = False
        self.last_layer = -1
        self.done = -1

    def fill(self, positions: torch.Tensor, masks: dict[str, torch.Tensor], *,
             unmasked: frozenset[str] = frozenset(), causal: frozenset[str] = frozenset(),
             real: bool = False) -> None:
        self.positions, self.masks = positions, masks
        self.unmasked, self.causal, self.real = unmasked, causal, real
        self.last_layer = self.done = -1

    def clear(self) -> None:
        self.positions, self.masks, self.last_layer, self.done = None, {}, -1, -1
        self.unmasked, self.causal, self.real = frozenset(), frozenset(), False

    @property
    def fresh(self) -> bool:
        """True between the plan's making and its first layer step.

        ``last_layer`` is read first: a compiled decode step then never guards on the shape of
        the spent plan's positions (the prefill's).
        """
        return self.last_layer < 0 and self.positions is not None

    def enter(self, layer_idx: int) -> None:
        """Layer ``layer_idx`` steps with this plan: layers step once each, in order."""
        if self.positions is None or layer_idx <= self.last_layer:
            raise RuntimeError(NOT_THROUGH_GENERATE)
        self.last_layer = layer_idx


def positions_from_mask(attention_mask: torch.Tensor | None, seen: torch.Tensor | int,
                        batch: int, T: int, device: torch.device) -> torch.Tensor:
    """``(B, T)`` absolute positions of the new tokens (-1 = padding) from HF's 2D mask.

    A row's token at absolute position ``p`` is its ``p``-th real token (``attention_mask``'s
    cumsum - 1, what ``generate`` feeds RoPE); without a mask, ``seen + 0 .. T-1``.
    """
    if attention_mask is None:
        return (seen + torch.arange(T, device=device)).expand(batch, T)
    if not torch.compiler.is_compiling() and attention_mask.shape != (batch, int(seen) + T):
        raise ValueError(f"attention_mask must cover every token so far: (B, seen + T) = "
                         f"{(batch, int(seen) + T)}, got {tuple(attention_mask.shape)}")
    mask = attention_mask.to(device=device, dtype=torch.bool)
    positions = mask.long().cumsum(-1)[:, -T:] - 1
    return positions.masked_fill(~mask[:, -T:], -1)


class RowsMixin:
    """Hugging Face's row operations on a cache layer, all through ``take_rows(index)``.

    Beam search reorders rows (``reorder_cache``), other searches repeat and select them: each a
    gather on the batch axis, never a crop, so a ring serves them exactly.
    """

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.take_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = self.keys.shape[0] if self.is_initialized else 0
        self.take_rows(torch.arange(rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero()[:, 0]
        self.take_rows(indices)


class RingLayer(RowsMixin, CacheLayerMixin):
    """A sliding layer: a :class:`RingKVCache` of up to ``window`` slots per row, made on first
    use and grown with its tokens (:meth:`fit`) until it holds the window, then fixed.

    ``sinks=S`` keeps each row's first ``S`` positions in ``S`` more slots (attention sinks),
    grown with the tokens too: a ring that has seen ``n < S`` tokens holds ``n`` sink slots.
    ``sink_rope`` is the ring's convention for them (None: absolute positions; a rotation:
    StreamingLLM's positions inside the cache).

    ``make_step``: another ring in its place (the seam, :data:`ringviz.cache.MakeStep`), built
    at the layer's first step and called with its q, k, v and positions: no plan mask, no row
    operations, no crop (it keeps its own storage).

    Two ways in. A :class:`RingCache` forward calls :meth:`step` (write, then attend, with the
    forward plan's mask from stored positions). Outside one (a ``RingLayer`` in Hugging Face's
    own ``DynamicCache``, or driven by hand), :meth:`update` keeps transformers' layer contract:
    it stores the new tokens and returns the keys and values a query attends over, in temporal
    order, exactly what ``DynamicSlidingWindowLayer.update`` returns, so HF's stock masks
    (:meth:`get_mask_sizes`) apply. What a ring cannot do: ``layer.keys`` and ``layer.values``
    are its storage, in slot order (position ``p`` in slot ``p % capacity``), not in temporal
    order; ``layer.positions`` says which position each slot holds (-1: empty).
    """

    is_sliding = True
    # fixed shapes once whole (a call that may compile allocates it first: RingCache.allocate);
    # the token count is a tensor, as in HF's StaticLayer
    is_compileable = True

    def __init__(self, window: int, *, sinks: int = 0, sink_rope: Rope | None = None,
                 draft: int = 0, make_step: MakeStep | None = None) -> None:
        super().__init__()
        self.window, self.sinks, self.sink_rope = window, sinks, sink_rope
        self.make_step, self.other = make_step, None  # another ring's step, once made
        # ``draft`` spare slots let a rejected draft of up to that many tokens be cropped: the
        # ring holds window + draft positions, so the keys the next query needs survive
        self.draft = draft
        self.is_croppable = draft > 0
        # ring slots and sink slots now: None until the first fit or use (then window + draft
        # and every sink unless fit to fewer); a ring fit to its tokens grows with them
        self.capacity: int | None = None
        self.sink_slots: int | None = None
        self.ring: RingKVCache | None = None
        # tokens (columns, padding included) given so far: a 0-d tensor updated in place, so a
        # compiled decode step does not specialise (and recompile) on its value
        self.columns = torch.zeros((), dtype=torch.int64)
        self.record_past = False  # HF's rollback asked for (activate_past_recording)
        self.stepped = False  # a RingCache forward wrote it: positions count real tokens

    # ------------------------------------------------------------------ what HF reads
    @property
    def sliding_window(self) -> int:
        return self.window

    @property
    def cumulative_length(self) -> torch.Tensor:
        """Tokens (columns) given so far, HF's name for them (a 0-d tensor, as a static layer's)."""
        return self.columns

    @property
    def device(self) -> torch.device | None:
        return self.ring.device if self.ring is not None else None

    @property
    def dtype(self) -> torch.dtype | None:
        return self.ring.dtype if self.ring is not None else None

    @property
    def positions(self) -> torch.Tensor | None:
        """``(B, S + C)``: the position each slot of ``keys`` holds (-1: empty), None before
        the first token: what a mask over the storage is built from."""
        return self.ring.positions if self.ring is not None else None

    # ------------------------------------------------------------------ size
    @property
    def full(self) -> int:
        """Ring slots once grown: the window and the draft slots."""
        return self.window + self.draft

    @property
    def slots(self) -> int:
        """Ring slots now, or once allocated (the full ring unless :meth:`fit` said fewer)."""
        return self.full if self.capacity is None else self.capacity

    @property
    def sinks_held(self) -> int:
        """Sink slots now, or once allocated (every sink unless :meth:`fit` said fewer)."""
        return self.sinks if self.sink_slots is None else self.sink_slots

    def fit(self, tokens: int, spare: int = 0, *, whole: bool = False) -> None:
        """Grow (never shrink) to what a forward that brings the columns to ``tokens`` needs.

        Positions never pass column indices, so ``tokens`` bounds them: the first
        ``min(sinks, tokens)`` are sinks, in their own slots; the rest take ring slots, as many
        as there are while they fit the window (no position reaches a slot twice: nothing
        wraps), then the window and ``spare`` draft slots (at most ``draft``). ``whole``: the
        window and every draft slot now (a run that may compile).
        """
        if self.make_step is not None:
            return
        sinks = min(self.sinks, tokens)
        rest = max(1, tokens - sinks)
        target = self.full if whole else rest if rest <= self.window else \
            self.window + min(spare, self.draft)
        target = max(target, self.capacity or 0)
        sinks = max(sinks, self.sink_slots or 0)
        if (target, sinks) == (self.capacity, self.sink_slots):
            return
        self.capacity, self.sink_slots = target, sinks
        if self.ring is not None:
            self.ring = self._regrown(self.ring)
            self.keys, self.values = self.ring.k, self.ring.v

    def _regrown(self, ring: RingKVCache) -> RingKVCache:
        """``ring``'s keys in a ring of this layer's slots now (``ring`` left as it was)."""
        window = min(self.window, self.capacity)
        if ring.sinks == self.sink_slots:
            return ring.grown(window, self.capacity)
        # more sink slots: every key moves to its home slot in the new layout (one write)
        new = RingKVCache(ring.batch_size, ring.num_kv_heads, window, ring.head_dim,
                          sinks=self.sink_slots, sink_rope=self.sink_rope,
                          capacity=self.capacity, dtype=ring.dtype, device=ring.device)
        new.write(ring.k, ring.v, ring.positions, check=False)
        return new

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.capacity, self.sink_slots = self.slots, self.sinks_held
        self.ring = RingKVCache(B, H, min(self.window, self.capacity), D,
                                sinks=self.sink_slots, sink_rope=self.sink_rope,
                                capacity=self.capacity, dtype=key_states.dtype,
                                device=key_states.device)
        self.keys, self.values = self.ring.k, self.ring.v
        self.columns = self.columns.to(key_states.device)
        self.is_initialized = True

    # ------------------------------------------------------------------ HF's layer contract
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' layer contract: store ``T`` new tokens (each row's next columns,
        ``cumulative_length + 0 .. T-1``) and return what their queries attend over, oldest
        first: the last ``min(seen, window - 1)`` stored tokens, then the new ones, as
        ``DynamicSlidingWindowLayer.update`` does (:meth:`get_mask_sizes` says where they start).

        Refused, changing nothing, for a ring that HF's masks cannot describe: one with sinks,
        another ring's step, or one a RingCache forward wrote (its positions count real tokens,
        not columns).
        """
        self._check_update(key_states, value_states)
        B, _, T, _ = key_states.shape
        seen = int(self.columns)
        self.fit(seen + T, spare=T if self.record_past else 0)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ring = self.ring
        past = torch.arange(seen - min(seen, self.window - 1), seen, device=ring.device)
        index = home_slots(past, 0, ring.capacity)  # the kept positions' slots, oldest first
        keys = torch.cat([ring.k.index_select(2, index), key_states], dim=2)
        values = torch.cat([ring.v.index_select(2, index), value_states], dim=2)
        positions = (seen + torch.arange(T, device=ring.device)).expand(B, T)
        ring.write(key_states, value_states, positions, check=False, contiguous=True)
        self.columns.add_(T)
        return keys, values

    def _check_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        why = ("it keeps sinks, which HF's masks do not know" if self.sinks else
               "another ring (make_step) keeps its storage" if self.make_step is not None else
               "a RingCache forward wrote it: its positions count real tokens, not columns"
               if self.stepped else None)
        if why is not None:
            raise NotImplementedError(
                f"RingLayer.update (HF's layer contract, keys in temporal order for HF's masks) "
                f"cannot serve this ring: {why}. Use RingCache through ringviz.hf.generate")
        if key_states.ndim != 4 or value_states.shape[:3] != key_states.shape[:3]:
            raise ValueError(f"key_states and value_states must be (B, H, T, D) alike, got "
                             f"{tuple(key_states.shape)} and {tuple(value_states.shape)}")
        if self.ring is not None and (key_states.shape[:2] != self.ring.k.shape[:2]
                                      or key_states.shape[3] != self.ring.head_dim):
            raise ValueError(f"this layer holds (B, H, ., D) = {tuple(self.ring.k.shape)}, got "
                             f"key_states {tuple(key_states.shape)}")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """HF's ``(kv_length, kv_offset)`` of :meth:`update`'s keys: they hold positions
        ``kv_offset .. kv_offset + kv_length - 1`` (a host read of the column count)."""
        seen = int(self.columns)
        kept = min(seen, self.window - 1)
        return kept + query_length, seen - kept

    def step_keys(self, query_length: int) -> int:
        """Keys :meth:`step` attends over for ``query_length`` queries: the sink and ring
        slots, and the chunk's own tokens for a chunk."""
        return self.sinks_held + self.slots + (query_length if query_length > 1 else 0)

    def get_seq_length(self) -> torch.Tensor:
        return self.columns

    def get_max_length(self) -> int:
        return self.sinks + self.full

    def activate_past_recording(self) -> None:
        """HF's rollback: served by the draft slots (:meth:`crop` takes back up to ``draft``
        tokens); refused, changing nothing, by a ring without them."""
        self.check_recording()
        self.record_past = True

    def check_recording(self) -> None:
        """Raise what :meth:`activate_past_recording` would refuse, changing nothing."""
        if not self.draft:
            raise NotImplementedError(
                f"a ring of {self.window} slots overwrites the keys a rollback would need: it "
                f"cannot record its past; build RingCache(model, draft=K) for rollbacks of up "
                f"to K tokens (ringviz.hf.generate sizes K for assisted decoding itself)")

    def offload(self) -> None:
        """Refused: a ring keeps its storage at fixed addresses on its device (written in
        place every step); keep sliding layers resident (``offload_only_non_sliding=True``)."""
        raise NotImplementedError(
            "a RingLayer is not offloaded: its storage (window slots) stays on its device, "
            "written in place; keep sliding layers resident (offload_only_non_sliding=True)")

    def prefetch(self) -> None:
        """Nothing to fetch: a ring is never offloaded (:meth:`offload`)."""

    # ------------------------------------------------------------------ the ring path
    def mask(self, q_positions: torch.Tensor) -> torch.Tensor:
        """Bool ``(B, 1, T, K)``: which keys of :meth:`step` each query sees."""
        keys = (step_key_positions(None, q_positions, self.sinks_held, self.slots)
                if self.ring is None else self.ring.key_positions(q_positions))
        return band_mask(q_positions, keys, self.window, self.sinks)[:, None]

    def plain_causal(self, T: int) -> bool:
        """Whether a chunk of ``T`` real tokens, stepped now, sees exactly the causal mask:
        the ring holds nothing yet (not allocated), the window covers the chunk, no sinks."""
        return (self.make_step is None and self.ring is None and not self.sinks
                and T <= self.window)

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             positions: torch.Tensor, mask: torch.Tensor, scale: float, *,
             unmasked: bool = False, causal: bool = False, real: bool = False
             ) -> torch.Tensor:
        """:meth:`RingKVCache.step` with the plan's mask: write, attend ``(B, Hq, T, D)``.

        ``unmasked``: the plan found every key visible (the ring is full), so the step is
        the write and attention with no mask; ``causal``: the plan found the chunk plain
        causal (:meth:`plain_causal`), so its queries attend over its own keys with SDPA's
        causal mask, then it is written; ``real``: every token is real, so each row's is its
        next position (the ring's contiguous write).
        """
        self.stepped = True
        if self.make_step is not None:
            return self._other_step(query, key, value, positions, scale)
        if torch.compiler.is_compiling() and (self.ring is None or self.slots != self.full):
            raise RuntimeError(f"a compiled step needs the ring allocated at its full "
                               f"{self.full} slots (RingCache.allocate for the call's tokens): "
                               f"it can neither grow nor allocate inside a graph")
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        if causal and query.shape[2] == key.shape[2]:
            out = attend(query, key, value, scale=scale, causal=True)
            self.ring.write(key, value, positions, check=False, contiguous=real)
        elif unmasked:
            self.ring.write(key, value, positions, check=False, contiguous=True)
            out = attend(query, self.ring.k, self.ring.v, scale=scale)
        else:  # validated for a chunk that may hold padding: the ring learns what each
            # row holds (one host read, never in a graph); a decode step is trusted, as the
            # plan built it
            check = key.shape[2] > 1 and not real and not torch.compiler.is_compiling()
            out = self.ring.step(query, key, value, positions, scale=scale, check=check,
                                 contiguous=real, mask=mask[:, 0])
        self.columns.add_(key.shape[2])
        return out

    def _other_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    positions: torch.Tensor, scale: float) -> torch.Tensor:
        """The other ring's step. A step scales by ``1/sqrt(D)``: the model's own ``scale`` is
        folded into the query (``q * scale * sqrt(D)``), the same scores."""
        B, H, T, D = key.shape
        if query.shape[2] != T:
            raise ValueError(f"a ring step takes as many queries as keys ({query.shape[2]} vs "
                             f"{T}): this model's KV-shared layers need RingCache's own rings")
        if self.other is None:
            self.other = self.make_step(batch_size=B, num_heads=query.shape[1], num_kv_heads=H,
                                        head_dim=D)
            self.columns = self.columns.to(key.device)
            self.is_initialized = True
        factor = scale * D ** 0.5
        out = self.other(query if factor == 1.0 else query * factor, key, value, positions)
        self.columns.add_(T)
        return out

    def sees_everything(self) -> bool:
        """Whether a decode step of every row's next token sees every key this layer holds
        once written: the ring's own :meth:`~ringviz.RingKVCache.full_after`."""
        return self.make_step is None and self.ring is not None and self.ring.full_after(1)

    def take_rows(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes row ``index[i]`` (the row operations of :class:`RowsMixin`)."""
        if self.make_step is not None and self.other is not None:
            raise NotImplementedError("a ring step given through make_step keeps its own rows: "
                                      "beam search and row selection need RingCache's rings")
        if self.ring is not None:
            self.ring.take_rows(index.to(self.ring.device), check=False)
            self.keys, self.values = self.ring.k, self.ring.v

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens of every row (a rejected draft).

        :meth:`RingKVCache.truncate`, which raises (changing nothing) unless every row still
        holds the window its next query needs: true for drafts up to the spare slots.
        """
        n = self.check_crop(tokens_to_remove)
        if n and self.ring is not None:
            self.ring.truncate(self.ring.lengths - n, check=False)
            self.columns.sub_(n)

    def check_crop(self, tokens_to_remove: int) -> int:
        """Raise what :meth:`crop` would (changing nothing); else the tokens it removes."""
        n = -tokens_to_remove
        if n and self.make_step is not None:
            raise NotImplementedError("a ring step given through make_step keeps its own "
                                      "storage: a crop needs RingCache's rings (draft=K)")
        if n and self.ring is not None:
            self.ring.check_truncation(self.ring.lengths - n)
        return n

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes if self.ring is not None else 0

    def reset(self) -> None:
        if self.ring is not None:
            self.ring.reset()
        self.other = None  # another ring's step is made afresh
        self.columns.zero_()


class FullLayer(RowsMixin, CacheLayerMixin):
    """A full-attention layer: row ``b``'s token at position ``p`` lives in slot ``p``.

    Storage holds exactly the tokens that arrived (a copy into larger storage when more
    arrive, as Hugging Face's ``torch.cat`` does; never reserved for ``max_new_tokens``, so
    never more than Hugging Face's own layer holds) unless a driver that knows its length
    reserves it (:meth:`fit`, :meth:`RingCache.allocate`); one spare slot past the end takes
    padding writes. Slot ``j`` holds position ``j``: a row's positions count its real tokens
    (``0, 1, 2, ...`` after its padding), so they never pass its column, the stored positions
    are implicit, and a query at ``p`` sees ``0..p``.

    Compileable as a static layer (``static``, set by :meth:`RingCache.allocate` for a call
    that may compile): a step writes into storage reserved for the whole call and attends over
    all of it, the slots past each query masked by the causal rule itself, so every step has
    the same shapes; under ``torch.compile`` the column count is then a tensor
    (:attr:`count`), read back by the host only when next asked. Outside a RingCache
    forward, :meth:`update` keeps HF's layer contract (``DynamicLayer``'s: store, return
    every token so far).
    """

    is_sliding = False
    is_compileable = True  # once its storage is reserved for the call (RingCache.allocate)
    is_croppable = True  # slot = position: a crop forgets the last columns

    def __init__(self) -> None:
        super().__init__()
        self.count = torch.zeros((), dtype=torch.int64)  # columns given so far, on the device
        self._columns: int | None = 0  # the same on the host (None: read it back from count)
        self.dense = True  # every column so far a real token: slot j holds position j
        self.allocated = 0  # slots per row in storage (the spare slot aside)
        self.reserve = 0  # slots to allocate at first use (RingRunner knows its length)
        self.static = False  # attend over every allocated slot: fixed shapes (a compiled call)
        self.device: torch.device | None = None  # the storage's own device, set at first use
        self._k_store: torch.Tensor | None = None
        self._v_store: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None  # (B,) row indices, made with the storage

    @property
    def columns(self) -> int:
        """Columns given so far (padding included), on the host."""
        if self._columns is None:  # after compiled steps, which counted on the device only
            self._columns = int(self.count)
        return self._columns

    @columns.setter
    def columns(self, n: int) -> None:
        self._columns = n
        self.count.fill_(n)

    @property
    def cumulative_length(self) -> int:
        return self.columns

    @property
    def dtype(self) -> torch.dtype | None:
        return self._k_store.dtype if self._k_store is not None else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, T, D = key_states.shape
        self.device = key_states.device
        self.count = self.count.to(self.device)
        self._allocate(key_states.new_zeros(B, H, 0, D), value_states.new_zeros(B, H, 0, D),
                       max(self.reserve, T))
        self.is_initialized = True

    def _allocate(self, k_old: torch.Tensor, v_old: torch.Tensor, slots: int) -> None:
        B, H, n, D = k_old.shape
        self._k_store = k_old.new_zeros(B, H, slots + 1, D)  # + the spare slot
        self._v_store = v_old.new_zeros(B, H, slots + 1, v_old.shape[3])
        self._k_store[:, :, :n] = k_old
        self._v_store[:, :, :n] = v_old
        self.allocated = slots
        self._views()
        self._rows = torch.arange(B, device=k_old.device)  # row index of a decode write

    def _views(self) -> None:
        self.keys = self._k_store[:, :, :self.allocated]
        self.values = self._v_store[:, :, :self.allocated]

    def fit(self, tokens: int) -> None:
        """Hold at least ``tokens`` slots, now if allocated (a copy), else at first use."""
        self.reserve = max(self.reserve, tokens)
        if self.is_initialized and tokens > self.allocated:
            n = self.columns
            self._allocate(self._k_store[:, :, :n], self._v_store[:, :, :n], tokens)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' layer contract (``DynamicLayer``'s): store ``T`` new tokens at the
        next columns and return every token so far, oldest first. Refused for a layer a
        RingCache forward wrote with padding (its slots then hold real-token positions)."""
        if not self.dense:
            raise NotImplementedError(
                "FullLayer.update (HF's layer contract, slot = column) cannot serve a layer "
                "that a RingCache forward wrote with padding: its slots hold each row's real "
                "tokens. Use RingCache through ringviz.hf.generate")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, _, T, _ = key_states.shape
        positions = (self.columns + torch.arange(T, device=self.device)).expand(B, T)
        return self._store(key_states, value_states, positions, real=True)

    def mask(self, q_positions: torch.Tensor) -> torch.Tensor:
        """Bool ``(B, 1, T, K)``: slot ``j`` (position ``j``) visible to queries ``>= j``, over
        ``seen + T`` slots (a static layer's: every reserved slot)."""
        K = self.allocated if self.static else self.columns + q_positions.shape[1]
        slots = torch.arange(K, device=q_positions.device)
        return band_mask(q_positions, slots, None)[:, None]  # the window rule, no window

    def plain_causal(self, T: int) -> bool:
        """Whether a chunk of ``T`` real tokens, stepped now, sees exactly the causal mask:
        the layer holds no column yet, so slot ``j`` will hold the chunk's ``j``-th token (a
        static layer attends over every slot: never)."""
        return not self.static and self.columns == 0

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             positions: torch.Tensor, mask: torch.Tensor, scale: float, *,
             unmasked: bool = False, causal: bool = False, real: bool = False
             ) -> torch.Tensor:
        """Write ``T`` tokens at slots = their positions, then attend over slots
        ``0..columns+T-1``
        (``unmasked``: the plan found every slot visible, as no row has had padding;
        ``causal``: a first chunk without padding, :meth:`plain_causal`)."""
        if torch.compiler.is_compiling():
            return self._compiled_step(query, key, value, positions, mask, scale)
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        T = key.shape[2]
        if self.static and self.columns + T > self.allocated:
            raise ValueError(f"this call brings the full layers to {self.columns + T} columns, "
                             f"past the {self.allocated} allocated for it (RingCache.allocate)")
        if not real and self.dense:  # a chunk's one host read; a decode column may be padding
            self.dense = T > 1 and bool((positions >= 0).all())
        keys, values = self._store(key, value, positions, real=real)
        if self.static:
            keys, values = self.keys, self.values
        if causal and query.shape[2] == keys.shape[2]:
            return attend(query, keys, values, scale=scale, causal=True)
        if unmasked:
            return attend(query, keys, values, scale=scale)
        empty = positions[:, T - query.shape[2]:] < 0  # the queries' rows (Gemma 4 keeps fewer)
        return attend(query, keys, values, mask[:, 0], scale=scale, empty=empty)

    def _store(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, *,
               real: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``T`` tokens at slots = their positions (padding: the spare slot); return the
        keys and values of slots ``0 .. columns + T - 1``."""
        B, H, T, D = key.shape
        columns = self.columns
        need = columns + T  # positions never pass column indices, so slots stay < need
        if need > self.allocated:  # exactly what is held: never more than HF's own layer
            self._allocate(self.keys[:, :, :columns], self.values[:, :, :columns], need)
        if real and not columns:  # a first chunk of real tokens: token j to slot j
            self._k_store[:, :, :T] = key
            self._v_store[:, :, :T] = value
        else:  # (B, T); the spare slot for padding
            slot = positions if real else torch.where(positions >= 0, positions, self.allocated)
            if T == 1:
                self._k_store[self._rows, :, slot[:, 0]] = key[:, :, 0]
                self._v_store[self._rows, :, slot[:, 0]] = value[:, :, 0]
            else:
                self._k_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), key)
                self._v_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), value)
        self._columns = need
        self.count.add_(T)
        return self._k_store[:, :, :need], self._v_store[:, :, :need]

    def _compiled_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       positions: torch.Tensor, mask: torch.Tensor, scale: float
                       ) -> torch.Tensor:
        """:meth:`step` with no host state read: a scatter into the reserved storage, then
        attention over every slot with the plan's mask (:meth:`mask`), the count on the
        device. The host's count and ``dense`` are only written (read back when next asked),
        so the graph guards on neither and never recompiles for them."""
        if not self.static:
            raise RuntimeError("a compiled step needs the full layer's storage allocated for "
                               "the call's tokens (RingCache.allocate(..., static=True)): it "
                               "can neither grow nor allocate inside a graph")
        B, H, T, D = key.shape
        slot = torch.where(positions >= 0, positions, self.allocated)
        self._k_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), key)
        self._v_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), value)
        self.count.add_(T)
        self._columns, self.dense = None, False
        empty = positions[:, T - query.shape[2]:] < 0
        return attend(query, self.keys, self.values, mask[:, 0], scale=scale, empty=empty)

    def sees_everything(self) -> bool:
        """Whether a decode step of every row's next token sees every slot: no row has had
        padding, so slot ``j`` holds position ``j`` (a static layer's spare slots: never)."""
        return self.dense and not self.static

    def take_rows(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes row ``index[i]`` (the row operations of :class:`RowsMixin`)."""
        if self._k_store is None:
            return
        index = index.to(self._k_store.device)
        if index.numel() == self._k_store.shape[0]:  # a reorder: in place
            self._k_store.copy_(self._k_store.index_select(0, index))
            self._v_store.copy_(self._v_store.index_select(0, index))
            return
        k, v = self._k_store.index_select(0, index), self._v_store.index_select(0, index)
        self._allocate(k[:, :, :self.columns], v[:, :, :self.columns], self.allocated)

    def offload(self) -> None:
        """HF's layer offloading: the storage to the CPU (:meth:`prefetch` brings it back)."""
        if self.is_initialized:
            self._move("cpu")

    def prefetch(self) -> None:
        """Back to the layer's device ahead of its next step, if offloaded."""
        if self.is_initialized and self._k_store.device != self.device:
            self._move(self.device)

    def _move(self, device: torch.device | str) -> None:
        self._k_store = self._k_store.to(device, non_blocking=True)
        self._v_store = self._v_store.to(device, non_blocking=True)
        self._rows = self._rows.to(device)
        self._views()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` columns (their slots are written again)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count, the tokens to "
                             f"remove (HF's convention)")
        if tokens_to_remove < 0:
            self.columns = max(0, self.columns + tokens_to_remove)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def step_keys(self, query_length: int) -> int:
        """Keys a step attends over for ``query_length`` queries: every slot so far (a
        static layer's: every allocated slot)."""
        return self.allocated if self.static else self.columns + query_length

    def get_seq_length(self) -> int | torch.Tensor:
        """Columns so far: the device's count under torch.compile (no host read)."""
        return self.count if torch.compiler.is_compiling() else self.columns

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
        self.columns, self.dense = 0, True


def check_model(model) -> None:
    """Raise on attention features the ring path does not implement, naming the feature.

    Given a config alone (``RingCache(config)``), the features only a model's modules show
    (learned sinks, a learned per-head mask) are refused by the attention hook instead, at the
    first layer of the first forward, before anything is written.
    """
    config = model if isinstance(model, PreTrainedConfig) else model.config
    modules = [] if config is model else list(model.modules())
    if config.get_text_config() is not config or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__}: RingCache serves decoder-only text models")
    features = {
        "attention logit soft-capping (as in Gemma 2)":
            getattr(config, "attn_logit_softcapping", None) is not None,
        "learned attention sinks (as in gpt-oss)": any(
            isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in modules),
        "ALiBi position biases": bool(getattr(config, "alibi", False))
            or config.model_type in ("bloom", "mpt") or "alibi" in str(
                getattr(config, "position_embedding_type", "")),
        "bidirectional attention": bool(getattr(config, "use_bidirectional_attention", False)),
        "chunked attention": getattr(config, "attention_chunk_size", None) is not None,
        "a learned per-head attention mask (as in Doge)": any(
            callable(getattr(m, "prepare_dynamic_mask", None)) for m in modules),
        "layers run more than once per forward (looped, as in Dory)": any(
            "loop" in key and isinstance(value, int) and value > 1
            for key, value in config.to_dict().items()),
    }
    found = [name for name, present in features.items() if present]
    if found:
        raise ValueError(f"{config.model_type} uses {', '.join(found)}, which the ring "
                         f"attention path does not implement")


class RingCache(Cache):
    """A ``transformers.Cache`` of rings (sliding layers) and growing full layers.

    ``RingCache(model)``, or ``RingCache(model.config)`` as Hugging Face's caches take a config:
    the same cache, but for what only the model shows (the cache sink convention turns sink keys
    with the model's own rotary embedding, probed on it: refused without the model; learned
    sinks and masks are refused at the first forward, :func:`check_model`).

    ``window=None`` keeps a model's own sliding window on its sliding layers; ``window=W`` sets
    it, and on a model without one (Llama, SmolLM2) makes every layer a ring of ``W``.

    ``sinks=S`` keeps each row's first ``S`` positions in every ring beside its window (attention
    sinks; full-attention layers keep everything anyway). ``sink_convention="absolute"`` scores
    them at their own positions; ``"cache"`` at StreamingLLM's positions inside the cache, the
    sink keys turned by the model's own rotary embedding for sliding layers (Gemma 3: the local
    base, not the global one). The same choices as :class:`ringviz.models.drive.RingRunner`,
    which drives a RingCache too.

    ``ring=factory`` puts another ring under every sliding layer: ``factory(window)`` is a
    make_step (:data:`ringviz.cache.MakeStep`, the seam the conformance kit tests), so a
    pitfall of the kit's catalogue runs inside a real model in one line.

    ``draft=K`` lets every ring take up to ``K`` spare slots (capacity up to ``window + K``,
    masks still ``window``), so :meth:`crop` can take back a rejected draft of up to ``K``
    tokens: assisted decoding and prompt lookup (chapter 13's rollback), which
    :func:`~ringviz.hf.generate` sizes from the call.

    Memory, what is allocated when: nothing before the first forward. A ring grows with its
    tokens (exactly: a copy into larger storage, as Hugging Face's ``torch.cat`` does) until it
    holds ``window``, then stays; it grows spare slots only for the drafts that arrive (one
    verified chunk of ``T`` reply tokens may lose ``T - 1``). A full layer holds exactly its
    tokens. So at every length a RingCache holds what Hugging Face's default cache holds, plus
    per layer one spare slot for padding writes (and on sliding layers the ``W``-th key HF drops
    after attending) and each slot's stored position. Sink slots grow with their tokens too. A
    call transformers may compile (on an accelerator, or with a ``compile_config``) is
    allocated whole first, for its length (:meth:`allocate` with ``static=True``: rings at
    their window, full layers fixed-shape): a compiled forward, the prefill chunks' as well as
    the decode steps', can neither grow nor allocate.

    One forward: transformers asks the mask hook for each layer kind's mask, and the first ask
    fills :attr:`plan` (:meth:`make_plan`); each layer's ``update`` then hands its new tokens on,
    and the attention hook calls :meth:`attend`: the layer's step (ring write + attention) with
    the plan's mask.
    """

    def __init__(self, model, *, window: int | None = None, sinks: int = 0,
                 sink_convention: str = "absolute",
                 draft: int = 0, ring: Callable[[int], MakeStep] | None = None) -> None:
        sinks = check_sinks(sinks, sink_convention)
        self.draft = check_int("draft", draft, minimum=0)
        if ring is not None and not callable(ring):
            raise TypeError(f"ring must be a factory window -> make_step, got "
                            f"{type(ring).__name__}")
        if ring is not None and (sinks or self.draft):
            raise ValueError("sinks and draft slots belong to RingCache's own rings: a ring "
                             "given through ring= keeps what its factory builds")
        config = model if isinstance(model, PreTrainedConfig) else model.config
        if config is model and sinks and sink_convention == "cache":
            raise ValueError("RingCache(config) with sink_convention='cache': the sink keys are "
                             "turned by the model's own rotary embedding, probed on the model; "
                             "pass the model, RingCache(model, ...)")
        check_model(model)
        layout = read_layout(config)
        windows = layout.windows(window)  # ValueError on a bad window
        ropes = [None] * len(windows) if config is model else sink_ropes(model, windows,
                                                                         sink_convention)
        check_kv_sharing(config)
        super().__init__(layers=[RingLayer(w, sinks=sinks, sink_rope=rope, draft=self.draft,
                                           make_step=ring(w) if ring else None)
                                 if w else FullLayer() for w, rope in zip(windows, ropes)])
        self.config, self.layout = config, layout
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
        self.given_real = False  # the driver vouches: every row's next position, no padding
        # the configs ring_active switches (found by its first, validated switch)
        self.attention_configs: list | None = None
        self.refused: str | None = None  # why this cache may not be used again, if it may not
        self._checked_kinds: set[str] = set()
        # what generate told the host: columns so far, and its prompt (columns, fewest real
        # tokens of a row), after which every column is a real token (one per row and step)
        self._columns = 0
        self.prompt: tuple[int, int] | None = None
        self._visible: dict[str, torch.Tensor] = {}  # per kind: its all-True decode mask
        self.sized = False  # transformers sized a mask on this cache since the hook last read it

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """transformers' size of a mask over this cache: the keys the layer's step attends
        over (host counts, no device read; the ring's mask hook makes the mask itself). Notes
        that it asked (``sized``): the mask hook then knows this forward is the ring call's."""
        self.sized = True
        return self.layers[layer_idx].step_keys(query_length), 0

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

    def rows(self) -> int | None:
        """Rows the layers hold (None before any layer holds storage)."""
        for layer in self.layers:
            if isinstance(layer, RingLayer) and layer.ring is not None:
                return layer.ring.batch_size
            if isinstance(layer, FullLayer) and layer.is_initialized:
                return layer.keys.shape[0]
        return None

    def check_rows(self, index: object, what: str) -> torch.Tensor:
        """``index`` as a 1-D integer tensor of rows this cache holds, or raise (TypeError,
        ValueError) before any layer changes: HF's row operations call every layer in turn."""
        index = torch.as_tensor(index)
        if index.ndim != 1 or index.dtype == torch.bool or index.is_floating_point() \
                or index.is_complex():
            raise TypeError(f"{what}: the row index must be a 1-D integer tensor, got "
                            f"{index.dtype} {tuple(index.shape)}")
        rows = self.rows()
        if rows is not None and index.numel():
            bad = index[(index < 0) | (index >= rows)]
            if bad.numel():
                raise ValueError(f"{what}: row index {bad.tolist()} is outside the cache's "
                                 f"{rows} rows (0..{rows - 1})")
        return index

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search's reorder: row ``i`` becomes row ``beam_idx[i]``, checked first."""
        super().reorder_cache(self.check_rows(beam_idx, "reorder_cache"))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (integers, or a bool mask over the rows), checked first."""
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            if indices.ndim != 1 or indices.numel() != (self.rows() or indices.numel()):
                raise ValueError(f"batch_select_indices: a bool mask must have one entry per "
                                 f"row ({self.rows()}), got {tuple(indices.shape)}")
            indices = indices.nonzero()[:, 0]
        super().batch_select_indices(self.check_rows(indices, "batch_select_indices"))

    def row_tokens(self) -> torch.Tensor:
        """``(B,)`` real (unpadded) tokens each row holds: its newest position + 1."""
        ring = next((layer.ring for layer in self.layers
                     if isinstance(layer, RingLayer) and layer.ring is not None), None)
        if ring is None:
            raise ValueError("row_tokens: this RingCache holds no tokens in a ring of its own")
        return ring.lengths

    def allocate(self, batch_size: int, tokens: int, dtype: torch.dtype,
                 device: torch.device | str | None, *, static: bool = False) -> None:
        """Allocate every layer now for a run that reaches ``tokens`` columns: rings whole
        (:meth:`fit_full`), full layers ``tokens`` slots. What a driver that knows its length
        calls (RingRunner), and a call transformers may compile, whose first forward is
        already in the graph: a compiled step can neither grow nor allocate. Layers that
        hold tokens keep them (grown where needed). ``static``: the full layers attend over
        all ``tokens`` slots from now on, so every step of the call has the same shapes (what
        a compiled call needs; :class:`FullLayer`)."""
        self.fit_full(tokens)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, FullLayer):
                layer.static = static
            if not layer.is_initialized and getattr(layer, "make_step", None) is None:
                # (another ring is made at its step)
                x = torch.empty(batch_size, self.layout.kv_heads[i], 0, self.layout.head_dims[i],
                                dtype=dtype, device=device)
                layer.lazy_initialization(x, x)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' per-layer call after RoPE: refused unless a fresh plan awaits it;
        hands the new tokens on to :meth:`attend`, where the layer's step writes and attends
        (its own ``update`` is HF's contract, for a layer outside a RingCache)."""
        plan = self.plan
        if plan.positions is None or layer_idx <= plan.last_layer \
                or plan.positions.shape != (key_states.shape[0], key_states.shape[2]):
            raise RuntimeError(NOT_THROUGH_GENERATE)
        return key_states, value_states  # the layer's step writes them (attend)

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
        self._fit_rings(T)
        no_mask = attention_mask is None and self.given_positions is None
        real, unmasked = self._plan(positions, no_mask or self.given_real)
        masks = {kind: self._all_visible(kind, batch, positions.device) if kind in unmasked
                 else self.layers[i].mask(positions) for kind, i in self.kind_layer.items()}
        causal = self._causal(T) if real else frozenset()
        self.plan.fill(positions, masks, unmasked=unmasked, causal=causal, real=real)
        return self.plan

    def _fit_rings(self, T: int) -> None:
        """Grow each ring to what this forward's ``T`` columns need (:meth:`RingLayer.fit`), on
        the host count of columns. The tokens of a reply in a chunk (drafts being verified:
        every one but the first may be taken back; the first verify also carries the prompt)
        get draft slots; a prompt's never are. Not under torch.compile: a compiled step's
        rings are full (:meth:`fit_full`, and its step checks).
        """
        if torch.compiler.is_compiling():
            return
        after = self._columns + T
        spare = max(0, min(T - 1, after - self.prompt[0])) if self.prompt is not None else 0
        for layer in self.layers:
            if isinstance(layer, RingLayer):
                layer.fit(after, spare=spare)

    def fit_full(self, tokens: int | None = None) -> None:
        """Grow every ring to its window and draft slots now, with every sink slot (or, given
        the ``tokens`` columns a run reaches, the sinks its positions can reach), and size the
        full layers for ``tokens``: a compiled step cannot grow."""
        for layer in self.layers:
            if isinstance(layer, RingLayer):
                layer.fit(layer.sinks if tokens is None else tokens, whole=True)
            elif tokens is not None:
                layer.fit(tokens)

    def activate_past_recording(self) -> None:
        """HF's rollback (assisted decoding): served by rings with draft slots (:meth:`crop`),
        refused, changing nothing, when a ring has none."""
        rings = [layer for layer in self.layers if isinstance(layer, RingLayer)]
        for layer in rings:
            layer.check_recording()
        for layer in rings:
            layer.activate_past_recording()

    def _plan(self, positions: torch.Tensor, vouched: bool) -> tuple[bool, frozenset[str]]:
        """Whether this forward's tokens are all real (each row's next positions), and the
        layer kinds whose decode query sees every key (no mask needed).

        Real: ``vouched`` (no mask, or a driver that checked), or generate's prompt without
        padding, or a column after it (generate appends one real token per row and step).
        A decode step then asks each kind's layer (:meth:`RingLayer.sees_everything`: the
        ring's own predicate; a full layer: no row has had padding). Under torch.compile
        nothing is counted (a host int read in the graph would recompile it every step): the
        masks stay, and the compiler fuses them.
        """
        T = positions.shape[1]
        if torch.compiler.is_compiling():
            return False, frozenset()
        before, self._columns = self._columns, self._columns + T
        real = vouched or (self.prompt is not None
                           and (before >= self.prompt[0] or self.prompt[1] == self.prompt[0]))
        if T > 1 or not real:
            return real, frozenset()
        return real, frozenset(kind for kind, i in self.kind_layer.items()
                               if self.layers[i].sees_everything())

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
        K = self.layers[self.kind_layer[kind]].step_keys(1)
        mask = self._visible.get(kind)
        if mask is None or mask.shape != (batch, 1, 1, K) or mask.device != device:
            mask = self._visible[kind] = torch.ones(batch, 1, 1, K, dtype=torch.bool,
                                                    device=device)
        return mask

    def end_forward(self) -> None:
        """Forget the last forward's plan (a write without a new one is then refused)."""
        self.plan.clear()
        self.given_positions, self.given_real = None, False

    def reset(self) -> None:
        """Empty every layer; the host's counts start again."""
        super().reset()
        self._columns = 0
        self.refused = None
        self.end_forward()

    def sync_columns(self, columns: int) -> None:
        """Tell the host the columns every layer holds (read by a caller that synced): a
        compiled step counts nothing on the host (:meth:`_plan`), so a call starts from this."""
        self._columns = columns

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (assisted decoding's rejected drafts).

        Served for up to :attr:`draft` tokens, and for the drafts of the last chunk the rings
        grew spare slots for (:meth:`_fit_rings`: as many as the reply tokens the chunk
        brought, so generate's crop of a rejected draft always fits); more raises, changing
        nothing: a ring has evicted what it would roll back to.
        """
        n = -int(tokens_to_remove)
        if tokens_to_remove > 0 or n > self.draft:
            raise NotImplementedError(
                f"RingCache.crop({tokens_to_remove}): this cache's rings have spare slots for "
                f"{self.draft} rejected draft tokens; past that a ring has evicted the tokens a "
                f"crop would roll back to (build RingCache(model, draft=K) for drafts up to K)")
        if n:
            for layer in self.layers:  # every ring checked before any layer forgets
                if isinstance(layer, RingLayer):
                    layer.check_crop(-n)
            for layer in self.layers:
                layer.crop(-n)
            self._columns -= n


def sink_ropes(model, windows: list[int | None], sink_convention: str) -> list[Rope | None]:
    """Per layer, the ``sink_rope`` of its ring: the model's RoPE of sliding layers for
    StreamingLLM's convention (``"cache"``), None for the absolute one, and None for a layer
    whose attention uses no RoPE (its keys carry no position: both conventions agree).
    A RoPE the convention cannot turn is refused before the probe (``rope_layers``) runs."""
    rings = [i for i, w in enumerate(windows) if w]
    if sink_convention != "cache" or not rings:
        return [None] * len(windows)
    try:
        rope = model_sink_rope(model, "sliding_attention")
    except ValueError:  # no RoPE module to turn with: right only if no ring layer rotates
        if any(used for i, used in enumerate(rope_layers(model)) if i in rings):
            raise
        return [None] * len(windows)
    check_rope(model, rope, "sliding_attention", rings)
    turned = {i for i, used in enumerate(rope_layers(model)) if used and i in rings}
    return [rope if i in turned else None for i in range(len(windows))]


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
