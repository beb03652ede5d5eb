"""The seam's two sides: how the kit calls a ``make_step``, and how a cache writes one.

``make_step(*, batch_size, num_heads, num_kv_heads, head_dim, dtype, device)`` builds a fresh
cache and returns its ``step(q, k, v, positions) -> out`` (:data:`ringviz.cache.MakeStep`).
``dtype`` and ``device`` are those of the kit's tensors, so a cache that preallocates can build
itself up front: :func:`make` passes them to a make_step that names them (or takes
``**kwargs``), and leaves them out for one written for the four shapes alone.

:func:`prebuilt` writes a make_step that takes both: built up front when it is told the dtype
and device (the kit tells it), at its first step otherwise (a caller that gives the shapes
alone, as ``ringviz.hf``'s seam).
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringviz import RingKVCache
from ringviz.cache import MakeStep, Step
from ringviz.checks import check_int

BUILD_KEYWORDS = ("dtype", "device")  # the keywords added to the four shapes


@dataclass(frozen=True)
class StepSpec:
    """What a make_step is told: the shapes of the step's tensors, their dtype and device."""

    batch_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def shapes(self) -> dict[str, int]:
        """The four shape keywords every make_step takes."""
        return {"batch_size": self.batch_size, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}

    def ring(self, window: int, **kw) -> RingKVCache:
        """A :class:`~ringviz.RingKVCache` of ``window`` for these keys (``kw``: sinks,
        capacity)."""
        return RingKVCache(self.batch_size, self.num_kv_heads, window, self.head_dim,
                           dtype=self.dtype, device=self.device, **kw)


def build_keywords(make_step: Callable[..., object]) -> tuple[str, ...]:
    """Which of ``dtype``, ``device`` ``make_step`` takes: those it names, both for
    ``**kwargs``, both when its signature cannot be read (the whole contract)."""
    try:
        params = inspect.signature(make_step).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return BUILD_KEYWORDS
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return BUILD_KEYWORDS
    named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return tuple(k for k in BUILD_KEYWORDS if k in named)


def build_hint(make_step: Callable[..., object], err: BaseException) -> str:
    """What to do when ``make_step`` took ``**kwargs`` and passed the kit's ``dtype`` or
    ``device`` on to a builder that takes neither (else ``""``)."""
    text = str(err)
    passed = [k for k in BUILD_KEYWORDS if f"keyword argument '{k}'" in text]
    try:
        params = inspect.signature(make_step).parameters.values()
    except (TypeError, ValueError):
        return ""
    if not (isinstance(err, TypeError) and passed
            and any(p.kind is p.VAR_KEYWORD for p in params)):
        return ""
    return "\n" + textwrap.fill(
        f"make_step takes **kwargs, so the kit passed it {' and '.join(BUILD_KEYWORDS)} "
        f"besides the four shapes, and it handed them on to a builder that does not take "
        f"{passed[0]!r}. Two ways out: forward them to a builder that takes them (every "
        f"factory in ringviz.conformance.adapters does, and builds its storage up front), "
        f"or name the four shapes, make_step(*, batch_size, num_heads, num_kv_heads, "
        f"head_dim), and the kit passes those alone.", width=92, initial_indent="  hint: ",
        subsequent_indent="  ")


def make(make_step: MakeStep, spec: StepSpec) -> Step:
    """Call ``make_step`` with the four shapes, and ``dtype`` and ``device`` if it takes them."""
    extra = {k: getattr(spec, k) for k in build_keywords(make_step)}
    return make_step(**spec.shapes(), **extra)


def _check_build(dtype: object, device: object) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    if device is not None and not isinstance(device, (torch.device, str)):
        raise TypeError(f"device must be a torch.device, a str or None, got "
                        f"{type(device).__name__}")


def prebuilt(build: Callable[[StepSpec], Step]) -> MakeStep:
    """A make_step from ``build(spec) -> step``: built at once when given ``dtype`` and
    ``device``, else at the first step, from its keys' dtype and device (either one given
    wins over the keys').

    >>> calls = []
    >>> make_step = prebuilt(lambda spec: calls.append(spec.dtype) or (lambda q, k, v, p: q))
    >>> step = make_step(batch_size=1, num_heads=2, num_kv_heads=1, head_dim=8,
    ...                  dtype=torch.float32, device="cpu")
    >>> calls
    [torch.float32]
    """
    def make_step(*, batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> Step:
        for name, value in (("batch_size", batch_size), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(name, value)
        _check_build(dtype, device)

        def spec(k: torch.Tensor | None) -> StepSpec:
            return StepSpec(batch_size, num_heads, num_kv_heads, head_dim,
                            k.dtype if dtype is None else dtype,
                            k.device if device is None else torch.device(device))

        if dtype is not None and device is not None:
            return build(spec(None))
        made: list[Step] = []

        def step(q, k, v, positions):
            if not made:
                made.append(build(spec(k)))
            return made[0](q, k, v, positions)

        return step

    return make_step
