"""The two kinds of layer in a RingCache: a ring per sliding layer, a growing store per full one.

Both are ``transformers`` cache layers (``CacheLayerMixin``): the model calls ``update(k, v)``
after RoPE, and the keys and values it returns are what that layer's attention reads. Positions
come from :mod:`ringviz.hf.attention` (the mask hook counts them once per forward).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ringviz.cache import RingKVCache, chunk_key_positions, home_slots
from ringviz.rope import Rope

NOT_THROUGH_GENERATE = (
    "a RingCache's masks must come from its stored positions, but this forward used Hugging "
    "Face's stock masks (keys assumed in temporal order). Call ringviz.hf.generate(model, "
    "input_ids, ...) instead of model.generate(..., cache=RingCache(model)).")



class RingLayer(CacheLayerMixin):
    """A sliding layer: a :class:`RingKVCache` of ``window`` slots per row, made on first use.

    ``sinks=S`` keeps each row's first ``S`` positions in ``S`` more slots (attention sinks);
    ``sink_rope`` is the ring's convention for them (None: absolute positions; a rotation:
    StreamingLLM's positions inside the cache, applied by :meth:`attention`).
    """

    is_sliding = True
    is_compileable = True  # fixed shapes; the token count is a tensor, as in HF's StaticLayer

    def __init__(self, window: int, *, sinks: int = 0, sink_rope: Rope | None = None) -> None:
        super().__init__()
        self.window, self.sinks, self.sink_rope = window, sinks, sink_rope
        self.ring: RingKVCache | None = None
        self.q_positions: torch.Tensor | None = None  # the last update's positions (B, T)
        # tokens (columns, padding included) given so far: a 0-d tensor updated in place, so a
        # compiled decode step does not specialise (and recompile) on its value
        self.seen = torch.zeros((), dtype=torch.int64)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.ring = RingKVCache(B, H, self.window, D, sinks=self.sinks, sink_rope=self.sink_rope,
                                dtype=key_states.dtype, device=key_states.device)
        self.keys, self.values = self.ring.k, self.ring.v
        self.seen = self.seen.to(key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               positions: torch.Tensor | None = None, padded: bool = True, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``T`` tokens; return the keys/values their queries attend over.

        ``T == 1``: write the slot, return the ring itself (``S + window`` keys, slot order).
        ``T > 1`` (a prefill chunk, possibly longer than the window): return
        :meth:`RingKVCache.keys_with_chunk` (``[sinks | ring | chunk]``) as it was before the
        write (just the chunk into an empty ring without sinks, its padded keys zeroed unless
        ``padded=False`` says it has none), then write (a chunk's early queries still need keys
        it overwrites).
        """
        if positions is None:
            raise RuntimeError(NOT_THROUGH_GENERATE)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ring, T = self.ring, key_states.shape[2]
        if T == 1:
            ring.write(key_states, value_states, positions, check=False)
            out = ring.k, ring.v
        elif not self.sinks and self.fresh():  # an empty ring adds W masked keys: chunk alone
            out = key_states, value_states
            if padded:  # 0 * NaN is NaN: zero padded keys
                pad = (positions < 0)[:, None, :, None]
                out = key_states.masked_fill(pad, 0.0), value_states.masked_fill(pad, 0.0)
            ring.write(key_states, value_states, positions, check=False)
        else:  # [ring | chunk] as RingKVCache.step's chunks attend over it
            out = ring.keys_with_chunk(key_states, value_states, positions)[:2]
            ring.write(key_states, value_states, positions, check=False)
        self.seen.add_(T)
        self.q_positions = positions
        return out

    def attention(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the last update's queries over the keys it returned (sink convention).

        The core's own :meth:`RingKVCache.attend_keys`: with ``sink_rope``, each query scores
        the ``S`` sink columns turned by ``p - min(p, S + W - 1)``.
        """
        return self.ring.attend_keys(query, self.q_positions, keys, values, mask, scale)

    def fresh(self) -> bool:
        """True before the first token (a host sync: asked only for prefill chunks)."""
        return self.ring is None or int(self.seen) == 0

    def key_positions(self, q_positions: torch.Tensor) -> torch.Tensor:
        """``(B, K)`` position of each key :meth:`update` will return for these queries."""
        S, n = self.sinks, self.sinks + self.window
        chunk = q_positions.shape[1] > 1
        if chunk and not S and self.fresh():  # the chunk alone, into an empty ring
            return q_positions
        before = self.ring.positions if self.ring is not None else torch.full(
            (q_positions.shape[0], n), -1, dtype=torch.int64, device=q_positions.device)
        if chunk:  # [sinks | ring | chunk], as RingKVCache.keys_with_chunk returns them
            return chunk_key_positions(before, q_positions, S)
        q = q_positions  # (B, 1): its slot now holds it, as RingKVCache.write puts it
        home = home_slots(q, S, self.window)  # (B, 1)
        return torch.where(torch.arange(n, device=before.device) == home, q, before)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length == 1:
            return self.sinks + self.window, 0
        fresh = not self.sinks and self.fresh()
        return (0 if fresh else self.sinks + self.window) + query_length, 0

    def get_seq_length(self) -> torch.Tensor:
        return self.seen

    def get_max_length(self) -> int:
        return self.sinks + self.window

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
        self._rows: torch.Tensor | None = None  # (B,) row indices, made with the storage

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
        self._rows = torch.arange(B, device=k_old.device)  # row index of a decode write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               positions: torch.Tensor | None = None, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``T`` tokens at slots = their positions; return slots ``0 .. seen+T-1``."""
        if positions is None:
            raise RuntimeError(NOT_THROUGH_GENERATE)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, T, D = key_states.shape
        need = self.seen + T  # positions never exceed column indices, so slots stay < need
        if need > self.capacity:
            self._allocate(self.keys[:, :, :self.seen], self.values[:, :, :self.seen],
                           max(need, 2 * self.capacity))
        slot = torch.where(positions >= 0, positions, self.capacity)  # (B, T); spare for pads
        if T == 1:
            self._k_store[self._rows, :, slot[:, 0]] = key_states[:, :, 0]
            self._v_store[self._rows, :, slot[:, 0]] = value_states[:, :, 0]
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
