"""Speculative decoding against a ring: the naive engine's failure, measured, and both fixes exact.

Also RingKVCache's two additions for it: ``capacity`` and ``truncate``.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringviz import RingKVCache, windowed_attention_reference
from ringviz.book.speculative import (
    CommitAcceptedRing,
    OverwritingRing,
    SpareSlotsRing,
    missing_positions,
    simulate,
)

FIXES = [SpareSlotsRing, CommitAcceptedRing]
EXACT = 1e-12  # float64 rounding is ~1e-16
WRONG = 1e-2  # a lost key moves outputs by O(0.1..1) on unit-variance data


def ring_of(cls, B=1, Hkv=1, W=8, D=16, k=4, device="cpu", **kwargs):
    return cls(B, Hkv, W, D, k, dtype=torch.float64, device=device, **kwargs)


def random_schedule(gen, cycles, B, k, low=1):
    return [torch.randint(low, k + 2, (B,), generator=gen).tolist() for _ in range(cycles)]


# ---------------------------------------------------------------- the failure, measured
@pytest.mark.parametrize("accepted", [1, 2, 3, 4, 5])
def test_naive_ring_loses_exactly_the_keys_rejected_drafts_overwrote(accepted):
    # prompt 0..10 in 8 slots holds 3..10; the chunk 11..15 takes the slots of 3..7; the next
    # query, at 11 + m, needs 11 + m - 7 .. on: the rejected tokens 12 + m .. 15 took them
    W, k, n = 8, 4, 11
    cycles = simulate(ring_of(OverwritingRing, W=W, k=k), [[accepted], [1]], prompt=n,
                      n_heads=2)
    assert cycles[0].error < EXACT  # the verify pass itself is right: the damage comes after
    lost = list(range(n + accepted + 1 - W, n + k + 1 - W))
    assert cycles[0].missing == [lost]
    assert len(lost) == max(0, k - accepted)  # every rejected token after the first
    if lost:
        assert cycles[1].error > WRONG
    else:
        assert cycles[1].error < EXACT


def test_naive_ring_is_exact_with_one_draft_token():
    # k = 1 and the target's own token always kept: at most one token is rejected, and it
    # overwrote the slot of a position that had just left the window
    gen = torch.Generator().manual_seed(1)
    ring = ring_of(OverwritingRing, B=3, Hkv=2, k=1)
    cycles = simulate(ring, random_schedule(gen, 30, 3, 1), prompt=13, n_heads=6)
    assert max(c.error for c in cycles) < EXACT
    assert all(m == [] for c in cycles for m in c.missing)
    # rejecting both tokens of the chunk is one too many for a ring of W slots
    cycles = simulate(ring_of(OverwritingRing, k=1), [[0], [1]], prompt=13, n_heads=1)
    assert cycles[0].missing == [[14 - 8]]  # 14 took the slot of 6 and cycles[1].error > WRONG


def test_naive_ring_with_many_drafts_goes_wrong_and_says_where():
    gen = torch.Generator().manual_seed(2)
    schedule = random_schedule(gen, 30, 2, 4)
    cycles = simulate(ring_of(OverwritingRing, B=2, Hkv=2), schedule, prompt=11, n_heads=4)
    wrong = [c.error > WRONG for c in cycles[1:]]
    holes = [any(c.missing) for c in cycles[:-1]]
    assert any(wrong) and wrong == holes  # a cycle is wrong exactly after a lost key


def test_naive_ring_without_rollback_attends_to_rejected_keys():
    # not forgetting rejected tokens is wrong even with one draft token: the chunk's first
    # query sees the rejected key at its own position beside the new one
    cycles = simulate(ring_of(OverwritingRing, k=1, rollback=False), [[1], [2], [2]],
                      prompt=9, n_heads=2)
    assert cycles[0].error < EXACT and cycles[1].error > WRONG
    kept_all = simulate(ring_of(OverwritingRing, k=3, rollback=False), [[4]] * 5, prompt=9,
                        n_heads=2)
    assert max(c.error for c in kept_all) < EXACT  # nothing rejected, nothing wrong


def test_the_package_refuses_the_naive_rollback():
    ring = ring_of(OverwritingRing)
    simulate(ring, [], prompt=11, n_heads=2)
    x = torch.zeros(1, 1, 5, 16, dtype=torch.float64)
    ring.verify(x, x, x, torch.arange(11, 16)[None])
    before = ring.cache.positions.clone()
    with pytest.raises(ValueError, match=r"leaves out position\(s\) \[5, 6, 7\].*at most 1 "):
        ring.cache.truncate(torch.tensor([12]))
    assert torch.equal(ring.cache.positions, before)


# ---------------------------------------------------------------- both fixes, exact
@pytest.mark.parametrize("cls", FIXES)
def test_fix_is_exact_for_ragged_acceptance_and_gqa(device, cls):
    gen = torch.Generator().manual_seed(3)
    ring = ring_of(cls, B=3, Hkv=2, k=5, device=device)
    cycles = simulate(ring, random_schedule(gen, 25, 3, 5, low=0), prompt=17, n_heads=6)
    assert max(c.error for c in cycles) < EXACT
    assert all(m == [] for c in cycles for m in c.missing)
    assert len({tuple(c.accepted) for c in cycles}) > 1  # rows really differ
    assert ring.lengths.tolist() == [17 + sum(c.accepted[b] for c in cycles) for b in range(3)]


def test_fixes_cost_what_they_claim():
    W, k = 8, 4
    plain = RingKVCache(1, 1, W, 16, dtype=torch.float64).nbytes
    assert ring_of(CommitAcceptedRing, W=W, k=k).nbytes == plain
    assert ring_of(SpareSlotsRing, W=W, k=k).nbytes == plain * (W + k + 1) // (W + 1)


@st.composite
def cases(draw):
    window, k = draw(st.integers(1, 7)), draw(st.integers(1, 5))
    B, Hkv, group = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2])), draw(
        st.sampled_from([1, 3]))
    prompt = draw(st.integers(1, 15))
    schedule = draw(st.lists(st.lists(st.integers(0, k + 1), min_size=B, max_size=B),
                             min_size=1, max_size=12))
    return window, k, B, Hkv, group, prompt, schedule, draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(cases())
def test_any_schedule_fixes_exact_naive_wrong_only_after_a_lost_key(case):
    window, k, B, Hkv, group, prompt, schedule, seed = case
    for cls in FIXES:
        ring = cls(B, Hkv, window, 4, k, dtype=torch.float64)
        cycles = simulate(ring, schedule, prompt=prompt, n_heads=Hkv * group, seed=seed)
        assert max(c.error for c in cycles) < EXACT, cls.__name__
    naive = OverwritingRing(B, Hkv, window, 4, k, dtype=torch.float64)
    cycles = simulate(naive, schedule, prompt=prompt, n_heads=Hkv * group, seed=seed)
    assert cycles[0].error < EXACT
    for before, after in zip(cycles, cycles[1:]):
        if not any(before.missing):
            assert after.error < EXACT


# ---------------------------------------------------------------- RingKVCache additions
def test_spare_capacity_changes_no_output():
    L, D, W = 30, 8, 5
    q, k, v = (torch.randn(2, h, L, D, dtype=torch.float64) for h in (4, 2, 2))
    pos = torch.arange(L).expand(2, L)
    cache = RingKVCache(2, 2, W, D, capacity=W + 3, dtype=torch.float64)
    outs, s = [], 0
    for n in [7, 1, 1, 4, 12, 1, 4]:
        outs.append(cache.step(q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n],
                               pos[:, s:s + n]))
        s += n
    ref = windowed_attention_reference(q, k, v, pos, W)
    assert (torch.cat(outs, 2) - ref).abs().max() < EXACT
    assert sorted(cache.positions[0].tolist()) == list(range(L - W - 3, L))


@pytest.mark.parametrize("spare", [0, 1, 3])
def test_truncate_takes_back_spare_plus_one_tokens(spare):
    W, n = 6, 20
    for back in range(1, spare + 4):
        cache = RingKVCache(1, 1, W, 2, capacity=W + spare)
        x = torch.zeros(1, 1, n, 2)
        cache.step(x, x, x, torch.arange(n)[None])
        if back <= spare + 1:
            cache.truncate(torch.tensor([n - back]))
            assert sorted(p for p in cache.positions[0].tolist() if p >= 0) == \
                list(range(n - W - spare, n - back))
            y = x[:, :, :1]  # the row continues at the truncated length
            cache.step(y, y, y, torch.tensor([[n - back]]))
        else:
            before = cache.positions.clone()
            with pytest.raises(ValueError, match="leaves out"):
                cache.truncate(torch.tensor([n - back]))
            assert torch.equal(cache.positions, before)


def test_truncate_twice_still_sees_the_first_loss():
    # 9 takes the slot of 5 and 8 that of 4: taking back 9, then 8, leaves 5 missing
    cache = RingKVCache(1, 1, 4, 2)
    x = torch.zeros(1, 1, 10, 2)
    cache.step(x, x, x, torch.arange(10)[None])
    cache.truncate(torch.tensor([9]))
    with pytest.raises(ValueError, match=r"\[5\]"):
        cache.truncate(torch.tensor([8]))


@pytest.mark.parametrize("lengths, error, match", [
    ([3], ValueError, "cannot truncate to 3 positions; it has seen 2"),
    ([-1], ValueError, "cannot truncate to -1"),
    ([1, 1], ValueError, "shape"),
    ([1.0], ValueError, "int64 or int32"),
    ("1", TypeError, "must be a torch.Tensor"),
])
def test_bad_truncate_raises_and_changes_nothing(lengths, error, match):
    cache = RingKVCache(1, 1, 4, 2)
    x = torch.zeros(1, 1, 2, 2)
    cache.step(x, x, x, torch.arange(2)[None])
    before = cache.positions.clone()
    with pytest.raises(error, match=match):
        cache.truncate(torch.tensor(lengths) if isinstance(lengths, list) else lengths)
    assert torch.equal(cache.positions, before)
    cache.step(x[:, :, :1], x[:, :, :1], x[:, :, :1], torch.tensor([[2]]))  # still at 2


def test_bad_capacity():
    with pytest.raises(ValueError, match="capacity must be >= 4"):
        RingKVCache(1, 1, 4, 2, capacity=3)
    with pytest.raises(TypeError, match="capacity must be an int"):
        RingKVCache(1, 1, 4, 2, capacity=4.0)


# ---------------------------------------------------------------- bad input
def chunk(T, start, B=1, H=1, D=16):
    x = torch.zeros(B, H, T, D, dtype=torch.float64)
    return x, x, x, (start + torch.arange(T)).expand(B, T).clone()


def state(ring):
    return (ring.cache.positions.clone(), ring.cache.k.clone(), ring.lengths.clone(),
            ring._pending is None)


@pytest.mark.parametrize("cls", [OverwritingRing, *FIXES])
@pytest.mark.parametrize("case, error, match", [
    ("too long", ValueError, "at most max_draft \\+ 1 = 5 tokens, got 6"),
    ("gap", ValueError, "row 0: positions must continue the row's sequence at 11"),
    ("repeat", ValueError, "row 0: positions must continue"),
    ("q dtype", ValueError, "q must be torch.float64"),
    ("q heads", ValueError, "Hq = a multiple of 1"),
    ("positions float", ValueError, "positions must be int64 or int32"),
    ("k list", TypeError, "k must be a torch.Tensor"),
])
def test_bad_verify_raises_and_changes_nothing(cls, case, error, match):
    ring = ring_of(cls)
    simulate(ring, [], prompt=11, n_heads=1)
    q, k, v, pos = chunk(5, 11)
    if case == "too long":
        q, k, v, pos = chunk(6, 11)
    elif case == "gap":
        pos = pos + 1
    elif case == "repeat":
        pos[0, 2] = 12
    elif case == "q dtype":
        q = q.float()
    elif case == "q heads":
        q = torch.zeros(1, 0, 5, 16, dtype=torch.float64)
    elif case == "positions float":
        pos = pos.double()
    elif case == "k list":
        k = k.tolist()
    before = state(ring)
    with pytest.raises(error, match=match):
        ring.verify(q, k, v, pos)
    after = state(ring)
    assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b
               for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("cls", [OverwritingRing, *FIXES])
def test_bad_commit_and_call_order(cls):
    ring = ring_of(cls, B=2)
    q, k, v, pos = chunk(11, 0, B=2)
    ring.prefill(q, k, v, pos)
    with pytest.raises(ValueError, match="commit\\(\\) needs a verify\\(\\) first"):
        ring.commit(torch.tensor([1, 1]))
    ring.verify(*chunk(5, 11, B=2))
    before = state(ring)
    for bad, error, match in [
        (torch.tensor([1, 6]), ValueError, r"accepted must lie in 0 .. .*\[5, 5\]"),
        (torch.tensor([-1, 0]), ValueError, "accepted must lie"),
        (torch.tensor([1]), ValueError, r"shape \(B,\) = \(2,\)"),
        (torch.tensor([1.0, 1.0]), ValueError, "int64 or int32"),
        ([1, 1], TypeError, "accepted must be a torch.Tensor"),
    ]:
        with pytest.raises(error, match=match):
            ring.commit(bad)
        assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b
                   for a, b in zip(before, state(ring), strict=True))
    with pytest.raises(ValueError, match="commit\\(\\) the verified chunk before"):
        ring.verify(*chunk(5, 11, B=2))
    ring.commit(torch.tensor([2, 5]))
    assert ring.lengths.tolist() == [13, 16]
    ring.verify(*chunk(1, 13, B=2)[:3], torch.tensor([[13], [16]]))  # rows apart now


@pytest.mark.parametrize("kwargs, error", [
    (dict(max_draft=0), ValueError), (dict(max_draft=2.0), TypeError),
    (dict(window=0), ValueError),
])
def test_bad_construction(kwargs, error):
    args = dict(batch_size=1, num_kv_heads=1, window=4, head_dim=2, max_draft=2) | kwargs
    for cls in [OverwritingRing, *FIXES]:
        with pytest.raises(error):
            cls(**args)


def test_simulate_rejects_bad_schedules():
    ring = ring_of(SpareSlotsRing, B=2)
    with pytest.raises(ValueError, match="one accepted count per row \\(2\\)"):
        simulate(ring, [[1]], prompt=4, n_heads=1)
    with pytest.raises(ValueError, match="n_heads=3 is not a multiple of 2"):
        simulate(ring_of(SpareSlotsRing, Hkv=2), [[1]], prompt=4, n_heads=3)
    assert missing_positions(ring) == [[], []] and ring.lengths.tolist() == [0, 0]
