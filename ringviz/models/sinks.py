"""StreamingLLM itself on a real model: the reference the ring's sinks are checked against.

:func:`streaming_llm_logits` is StreamingLLM's algorithm as the paper and its code run it: keys
cached *before* RoPE, the cache cut to ``[sinks | last W]``, and every key and the query
re-rotated at their positions inside the cache on every step
(:class:`ringviz.reference.StreamingLLMCache`, given the model's own rotary). It shares nothing
with the ring but Hugging Face's modules.
"""

from __future__ import annotations

import torch

from ringviz.checks import check_int
from ringviz.hf.attention import attention_implementation
from ringviz.hf.config import KIND_TYPES, read_layout
from ringviz.hf.rotary import model_sink_rope, rope_layers
from ringviz.reference import StreamingLLMCache

STREAMING_REF_NAME = "ringviz_streaming_llm_reference"


def _unturned(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The RoPE of a layer that has none: keys and queries stay as they are."""
    return x


def _streaming_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask, scaling: float,
                         dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """One token: append, evict to ``[sinks | last W]``, re-rotate all, attend."""
    cache: StreamingLLMCache = kwargs["streaming_caches"][module.layer_idx]
    keys, values = cache.update(key, value)
    q = cache.query(query)  # the query is the cache's last entry
    G = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1)
    weights = torch.softmax((q @ keys.transpose(-1, -2)) * scaling, dim=-1)
    return (weights @ values).transpose(1, 2), None


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

    if ids.ndim != 1:
        raise ValueError(f"ids must be one sequence (L,), got shape {tuple(ids.shape)}")
    sinks = check_int("sinks", sinks, minimum=0)
    layout = read_layout(model)
    # per layer, a StreamingLLMCache with the model's own rotary: Llama's every layer slides
    # (imposed), Gemma 3's full layers keep everything, a layer without RoPE (SmolLM3's every
    # fourth) never turns its keys
    caches = [StreamingLLMCache(sinks, w, model_sink_rope(model, KIND_TYPES[kind])
                                if used else _unturned)
              for kind, w, used in zip(layout.kinds, layout.windows(window), rope_layers(model),
                                       strict=True)]
    AttentionInterface.register(STREAMING_REF_NAME, _streaming_attention)
    zero = torch.zeros(1, 1, dtype=torch.int64, device=ids.device)
    logits = []
    with attention_implementation(model, STREAMING_REF_NAME):
        for t in range(len(ids)):
            out = model(input_ids=ids[None, t:t + 1], position_ids=zero, use_cache=False,
                        streaming_caches=caches)
            logits.append(out.logits[0, 0])
    return torch.stack(logits)
