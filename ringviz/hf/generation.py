"""``generate``: Hugging Face's ``generate()`` decoded through a :class:`RingCache`."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from ringviz.checks import check_sinks, sink_convention_from
from ringviz.hf.attention import ring_active
from ringviz.hf.cache import RingCache

# default prefill chunk: a prompt is prefilled in chunks of this many tokens. Each chunk is one
# more pass over the weights (about a decode step: 0.1 s for Gemma-3-270M on one CPU thread), so
# chunks are long; a chunk's transient memory (its mask, activations) stays tens of MB.
PREFILL_CHUNK = 2048
SERVED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


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
                         f"needs crop/reorder of tokens a ring has evicted; use greedy or "
                         f"sampling (num_beams=1, no assistant)")
    if config.output_attentions:
        raise ValueError("output_attentions is not supported: the ring attention returns no "
                         "weights")
    if config.use_cache is False:
        raise ValueError("use_cache=False would bypass the RingCache")


def _check_cache(model, cache, window: int | None, sinks: int, sink_convention: str) -> None:
    """Raise unless ``cache`` is an unused RingCache for ``model`` with these settings."""
    if not isinstance(cache, RingCache) or cache.config is not model.config:
        raise ValueError("cache= must be a RingCache built for this model")
    if window is not None and window != cache.window:
        raise ValueError(f"window={window} differs from the cache's window {cache.window}")
    if (sinks, sink_convention) != (cache.sinks, cache.sink_convention):
        raise ValueError(f"sinks={sinks}, sink_convention={sink_convention!r} differ from the "
                         f"cache's sinks={cache.sinks}, "
                         f"sink_convention={cache.sink_convention!r}")
    if cache.get_seq_length() > 0:
        raise ValueError("this RingCache already holds tokens: pass a fresh one")


def generate(model, input_ids: torch.Tensor | None = None, *, window: int | None = None,
             sinks: int = 0, sink_convention: str = "absolute", sink_rope: str | None = None,
             **kwargs):
    """``model.generate(input_ids, **kwargs)`` decoded through a :class:`RingCache`.

    A fresh ``RingCache(model, window=window, sinks=sinks, sink_convention=...)`` unless
    ``cache=`` passes one (unused, built for this model, with these ``sinks`` and
    ``sink_convention``). ``sinks=S`` keeps each row's first S tokens in every ring;
    ``sink_convention="absolute"`` scores them at their own positions, ``"cache"`` at
    StreamingLLM's positions inside the cache (:class:`RingCache`; ``sink_rope=None | "cache"``
    is its deprecated spelling). The prompt is prefilled in chunks of ``prefill_chunk_size``
    tokens (default :data:`PREFILL_CHUNK`). Greedy and sampling only.
    """
    cache = kwargs.pop("cache", None)
    sink_convention = sink_convention_from(sink_convention, sink_rope)
    config = _generation_config(model, kwargs)
    _check_call(model, kwargs, config)
    if cache is None:
        cache = RingCache(model, window=window, sinks=sinks, sink_convention=sink_convention)
    else:
        _check_cache(model, cache, window, check_sinks(sinks, sink_convention), sink_convention)
    if config.prefill_chunk_size is None:
        kwargs["prefill_chunk_size"] = PREFILL_CHUNK
    if config.cache_implementation is not None:  # a model default (e.g. Gemma 3's "hybrid")
        kwargs["cache_implementation"] = None  # would clash with cache=: the ring replaces it
    if input_ids is not None and config.max_new_tokens is not None:
        cache.reserve(input_ids.shape[-1] + config.max_new_tokens)
    with ring_active(model, cache):
        return model.generate(input_ids, cache=cache, **kwargs)
