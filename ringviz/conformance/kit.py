"""``check(make_step, window=W)``: hypothesis draws schedules, shrinks the ones that fail.

Each example is one :class:`~ringviz.conformance.schedule.Schedule` run through fresh caches
(:func:`~ringviz.conformance.probe.evaluate_all`: every property judged on every query). A
failing example raises an exception of its first broken property's class; hypothesis then
shrinks it (fewer, smaller chunks, smaller offsets, fewer and smaller rewinds) while the same
property keeps failing, and with ``report_multiple_bugs`` it shrinks each property apart. A
property that broke only beside another (a ring that keeps a stale key *and* scales its
outputs breaks both on every schedule that shows either) gets a second search of its own, on
the same seed, which raises for that property alone and so shrinks it to its own schedule.
The run is seeded (``@seed``) and keeps no example database, so the same call gives the
same report.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky, Unsatisfiable

from ringviz.cache import MakeStep
from ringviz.checks import check_int
from ringviz.conformance.probe import (
    LAYOUTS,
    NUM_HEADS,
    NUM_KV_HEADS,
    Unsupported,
    evaluate_all,
    head_dim_for,
)
from ringviz.conformance.report import PROPERTIES, Failure, Report
from ringviz.conformance.schedule import PADDINGS, schedules
from ringviz.conformance.seam import StepSpec, make


class _Broken(Exception):
    """A property broke on the example hypothesis is running (one subclass per property)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(str(failure))
        self.failure = failure


# hypothesis tells bugs apart by their exception's class, and shrinks each one on its own
_BROKEN = {p: type(f"_{p.title()}Broken", (_Broken,), {}) for p in PROPERTIES}


def _leaves(err: BaseException) -> list[BaseException]:
    """The exceptions inside an exception group (hypothesis's several bugs), or ``[err]``."""
    if isinstance(getattr(err, "exceptions", None), (list, tuple)):  # (Base)ExceptionGroup
        return [leaf for sub in err.exceptions for leaf in _leaves(sub)]
    return [err]


def _check_args(make_step: object, window: object, sinks: object, batch_size: object,
                ragged: object, examples: object, seed: object, dtype: object,
                max_chunk: object, rewind: object, layout: object, padding: object) -> None:
    if not callable(make_step):
        raise TypeError(f"make_step must be callable, got {type(make_step).__name__}")
    check_int("window", window)
    check_int("sinks", sinks, minimum=0)
    check_int("batch_size", batch_size)
    check_int("examples", examples)
    check_int("seed", seed, minimum=0)
    if max_chunk is not None:
        check_int("max_chunk", max_chunk)
    if not isinstance(ragged, bool):
        raise TypeError(f"ragged must be a bool, got {type(ragged).__name__}")
    if ragged and batch_size < 2:
        raise ValueError(f"ragged=True needs batch_size >= 2 (rows that start at different "
                         f"times), got batch_size={batch_size}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not isinstance(rewind, bool):
        raise TypeError(f"rewind must be a bool, got {type(rewind).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if padding not in PADDINGS:
        raise ValueError(f"padding must be one of {PADDINGS}, got {padding!r}")
    if padding == "any" and not ragged:
        raise ValueError("padding='any' pads rows anywhere, so they are not in lock-step: it "
                         "needs ragged=True (and batch_size >= 2)")
    if padding == "any" and rewind:
        raise ValueError("padding='any' and rewind=True do not combine: a rewind forgets real "
                         "tokens of every row, which rows that pad anywhere do not share")


def _check_rewind(make_step: MakeStep, batch_size: int, dtype: torch.dtype,
                  device: torch.device) -> None:
    """TypeError unless the step ``make_step`` builds has a ``rewind(n)`` method (a step that
    cannot be built is left to the run, which reports it)."""
    spec = StepSpec(batch_size, NUM_HEADS, NUM_KV_HEADS, head_dim_for(1), dtype, device)
    try:
        step = make(make_step, spec)
    except Exception:  # noqa: BLE001 -- an unbuildable cache is the run's "error"
        return
    if not callable(getattr(step, "rewind", None)):
        raise TypeError("rewind=True needs a step with a rewind(n) method (forget the newest "
                        "n tokens of every row); the step make_step built has no callable "
                        "'rewind'")


def check(make_step: MakeStep, *, window: int, sinks: int = 0, batch_size: int = 1,
          ragged: bool = False, examples: int = 100, seed: int = 0,
          dtype: torch.dtype = torch.float64, max_chunk: int | None = None,
          device: torch.device | str = "cpu", name: str = "",
          progress: Callable[[int], None] | None = None, rewind: bool = False,
          layout: str = "padded", padding: str = "left") -> Report:
    """Check a sliding-window cache on ``examples`` schedules; a :class:`Report`, never a raise.

    ``make_step``, and the contract its cache is held to: :mod:`ringviz.conformance`.
    ``max_chunk`` caps the chunk sizes (1: decode steps only); ``progress(n)`` is called after
    each schedule run. ``rewind=True`` also draws schedules that rewind
    (:class:`~ringviz.conformance.Rewind`); the step must have a method ``rewind(n)``
    (TypeError, before any schedule, if it has none). ``layout="rows"`` hands each chunk over
    as each row's real tokens, no padding. ``padding="any"`` (with ``ragged=True``) also pads
    rows after they start: right padding and mid-row gaps, rows not in lock-step; a failure
    then shows each row's positions (:meth:`~ringviz.conformance.Failure.where`).

    >>> from ringviz.conformance.adapters import ringviz_ring
    >>> check(ringviz_ring(4), window=4, examples=10).ok
    True
    """
    _check_args(make_step, window, sinks, batch_size, ragged, examples, seed, dtype, max_chunk,
                rewind, layout, padding)
    device = torch.device(device)
    if rewind:
        _check_rewind(make_step, batch_size, dtype, device)
    state = {"runs": 0, "skipped": 0, "why": "", "seen": set()}

    def search(target: str | None) -> list[Failure]:
        """One hypothesis search; ``target``: the only property it raises for (None: the
        first each example breaks)."""
        @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
                  phases=(Phase.generate, Phase.shrink), report_multiple_bugs=True,
                  suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                  print_blob=False)
        @hypothesis_seed(seed)
        @given(schedules(window=window, sinks=sinks, batch_size=batch_size, ragged=ragged,
                         max_chunk=max_chunk, rewind=rewind, padding=padding))
        def conforms(schedule) -> None:
            state["runs"] += 1
            try:
                found = evaluate_all(make_step, schedule, window=window, sinks=sinks,
                                     dtype=dtype, device=device, seed=seed, layout=layout)
            except Unsupported as err:
                state["skipped"] += 1
                state["why"] = str(err)
                reject()
            finally:
                if progress is not None:
                    progress(state["runs"])
            state["seen"].update(f.property for f in found)
            found = [f for f in found if target in (None, f.property)]
            if found:
                raise _BROKEN[found[0].property](found[0])

        try:
            conforms()
        except (Unsatisfiable, Flaky):
            if target:  # the first search reported what the cache declines or does two ways
                return []
            raise
        except BaseException as err:
            leaves = _leaves(err)
            if not all(isinstance(leaf, _Broken) for leaf in leaves):
                raise
            return [leaf.failure for leaf in leaves]
        return []

    def first_search() -> list[Failure]:
        """The untargeted search; a cache that declines everything, or answers the same
        schedule two ways, is an ``"error"``."""
        try:
            return search(None)
        except Unsatisfiable:
            return [Failure("error", [], [], message=f"the cache declined every schedule "
                            f"drawn ({state['skipped']} of {state['runs']}): {state['why']}")]
        except Flaky as err:  # the same schedule passed once and failed once
            return [Failure("error", [], [], message=f"the cache answered the same "
                            f"schedule two ways (nondeterministic): {err}")]

    failures = first_search()
    for prop in PROPERTIES:  # broken only beside another property: shrunk on its own
        if prop in state["seen"] and all(f.property != prop for f in failures):
            failures += search(prop)
    return Report(failures=_one_per_property(failures), examples=state["runs"],
                  skipped=state["skipped"], window=window, sinks=sinks,
                  batch_size=batch_size, ragged=ragged, max_chunk=max_chunk, seed=seed,
                  name=name, dtype=str(dtype).removeprefix("torch."), rewind=rewind,
                  layout=layout, padding=padding)


def _one_per_property(failures: list[Failure]) -> list[Failure]:
    """The smallest failure of each property (fewest tokens, then fewest chunks), in the order
    of :data:`PROPERTIES`. Hypothesis can report one property twice, from two origins (a cache
    that is wrong only sometimes)."""
    best: dict[str, Failure] = {}
    for f in sorted(failures, key=lambda f: (sum(f.schedule), len(f.schedule))):
        best.setdefault(f.property, f)
    return [best[p] for p in PROPERTIES if p in best]
