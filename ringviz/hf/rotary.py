"""A Hugging Face model's own rotary embedding, as ringviz uses it.

* :func:`model_sink_rope` turns the model's rotary embedding into the ``sink_rope`` that
  :class:`ringviz.RingKVCache` takes (StreamingLLM's positions inside the cache), per layer
  type: Gemma 3's sliding layers rotate with their local base (1e4), not the global one (1e6).
* :func:`float64_rope_angles`: Hugging Face computes RoPE angles in float32, so a rotation by
  ``a`` then ``b`` differs from one by ``a + b`` by about ``(a + b) * 2**-24`` radians. The two
  sink conventions rotate by different amounts, so an exactness check in float64 needs float64
  angles on both sides; this context manager gives the model's rotary embedding exactly that.
* :func:`check_rope` refuses, when a cache is built, a model whose RoPE the cache convention
  cannot turn (probed against the model's own ``apply_rotary_pos_emb``); :func:`rope_layers`
  measures which layers rotate at all.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ringviz.rope import Rope, rotate


def rotary_embedding(model) -> torch.nn.Module:
    """The model's one rotary-embedding module, on its backbone (``model.model.rotary_emb`` for
    Llama and Gemma 3, ``model.gpt_neox.rotary_emb`` for GPT-NeoX)."""
    rotary = getattr(getattr(model, "base_model", None), "rotary_emb", None)
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


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """Each layer's attention module, by its ``layer_idx`` (the first module that claims it)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "head_dim"):
            found.setdefault(idx, module)
    return found


def rope_layers(model) -> list[bool]:
    """Per layer: whether its attention rotates keys by position (RoPE) at all.

    Families say it in many ways (SmolLM3's ``no_rope_layers``, Beam's None RoPE parameters,
    AfMoE and Cohere 2 rotating only on sliding layers), so it is measured: one token run at
    two positions. With one token every attention output is its own value, so the hidden states
    do not depend on the position; a layer's keys then differ between the runs exactly when it
    rotates them. A key a layer does not rotate carries no position and is never turned: both
    sink conventions score it alike. The probe's attention runs in this thread's forwards only
    (:func:`~ringviz.hf.attention.forwards_through`): a ring call or a plain call of the same
    model in another thread meanwhile runs its own.
    """
    from ringviz.hf.attention import forwards_through  # (it imports this module)

    param = next(model.parameters())
    token = torch.full((1, 1), 1, dtype=torch.int64, device=param.device)
    keys: list[dict[int, torch.Tensor]] = []

    def probe(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        """One token's attention (its own value), keeping the layer's key."""
        keys[-1][module.layer_idx] = key.clone()
        out = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)  # (B, Hq, 1, D)
        return out.transpose(1, 2).contiguous(), None

    with torch.no_grad(), forwards_through(model, probe):
        for position in (0, 7):
            keys.append({})
            model(input_ids=token, position_ids=torch.full_like(token, position),
                  use_cache=False)
    return [not torch.equal(keys[0][i], keys[1][i]) if i in keys[0] else False
            for i in range(model.config.num_hidden_layers)]


def check_rope(model, rope: Rope, layer_type: str, layers: list[int]) -> None:
    """Raise unless ``rope`` turns a key exactly as each of ``layers``' attention rotates it.

    StreamingLLM's sink convention turns stored keys again with ``rope``: a rotation of the whole
    head by the model's cos/sin (``x cos + rotate_half(x) sin``). A model whose RoPE is not that
    (Cohere's interleaved pairs, Phi-3's partial rotary) is refused here, probed on a random key
    of every listed layer's head size with the function its attention module calls
    (``apply_rotary_pos_emb``).
    """
    modules = attention_modules(model)
    for i in layers:
        attention = modules.get(i)
        apply = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None) \
            if attention is not None else None
        if apply is None:
            raise ValueError(f"{type(model).__name__}: no apply_rotary_pos_emb found next to "
                             f"layer {i}'s attention, so sink_convention='cache' cannot check "
                             f"the model's RoPE")
        if not _turns_alike(model, rope, apply, attention.head_dim, layer_type):
            raise ValueError(f"{model.config.model_type}'s RoPE (layer {i}) is not a rotation "
                             f"of the whole head by its cos/sin (interleaved pairs or partial "
                             f"rotary): sink_convention='cache' cannot turn its stored keys; use "
                             f"'absolute'")


def _turns_alike(model, rope: Rope, apply, head_dim: int, layer_type: str) -> bool:
    """Whether ``rope`` and the model's ``apply`` rotate a random key of ``head_dim`` alike."""
    rotary = rotary_embedding(model)
    param = next(model.parameters())
    x = torch.randn(1, 1, 3, head_dim, generator=torch.Generator().manual_seed(0),
                    dtype=param.dtype).to(param.device)
    positions = torch.tensor([[0, 5, 37]], device=x.device)
    args = (layer_type,) if _takes_layer_type(rotary) else ()
    try:
        cos, sin = rotary(x, positions, *args)
        params = list(inspect.signature(apply).parameters)
        theirs = apply(x, cos, sin) if params[1] == "cos" else apply(x, x, cos, sin)[1]
        ours = rope(x, positions)
        return ours.shape == theirs.shape and bool(torch.allclose(ours, theirs, atol=1e-5))
    except (RuntimeError, ValueError, TypeError):
        return False
