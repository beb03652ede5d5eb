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

import torch

from ringviz import band_mask
from ringviz.cache import MakeStep
from ringviz.conformance.report import Failure
from ringviz.conformance.schedule import Schedule
from ringviz.conformance.seam import StepSpec, make

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


def described(err: BaseException, frames: int = TRACEBACK_FRAMES) -> str:
    """``"Type: text"`` and the innermost ``frames`` frames of its traceback, the kit's own
    left out (where in the cache's code it broke)."""
    stack = [f for f in traceback.extract_tb(err.__traceback__) if f.filename not in _KIT_FILES]
    text = f"{type(err).__name__}: {err}"
    if not stack or frames < 1:
        return text
    lines = "".join(traceback.format_list(stack[-frames:])).rstrip("\n").split("\n")
    return text + "\n  last frames, innermost last:\n" + "\n".join("  " + ln for ln in lines)


def feed(make_step: MakeStep, schedule: Schedule, q: torch.Tensor, k: torch.Tensor,
         v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Build a fresh cache, feed it the schedule's chunks; ``(B, Hq, N, D)`` outputs, float64."""
    B, Hq, _, D = q.shape
    try:
        step = make(make_step, StepSpec(B, Hq, k.shape[1], D, q.dtype, q.device))
    except Unsupported:
        raise
    except Exception as err:  # noqa: BLE001 -- a cache that cannot be built is reported
        raise StepError(0, f"make_step raised {described(err)}") from err
    outs = []
    for i, (a, b) in enumerate(schedule.bounds()):
        # copies: a step that writes into its inputs must not change what the kit compares
        chunk = [t[:, :, a:b].clone() for t in (q, k, v)] + [positions[:, a:b].clone()]
        try:
            with torch.no_grad():
                out = step(*chunk)
        except Unsupported:
            raise
        except Exception as err:  # noqa: BLE001 -- the kit reports, never propagates
            raise StepError(i, described(err)) from err
        want = (B, Hq, b - a, D)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise StepError(i, f"step returned {got}, expected a tensor of shape {want}")
        outs.append(out.detach().to(device=q.device, dtype=torch.float64))
    return torch.cat(outs, dim=2)


def expected_mask(positions: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """``(B, N, N)``: query column c of row b sees key column c' of the same row."""
    return band_mask(positions, positions, window, sinks)


def probe_weights(make_step: MakeStep, schedule: Schedule, positions: torch.Tensor, *,
                  dtype: torch.dtype, device: torch.device, gen: torch.Generator
                  ) -> torch.Tensor:
    """``(B, Hq, N, ids)``: each query's weight on each token id (id = row * N + column)."""
    B, N = positions.shape
    ids = B * N
    D = head_dim_for(ids)
    q = torch.zeros(B, NUM_HEADS, N, D, dtype=dtype, device=device)
    k = torch.randn(B, NUM_KV_HEADS, N, D, generator=gen, dtype=torch.float64)
    k = k.to(device=device, dtype=dtype)
    token = torch.arange(ids, device=device).view(B, 1, N)  # id of each (row, column)
    parts = []
    for first in range(0, ids, D):
        hot = token - first  # (B, 1, N): index into this probe's D entries, or out of range
        inside = (hot >= 0) & (hot < D)
        onehot = torch.nn.functional.one_hot(hot.clamp(0, D - 1), D).to(dtype)  # (B, 1, N, D)
        v = (onehot * inside[..., None]).expand(B, NUM_KV_HEADS, N, D).contiguous()
        parts.append(feed(make_step, schedule, q, k, v, positions))
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


def window_failure(weights: torch.Tensor, schedule: Schedule, positions: torch.Tensor,
                   mask: torch.Tensor, *, dtype: torch.dtype) -> Failure | None:
    """The first query (in time order) whose seen keys differ from its window, or None."""
    B, N = positions.shape
    noise = PROBE_NOISE.get(dtype, 1e-2)
    ids_expected = torch.zeros(B, N, B * N, dtype=torch.bool, device=mask.device)
    for b in range(B):
        ids_expected[b, :, b * N:(b + 1) * N] = mask[b]
    count = ids_expected.sum(-1, keepdim=True).clamp_min(1)
    uniform = ids_expected / count  # (B, N, ids): what a correct cache's probe reads
    off = (weights - uniform[:, None]).abs().nan_to_num(nan=1.0).amax(dim=(1, 3)) > noise
    off &= positions >= 0  # padding queries may output anything
    for c in range(N):
        for b in range(B):
            if not off[b, c]:
                continue
            for h in range(weights.shape[1]):
                found = _compare(weights[b, h, c], b, c, positions, ids_expected[b, c], noise)
                if found is not None:
                    return _window(schedule, positions, mask, weights[:, h], b, c, found,
                                   noise)
    return None


def _compare(w: torch.Tensor, b: int, c: int, positions: torch.Tensor, want: torch.Tensor,
             noise: float) -> tuple[list[int], list[int], list[tuple[int, int]]] | None:
    """``(expected, seen, other_rows)`` if this query's keys differ from its window."""
    N = positions.shape[1]
    counts, blank = read_seen(w, noise)
    expected = sorted(int(positions[b, j % N]) for j in want.nonzero()[:, 0])
    seen, others = [-1] * blank, []
    for j, n in counts.items():
        row, col = divmod(j, N)
        if row == b:
            seen += [int(positions[row, col])] * n
        else:
            others += [(row, int(positions[row, col]))] * n
    seen.sort()
    if seen == expected and not others:
        return None
    return expected, seen, sorted(others)


def _window(schedule: Schedule, positions: torch.Tensor, mask: torch.Tensor,
            weights: torch.Tensor, b: int, c: int,
            found: tuple[list[int], list[int], list[tuple[int, int]]], noise: float) -> Failure:
    """A window Failure at query (row b, column c), with the row's expected and seen grids."""
    expected, seen, others = found
    real = (positions[b] >= 0).nonzero()[:, 0]  # the row's real columns, in position order
    N = positions.shape[1]
    seen_grid, blank, foreign = [], [], []
    for qc in real.tolist():
        counts, none = read_seen(weights[b, qc], noise)
        own = {j - b * N: n for j, n in counts.items() if b * N <= j < (b + 1) * N}
        seen_grid.append([kc in own for kc in real.tolist()])
        pads = sum(n for c, n in own.items() if positions[b, c] < 0)
        blank.append(none + pads)  # keys that hold no token of the row: empty slots, padding
        foreign.append(sum(counts.values()) - sum(own.values()))
    expected_grid = mask[b][real][:, real].tolist()
    return Failure("window", list(schedule.chunks), list(schedule.offsets),
                   message=f"query saw {seen}, expected {expected}", step=schedule.chunk_of(c),
                   row=b, column=c, position=int(positions[b, c]), expected=expected, seen=seen,
                   other_rows=others,
                   expected_mask=expected_grid, seen_mask=seen_grid, seen_blank=blank,
                   seen_other_rows=foreign)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """Float64 softmax attention of every column over the columns ``mask`` (B, N, N) allows."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # head h: KV h // G
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    weights = scores.softmax(dim=-1).nan_to_num(nan=0.0)  # a query seeing nothing: 0
    return weights @ v


def random_outputs(make_step: MakeStep, schedule: Schedule, positions: torch.Tensor,
                   mask: torch.Tensor, *, dtype: torch.dtype, device: torch.device,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random q, k, v through a fresh cache: its outputs and the float64 reference's, each
    ``(B, Hq, N, D)`` float64."""
    B, N = positions.shape
    D = head_dim_for(B * N)
    q, k, v = (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64)
               .to(device=device, dtype=dtype)
               for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    return feed(make_step, schedule, q, k, v, positions), reference(q, k, v, mask)


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
    return Failure("padding", list(schedule.chunks), list(schedule.offsets),
                   message=f"{count} of {pads} padding outputs not finite",
                   step=schedule.chunk_of(c), row=b, column=c,
                   position=int(positions[b, c]), bad_value=what)


def values_failure(out: torch.Tensor, ref: torch.Tensor, schedule: Schedule,
                   positions: torch.Tensor, *, dtype: torch.dtype) -> Failure | None:
    """The first real query (in time order) whose output is off the reference, or None."""
    err = (out - ref).abs().nan_to_num(nan=math.inf).amax(dim=(1, 3))
    err = err.masked_fill(positions < 0, 0.0)  # (B, N): padding queries are "padding"'s
    tol = VALUE_TOL.get(dtype, 5e-2)
    bad = (err > tol).T.nonzero()  # (column, row) in time order
    if not len(bad):
        return None
    c, b = (int(i) for i in bad[0])
    worst = float(err.max())
    return Failure("values", list(schedule.chunks), list(schedule.offsets),
                   message=f"max |out - reference| {worst:.3g} > {tol:g}",
                   step=schedule.chunk_of(c), row=b, column=c, position=int(positions[b, c]),
                   max_error=worst)


def evaluate(make_step: MakeStep, schedule: Schedule, *, window: int, sinks: int,
             dtype: torch.dtype, device: torch.device, seed: int) -> Failure | None:
    """The first property ``schedule`` breaks: window, then padding, then values (padding
    first: a schedule with no padding can still show values, so a cache that breaks both is
    reported for both); errors as ``"error"``.

    Raises :class:`Unsupported` if the cache declines the schedule.
    """
    gen = torch.Generator().manual_seed(seed)
    positions = schedule.positions().to(device)
    mask = expected_mask(positions, window, sinks)
    try:
        weights = probe_weights(make_step, schedule, positions, dtype=dtype, device=device,
                                gen=gen)
        found = window_failure(weights, schedule, positions, mask, dtype=dtype)
        if found is None:
            out, ref = random_outputs(make_step, schedule, positions, mask, dtype=dtype,
                                      device=device, gen=gen)
            found = (padding_failure(out, schedule, positions)
                     or values_failure(out, ref, schedule, positions, dtype=dtype))
    except StepError as err:
        return Failure("error", list(schedule.chunks), list(schedule.offsets),
                       message=err.message, step=err.step)
    return found
