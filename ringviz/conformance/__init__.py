"""Test any sliding-window KV cache from the outside: ``check(make_step, window=W)``.

The contract a cache is held to: a query at absolute position ``p`` sees exactly the keys at
positions ``max(0, p - W + 1) .. p``, plus ``0 .. sinks - 1`` when the cache keeps attention
sinks, of its own row (after a rewind, the keys fed last at those positions and not
forgotten), whatever chunk sizes the tokens arrive in (single tokens, chunks shorter
and longer than ``W``, chunks that wrap the ring, runs of each) and for rows that start at
different times (``ragged=True``: left padding, position -1) or, with ``padding="any"``, pad
anywhere after they start (right padding, mid-row gaps: rows not in lock-step). And its
output is the softmax attention over those keys (scale ``1/sqrt(D)``); a padding query's
output may be anything finite.

``make_step(*, batch_size, num_heads, num_kv_heads, head_dim, dtype, device)`` builds a fresh
cache (``dtype`` and ``device`` those of the kit's tensors, so it can allocate up front) and
returns ``step(q, k, v, positions) -> out``, in one of two layouts (``check(...,
layout=...)``), ``T`` the chunk's tokens, keys already rotated (the cache only stores, evicts
and masks):

========================  ====================================  ==============================
                          ``layout="padded"`` (the default)     ``layout="rows"``
========================  ====================================  ==============================
``q``                     ``(B, Hq, T, D)``                     list of B ``(Hq, n_b, D)``
``k``, ``v``              ``(B, Hkv, T, D)``                    list of B ``(Hkv, n_b, D)``
``positions``             ``(B, T)`` int64, -1 = padding        list of B ``(n_b,)`` int64
``out``                   ``(B, Hq, T, D)``                     list of B ``(Hq, n_b, D)``
========================  ====================================  ==============================

In the rows layout, row ``b`` gets its real tokens of the chunk only (``n_b <= T``, no
position -1), as a server or a variable-length kernel takes them: a row that has not started
yet gets ``n_b = 0`` (empty tensors) and returns an empty output; list index ``b`` is always
row ``b``. The kit chooses the head counts (grouped-query: ``Hq = 2 Hkv``) and ``D``.

A step may also have a method ``rewind(n)``: forget the newest ``n`` tokens of every row (a
speculative decoder's rejected drafts, a prompt cache trimmed back to a shared prefix).
``check(..., rewind=True)`` draws schedules that rewind (:class:`Rewind`) and feed the
forgotten positions again, with new keys or the same ones; every forgotten token is a real
token of every row. A cache that cannot rewind a state (its keys overwritten) raises
:class:`Unsupported` in ``rewind``, and the schedule is counted as declined. A make_step
written for the four shapes alone still works: the kit passes ``dtype`` and ``device`` only
to one that names them or takes ``**kwargs`` (:mod:`.seam`); one that takes ``**kwargs`` and
hands them to a builder of four shapes fails with ``"error"``, and the report says the two
ways out. :mod:`ringviz.conformance.adapters` holds ready ones; :func:`check` returns a
:class:`Report` whose :class:`Failure` s carry a shrunk schedule.

How it reads the keys a query saw without looking inside the cache: :mod:`.probe`.
"""

from ringviz.conformance.kit import check
from ringviz.conformance.probe import Unsupported
from ringviz.conformance.report import Failure, Report
from ringviz.conformance.schedule import Rewind, Schedule

__all__ = ["Failure", "Report", "Rewind", "Schedule", "Unsupported", "check"]
