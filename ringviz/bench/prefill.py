"""Peak memory of a long prompt through a real model's ring: one call vs chunked prefill.

A prompt of T tokens in one call holds every layer's attention over ``W + T`` keys and the
logits of all T tokens at once; chunked prefill (:meth:`RingRunner.prefill`) holds one chunk's.
Each way runs in its own subprocess, so peak RSS (``VmHWM``, reset after the model loads)
belongs to that way alone::

    python -m ringviz.bench.prefill --model smollm2 --window 256 --prompt-tokens 8192 --json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ringviz.bench.harness import in_fresh_process, machine_info
from ringviz.bench.memory import _reset_peak, _status_bytes

WAYS = {  # name -> what the prompt goes through
    "one_call": "RingRunner.forward over the whole prompt, every logit (ring_generate before)",
    "chunked": "RingRunner.prefill in chunks of W, every logit (ring_logits)",
    "chunked_last": "RingRunner.prefill in chunks of W, last logit only (ring_generate)",
}


@torch.no_grad()
def _worker(way: str, model_name: str, window: int, prompt_tokens: int, threads: int) -> dict:
    from ringviz.models.drive import RingRunner
    from ringviz.models.load import load_model

    torch.set_num_threads(threads)
    model, _ = load_model(model_name)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens),
                        generator=torch.Generator().manual_seed(0))  # content does not matter
    positions = torch.arange(prompt_tokens)[None]
    runner = RingRunner(model, 1, window, length=prompt_tokens)
    runner.forward(ids[:, :1], positions[:, :1])  # page the (memory-mapped) weights in first
    runner.reset()
    baseline = _status_bytes("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    if way == "one_call":
        logits = runner.forward(ids, positions)
    else:
        logits = runner.prefill(ids, positions, last_only=way == "chunked_last")
    seconds = time.perf_counter() - start
    return {"way": way, "what": WAYS[way], "model": model_name, "window": window,
            "prompt_tokens": prompt_tokens, "chunk": prompt_tokens if way == "one_call"
            else runner.prefill_chunk, "threads": threads, "seconds": seconds,
            "peak_rss_growth_bytes": _status_bytes("VmHWM") - baseline,
            "logits_bytes": logits.numel() * logits.element_size(),
            "last_logits": logits[0, -1, :8].tolist()}


def run(model_name: str = "smollm2", window: int = 256, prompt_tokens: int = 8192,
        threads: int = 1) -> list[dict]:
    """One row per way, each measured in a fresh subprocess; checks the last logits agree."""
    rows = [in_fresh_process("ringviz.bench.prefill:_worker",
                             {"way": way, "model_name": model_name, "window": window,
                              "prompt_tokens": prompt_tokens, "threads": threads},
                             f"prefill {way}") for way in WAYS]
    ref = torch.tensor(rows[0]["last_logits"])
    for row in rows:
        row["max_abs_last_logit_diff_vs_one_call"] = float(
            (torch.tensor(row.pop("last_logits")) - ref).abs().max())
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = run(args.model, args.window, args.prompt_tokens, args.threads)
    if args.json:
        torch.set_num_threads(args.threads)
        print(json.dumps({"machine": machine_info(torch.device("cpu")), "rows": rows}))
        return
    for r in rows:
        mib = r["peak_rss_growth_bytes"] / 2**20
        print(f"{r['way']:>13}: {r['seconds']:7.2f} s, peak RSS +{mib:8.1f} MiB "
              f"(logits {r['logits_bytes'] / 2**20:.1f} MiB), last-logit diff "
              f"{r['max_abs_last_logit_diff_vs_one_call']:.1e}")


if __name__ == "__main__":
    main()
