"""The baselines are honest: the growing cache and both shift-copy windows keep what they claim,
and the band-mask reference equals attention written out one query at a time."""

import math

import pytest
import torch

from ringviz import GrowingKVCache, ShiftWindowKVCache, windowed_attention_reference


def test_growing_cache_keeps_everything_and_grows():
    cache = GrowingKVCache(2, 3, 4, dtype=torch.float64)
    ks = [torch.randn(2, 3, n, 4, dtype=torch.float64) for n in (5, 1, 1, 3)]
    for k in ks:
        k_all, v_all = cache.update(k, -k)
        assert cache.nbytes == 2 * 2 * 3 * len(cache) * 4 * 8
    assert torch.equal(k_all, torch.cat(ks, dim=2)) and torch.equal(v_all, -k_all)


@pytest.mark.parametrize("mode", ["cat", "roll"])
def test_shift_window_returns_last_w_in_order(mode):
    W = 4
    cache = ShiftWindowKVCache(1, 2, W, 3, mode=mode, dtype=torch.float64)
    seen = []
    for n in [1, 2, 1, 6, 1, 1]:
        k = torch.arange(len(seen), len(seen) + n, dtype=torch.float64).view(1, 1, n, 1)
        k = k.expand(1, 2, n, 3).contiguous()
        seen += list(range(len(seen), len(seen) + n))
        k_win, v_win = cache.update(k, k)
        assert k_win[0, 0, :, 0].tolist() == seen[-W:]
    assert cache.nbytes == 2 * 2 * W * 3 * 8


def test_roll_keeps_its_storage():
    cache = ShiftWindowKVCache(1, 1, 4, 2, mode="roll")
    ptr = cache.k.data_ptr()
    for _ in range(9):
        cache.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    assert cache.k.data_ptr() == ptr


def loop_reference(q, k, v, pos, window):
    """One query, one head at a time: softmax over keys p-W+1..p (float64, no masks)."""
    B, Hq, T, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            for i in range(T):
                p = int(pos[b, i])
                keys = [j for j in range(T) if pos[b, j] >= 0 and p - window < pos[b, j] <= p]
                if p < 0 or not keys:
                    continue
                s = torch.stack([q[b, h, i] @ k[b, h // group, j] for j in keys]) / math.sqrt(D)
                w = torch.softmax(s, dim=0)
                out[b, h, i] = sum(wj * v[b, h // group, j] for wj, j in zip(w, keys))
    return out


def test_reference_equals_per_query_loop():
    B, Hq, Hkv, T, D, W = 2, 4, 2, 9, 4, 3
    q = torch.randn(B, Hq, T, D, dtype=torch.float64)
    k = torch.randn(B, Hkv, T, D, dtype=torch.float64)
    v = torch.randn(B, Hkv, T, D, dtype=torch.float64)
    pos = torch.tensor([list(range(T)), [-1, -1] + list(range(T - 2))])
    got = windowed_attention_reference(q, k, v, pos, W)
    assert (got - loop_reference(q, k, v, pos, W)).abs().max() < 1e-12
    assert (got[1, :, :2] == 0).all()


def test_bad_inputs():
    with pytest.raises(ValueError, match="mode"):
        ShiftWindowKVCache(1, 1, 4, 2, mode="ring")
    with pytest.raises(ValueError, match="window must be >= 1"):
        ShiftWindowKVCache(1, 1, 0, 2)
    cache = GrowingKVCache(1, 2, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cache.update(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))
    with pytest.raises(TypeError, match="dtype"):
        cache.update(torch.randn(1, 2, 1, 4, dtype=torch.float64),
                     torch.randn(1, 2, 1, 4, dtype=torch.float64))
    assert len(cache) == 0
    with pytest.raises(ValueError, match="not a positive multiple"):
        windowed_attention_reference(torch.randn(1, 3, 2, 4), torch.randn(1, 2, 2, 4),
                                     torch.randn(1, 2, 2, 4), torch.arange(2)[None], 2)
