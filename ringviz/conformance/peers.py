"""Every cache the kit knows by name: the field's real caches and the book's pitfalls.

:data:`PEERS` maps a name to a :class:`Peer`: how to build its ``make_step`` for a window and a
number of sinks, what it takes (sinks, left-padded rows, rewinds, the rows layout), the dtype
to check it in, and the library version it runs. ``python -m ringviz conform --cache NAME``
and chapter 14's table read it; :func:`run` checks one peer at its most demanding setting.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringviz.cache import MakeStep
from ringviz.conformance import adapters
from ringviz.conformance.kit import check
from ringviz.conformance.pitfalls import PITFALLS
from ringviz.conformance.report import PROPERTIES, Report
from ringviz.conformance.schedule import Rewind


@dataclass(frozen=True)
class Peer:
    """A named cache: ``factory(window)`` (``factory(window, sinks)`` if it keeps sinks) and
    what it takes."""

    name: str
    what: str
    factory: Callable[..., MakeStep]
    library: str = "ringviz"  # the distribution whose version the check runs
    sinks: bool = False  # keeps attention sinks
    ragged: bool = True  # takes left-padded rows (checked as a ragged batch of 2)
    batch_size: int = 1  # rows when not ragged
    dtype: torch.dtype = torch.float64  # the dtype its checks run in
    expect: str | None = None  # pitfalls: the property the kit must report
    default_sinks: int = 0
    rewind: bool = False  # its step has rewind(n): checked with rewinds
    layout: str = "padded"  # how it takes a chunk: "padded" or "rows" (no padding)

    def build(self, window: int, sinks: int = 0) -> MakeStep:
        """The cache's ``make_step`` for ``window`` and ``sinks``."""
        if self.sinks:
            return self.factory(window, sinks)
        if sinks:
            raise ValueError(f"{self.name} keeps no attention sinks: use sinks=0, got {sinks}")
        return self.factory(window)

    def version(self) -> str:
        """``library==version`` as installed (what the check ran)."""
        try:
            return f"{self.library}=={importlib.metadata.version(self.library)}"
        except importlib.metadata.PackageNotFoundError:
            return f"{self.library} (not installed)"


_F32 = torch.float32  # mlx computes its float64 SDPA at float32 precision
PEERS: dict[str, Peer] = {p.name: p for p in [
    Peer("ringviz_ring", "ringviz.RingKVCache, one step per chunk", adapters.ringviz_ring,
         sinks=True, default_sinks=2),
    Peer("ringviz_hf", "ringviz.hf.RingLayer as RingCache drives it", adapters.ringviz_hf,
         sinks=True, default_sinks=2),
    Peer("hf_dynamic_sliding", "transformers DynamicSlidingWindowLayer + masking_utils + sdpa",
         adapters.hf_dynamic_sliding, library="transformers"),
    Peer("hf_static_sliding", "transformers StaticSlidingWindowLayer + masking_utils + sdpa",
         adapters.hf_static_sliding, library="transformers"),
    Peer("mlx_rotating", "mlx-lm RotatingKVCache(W + S, keep=S), mask built before the update",
         lambda w, s: adapters.mlx_rotating(w + s, keep=s), library="mlx-lm", sinks=True,
         ragged=False, dtype=_F32, default_sinks=2),
    Peer("mlx_rotating_window", "mlx-lm RotatingKVCache(W) with make_mask(window_size=W), as "
         "Gemma 3's sliding layers", lambda w: adapters.mlx_rotating(w, window_size=w),
         library="mlx-lm", ragged=False, dtype=_F32),
    Peer("mlx_batch_rotating", "mlx-lm BatchRotatingKVCache(W, left_padding)",
         adapters.mlx_batch_rotating, library="mlx-lm", dtype=_F32),
    Peer("ringviz_draft", "ringviz.RingKVCache with 2 draft slots, rewound by truncate",
         adapters.ringviz_draft, sinks=True, default_sinks=2, rewind=True),
    Peer("ringviz_rows", "one ringviz.RingKVCache per row, each row's tokens only (a server)",
         lambda w, s: adapters.ringviz_rows(w, s, drafts=2), sinks=True, default_sinks=2,
         rewind=True, layout="rows"),
    Peer("mlx_rotating_rewind", "mlx-lm RotatingKVCache(W + S, keep=S) rewound by "
         "trim_prompt_cache, as its speculative decoder does", lambda w, s: adapters.mlx_rotating(
             w + s, keep=s), library="mlx-lm", sinks=True, ragged=False, dtype=_F32,
         rewind=True),
    Peer("executorch_ring", "ExecuTorch RingKVCache (2W slots) + its ring mask + SDPA, as "
         "AttentionMHA drives it", adapters.executorch_ring, library="executorch",
         ragged=False, batch_size=2, dtype=_F32),  # its ring mask is float32, as its models
]} | {name: Peer(name, p.what, p.factory, sinks=p.sinks > 0, ragged=p.ragged,
                 batch_size=p.batch_size, expect=p.breaks, default_sinks=p.sinks)
      for name, p in PITFALLS.items()}


def get(name: str) -> Peer:
    """The peer called ``name``; ValueError listing the known names otherwise."""
    if name not in PEERS:
        raise ValueError(f"unknown cache {name!r}; known: {', '.join(PEERS)}")
    return PEERS[name]


def run(name: str, *, window: int = 6, sinks: int | None = None, examples: int = 100,
        seed: int = 0, max_chunk: int | None = None,
        progress: Callable[[int], None] | None = None, padding: str = "left") -> Report:
    """Check peer ``name``: its default sinks unless given, a ragged batch of 2 if it takes
    padding (else its own batch size), in its dtype, its layout, with rewinds if it takes
    them. ``padding="any"`` pads its ragged rows anywhere too (a peer without padding, or one
    that rewinds, is checked as ever)."""
    peer = get(name)
    sinks = peer.default_sinks if sinks is None else sinks
    make_step = peer.build(window, sinks)
    batch = 2 if peer.ragged else peer.batch_size
    return check(make_step, window=window, sinks=sinks, batch_size=batch,
                 ragged=peer.ragged, examples=examples, seed=seed, dtype=peer.dtype,
                 max_chunk=max_chunk, name=name, progress=progress, rewind=peer.rewind,
                 layout=peer.layout,
                 padding=padding if peer.ragged and not peer.rewind else "left")


def setting(report: Report) -> str:
    """A check's setting, short: ``"W=6 S=2, 2 ragged rows"``, ``"W=6 S=0, 1 row, chunks <= 4"``,
    ``"W=6 S=2, 2 ragged rows, rewinds, rows layout"``.
    """
    rows = (f"{report.batch_size} ragged rows" if report.ragged
            else f"{report.batch_size} row{'s' if report.batch_size > 1 else ''}")
    return f"W={report.window} S={report.sinks}, {rows}{report.options()}"


def table_row(report: Report) -> dict[str, str]:
    """One line of chapter 14's table: the cache, its version and setting, and per property
    ``"pass"`` or the shrunk schedule that breaks it (``[6, 1, 2], rows at [0, 2]``)."""
    peer = get(report.name)
    row = {"cache": report.name, "version": peer.version(), "setting": setting(report)}
    row |= {p: "pass" for p in PROPERTIES}
    for f in report.failures:
        row[f.property] = (str(f.schedule) + (f", rows at {f.offsets}" if any(f.offsets) else "")
                           + "".join(f", {Rewind(*r)}" for r in f.rewinds))
    return row
