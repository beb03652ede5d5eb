"""A conversation through the ring: each turn continues the cache the last one returned.

:class:`Conversation` keeps one :class:`ringviz.hf.RingCache` and the conversation's token ids;
a turn appends the user's text and calls :func:`ringviz.hf.generate` with the whole conversation
and that cache (Hugging Face's multi-turn convention), so only the new tokens are prefilled and
the sliding layers' memory stays fixed however long the conversation grows. What ``python -m
ringviz generate`` and ``python -m ringviz chat`` run.

A turn stopped part-way (Ctrl-C) is dropped: the conversation goes on from before it (a copy of
the cache taken at the turn's start is put back), never from a cache whose layers disagree. A
turn that raises (its ``write`` failed with an OSError, a closed pipe) is dropped the same way,
and the error goes on to the caller.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from ringviz import hf

USER, MODEL = "User:", "Assistant:"  # a plain transcript: Gemma 3 270M is a base model


class TextOut(BaseStreamer):
    """Hands each new piece of text to ``write`` as the tokens arrive (the prompt is skipped).

    ``stop``: the text that ends a reply. It is never written: text that may be its beginning
    is held back until the next tokens show it is not, and the reply ends before it.
    """

    def __init__(self, tokenizer, write: Callable[[str], None], stop: str | None = None) -> None:
        self.tokenizer, self.write, self.stop = tokenizer, write, stop
        self.tokens: list[int] = []
        self.shown = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate hands the prompt over first
            self.prompt_seen = True
            return
        self.tokens.extend(value.reshape(-1).tolist())
        self._show(final=False)

    def end(self) -> None:
        self._show(final=True)
        self.write("\n")

    def _show(self, *, final: bool) -> None:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        upto = len(text)
        if self.stop:
            at = text.find(self.stop)
            upto = at if at >= 0 else upto if final else len(text) - held_back(text, self.stop)
        if upto > self.shown:
            self.write(text[self.shown:upto])
            self.shown = upto


def held_back(text: str, stop: str) -> int:
    """How many characters at the end of ``text`` may begin ``stop`` (so are not shown yet).

    >>> held_back("Sure.\\nUs", "\\nUser:"), held_back("Sure.", "\\nUser:")
    (3, 0)
    """
    return next((n for n in range(min(len(stop) - 1, len(text)), 0, -1)
                 if stop.startswith(text[-n:])), 0)


def hf_cache_bytes(model, tokens: int) -> int:
    """Bytes Hugging Face's default cache (``DynamicCache``) holds after ``tokens`` tokens.

    Its full layers keep every token; its sliding layers keep the last ``sliding_window - 1``
    (``DynamicSlidingWindowLayer``: the newest token is attended to, then dropped with the
    oldest), so on Gemma 3 it already saves most of what the ring does.
    """
    layout = hf.read_layout(model.config)
    itemsize = next(model.parameters()).element_size()
    kept = [tokens if kind == "full" or layout.native_window is None
            else min(tokens, layout.native_window - 1) for kind in layout.kinds]
    return sum(2 * heads * dim * itemsize * n
               for heads, dim, n in zip(layout.kv_heads, layout.head_dims, kept, strict=True))


def cache_bytes(cache, *, sliding: bool | None = None) -> int:
    """Bytes a cache's layers hold (``sliding=True``: its sliding layers only), ringviz's or
    Hugging Face's."""
    total = 0
    for layer in cache.layers:
        if sliding and not layer.is_sliding:
            continue
        if hasattr(layer, "nbytes"):
            total += layer.nbytes
        elif getattr(layer, "keys", None) is not None:
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total


class Conversation:
    """A conversation with ``model`` through one RingCache (``window``, ``sinks`` as in it).

    ``stop``: the text that ends a reply (default :attr:`STOP`, the next user's tag; None: only
    EOS and ``max_new_tokens``). ``baseline=True``: the same conversation through Hugging
    Face's own default cache.
    """

    STOP = f"\n{USER}"

    def __init__(self, model, tokenizer, *, window: int | None = None, sinks: int = 0,
                 sink_convention: str = "absolute", stop: str | None = STOP,
                 baseline: bool = False) -> None:
        self.model, self.tokenizer, self.stop, self.baseline = model, tokenizer, stop, baseline
        self.cache = (DynamicCache(config=model.config) if baseline
                      else hf.RingCache(model, window=window, sinks=sinks,
                                        sink_convention=sink_convention))
        self.ids = torch.zeros(1, 0, dtype=torch.int64, device=model.device)
        self.at_user = False  # the last reply ended in the stop string (the next user's tag)

    def turn(self, text: str, *, max_new_tokens: int = 128, write: Callable[[str], None]
             = lambda _: None, framed: bool = True, **kwargs) -> dict:
        """Append ``text`` (framed as a user turn unless ``framed=False``), generate the reply.

        Returns the reply, its token count, tokens/s (prefill and decode together), and the
        cache's bytes against what Hugging Face's default cache holds for the conversation so
        far (:func:`hf_cache_bytes`). ``interrupted`` is True when Ctrl-C stopped the turn: it
        is dropped and the conversation is as before it; a turn that raises (``write`` failing,
        say) is dropped too, then the error is raised.
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a turn needs some text")
        prompt = f"{USER} {text.strip()}\n{MODEL}" if framed else text
        if framed and self.at_user:  # the model already wrote the user's tag
            prompt = prompt[len(USER):]
        elif framed and self.ids.shape[1]:
            prompt = "\n" + prompt
        added = self.tokenizer(prompt, add_special_tokens=self.ids.shape[1] == 0)["input_ids"]
        ids = torch.cat([self.ids, self.ids.new_tensor([added])], dim=1)
        saved = copy.deepcopy(self.cache)
        out = TextOut(self.tokenizer, write, self.stop)
        stop = {"stop_strings": [self.stop], "tokenizer": self.tokenizer} if self.stop else {}
        start = time.perf_counter()
        try:
            call = dict(cache=self.cache, max_new_tokens=max_new_tokens, do_sample=False,
                        streamer=out, pad_token_id=self.tokenizer.eos_token_id, **stop, **kwargs)
            seq = (self.model.generate(ids, **call) if self.baseline
                   else hf.generate(self.model, ids, **call))
        except KeyboardInterrupt:
            self.cache = saved
            write("\n[interrupted: turn dropped]\n")
            return {"interrupted": True, "tokens_so_far": self.ids.shape[1]}
        except BaseException:  # a write that failed (OSError), a refused call: turn dropped
            self.cache = saved
            raise
        seconds = time.perf_counter() - start
        new = seq.shape[1] - ids.shape[1]
        self.ids = seq
        reply = self.tokenizer.decode(seq[0, ids.shape[1]:], skip_special_tokens=True)
        self.at_user = bool(self.stop) and reply.endswith(self.stop)
        if self.at_user:
            reply = reply[:-len(self.stop)]
        return {"interrupted": False, "reply": reply.strip(), "new_tokens": new,
                "tokens_per_s": new / seconds, "tokens_so_far": self.ids.shape[1],
                "cache_bytes": cache_bytes(self.cache),
                "sliding_bytes": cache_bytes(self.cache, sliding=True),
                "hf_cache_bytes": hf_cache_bytes(self.model, self.ids.shape[1] - 1)}
