"""The two kinds of layer in a RingCache: a ring per sliding layer, a growing store per full one.

Both are ``transformers`` cache layers (``CacheLayerMixin``): the model calls ``update(k, v)``
after RoPE, and the keys and values it returns are what that layer's attention reads. Positions
come from :mod:`ringviz.hf.attention` (the mask hook counts them once per forward).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ringviz.cache import RingKVCache

NOT_THROUGH_GENERATE = (
    "a RingCache's masks must come from its stored positions, but this forward used Hugging "
    "Face's stock masks (keys assumed in temporal order). Call ringviz.hf.generate(model, "
    "input_ids, ...) instead of model.generate(..., cache=RingCache(model)).")



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
            raise RuntimeError(NOT_THROUGH_GENERATE)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ring, T = self.ring, key_states.shape[2]
        if T == 1:
            ring.write(key_states, value_states, positions, check=False)
            out = ring.k, ring.v
        elif self.fresh():  # an empty ring adds nothing but W masked keys: the chunk alone
            pad = (positions < 0)[:, None, :, None]  # 0 * NaN is NaN: zero padded keys
            out = key_states.masked_fill(pad, 0.0), value_states.masked_fill(pad, 0.0)
            ring.write(key_states, value_states, positions, check=False)
        else:  # [ring | chunk] as RingKVCache.step's chunks attend over it
            out = ring.keys_with_chunk(key_states, value_states, positions)[:2]
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
