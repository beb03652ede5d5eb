"""Attention sinks on a real model: the model's own RoPE for the sink keys, and StreamingLLM itself.

* :func:`model_sink_rope` turns a Hugging Face model's rotary embedding into the ``sink_rope``
  that :class:`ringviz.RingKVCache` takes (StreamingLLM's positions inside the cache), per layer
  type: Gemma 3's sliding layers rotate with their local base (1e4), not the global one (1e6).
* :func:`streaming_llm_logits` is StreamingLLM's algorithm as the paper and its code run it, and
  the reference the ring is checked against: keys cached *before* RoPE, the cache cut to
  ``[sinks | last W]``, and every key and the query re-rotated at their positions inside the
  cache on every step. It shares nothing with the ring but Hugging Face's modules.
* :func:`float64_rope_angles`: Hugging Face computes RoPE angles in float32, so a rotation by
  ``a`` then ``b`` differs from one by ``a + b`` by about ``(a + b) * 2**-24`` radians. The two
  conventions rotate by different amounts, so an exactness check in float64 needs float64
  angles on both sides; this context manager gives the model's rotary embedding exactly that.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ringviz.rope import Rope, rotate_half

STREAMING_REF_NAME = "ringviz_streaming_llm_reference"


def rotary_embedding(model) -> torch.nn.Module:
    """The model's one rotary-embedding module (``model.model.rotary_emb`` for Llama, Gemma 3)."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no model.rotary_emb: sinks with "
                         f"StreamingLLM's positions need the model's RoPE")
    return rotary


def _takes_layer_type(rotary: torch.nn.Module) -> bool:
    return "layer_type" in inspect.signature(rotary.forward).parameters


def model_sink_rope(model, layer_type: str = "sliding_attention") -> Rope:
    """``f(x, positions)``: rotate ``x`` (B, H, T, D) by ``positions`` (B, T) with the model's RoPE.

    The same cos/sin the model's attention layers apply to q and k, so a sink key turned by
    ``p - c`` is exactly what the model would have produced at the shifted position (up to the
    float32 angles, see :func:`float64_rope_angles`). Scaled RoPE variants that also rescale
    q/k (``attention_scaling != 1``) are not rotations and are rejected.
    """
    rotary = rotary_embedding(model)
    per_type = _takes_layer_type(rotary)
    scaling = getattr(rotary, f"{layer_type}_attention_scaling" if per_type
                      else "attention_scaling", 1.0)
    if scaling != 1.0:
        raise ValueError(f"RoPE with attention_scaling={scaling} scales keys as it rotates: "
                         f"turning a stored key again would scale it twice")

    def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        args = (layer_type,) if per_type else ()
        cos, sin = rotary(x, positions, *args)  # (B, T, D) each
        return x * cos[:, None] + rotate_half(x) * sin[:, None]

    rope.__name__ = f"model_sink_rope[{layer_type}]"
    return rope


@contextmanager
def float64_rope_angles(model) -> Iterator[None]:
    """Within the block, the model's rotary embedding computes its angles in float64.

    ``inv_freq`` keeps its float32 values; only the product ``position * inv_freq`` and its
    cos/sin are taken in float64, so rotations compose exactly (to float64 rounding) and
    ``R(a) R(b) == R(a + b)`` holds as the algebra of the two conventions assumes.
    """
    rotary = rotary_embedding(model)
    per_type = _takes_layer_type(rotary)

    def forward(x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        inv = getattr(rotary, f"{layer_type}_inv_freq") if per_type else rotary.inv_freq
        freqs = position_ids[..., None].double() * inv.double().to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rotary.forward = forward  # nn.Module.__call__ looks the instance attribute up first
    try:
        yield
    finally:
        del rotary.forward


class _StreamingState:
    """Per layer: unrotated keys and values ``[sinks | recent]`` (1, Hkv, n, D) and the rope."""

    def __init__(self, model, sinks: int, window: int | None) -> None:
        self.sinks, self.window = sinks, window
        types = getattr(model.config, "layer_types", None) or (
            ["sliding_attention"] * model.config.num_hidden_layers)
        self.sliding = [t == "sliding_attention" for t in types]
        self.ropes = [model_sink_rope(model, t) for t in types]
        self.k: list[torch.Tensor | None] = [None] * len(types)
        self.v: list[torch.Tensor | None] = [None] * len(types)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """One token: append, evict to ``[sinks | last W]``, re-rotate all, attend (1, Hq, 1, D)."""
        keys = k if self.k[layer] is None else torch.cat([self.k[layer], k], dim=2)
        values = v if self.v[layer] is None else torch.cat([self.v[layer], v], dim=2)
        if self.sliding[layer] and keys.shape[2] > self.sinks + self.window:
            keep = list(range(self.sinks)) + list(range(keys.shape[2] - self.window,
                                                        keys.shape[2]))
            keys, values = keys[:, :, keep], values[:, :, keep]
        self.k[layer], self.v[layer] = keys, values
        n = keys.shape[2]
        rope = self.ropes[layer]
        keys = rope(keys, torch.arange(n, device=keys.device)[None])  # positions in the cache
        q = rope(q, torch.full((1, 1), n - 1, device=q.device))  # the query is the last entry
        G = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1)
        weights = torch.softmax((q @ keys.transpose(-1, -2)) * scaling, dim=-1)
        return weights @ values


def _streaming_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask, scaling: float,
                         dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    state: _StreamingState = kwargs["streaming_state"]
    out = state.attend(module.layer_idx, query, key, value, scaling)
    return out.transpose(1, 2), None


@torch.no_grad()
def streaming_llm_logits(model, ids: torch.Tensor, window: int | None, sinks: int) -> torch.Tensor:
    """StreamingLLM's logits ``(L, vocab)`` for one sequence, one token per forward.

    The model is run with every position id 0, so its RoPE is the identity and the attention
    function receives unrotated q and k; it then does StreamingLLM's bookkeeping itself. Sliding
    layers keep ``[sinks | last window]`` (``window=None``: the model's own ``sliding_window``);
    full-attention layers (Gemma 3's global ones) keep everything, so their positions inside the
    cache are the absolute ones.
    """
    from transformers import AttentionInterface

    from ringviz.models.drive import attention_implementation, layer_windows

    if ids.ndim != 1:
        raise ValueError(f"ids must be one sequence (L,), got shape {tuple(ids.shape)}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")
    window = next(w for w in layer_windows(model, window) if w is not None)
    AttentionInterface.register(STREAMING_REF_NAME, _streaming_attention)
    state = _StreamingState(model, sinks, window)
    zero = torch.zeros(1, 1, dtype=torch.int64, device=ids.device)
    logits = []
    with attention_implementation(model, STREAMING_REF_NAME):
        for t in range(len(ids)):
            out = model(input_ids=ids[None, t:t + 1], position_ids=zero, use_cache=False,
                        streaming_state=state)
            logits.append(out.logits[0, 0])
    return torch.stack(logits)
