"""The ring inside Hugging Face's ``generate()``: :class:`RingCache` and :func:`generate`.

``RingCache(model)`` is a real ``transformers.Cache``. Its sliding layers are rings
(:class:`ringviz.cache.RingKVCache`: slot ``pos % W``, stored positions, one slot written per
token, never a copy of the window); its full-attention layers keep every token in storage that
grows geometrically, so no step copies their history. The data path of one layer::

    q, k, v (RoPE at absolute positions, by HF) -> cache.update: ring write at slot pos % W
        -> mask from stored positions (built once per forward per window) -> attention

Hugging Face's stock masks assume key ``i`` holds position ``kv_offset + i`` (keys in temporal
order); a ring's slots break that as soon as it wraps, is not full, takes a chunk or a padded row.
So the masks come from ringviz: a mask function registered in ``AttentionMaskInterface`` under
:data:`ATTN_NAME` (transformers calls it once per layer type and forward) reads the ring's stored
positions, and an attention function registered in ``AttentionInterface`` under the same name
applies them. :func:`generate` switches the model to that name for the call and back afterwards.
Plain ``model.generate(cache=RingCache(model))`` keeps the stock masks, so the first cache write
raises an error that names :func:`generate`; it is never silently wrong.

Modules: ``layers`` (``RingLayer``, ``FullLayer``), ``cache`` (``RingCache``), ``attention``
(the mask and attention hooks, ``ring_active``); :func:`generate` lives here.

Attention sinks: ``RingCache(model, sinks=S, sink_rope=None | "cache")`` (and the same arguments
of :func:`generate`) keep each row's first ``S`` tokens in every ring, as
:class:`ringviz.models.drive.RingRunner` does: the sliding masks add the sink rule, and with
``"cache"`` (StreamingLLM's positions inside the cache) the attention function scores the sink
keys turned by ``p - min(p, S + W - 1)``, the core's own sink attention. Full layers unchanged.

Positions: a row's token at absolute position ``p`` is the ``p``-th real token of that row
(``attention_mask.cumsum(-1) - 1``, what ``generate`` feeds RoPE); padding is ``-1`` and never
takes a slot.
"""

from __future__ import annotations

import copy

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from ringviz.hf.attention import ATTN_NAME, register, ring_active
from ringviz.hf.cache import RingCache, check_model
from ringviz.hf.calls import (
    UNSET,
    check_continuation,
    check_mask_holes,
    check_settings,
    effective_attention_mask,
)
from ringviz.hf.config import layer_windows, read_layout
from ringviz.hf.layers import FullLayer, RingLayer

# default prefill chunk: a prompt is prefilled in chunks of this many tokens. Each chunk is one
# more pass over the weights (about a decode step: 0.1 s for Gemma-3-270M on one CPU thread), so
# chunks are long; a chunk's transient memory (its mask, activations) stays tens of MB.
PREFILL_CHUNK = 2048
# beam search and beam sampling only gather the cache's rows (reorder_cache): a ring serves them
SERVED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                GenerationMode.BEAM_SAMPLE)


def _generation_config(model, kwargs: dict) -> GenerationConfig:
    """The generation config this call would use (a copy: the model's stays untouched)."""
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config


def _check_call(model, kwargs: dict, config: GenerationConfig) -> None:
    """Raise on what a ring cannot serve, before anything runs."""
    for name, why in (("past_key_values", "pass cache= (a RingCache) instead"),
                      ("position_ids", "positions come from attention_mask"),
                      ("cache_implementation", "the cache is a RingCache")):
        if kwargs.get(name) is not None:
            raise ValueError(f"ringviz.hf.generate does not take {name}: {why}")
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    if mode == GenerationMode.ASSISTED_GENERATION:
        raise ValueError("assisted decoding and prompt lookup crop rejected draft tokens, which "
                         "needs a ring with spare slots for the longest draft: not served by "
                         "RingCache yet; use greedy, sampling or beams")
    if mode not in SERVED_MODES:
        raise ValueError(f"generation mode {mode.value!r} is not supported by RingCache: it "
                         f"is not in transformers {transformers.__version__} itself (a Hub "
                         f"recipe that ringviz has not checked); use greedy, sampling or beams")
    if config.output_attentions:
        raise ValueError("output_attentions is not supported: the ring attention returns no "
                         "weights")
    if config.use_cache is False:
        raise ValueError("use_cache=False would bypass the RingCache")


def generate(model, input_ids: torch.Tensor | None = None, *, window: int | None = None,
             sinks: int = UNSET, sink_rope: str | None = UNSET, **kwargs):
    """``model.generate(input_ids, **kwargs)`` decoded through a :class:`RingCache`.

    A fresh ``RingCache(model, window=window, sinks=sinks, sink_rope=sink_rope)`` unless
    ``cache=`` passes one, whose settings then serve (one given that differs raises).
    ``sinks=S`` keeps each row's first S tokens in every ring; ``sink_rope`` None scores them
    at absolute positions, ``"cache"`` at StreamingLLM's positions inside the cache
    (:class:`RingCache`).

    A conversation passes the returned cache back with the whole conversation so far as
    ``input_ids`` (and its ``attention_mask``, padding included), as with Hugging Face's own
    caches: only the tokens the cache has not seen are prefilled. The prompt is prefilled in
    chunks of ``prefill_chunk_size`` tokens (default :data:`PREFILL_CHUNK`; ``inputs_embeds``
    in one pass, which Hugging Face's chunked prefill cannot split).
    """
    cache = kwargs.pop("cache", None)
    config = _generation_config(model, kwargs)
    _check_call(model, kwargs, config)
    if cache is None:
        cache = RingCache(model, window=window, sinks=0 if sinks is UNSET else sinks,
                          sink_rope=None if sink_rope is UNSET else sink_rope)
    else:
        check_settings(model, cache, window, sinks, sink_rope)
    embeds = kwargs.get("inputs_embeds")
    source = embeds if embeds is not None else input_ids
    mask = effective_attention_mask(input_ids if embeds is None else None,
                                    kwargs.get("attention_mask"), config)
    check_mask_holes(cache, mask)
    if source is not None:
        check_continuation(cache, source.shape[1], source.shape[0], mask)
    if embeds is not None and config.prefill_chunk_size is not None:
        raise ValueError("inputs_embeds are prefilled in one pass: Hugging Face's chunked "
                         "prefill splits input_ids only; leave prefill_chunk_size out")
    if config.prefill_chunk_size is None and embeds is None:
        kwargs["prefill_chunk_size"] = PREFILL_CHUNK
    if config.cache_implementation is not None:  # a model default (e.g. Gemma 3's "hybrid")
        kwargs["cache_implementation"] = None  # would clash with cache=: the ring replaces it
    with ring_active(model, cache):
        return model.generate(input_ids, cache=cache, **kwargs)


__all__ = ["ATTN_NAME", "PREFILL_CHUNK", "FullLayer", "RingCache", "RingLayer", "check_model",
           "generate", "layer_windows", "read_layout", "register", "ring_active"]
