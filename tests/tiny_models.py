"""The one builder of tiny random models for the tests, one per family ringviz.hf serves, and
the inputs and generate helpers the transformers tests share.

Each ``tiny_<family>(device="cpu", dtype=torch.float64, ...)`` returns an eval-mode model with
SDPA attention (the float64 exactness of the ring path assumes it: ``ringviz.models.drive``).
:data:`FAMILIES` maps each family to its builder and the window its ring test uses (None: the
model's own).
"""

from __future__ import annotations

import torch
import transformers
from transformers.generation.streamers import BaseStreamer

from ringviz import hf

VOCAB = 97


def _finish(model, device, dtype) -> torch.nn.Module:
    return model.to(device=device, dtype=dtype).eval()


def tiny_llama(device="cpu", dtype=torch.float64) -> torch.nn.Module:
    """Llama (SmolLM2's family): no sliding window, every layer full attention."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5}, attn_implementation="sdpa")
    return _finish(transformers.LlamaForCausalLM(config), device, dtype)


def tiny_gemma(device="cpu", dtype=torch.float64, window: int = 6) -> torch.nn.Module:
    """Gemma 3: sliding, full, sliding layers; a RoPE base per layer type."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=16, max_position_embeddings=4096, attn_implementation="sdpa")
    return _finish(transformers.Gemma3ForCausalLM(config), device, dtype)


def tiny_mistral(device="cpu", dtype=torch.float64, window: int = 5) -> torch.nn.Module:
    """Mistral: every layer sliding, no ``layer_types`` in its config."""
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=window,
        max_position_embeddings=4096, attn_implementation="sdpa")
    return _finish(transformers.MistralForCausalLM(config), device, dtype)


def tiny_qwen2(device="cpu", dtype=torch.float64, window: int = 5,
               sliding: bool = True) -> torch.nn.Module:
    """Qwen2 (no ``head_dim`` in its config): layer 0 full, layers 1-2 sliding;
    ``sliding=False``: all full, no window."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=sliding,
        sliding_window=window, max_window_layers=1, max_position_embeddings=4096,
        attn_implementation="sdpa")
    return _finish(transformers.Qwen2ForCausalLM(config), device, dtype)


def tiny_qwen2_full(device="cpu", dtype=torch.float64) -> torch.nn.Module:
    return tiny_qwen2(device, dtype, sliding=False)


def tiny_phi3(device="cpu", dtype=torch.float64, window: int = 5) -> torch.nn.Module:
    """Phi-3 (fused qkv, no ``head_dim`` in its config): every layer sliding."""
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
        max_position_embeddings=4096, original_max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return _finish(transformers.Phi3ForCausalLM(config), device, dtype)


# family -> (builder, window for its ring: None keeps the model's own)
FAMILIES = {"llama": (tiny_llama, 4), "gemma3": (tiny_gemma, None),
            "mistral": (tiny_mistral, None), "qwen2": (tiny_qwen2, None),
            "qwen2_full": (tiny_qwen2_full, 4), "phi3": (tiny_phi3, None)}


def tokens(n: int, device="cpu", offset: int = 0) -> torch.Tensor:
    """``n`` seeded random token ids (L,)."""
    g = torch.Generator().manual_seed(123 + offset)
    return torch.randint(0, VOCAB, (n,), generator=g).to(device)


def prompt(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def run(fn, model, ids, **kwargs):
    """Greedy (unless kwargs say otherwise) with scores, through ``fn`` (HF or ringviz)."""
    kwargs = {"do_sample": False, "output_scores": True, "return_dict_in_generate": True,
              "pad_token_id": 0, **kwargs}
    return fn(model, ids, **kwargs) if fn is hf.generate else model.generate(ids, **kwargs)


def ring_bytes(cache: hf.RingCache) -> int:
    return sum(layer.nbytes for layer in cache.layers if isinstance(layer, hf.RingLayer))


class Collect(BaseStreamer):
    """A streamer that keeps what generate hands it, and can fail on demand."""

    def __init__(self, cache=None, fail_at: int | None = None) -> None:
        self.tokens, self.ended, self.cache, self.fail_at = [], False, cache, fail_at
        self.ring_bytes: dict[int, int] = {}

    def put(self, value):
        self.tokens.append(value.reshape(-1).clone())
        if self.cache is not None:
            self.ring_bytes[int(self.cache.get_seq_length())] = ring_bytes(self.cache)
        if self.fail_at is not None and len(self.tokens) == self.fail_at:
            raise KeyboardInterrupt("stop")

    def end(self):
        self.ended = True
