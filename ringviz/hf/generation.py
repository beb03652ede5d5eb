"""``generate``: Hugging Face's ``generate()`` decoded through a :class:`RingCache`.

A cache is built once with its settings (window, sinks, sink convention) and then serves every
call: a conversation passes the returned cache back with the whole conversation so far as
``input_ids`` (Hugging Face's multi-turn convention), and only the tokens the cache has not
seen are prefilled. What a call may ask of a cache it is handed is checked here, before the
first forward, so a refused call changes nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from ringviz.cache import MakeStep
from ringviz.checks import check_int, check_sinks
from ringviz.hf.attention import ring_active
from ringviz.hf.cache import RingCache, positions_from_mask

# default prefill chunk: a prompt is prefilled in chunks of this many tokens. Each chunk is one
# more pass over the weights (about a decode step: 0.1 s for Gemma-3-270M on one CPU thread), so
# chunks are long; a chunk's transient memory (its mask, activations) stays tens of MB.
PREFILL_CHUNK = 2048
# beam search and beam sampling only gather the cache's rows (reorder_cache); assisted decoding
# and prompt lookup crop rejected drafts, inside rings with spare slots
SERVED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                GenerationMode.BEAM_SAMPLE, GenerationMode.ASSISTED_GENERATION)


UNSET = object()  # a setting the call does not give: the cache's own serves


def check_settings(model, cache, window, sinks, sink_convention) -> None:
    """Raise unless ``cache`` is a RingCache for ``model`` and the given settings are its own.

    Settings the call leaves :data:`UNSET` are the cache's; one given that differs raises.
    """
    if not isinstance(cache, RingCache) or cache.config is not model.config:
        raise ValueError("cache= must be a RingCache built for this model")
    if sinks is not UNSET or sink_convention is not UNSET:  # the checks of construction
        check_sinks(cache.sinks if sinks is UNSET else sinks,
                    cache.sink_convention if sink_convention is UNSET else sink_convention)
    for name, given in (("window", window), ("sinks", sinks),
                        ("sink_convention", sink_convention)):
        own = getattr(cache, name)
        if given is UNSET or (name == "window" and given is None):
            continue
        if given != own:
            raise ValueError(f"{name}={given!r} differs from the cache's {name}={own!r}: a "
                             f"RingCache's settings are fixed when it is built (leave {name} "
                             f"out of the call)")


def effective_attention_mask(input_ids: torch.Tensor | None, attention_mask, config
                             ) -> torch.Tensor | None:
    """The 2D mask ``model.generate`` will use: the given one, or the one it infers.

    Hugging Face infers ``input_ids != pad_token_id`` when the pad token occurs in the input
    and is not an end-of-sequence token, and all ones otherwise (``None`` here).
    """
    if attention_mask is not None or input_ids is None:
        return attention_mask
    pad, eos = config.pad_token_id, config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if pad is None or pad in eos or not bool((input_ids == pad).any()):
        return None
    return input_ids.ne(pad).long()


def check_mask_holes(cache: RingCache, mask: torch.Tensor | None) -> None:
    """Raise if a row of ``mask`` has a padding column after a real token (a hole).

    Hugging Face's sliding window counts columns, holes included; a ring counts the real tokens
    it holds. The two agree for left padding only, so a hole is refused rather than served
    differently. Full-attention layers would agree, but every RingCache has a ring.
    """
    if mask is None or mask.ndim != 2:
        return
    real = mask.to(torch.bool)
    hole = real.long().cummax(-1).values.bool() & ~real
    if bool(hole.any()):
        rows = sorted({int(b) for b in hole.nonzero()[:, 0]})
        raise ValueError(f"attention_mask has padding after real tokens in rows {rows}: a ring "
                         f"window counts real tokens, Hugging Face's counts columns, so they "
                         f"would differ; pad on the left only (window {cache.window})")


def check_inputs(source: torch.Tensor | None, is_ids: bool, attention_mask) -> None:
    """Raise on inputs transformers would fail on deep inside, or serve wrong: ``input_ids`` an
    integer ``(B, L)`` tensor with ``L >= 1`` (``inputs_embeds`` ``(B, L, d)``),
    ``attention_mask`` a ``(B, L)`` tensor of 0s (padding) and 1s (real tokens)."""
    if attention_mask is not None:
        check_mask_values(attention_mask)
    if source is not None:
        if not isinstance(source, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(source).__name__}")
        if is_ids and (source.dtype.is_floating_point or source.dtype.is_complex
                       or source.dtype == torch.bool):
            raise TypeError(f"input_ids must hold integer token ids, got {source.dtype}")
        if source.ndim != (2 if is_ids else 3) or source.shape[1] == 0:
            raise ValueError(f"{'input_ids' if is_ids else 'inputs_embeds'} must hold at least "
                             f"one token per row, (B, L{'' if is_ids else ', d'}) with L >= 1; "
                             f"got shape {tuple(source.shape)}")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(source.shape[:2]):
            raise ValueError(f"attention_mask must be (B, L) = {tuple(source.shape[:2])}, like "
                             f"the input, got {tuple(attention_mask.shape)}")


def check_mask_values(attention_mask) -> None:
    """Raise unless ``attention_mask`` is a tensor of 0s and 1s: Hugging Face's positions count
    its values (``cumsum``), so a 2 would move every later position while the ring's mask reads
    it as one real token."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got "
                        f"{type(attention_mask).__name__}")
    if attention_mask.dtype.is_complex:
        raise TypeError(f"attention_mask must hold 0s and 1s, got {attention_mask.dtype}")
    bad = (attention_mask != 0) & (attention_mask != 1)
    if bool(bad.any()):
        values = sorted({v.item() for v in attention_mask[bad].unique()[:5]})
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (a real token), "
                         f"got {values}")


def check_position_ids(position_ids, mask: torch.Tensor | None, shape: tuple[int, int]) -> None:
    """Raise unless ``position_ids`` are the positions the ring computes itself: each real
    token's index among its row's real tokens (``attention_mask.cumsum(-1) - 1``, what
    Hugging Face's generate infers), any value on padding. Given positions that agree change
    nothing, so they are accepted and the ring's own serve."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point \
            or position_ids.dtype.is_complex or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer torch.Tensor, got "
                        f"{getattr(position_ids, 'dtype', type(position_ids).__name__)}")
    if position_ids.ndim != 2 or position_ids.shape[1] != shape[1] \
            or position_ids.shape[0] not in (1, shape[0]):
        raise ValueError(f"position_ids must be (B, L) = {shape} like input_ids (or (1, L)), "
                         f"got {tuple(position_ids.shape)}")
    real = (torch.ones(shape, dtype=torch.bool) if mask is None else mask.to(torch.bool)).to(
        position_ids.device)
    expected = positions_from_mask(mask, 0, *shape, position_ids.device)  # -1 on padding
    wrong = real & (position_ids.expand(shape) != expected)
    if bool(wrong.any()):
        b, j = (int(i) for i in wrong.nonzero()[0])
        raise ValueError(f"position_ids disagree with attention_mask at row {b}, column {j}: "
                         f"{int(position_ids.expand(shape)[b, j])}, but that token is its "
                         f"row's real token number {int(expected[b, j])} (from 0), the position "
                         f"the ring stores it at; a ring serves only positions that count the "
                         f"real tokens (attention_mask.cumsum(-1) - 1)")


def check_storage(model, cache: RingCache) -> None:
    """Raise unless a cache that holds tokens holds them in the dtype and on the device the
    model computes in now (a ``model.to(torch.bfloat16)`` after the cache was filled would
    write bfloat16 keys into float32 storage)."""
    held = next((layer.keys for layer in cache.layers
                 if layer.is_initialized and layer.keys is not None), None)
    if held is not None and (held.dtype != model.dtype or held.device != model.device):
        raise ValueError(f"the cache holds {held.dtype} keys on {held.device}, but the model "
                         f"now computes in {model.dtype} on {model.device} (moved or cast "
                         f"after the cache was filled): build a new RingCache")


def check_continuation(cache: RingCache, seen: int, length: int, batch: int,
                       mask: torch.Tensor | None) -> None:
    """Raise unless a call of ``length`` columns (``batch`` rows) continues what ``cache`` holds.

    ``cache`` holds the first ``seen`` columns of the conversation (its
    :meth:`~RingCache.seen_columns`); the call must give them
    again (``input_ids`` or ``inputs_embeds``, Hugging Face's convention) plus at least one new
    column, in as many rows, with a mask whose first ``seen`` columns count each row's cached
    tokens (the same padding as before).
    """
    if seen == 0:
        return
    held = cache.row_tokens()
    if batch != held.shape[0]:
        raise ValueError(f"the cache holds {held.shape[0]} rows, this call gives {batch}")
    if length <= seen:
        raise ValueError(f"the cache holds {seen} columns of the conversation; input_ids must "
                         f"be the whole conversation so far, longer than that (got {length})")
    counted = (torch.full_like(held, seen) if mask is None
               else mask[:, :seen].to(torch.bool).sum(-1).to(held.device))
    if not torch.equal(counted, held):
        raise ValueError(f"attention_mask's first {seen} columns count {counted.tolist()} real "
                         f"tokens per row, but the cache holds {held.tolist()}: pass the "
                         f"attention_mask of the whole conversation (its earlier padding too)")


def check_weights(model, cache: RingCache, config: GenerationConfig) -> None:
    """Raise unless the call's ``output_attentions`` can be served in Hugging Face's layout
    (:func:`ringviz.hf.attention.hf_weights`): Hugging Face's keys have no place for sink
    keys, another ring's step returns no weights, and the weights' layout is read on the
    host (no compiled step)."""
    why = ("sinks (Hugging Face's keys have no place for them)" if cache.sinks else
           "a ring given through ring= (its step returns no weights)"
           if any(getattr(layer, "make_step", None) for layer in cache.layers) else
           "a compiled decode step (the weights' layout is read on the host)"
           if compiles(model, config) else None)
    if why:
        raise ValueError(f"output_attentions is not served with {why}")


def draft_tokens(model, kwargs: dict, config, prompt_length: int) -> int:
    """The longest draft an assisted call can ask the cache to take back (0 if not assisted).

    Prompt lookup drafts ``prompt_lookup_num_tokens``; an assistant model (same tokenizer) its
    ``num_assistant_tokens`` with the constant schedule, and up to every new token with the
    heuristic ones (which grow the draft after each full acceptance). Other candidate
    generators (early exit, MTP, DFlash, other tokenizers) are refused.
    """
    assistant = kwargs.get("assistant_model")
    others = {"assistant_early_exit": config.assistant_early_exit,
              "use_mtp": getattr(config, "use_mtp", None),
              "speculation_type": getattr(config, "speculation_type", None),
              "assistant_tokenizer": kwargs.get("assistant_tokenizer")}
    given = sorted(name for name, value in others.items() if value)
    if given:
        raise ValueError(f"assisted decoding with {given} is not served by RingCache: only an "
                         f"assistant model with the same tokenizer, or prompt lookup")
    if config.prompt_lookup_num_tokens is not None:
        return int(config.prompt_lookup_num_tokens)
    if assistant is None:
        return 0
    if assistant is model or getattr(assistant, "config", None) is model.config:
        raise ValueError("assistant_model is the model itself: its draft forwards would run "
                         "through this RingCache; pass a separate model (a copy.deepcopy of it "
                         "drafts the same tokens)")
    assistant_config = assistant.generation_config
    schedule = assistant_config.num_assistant_tokens_schedule or "constant"
    if schedule == "constant":
        return int(assistant_config.num_assistant_tokens or 20)  # transformers' default
    if config.max_new_tokens is not None:
        return int(config.max_new_tokens)
    return max(1, int(config.max_length) - prompt_length)


def compiles(model, config: GenerationConfig) -> bool:
    """Whether transformers may compile this call's decode step: on an accelerator unless
    ``disable_compile``, or wherever a ``compile_config`` asks (a superset of its own test)."""
    if config.disable_compile:
        return False
    return model.device.type != "cpu" or config.compile_config is not None


def call_length(config: GenerationConfig, columns: int) -> int:
    """The columns a call that starts from ``columns`` reaches at most (Hugging Face's
    ``max_length`` once it has prepared it)."""
    if config.max_new_tokens is not None:
        return columns + int(config.max_new_tokens)
    return max(int(config.max_length), columns)


def _generation_config(model, kwargs: dict) -> GenerationConfig:
    """The generation config this call would use (a copy: the model's stays untouched)."""
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config


def _check_call(model, kwargs: dict, config: GenerationConfig) -> None:
    """Raise on what a ring cannot serve, before anything runs."""
    for name, why in (("past_key_values", "pass cache= (a RingCache) instead"),
                      ("cache_implementation", "the cache is a RingCache")):
        if kwargs.get(name) is not None:
            raise ValueError(f"ringviz.hf.generate does not take {name}: {why}")
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    if mode not in SERVED_MODES:
        raise ValueError(f"generation mode {mode.value!r} is not supported by RingCache: it "
                         f"is not in transformers {transformers.__version__} itself (a Hub "
                         f"recipe that ringviz has not checked); use greedy, sampling, beams "
                         f"or assisted decoding")
    if config.use_cache is False:
        raise ValueError("use_cache=False would bypass the RingCache")
    if config.prefill_chunk_size is not None:
        check_int("prefill_chunk_size", config.prefill_chunk_size)


def generate(model, input_ids: torch.Tensor | None = None, *, window: int | None = None,
             sinks: int = UNSET, sink_convention: str = UNSET,
             ring: Callable[[int], MakeStep] | None = None, **kwargs):
    """``model.generate(input_ids, **kwargs)`` decoded through a :class:`RingCache`.

    A fresh ``RingCache(model, window=window, sinks=sinks, sink_convention=...)`` unless
    ``cache=`` passes one, whose settings then serve (one given that differs raises).
    ``sinks=S`` keeps each row's first S tokens in every ring; ``sink_convention="absolute"``
    scores them at their own positions, ``"cache"`` at StreamingLLM's positions inside the cache
    (:class:`RingCache`).
    ``ring=factory`` decodes with another ring under every sliding layer (the seam:
    ``factory(window)`` is a make_step), e.g. a pitfall of :mod:`ringviz.conformance.pitfalls`.

    A conversation passes the returned cache back with the whole conversation so far as
    ``input_ids`` (and its ``attention_mask``, padding included), as with Hugging Face's own
    caches: only the tokens the cache has not seen are prefilled. The prompt is prefilled in
    chunks of ``prefill_chunk_size`` tokens (default :data:`PREFILL_CHUNK`; ``inputs_embeds``
    in one pass, which Hugging Face's chunked prefill cannot split). Greedy, sampling, beam
    search, beam sampling, assisted decoding and prompt lookup (the rings get spare slots for
    the longest draft); full-attention layers grow with the tokens that arrive.
    """
    cache = kwargs.pop("cache", None)
    config = _generation_config(model, kwargs)
    _check_call(model, kwargs, config)
    embeds = kwargs.get("inputs_embeds")
    source = embeds if embeds is not None else input_ids
    check_inputs(source, embeds is None, kwargs.get("attention_mask"))
    draft = draft_tokens(model, kwargs, config, source.shape[1] if source is not None else 0)
    if cache is None:
        cache = RingCache(model, window=window, sinks=0 if sinks is UNSET else sinks,
                          sink_convention="absolute" if sink_convention is UNSET
                          else sink_convention, draft=draft, ring=ring)
    else:
        if ring is not None:
            raise ValueError("ring= builds a cache's rings: pass it to RingCache, not with "
                             "cache=")
        check_settings(model, cache, window, sinks, sink_convention)
        if draft > cache.draft:
            raise ValueError(f"this call may draft {draft} tokens, but the cache's rings have "
                             f"spare slots for {cache.draft}: build RingCache(model, "
                             f"draft={draft}) for it")
    check_storage(model, cache)
    if config.output_attentions:
        check_weights(model, cache, config)
    mask = effective_attention_mask(input_ids if embeds is None else None,
                                    kwargs.get("attention_mask"), config)
    check_mask_holes(cache, mask)
    position_ids = kwargs.pop("position_ids", None)
    if position_ids is not None:  # the ring's own positions serve: drop them once checked
        if source is None:
            raise ValueError("position_ids need input_ids or inputs_embeds to check them against")
        check_position_ids(position_ids, mask, tuple(source.shape[:2]))
    before = cache.seen_columns()  # raises for a cache a failed call left refused
    cache.sync_columns(before)
    if compiles(model, config):  # a compiled call's forwards can neither grow nor allocate
        rows = source.shape[0] if source is not None else 1
        cache.allocate(rows * max(config.num_beams or 1, config.num_return_sequences or 1),
                       call_length(config, source.shape[1] if source is not None else 1),
                       model.dtype, model.device, static=True)
    if source is not None:
        check_continuation(cache, before, source.shape[1], source.shape[0], mask)
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
    try:
        with ring_active(model, cache, weights=bool(config.output_attentions)):
            return model.generate(input_ids, cache=cache, **kwargs)
    except BaseException as error:
        taken = 0 if cache.refused is not None else cache.seen_columns() - before
        if taken:
            cache.refuse(f"a generate call raised {type(error).__name__} after the cache had "
                         f"taken {taken} columns of a reply the caller never received")
        raise
