"""Attention sinks inside the ring (issue 12): both RoPE conventions against independent references.

The StreamingLLM reference below follows the paper's algorithm literally and shares no code with
the cache: keys and queries are kept *unrotated*; for each query the cache is
``[sinks | recent]`` in order, and every key and the query are rotated at their positions
*inside that cache* (0, 1, ..., the query last) before a plain softmax. The absolute reference is
a band-with-sinks recompute over the whole sequence. Rotations use the textbook RoPE formula
written here (``rope``), not ``ringviz.apply_rope``.
"""

import hashlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringviz import RingKVCache, apply_rope
from ringviz.sinks import sink_shift

THETA = 10000.0


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Textbook RoPE in HF's rotate_half layout: pair (i, i + D/2) turned by pos * theta^(-2i/D)."""
    D = x.shape[-1]
    freq = THETA ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angle = positions.to(torch.float64)[..., None] * freq  # (B, T, D/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # (B, 1, T, D/2)
    x1, x2 = x[..., : D // 2].double(), x[..., D // 2:].double()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query (Hq, D) over keys/values (Hkv, n, D), HF's repeat_kv grouping."""
    G = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(G, 0), values.repeat_interleave(G, 0)
    weights = torch.softmax((keys @ q[:, :, None])[..., 0] / math.sqrt(q.shape[-1]), dim=-1)
    return (weights[:, None, :] @ values)[:, 0]  # (Hq, D)


def one(x: torch.Tensor, pos: int) -> torch.Tensor:
    """Rotate one (H, D) vector at ``pos``."""
    return rope(x[None, :, None], torch.tensor([[pos]]))[0, :, 0]


def streaming_llm_row(q_raw, k_raw, v, sinks, window):
    """StreamingLLM on one row of n tokens (positions 0..n-1): unrotated q (Hq, n, D), k, v."""
    outs = []
    for p in range(q_raw.shape[1]):
        kept = sorted(set(range(min(sinks, p + 1))) | set(range(max(0, p - window + 1), p + 1)))
        keys = torch.stack([one(k_raw[:, j], c) for c, j in enumerate(kept)], dim=1)
        query = one(q_raw[:, p], len(kept) - 1)  # the query is the cache's last entry
        outs.append(attend_one(query, keys, v[:, kept]))
    return torch.stack(outs, dim=1)  # (Hq, n, D)


def absolute_row(q_raw, k_raw, v, sinks, window):
    """Band-with-sinks recompute on one row: everything rotated at its absolute position."""
    outs = []
    for p in range(q_raw.shape[1]):
        kept = [j for j in range(p + 1) if j > p - window or j < sinks]
        keys = torch.stack([one(k_raw[:, j], j) for j in kept], dim=1)
        outs.append(attend_one(one(q_raw[:, p], p), keys, v[:, kept]))
    return torch.stack(outs, dim=1)


def run_cache(cache, q_raw, k_raw, v, positions, chunks):
    """Feed rotated q/k (at absolute positions) through ``cache`` chunk by chunk."""
    safe = positions.clamp(min=0)
    q, k = rope(q_raw, safe), rope(k_raw, safe)
    outs, t = [], 0
    for T in chunks:
        sl = slice(t, t + T)
        outs.append(cache.step(q[:, :, sl], k[:, :, sl], v[:, :, sl], positions[:, sl]))
        t += T
    return torch.cat(outs, dim=2)


def reference(q_raw, k_raw, v, positions, sinks, window, convention):
    """Per row, the reference on its real tokens; padding queries get zeros."""
    row_ref = streaming_llm_row if convention == "cache" else absolute_row
    out = torch.zeros_like(q_raw)
    for b in range(q_raw.shape[0]):
        real = positions[b] >= 0
        idx = real.nonzero()[:, 0]
        assert torch.equal(positions[b, idx], torch.arange(len(idx)))  # 0, 1, 2, ...
        out[b][:, idx] = row_ref(q_raw[b][:, idx], k_raw[b][:, idx], v[b][:, idx], sinks, window)
    return out


def make_case(seed, B, Hkv, G, D, chunks, pad_prob):
    """Random unrotated q/k/v and per-row positions 0, 1, ... with padding scattered in."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(chunks)
    q = torch.randn(B, Hkv * G, n, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, n, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, n, D, generator=gen, dtype=torch.float64)
    real = torch.rand(B, n, generator=gen) >= pad_prob
    real[0] = True  # row 0 unpadded
    positions = torch.where(real, real.cumsum(dim=1) - 1, -1)
    return q, k, v, positions


CONVENTIONS = {"absolute": None, "cache": rope}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    sinks=st.integers(0, 4),
    window=st.integers(1, 6),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    groups=st.sampled_from([(1, 1), (2, 1), (1, 3), (2, 2)]),
    pad_prob=st.sampled_from([0.0, 0.3]),
    convention=st.sampled_from(["absolute", "cache"]),
)
def test_sinks_equal_reference_over_random_chunk_schedules(seed, sinks, window, chunks, groups,
                                                           pad_prob, convention):
    Hkv, G = groups
    if convention == "cache" and sinks == 0:
        convention = "absolute"  # no sinks, one convention
    q, k, v, positions = make_case(seed, 2, Hkv, G, 4, chunks, pad_prob)
    cache = RingKVCache(2, Hkv, window, 4, sinks=sinks, sink_rope=CONVENTIONS[convention],
                        dtype=torch.float64)
    got = run_cache(cache, q, k, v, positions, chunks)
    want = reference(q, k, v, positions, sinks, window, convention)
    assert (got - want).abs().max() <= 1e-10


@pytest.mark.parametrize("convention", ["absolute", "cache"])
@pytest.mark.parametrize("chunks", [[1] * 30, [3] * 10, [13, 1, 1, 15], [30], [2, 25, 1, 1, 1]],
                         ids=["T=1", "T<W", "mixed", "T>W", "prefill-then-decode"])
def test_named_chunk_lengths_with_gqa_and_padding(convention, chunks):
    sinks, window = 3, 5
    q, k, v, positions = make_case(7, 3, 2, 2, 8, chunks, pad_prob=0.25)
    cache = RingKVCache(3, 2, window, 8, sinks=sinks, sink_rope=CONVENTIONS[convention],
                        dtype=torch.float64)
    got = run_cache(cache, q, k, v, positions, chunks)
    want = reference(q, k, v, positions, sinks, window, convention)
    assert (got - want).abs().max() <= 1e-10
    padded = positions < 0
    assert padded.any() and got.permute(0, 2, 1, 3)[padded].abs().max() == 0


def test_ringviz_apply_rope_as_sink_rope():
    """The package's own RoPE works as the sink rotation (same formula as the test's)."""
    q, k, v, positions = make_case(3, 2, 1, 2, 8, [6, 1, 1, 9, 1], pad_prob=0.2)
    cache = RingKVCache(2, 1, 4, 8, sinks=2, sink_rope=apply_rope, dtype=torch.float64)
    got = run_cache(cache, q, k, v, positions, [6, 1, 1, 9, 1])
    assert (got - reference(q, k, v, positions, 2, 4, "cache")).abs().max() <= 1e-10


def test_conventions_agree_until_s_plus_w_then_differ():
    """StreamingLLM moves the sinks only once the cache is full: from position S + W on."""
    sinks, window, n = 2, 4, 12
    q, k, v, positions = make_case(11, 1, 1, 1, 8, [n], pad_prob=0.0)
    outs = {}
    for name, f in CONVENTIONS.items():
        cache = RingKVCache(1, 1, window, 8, sinks=sinks, sink_rope=f, dtype=torch.float64)
        outs[name] = run_cache(cache, q, k, v, positions, [1] * n)
    gap = (outs["absolute"] - outs["cache"]).abs().amax(dim=(0, 1, 3))  # per position
    assert gap[: sinks + window].max() <= 1e-12
    assert gap[sinks + window:].min() > 1e-3


@pytest.mark.parametrize(("sinks", "window", "prefill"), [(2, 3, 1), (0, 4, 1), (3, 2, 7)])
def test_the_package_streaming_llm_reference_equals_the_literal_one(sinks, window, prefill):
    """ringviz.reference.StreamingLLMCache (the bench's and models/sinks' reference), given this
    file's textbook rope, equals the paper's algorithm above token by token after a prefill of
    ``prefill`` tokens (7 > S + W: the prefill itself is cut)."""
    from ringviz.reference import StreamingLLMCache

    q, k, v, _ = make_case(5, 1, 2, 2, 8, [16], 0.0)
    want = streaming_llm_row(q[0], k[0], v[0], sinks, window)
    cache = StreamingLLMCache(sinks, window, rope)
    cache.update(k[:, :, :prefill], v[:, :, :prefill])
    assert cache.k.shape[2] == min(prefill, sinks + window)
    for p in range(prefill, 16):
        keys, values = cache.update(k[:, :, p:p + 1], v[:, :, p:p + 1])
        got = attend_one(cache.query(q[:, :, p:p + 1])[0, :, 0], keys[0], values[0])
        assert (got - want[:, p]).abs().max() < 1e-12


def test_streaming_llm_reference_rejects_bad_input():
    from ringviz.reference import StreamingLLMCache

    with pytest.raises(ValueError, match="sinks"):
        StreamingLLMCache(-1, 4)
    with pytest.raises(TypeError, match="window"):
        StreamingLLMCache(1, 4.0)
    cache = StreamingLLMCache(1, 4)
    with pytest.raises(ValueError, match="empty"):
        cache.query(torch.zeros(1, 1, 1, 8))
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match="does not match"):
        cache.update(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8))
    with pytest.raises(ValueError, match="equal 4-D"):
        cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 2, 8))
    assert cache.k.shape == (1, 2, 3, 8)  # the rejected calls changed nothing


def test_sink_shift_is_p_minus_cache_position():
    p = torch.tensor([[-1, 0, 3, 5, 6, 7, 100]])
    assert sink_shift(p, sinks=2, window=4).tolist() == [[0, 0, 0, 0, 1, 2, 95]]


@pytest.mark.parametrize("convention", ["absolute", "cache"])
def test_sink_slots_never_overwritten_and_storage_fixed(convention):
    sinks, window, n = 3, 4, 40
    cache = RingKVCache(2, 1, window, 8, sinks=sinks, sink_rope=CONVENTIONS[convention],
                        dtype=torch.float64)
    ptrs = (cache._k_store.data_ptr(), cache._v_store.data_ptr(), cache._pos_store.data_ptr())
    nbytes = cache.nbytes
    assert nbytes == 2 * (2 * 1 * (sinks + window + 1) * 8) * 8 + 2 * (sinks + window + 1) * 8
    q, k, v, positions = make_case(5, 2, 1, 1, 8, [n], pad_prob=0.0)
    run_cache(cache, q, k, v, positions, [5] + [1] * (n - 5))
    assert cache.positions[:, :sinks].tolist() == [[0, 1, 2]] * 2
    assert torch.equal(cache.k[:, :, :sinks], rope(k, positions)[:, :, :sinks])
    ring = cache.positions[:, sinks:]
    assert sorted(ring[0].tolist()) == list(range(n - window, n))
    assert all(int(ring[0, s]) % window == s for s in range(window))  # slot S + pos % W
    assert (cache._k_store.data_ptr(), cache._v_store.data_ptr(),
            cache._pos_store.data_ptr()) == ptrs and cache.nbytes == nbytes
    assert cache.kv_seqlens.tolist() == [sinks + window] * 2 and cache.start.tolist() == [0, 0]


def test_attend_matches_step_with_sinks():
    """attend() over the stored cache scores sinks with the same convention as step()."""
    q, k, v, positions = make_case(9, 1, 1, 2, 8, [12], pad_prob=0.0)
    qr, kr = rope(q, positions), rope(k, positions)
    a = RingKVCache(1, 1, 4, 8, sinks=2, sink_rope=rope, dtype=torch.float64)
    b = RingKVCache(1, 1, 4, 8, sinks=2, sink_rope=rope, dtype=torch.float64)
    a.step(qr[:, :, :11], kr[:, :, :11], v[:, :, :11], positions[:, :11])
    b.step(qr[:, :, :11], kr[:, :, :11], v[:, :, :11], positions[:, :11])
    stepped = a.step(qr[:, :, 11:], kr[:, :, 11:], v[:, :, 11:], positions[:, 11:])
    b.write(kr[:, :, 11:], v[:, :, 11:], positions[:, 11:])
    attended = b.attend(qr[:, :, 11:], positions[:, 11:])
    assert (stepped - attended).abs().max() <= 1e-12


def test_float32_cache_positions_close_to_float64_reference():
    q, k, v, positions = make_case(4, 2, 2, 2, 16, [9, 1, 1, 1, 20], pad_prob=0.2)
    cache = RingKVCache(2, 2, 6, 16, sinks=4, sink_rope=apply_rope)
    safe = positions.clamp(min=0)
    qr, kr = rope(q, safe).float(), rope(k, safe).float()
    outs, t = [], 0
    for T in [9, 1, 1, 1, 20]:
        sl = slice(t, t + T)
        outs.append(cache.step(qr[:, :, sl], kr[:, :, sl], v[:, :, sl].float(), positions[:, sl]))
        t += T
    want = reference(q, k, v, positions, 4, 6, "cache")
    assert (torch.cat(outs, dim=2).double() - want).abs().max() <= 1e-5


def snapshot(cache) -> str:
    """sha256 over every tensor the cache stores (sink slots and spare included)."""
    digest = hashlib.sha256()
    for t in (cache._k_store, cache._v_store, cache._pos_store, cache._last_pos):
        digest.update(t.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("bad", ["repeat_position", "wrong_kv_heads", "bad_scale", "q_dtype"])
def test_rejected_step_changes_nothing_with_sinks(bad):
    cache = RingKVCache(2, 2, 4, 8, sinks=2, sink_rope=apply_rope)
    x = torch.randn(2, 2, 7, 8)
    cache.step(x, x, x, torch.arange(7).repeat(2, 1))
    before = snapshot(cache)
    q = k = v = torch.randn(2, 2, 3, 8)
    pos, scale = torch.arange(7, 10).repeat(2, 1), None
    if bad == "repeat_position":
        pos = torch.tensor([[7, 8, 9], [6, 7, 8]])  # row 1 repeats 6
    elif bad == "wrong_kv_heads":
        k = v = torch.randn(2, 1, 3, 8)
    elif bad == "bad_scale":
        scale = -1.0
    else:
        q = q.double()
    with pytest.raises((ValueError, TypeError)):
        cache.step(q, k, v, pos, scale=scale)
    assert snapshot(cache) == before


def _wrong_shape(x, positions):
    return x[..., :-1]


def _scales(x, positions):
    return 2 * apply_rope(x, positions)


def _fails(x, positions):
    raise RuntimeError("no table for these positions")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"sinks": -1}, ValueError, "sinks must be >= 0"),
    ({"sinks": 1.5}, TypeError, "sinks must be an int"),
    ({"sinks": True}, TypeError, "sinks must be an int"),
    ({"sinks": 2, "sink_rope": "rope"}, TypeError, "sink_rope must be None or a callable"),
    ({"sinks": 0, "sink_rope": apply_rope}, ValueError, "needs sinks >= 1"),
    ({"sinks": 2, "sink_rope": _wrong_shape}, TypeError, "x's shape"),
    ({"sinks": 2, "sink_rope": _scales}, ValueError, "not a rotation"),
    ({"sinks": 2, "sink_rope": lambda x, p: x}, ValueError, "not a rotation"),
    ({"sinks": 2, "sink_rope": _fails}, TypeError, "probe"),
])
def test_bad_sinks_or_sink_rope_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        RingKVCache(1, 1, 4, 8, **kwargs)


def test_repr_names_sinks_and_convention():
    text = repr(RingKVCache(1, 1, 4, 8, sinks=2, sink_rope=apply_rope))
    assert "sinks=2" in text and "sink_rope=apply_rope" in text


@pytest.mark.parametrize("convention", ["absolute", "cache"])
def test_unchecked_steps_equal_checked_ones(convention):
    """check=False (a trusted loop, CUDA-graph capture) computes exactly what check=True does."""
    q, k, v, positions = make_case(12, 2, 1, 2, 8, [7] + [1] * 9, pad_prob=0.2)
    a, b = (RingKVCache(2, 1, 4, 8, sinks=2, sink_rope=CONVENTIONS[convention],
                        dtype=torch.float64) for _ in range(2))
    safe = positions.clamp(min=0)
    qr, kr = rope(q, safe), rope(k, safe)
    t = 0
    for T in [7] + [1] * 9:
        sl = slice(t, t + T)
        args = (qr[:, :, sl], kr[:, :, sl], v[:, :, sl], positions[:, sl])
        assert torch.equal(a.step(*args), b.step(*args, check=False))
        t += T
    assert snapshot(a) == snapshot(b)


@pytest.mark.parametrize("convention", ["absolute", "cache"])
def test_sinks_with_spare_capacity_and_truncate(convention):
    """Speculative decoding's capacity= and truncate() keep working beside the sink slots."""
    q, k, v, positions = make_case(13, 1, 1, 2, 8, [16], pad_prob=0.0)
    safe = positions.clamp(min=0)
    qr, kr = rope(q, safe), rope(k, safe)
    f = CONVENTIONS[convention]
    spec = RingKVCache(1, 1, 4, 8, sinks=2, sink_rope=f, capacity=6, dtype=torch.float64)
    plain = RingKVCache(1, 1, 4, 8, sinks=2, sink_rope=f, dtype=torch.float64)
    want = plain.step(qr, kr, v, positions)
    spec.step(qr[:, :, :12], kr[:, :, :12], v[:, :, :12], positions[:, :12])
    draft = torch.randn(1, 1, 2, 8, dtype=torch.float64)  # two rejected draft tokens
    spec.step(torch.randn(1, 2, 2, 8, dtype=torch.float64), draft, draft, positions[:, 12:14])
    spec.truncate(torch.tensor([12]))
    got = spec.step(qr[:, :, 12:], kr[:, :, 12:], v[:, :, 12:], positions[:, 12:])
    assert (got - want[:, :, 12:]).abs().max() <= 1e-12
    assert spec.positions[0, :2].tolist() == [0, 1] and spec.k.shape[2] == 2 + 6


def test_a_sink_rope_failing_in_a_chunk_changes_nothing():
    """Attend first, then write: a rotation that fails mid-chunk leaves the cache as it was."""

    def small_only(x, positions):  # passes the construction probe, fails on larger inputs
        if x.shape[2] > 2:
            raise RuntimeError("no table for so many keys")
        return apply_rope(x, positions)

    cache = RingKVCache(1, 1, 4, 8, sinks=2, sink_rope=small_only)
    x = torch.randn(1, 1, 1, 8)
    cache.step(x, x, x, torch.tensor([[0]]))
    before = snapshot(cache)
    y = torch.randn(1, 1, 3, 8)
    with pytest.raises(RuntimeError, match="no table"):
        cache.step(y, y, y, torch.tensor([[1, 2, 3]]))
    assert snapshot(cache) == before
