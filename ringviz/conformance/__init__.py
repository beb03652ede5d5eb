"""Test any sliding-window KV cache from the outside: ``check(make_step, window=W)``.

The contract a cache is held to: a query at absolute position ``p`` sees exactly the keys at
positions ``max(0, p - W + 1) .. p``, plus ``0 .. sinks - 1`` when the cache keeps attention
sinks, of its own row, whatever chunk sizes the tokens arrive in (single tokens, chunks shorter
and longer than ``W``, chunks that wrap the ring, runs of each) and for rows that start at
different times (``ragged=True``: left padding, position -1). And its output is the softmax
attention over those keys (scale ``1/sqrt(D)``); a padding query's output may be anything
finite.

``make_step(*, batch_size, num_heads, num_kv_heads, head_dim, dtype, device)`` builds a fresh
cache (``dtype`` and ``device`` those of the kit's tensors, so it can allocate up front) and
returns ``step(q, k, v, positions) -> out``: ``q`` ``(B, Hq, T, D)``, ``k``/``v``
``(B, Hkv, T, D)`` (keys already rotated: the cache only stores, evicts and masks),
``positions`` ``(B, T)`` int64, ``out`` ``(B, Hq, T, D)``. The kit chooses the head counts
(grouped-query: ``Hq = 2 Hkv``) and ``D``. A make_step written for the four shapes alone
still works: the kit passes ``dtype`` and ``device`` only to one that takes them
(:mod:`.seam`). :mod:`ringviz.conformance.adapters` holds ready ones; :func:`check` returns a
:class:`Report` whose :class:`Failure` s carry a shrunk schedule.

How it reads the keys a query saw without looking inside the cache: :mod:`.probe`.
"""

from ringviz.conformance.kit import check
from ringviz.conformance.probe import Unsupported
from ringviz.conformance.report import Failure, Report
from ringviz.conformance.schedule import Schedule

__all__ = ["Failure", "Report", "Schedule", "Unsupported", "check"]
