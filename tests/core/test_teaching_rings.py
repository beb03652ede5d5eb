"""The book's teaching rings (chapters 3, 6, 7, 9) agree with the package's RingKVCache.

Each chapter defines its ring in one notebook cell (by cell id); the test loads that cell's code,
as the reader retypes it, and runs it side by side with :class:`ringviz.RingKVCache` over the
schedules the chapter claims it handles: decode only (3), any chunks (6), ragged left-padded
batches (7), and sinks (9). Padding queries are compared too (both give zeros).
"""

from __future__ import annotations

import json
import math
import pathlib
import types

import pytest
import torch
import torch.nn.functional as F

from ringviz import RingKVCache

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
CELLS = {"Ring": ("03_ring_indexing", "ch03-ring"), "ChunkRing": ("06_prefill", "ch06-ring"),
         "BatchRing": ("07_batching", "ch07-ring"), "SinkRing": ("09_sinks", "ch09-ring")}


def cell_source(notebook: str, cell_id: str) -> str:
    nb = json.loads((NOTEBOOKS / f"{notebook}.ipynb").read_text())
    (cell,) = [c for c in nb["cells"] if c.get("id") == cell_id]
    return "".join(cell["source"])


def teaching_ring(name: str) -> type:
    """The class as the chapter defines it (SinkRing needs the BatchRing it extends)."""
    namespace = {"torch": torch, "F": F}
    if name == "SinkRing":
        exec(cell_source(*CELLS["BatchRing"]), namespace)  # noqa: S102 -- the book's own code
    exec(cell_source(*CELLS[name]), namespace)  # noqa: S102
    return namespace[name]


def unmarked(source: str) -> str:
    """The code without its ``# NEW`` / ``# CHANGED`` comments (what the next chapter starts from)."""
    return "\n".join(line.split("  # NEW")[0].split("  # CHANGED")[0] for line in source.split("\n"))


@pytest.mark.parametrize("earlier, later", [
    (("03_ring_indexing", "ch03-ring"), ("06_prefill", "ch06-ring3")),
    (("06_prefill", "ch06-ring"), ("07_batching", "ch07-ring6")),
    (("07_batching", "ch07-ring"), ("09_sinks", "ch09-ring7")),
    (("06_prefill", "ch06-ring"), ("11_real_models", "ch11-ring6"))])
def test_each_chapter_starts_from_the_previous_ring(earlier, later):
    """The hidden copy a chapter starts from is an earlier chapter's ring, unchanged (chapter 11's
    decoder runs chapter 6's)."""
    assert cell_source(*later) == unmarked(cell_source(*earlier))


def run(step, q, k, v, pos, sizes):
    outs, t = [], 0
    for n in sizes:
        c = slice(t, t + n)
        outs.append(step(q[:, :, c], k[:, :, c], v[:, :, c], pos[:, c]))
        t += n
    return torch.cat(outs, dim=2)


def batch(B: int, T: int, offsets: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 4, T, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(B, 2, T, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(B, 2, T, 8, generator=gen, dtype=torch.float64)
    pos = torch.arange(T)[None].repeat(B, 1) - torch.tensor(offsets)[:, None]
    return q, k, v, pos.clamp_min(-1)


DECODE = [[1] * 23]
CHUNKS = DECODE + [[5, 1, 1, 9, 7], [23], [3, 8, 12], [7, 7, 1, 8]]
CASES = ([("Ring", 0, False, s) for s in DECODE]  # chapter 3's ring: one token per step
         + [("ChunkRing", 0, False, s) for s in CHUNKS]
         + [("BatchRing", 0, True, s) for s in CHUNKS]
         + [("SinkRing", 2, True, s) for s in CHUNKS])


@pytest.mark.parametrize("name, sinks, ragged, sizes", CASES)
def test_teaching_ring_equals_package(name, sinks, ragged, sizes):
    W, B = 6, (3 if ragged else 2)
    offsets = [0, 4, 9][:B] if ragged else [0] * B
    q, k, v, pos = batch(B, sum(sizes), offsets, seed=len(sizes))
    cls = teaching_ring(name)
    ring = cls(B, 2, W, 8, sinks) if sinks else cls(B, 2, W, 8)
    package = RingKVCache(B, 2, W, 8, sinks=sinks, dtype=torch.float64)
    got, want = run(ring.step, q, k, v, pos, sizes), run(package.step, q, k, v, pos, sizes)
    assert (got - want).abs().max().item() < 1e-12
    assert torch.equal(ring.pos if ring.pos.ndim == 2 else ring.pos.expand(B, -1),
                       package.positions)



ZERO_FILL = "        return out.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # NEW: pads\n"


def textbook_sdpa(q, k, v, attn_mask, enable_gqa=False):
    """SDPA as its formula reads (chapter 5): a query with no visible key gets 0/0 = NaN.
    (This torch's own SDPA returns zeros for such a row on the CPU: one kernel's choice.)"""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~attn_mask, float("-inf")).softmax(dim=-1) @ v


def batch_ring_maker(source: str, sdpa=F.scaled_dot_product_attention):
    """The kit's make_step for chapter 7's BatchRing (W = 5) defined from ``source``, its
    attention kernel ``sdpa``."""
    functional = types.SimpleNamespace(scaled_dot_product_attention=sdpa)
    namespace = {"torch": torch, "F": functional}
    exec(source, namespace)  # noqa: S102 -- the book's own code, or a mutation of it
    ring_class = namespace["BatchRing"]

    def make_step(*, batch_size, num_heads, num_kv_heads, head_dim, dtype, device):
        return ring_class(batch_size, num_kv_heads, 5, head_dim, dtype=dtype).step

    return make_step


def test_batch_ring_without_its_zero_fill_fails_padding():
    """Chapter 7's zero-fill keeps a padding query's output finite whatever the kernel gives
    a query that sees nothing; without it, the textbook kernel's NaN reaches the output and
    the kit reports "padding"."""
    from ringviz.conformance import check

    source = cell_source(*CELLS["BatchRing"])
    assert source.count(ZERO_FILL) == 1
    mutant = source.replace(ZERO_FILL, "        return out\n")
    kw = {"window": 5, "batch_size": 2, "ragged": True, "examples": 40}
    for sdpa in (F.scaled_dot_product_attention, textbook_sdpa):
        real = check(batch_ring_maker(source, sdpa), **kw)
        assert real.ok, str(real)
    report = check(batch_ring_maker(mutant, textbook_sdpa), **kw)
    assert report.properties() == ["padding"], str(report)
    f = report.failures[0]
    assert f.position == -1 and f.bad_value == "nan" and f.offsets[f.row] > f.column
