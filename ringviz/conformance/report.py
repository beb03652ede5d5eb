"""What a conformance check returns: a :class:`Report` of :class:`Failure` s, readable, JSON-able.

A failure names the property it breaks:

* ``"window"``: a real query saw another set of keys than its window (``expected`` vs ``seen``,
  sorted key positions of its own row, and :meth:`Failure.difference` between them; ``-1``
  counts a key that holds no token of the row: an empty slot, a padding token or a zero vector;
  ``other_rows`` lists keys of other rows as ``(row, position)``; ``forgotten``, the seen keys
  a rewind had forgotten). ``expected_mask`` and ``seen_mask`` are the whole row's query x key
  grids for the failing schedule (by fed column: by position unless it rewinds),
  ``seen_blank`` and ``seen_other_rows`` each query's count of keys outside them.
* ``"padding"``: a padding query (position -1: a ragged row's left padding, or with
  ``padding="any"`` its right padding and mid-row gaps) output a NaN or an inf
  (``bad_value``). Its output may be anything else, but it must be finite: the next layer
  mixes it into every real token of the row (chapter 5). Only ragged checks have padding.
* ``"values"``: a real query saw the right keys, but its output is off a float64 softmax over
  them by ``max_error``, more than the dtype allows.
* ``"error"``: the step raised, or returned something that is not a ``(B, Hq, T, D)`` tensor
  (``message`` holds the exception text and the innermost frames of its traceback); also a
  cache that answers the same schedule two ways.

Each carries the shrunk schedule that shows it and where (:class:`Failure`'s fields). A report
lists every property broken, each with its own smallest schedule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from ringviz.conformance.schedule import Rewind

PROPERTIES = ("window", "padding", "values", "error")
# what -1 means wherever a report shows it
BLANK = "-1: holds no token of the row (an empty slot, a padding token or a zero vector)"
PADDING = ("-1: a padding token; its output may be anything finite, but a NaN or inf would reach "
           "every real token through the next layer")
FLOAT32_HINT_BELOW = 1e-4  # a "values" error under this, at float64, is float32 rounding


@dataclass(frozen=True)
class Failure:
    """One property a cache breaks, with the smallest schedule hypothesis found that shows it."""

    property: str
    schedule: list[int]  # chunk sizes
    offsets: list[int]  # each row's left padding
    message: str
    step: int | None = None  # index of the chunk in ``schedule`` where it shows
    row: int | None = None
    position: int | None = None
    # the query's index in its row: tokens fed before it, padding and re-fed tokens included
    column: int | None = None
    expected: list[int] | None = None
    seen: list[int] | None = None
    other_rows: list[tuple[int, int]] = field(default_factory=list)
    max_error: float | None = None
    expected_mask: list[list[bool]] | None = None  # (queries, keys) of ``row``, by position
    seen_mask: list[list[bool]] | None = None
    seen_blank: list[int] | None = None  # per query of ``row``: keys holding no token of it
    seen_other_rows: list[int] | None = None  # per query of ``row``: keys of other rows
    bad_value: str | None = None  # "padding": "nan" or "inf"
    rewinds: list[Rewind] = field(default_factory=list)  # the schedule's rewinds
    forgotten: list[int] | None = None  # "window": seen keys that a rewind forgot
    pads: list[list[int]] = field(default_factory=list)  # per row: pad columns after its start

    def __post_init__(self) -> None:
        if self.property not in PROPERTIES:
            raise ValueError(f"property must be one of {PROPERTIES}, got {self.property!r}")

    def where(self) -> str:
        """Schedule (and offsets, for a ragged batch; each row's positions where rows pad
        after they start) in words."""
        text = f"chunks {self.schedule}"
        if any(self.offsets):
            text += f", rows start at columns {self.offsets}"
        if any(self.pads):
            text += ", rows pad after they start: positions " + "; ".join(
                f"row {b} {row}" for b, row in enumerate(self.positions()))
        for r in self.rewinds:
            text += f", {Rewind(*r)}"
        return text

    def positions(self) -> list[list[int]]:
        """Each row's position per column (-1: padding), the layout the schedule drew."""
        from ringviz.conformance.schedule import Schedule

        return Schedule(tuple(self.schedule), tuple(self.offsets), tuple(self.rewinds),
                        tuple(map(tuple, self.pads))).positions().tolist()

    def difference(self) -> tuple[list[int], list[int]]:
        """``(missing, extra)``: expected keys not seen, seen keys not expected (with repeats)."""
        expected, seen = Counter(self.expected or []), Counter(self.seen or [])
        return sorted((expected - seen).elements()), sorted((seen - expected).elements())

    def _query(self) -> str:
        """Which query, in words: row, position, column, chunk."""
        return (f"row {self.row}, query at position {self.position} (column {self.column}, "
                f"chunk {self.step})")

    def _window_text(self) -> list[str]:
        missing, extra = self.difference()
        lines = [self._query(), f"expected keys {self.expected}", f"saw keys      {self.seen}",
                 f"missing {missing or 'none'}, extra {extra or 'none'}"]
        if self.forgotten:
            lines.append(f"still seen, though a rewind took them back (the rejected keys, not "
                         f"ones written since) {self.forgotten}")
        if self.other_rows:
            lines.append(f"and keys of other rows (row, position) {self.other_rows}")
        if -1 in (self.seen or []) or any(p == -1 for _, p in self.other_rows):
            lines.append(BLANK)
        return lines

    def __str__(self) -> str:
        head = f"{self.property}: {self.where()}"
        if self.property == "window":
            lines = self._window_text()
        elif self.property == "padding":
            lines = [f"{self._query()}: its output holds {self.bad_value} ({self.message})",
                     PADDING]
        elif self.property == "values":
            lines = [f"{self._query()}: the right keys, but",
                     f"|out - softmax reference| = {self.max_error:.3g}"]
        else:
            lines = [f"chunk {self.step}: {self.message}"]
        return "\n".join([head] + ["  " + line for line in lines])


@dataclass(frozen=True)
class Report:
    """Result of :func:`ringviz.conformance.check`: ``ok`` when no schedule broke a property."""

    failures: list[Failure]
    examples: int  # schedules run, shrinking included
    window: int
    skipped: int = 0  # schedules the cache declined by design (Unsupported), among examples
    sinks: int = 0
    batch_size: int = 1
    ragged: bool = False
    max_chunk: int | None = None
    seed: int = 0
    name: str = ""
    dtype: str = "float64"  # the dtype the check ran in
    rewind: bool = False  # schedules rewound (the step's rewind(n) was checked)
    layout: str = "padded"  # how chunks were handed over: "padded" or "rows"
    padding: str = "left"  # where rows pad: "left" (before they start) or "any"

    @property
    def ok(self) -> bool:
        return not self.failures

    def properties(self) -> list[str]:
        """The properties broken, in the order window, padding, values, error."""
        return [p for p in PROPERTIES if any(f.property == p for f in self.failures)]

    def options(self) -> str:
        """The setting's options that are on, for its text: ``", chunks <= 4, rewinds"``."""
        return ((f", chunks <= {self.max_chunk}" if self.max_chunk else "")
                + (", rewinds" if self.rewind else "")
                + (", padding anywhere" if self.padding == "any" else "")
                + (", rows layout" if self.layout == "rows" else ""))

    def to_dict(self) -> dict:
        """Plain data (for ``--json``)."""
        return {"name": self.name, "ok": self.ok, "examples": self.examples,
                "window": self.window, "sinks": self.sinks, "batch_size": self.batch_size,
                "ragged": self.ragged, "max_chunk": self.max_chunk, "seed": self.seed,
                "skipped": self.skipped, "dtype": self.dtype, "rewind": self.rewind,
                "layout": self.layout, "padding": self.padding,
                "failures": [asdict(f) for f in self.failures]}

    def __str__(self) -> str:
        # the setting as keyword values (W=8): "window" alone is also a property's name
        what = (f"{self.name + ': ' if self.name else ''}W={self.window}, sinks={self.sinks}, "
                f"batch={self.batch_size}{' ragged' if self.ragged else ''}{self.options()}")
        declined = f" ({self.skipped} declined by the cache)" if self.skipped else ""
        if self.ok:
            return (f"PASS {what}: {self.examples} schedules{declined}, every query saw its "
                    f"window")
        lines = [f"FAIL {what}: {len(self.failures)} propert"
                 f"{'y' if len(self.failures) == 1 else 'ies'} broken in {self.examples} "
                 f"schedules{declined}"]
        lines += [str(f) for f in self.failures]
        hint = self.hint()
        return "\n".join(lines + ([f"hint: {hint}"] if hint else []))

    def hint(self) -> str | None:
        """What to try when a float64 check fails "values" alone by float32 rounding."""
        if self.properties() != ["values"] or self.dtype != "float64":
            return None
        error = self.failures[0].max_error
        if error is None or error >= FLOAT32_HINT_BELOW:
            return None
        return (f"the outputs are off by {error:.2g} only, float32 rounding: a cache that "
                f"computes in float32 cannot do better; check it at its own precision with "
                f"dtype=torch.float32")
