"""The two kinds of layer in a RingCache: a ring per sliding layer, a growing store per full one.

Both are ``transformers`` cache layers (``CacheLayerMixin``). The model calls ``update(k, v)``
after RoPE; it stores nothing and hands the new tokens on, because the write and the attention
are one step (:meth:`RingLayer.step`, :meth:`FullLayer.step`): ringviz's attention function
calls it with the query and the forward plan's mask (:mod:`ringviz.hf.plan`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

from ringviz.attention import masked_attention, unmasked_attention
from ringviz.cache import RingKVCache, step_key_positions
from ringviz.masks import band_mask
from ringviz.rope import Rope


def no_mask_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scale: float, positions: torch.Tensor, real: bool) -> torch.Tensor:
    """A decode query over keys it all sees (the plan's decision): no mask; a padding query,
    unless every token is known real, sees nothing and gets zeros."""
    out = unmasked_attention(query, keys, values, scale=scale)
    return out if real else out.masked_fill_((positions < 0)[:, None, :, None], 0.0)


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """A first chunk's queries ``(B, Hq, T, D)`` over its own ``T`` real keys (the plan's
    decision): the causal mask, applied by SDPA itself, which skips the blocks above the
    diagonal instead of scoring them against a ``(T, T)`` boolean mask.

    The same kernel and arithmetic as :func:`~ringviz.attention.masked_attention` for a chunk
    on the CPU, so the same bits (``tests/test_hf_causal.py`` pins it): a masked score adds
    nothing to the softmax either way.
    """
    return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale,
                                          enable_gqa=query.shape[1] != keys.shape[1])


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
    """A sliding layer: a :class:`RingKVCache` of ``window`` slots per row, made on first use.

    ``sinks=S`` keeps each row's first ``S`` positions in ``S`` more slots (attention sinks);
    ``sink_rope`` is the ring's convention for them (None: absolute positions; a rotation:
    StreamingLLM's positions inside the cache).
    """

    is_sliding = True
    is_compileable = True  # fixed shapes; the token count is a tensor, as in HF's StaticLayer

    def __init__(self, window: int, *, sinks: int = 0, sink_rope: Rope | None = None,
                 draft: int = 0) -> None:
        super().__init__()
        self.window, self.sinks, self.sink_rope = window, sinks, sink_rope
        # ``draft`` spare slots let a rejected draft of up to that many tokens be cropped: the
        # ring holds window + draft positions, so the keys the next query needs survive
        self.capacity = window + draft
        self.is_croppable = draft > 0
        self.ring: RingKVCache | None = None
        # tokens (columns, padding included) given so far: a 0-d tensor updated in place, so a
        # compiled decode step does not specialise (and recompile) on its value
        self.seen = torch.zeros((), dtype=torch.int64)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.ring = RingKVCache(B, H, self.window, D, sinks=self.sinks, sink_rope=self.sink_rope,
                                capacity=self.capacity, dtype=key_states.dtype,
                                device=key_states.device)
        self.keys, self.values = self.ring.k, self.ring.v
        self.seen = self.seen.to(key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand the new tokens on to :meth:`step`, which allocates on first use and writes."""
        return key_states, value_states

    def mask(self, q_positions: torch.Tensor) -> torch.Tensor:
        """Bool ``(B, 1, T, K)``: which keys of :meth:`step` each query sees."""
        stored = self.ring.positions if self.ring is not None else None
        keys = step_key_positions(stored, q_positions, self.sinks, self.capacity)
        return band_mask(q_positions, keys, self.window, self.sinks)[:, None]

    def plain_causal(self, T: int) -> bool:
        """Whether a chunk of ``T`` real tokens, stepped now, sees exactly the causal mask:
        the ring holds nothing yet (not allocated), the window covers the chunk, no sinks."""
        return self.ring is None and not self.sinks and T <= self.window

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             positions: torch.Tensor, mask: torch.Tensor, scale: float, *,
             unmasked: bool = False, causal: bool = False, real: bool = False
             ) -> torch.Tensor:
        """:meth:`RingKVCache.step` with the plan's mask: write, attend ``(B, Hq, T, D)``.

        ``unmasked``: the plan found every key visible (the ring is full), so the step is the
        write and attention with no mask; ``causal``: the plan found the chunk plain causal
        (:meth:`plain_causal`), so its queries attend over its own keys with SDPA's causal
        mask, then it is written; ``real``: every token is real, so each row's is its next
        position (the ring's contiguous write).
        """
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        if causal and query.shape[2] == key.shape[2]:
            out = causal_attention(query, key, value, scale)
            self.ring.write(key, value, positions, check=False, contiguous=real)
        elif unmasked:
            self.ring.write(key, value, positions, check=False, contiguous=real)
            out = no_mask_attention(query, self.ring.k, self.ring.v, scale, positions, real)
        else:
            out = self.ring.step(query, key, value, positions, scale=scale, check=False,
                                 contiguous=real, mask=mask[:, 0])
        self.seen.add_(key.shape[2])
        return out

    def take_rows(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes row ``index[i]`` (the row operations of :class:`RowsMixin`)."""
        if self.ring is not None:
            self.ring.take_rows(index.to(self.ring.device), check=False)
            self.keys, self.values = self.ring.k, self.ring.v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.sinks + self.capacity + (query_length if query_length > 1 else 0), 0

    def get_seq_length(self) -> torch.Tensor:
        return self.seen

    def get_max_length(self) -> int:
        return self.sinks + self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens of every row (a rejected draft).

        :meth:`RingKVCache.truncate`, which raises (changing nothing) unless every row still
        holds the window its next query needs: true for drafts up to the spare slots.
        """
        n = -tokens_to_remove
        if n and self.ring is not None:
            self.ring.truncate(self.ring.lengths - n)
            self.seen.sub_(n)

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes if self.ring is not None else 0

    def reset(self) -> None:
        if self.ring is not None:
            self.ring.reset()
        self.seen.zero_()


class FullLayer(RowsMixin, CacheLayerMixin):
    """A full-attention layer: row ``b``'s token at position ``p`` lives in slot ``p``.

    Storage holds the tokens that arrived and grows by doubling (amortised O(1) per token,
    never a copy of the whole history per step, never reserved for ``max_new_tokens``); one
    spare slot past the end takes padding writes. Slot ``j`` holds position ``j``:
    a row's positions count its real tokens (``0, 1, 2, ...`` after its padding), so they never
    pass its column, the stored positions are implicit, and a query at ``p`` sees ``0..p``.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True  # slot = position: a crop forgets the last columns

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0  # columns given so far (padding included)
        self.allocated = 0  # slots per row in storage (the spare slot aside)
        self.reserve = 0  # slots to allocate at first use (RingRunner knows its length)
        self._k_store: torch.Tensor | None = None
        self._v_store: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None  # (B,) row indices, made with the storage

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, T, D = key_states.shape
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
        self.keys, self.values = self._k_store[:, :, :slots], self._v_store[:, :, :slots]
        self._rows = torch.arange(B, device=k_old.device)  # row index of a decode write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand the new tokens on to :meth:`step`, which allocates on first use and writes."""
        return key_states, value_states

    def mask(self, q_positions: torch.Tensor) -> torch.Tensor:
        """Bool ``(B, 1, T, seen + T)``: slot ``j`` (position ``j``) visible to queries ``>= j``."""
        slots = torch.arange(self.seen + q_positions.shape[1], device=q_positions.device)
        return ((slots <= q_positions[..., None]) & (q_positions[..., None] >= 0))[:, None]

    def plain_causal(self, T: int) -> bool:
        """Whether a chunk of ``T`` real tokens, stepped now, sees exactly the causal mask:
        the layer holds no column yet, so slot ``j`` will hold the chunk's ``j``-th token."""
        return self.seen == 0

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             positions: torch.Tensor, mask: torch.Tensor, scale: float, *,
             unmasked: bool = False, causal: bool = False, real: bool = False
             ) -> torch.Tensor:
        """Write ``T`` tokens at slots = their positions, then attend over slots ``0..seen+T-1``
        (``unmasked``: the plan found every slot visible, as no row has had padding;
        ``causal``: a first chunk without padding, :meth:`plain_causal`)."""
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        B, H, T, D = key.shape
        need = self.seen + T  # positions never pass column indices, so slots stay < need
        if need > self.allocated:
            self._allocate(self.keys[:, :, :self.seen], self.values[:, :, :self.seen],
                           max(need, 2 * self.allocated))
        if real and not self.seen:  # a first chunk of real tokens: token j to slot j
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
        self.seen = need
        keys, values = self._k_store[:, :, :need], self._v_store[:, :, :need]
        if causal and query.shape[2] == need:
            return causal_attention(query, keys, values, scale)
        if unmasked:
            return no_mask_attention(query, keys, values, scale, positions, real)
        empty = positions[:, T - query.shape[2]:] < 0  # the queries' rows (Gemma 4 keeps fewer)
        return masked_attention(query, keys, values, mask[:, 0], scale=scale, empty=empty)

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
        self._allocate(k[:, :, :self.seen], v[:, :, :self.seen], self.allocated)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` columns (their slots are written again)."""
        self.seen = max(0, self.seen + tokens_to_remove) if tokens_to_remove < 0 else self.seen

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
