import pytest

from ringviz.book.memory import MODELS, ring_cache_bytes
from ringviz.book.seeds import seed000_memory_bytes, seed000_text_bytes


def test_seed000_formulas_as_printed():
    assert seed000_memory_bytes(4, 16, 128) == 131_072  # its code
    assert seed000_text_bytes(4, 16, 128) == 65_536  # its text, "64 KB"


def test_seed000_formula_misses_the_layers():
    qwen16 = MODELS["Qwen2.5-7B"].all_sliding(16)
    assert ring_cache_bytes(qwen16, 0) == 28 * 4 * 16 * 128 * 2 * 2
    assert ring_cache_bytes(qwen16, 0) / seed000_memory_bytes(4, 16, 128) == 7.0


def test_seed000_rejects_bad_sizes():
    with pytest.raises((TypeError, ValueError)):
        seed000_memory_bytes(4, 0, 128)
