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


F64 = 1e-7  # float64: the ring path and HF's share every module but attention


def max_score_diff(a, b) -> float:
    """Largest |difference| of two runs' scores; -inf (tokens a warper removed) must agree."""
    worst = 0.0
    for x, y in zip(a.scores, b.scores, strict=True):
        assert torch.equal(torch.isinf(x), torch.isinf(y))
        finite = torch.isfinite(x)
        worst = max(worst, float((x[finite] - y[finite]).abs().max()))
    return worst


# one tiny config for any family: each key is set where the family's config declares it
TINY_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, sliding_window=5,
    attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # mixtures of experts
    moe_intermediate_size=16, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, shared_intermediate_size=16,
    first_k_dense_replace=1, n_group=1, topk_group=1,
    # multi-head latent attention (keys 16 wide, values 16: one head size)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # Gemma 3n / Gemma 4
    global_head_dim=16, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
    num_kv_shared_layers=0, laurel_rank=4, altup_num_inputs=2)


def _tiny_kwargs(config_class, layers: int) -> dict:
    fields = getattr(config_class, "__dataclass_fields__", {})
    kwargs = {key: value for key, value in TINY_CONFIG.items() if key in fields}
    kwargs["num_hidden_layers"] = layers
    if "layer_types" in fields:
        types = getattr(config_class().get_text_config(), "layer_types", None)
        if types:
            kinds = list(dict.fromkeys(types))
            kwargs["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    return kwargs


def family_model_class(model_type: str):
    """transformers' causal-LM class of ``model_type``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def tiny_family(model_type: str, layers: int = 4, dtype=torch.float64, **overrides):
    """A tiny random eval-mode model of any causal-LM family (float64, seeded).

    :data:`TINY_CONFIG`'s keys where the config class declares them, ``layers`` layers cycling
    through the family's own layer types, eager experts (grouped matmuls take no float64),
    and SDPA attention where the family has it (eager otherwise).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    config_class = CONFIG_MAPPING[model_type]
    kwargs = {**_tiny_kwargs(config_class, layers), **overrides}
    text_class = getattr(config_class, "sub_configs", {}).get("text_config")
    if text_class is not None:  # a draft assistant's nested text model: tiny too
        default = config_class().text_config  # an AutoConfig entry: its default's class
        text_class = type(default) if text_class.__name__ == "AutoConfig" else text_class
        kwargs["text_config"] = {"model_type": text_class.model_type,
                                 **_tiny_kwargs(text_class, layers)}
    config = config_class(**kwargs, experts_implementation="eager")
    text = config.get_text_config()
    if text.vocab_size > VOCAB or getattr(text, "hidden_size", 0) > 64:
        raise RuntimeError(f"{model_type}: the tiny config did not take (vocab "
                           f"{text.vocab_size}, hidden {text.hidden_size}); not building it")
    torch.manual_seed(0)
    try:
        config._attn_implementation = "sdpa"
        model = family_model_class(model_type)(config)
    except ValueError:  # no SDPA for this family
        config._attn_implementation = "eager"
        model = family_model_class(model_type)(config)
    return model.to(dtype).eval()
