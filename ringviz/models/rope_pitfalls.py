"""RoPE pitfalls around a ring cache, each a small ``RingRunner`` variant run on a real model.

=================  ===========================================================  ===============
runner             what the code does wrong                                     first symptom
=================  ===========================================================  ===============
DoubleRopeRunner   rotates keys HF has already rotated (cache "adds" RoPE)      position 1
BatchCounterRunner one decode counter for the batch: padded rows jump ahead     padded row,
                   by their padding (prefill used per-row positions)            first decode
OneBaseRunner      every layer rotated with the global base (Gemma 3: 1e6),     position 1
                   local layers' own base (1e4) ignored
=================  ===========================================================  ===============

Each is fixed by the plain ``RingRunner``: rotate once, at the row's own absolute position, with
the layer's own base. ``rope_bases`` reads the bases from the model's own rotary module, so the
Gemma 3 pitfall is measured with the model's real cos/sin, not a re-implementation.
"""

from __future__ import annotations

import torch

from ringviz.hf.config import KIND_TYPES, read_layout
from ringviz.models.drive import RingRunner
from ringviz.rope import apply_rope, rotate


class DoubleRopeRunner(RingRunner):
    """Bug: the cache rotates keys at ``pos`` that HF already rotated: they end up at ``R(2 pos)``.

    Position 0 is rotated by angle 0 either way, so only position 0 is right.
    """

    def attend(self, layer, q, k, v, positions, scale):
        theta = read_layout(self.model).rope_theta("sliding")
        k_twice = apply_rope(k, positions, theta)  # (B, Hkv, T, D)
        return self.caches[layer].step(q, k_twice, v, positions, scale=scale, check=layer == 0)


class BatchCounterRunner(RingRunner):
    """Bug: after a left-padded prefill with per-row positions, decode with one batch counter.

    The counter starts at the padded prefill width, so a row with ``p`` padding tokens writes
    its next token at ``len + p`` instead of ``len``: RoPE distances to its cached keys are
    ``p`` too long and the window mask drops its ``p`` oldest visible keys. The unpadded row is
    unharmed.
    """

    def __init__(self, model, batch_size, window, capacity):
        super().__init__(model, batch_size, window, capacity)
        self.counter: int | None = None  # next batch-wide position, set by the prefill

    def prefill(self, input_ids, positions, **kwargs):
        self.counter = None  # the prefill's chunks keep their per-row positions (left_pad's)
        out = super().prefill(input_ids, positions, **kwargs)
        self.counter = input_ids.shape[1]  # the padded width: right for unpadded rows only
        return out

    def forward(self, input_ids, positions, **kwargs):
        if self.counter is None:  # inside (or before) a prefill
            return super().forward(input_ids, positions, **kwargs)
        shared = torch.full_like(positions, self.counter)  # (B, 1): every row alike
        self.counter += 1
        return super().forward(input_ids, shared, **kwargs)


def rope_bases(model) -> dict[str, float]:
    """RoPE base per layer type, from the config the model's rotary module was built with."""
    layout = read_layout(model)
    return {KIND_TYPES[kind]: layout.rope_theta(kind) for kind in dict.fromkeys(layout.kinds)}


class OneBaseRunner(RingRunner):
    """Bug (Gemma 3): local layers rotated with the global base, as if the model had one.

    HF rotated ``q`` and ``k`` of a sliding layer with the local base; this runner undoes that
    rotation and applies the global one, both with cos/sin from the model's own rotary module.
    """

    def __init__(self, model, batch_size, window, capacity):
        if set(rope_bases(model)) != {"sliding_attention", "full_attention"}:
            raise ValueError("OneBaseRunner needs a model with sliding and full layers (Gemma 3)")
        super().__init__(model, batch_size, window, capacity)
        self.rotary = model.model.rotary_emb

    def _cos_sin(self, x, positions, layer_type):
        cos, sin = self.rotary(x, positions, layer_type)  # (B, T, D) each
        return cos[:, None], sin[:, None]  # (B, 1, T, D)

    def attend(self, layer, q, k, v, positions, scale):
        if self.windows[layer] is not None:  # a sliding (local) layer
            cos_l, sin_l = self._cos_sin(q, positions, "sliding_attention")
            cos_g, sin_g = self._cos_sin(q, positions, "full_attention")
            q, k = (rotate(rotate(x, cos_l, -sin_l), cos_g, sin_g) for x in (q, k))
        return super().attend(layer, q, k, v, positions, scale)
