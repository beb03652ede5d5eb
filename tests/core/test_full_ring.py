"""A full ring's decode step needs no mask: the fast path equals the masked one, bit for bit.

Once every row holds its last W positions (no sinks, no spare slots) and a decode step writes
every row's next position, each stored key is inside each query's window, so
``RingKVCache.step`` attends over the raw ring without a mask. These tests drive random
schedules through a cache and through a twin that always takes the masked path, and compare
every output and the whole stored state after every call; they check that the fast path is
taken exactly when the rows are full, and that deciding it reads nothing back from the device.
"""

import random

import pytest
import torch
from host_reads import HostReads
from ring_state import MaskedRing, ring_tensors
from torch.utils._python_dispatch import TorchDispatchMode

from ringviz import RingKVCache
from ringviz.rope import apply_rope


def assert_same(out, ref_out, cache, ref) -> None:
    if out.device.type == "cpu":  # CPU SDPA: an all-True mask and no mask give the same bits
        assert torch.equal(out, ref_out)
    else:  # another kernel may run without a mask: equal to rounding
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for a, b in zip(ring_tensors(cache), ring_tensors(ref), strict=True):
        assert torch.equal(a, b)


def held_window(history: list[int], window: int) -> bool:
    """True if a row that wrote ``history`` holds exactly its last ``window`` positions,
    consecutive (what lets its next query see every stored key)."""
    return len(history) >= window and history[-1] - history[-window] == window - 1


def random_schedule(rng: random.Random, B: int, window: int, steps: int, *, trusted: bool):
    """Calls as (positions rows, check, contiguous): mostly decode, some chunks, padding,
    gaps, rows that start late (so they become full at different steps)."""
    nxt = [0 if rng.random() < 0.5 else -rng.randint(1, 2 * window) for _ in range(B)]
    calls = []
    for _ in range(steps):
        T = 1 if rng.random() < 0.8 else rng.randint(2, 2 * window + 1)
        rows = []
        for b in range(B):
            row = []
            for _ in range(T):
                if nxt[b] < 0 or rng.random() < 0.04:  # not started yet, or padding
                    nxt[b] += nxt[b] < 0
                    row.append(-1)
                    continue
                if rng.random() < 0.03:  # a gap: positions may jump
                    nxt[b] += rng.randint(1, window)
                row.append(nxt[b])
                nxt[b] += 1
            rows.append(row)
        check = not trusted or rng.random() < 0.5
        calls.append((rows, check, not check and rng.random() < 0.5))
    return calls


def run(device, *, B, Hkv, G, window, capacity, sinks, sink_rope, calls, seed):
    """Drive ``calls`` through a ring and its masked twin; return how many decode steps took
    the fast path and the steps at which every row held its window (the model's view)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    kw = {"sinks": sinks, "sink_rope": sink_rope, "capacity": capacity,
          "dtype": torch.float64, "device": device}
    cache = RingKVCache(B, Hkv, window, 8, **kw)
    ref = MaskedRing(B, Hkv, window, 8, **kw)
    history = [[] for _ in range(B)]
    fast, expected = [], []
    for i, (rows, check, contiguous) in enumerate(calls):
        T = len(rows[0])
        pos = torch.tensor(rows, device=device)
        q, k, v = (torch.randn(B, h, T, 8, generator=gen, dtype=torch.float64).to(device)
                   for h in (Hkv * G, Hkv, Hkv))
        is_next = all(r[0] == (h[-1] + 1 if h else 0) for r, h in zip(rows, history,
                                                                           strict=True))
        vouched = contiguous and is_next and T == 1
        out = cache.step(q, k, v, pos, check=check, contiguous=vouched)
        ref_out = ref.step(q, k, v, pos)
        assert_same(out, ref_out, cache, ref)
        for h, r in zip(history, rows, strict=True):
            h.extend(p for p in r if p >= 0)
        if T == 1:
            took = is_next and (check or vouched) and cache.window_full
            fast.append(i) if took else None
            full = (not sinks and capacity in (None, window) and is_next
                    and all(held_window(h, window) for h in history))
            assert not took or full  # sound: never without every key in the window
            expected.append(i) if full else None
    return fast, expected


@pytest.mark.parametrize("seed", range(40))
def test_random_validated_schedules_equal_the_masked_path_and_go_fast_when_full(device, seed):
    """Validated calls only: the fast path is taken at exactly the steps where every row's
    ring holds its last W positions (the cache learns it in validation's one sync)."""
    rng = random.Random(seed)
    B, window = rng.randint(1, 4), rng.randint(1, 6)
    Hkv, G = rng.choice([(1, 1), (2, 1), (1, 3), (2, 2)])
    calls = random_schedule(rng, B, window, rng.randint(10, 60), trusted=False)
    fast, expected = run(device, B=B, Hkv=Hkv, G=G, window=window, capacity=None, sinks=0,
                         sink_rope=None, calls=calls, seed=seed)
    assert fast == expected


@pytest.mark.parametrize("seed", range(40))
def test_random_trusted_schedules_equal_the_masked_path(device, seed):
    """Trusted calls mixed in (check=False, with and without contiguous=True): outputs and
    state equal the masked path's, and the fast path is never taken unless every row is full."""
    rng = random.Random(1000 + seed)
    B, window = rng.randint(1, 4), rng.randint(1, 6)
    calls = random_schedule(rng, B, window, rng.randint(10, 60), trusted=True)
    run(device, B=B, Hkv=2, G=2, window=window, capacity=None, sinks=0, sink_rope=None,
        calls=calls, seed=seed)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kind", ["spare", "sinks", "sinks_rope"])
def test_spare_slots_and_sinks_always_take_the_masked_path(device, seed, kind):
    """A spare slot holds a key that has left the window, a sink a key outside it: masked."""
    rng = random.Random(2000 + seed)
    B, window = rng.randint(1, 3), rng.randint(1, 5)
    calls = random_schedule(rng, B, window, 40, trusted=False)
    fast, _ = run(device, B=B, Hkv=1, G=2, window=window,
                  capacity=window + rng.randint(1, 2) if kind == "spare" else None,
                  sinks=0 if kind == "spare" else rng.randint(1, 2),
                  sink_rope=apply_rope if kind == "sinks_rope" else None,
                  calls=calls, seed=seed)
    assert fast == []


def test_ragged_rows_go_fast_when_the_last_row_is_full(device):
    """Row 1 starts 3 steps late: no fast step until its ring is full too."""
    W = 4
    cache = RingKVCache(2, 1, W, 8, dtype=torch.float64, device=device)
    x = torch.zeros(2, 1, 1, 8, dtype=torch.float64, device=device)
    full_at = []
    for step in range(12):
        pos = torch.tensor([[step], [step - 3 if step >= 3 else -1]], device=device)
        cache.step(x, x, x, pos)
        full_at.append(cache.window_full)
    # row 0 holds 0..3 after step 3, row 1 holds 0..3 after step 6
    assert full_at == [False] * 6 + [True] * 6


def test_padding_gap_truncate_and_reset_leave_the_fast_path(device):
    W = 3
    cache = RingKVCache(1, 1, W, 4, device=device)
    x = torch.zeros(1, 1, 1, 4, device=device)

    def step(p):
        cache.step(x, x, x, torch.tensor([[p]], device=device))
        return cache.window_full

    assert [step(p) for p in range(4)] == [False, False, True, True]
    assert step(-1)  # padding takes no slot: the ring still holds 1, 2, 3
    assert not step(5) and not step(6) and step(7)  # a gap: full again W steps later
    cache.truncate(torch.tensor([8], device=device))  # keeps everything, but unknown on host
    assert not cache.window_full
    assert not step(8) and not step(9) and step(10)
    cache.reset()
    assert not cache.window_full


def test_contiguous_is_checked_when_validating(device):
    cache = RingKVCache(1, 1, 2, 4, device=device)
    x = torch.zeros(1, 1, 1, 4, device=device)
    cache.step(x, x, x, torch.tensor([[0]], device=device), contiguous=True)
    before = [t.clone() for t in ring_tensors(cache)]
    with pytest.raises(ValueError, match="contiguous=True"):
        cache.step(x, x, x, torch.tensor([[2]], device=device), contiguous=True)
    assert all(torch.equal(a, b) for a, b in zip(ring_tensors(cache), before, strict=True))


def full_ring(B=2, W=16):
    cache = RingKVCache(B, 2, W, 8)
    x = torch.randn(B, 2, W, 8)
    cache.step(torch.randn(B, 4, W, 8), x, x, torch.arange(W).repeat(B, 1))
    return cache, torch.full((B, 1), W - 1)


def recorded_steps(cache, pos, record, steps, **step_kwargs):
    """``steps`` decode steps of ``full_ring``'s cache at the next positions (``pos`` advanced
    in place), each under a fresh ``record()`` dispatch mode, yielded once the step is done."""
    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8)
    for _ in range(steps):
        pos += 1
        with record() as mode:
            cache.step(q, k, k, pos, **step_kwargs)
        yield mode


@pytest.mark.parametrize("check", [True, False])
def test_decode_step_reads_back_what_it_did_before(check):
    """A full ring's decode step reads one value back (validation) or none (trusted): the
    fast path adds no host read to either."""
    cache, pos = full_ring()
    reads = []
    for mode in recorded_steps(cache, pos, HostReads, 3, check=check, contiguous=not check):
        reads.append(mode.count)
        assert cache.window_full
    assert reads == [1 if check else 0] * 3


def test_window_full_in_a_trusted_loop_needs_contiguous():
    """Without contiguous=True a trusted call could have written anything: masked again."""
    cache, pos = full_ring()
    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8)
    pos += 1
    cache.step(q, k, k, pos, check=False)
    assert not cache.window_full


class Ops(TorchDispatchMode):
    """Records each op with its non-tensor arguments (a slot picked on the host shows)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        plain = tuple(a for a in args if not isinstance(a, torch.Tensor | list))
        self.calls.append((func, plain))
        return func(*args, **(kwargs or {}))


def test_a_captured_trusted_decode_step_is_one_op_sequence_for_any_position(monkeypatch):
    """A trusted step (check=False, contiguous=True) captured in a CUDA graph runs the same
    ops with the same non-tensor arguments whatever the positions, so no slot picked on the
    host is baked in; it then forgets each row's newest,
    so the eager steps after it (replays advanced the rows unseen) pick their slots on the
    device too, until a validated step reads them again. (A CPU test: capture is simulated.)"""
    cache, pos = full_ring()
    list(recorded_steps(cache, pos, Ops, 1))  # validated: the host knows each row's newest
    monkeypatch.setattr(RingKVCache, "_capturing", lambda self: True)
    seen = [m.calls for m in recorded_steps(cache, pos, Ops, 2, check=False, contiguous=True)]
    monkeypatch.undo()
    seen += [m.calls for m in recorded_steps(cache, pos, Ops, 2, check=False, contiguous=True)]
    assert seen[0] == seen[1] == seen[2] == seen[3]
    assert cache.window_full  # the runs still grew


def test_a_trusted_loop_after_validation_writes_host_slots_and_stays_exact():
    """Run eagerly, the trusted loop keeps each row's newest on the host from the last
    validated step (+1 per vouched token), so it writes one slot known on the host, as the
    validated step does (narrow's start differs step to step), with the same state."""
    torch.manual_seed(0)
    cache, pos = full_ring()
    list(recorded_steps(cache, pos, Ops, 1))
    trusted = [m.calls for m in recorded_steps(cache, pos, Ops, 3, check=False, contiguous=True)]
    torch.manual_seed(0)
    ref, ref_pos = full_ring()
    list(recorded_steps(ref, ref_pos, Ops, 1))
    validated = [m.calls for m in recorded_steps(ref, ref_pos, Ops, 3)]
    assert trusted[0] != trusted[1] and validated[0] != validated[1]
    for a, b in zip(ring_tensors(cache), ring_tensors(ref), strict=True):
        assert torch.equal(a, b)
