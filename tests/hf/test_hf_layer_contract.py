"""ringviz.hf's cache layers keep transformers' layer contract where a ring can keep it.

Modelled on what transformers' own cache tests check (``tests/utils/test_cache_utils.py``):
a layer's ``update`` stores the new tokens and returns what the layer attends over; its
``get_mask_sizes`` says where those keys start; the attributes HF reads are there; a layer
inside HF's own ``DynamicCache`` generates what HF's own layers generate; rollback
(``activate_past_recording``, ``crop``) is served or refused before anything changes;
``offload``/``prefetch`` work or are refused clearly; ``RingCache(config)`` works without
the model. What a ring cannot keep, keys in temporal order in ``layer.keys``, is checked as
documented: slot order, with ``layer.positions`` beside them.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import max_score_diff, prompt, run, tiny_gemma, tiny_mistral  # noqa: E402
from transformers.cache_utils import (  # noqa: E402
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
)

from ringviz import hf  # noqa: E402

CHUNKS = [3, 1, 1, 4, 1, 1, 1, 7, 1, 2, 1]  # a prompt, decode steps, chunks past the window


def kv(T: int, start: int, B: int = 2, H: int = 2, D: int = 4) -> tuple[torch.Tensor, ...]:
    """Keys and values of ``T`` tokens whose every entry says its column (``start + t``)."""
    col = torch.arange(start, start + T, dtype=torch.float64)[None, None, :, None]
    k = col.expand(B, H, T, D) + torch.arange(B, dtype=torch.float64)[:, None, None, None] / 10
    return k.contiguous(), (-k).contiguous()


# ------------------------------------------------------------------------- update
@pytest.mark.parametrize("draft", [0, 3])
def test_ring_layer_update_returns_what_hf_sliding_layer_returns(draft):
    """Chunk after chunk past several wraps: the same keys and values, in the same (temporal)
    order, the same mask sizes and lengths as DynamicSlidingWindowLayer's."""
    W = 5
    ring, ref = hf.RingLayer(W, draft=draft), DynamicSlidingWindowLayer(sliding_window=W)
    seen = 0
    for T in CHUNKS:
        assert ring.get_mask_sizes(T) == ref.get_mask_sizes(T)
        k, v = kv(T, seen)
        got, want = ring.update(k, v), ref.update(k, v)
        seen += T
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        assert int(ring.get_seq_length()) == ref.get_seq_length() == seen
        assert int(ring.cumulative_length) == ref.cumulative_length == seen
    assert ring.get_max_length() == W + draft and ref.get_max_length() == W


def test_ring_layer_has_the_attributes_hf_reads():
    layer = hf.RingLayer(4)
    assert layer.sliding_window == 4 and layer.is_sliding and layer.is_compileable
    assert layer.device is None and layer.dtype is None and not layer.is_initialized
    assert not hasattr(layer, "batch_size")  # HF's Cache.batch_size skips uninitialized layers
    layer.update(*kv(3, 0))
    assert layer.device == torch.device("cpu") and layer.dtype == torch.float64
    assert layer.is_initialized and isinstance(layer.cumulative_length, torch.Tensor)


def test_ring_layer_keys_are_in_slot_order_with_their_positions():
    """What a ring cannot do: ``layer.keys`` is its storage, position p in slot p % W, and
    ``layer.positions`` says which position each slot holds."""
    layer = hf.RingLayer(4)
    for start, T in ((0, 3), (3, 1), (4, 1), (5, 1)):  # positions 0..5 into 4 slots
        layer.update(*kv(T, start))
    assert layer.positions.tolist() == [[4, 5, 2, 3]] * 2
    assert layer.keys[0, 0, :, 0].tolist() == [4.0, 5.0, 2.0, 3.0]  # not 2, 3, 4, 5


def test_full_layer_update_returns_what_hf_dynamic_layer_returns():
    full, ref = hf.FullLayer(), DynamicLayer()
    seen = 0
    for T in CHUNKS:
        assert full.get_mask_sizes(T) == ref.get_mask_sizes(T)
        k, v = kv(T, seen)
        for a, b in zip(full.update(k, v), ref.update(k, v), strict=True):
            assert torch.equal(a, b)
        seen += T
        assert full.get_seq_length() == ref.get_seq_length() == full.cumulative_length == seen


def test_update_refuses_what_hf_masks_cannot_describe_changing_nothing():
    with pytest.raises(NotImplementedError, match="sinks"):
        hf.RingLayer(4, sinks=2).update(*kv(2, 0))
    layer = hf.RingLayer(4)
    layer.update(*kv(3, 0))
    before = layer.keys.clone(), layer.positions.clone(), int(layer.columns)
    with pytest.raises(ValueError, match="holds"):
        layer.update(*kv(1, 3, B=3))  # another batch
    with pytest.raises(ValueError, match="alike"):
        layer.update(kv(1, 3)[0], kv(2, 3)[1])
    assert torch.equal(layer.keys, before[0]) and torch.equal(layer.positions, before[1])
    assert int(layer.columns) == before[2]
    # a layer a RingCache forward wrote counts real tokens: HF's column contract is refused
    model = tiny_mistral()
    out = hf.generate(model, prompt(4), max_new_tokens=2, do_sample=False,
                      return_dict_in_generate=True)
    with pytest.raises(NotImplementedError, match="RingCache forward wrote it"):
        out.cache.layers[0].update(*kv(1, 6, B=1))


# ------------------------------------------------------------------------- inside HF's cache
@pytest.mark.parametrize("make", [tiny_mistral, tiny_gemma])
def test_ring_layers_inside_hf_dynamic_cache_generate_what_hf_generates(make):
    """HF's own DynamicCache with ringviz's layers in place of its own (rings for sliding
    layers, FullLayer for full ones), HF's own masks and attention: the same tokens as HF's
    DynamicCache, scores at float64 rounding, past several wraps of the window."""
    model = make()
    W = model.config.sliding_window
    ids = prompt(2 * W + 1)
    ref = run(None, model, ids, max_new_tokens=4 * W, cache=DynamicCache(config=model.config))
    cache = DynamicCache(config=model.config)
    cache.layers = [hf.RingLayer(layer.sliding_window) if layer.is_sliding else hf.FullLayer()
                    for layer in cache.layers]
    out = run(None, model, ids, max_new_tokens=4 * W, cache=cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_score_diff(out, ref) < 1e-9
    ring = cache.layers[0]
    assert ring.ring.capacity == W and int(ring.get_seq_length()) == out.sequences.shape[1] - 1


# ------------------------------------------------------------------------- rollback
def test_rollback_refused_before_anything_changes_without_draft_slots():
    """HF's activate_past_recording used to skip the rings silently (no such method); a ring
    without draft slots refuses it, and no layer of the cache starts recording."""
    model = tiny_gemma()
    cache = hf.RingCache(model)
    with pytest.raises(NotImplementedError, match="draft=K"):
        cache.activate_past_recording()
    assert not any(cache.is_recording_past(i) for i in range(len(cache.layers)))
    served = hf.RingCache(model, draft=2)
    served.activate_past_recording()
    assert served.is_recording_past(0) and served.is_croppable


def test_ring_layer_crop_takes_back_a_draft_like_hf_sliding_layer():
    """A ring with draft slots, recording its past: after a rejected draft is cropped, the next
    update returns what a layer that never saw the draft returns."""
    W, draft = 5, 3
    ring, clean = hf.RingLayer(W, draft=draft), DynamicSlidingWindowLayer(sliding_window=W)
    ring.activate_past_recording()
    for start, T in ((0, 7), (7, 1), (8, 1)):
        ring.update(*kv(T, start))
        clean.update(*kv(T, start))
    ring.update(*kv(3, 9))  # a draft of 3, all rejected
    ring.crop(-3)
    assert int(ring.get_seq_length()) == 9
    for a, b in zip(ring.update(*kv(1, 9)), clean.update(*kv(1, 9)), strict=True):
        assert torch.equal(a, b)
    before = ring.positions.clone()
    with pytest.raises(ValueError):  # further back than the spare slots keep
        ring.crop(-(W + draft))
    assert torch.equal(ring.positions, before)


# ------------------------------------------------------------------------- offloading
def test_offload_and_prefetch_work_or_are_refused_clearly():
    """HF's base prefetch raised AttributeError on a RingLayer (no ``device``); now a ring is
    never offloaded (refused, changing nothing) and has nothing to prefetch; a full layer's
    storage round-trips."""
    ring = hf.RingLayer(4)
    ring.update(*kv(3, 0))
    keys = ring.keys.clone()
    ring.prefetch()
    with pytest.raises(NotImplementedError, match="resident"):
        ring.offload()
    assert torch.equal(ring.keys, keys) and ring.keys.data_ptr() == ring.ring.k.data_ptr()
    full = hf.FullLayer()
    full.update(*kv(3, 0))
    keys = full.keys.clone()
    full.offload()
    assert full.keys.device.type == "cpu" and full.device == torch.device("cpu")
    full.prefetch()
    assert torch.equal(full.update(*kv(1, 3))[0][:, :, :3], keys)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: offloading moves to CPU")
def test_full_layer_offload_round_trips_through_the_cpu_on_cuda():
    full = hf.FullLayer()
    k, v = (t.cuda() for t in kv(3, 0))
    full.update(k, v)
    full.offload()
    assert full.keys.device.type == "cpu"
    full.prefetch()
    torch.cuda.synchronize()
    assert full.keys.device.type == "cuda" and torch.equal(full.keys[:, :, :3], k)


# ------------------------------------------------------------------------- RingCache(config)
def test_ring_cache_from_a_config_serves_like_one_from_the_model():
    model = tiny_gemma()
    ids = prompt(9)
    from_model = run(hf.generate, model, ids, cache=hf.RingCache(model, sinks=2),
                     max_new_tokens=10)
    from_config = run(hf.generate, model, ids, cache=hf.RingCache(model.config, sinks=2),
                      max_new_tokens=10)
    assert torch.equal(from_config.sequences, from_model.sequences)
    assert max_score_diff(from_config, from_model) == 0.0
    with pytest.raises(ValueError, match="pass the model"):
        hf.RingCache(model.config, sinks=2, sink_convention="cache")


def test_ring_cache_from_a_config_copies_like_one_from_the_model():
    model = tiny_mistral()
    cache = hf.RingCache(model.config)
    hf.generate(model, prompt(6), cache=cache, max_new_tokens=3, do_sample=False)
    twin = copy.deepcopy(cache)
    assert twin.config is model.config and twin.seen_columns() == cache.seen_columns() == 8
