"""What one forward needs, computed once: the forward plan.

transformers asks for masks (once per layer kind) before any layer runs; the first ask of a
forward builds a :class:`ForwardPlan` for every kind at once, the way mistral-inference computes
its cache metadata once per step, and every layer of that forward reads it::

    plan: positions (B, T) (-1 = padding), per kind: key positions -> mask (B, 1, T, K)
    layer i: q, k, v (RoPE by HF at plan.positions) -> step: ring write + attention, plan's mask

A plan is spent once a layer has stepped with it; the next ask for a mask starts a new one.
"""

from __future__ import annotations

import torch

NOT_THROUGH_GENERATE = (
    "a RingCache's masks must come from its stored positions, but this forward used Hugging "
    "Face's stock masks (keys assumed in temporal order). Call ringviz.hf.generate(model, "
    "input_ids, ...) instead of model.generate(..., cache=RingCache(model)).")


class ForwardPlan:
    """One forward's positions and masks (one object per cache, refilled by :meth:`fill`).

    ``positions`` ``(B, T)`` absolute, -1 = padding; ``masks`` bool ``(B, 1, T, K)`` per layer
    kind; ``last_layer``: the last layer that began its step with it (-1: none yet), so a stale
    plan (a forward that skipped the mask hook) is refused; ``done``: the last layer whose step
    (its write) completed, so a forward that raises part-way is known to have written.
    ``unmasked``: the kinds whose query sees every key (their mask an all-True view, skipped
    by their layers' step); ``real``: every new token is known to be real (no padding);
    ``causal``: the kinds whose chunk is a first chunk without padding, so each query sees the
    chunk's keys up to its own (the plain causal mask, which SDPA applies itself).
    """

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None
        self.masks: dict[str, torch.Tensor] = {}
        self.unmasked: frozenset[str] = frozenset()
        self.causal: frozenset[str] = frozenset()
        self.real = False
        self.last_layer = -1
        self.done = -1

    def fill(self, positions: torch.Tensor, masks: dict[str, torch.Tensor], *,
             unmasked: frozenset[str] = frozenset(), causal: frozenset[str] = frozenset(),
             real: bool = False) -> None:
        self.positions, self.masks = positions, masks
        self.unmasked, self.causal, self.real = unmasked, causal, real
        self.last_layer = self.done = -1

    def clear(self) -> None:
        self.positions, self.masks, self.last_layer, self.done = None, {}, -1, -1
        self.unmasked, self.causal, self.real = frozenset(), frozenset(), False

    @property
    def fresh(self) -> bool:
        """True between the plan's making and its first layer step.

        ``last_layer`` is read first: a compiled decode step then never guards on the shape of
        the spent plan's positions (the prefill's).
        """
        return self.last_layer < 0 and self.positions is not None

    def enter(self, layer_idx: int) -> None:
        """Layer ``layer_idx`` steps with this plan: layers step once each, in order."""
        if self.positions is None or layer_idx <= self.last_layer:
            raise RuntimeError(NOT_THROUGH_GENERATE)
        self.last_layer = layer_idx


def positions_from_mask(attention_mask: torch.Tensor | None, seen: torch.Tensor | int,
                        batch: int, T: int, device: torch.device) -> torch.Tensor:
    """``(B, T)`` absolute positions of the new tokens (-1 = padding) from HF's 2D mask.

    A row's token at absolute position ``p`` is its ``p``-th real token (``attention_mask``'s
    cumsum - 1, what ``generate`` feeds RoPE); without a mask, ``seen + 0 .. T-1``.
    """
    if attention_mask is None:
        return (seen + torch.arange(T, device=device)).expand(batch, T)
    if attention_mask.shape != (batch, int(seen) + T):
        raise ValueError(f"attention_mask must cover every token so far: (B, seen + T) = "
                         f"{(batch, int(seen) + T)}, got {tuple(attention_mask.shape)}")
    mask = attention_mask.to(device=device, dtype=torch.bool)
    positions = mask.long().cumsum(-1)[:, -T:] - 1
    return positions.masked_fill(~mask[:, -T:], -1)
