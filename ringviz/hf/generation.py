"""``generate``: Hugging Face's ``generate()`` decoded through a :class:`RingCache`."""

from __future__ import annotations

import copy

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from ringviz.checks import sink_convention_from
from ringviz.hf.attention import ring_active
from ringviz.hf.cache import RingCache
from ringviz.hf.calls import (
    UNSET,
    check_continuation,
    check_mask_holes,
    check_settings,
    draft_tokens,
    effective_attention_mask,
)

# default prefill chunk: a prompt is prefilled in chunks of this many tokens. Each chunk is one
# more pass over the weights (about a decode step: 0.1 s for Gemma-3-270M on one CPU thread), so
# chunks are long; a chunk's transient memory (its mask, activations) stays tens of MB.
PREFILL_CHUNK = 2048
# beam search and beam sampling only gather the cache's rows (reorder_cache); assisted decoding
# and prompt lookup crop rejected drafts, inside rings with spare slots
SERVED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                GenerationMode.BEAM_SAMPLE, GenerationMode.ASSISTED_GENERATION)


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
    if mode not in SERVED_MODES:
        raise ValueError(f"generation mode {mode.value!r} is not supported by RingCache: it "
                         f"is not in transformers {transformers.__version__} itself (a Hub "
                         f"recipe that ringviz has not checked); use greedy, sampling, beams "
                         f"or assisted decoding")
    if config.output_attentions:
        raise ValueError("output_attentions is not supported: the ring attention returns no "
                         "weights")
    if config.use_cache is False:
        raise ValueError("use_cache=False would bypass the RingCache")


def generate(model, input_ids: torch.Tensor | None = None, *, window: int | None = None,
             sinks: int = UNSET, sink_convention: str = UNSET, sink_rope: str | None = None,
             **kwargs):
    """``model.generate(input_ids, **kwargs)`` decoded through a :class:`RingCache`.

    A fresh ``RingCache(model, window=window, sinks=sinks, sink_convention=...)`` unless
    ``cache=`` passes one, whose settings then serve (one given that differs raises).
    ``sinks=S`` keeps each row's first S tokens in every ring; ``sink_convention="absolute"``
    scores them at their own positions, ``"cache"`` at StreamingLLM's positions inside the cache
    (:class:`RingCache`; ``sink_rope=None | "cache"`` is its deprecated spelling).

    A conversation passes the returned cache back with the whole conversation so far as
    ``input_ids`` (and its ``attention_mask``, padding included), as with Hugging Face's own
    caches: only the tokens the cache has not seen are prefilled. The prompt is prefilled in
    chunks of ``prefill_chunk_size`` tokens (default :data:`PREFILL_CHUNK`; ``inputs_embeds``
    in one pass, which Hugging Face's chunked prefill cannot split). Greedy, sampling, beam
    search, beam sampling, assisted decoding and prompt lookup (the rings get spare slots for
    the longest draft); full-attention layers grow with the tokens that arrive.
    """
    cache = kwargs.pop("cache", None)
    if sink_rope is not None:
        sink_convention = sink_convention_from(
            "absolute" if sink_convention is UNSET else sink_convention, sink_rope)
    config = _generation_config(model, kwargs)
    _check_call(model, kwargs, config)
    embeds = kwargs.get("inputs_embeds")
    source = embeds if embeds is not None else input_ids
    draft = draft_tokens(model, kwargs, config, source.shape[1] if source is not None else 0)
    if cache is None:
        cache = RingCache(model, window=window, sinks=0 if sinks is UNSET else sinks,
                          sink_convention="absolute" if sink_convention is UNSET
                          else sink_convention, draft=draft)
    else:
        check_settings(model, cache, window, sinks, sink_convention)
        if draft > cache.draft:
            raise ValueError(f"this call may draft {draft} tokens, but the cache's rings have "
                             f"spare slots for {cache.draft}: build RingCache(model, "
                             f"draft={draft}) for it")
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
    if source is not None:  # generate appends one real token per row and step after it
        # (columns, fewest real tokens of a row): no mask is an all-ones one
        columns = source.shape[1]
        cache.prompt = (columns, columns if mask is None else int(mask.sum(-1).min()))
    before = cache.seen_columns()
    try:
        with ring_active(model, cache):
            return model.generate(input_ids, cache=cache, **kwargs)
    except BaseException as error:
        taken = 0 if cache.refused is not None else cache.seen_columns() - before
        if taken:
            cache.refuse(f"a generate call raised {type(error).__name__} after the cache had "
                         f"taken {taken} columns of a reply the caller never received")
        raise
