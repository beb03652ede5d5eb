"""ringviz: a ring-buffer KV cache for sliding-window attention, taught and proven.

Window semantics everywhere: a query at absolute position p sees the keys at positions
p-W+1 .. p (itself and the W-1 before it), as in Mistral and Hugging Face. Position -1 marks
an empty slot or a padding token.
"""

from ringviz.cache import RingKVCache
from ringviz.masks import band_mask, decode_mask
from ringviz.reference import (
    GrowingKVCache,
    ShiftWindowKVCache,
    windowed_attention_reference,
)
from ringviz.ring import RingKV
from ringviz.rope import apply_rope

__all__ = [
    "RingKV",
    "RingKVCache",
    "GrowingKVCache",
    "ShiftWindowKVCache",
    "apply_rope",
    "band_mask",
    "decode_mask",
    "windowed_attention_reference",
]
__version__ = "0.1.0"
