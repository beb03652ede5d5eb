"""A Hugging Face model's own rotary embedding, as ringviz uses it.

* :func:`model_sink_rope` turns the model's rotary embedding into the ``sink_rope`` that
  :class:`ringviz.RingKVCache` takes (StreamingLLM's positions inside the cache), per layer
  type: Gemma 3's sliding layers rotate with their local base (1e4), not the global one (1e6).
* :func:`float64_rope_angles`: Hugging Face computes RoPE angles in float32, so a rotation by
  ``a`` then ``b`` differs from one by ``a + b`` by about ``(a + b) * 2**-24`` radians. The two
  sink conventions rotate by different amounts, so an exactness check in float64 needs float64
  angles on both sides; this context manager gives the model's rotary embedding exactly that.
* :func:`check_rope` refuses, when a cache is built, a model whose RoPE the cache convention
  cannot turn (probed against the model's own ``apply_rotary_pos_emb``).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ringviz.rope import Rope, rotate


def rotary_embedding(model) -> torch.nn.Module:
    """The model's one rotary-embedding module (``model.model.rotary_emb`` for Llama, Gemma 3)."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no model.rotary_emb: sinks with "
                         f"StreamingLLM's positions need the model's RoPE")
    return rotary


def _takes_layer_type(rotary: torch.nn.Module) -> bool:
    return "layer_type" in inspect.signature(rotary.forward).parameters


def model_sink_rope(model, layer_type: str = "sliding_attention") -> Rope:
    """``f(x, positions)``: rotate ``x`` (B, H, T, D) by ``positions`` (B, T) with the model's RoPE.

    The same cos/sin the model's attention layers apply to q and k, so a sink key turned by
    ``p - c`` is exactly what the model would have produced at the shifted position (up to the
    float32 angles, see :func:`float64_rope_angles`). Scaled RoPE variants that also rescale
    q/k (``attention_scaling != 1``) are not rotations and are rejected.
    """
    rotary = rotary_embedding(model)
    per_type = _takes_layer_type(rotary)
    scaling = getattr(rotary, f"{layer_type}_attention_scaling" if per_type
                      else "attention_scaling", 1.0)
    if scaling != 1.0:
        raise ValueError(f"RoPE with attention_scaling={scaling} scales keys as it rotates: "
                         f"turning a stored key again would scale it twice")

    def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        args = (layer_type,) if per_type else ()
        cos, sin = rotary(x, positions, *args)  # (B, T, D) each
        return rotate(x, cos[:, None], sin[:, None])

    rope.__name__ = f"model_sink_rope[{layer_type}]"
    return rope


@contextmanager
def float64_rope_angles(model) -> Iterator[None]:
    """Within the block, the model's rotary embedding computes its angles in float64.

    ``inv_freq`` keeps its float32 values; only the product ``position * inv_freq`` and its
    cos/sin are taken in float64, so rotations compose exactly (to float64 rounding) and
    ``R(a) R(b) == R(a + b)`` holds as the algebra of the two conventions assumes.
    """
    rotary = rotary_embedding(model)
    per_type = _takes_layer_type(rotary)

    def forward(x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        inv = getattr(rotary, f"{layer_type}_inv_freq") if per_type else rotary.inv_freq
        freqs = position_ids[..., None].double() * inv.double().to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rotary.forward = forward  # nn.Module.__call__ looks the instance attribute up first
    try:
        yield
    finally:
        del rotary.forward


def check_rope(model, rope: Rope, layer_type: str) -> None:
    """Raise unless ``rope`` turns a key exactly as the model's own attention rotates it.

    StreamingLLM's sink convention turns stored keys again with ``rope``: a rotation of the whole
    head by the model's cos/sin (``x cos + rotate_half(x) sin``). A model whose RoPE is not that
    (Cohere's interleaved pairs, Phi-3's partial rotary) is refused here, probed once on a random
    key with the function its attention module calls (``apply_rotary_pos_emb``).
    """
    attention = next((m for m in model.modules() if hasattr(m, "layer_idx")
                      and hasattr(m, "head_dim")), None)
    apply = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None) \
        if attention is not None else None
    if apply is None:
        raise ValueError(f"{type(model).__name__}: no apply_rotary_pos_emb found next to its "
                         f"attention, so sink_convention='cache' cannot check the model's RoPE")
    rotary = model.model.rotary_emb
    dtype = next(model.parameters()).dtype
    x = torch.randn(1, 1, 3, attention.head_dim, generator=torch.Generator().manual_seed(0),
                    dtype=dtype).to(next(model.parameters()).device)
    positions = torch.tensor([[0, 5, 37]], device=x.device)
    args = (layer_type,) if "layer_type" in inspect.signature(rotary.forward).parameters else ()
    cos, sin = rotary(x, positions, *args)
    try:
        params = list(inspect.signature(apply).parameters)
        theirs = apply(x, cos, sin) if params[1] == "cos" else apply(x, x, cos, sin)[1]
        ours = rope(x, positions)
        same = ours.shape == theirs.shape and torch.allclose(ours, theirs, atol=1e-5)
    except (RuntimeError, ValueError, TypeError):
        same = False
    if not same:
        raise ValueError(f"{model.config.model_type}'s RoPE is not a rotation of the whole head "
                         f"by its cos/sin (interleaved pairs or partial rotary): "
                         f"sink_convention='cache' cannot turn its stored keys; use 'absolute'")
