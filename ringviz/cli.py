"""The command line: `python -m ringviz COMMAND ...` (demo, equivalence, perplexity, streaming,
bench, conform, generate, chat).

Each subcommand parses its flags here and calls one function of the package that returns a
plain dict; `--json` prints that dict as the last line of output (progress goes to stderr).
Heavy modules (torch models, benchmarks) are imported only by the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import unicodedata
from collections.abc import Callable, Sequence

from ringviz.checks import SINK_CONVENTIONS


def _int_list(text: str) -> list[int]:
    """Parse "16,64,256" into [16, 64, 256]."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from err
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


DEMO_SLOTS = 10**7  # the most slot numbers a demo shows (and keeps for --json): W per step


def _cmd_demo(args: argparse.Namespace) -> dict:
    import numpy as np

    from ringviz.ring import RingKV

    if args.window * args.tokens > DEMO_SLOTS:
        raise ValueError(f"demo shows every slot at every step: --window {args.window} x "
                         f"--tokens {args.tokens} is {args.window * args.tokens:,} slot "
                         f"numbers, more than {DEMO_SLOTS:,}; pick a smaller --window or "
                         f"--tokens")
    ring = RingKV(window=args.window, head_dim=1)
    steps = []
    for pos in range(args.tokens):
        evicted = ring.push(np.zeros(1), np.zeros(1), pos)
        steps.append({"pos": pos, "slot": ring.last_slot, "evicted": evicted,
                      "start": ring.start, "slots": ring.positions.tolist()})
        if not args.json:
            slots = " ".join("  ." if p < 0 else f"{p:3d}" for p in ring.positions)
            gone = f"evicts {evicted}" if evicted >= 0 else "slot was empty"
            print(f"token {pos:3d} -> slot {ring.last_slot:2d} ({gone:>14}); "
                  f"start={ring.start:2d} | {slots}")
    return {"window": args.window, "tokens": args.tokens, "nbytes": ring.nbytes, "steps": steps}


def _cmd_equivalence(args: argparse.Namespace) -> dict:
    from ringviz.models.equivalence import run_equivalence

    return run_equivalence(model=args.model, window=args.window, prompt_tokens=args.prompt_tokens,
                           new_tokens=args.new_tokens, batch=args.batch, dtype=args.dtype)


def _cmd_perplexity(args: argparse.Namespace) -> dict:
    from ringviz.models.perplexity import run_perplexity

    return run_perplexity(model=args.model, windows=args.windows, sinks=args.sinks,
                          tokens=args.tokens)


def _cmd_streaming(args: argparse.Namespace) -> dict:
    from ringviz.models.streaming import run_streaming

    return run_streaming(model=args.model, windows=tuple(args.windows),
                         sinks=tuple(args.sinks), tokens=args.tokens,
                         past_window=args.past_window, past_extra=args.past_extra)


def _cmd_bench(args: argparse.Namespace) -> dict:
    from ringviz.bench import run_bench

    return run_bench(quick=args.quick, device=args.device, plot_dir=args.plot_dir,
                     only_part=args.only, generate_cases=args.generate_cases,
                     generate_reps=args.generate_reps,
                     generate_long_cases=args.generate_long_cases,
                     generate_long_reps=args.generate_long_reps)


def _cmd_conform(args: argparse.Namespace) -> dict:
    from ringviz.conformance.peers import PEERS, get, run

    if args.list:
        caches = [{"name": p.name, "what": p.what, "version": p.version(),
                   "sinks": p.sinks, "ragged": p.ragged, "rewind": p.rewind, "layout": p.layout,
                   "expect": p.expect or "pass"}
                  for p in PEERS.values()]
        if not args.json:
            width = max(len(c["name"]) for c in caches)
            for c in caches:
                tag = f"(pitfall: breaks {c['expect']})" if c["expect"] != "pass" else c["version"]
                how = ", ".join(w for w, on in (("rewinds", c["rewind"]),
                                                ("rows layout", c["layout"] == "rows")) if on)
                print(f"{c['name']:<{width}}  {c['what']}  [{tag}]" + (f" ({how})" if how else ""))
        return {"caches": caches}
    if args.cache is None:
        raise ValueError("conform needs --cache NAME (or --list)")
    get(args.cache)  # unknown names fail before the progress bar
    from tqdm import tqdm

    with tqdm(total=args.examples, desc=f"conform {args.cache}", unit="schedule",
              file=sys.stderr, delay=1.0, leave=False) as bar:
        report = run(args.cache, window=args.window, sinks=args.sinks, examples=args.examples,
                     seed=args.seed, max_chunk=args.max_chunk,
                     progress=lambda n: bar.update(n - bar.n))
    if not args.json:
        print(report)
    return {"cache": args.cache, "version": get(args.cache).version(), **report.to_dict()}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _conversation(args: argparse.Namespace):
    from ringviz.models.chat import Conversation
    from ringviz.models.load import load_model

    model, tokenizer = load_model(args.model)
    return Conversation(model, tokenizer, window=args.window, sinks=args.sinks,
                        sink_convention=_sink_convention(args),
                        stop=None if args.command == "generate" else Conversation.STOP)


def _sink_convention(args: argparse.Namespace) -> str:
    """The convention asked for; by default StreamingLLM's where there are sinks."""
    return args.sink_convention or ("cache" if args.sinks else "absolute")


def printable(text: str) -> str:
    r"""``text`` with its control characters written as escapes (``\x1b``), newlines and tabs
    kept: a prompt's or a reply's escape sequences never drive the terminal.

    >>> printable("red \x1b[31m!\n")
    'red \\x1b[31m!\n'
    """
    return "".join(ch if ch in "\n\t" or not _controls(ch) else ch.encode("unicode_escape")
                   .decode("ascii") for ch in text)


def _controls(ch: str) -> bool:
    """A control character, or a bidirectional override (text that reorders the line)."""
    return unicodedata.category(ch) == "Cc" or unicodedata.bidirectional(ch) in (
        "LRE", "RLE", "LRO", "RLO", "PDF", "LRI", "RLI", "FSI", "PDI")


def _show(text: str) -> None:
    print(printable(text), end="", flush=True)


def _cmd_generate(args: argparse.Namespace) -> dict:
    """Stream one continuation of ``--prompt`` through the ring, then its numbers."""
    chat = _conversation(args)
    write = (lambda _: None) if args.json else _show
    result = chat.turn(args.prompt, max_new_tokens=args.max_new_tokens, write=write,
                       framed=False)
    return {"model": args.model, "window": chat.cache.window, "sinks": args.sinks,
            "sink_convention": chat.cache.sink_convention, **result}


def _cmd_chat(args: argparse.Namespace) -> dict:
    """Turn after turn from stdin (an empty line or EOF ends); numbers after each turn."""
    chat = _conversation(args)
    print(f"{args.model}, ring window {chat.cache.window}, {args.sinks} sinks "
          f"({chat.cache.sink_convention} positions); an empty line "
          f"ends, Ctrl-C stops a reply", file=sys.stderr)
    turns = []
    while True:  # the prompts go to stderr: stdout holds the replies, then (--json) the result
        print("you> ", end="", flush=True, file=sys.stderr)
        try:
            text = input()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        if not text.strip():
            break
        print("model> ", end="", flush=True)
        result = chat.turn(text, max_new_tokens=args.max_new_tokens, write=_show)
        turns.append(result)
        if not result["interrupted"]:
            print(f"[{result['new_tokens']} tokens, {result['tokens_per_s']:.1f} tokens/s; "
                  f"{result['tokens_so_far']} in the conversation; cache "
                  f"{_mib(result['cache_bytes'])}, Hugging Face's default cache would hold "
                  f"{_mib(result['hf_cache_bytes'])}]", file=sys.stderr)
    return {"model": args.model, "window": chat.cache.window, "sinks": args.sinks,
            "turns": len(turns), "tokens": chat.ids.shape[1], "cache_bytes": chat.cache.nbytes}


def _pairs(first: str, second: str, low: tuple[int, int]) -> Callable[[str], list]:
    """A parser of ``"AxB[,AxB...]"`` into ``[(A, B), ...]``, each ``A >= low[0]``,
    ``B >= low[1]`` (``first``, ``second``: the numbers' names in the error)."""
    def parse(text: str) -> list[tuple[int, int]]:
        try:
            cases = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
        except ValueError:
            cases = []
        if not cases or any(len(c) != 2 or c[0] < low[0] or c[1] < low[1] for c in cases):
            raise argparse.ArgumentTypeError(
                f"expected {first}x{second}[,{first}x{second}...] with {first} >= {low[0]}, "
                f"{second} >= {low[1]}; got {text!r}")
        return cases

    return parse


_cases = _pairs("BATCH", "NEW", (1, 2))  # "1x96,8x2048": batch x new tokens
_window_batches = _pairs("WINDOW", "BATCH", (2, 1))  # "1024x1,4096x8": window x batch


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one subparser per subcommand."""
    from ringviz.bench import PARTS

    parser = argparse.ArgumentParser(
        prog="python -m ringviz",
        description="Ring-buffer KV cache for sliding-window attention: demos, proofs, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="print the ring's slots step by step (NumPy RingKV)")
    demo.add_argument("--window", type=_positive_int, default=4, help="ring capacity W")
    demo.add_argument("--tokens", type=_positive_int, default=10, help="tokens to push")
    demo.set_defaults(func=_cmd_demo)

    eq = sub.add_parser(
        "equivalence",
        help="ring-cache decode vs an independent reference on a real model (logit diffs)",
    )
    eq.add_argument("--model", choices=["smollm2", "gemma3"], required=True)
    eq.add_argument("--window", type=_positive_int, default=None,
                    help="sliding window W (default: the model's own, 512 for gemma3)")
    eq.add_argument("--prompt-tokens", type=_positive_int, default=64, help="prefill length P")
    eq.add_argument("--new-tokens", type=_positive_int, default=32,
                    help="teacher-forced decode steps N")
    eq.add_argument("--batch", type=_positive_int, default=1,
                    help="rows; B > 1 gives rows different prompt lengths (ragged batch)")
    eq.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    eq.set_defaults(func=_cmd_equivalence)

    ppl = sub.add_parser("perplexity", help="perplexity of full attention vs windows and sinks")
    ppl.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    ppl.add_argument("--windows", type=_int_list, default=[16, 64, 256], help="e.g. 16,64,256")
    ppl.add_argument("--sinks", type=_int_list, default=[0, 4], help="e.g. 0,4")
    ppl.add_argument("--tokens", type=_positive_int, default=1000, help="tokens of evaluation text")
    ppl.set_defaults(func=_cmd_perplexity)

    stream = sub.add_parser("streaming", help="sinks in both RoPE conventions, past the context")
    stream.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    stream.add_argument("--windows", type=_int_list, default=[64, 256, 1024])
    stream.add_argument("--sinks", type=_int_list, default=[0, 1, 4])
    stream.add_argument("--tokens", type=_positive_int, default=4096, help="tokens per setting")
    stream.add_argument("--past-window", type=_positive_int, default=256)
    stream.add_argument("--past-extra", type=_non_negative_int, default=2048,
                        help="tokens decoded past max_position_embeddings (0: skip that run)")
    stream.set_defaults(func=_cmd_streaming)

    bench = sub.add_parser("bench", help="time the ring against copying windows and HF layers")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (< 2 min on 2 CPUs)")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    bench.add_argument("--plot-dir", default=None, help="also write the plots (PNG) here")
    bench.add_argument("--only", choices=PARTS, default=None,
                       help="one part alone: 'decode_step' (ring step vs attention alone), "
                            "'sinks' (sinks_update, sinks_decode), 'generate' "
                            "(Gemma-3-270M generate(), ringviz.hf vs HF's caches), 'compiled' "
                            "(SmolLM2 ring generate, eager vs inductor), 'generate_memory' "
                            "(SmolLM2 RSS after 20 and 2,000 tokens, ring vs HF default), "
                            "'generate_long' (SmolLM2 sliding at W = 1,024-8,192: ring vs HF's "
                            "sliding caches and the bytes-bound floor) or "
                            "'conform' (seconds of conformance.check(examples=100), W=6)")
    bench.add_argument("--generate-cases", type=_cases, default=None,
                       help="generate() cases, BATCHxNEW,... (default 1x96,8x2048)")
    bench.add_argument("--generate-reps", type=_positive_int, default=None,
                       help="repetitions of each generate() case (default 3)")
    bench.add_argument("--generate-long-cases", type=_window_batches, default=None,
                       help="generate_long cases, WINDOWxBATCH,... (default 1024x1,4096x1,"
                            "8192x1,1024x8,4096x8,8192x8)")
    bench.add_argument("--generate-long-reps", type=_positive_int, default=None,
                       help="repetitions of each generate_long case (default 3)")
    bench.set_defaults(func=_cmd_bench)

    conform = sub.add_parser(
        "conform", help="check a sliding-window cache against the window contract (exit 1 if "
                        "it breaks it)")
    conform.add_argument("--cache", default=None, help="a name from --list")
    conform.add_argument("--list", action="store_true", help="list the caches it knows")
    conform.add_argument("--window", type=_positive_int, default=6, help="sliding window W")
    conform.add_argument("--sinks", type=_non_negative_int, default=None,
                         help="attention sinks S (default: the cache's own, 2 where it keeps "
                              "sinks, else 0)")
    conform.add_argument("--examples", type=_positive_int, default=100,
                         help="schedules hypothesis draws (shrinking runs more)")
    conform.add_argument("--seed", type=_non_negative_int, default=0)
    conform.add_argument("--max-chunk", type=_positive_int, default=None,
                         help="largest chunk in a schedule (1: decode steps only)")
    conform.set_defaults(func=_cmd_conform)

    gen = sub.add_parser("generate", help="stream a model's continuation through the ring")
    talk = sub.add_parser("chat", help="a conversation turn after turn, in fixed memory")
    for p, default in ((gen, 64), (talk, 128)):
        p.add_argument("--model", choices=["smollm2", "gemma3"],
                       required=p is gen, default="gemma3")
        p.add_argument("--window", type=_positive_int, default=None,
                       help="ring window W (default: the model's own; smollm2 needs one)")
        p.add_argument("--sinks", type=_non_negative_int, default=0 if p is gen else 4,
                       help="attention sinks kept beside each ring")
        p.add_argument("--sink-convention", choices=SINK_CONVENTIONS, default=None,
                       help="the sinks' RoPE positions: 'cache' (StreamingLLM's, inside the "
                            "cache: no key farther than the window plus the sinks; the default "
                            "with sinks) or 'absolute' (their own: farther than any distance a "
                            "model trained with a window has seen)")
        p.add_argument("--max-new-tokens", type=_positive_int, default=default,
                       help="tokens per reply")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.set_defaults(func=_cmd_generate)
    talk.set_defaults(func=_cmd_chat)

    for p in (demo, eq, ppl, stream, bench, conform, gen, talk):
        p.add_argument("--json", action="store_true",
                       help="print one JSON object as the last line of output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
        if args.json:
            print(json.dumps(result, default=str))
        elif args.command not in ("demo", "conform", "chat"):
            print_human(result)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except MemoryError as err:
        print(f"error: out of memory ({err or 'an allocation failed'})", file=sys.stderr)
        return 2
    except (ValueError, TypeError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.command == "conform" and result.get("ok") is False:
        return 1  # the cache broke the window contract
    return 0


TABLE_COLUMNS = ("bench", "impl", "window", "sinks", "batch", "median_us", "p10_us", "p90_us",
                 "steps", "cache_bytes", "peak_rss_bytes", "tokens_per_s", "perplexity")


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def print_human(result: dict) -> None:
    """Readable form of a result: scalars as lines, dicts indented, lists of rows as a table."""
    for key, value in result.items():
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            cols = [c for c in TABLE_COLUMNS if any(c in r for r in value)]
            cols = cols or list(value[0])
            cells = [[_fmt(r.get(c, "")) for c in cols] for r in value]
            widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
            print(f"{key}:")
            for row in [list(cols), *cells]:
                print("  " + "  ".join(x.rjust(w) for x, w in zip(row, widths)))
        elif isinstance(value, dict):
            print(f"{key}:")
            for sub, item in value.items():
                print(f"  {sub}: {_fmt(item)}")
        else:
            print(f"{key}: {_fmt(value)}")
