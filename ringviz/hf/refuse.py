"""Model features the ring path cannot serve, refused before the first forward writes anything.

A RingCache is exact for causal and sliding-window attention with RoPE applied as a rotation.
What a model adds beyond that is found here, never half-way through a forward and never
silently: a RoPE the sink convention cannot turn when the cache is built (:func:`check_rope`),
attention dropout in train() when the ring attention is switched on (:func:`check_eval_mode`,
with :func:`attention_dropout`), and enabled gradients at the start of every ring forward
(:func:`check_no_grad`).
"""

from __future__ import annotations

import inspect
import sys

import torch

from ringviz.rope import Rope


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


def attention_dropout(model) -> float:
    """The largest attention dropout any module of ``model`` would apply in train()."""
    rates = [getattr(model.config, "attention_dropout", 0.0)]
    rates += [getattr(m, "attention_dropout", 0.0) for m in model.modules()]
    return max(float(r) for r in rates if isinstance(r, (int, float)))


def check_eval_mode(model) -> None:
    """Raise if ``model`` is in train() with attention dropout (the ring attention has none)."""
    if model.training and attention_dropout(model) > 0:
        raise ValueError(f"{type(model).__name__} is in train() with attention dropout "
                         f"{attention_dropout(model)}: the ring attention has no dropout; call "
                         f"model.eval()")


def check_no_grad() -> None:
    """Raise if gradients are enabled: a ring writes its storage in place (fixed memory),
    which autograd cannot differentiate through. Asked at the start of every ring forward."""
    if torch.is_grad_enabled():
        raise ValueError("a RingCache writes its storage in place, so gradients cannot flow "
                         "through it: run the forward under torch.no_grad() (generate does)")
