"""Attention over a ring's keys: masks come in from stored positions, GQA by head grouping.

:func:`attend` is the one entry point: keys, values, an optional mask and optional sink keys.
With a mask it is :func:`masked_attention`, SDPA with one boolean mask for every head (chapter
5); without one, every key is visible (a full ring's decode step) or, with ``causal=True``, the
chunk's own causal mask (a first chunk); with sink keys, the sink columns are scored per query
(StreamingLLM's convention, see :mod:`ringviz.sinks`). None knows about slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor, *, scale: float | None = None,
                     empty: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with a boolean ``(B, Tq, Tk)`` mask shared by all heads; GQA by head grouping.

    The ``G = Hq / Hkv`` query heads that share a KV head (HF ``repeat_kv`` order: head
    ``h`` reads KV head ``h // G``). A decode query's G heads are packed into the query
    dimension, so each KV head is read once by a G-row attention: a free view,
    faster than ``enable_gqa``.
    A chunk keeps its heads and ``enable_gqa``: its mask then broadcasts over heads, where
    packing would copy it G times.
    Rows with nothing visible come out as zeros, whatever the SDPA backend returns for them
    (kernels differ: zeros from some, NaN from others). ``empty``
    ``(B, Tq)`` names those rows when the caller knows them (padding queries: a real query
    always sees itself), sparing a reduction over the whole mask in every layer.
    """
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    mask = mask[:, None]  # (B, 1, T, Tk): one mask for every head
    if T == 1:  # decode: (B, num_kv_heads, G, head_dim), the G heads as G query rows
        out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D), k, v,
                                             attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=Hq != Hkv)
    # (B, 1, T, 1): broadcasts over heads
    empty = ~mask.any(dim=-1, keepdim=True) if empty is None else empty[:, None, :, None]
    # in place on SDPA's fresh output (saves a copy per call), unless autograd needs it
    out = out.masked_fill(empty, 0.0) if out.requires_grad else out.masked_fill_(empty, 0.0)
    return out.view(B, Hq, T, D)  # (B, Hq, T, head_dim)


def _unmasked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       scale: float | None = None) -> torch.Tensor:
    """Decode queries ``(B, Hq, 1, D)`` over every key: :func:`masked_attention` with a mask
    that is all True, without the mask.

    The same packed GQA view and SDPA call, so on the CPU the same bits: torch 2.13's CPU
    kernel gives an all-True boolean mask and no mask the same result
    (``tests/core/test_full_ring.py`` pins it). For a full ring's decode step, where every stored
    key is inside the query's window (:attr:`ringviz.RingKVCache.window_full`).
    """
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if Hq == Hkv:  # nothing to pack: the same call without two no-op views
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv * T, D), k, v, scale=scale)
    return out.view(B, Hq, T, D)


def _sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sink_keys: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """:func:`masked_attention` whose first ``S`` keys are replaced, per query, by ``sink_keys``.

    ``sink_keys`` ``(B, Hkv, T, S, D)`` (from :func:`ringviz.sinks.rotate_sinks`) score the sink
    columns; the other keys score as usual, and one softmax spans both. Written as matmul +
    softmax because SDPA takes one key per column for all queries. Scores and softmax run in
    float32 at least.
    """
    B, Hq, T, D = q.shape
    Hkv, Tk, S = k.shape[1], k.shape[2], sink_keys.shape[3]
    G = Hq // Hkv
    q = q * (D ** -0.5 if scale is None else scale)  # scaled once, on T rows, not Tk columns
    # every column first (a view of the storage, no copy), then the sink columns overwritten
    scores = torch.matmul(q.reshape(B, Hkv, G * T, D), k.transpose(-1, -2))
    scores = scores.view(B, Hkv, G, T, Tk)  # HF repeat_kv order: head h reads KV head h // G
    scores[..., :S] = torch.einsum("bhgtd,bhtsd->bhgts", q.reshape(B, Hkv, G, T, D), sink_keys)
    seen = mask[:, None, None]  # (B, 1, 1, T, Tk)
    scores = scores.to(torch.promote_types(q.dtype, torch.float32))
    weights = scores.masked_fill_(~seen, float("-inf")).softmax(dim=-1)
    weights = weights.masked_fill_(~seen.any(dim=-1, keepdim=True), 0.0)  # nothing visible: 0
    out = torch.matmul(weights.to(v.dtype).view(B, Hkv, G * T, Tk), v)  # (B, Hkv, G*T, D)
    return out.view(B, Hq, T, D)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    """A first chunk's queries over its own keys with SDPA's causal mask, which skips the
    blocks above the diagonal instead of scoring them against a ``(T, T)`` boolean mask.

    The same kernel and arithmetic as :func:`masked_attention` for a chunk on the CPU, so the
    same bits (``tests/hf/test_hf_causal.py`` pins it): a masked score adds nothing either way.
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           *, scale: float | None = None, empty: torch.Tensor | None = None,
           causal: bool = False, sink_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` ``(B, Hq, T, D)`` over ``k``, ``v`` ``(B, Hkv, K, D)``: ``(B, Hq, T, D)``.

    ``mask`` ``(B, T, K)`` bool, shared by every head (:func:`masked_attention`), or None:
    every key visible (a full ring's decode step; the same bits as an all-True mask on the
    CPU, ``tests/core/test_full_ring.py``), or with ``causal=True`` query ``i`` sees keys ``0..i``
    (a first chunk into an empty ring). ``sink_keys`` ``(B, Hkv, T, S, D)``: the first ``S``
    columns scored per query with these keys instead (:func:`ringviz.sinks.rotate_sinks`),
    in one softmax with the rest. ``empty`` ``(B, T)``: queries known to see nothing (padding):
    their rows come out zeros.
    """
    if sink_keys is not None:
        return _sink_attention(q, k, v, mask, sink_keys, scale=scale)
    if causal:
        return _causal_attention(q, k, v, scale)
    if mask is not None:
        return masked_attention(q, k, v, mask, scale=scale, empty=empty)
    out = _unmasked_attention(q, k, v, scale=scale)
    return out if empty is None else out.masked_fill(empty[:, None, :, None], 0.0)
