"""References that share only the window rule with the ring: one HF forward over the sequence.

* Imposed window W on a model trained without one (SmolLM2): HF's forward with an explicit 4D
  band mask. Setting ``config.sliding_window`` is not enough: Llama trims its cache to the
  window but its mask ignores it, so prefill and decode silently disagree. The mask is the
  window rule, :func:`ringviz.masks.band_mask` (whose tests check it against the rule's
  definition); nothing else of the ring is shared.
* A model with its own sliding window (Gemma 3): HF's forward as it is; its masks are HF's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ringviz.checks import check_int
from ringviz.hf.config import KIND_TYPES, read_layout
from ringviz.masks import band_mask


def band_bias(length: int, window: int | None, sinks: int = 0, *, dtype: torch.dtype,
              device: torch.device | str | None = None) -> torch.Tensor:
    """Additive mask ``(1, 1, L, L)``: 0 where query i may see key j, the dtype's min
    elsewhere.

    Visible by the window rule (:func:`ringviz.masks.band_mask`): ``j <= i`` and
    (``j > i - window`` or ``j < sinks``); ``window=None`` is causal.
    """
    positions = torch.arange(length, device=device)  # query i and key j at position i, j
    seen = band_mask(positions, positions, window, sinks)  # (L, L)
    bias = torch.zeros(length, length, dtype=dtype, device=device)
    return bias.masked_fill(~seen, torch.finfo(dtype).min)[None, None]


@contextmanager
def native_window(model, window: int | None) -> Iterator[int | None]:
    """Run a native-window model's sliding layers with ``window`` for a block (None: its own).

    HF's Gemma masks read ``config.sliding_window`` at call time, so this changes HF's own
    forward and ringviz's ring together. Models without a native window are left alone.
    """
    if not read_layout(model).has_native_window:
        yield window
        return
    before = model.config.sliding_window
    model.config.sliding_window = before if window is None else window
    try:
        yield model.config.sliding_window
    finally:
        model.config.sliding_window = before


@torch.no_grad()
def reference_logits(model, ids: torch.Tensor, window: int | None, sinks: int = 0) -> torch.Tensor:
    """Logits ``(L, vocab)`` for one unpadded sequence ``ids`` (L,), by one full forward.

    Without a native window: the band mask for ``window`` (None = full causal) and ``sinks``
    on every layer. With one (Gemma 3): ``window`` is its sliding layers' window (None = its
    own); without sinks HF builds its own masks, with sinks its sliding layers get our band.
    """
    if ids.ndim != 1:
        raise ValueError(f"ids must be one sequence (L,), got shape {tuple(ids.shape)}")
    sinks = check_int("sinks", sinks, minimum=0)
    positions = torch.arange(len(ids), device=ids.device)[None]
    dtype = next(model.parameters()).dtype

    def bias(w: int | None, s: int) -> torch.Tensor:
        return band_bias(len(ids), w, s, dtype=dtype, device=ids.device)

    layout = read_layout(model)
    if not layout.has_native_window:
        mask = bias(window, sinks)
    elif sinks == 0:
        with native_window(model, window):
            return model(input_ids=ids[None], position_ids=positions, use_cache=False).logits[0]
    else:  # one mask per kind: a dict where the model has both, else the one tensor
        by_kind = {"full": bias(None, 0), "sliding": bias(window or layout.native_window, sinks)}
        kinds = dict.fromkeys(layout.kinds)
        mask = ({KIND_TYPES[k]: by_kind[k] for k in kinds} if len(kinds) > 1
                else by_kind[next(iter(kinds))])
    out = model(input_ids=ids[None], attention_mask=mask, position_ids=positions, use_cache=False)
    return out.logits[0]


@torch.no_grad()
def reference_greedy(model, prompt: torch.Tensor, new_tokens: int,
                     window: int | None) -> torch.Tensor:
    """Greedy continuation ``(new_tokens,)`` by recomputing the whole sequence every step."""
    ids = prompt
    for _ in range(new_tokens):
        nxt = reference_logits(model, ids, window)[-1].argmax()
        ids = torch.cat([ids, nxt[None]])
    return ids[len(prompt):]
