"""A peer beside the ring: mlx-lm's ``RotatingKVCache`` one-token step, on MLX's CPU backend.

mlx-lm keeps a sliding window the same way ringviz does: a buffer of ``max_size`` slots written
in place at a wrap pointer, the keys attended in slot order. A model's decode step is
``cache.update_and_fetch(k, v)`` then ``mx.fast.scaled_dot_product_attention`` with
``cache.make_mask(1, window_size=W)``, which is ``None`` when the window fills the buffer: no
mask, as in ringviz's full-ring fast path. The row ``impl="mlx_rotating"`` times exactly that,
evaluated (MLX is lazy) with ``mx.eval`` each call, from the same prefill and token as the torch
rows; ``mlx_attention_only`` times MLX's attention alone over the same window, so the peer's
cost over its own kernel can be read beside the ring's over torch's. MLX is imported here only,
so the bench runs where it is absent; the rows then say why they were skipped. MLX runs on the
CPU with its own kernels and threads (``torch.set_num_threads`` does not reach it), and only
beside CPU rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

IMPL = "mlx_rotating"
ATTENTION_IMPL = "mlx_attention_only"  # MLX's SDPA over the same window, nothing written


def skip_reason(device_type: str) -> str | None:
    """Why the MLX row cannot run here (None if it can)."""
    if device_type != "cpu":
        return f"MLX runs on the CPU here; this run is on {device_type}"
    try:
        import mlx.core  # noqa: F401
        from mlx_lm.models.cache import RotatingKVCache  # noqa: F401
    except ImportError as err:
        return f"mlx / mlx-lm not importable: {err}"
    return None


def decode_steps(pre_k, pre_v, tok_k, tok_v, tok_q, window: int
                 ) -> dict[str, Callable[[], object]]:
    """``{IMPL: step, ATTENTION_IMPL: attention}`` for a ``RotatingKVCache(max_size=window)``
    after a ``window``-token prefill. ``step`` writes the token and attends the query over the
    window, as mlx-lm's attention layers do; ``attention`` is MLX's SDPA over a second cache's
    full window with nothing written (MLX's own bound, as ``attention_only`` is torch's).

    Inputs are the torch rows' tensors (CPU); each call returns the evaluated MLX output
    ``(B, Hq, 1, head_dim)``.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    def to_mx(t) -> mx.array:
        return mx.array(np.ascontiguousarray(t.detach().cpu().numpy()))

    k, v, q = to_mx(tok_k), to_mx(tok_v), to_mx(tok_q)
    scale = float(q.shape[-1]) ** -0.5
    cache, still = RotatingKVCache(max_size=window), RotatingKVCache(max_size=window)
    for c in (cache, still):
        c.update_and_fetch(to_mx(pre_k), to_mx(pre_v))
        mx.eval(c.keys, c.values)

    def step() -> mx.array:
        keys, values = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale, mask=cache.make_mask(1, window_size=window))
        mx.eval(out)
        return out

    def attention() -> mx.array:
        out = mx.fast.scaled_dot_product_attention(q, still.keys, still.values, scale=scale)
        mx.eval(out)
        return out

    return {IMPL: step, ATTENTION_IMPL: attention}
