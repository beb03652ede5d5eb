"""A ring survives pickle exactly, and refuses storage its device cannot hold, before
allocating any (a huge window would otherwise be zero-filled until the process is killed)."""

import copy
import io
import os
import pickle

import pytest
import torch

from ringviz import RingKVCache
from ringviz.cache import storage_bytes
from ringviz.rope import apply_rope

B, H, D, W = 2, 2, 4, 5


def drive(cache: RingKVCache, start: int, steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(steps):
        q, k, v = (torch.randn(B, h, 1, D, generator=gen) for h in (2 * H, H, H))
        outs.append(cache.step(q, k, v, torch.full((B, 1), start + i)))
    return outs


def pickled(cache):
    return pickle.loads(pickle.dumps(cache))


def saved(cache):
    buf = io.BytesIO()
    torch.save(cache, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("copier", [pickled, copy.deepcopy, saved],
                         ids=["pickle", "deepcopy", "torch.save"])
@pytest.mark.parametrize("kwargs", [{}, {"sinks": 1, "sink_rope": apply_rope},
                                    {"capacity": W + 2}], ids=["plain", "sinks", "draft"])
def test_a_copied_ring_continues_bit_for_bit(copier, kwargs):
    cache = RingKVCache(B, H, W, D, **kwargs)
    drive(cache, 0, 7, seed=0)  # wrapped: the ring is full and known to be
    twin = copier(cache)
    assert twin.k.data_ptr() == twin._k_store.data_ptr()  # views on its own storage
    assert twin.positions.data_ptr() == twin._pos_store.data_ptr()
    ours, theirs = drive(cache, 7, 9, seed=1), drive(twin, 7, 9, seed=1)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    for a, b in zip((cache._k_store, cache._v_store, cache._pos_store, cache._last_pos),
                    (twin._k_store, twin._v_store, twin._pos_store, twin._last_pos),
                    strict=True):
        assert torch.equal(a, b)


def physical_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_storage_bytes_is_what_the_ring_allocates():
    cache = RingKVCache(3, 2, 5, 4, sinks=2, capacity=7, dtype=torch.float16)
    assert cache.nbytes == storage_bytes(3, 2, 2 + 7, 4, torch.float16)


@pytest.mark.parametrize("kwargs", [{"window": None}, {"window": 4, "sinks": None},
                                    {"window": 4, "capacity": None}],
                         ids=["window", "sinks", "capacity"])
def test_storage_larger_than_the_machine_is_refused_before_allocating(kwargs, monkeypatch):
    """Slots one past what physical memory holds (16 bytes a slot at head_dim 1, float32)."""
    slots = physical_bytes() // 16 + 1
    kwargs = {k: slots if v is None else v for k, v in kwargs.items()}
    made = []
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: made.append(a))  # nothing allocated
    with pytest.raises(ValueError, match=r"GiB of storage, more than the cpu's .* physical"):
        RingKVCache(1, 1, head_dim=1, **kwargs)
    assert not made


def test_the_issue_window_says_what_it_needs():
    """``RingKVCache(1, 1, 2**31, 1)``: 2**31 + 1 slots of 16 bytes, 32 GiB."""
    if physical_bytes() >= 32 * 2**30:
        pytest.skip("this machine could hold it")
    with pytest.raises(ValueError, match=r"RingKVCache\(batch_size=1.*needs 32\.0 GiB"):
        RingKVCache(1, 1, 2**31, 1)


def test_take_rows_past_the_machine_is_refused_and_changes_nothing():
    cache = RingKVCache(1, 1, 2**20, 1)
    rows = physical_bytes() // cache.nbytes + 1
    before = cache.nbytes
    with pytest.raises(ValueError, match="take_rows"):
        cache.take_rows(torch.zeros(rows, dtype=torch.int64))
    assert cache.batch_size == 1 and cache.nbytes == before


def test_meta_device_is_refused_at_construction():
    with pytest.raises(ValueError, match="meta"):
        RingKVCache(1, 1, 4, 2, device="meta")
