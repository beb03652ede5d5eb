"""The two kinds of layer in a RingCache: a ring per sliding layer, a growing store per full one.

Both are ``transformers`` cache layers (``CacheLayerMixin``). The model calls ``update(k, v)``
after RoPE; it stores nothing and hands the new tokens on, because the write and the attention
are one step (:meth:`RingLayer.step`, :meth:`FullLayer.step`): ringviz's attention function
calls it with the query and the forward plan's mask (:mod:`ringviz.hf.plan`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ringviz.attention import masked_attention
from ringviz.cache import RingKVCache
from ringviz.masks import band_mask
from ringviz.rope import Rope
from ringviz.slots import step_key_positions


class RingLayer(CacheLayerMixin):
    """A sliding layer: a :class:`RingKVCache` of ``window`` slots per row, made on first use.

    ``sinks=S`` keeps each row's first ``S`` positions in ``S`` more slots (attention sinks);
    ``sink_rope`` is the ring's convention for them (None: absolute positions; a rotation:
    StreamingLLM's positions inside the cache).
    """

    is_sliding = True
    is_compileable = True  # fixed shapes; the token count is a tensor, as in HF's StaticLayer

    def __init__(self, window: int, *, sinks: int = 0, sink_rope: Rope | None = None) -> None:
        super().__init__()
        self.window, self.sinks, self.sink_rope = window, sinks, sink_rope
        self.ring: RingKVCache | None = None
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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand the new tokens on to :meth:`step`, which allocates on first use and writes."""
        return key_states, value_states

    def mask(self, q_positions: torch.Tensor) -> torch.Tensor:
        """Bool ``(B, 1, T, K)``: which keys of :meth:`step` each query sees."""
        stored = self.ring.positions if self.ring is not None else None
        keys = step_key_positions(stored, q_positions, self.sinks, self.window)
        return band_mask(q_positions, keys, self.window, self.sinks)[:, None]

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             positions: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """:meth:`RingKVCache.step` with the plan's mask: write, attend ``(B, Hq, T, D)``."""
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        out = self.ring.step(query, key, value, positions, scale=scale, check=False,
                             mask=mask[:, 0])
        self.seen.add_(key.shape[2])
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.sinks + self.window + (query_length if query_length > 1 else 0), 0

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
    step); one spare slot past the end takes padding writes. Slot ``j`` holds position ``j``:
    a row's positions count its real tokens (``0, 1, 2, ...`` after its padding), so they never
    pass its column, the stored positions are implicit, and a query at ``p`` sees ``0..p``.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0  # columns given so far (padding included)
        self.allocated = 0  # slots per row in storage (the spare slot aside)
        self.reserve = 0  # slots to allocate at first use (set by generate and RingRunner)
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

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             positions: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Write ``T`` tokens at slots = their positions, then attend over slots ``0..seen+T-1``."""
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        B, H, T, D = key.shape
        need = self.seen + T  # positions never pass column indices, so slots stay < need
        if need > self.allocated:
            self._allocate(self.keys[:, :, :self.seen], self.values[:, :, :self.seen],
                           max(need, 2 * self.allocated))
        slot = torch.where(positions >= 0, positions, self.allocated)  # (B, T); spare for pads
        if T == 1:
            self._k_store[self._rows, :, slot[:, 0]] = key[:, :, 0]
            self._v_store[self._rows, :, slot[:, 0]] = value[:, :, 0]
        else:
            self._k_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), key)
            self._v_store.scatter_(2, slot[:, None, :, None].expand(B, H, T, D), value)
        self.seen = need
        return masked_attention(query, self._k_store[:, :, :need], self._v_store[:, :, :need],
                                mask[:, 0], scale=scale, empty=positions < 0)

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
