"""Decode throughput of a real model: ringviz's rings vs Hugging Face's default cache.

Gemma-3-270M (sliding window 512 on 15 of its 18 layers) decodes the same prompt greedily twice,
in one process and interleaved token by token: step i of the ring path (``RingRunner``, every
layer's K/V in a ``RingKVCache``), then step i of Hugging Face's path (``use_cache=True``, the
``DynamicCache`` its ``generate`` would build: ``DynamicSlidingWindowLayer`` on sliding layers,
``DynamicLayer`` on full ones). Only decode steps are timed; the prefill runs once per path,
untimed. Both paths must produce the same tokens, or the row says they did not.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ringviz.bench.harness import spread, timed_call


def load_with_prompt(name: str, prompt_tokens: int, device: torch.device | None = None):
    """``(model, ids)``: ``name`` loaded onto ``device``, and its first ``prompt_tokens`` tokens
    of the evaluation text ``(P,)``."""
    from ringviz.models.load import load_model
    from ringviz.models.text import eval_tokens

    model, tokenizer = load_model(name, device=device)
    return model, eval_tokens(tokenizer, prompt_tokens, device=device)


def _hf_decode(model, ids: torch.Tensor):
    """Hugging Face's path: a prefill creating its default cache; a step fn and a bytes fn."""
    from ringviz.models.chat import cache_bytes

    out = model(input_ids=ids, use_cache=True)
    state = {"cache": out.past_key_values}

    def step(token: torch.Tensor) -> torch.Tensor:
        res = model(input_ids=token[:, None], cache=state["cache"], use_cache=True)
        state["cache"] = res.past_key_values
        return res.logits[:, -1]  # (B, vocab)

    return out.logits[:, -1], step, lambda: cache_bytes(state["cache"])


def _ring_decode(runner, ids: torch.Tensor):
    """The ring path: a prefill into the runner's rings; a step fn and a bytes fn."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # (B, P)
    first = runner.prefill(ids, positions, last_only=True)[:, -1]  # chunks of W
    pos = torch.full((ids.shape[0], 1), ids.shape[1] - 1, dtype=torch.int64, device=ids.device)

    def step(token: torch.Tensor) -> torch.Tensor:
        pos.add_(1)
        return runner.forward(token[:, None], pos)[:, -1]  # (B, vocab)

    return first, step, lambda: runner.nbytes


@torch.no_grad()
def model_rows(*, name: str = "gemma3", prompt_tokens: int, new_tokens: int,
               device: torch.device) -> list[dict]:
    """Two ``bench="model"`` rows (impl ``ring`` and ``hf_default``): decode tokens per second."""
    from ringviz.models.drive import RingRunner

    if prompt_tokens < 1 or new_tokens < 2:
        raise ValueError(f"need prompt_tokens >= 1 and new_tokens >= 2, got "
                         f"{prompt_tokens}, {new_tokens}")
    model, prompt = load_with_prompt(name, prompt_tokens, device)
    ids = prompt[None]  # (1, P)
    runner = RingRunner(model, batch_size=1, window=None, length=prompt_tokens + new_tokens)
    paths = {"ring": _ring_decode(runner, ids), "hf_default": _hf_decode(model, ids)}
    tokens = {impl: [int(path[0].argmax(-1))] for impl, path in paths.items()}
    seconds: dict[str, list[float]] = {impl: [] for impl in paths}
    for i in range(new_tokens - 1):
        order = list(paths) if i % 2 == 0 else list(paths)[::-1]  # alternate who goes first
        for impl in order:
            token = torch.tensor([tokens[impl][-1]], device=device)  # (1,)
            logits, dt = timed_call(partial(paths[impl][1], token), device)
            tokens[impl].append(int(logits.argmax(-1)))
            seconds[impl].append(dt)
    config = model.config
    same = tokens["ring"] == tokens["hf_default"]
    return [{"bench": "model", "impl": impl, "model": name, "window": config.sliding_window,
             "batch": 1, "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
             "dtype": "float32", "device": device.type, "threads": torch.get_num_threads(),
             "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
             **spread(np.asarray(s) * 1e6), "tokens_per_s": float(len(s) / np.sum(s)),
             "tokens_match": same, "cache_bytes": paths[impl][2]()}
            for impl, s in seconds.items()]
