"""Long windows end to end: ``generate()`` at W = 1,024 to 8,192, against the bytes a step moves.

SmolLM2-135M's weights run in a sliding-window config (``MistralForCausalLM``: the same
architecture as Llama plus ``sliding_window``, so every one of its 30 layers slides with window
``W``; the weights are shared, not copied). Three caches decode the same prompt greedily, each
inside transformers' own ``generate``:

* ``ring`` — :func:`ringviz.hf.generate` with a :class:`ringviz.hf.RingCache` (every layer a
  ring of ``W``: a decode step writes one slot and attends over the ``W`` it holds);
* ``hf_dynamic`` — ``model.generate`` with ``DynamicCache`` (``DynamicSlidingWindowLayer``:
  every step concatenates the ``W - 1`` kept keys and values with the new one, then slices);
* ``hf_static`` — ``model.generate`` with ``StaticCache`` (``StaticSlidingWindowLayer``: every
  step rolls the window by one, writes the new token and copies the roll back).

The prompt is ``W + extra_prompt`` tokens (the evaluation text, tiled when ``W`` outgrows it),
the same in every row. A prefill is the expensive part on a CPU (W = 8,192 at B = 8 is about
30 TFLOP), so each cache prefills once, one row (one ``generate`` of one token, timed alone and
reported), and then repeats its rows to ``batch`` (:func:`repeat_rows`: the row operation Hugging
Face's own searches use; every row holds the same prompt, so the state is a B-row prefill's).
Every timed repetition then continues that same conversation by
``new_tokens`` more tokens, passing the cache back with the whole sequence so far (Hugging
Face's multi-turn convention): each repetition is ``new_tokens`` decode steps over a full
window. One repetition runs the three caches in a rotated order; ratios are paired inside a
repetition. The tokens of every cache must equal the ring's, repetition by repetition.

The floor: one decode step must read the weights, read the ``W`` keys and values of every layer
that attention uses, and write one token's. Those bytes over this process's copy bandwidth
(:func:`copy_bandwidth`, a STREAM-style copy timed just before each timed call, so that a
loaded machine's bandwidth is read when the call runs) are the time per step no cache can beat
on this machine; each call's time per step over its own floor is reported. Peak RSS: the growth
of the kernel's peak-RSS mark (reset just before) over the RSS at the start of each timed call,
in this process (the transient memory a decode allocates on top of the cache it holds;
``cache_bytes`` is what the cache itself holds).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from ringviz.bench.generate import _greedy, ring_case_figures
from ringviz.bench.harness import synchronize, timed_call
from ringviz.bench.memory import _reset_peak, _status_bytes

GENERATE_LONG_IMPLS = ("ring", "hf_dynamic", "hf_static")
# (W, B) of the full run; W = 8,192 at B = 8 needs about 9 GB for the three caches
GENERATE_LONG_CASES = ((1024, 1), (4096, 1), (8192, 1), (1024, 8), (4096, 8), (8192, 8))
_MISTRAL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                   "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                   "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
                   "attention_dropout")


def as_sliding(model, window: int):
    """A ``MistralForCausalLM`` with ``model``'s (Llama) weights, every layer sliding by
    ``window``. Its parameters are ``model``'s own tensors (``assign``), so nothing is copied."""
    from transformers import MistralConfig, MistralForCausalLM

    fields = {name: getattr(model.config, name) for name in _MISTRAL_FIELDS}
    config = MistralConfig(**fields, sliding_window=window, attn_implementation="sdpa")
    with torch.device(model.device):
        sliding = MistralForCausalLM(config)
    sliding.load_state_dict(model.state_dict(), strict=True, assign=True)
    return sliding.to(model.dtype).eval()


def tiled(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` of ``tokens`` repeated end to end, ``(n,)`` (a long prompt from a short
    text).

    >>> tiled(torch.tensor([1, 2, 3]), 7).tolist()
    [1, 2, 3, 1, 2, 3, 1]
    """
    return tokens.repeat(-(-n // tokens.numel()))[:n]


def smollm2_sliding(device: torch.device | None = None):
    """``(model_for, prompt_for)``: ``model_for(W)`` SmolLM2-135M sliding by ``W``;
    ``prompt_for(n)`` ``n`` tokens of the evaluation text, tiled."""
    from ringviz.models.load import load_model
    from ringviz.models.text import eval_text

    model, tokenizer = load_model("smollm2", device=device)
    text = torch.tensor(tokenizer(eval_text())["input_ids"], dtype=torch.int64, device=device)
    return partial(as_sliding, model), partial(tiled, text)


def copy_bandwidth(nbytes: int = 1 << 29, reps: int = 5, device: torch.device | None = None
                   ) -> float:
    """Bytes per second of a STREAM-style copy ``b[:] = a`` of ``nbytes`` (read + write counted,
    as STREAM does), the median of ``reps`` copies after one untimed. The default, two buffers
    of 512 MiB, is larger than the last-level cache of the CPUs this book runs on."""
    a = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    seconds = [timed_call(partial(b.copy_, a), a.device)[1] for _ in range(reps)]
    return 2 * nbytes / float(np.median(seconds))


def step_bytes(model, window: int, batch: int) -> dict:
    """Bytes one decode step must move: the weights (each tensor once), the ``W`` keys and
    values attention reads in every layer, and one token's keys and values written."""
    config = model.config
    weights = sum(t.numel() * t.element_size() for t in
                  {p.data_ptr(): p for p in model.parameters()}.values())
    item = next(model.parameters()).element_size()
    per_token = 2 * config.num_hidden_layers * batch * config.num_key_value_heads * \
        config.head_dim * item  # K and V, every layer, every row
    return {"weights": weights, "kv_read": window * per_token, "kv_write": per_token,
            "total": weights + (window + 1) * per_token}


def _cache(impl: str, model, capacity: int):
    from transformers import DynamicCache, StaticCache

    from ringviz import hf

    if impl == "ring":
        return hf.RingCache(model)
    if impl == "hf_dynamic":
        return DynamicCache(config=model.config)
    return StaticCache(config=model.config, max_cache_len=capacity)


def repeat_rows(cache, batch: int) -> None:
    """Repeat a one-row cache's row ``batch`` times, in place.

    ``batch_repeat_interleave`` where the cache has it (ringviz's rings, Hugging Face's dynamic
    layers); a static layer has no row operation but its tensors and ``batch_size``, repeated
    here (its ``update`` writes into them in place, as before).
    """
    from transformers import StaticCache

    if not isinstance(cache, StaticCache):
        cache.batch_repeat_interleave(batch)
        return
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(batch, dim=0)
        layer.values = layer.values.repeat_interleave(batch, dim=0)
        layer.batch_size = batch


def _generate(impl: str, model, ids: torch.Tensor, cache, new_tokens: int) -> torch.Tensor:
    """``new_tokens`` more tokens after ``ids`` (the whole conversation so far) through
    ``cache`` (which holds all but what it has not seen)."""
    from ringviz import hf

    kwargs = _greedy(ids, new_tokens)
    if impl == "ring":
        return hf.generate(model, ids, cache=cache, **kwargs)
    return model.generate(ids, cache=cache, **kwargs)


def _measured(call: Callable[[], torch.Tensor], device: torch.device
              ) -> tuple[torch.Tensor, float, int]:
    """``call()``'s result, seconds, and the growth of peak RSS over the RSS before it."""
    synchronize(device)
    before = _status_bytes("VmRSS")
    _reset_peak()
    out, seconds = timed_call(call, device)
    return out, seconds, _status_bytes("VmHWM") - before


@torch.no_grad()
def generate_long_rows(*, cases: tuple[tuple[int, int], ...] = GENERATE_LONG_CASES,
                       new_tokens: int = 64, reps: int = 3, extra_prompt: int = 128,
                       device: torch.device | None = None, load=None, log=print,
                       bandwidth_bytes: int = 1 << 29) -> list[dict]:
    """``bench="generate_long"`` rows: one per (impl, W, B), every repetition's seconds.

    ``load``: ``(model_for, prompt_for)`` as :func:`smollm2_sliding` returns (the default);
    a test passes a tiny random model's.
    """
    from ringviz.models.chat import cache_bytes

    device = torch.device("cpu") if device is None else torch.device(device)
    if reps < 1 or new_tokens < 2 or extra_prompt < 1 or not cases or any(
            w < 2 or b < 1 for w, b in cases):
        raise ValueError(f"need reps >= 1, new_tokens >= 2, extra_prompt >= 1 and cases of "
                         f"(W >= 2, B >= 1); got {reps}, {new_tokens}, {extra_prompt}, {cases}")
    model_for, prompt_for = load if load is not None else smollm2_sliding(device)
    rows = []
    for window, batch in cases:
        model = model_for(window)
        ids = prompt_for(window + extra_prompt).to(device)[None]  # (1, P)
        capacity = ids.shape[1] + 1 + reps * new_tokens
        caches = {impl: _cache(impl, model, capacity) for impl in GENERATE_LONG_IMPLS}
        seqs, prefill_s = {}, {}
        for impl in GENERATE_LONG_IMPLS:  # one prefill each (one row), plus its first token
            seq, prefill_s[impl] = timed_call(
                partial(_generate, impl, model, ids, caches[impl], 1), device)
            repeat_rows(caches[impl], batch)
            seqs[impl] = seq.expand(batch, -1).contiguous()  # (B, P + 1)
            log(f"generate_long W={window} B={batch} {impl}: prefill of {ids.shape[1]} tokens "
                f"{prefill_s[impl]:.1f} s")
        seconds = {impl: [] for impl in GENERATE_LONG_IMPLS}
        peaks = {impl: [] for impl in GENERATE_LONG_IMPLS}
        bandwidth = {impl: [] for impl in GENERATE_LONG_IMPLS}  # measured just before each call
        match = {impl: torch.equal(seqs[impl], seqs["ring"]) for impl in GENERATE_LONG_IMPLS}
        names = list(GENERATE_LONG_IMPLS)
        for r in range(reps):
            for impl in names[r % len(names):] + names[:r % len(names)]:
                bandwidth[impl].append(copy_bandwidth(bandwidth_bytes, device=device))
                seqs[impl], dt, peak = _measured(partial(
                    _generate, impl, model, seqs[impl], caches[impl], new_tokens), device)
                seconds[impl].append(dt)
                peaks[impl].append(peak)
            for impl in names:
                match[impl] = match[impl] and torch.equal(seqs[impl], seqs["ring"])
            log(f"generate_long W={window} B={batch} rep {r + 1}/{reps}: " + ", ".join(
                f"{impl} {seconds[impl][-1]:.1f} s ({bandwidth[impl][-1] / 1e9:.1f} GB/s)"
                for impl in names))
        moved = step_bytes(model, window, batch)
        config = model.config
        for impl in names:
            per_step = np.asarray(seconds[impl]) / new_tokens
            floor = moved["total"] / np.asarray(bandwidth[impl])  # s per step, per call
            rows.append({
                "bench": "generate_long", "impl": impl, "model": "smollm2-sliding",
                "window": window, "batch": batch, "layers": config.num_hidden_layers,
                "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                "dtype": str(model.dtype).removeprefix("torch."), "device": device.type,
                "threads": torch.get_num_threads(), "prompt_tokens": ids.shape[1],
                "new_tokens": new_tokens, "reps": reps, "seconds": seconds[impl],
                "prefill_s": prefill_s[impl],
                "tokens_per_s": float(batch * new_tokens / np.median(seconds[impl])),
                "step_bytes": moved, "copy_bandwidth_Bps": [float(x) for x in bandwidth[impl]],
                "floor_s_per_step": float(np.median(floor)),
                "over_floor": [float(x) for x in per_step / floor],
                "peak_rss_growth_bytes": int(max(peaks[impl])),
                "cache_bytes": cache_bytes(caches[impl]),
                "tokens_match_ring": bool(match[impl])})
        del caches, seqs
    return rows


def generate_long_figures(rows: list[dict]) -> dict:
    """Per (W, B): ring tokens/s over each HF cache's (paired per repetition), each cache's
    time per step over the floor, all as median and range; whether the tokens matched."""
    out = {}
    long = [r for r in rows if r["bench"] == "generate_long"]
    for window, batch in sorted({(r["window"], r["batch"]) for r in long}):
        by = {r["impl"]: r for r in long if (r["window"], r["batch"]) == (window, batch)}
        tag = f"W{window}_B{batch}"
        if "ring" not in by:
            continue
        out.update(ring_case_figures(by, "generate_long", tag, ("hf_dynamic", "hf_static")))
        for impl, row in by.items():
            over = np.asarray(row["over_floor"])
            out.update({f"generate_long_{impl}_over_floor_{tag}": float(np.median(over)),
                        f"generate_long_{impl}_over_floor_{tag}_min": float(over.min()),
                        f"generate_long_{impl}_over_floor_{tag}_max": float(over.max())})
    return out


@torch.no_grad()
def profile_decode(window: int, batch: int, new_tokens: int, impls: tuple[str, ...],
                   device: torch.device | None = None) -> str:
    """Where a long-window decode goes: ``torch.profiler``'s table of ops (by self time) over
    ``new_tokens`` decode steps of each cache in ``impls``, after one prefill (one row, repeated
    to ``batch``) and two warm steps, each beside its floor."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cpu") if device is None else torch.device(device)
    model_for, prompt_for = smollm2_sliding(device)
    model = model_for(window)
    ids = prompt_for(window + 128).to(device)[None]  # (1, P)
    out = []
    for impl in impls:
        cache = _cache(impl, model, ids.shape[1] + new_tokens + 4)
        seq = _generate(impl, model, ids, cache, 1)
        repeat_rows(cache, batch)
        seq = _generate(impl, model, seq.expand(batch, -1).contiguous(), cache, 2)
        floor = step_bytes(model, window, batch)["total"] / copy_bandwidth(device=device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            seq, seconds = timed_call(partial(_generate, impl, model, seq, cache, new_tokens),
                                      device)
        out.append(f"== {impl} W={window} B={batch}: {seconds / new_tokens * 1e3:.0f} ms per "
                   f"step under the profiler, floor {floor * 1e3:.0f} ms\n" +
                   prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14,
                                             max_name_column_width=40))
        del cache
    return "\n".join(out)


if __name__ == "__main__":  # python -m ringviz.bench.generate_long W B NEW_TOKENS IMPL,IMPL
    import sys

    torch.set_num_threads(1)
    W, B, N = (int(x) for x in sys.argv[1:4])
    print(profile_decode(W, B, N, tuple(sys.argv[4].split(","))))
