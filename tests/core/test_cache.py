"""RingKVCache against the full-recompute reference, and every contract of its API."""

import hashlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringviz import RingKVCache, windowed_attention_reference


def make_inputs(B, Hq, Hkv, L, D, device, dtype=torch.float64, pad=None):
    """Random q, k, v and positions; ``pad[b] = (left, right)`` padding per row."""
    q = torch.randn(B, Hq, L, D, dtype=dtype, device=device)
    k = torch.randn(B, Hkv, L, D, dtype=dtype, device=device)
    v = torch.randn(B, Hkv, L, D, dtype=dtype, device=device)
    pos = torch.full((B, L), -1, dtype=torch.int64, device=device)
    for b in range(B):
        left, right = pad[b] if pad else (0, 0)
        pos[b, left:L - right] = torch.arange(L - left - right, device=device)
    return q, k, v, pos


def run_chunks(cache, q, k, v, pos, chunks):
    outs, s = [], 0
    for n in chunks:
        outs.append(cache.step(q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n],
                               pos[:, s:s + n]))
        s += n
    return torch.cat(outs, dim=2)


def last_window(pos_row: torch.Tensor, window: int) -> set[int]:
    valid = [int(p) for p in pos_row if p >= 0]
    return set(valid[-window:])


@st.composite
def schedules(draw):
    window = draw(st.integers(1, 7))
    B = draw(st.integers(1, 3))
    Hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3]))
    sizes = st.sampled_from([1, 1, 1, max(window - 1, 1), window, window + 1, 2 * window + 3])
    chunks = draw(st.lists(sizes, min_size=1, max_size=8))
    L = sum(chunks)
    pad = [(draw(st.integers(0, L // 2)), 0) if draw(st.booleans())
           else (0, draw(st.integers(0, L // 2))) for _ in range(B)]
    return window, B, Hkv, group, chunks, pad


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_step_equals_reference_for_any_chunk_schedule(case):
    window, B, Hkv, group, chunks, pad = case
    L, D = sum(chunks), 4
    q, k, v, pos = make_inputs(B, Hkv * group, Hkv, L, D, "cpu", pad=pad)
    cache = RingKVCache(B, Hkv, window, D, dtype=torch.float64)
    out = run_chunks(cache, q, k, v, pos, chunks)
    ref = windowed_attention_reference(q, k, v, pos, window)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 1e-12
    for b in range(B):  # afterwards the ring holds each row's last W positions, nothing else
        stored = {int(p) for p in cache.positions[b] if p >= 0}
        assert stored == last_window(pos[b], window)


@pytest.mark.parametrize("window", [1, 4, 16])
def test_named_chunk_sizes(device, window):
    chunks = [1, window - 1 or 1, window, window + 1, 2 * window + 3, 1, 1]
    L, D = sum(chunks), 8
    q, k, v, pos = make_inputs(2, 4, 2, L, D, device, pad=[(0, 0), (3, 2)])
    cache = RingKVCache(2, 2, window, D, dtype=torch.float64, device=device)
    out = run_chunks(cache, q, k, v, pos, chunks)
    assert (out - windowed_attention_reference(q, k, v, pos, window)).abs().max() < 1e-12


def test_chunked_prefill_equals_token_by_token(device):
    q, k, v, pos = make_inputs(3, 6, 2, 40, 8, device, pad=[(0, 0), (5, 0), (0, 7)])
    one = run_chunks(RingKVCache(3, 2, 8, 8, dtype=torch.float64, device=device),
                     q, k, v, pos, [1] * 40)
    chunked = run_chunks(RingKVCache(3, 2, 8, 8, dtype=torch.float64, device=device),
                         q, k, v, pos, [13, 9, 18])
    assert (one - chunked).abs().max() < 1e-12


def test_chunk_step_takes_its_last_queries_only(device):
    """A chunk's q may hold only its last queries (Gemma 4's KV-shared layers): their outputs
    and what the ring stores are those of the whole chunk's step."""
    q, k, v, pos = make_inputs(3, 4, 2, 30, 8, device, pad=[(0, 0), (4, 0), (0, 6)])
    whole = RingKVCache(3, 2, 8, 8, dtype=torch.float64, device=device)
    last = RingKVCache(3, 2, 8, 8, dtype=torch.float64, device=device)
    for s, n in ((0, 11), (11, 1), (12, 18)):
        chunk = slice(s, s + n)
        out = whole.step(q[:, :, chunk], k[:, :, chunk], v[:, :, chunk], pos[:, chunk])
        got = last.step(q[:, :, s + n - 1:s + n], k[:, :, chunk], v[:, :, chunk], pos[:, chunk])
        assert (got - out[:, :, -1:]).abs().max() < 1e-12
        assert torch.equal(last.positions, whole.positions) and torch.equal(last.k, whole.k)
    with pytest.raises(ValueError, match=r"T=1..4"):
        last.step(q[:, :, :5], k[:, :, :4], v[:, :, :4], last.lengths[:, None]
                  + torch.arange(4, device=device))


def test_float32_close_to_float64_reference(device):
    q, k, v, pos = make_inputs(2, 4, 4, 50, 32, device, dtype=torch.float32)
    out = run_chunks(RingKVCache(2, 4, 16, 32, device=device), q, k, v, pos, [20, 1, 1, 28])
    ref = windowed_attention_reference(q.double(), k.double(), v.double(), pos, 16)
    assert (out.double() - ref).abs().max() < 1e-5


def test_gqa_head_h_reads_kv_head_h_div_group(device):
    # kv head j holds constant value j: query head h must read value h // group
    B, Hkv, group, W, D = 1, 3, 2, 4, 2
    cache = RingKVCache(B, Hkv, W, D, dtype=torch.float64, device=device)
    v = torch.arange(Hkv, dtype=torch.float64, device=device).view(1, Hkv, 1, 1).expand(B, Hkv, 5, D)
    q = torch.randn(B, Hkv * group, 5, D, dtype=torch.float64, device=device)
    k = torch.randn(B, Hkv, 5, D, dtype=torch.float64, device=device)
    out = cache.step(q, k, v.contiguous(), torch.arange(5, device=device)[None])
    want = (torch.arange(Hkv * group, device=device) // group).double()
    assert torch.allclose(out[0, :, :, 0], want[:, None].expand(-1, 5))


@pytest.mark.parametrize("T", [1, 5])
def test_masked_attention_empty_rows_given_or_found_agree(device, T):
    """Rows named in ``empty`` come out zero, exactly as when found from the mask; GQA of 3."""
    from ringviz.attention import masked_attention

    gen = torch.Generator().manual_seed(0)
    B, Hkv, G, Tk, D = 2, 2, 3, 7, 4
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64).to(device)
               for s in ((B, Hkv * G, T, D), (B, Hkv, Tk, D), (B, Hkv, Tk, D)))
    mask = torch.rand(B, T, Tk, generator=gen).to(device) < 0.6
    mask[:, :, 0] = True
    mask[1, T - 1] = False  # row 1's last query sees nothing
    empty = ~mask.any(dim=-1)  # (B, T)
    found = masked_attention(q, k, v, mask)
    given = masked_attention(q, k, v, mask, empty=empty)
    assert torch.equal(found, given)
    assert (given[1, :, T - 1] == 0).all()
    ref = torch.softmax((q @ k.repeat_interleave(G, 1).transpose(-1, -2)) / D ** 0.5
                        + torch.where(mask[:, None], 0.0, float("-inf")), dim=-1)
    ref = torch.nan_to_num(ref) @ v.repeat_interleave(G, 1)
    torch.testing.assert_close(given, ref, rtol=0, atol=1e-12)


def test_decode_writes_exactly_one_slot_per_row(device):
    B, W, D = 3, 8, 4
    q, k, v, pos = make_inputs(B, 2, 2, 20, D, device)
    cache = RingKVCache(B, 2, W, D, dtype=torch.float64, device=device)
    cache.step(q[:, :, :12], k[:, :, :12], v[:, :, :12], pos[:, :12])
    for t in range(12, 20):
        k_before, pos_before = cache.k.clone(), cache.positions.clone()
        cache.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], pos[:, t:t + 1])
        changed = (cache.k != k_before).any(dim=(1, 3))  # (B, W)
        assert changed.sum(dim=1).tolist() == [1] * B
        assert changed[:, t % W].all()
        assert (cache.positions != pos_before).sum() == B


def test_storage_never_reallocated_and_memory_flat(device):
    B, H, W, D = 2, 2, 8, 4
    cache = RingKVCache(B, H, W, D, device=device)
    ptrs, nbytes = (cache.k.data_ptr(), cache.v.data_ptr(), cache.positions.data_ptr()), cache.nbytes
    q, k, v, pos = make_inputs(B, H, H, 3 * W + 1, D, device, dtype=torch.float32)
    cache.step(q, k, v, pos)  # a prompt longer than the window
    one = torch.randn(B, H, 1, D, device=device)
    for t in range(3 * W + 1, 100_000 + 3 * W + 1):  # 100k decode steps, cache write only
        cache.write(one, one, torch.full((B, 1), t, device=device), check=False)
    assert (cache.k.data_ptr(), cache.v.data_ptr(), cache.positions.data_ptr()) == ptrs
    assert cache.nbytes == nbytes == 2 * B * H * (W + 1) * D * 4 + B * (W + 1) * 8  # + spare slot
    assert cache.positions.sort(dim=1).values.tolist() == [list(range(100_017, 100_025))] * B


def test_padding_takes_no_slot_and_all_padding_row_gives_zeros(device):
    q, k, v, pos = make_inputs(3, 2, 1, 6, 4, device, pad=[(0, 0), (6, 0), (2, 1)])
    cache = RingKVCache(3, 1, 4, 4, dtype=torch.float64, device=device)
    out = cache.step(q, k, v, pos)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all()  # a row that is all padding sees nothing: zeros, not NaN
    assert (out[2, :, :2] == 0).all() and (out[2, :, -1] == 0).all()
    assert cache.positions[1].tolist() == [-1] * 4
    assert sorted(p for p in cache.positions[2].tolist() if p >= 0) == [0, 1, 2]
    assert cache.kv_seqlens.tolist() == [4, 0, 3]
    decode = cache.step(q[:, :, :1], k[:, :, :1], v[:, :, :1],
                        torch.tensor([[6], [-1], [3]], device=device))
    assert (decode[1] == 0).all() and torch.isfinite(decode).all()
    assert cache.positions[1].tolist() == [-1] * 4


def test_garbage_in_padding_never_reaches_real_queries(device):
    q, k, v, pos = make_inputs(2, 2, 2, 9, 4, device, pad=[(3, 0), (0, 2)])
    pad = (pos < 0)[:, None, :, None]
    out = RingKVCache(2, 2, 4, 4, dtype=torch.float64, device=device).step(
        q.masked_fill(pad, float("nan")), k.masked_fill(pad, float("nan")),
        v.masked_fill(pad, float("inf")), pos)
    ref = windowed_attention_reference(q, k, v, pos, 4)
    assert torch.isfinite(out).all() and (out - ref).abs().max() < 1e-12


def test_rows_never_see_each_other(device):
    q, k, v, pos = make_inputs(2, 2, 2, 12, 4, device)
    a = run_chunks(RingKVCache(2, 2, 5, 4, dtype=torch.float64, device=device),
                   q, k, v, pos, [7, 1, 4])
    k2, v2 = k.clone(), v.clone()
    k2[1], v2[1] = torch.randn_like(k2[1]), torch.randn_like(v2[1])
    b = run_chunks(RingKVCache(2, 2, 5, 4, dtype=torch.float64, device=device),
                   q, k2, v2, pos, [7, 1, 4])
    assert torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])


def test_batch_of_one_equals_row_of_batch_of_eight(device):
    q, k, v, pos = make_inputs(8, 4, 2, 30, 8, device, pad=[(i, 0) for i in range(8)])
    batch = run_chunks(RingKVCache(8, 2, 6, 8, dtype=torch.float64, device=device),
                       q, k, v, pos, [10, 1, 19])
    for b in range(8):
        single = run_chunks(RingKVCache(1, 2, 6, 8, dtype=torch.float64, device=device),
                            q[b:b + 1], k[b:b + 1], v[b:b + 1], pos[b:b + 1], [10, 1, 19])
        assert (single[0] - batch[b]).abs().max() < 1e-12


def test_start_pointer_and_reset(device):
    cache = RingKVCache(1, 1, 4, 2, device=device)
    x = torch.zeros(1, 1, 6, 2, device=device)
    cache.step(x, x, x, torch.arange(6, device=device)[None])
    assert cache.start.tolist() == [2] and cache.kv_seqlens.tolist() == [4]
    ptr = cache.k.data_ptr()
    cache.reset()
    assert cache.positions.tolist() == [[-1] * 4] and cache.start.tolist() == [0]
    assert cache.k.data_ptr() == ptr
    cache.step(x, x, x, torch.arange(6, device=device)[None])  # positions may restart after reset


def test_attend_uses_stored_positions(device):
    q, k, v, pos = make_inputs(1, 2, 2, 10, 4, device)
    cache = RingKVCache(1, 2, 4, 4, dtype=torch.float64, device=device)
    full = cache.step(q, k, v, pos)
    again = cache.attend(q[:, :, -1:], pos[:, -1:])
    assert (again - full[:, :, -1:]).abs().max() < 1e-12


def test_int32_positions_accepted(device):
    cache = RingKVCache(1, 1, 3, 2, device=device)
    x = torch.zeros(1, 1, 2, 2, device=device)
    cache.step(x, x, x, torch.tensor([[0, 1]], dtype=torch.int32, device=device))
    assert cache.positions.dtype == torch.int64


# ---------------------------------------------------------------- bad input
def snapshot(cache) -> str:
    """sha256 over the bytes of every tensor the cache stores (spare slot included)."""
    digest = hashlib.sha256()
    for t in (cache._k_store, cache._v_store, cache._pos_store, cache._last_pos):
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def primed(device):
    cache = RingKVCache(2, 2, 4, 8, device=device)
    x = torch.randn(2, 2, 5, 8, device=device)
    cache.step(x, x, x, torch.arange(5, device=device).repeat(2, 1))
    return cache


def good(device, T=1, Hq=4, start=5):
    q = torch.randn(2, Hq, T, 8, device=device)
    kv = torch.randn(2, 2, T, 8, device=device)
    pos = torch.arange(start, start + T, device=device).repeat(2, 1)
    return q, kv, kv.clone(), pos


BAD = {
    "wrong k shape": (lambda q, k, v, p: (q, k[:, :1], v[:, :1], p), ValueError, "k must be"),
    "head_dim mismatch": (lambda q, k, v, p: (q, k[..., :4], v[..., :4], p), ValueError, "head_dim"),
    "Hq not multiple": (lambda q, k, v, p: (q[:, :3], k, v, p), ValueError, "not a positive multiple"),
    "zero query heads": (lambda q, k, v, p: (q[:, :0], k, v, p), ValueError, "Hq=0"),
    "q head_dim": (lambda q, k, v, p: (q[..., :4], k, v, p), ValueError, "q must be"),
    "k/v differ": (lambda q, k, v, p: (q, k, v[:, :, :0], p), ValueError, "v must be"),
    "positions shape": (lambda q, k, v, p: (q, k, v, p[:1]), ValueError, r"positions must be \(B, T\)"),
    "float positions": (lambda q, k, v, p: (q, k, v, p.float()), TypeError, "positions must be int"),
    "negative positions": (lambda q, k, v, p: (q, k, v, p - 10), ValueError, "-1 for padding"),
    "not after cache": (lambda q, k, v, p: (q, k, v, p - 2), ValueError, "not after the row's cached"),
    "dtype mismatch": (lambda q, k, v, p: (q, k.double(), v.double(), p), TypeError, "dtype"),
    "q dtype": (lambda q, k, v, p: (q.double(), k, v, p), TypeError, "q has dtype"),
    "not a tensor": (lambda q, k, v, p: (q, k.tolist(), v, p), TypeError, "must be a torch.Tensor"),
    "empty chunk": (lambda q, k, v, p: (q[:, :, :0], k[:, :, :0], v[:, :, :0], p[:, :0]), ValueError,
                    "T>=1"),
    # one token per row, each the decode loop's call but for one fault
    "q of two tokens": (lambda q, k, v, p: (q.repeat(1, 1, 2, 1), k, v, p), ValueError, "q must be"),
    "q of 3 dims": (lambda q, k, v, p: (q[:, :, 0], k, v, p), ValueError, "q must be"),
    "v dtype alone": (lambda q, k, v, p: (q, k, v.double(), p), TypeError, "v has dtype"),
    "1-D positions": (lambda q, k, v, p: (q, k, v, p[:, 0]), ValueError, r"positions must be \(B, T\)"),
    "int16 positions": (lambda q, k, v, p: (q, k, v, p.short()), TypeError, "positions must be int"),
    "k on meta": (lambda q, k, v, p: (q, k.to("meta"), v, p), ValueError, "k is on meta"),
    "q on meta": (lambda q, k, v, p: (q.to("meta"), k, v, p), ValueError, "q is on meta"),
    "positions on meta": (lambda q, k, v, p: (q, k, v, p.to("meta")), ValueError,
                          "positions is on meta"),
    "q not a tensor": (lambda q, k, v, p: (q.tolist(), k, v, p), TypeError, "q must be a torch"),
    "positions a list": (lambda q, k, v, p: (q, k, v, p.tolist()), TypeError,
                         "positions must be a torch"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_step_raises_and_changes_nothing(device, name):
    mutate, error, match = BAD[name]
    cache = primed(device)
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        cache.step(*mutate(*good(device)))
    assert snapshot(cache) == before


@pytest.mark.parametrize("name", list(BAD))
def test_the_decode_shortcut_takes_no_input_the_checks_refuse(device, name):
    """``_is_token`` (a decode loop's call, checked in one expression) turns away every bad
    call: the full checks then name the fault. A good call it accepts."""
    mutate, _, _ = BAD[name]
    cache = primed(device)
    q, k, v, p = mutate(*good(device))
    assert not cache._is_token(q, k, v, p) or name in ("negative positions", "not after cache")
    assert cache._is_token(*good(device)) and cache._is_token(None, *good(device)[1:])


def test_positions_not_strictly_increasing_within_row(device):
    cache = primed(device)
    before = snapshot(cache)
    q, k, v, _ = good(device, T=3)
    pos = torch.tensor([[5, 7, 6], [5, 6, 7]], device=device)
    with pytest.raises(ValueError, match="row 0: positions must strictly increase"):
        cache.step(q, k, v, pos)
    assert snapshot(cache) == before


BAD_SCALES = [("0.5", TypeError), (torch.tensor(0.5), TypeError), (True, TypeError),
              (math.nan, ValueError), (math.inf, ValueError), (0.0, ValueError), (-0.5, ValueError)]


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize(("scale", "error"), BAD_SCALES)
def test_bad_scale_rejected_before_any_write(device, T, scale, error):
    cache = primed(device)
    before = snapshot(cache)
    q, k, v, pos = good(device, T=T)
    for call in (lambda: cache.step(q, k, v, pos, scale=scale),
                 lambda: cache.step(q, k, v, pos, scale=scale, check=False),
                 lambda: cache.attend(q, pos, scale=scale)):
        with pytest.raises(error, match="scale"):
            call()
        assert snapshot(cache) == before
    cache.step(q, k, v, pos, scale=0.5)  # the corrected retry is accepted
    assert int(cache._last_pos.max()) == 5 + T - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_mismatch_rejected():
    cache = RingKVCache(1, 1, 4, 2, device="cuda")
    x = torch.zeros(1, 1, 1, 2)
    with pytest.raises(ValueError, match="is on cpu"):
        cache.step(x, x, x, torch.zeros(1, 1, dtype=torch.int64))


@pytest.mark.parametrize(("args", "kwargs", "error"), [
    ((1, 1, 0, 4), {}, ValueError),
    ((1, 1, -2, 4), {}, ValueError),
    ((0, 1, 4, 4), {}, ValueError),
    ((1, 1.0, 4, 4), {}, TypeError),
    ((1, 1, 4, 4), {"dtype": torch.int64}, TypeError),
])
def test_bad_construction(args, kwargs, error):
    with pytest.raises(error):
        RingKVCache(*args, **kwargs)


@pytest.mark.parametrize("capacity", [None, 9])
def test_decode_mask_shortcut_equals_the_band_mask(device, capacity):
    """The decode step's one-comparison mask is the full rule, padding rows and spare slots too."""
    cache = RingKVCache(3, 1, 6, 2, capacity=capacity, device=device)
    g = torch.Generator().manual_seed(7)
    nxt = [0, 0, 0]
    for _ in range(25):
        pos = torch.tensor([[p if torch.rand(1, generator=g) < 0.8 else -1] for p in nxt],
                           device=device)
        x = torch.zeros(3, 1, 1, 2, device=device)
        cache.step(x, x, x, pos)
        nxt = [p + 1 if int(q) >= 0 else p for p, q in zip(nxt, pos[:, 0])]
        assert torch.equal(cache._decode_mask(pos), cache._mask(pos, cache.positions))


def test_take_rows_reorders_repeats_and_refuses_bad_indices():
    from ringviz.cache import RingKVCache

    torch.manual_seed(0)
    cache = RingKVCache(3, 1, window=4, head_dim=2, sinks=1)
    k = torch.randn(3, 1, 7, 2)
    pos = torch.arange(7).expand(3, 7).clone()
    pos[2, :3] = -1  # row 2 left-padded
    cache.write(k, k, pos)
    before = cache.k.clone(), cache.positions.clone(), cache.lengths.clone()
    for bad in (torch.tensor([0, 3]), torch.tensor([[0]]), torch.tensor([0.0]),
                torch.tensor([True, False, True])):
        with pytest.raises(ValueError, match="index"):
            cache.take_rows(bad)
    assert torch.equal(cache.k, before[0]) and torch.equal(cache.positions, before[1])
    address = cache.k.data_ptr()
    cache.take_rows(torch.tensor([2, 0, 0]))  # same length: in place
    assert cache.k.data_ptr() == address
    assert torch.equal(cache.positions, before[1][[2, 0, 0]])
    assert torch.equal(cache.lengths, before[2][[2, 0, 0]])
    cache.take_rows(torch.tensor([0, 1, 1, 2, 0]))
    assert cache.batch_size == 5 and cache.k.shape[0] == 5
    assert torch.equal(cache.k, before[0][[2, 0, 0, 0, 2]])
    cache.write(k[:1, :, :1].expand(5, 1, 1, 2), k[:1, :, :1].expand(5, 1, 1, 2),
                cache.lengths[:, None])  # the next token of every row still writes
