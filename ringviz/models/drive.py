"""The ring decode path on a real model: Hugging Face's layers, ringviz's ``RingKVCache``.

Hugging Face computes everything around attention (embeddings, RMSNorm, q/k/v projections,
RoPE at the positions we pass, MLP, logits) with its own modules, so float64 runs agree with
its float32-angle RoPE and float32 RMSNorm to the last bit. What it hands to attention is the
new tokens' rotated ``q``, ``k``, ``v``; we register an attention function under the name
``"ringviz_ring"`` that sends them to the layer's ring::

    q, k, v (rotated at absolute positions) -> RingKVCache.step -> write slot pos % W
                                              -> mask from stored positions -> attention

No Hugging Face cache is built (``use_cache=False``) and no HF mask is made (masks come from the
ring's stored positions), so the ring is the only KV state. Sliding layers get a ring of
capacity ``window``; a full-attention layer (Gemma 3's 5, 11, 17) gets a ``RingKVCache`` whose
capacity covers the whole run, so it never wraps: a preallocated full cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ringviz.cache import RingKVCache

ATTN_NAME = "ringviz_ring"


def _ring_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                    dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention-interface entry: route one layer's q/k/v through the runner's ring."""
    runner: RingRunner = kwargs["ring_runner"]
    positions = kwargs["position_ids"]  # (B, T) absolute, -1 = padding
    out = runner.attend(module.layer_idx, query, key, value, positions, scaling)  # (B, Hq, T, D)
    return out.transpose(1, 2), None  # HF expects (B, T, Hq, D)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _ring_attention)


@contextmanager
def attention_implementation(model, name: str, *, one_config: bool = False) -> Iterator[None]:
    """Switch the model's attention implementation for a block, then restore it.

    ``set_attn_implementation`` validates the name and walks every module: 0.42 ms a call on
    Gemma 3 (measured, CPU), twice per ring forward. With ``one_config=True`` (every module
    reads ``model.config`` itself, see :func:`shares_one_config`; the name validated once
    already) the switch is the one config attribute ``set_attn_implementation`` itself sets.
    """
    before = model.config._attn_implementation

    def switch(impl: str) -> None:
        if one_config:
            model.config._attn_implementation_internal = impl
        else:
            model.set_attn_implementation(impl)

    switch(name)
    try:
        yield
    finally:
        switch(before)


def shares_one_config(model) -> bool:
    """True when every module reads ``model.config`` itself and it has no sub-configs."""
    config = model.config
    return not config.sub_configs and all(
        getattr(module, "config", config) is config for module in model.modules())


def layer_windows(model, window: int | None) -> list[int | None]:
    """Per layer: the ring capacity of a sliding layer, or None for a full-attention layer.

    A model with ``layer_types`` (Gemma 3) keeps its own split, its sliding layers using
    ``window`` (default: the model's ``sliding_window``). A model without (Llama/SmolLM2)
    gets ``window`` imposed on every layer.
    """
    config = model.config
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    if window is None:
        window = getattr(config, "sliding_window", None)
        if window is None:
            raise ValueError(f"{config.model_type} has no native sliding window: pass window=W")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be a positive int, got {window!r}")
    return [window if t == "sliding_attention" else None for t in types]


class RingRunner:
    """One model's KV state in ``RingKVCache`` objects, one per layer, for a batch of rows."""

    def __init__(self, model, batch_size: int, window: int | None, capacity: int) -> None:
        """``capacity``: positions the run may reach (sizes the full layers' caches)."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        _register()
        with attention_implementation(model, ATTN_NAME):  # validates the name once
            pass
        self.one_config = shares_one_config(model)  # then every forward switches cheaply
        config = model.config
        self.model = model
        self.windows = layer_windows(model, window)
        param = next(model.parameters())
        self.caches = [
            RingKVCache(batch_size, config.num_key_value_heads, w or capacity, config.head_dim,
                        dtype=param.dtype, device=param.device)
            for w in self.windows
        ]

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' caches (k, v and positions)."""
        return sum(cache.nbytes for cache in self.caches)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention for one layer: write into its ring and attend (bugs.py overrides this).

        Every layer of one forward gets the same positions and shapes, and all rings advance
        together, so validating at layer 0 (before anything is written) covers them all and
        spares the other layers the host sync.
        """
        return self.caches[layer].step(q, k, v, positions, scale=scale, check=layer == 0)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` of ``T`` new tokens per row; -1 positions are padding."""
        if input_ids.shape != positions.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions "
                             f"{tuple(positions.shape)} differ")
        with attention_implementation(self.model, ATTN_NAME, one_config=self.one_config):
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                             ring_runner=self)
        return out.logits


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token rows of different lengths, padded on the left: ``(ids, positions)`` (B, T).

    >>> ids, pos = left_pad([torch.tensor([7, 8, 9]), torch.tensor([5])], pad_id=0)
    >>> ids.tolist(), pos.tolist()
    ([[7, 8, 9], [0, 0, 5]], [[0, 1, 2], [-1, -1, 0]])
    """
    T = max(len(r) for r in rows)
    device = rows[0].device
    ids = torch.full((len(rows), T), pad_id, dtype=torch.int64, device=device)
    positions = torch.full((len(rows), T), -1, dtype=torch.int64, device=device)
    for b, row in enumerate(rows):
        ids[b, T - len(row):] = row
        positions[b, T - len(row):] = torch.arange(len(row), device=device)
    return ids, positions


@torch.no_grad()
def ring_logits(runner: RingRunner, rows: list[torch.Tensor], prompt_lengths: list[int],
                progress: bool = False) -> list[torch.Tensor]:
    """Teacher-forced ring decode: prefill each row's prompt, then one token per step.

    ``rows[b]`` holds row b's whole sequence; its first ``prompt_lengths[b]`` tokens are the
    prompt (one batched, left-padded prefill call), the rest are fed one per decode step.
    Rows must have the same number of decode tokens. Returns each row's logits ``(L_b, vocab)``.
    """
    from tqdm.auto import tqdm

    new = {len(r) - p for r, p in zip(rows, prompt_lengths, strict=True)}
    if len(new) != 1 or min(prompt_lengths) <= 0:
        raise ValueError("rows need prompts of >= 1 token and the same number of new tokens")
    n_new = new.pop()
    pad_id = int(rows[0][0])  # any valid id: padded tokens are never attended to
    ids, positions = left_pad([r[:p] for r, p in zip(rows, prompt_lengths, strict=True)],
                              pad_id)
    prefill = runner.forward(ids, positions)  # (B, P_max, vocab)
    steps = []
    lengths = torch.tensor(prompt_lengths, device=ids.device)
    for i in tqdm(range(n_new), desc="ring decode", disable=not progress, leave=False):
        tok = torch.stack([r[p + i] for r, p in zip(rows, prompt_lengths, strict=True)])  # (B,)
        steps.append(runner.forward(tok[:, None], (lengths + i)[:, None]))  # (B, 1, vocab)
    decode = torch.cat(steps, dim=1) if steps else prefill[:, :0]
    return [torch.cat([prefill[b, prefill.shape[1] - p:], decode[b]])
            for b, p in enumerate(prompt_lengths)]


@torch.no_grad()
def ring_generate(runner: RingRunner, prompts: list[torch.Tensor],
                  new_tokens: int) -> list[torch.Tensor]:
    """Greedy decoding through the ring: each row's ``new_tokens`` next token ids."""
    if new_tokens <= 0:
        raise ValueError(f"new_tokens must be positive, got {new_tokens}")
    ids, positions = left_pad(prompts, pad_id=int(prompts[0][0]))
    nxt = runner.forward(ids, positions)[:, -1].argmax(-1)  # (B,)
    out = [nxt]
    pos = positions[:, -1] + 1  # (B,) next absolute position of each row
    for i in range(new_tokens - 1):
        nxt = runner.forward(nxt[:, None], (pos + i)[:, None])[:, -1].argmax(-1)  # (B,)
        out.append(nxt)
    return list(torch.stack(out, dim=1))  # B tensors of (new_tokens,)
