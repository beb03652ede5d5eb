"""The seed articles' own memory formulas, as printed, so the book quotes them one way.

The evidence (``notebooks/evidence_seeds.ipynb``) checks these against ``ringviz.book.memory``;
the numbers here are the articles', right or wrong, never ours.
"""

from __future__ import annotations

from ringviz.checks import check_int


def seed000_memory_bytes(num_heads: int, k: int, head_dim: int) -> int:
    """Seed 000's ``RingKVCache.memory_bytes()``: ``num_heads * k * head_dim * 8 * 2``.

    Its comment says float16 (2 bytes) for K and V; the code multiplies by 8 and then 2, and
    counts no layers. For its Qwen2.5-7B example (4 heads, K = 16, head_dim 128) the code
    returns 131,072 bytes while the article's text prints ``4 x 16 x 128 x 8 = 65,536 bytes``
    ("64 KB"): :func:`seed000_text_bytes`.

    >>> seed000_memory_bytes(4, 16, 128), seed000_text_bytes(4, 16, 128)
    (131072, 65536)
    """
    for name, value in (("num_heads", num_heads), ("k", k), ("head_dim", head_dim)):
        check_int(name, value)
    return num_heads * k * head_dim * 8 * 2


def seed000_text_bytes(num_heads: int, k: int, head_dim: int) -> int:
    """The same example as seed 000's text computes it: ``num_heads x K x head_dim x 8 bytes``."""
    return seed000_memory_bytes(num_heads, k, head_dim) // 2
