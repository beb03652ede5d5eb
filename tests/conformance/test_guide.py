"""The guide's four adapters (README, chapter 14) pass the kit in their layouts."""

import torch

from ringviz.conformance import check
from ringviz.conformance.guide import (
    hf_layer,
    mlx_cache,
    server_rows,
    speculative_layer,
)


def test_hf_layer_passes():
    assert check(hf_layer(4), window=4, examples=40).ok


def test_mlx_cache_passes():
    assert check(mlx_cache(4), window=4, examples=40, dtype=torch.float32).ok


def test_server_rows_passes_with_rows_joining():
    report = check(server_rows(4), window=4, batch_size=3, ragged=True, layout="rows",
                   examples=40, dtype=torch.float32)
    assert report.ok, str(report)


def test_speculative_layer_rewinds():
    report = check(speculative_layer(4), window=4, rewind=True, examples=40)
    assert report.ok, str(report)
    assert report.examples > report.skipped  # most rewinds were taken, not declined


def test_readme_shows_the_guide_as_it_is():
    import inspect
    from pathlib import Path

    from ringviz.conformance import guide

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for name in ("hf_layer", "mlx_cache", "server_rows", "SpeculativeStep", "speculative_layer"):
        assert inspect.getsource(getattr(guide, name)).rstrip("\n") in readme, name


def test_small_blocks_grow_several_times_before_the_window_fills_and_pass():
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    def sizes(step):
        cache = RotatingKVCache(max_size=6)
        cache.step = step
        seen = []
        for _ in range(8):
            x = mx.zeros((1, 1, 1, 8))
            cache.update_and_fetch(x, x)
            seen.append(cache.keys.shape[2])
        return sorted(set(seen))

    assert sizes(256) == [6]  # the class's block: one allocation, no grow path at W = 6
    assert sizes(2) == [2, 4, 6]  # scaled down: it grows, and copies, twice
    assert check(mlx_cache(6, block=2), window=6, examples=40, dtype=torch.float32).ok
