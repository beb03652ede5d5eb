import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringviz import apply_rope
from ringviz.rope import float32_angles, rope_angles, rotation_error


def rope_by_formula(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Pair i = (x[i], x[i + D/2]) rotated by pos * theta^(-2i/D), one pair at a time."""
    D = x.shape[-1]
    out = x.clone()
    for i in range(D // 2):
        a = pos * theta ** (-2 * i / D)
        c, s = math.cos(a), math.sin(a)
        out[i] = x[i] * c - x[i + D // 2] * s
        out[i + D // 2] = x[i + D // 2] * c + x[i] * s
    return out


def test_float64_matches_formula_to_1e_12():
    D, theta = 16, 10000.0
    x = torch.randn(2, 3, 5, D, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 7, 1000, 123456], [3, 4, 5, 6, 99999]])
    y = apply_rope(x, pos, theta)
    for b in range(2):
        for h in range(3):
            for t in range(5):
                want = rope_by_formula(x[b, h, t], int(pos[b, t]), theta)
                assert (y[b, h, t] - want).abs().max() < 1e-9


@settings(max_examples=30, deadline=None)
@given(p=st.integers(0, 5000), s=st.integers(0, 5000), shift=st.integers(0, 100000))
def test_score_depends_only_on_relative_position(p, s, shift):
    g = torch.Generator().manual_seed(p * 7 + s)
    q = torch.randn(1, 1, 1, 32, dtype=torch.float64, generator=g)
    k = torch.randn(1, 1, 1, 32, dtype=torch.float64, generator=g)

    def score(a: int, b: int) -> float:
        qa = apply_rope(q, torch.tensor([[a]]), 1e5)
        kb = apply_rope(k, torch.tensor([[b]]), 1e5)
        return float((qa * kb).sum())

    assert score(p, s) == pytest.approx(score(p + shift, s + shift), abs=1e-9)


def test_matches_hugging_face_llama_rotary():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=1e5,
                      max_position_embeddings=4096)
    rotary = LlamaRotaryEmbedding(cfg)
    q = torch.randn(1, 4, 6, 16)
    pos = torch.tensor([[0, 5, 17, 300, 1024, 4000]])
    cos, sin = rotary(q, pos)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    assert (apply_rope(q, pos, 1e5) - want).abs().max() < 1e-4  # HF's angles are float32


def test_angles_are_float64_and_shape():
    ang = rope_angles(torch.arange(4)[None], 8, 10000.0)
    assert ang.dtype == torch.float64 and ang.shape == (1, 4, 4)


def test_bad_inputs():
    x = torch.randn(1, 1, 3, 8)
    with pytest.raises(ValueError, match="positions must be"):
        apply_rope(x, torch.arange(4)[None])
    with pytest.raises(TypeError, match="positions must be integers"):
        apply_rope(x, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="head_dim"):
        apply_rope(torch.randn(1, 1, 3, 7), torch.arange(3)[None])
    with pytest.raises(ValueError, match=r"\(B, H, T, D\)"):
        apply_rope(torch.randn(3, 8), torch.arange(3)[None])


def test_float32_angles_are_hugging_face_angles_bit_for_bit():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=1e5,
                      max_position_embeddings=4096)
    pos = torch.tensor([[0, 7, 10**4, 10**5, 10**6, 10**7]])
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 1, dtype=torch.float64), pos)
    ang = float32_angles(pos, 64, 1e5)  # (1, 6, 32)
    assert torch.equal(cos[..., :32], ang.cos().double())
    assert torch.equal(sin[..., :32], ang.sin().double())


def test_rotation_error_grows_with_position_and_is_zero_at_0():
    pos = torch.tensor([0, 10**4, 10**5, 10**6, 10**7])
    err = rotation_error(pos, 64, 1e4)
    assert err[0] == 0
    assert err[1] < 1e-3 < err[3] and err[4] > 0.1  # a tenth of a radian at 10 million
    assert torch.all(err[1:] > 0)
    with pytest.raises(ValueError, match="head_dim"):
        rotation_error(pos, 7, 1e4)
