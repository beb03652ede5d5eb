"""Run one schedule through a cache and read, from its outputs alone, which keys each query saw.

The trick (no access to the cache's internals): give every token its own id and a value vector
that is one-hot at that id, and ask with a **zero query**. Every score is then 0, so every key
the query can see gets the same softmax weight ``1/K``, and the output is the average of their
one-hot values: entry ``j`` reads ``c_j / K`` for a key seen ``c_j`` times, 0 for an unseen one.
The smallest non-zero entry is ``1/K``; whatever the entries leave of 1 is keys carrying no id
(empty slots, zero vectors). With more ids than the head dimension ``D``, several probes each
carry ``D`` of them.

A second run with random ``q``, ``k``, ``v`` compares the outputs with a float64 softmax over
the keys the window defines, which catches everything the key set cannot show (scaling, head
mapping in grouped-query attention, keys re-rotated or mixed up between slots). Its outputs at
padding queries (position -1) may be anything finite: a NaN or inf there is a ``"padding"``
failure, since the next layer would mix it into every real token.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch

from ringviz import band_mask
from ringviz.cache import MakeStep, Step
from ringviz.conformance.pitfalls import attend
from ringviz.conformance.report import Failure
from ringviz.conformance.schedule import Schedule
from ringviz.conformance.seam import StepSpec, build_hint, make

NUM_HEADS, NUM_KV_HEADS = 4, 2  # grouped-query attention: two query heads per KV head
MAX_HEAD_DIM = 64
# |out - reference| allowed by the "values" check, and the noise floor of a probe's entries
VALUE_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
PROBE_NOISE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3,
               torch.bfloat16: 8e-3}
TRACEBACK_FRAMES = 3  # the innermost frames of a step's exception that an "error" shows
_KIT_FILES = frozenset({__file__, make.__code__.co_filename})  # frames the report leaves out


class Unsupported(ValueError):
    """Raised by a step for a schedule its cache does not take by design (not a bug).

    :func:`~ringviz.conformance.check` skips such schedules (hypothesis draws others) and counts
    them in ``Report.skipped``; a cache that takes none of them fails with ``"error"``.
    """


class StepError(Exception):
    """The step raised, or returned something unusable, at chunk ``step``."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step, self.message = step, message


def head_dim_for(ids: int) -> int:
    """Head dimension of the probes: room for every id, a multiple of 8, at most 64."""
    return min(MAX_HEAD_DIM, max(8, -(-ids // 8) * 8))


def described(err: BaseException) -> str:
    """``"Type: text"`` and the innermost :data:`TRACEBACK_FRAMES` frames of its traceback, the
    kit's own left out (where in the cache's code it broke)."""
    stack = [f for f in traceback.extract_tb(err.__traceback__) if f.filename not in _KIT_FILES]
    text = f"{type(err).__name__}: {err}"
    if not stack:
        return text
    lines = "".join(traceback.format_list(stack[-TRACEBACK_FRAMES:])).rstrip("\n").split("\n")
    return text + "\n  last frames, innermost last:\n" + "\n".join("  " + ln for ln in lines)


LAYOUTS = ("padded", "rows")


@contextmanager
def _reported(i: int, doing: str = "",
              hint: Callable[[BaseException], str] | None = None) -> Iterator[None]:
    """An exception the cache's code raises becomes a StepError at chunk ``i``, its text after
    ``doing`` and before ``hint(err)``; :class:`Unsupported` (a schedule declined) passes
    through."""
    try:
        yield
    except (Unsupported, StepError):
        raise
    except Exception as err:  # noqa: BLE001 -- the kit reports, never propagates
        raise StepError(i, doing + described(err) + (hint(err) if hint else "")) from err


def _kind(out: object) -> object:
    """A returned output in words: its shape if a tensor, else its type."""
    return tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__


def _padded(step: Step, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            positions: torch.Tensor, i: int) -> torch.Tensor:
    """One chunk, padded layout: ``(B, H, T, D)`` tensors in, ``(B, Hq, T, D)`` out."""
    out = step(q, k, v, positions)
    if _kind(out) != tuple(q.shape):
        raise StepError(i, f"step returned {_kind(out)}, expected a tensor of shape "
                        f"{tuple(q.shape)}")
    return out


def _rows(step: Step, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          positions: torch.Tensor, i: int) -> torch.Tensor:
    """One chunk, rows layout: each row's real tokens only, as lists of ``(H, n_b, D)`` and
    ``(n_b,)``; the outputs put back in their columns, padding columns zero."""
    real = positions >= 0  # (B, T): left padding, so each row's real tokens are a suffix
    B = q.shape[0]
    out = step(*([t[b][:, real[b]] for b in range(B)] for t in (q, k, v)),
               [positions[b][real[b]] for b in range(B)])
    if not isinstance(out, (list, tuple)) or len(out) != B:
        got = type(out).__name__ + (f" of {len(out)}" if isinstance(out, (list, tuple)) else "")
        raise StepError(i, f"step returned {got}, expected a list of {B} tensors (rows layout)")
    full = q.new_zeros(q.shape)
    for b, o in enumerate(out):
        want = (q.shape[1], int(real[b].sum()), q.shape[3])
        if _kind(o) != want:
            raise StepError(i, f"step returned {_kind(o)} for row {b}, expected a tensor of "
                            f"shape {want} (rows layout)")
        full[b][:, real[b]] = o.to(device=q.device, dtype=q.dtype)
    return full


def feed(make_step: MakeStep, schedule: Schedule, q: torch.Tensor, k: torch.Tensor,
         v: torch.Tensor, positions: torch.Tensor, layout: str = "padded") -> torch.Tensor:
    """Build a fresh cache, feed it the schedule's chunks (and rewinds); ``(B, Hq, N, D)``
    outputs, float64. ``layout`` is how a chunk is handed over: ``"padded"`` tensors, or
    ``"rows"``, each row's real tokens (:mod:`ringviz.conformance`)."""
    B, Hq, _, D = q.shape
    with _reported(0, "make_step raised ", partial(build_hint, make_step)):
        step = make(make_step, StepSpec(B, Hq, k.shape[1], D, q.dtype, q.device))
    one = _rows if layout == "rows" else _padded
    outs = []
    for i, (a, b) in enumerate(schedule.bounds()):
        # copies: a step that writes into its inputs must not change what the kit compares
        chunk = [t[:, :, a:b].clone() for t in (q, k, v)] + [positions[:, a:b].clone()]
        with _reported(i), torch.no_grad():
            out = one(step, *chunk, i)
        outs.append(out.detach().to(device=q.device, dtype=torch.float64))
        if n := schedule.rewind_after(i):
            with _reported(i, f"rewind({n}) after this chunk raised "):
                step.rewind(n)
    return torch.cat(outs, dim=2)


def _repeat_keys(schedule: Schedule, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each ``(B, H, N, D)`` with a re-fed key's column copied from its first feed."""
    src = schedule.sources().to(tensors[0].device)
    return [t.index_select(2, src) for t in tensors]


def probe_weights(make_step: MakeStep, schedule: Schedule, positions: torch.Tensor, *,
                  dtype: torch.dtype, device: torch.device, gen: torch.Generator,
                  layout: str = "padded") -> torch.Tensor:
    """``(B, Hq, N, ids)``: each query's weight on each token id (:meth:`Schedule.token_ids`:
    ``row * N + column`` of the key's first feed)."""
    B, N = positions.shape
    ids = B * N
    D = head_dim_for(ids)
    q = torch.zeros(B, NUM_HEADS, N, D, dtype=dtype, device=device)
    k = torch.randn(B, NUM_KV_HEADS, N, D, generator=gen, dtype=torch.float64)
    (k,) = _repeat_keys(schedule, k.to(device=device, dtype=dtype))
    token = schedule.token_ids().to(device).view(B, 1, N)  # id of each (row, column)
    parts = []
    for first in range(0, ids, D):
        hot = token - first  # (B, 1, N): index into this probe's D entries, or out of range
        inside = (hot >= 0) & (hot < D)
        onehot = torch.nn.functional.one_hot(hot.clamp(0, D - 1), D).to(dtype)  # (B, 1, N, D)
        v = (onehot * inside[..., None]).expand(B, NUM_KV_HEADS, N, D).contiguous()
        parts.append(feed(make_step, schedule, q, k, v, positions, layout))
    return torch.cat(parts, dim=-1)[..., :ids]


def read_seen(weights: torch.Tensor, noise: float) -> tuple[dict[int, int], int]:
    """From one query's id weights ``(ids,)``: ``{id: times seen}`` and keys with no id."""
    w = torch.nan_to_num(weights, nan=0.0)
    hit = w > noise
    if not bool(hit.any()):
        return {}, 0
    unit = float(w[hit].min())  # 1/K: one key's weight
    counts = {int(j): max(1, round(float(w[j]) / unit)) for j in hit.nonzero()[:, 0]}
    blank = max(0, round((1.0 - float(w[hit].sum())) / unit))
    return counts, blank


def _expected_ids(schedule: Schedule, mask: torch.Tensor) -> torch.Tensor:
    """``(B, N, ids)`` bool: the token ids each query's window holds."""
    B, N, _ = mask.shape
    ids = schedule.token_ids().to(mask.device)  # (B, N)
    count = torch.zeros(B, N, B * N, dtype=torch.int64, device=mask.device)
    count.scatter_add_(2, ids[:, None, :].expand(B, N, N), mask.long())
    return count > 0


def window_check(weights: torch.Tensor, schedule: Schedule, positions: torch.Tensor,
                 mask: torch.Tensor, *, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, Failure | None]:
    """``(wrong, failure)``: ``(B, N)`` bool, the real queries that saw another set of keys
    than their window (in any head), and the window Failure of the first of them in time
    order (None if none). A query whose weights are off uniform but whose keys are right (its
    outputs scaled, say) is not wrong here: that is ``"values"``'s to judge."""
    B, N = positions.shape
    noise = PROBE_NOISE.get(dtype, 1e-2)
    ids_expected = _expected_ids(schedule, mask)
    uniform = ids_expected / ids_expected.sum(-1, keepdim=True).clamp_min(1)
    off = (weights - uniform[:, None]).abs().nan_to_num(nan=1.0).amax(dim=(1, 3)) > noise
    off &= positions >= 0  # padding queries may output anything
    wrong = torch.zeros_like(off)
    first = None
    for c in range(N):
        for b in range(B):
            if not off[b, c]:
                continue
            _, forgotten = _columns_of(schedule, b, c)
            for h in range(weights.shape[1]):
                found = _compare(weights[b, h, c], b, c, positions, ids_expected[b, c], noise,
                                 forgotten)
                if found is not None:
                    wrong[b, c] = True
                    if first is None:
                        first = _window(schedule, positions, mask, weights[:, h], b, c, found,
                                        noise)
                    break
    return wrong, first


def _compare(w: torch.Tensor, b: int, c: int, positions: torch.Tensor, want: torch.Tensor,
             noise: float, forgotten: set[int]) -> tuple | None:
    """``(expected, seen, other_rows, forgotten)`` if this query's keys differ from its
    window (``forgotten``: positions of seen keys a rewind forgot)."""
    N = positions.shape[1]
    counts, blank = read_seen(w, noise)
    want_ids = want.nonzero()[:, 0].tolist()
    if blank == 0 and counts == dict.fromkeys(want_ids, 1):
        return None  # the same keys, by id: a forgotten key at a reused position shows
    expected = sorted(int(positions[b, j % N]) for j in want_ids)
    seen, others, forgot = [-1] * blank, [], []
    for j, n in counts.items():
        row, col = divmod(j, N)
        if row == b:
            seen += [int(positions[row, col])] * n
            if j in forgotten:  # its copies beyond the one held, if one is
                forgot += [int(positions[row, col])] * (n - (j in want_ids))
        else:
            others += [(row, int(positions[row, col]))] * n
    return expected, sorted(seen), sorted(others), sorted(forgot)


def _columns_of(schedule: Schedule, b: int, c: int) -> tuple[dict[int, int], set[int]]:
    """Row ``b``'s id -> the column that fed it as column ``c``'s query finds it (the held one,
    else the newest fed before the end of ``c``'s chunk), and the ids a rewind forgot before
    that query (some fed again since, as the same keys)."""
    end = schedule.bounds()[schedule.chunk_of(c)][1]
    fed = list(zip(schedule.token_ids()[b, :end].tolist(), schedule.held()[c, :end].tolist()))
    forgotten = {i: j for j, (i, h) in enumerate(fed) if not h}
    return forgotten | {i: j for j, (i, h) in enumerate(fed) if h}, set(forgotten)


def _window(schedule: Schedule, positions: torch.Tensor, mask: torch.Tensor,
            weights: torch.Tensor, b: int, c: int, found: tuple, noise: float) -> Failure:
    """A window Failure at query (row b, column c), with the row's expected and seen grids
    (by fed column: by position when the schedule does not rewind)."""
    expected, seen, others, forgot = found
    real = (positions[b] >= 0).nonzero()[:, 0].tolist()  # the row's real columns, in order
    seen_grid, blank, foreign = [], [], []
    for qc in real:
        counts, none = read_seen(weights[b, qc], noise)
        col_of, _ = _columns_of(schedule, b, qc)
        own = {col_of[j]: n for j, n in counts.items() if j in col_of}
        seen_grid.append([kc in own for kc in real])
        pads = sum(n for col, n in own.items() if positions[b, col] < 0)
        blank.append(none + pads)  # keys that hold no token of the row: empty slots, padding
        foreign.append(sum(counts.values()) - sum(own.values()))
    expected_grid = mask[b][real][:, real].tolist()
    return schedule_failure(
        "window", schedule, message=f"query saw {seen}, expected {expected}",
        step=schedule.chunk_of(c), row=b, column=c, position=int(positions[b, c]),
        expected=expected, seen=seen, other_rows=others, forgotten=forgot,
        expected_mask=expected_grid, seen_mask=seen_grid, seen_blank=blank,
        seen_other_rows=foreign)


def schedule_failure(prop: str, schedule: Schedule, **details: object) -> Failure:
    """A Failure of ``prop`` shown by ``schedule`` (its chunks, offsets and rewinds)."""
    return Failure(prop, list(schedule.chunks), list(schedule.offsets),
                   rewinds=list(schedule.rewinds),
                   pads=[list(p) for p in schedule.pads] if schedule.gapped else [],
                   **details)


def random_outputs(make_step: MakeStep, schedule: Schedule, positions: torch.Tensor,
                   mask: torch.Tensor, *, dtype: torch.dtype, device: torch.device,
                   gen: torch.Generator, layout: str = "padded"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random q, k, v through a fresh cache: its outputs and the float64 reference's, each
    ``(B, Hq, N, D)`` float64. A key fed again after a rewind with ``same=True`` is the
    forgotten one (and so is its query); every other token is new."""
    B, N = positions.shape
    D = head_dim_for(B * N)
    q, k, v = _repeat_keys(schedule, *(torch.randn(B, h, N, D, generator=gen,
                                                   dtype=torch.float64)
                                       .to(device=device, dtype=dtype)
                                       for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)))
    ref = attend(*(t.to(torch.float64) for t in (q, k, v)), mask)  # the float64 reference
    return feed(make_step, schedule, q, k, v, positions, layout), ref


def padding_failure(out: torch.Tensor, schedule: Schedule,
                    positions: torch.Tensor) -> Failure | None:
    """The first padding query (in time order) whose output holds a NaN or inf, or None."""
    broken = ~out.isfinite().all(dim=-1).all(dim=1) & (positions < 0)  # (B, N)
    bad = broken.T.nonzero()  # (column, row) in time order
    if not len(bad):
        return None
    c, b = (int(i) for i in bad[0])
    what = "nan" if bool(out[b, :, c].isnan().any()) else "inf"
    count, pads = int(broken.sum()), int((positions < 0).sum())
    return schedule_failure("padding", schedule,
                            message=f"{count} of {pads} padding outputs not finite",
                            step=schedule.chunk_of(c), row=b, column=c,
                            position=int(positions[b, c]), bad_value=what)


def values_failure(out: torch.Tensor, ref: torch.Tensor, schedule: Schedule,
                   positions: torch.Tensor, *, dtype: torch.dtype,
                   wrong: torch.Tensor | None = None) -> Failure | None:
    """The first real query (in time order) whose output is off the reference, or None.
    ``wrong``: ``(B, N)`` queries that saw the wrong keys, left to ``"window"`` (their
    outputs are off for that reason)."""
    err = (out - ref).abs().nan_to_num(nan=math.inf).amax(dim=(1, 3))
    err = err.masked_fill(positions < 0, 0.0)  # (B, N): padding queries are "padding"'s
    if wrong is not None:
        err = err.masked_fill(wrong, 0.0)
    tol = VALUE_TOL.get(dtype, 5e-2)
    bad = (err > tol).T.nonzero()  # (column, row) in time order
    if not len(bad):
        return None
    c, b = (int(i) for i in bad[0])
    worst = float(err.max())
    return schedule_failure("values", schedule,
                            message=f"max |out - reference| {worst:.3g} > {tol:g}",
                            step=schedule.chunk_of(c), row=b, column=c,
                            position=int(positions[b, c]), max_error=worst)


def evaluate_all(make_step: MakeStep, schedule: Schedule, *, window: int, sinks: int,
                 dtype: torch.dtype, device: torch.device, seed: int,
                 layout: str = "padded") -> list[Failure]:
    """Every property ``schedule`` breaks, each on its first query, in the order window,
    padding, values: each judged on every query (``"values"`` on the queries that saw their
    window's keys, so a query with the right keys and the wrong output counts even where
    another query broke the window); an exception as ``"error"``. ``layout``: how chunks are
    handed over (:data:`LAYOUTS`).

    Raises :class:`Unsupported` if the cache declines the schedule.
    """
    gen = torch.Generator().manual_seed(seed)
    positions = schedule.positions().to(device)
    # query column c of row b sees key column c': its window over the keys held when c is answered
    mask = band_mask(positions, positions, window, sinks) & schedule.held().to(device)[None]
    found: list[Failure] = []
    try:
        weights = probe_weights(make_step, schedule, positions, dtype=dtype, device=device,
                                gen=gen, layout=layout)
        wrong, window_broken = window_check(weights, schedule, positions, mask, dtype=dtype)
        found.append(window_broken)
        out, ref = random_outputs(make_step, schedule, positions, mask, dtype=dtype,
                                  device=device, gen=gen, layout=layout)
        found.append(padding_failure(out, schedule, positions))
        found.append(values_failure(out, ref, schedule, positions, dtype=dtype, wrong=wrong))
    except StepError as err:
        found.append(schedule_failure("error", schedule, message=err.message, step=err.step))
    return [f for f in found if f is not None]


def evaluate(make_step: MakeStep, schedule: Schedule, **kwargs) -> Failure | None:
    """The first property :func:`evaluate_all` finds broken (window, padding, values, error),
    or None."""
    found = evaluate_all(make_step, schedule, **kwargs)
    return found[0] if found else None
