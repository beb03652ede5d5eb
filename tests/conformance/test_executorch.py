"""ExecuTorch's RingKVCache (the real package, ``executorch==1.5.1``) as its attention drives
it: a chunk of 2W tokens overflows its 2W ring (the gemma4 runner's bug, PR #20346); chunks
capped at W, the runner's fix, pass; the cap holds up to W + 1 tokens, not W + 2."""

import pytest
import torch

pytest.importorskip("executorch", reason="the package executorch is not installed "
                    "(pip install --no-deps -r requirements-peers.txt)")

from ringviz.conformance import check  # noqa: E402
from ringviz.conformance.adapters import executorch_ring  # noqa: E402
from ringviz.conformance.peers import run  # noqa: E402

W = 6
# ExecuTorch's update calls torch._check_is_size, which torch 2.13 marks as going away
pytestmark = pytest.mark.filterwarnings("ignore:_check_is_size:FutureWarning")


def test_a_2w_chunk_after_one_token_loses_a_key_of_the_window():
    report = run("executorch_ring", window=W)
    (f,) = report.failures
    assert f.property == "window" and f.schedule == [1, 2 * W]
    assert (f.position, f.difference()) == (1, ([0], []))
    assert report.skipped > 0  # chunks over 2W: its update's assert, declined


F32 = torch.float32  # ExecuTorch's ring mask is float32, as its models are


@pytest.mark.parametrize(("window", "cap"), [(W, W), (W, W + 1), (8, 9)])
def test_chunks_capped_at_the_window_pass(window, cap):
    assert check(executorch_ring(window, max_chunk=cap), window=window, batch_size=2,
                 examples=60, dtype=F32).ok


def test_a_cap_of_w_plus_2_still_breaks():
    report = check(executorch_ring(W, max_chunk=W + 2), window=W, batch_size=2, examples=100,
                   dtype=F32)
    assert report.properties() == ["window"]
    assert max(report.failures[0].schedule) > W + 1


def test_the_ring_itself_without_the_kit():
    """ExecuTorch's own calls, no kit: after position 0 and a chunk of 2W, the slot that held
    key 0 holds key 12, and the mask for the query at position 1 has only one key left."""
    from executorch.examples.models.llama.attention import RingKVCache

    cache = RingKVCache(1, W, 1, 8, enable_dynamic_shape=True, dtype=torch.float32)
    for start, n in ((0, 1), (1, 2 * W)):
        x = torch.zeros(1, 1, n, 8)
        cache.update(torch.tensor([start]), x, x)
    held = cache.cache_positions_manager.cache_positions.tolist()
    assert 0 not in held and sorted(held) == list(range(1, 2 * W + 1))
    mask = cache.create_causal_mask_for_ring_buffer(1, 2 * W)
    assert int((mask[0] == 0).sum()) == 1  # query 1 sees key 1 alone, not 0 and 1


def test_padding_and_rows_out_of_step_are_refused():
    step = executorch_ring(W)(batch_size=2, num_heads=4, num_kv_heads=2, head_dim=8,
                              dtype=torch.float64, device="cpu")
    x = torch.zeros(2, 2, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="one input_pos"):
        step(torch.zeros(2, 4, 2, 8, dtype=torch.float64), x, x, torch.tensor([[0, 1], [-1, 0]]))


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="seen on torch 2.13")
def test_float64_queries_beside_its_float32_mask_from_16_keys():
    """Not ExecuTorch's bug: torch 2.13's fused CPU attention takes a float32 mask beside
    float64 queries and misreads it once it spans 16 keys (2W = 16 at W = 8), where its math
    kernel is right. The kit sees empty slots in the very first query's window."""
    f = check(executorch_ring(8, max_chunk=8), window=8, examples=20).failures[0]
    assert f.schedule == [1] and f.difference() == ([], [-1] * 8)
    assert check(executorch_ring(8, max_chunk=8), window=8, examples=20, dtype=F32).ok
