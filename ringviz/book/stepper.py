"""The ring stepper: traces in synced traits, stepped and selected by a plain-JavaScript SVG view.

Every trace the stepper can show lives in the ``views`` and ``frames`` traits, so the saved
notebook embeds them and the rendered book steps through them with no kernel. Frames repeat a lot
across a grid (the empty start, decode steps after equal prompts), so each distinct frame is
stored once in ``frames`` and a view lists indices into it. A stepper built with ``vary=`` holds
one trace per point of a parameter grid (all computed here, in Python, by the real caches); the
page's drop-downs only pick which precomputed trace to draw. ``frame`` and ``choice`` are the
only things that change. :class:`Controls` adds ipywidgets sliders that rebuild the trace in
Python for any value (live kernel only).
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
from collections.abc import Callable, Mapping, Sequence

import anywidget
import ipywidgets as widgets
import traitlets
from matplotlib.figure import Figure

from ringviz.book.draw import draw_frames
from ringviz.book.style import EDGE_COLOR, EVICT_COLOR, START_COLOR, STATE_COLORS, WRITE_COLOR
from ringviz.book.trace import Scenario, Trace, trace_ring, trace_scenario

_HERE = pathlib.Path(__file__).parent
COLORS = {**STATE_COLORS, "write": WRITE_COLOR, "start": START_COLOR, "evict": EVICT_COLOR,
          "edge": EDGE_COLOR}
MAX_GRID = 96  # traces per stepper: each one is embedded in the page
# frame fields the view takes as they are (masks and slot states it gets compacted)
VIEW_FIELDS = ("caption", "arithmetic", "positions", "start", "written", "evicted", "queries",
               "keys")
STATE_LETTERS = {"visible": "v", "stale": "s", "future": "f", "empty": "e", "sink": "k"}
LABELS = {"window": "window W", "tokens": "tokens", "prompt": "prompt tokens",
          "chunk": "chunk size", "decode_steps": "decode steps", "batch_lengths": "row lengths",
          "sinks": "sink slots S"}


def view(trace: Trace) -> dict:
    """What the JavaScript view draws of a trace, compactly: masks as '0'/'1' strings per query,
    slot states as one letter per slot (``v``isible, ``s``tale, ``f``uture, ``e``mpty, sin``k``).
    ``"sinks"`` says how many of a frame's first slots are sink slots (0: a plain ring).

    >>> v = view(trace_ring(window=2, tokens=3))
    >>> v["frames"][-1]["positions"], v["frames"][-1]["states"], v["frames"][-1]["band"]
    ([[2, 1]], ['vv'], [['11']])
    """
    frames = [{
        **{name: getattr(f, name) for name in VIEW_FIELDS},
        "band": [["".join("1" if b else "0" for b in q) for q in row] for row in f.band],
        "states": ["".join(STATE_LETTERS[s] for s in row) for row in f.slot_state],
    } for f in trace.frames]
    return {"layout": trace.layout, "window": trace.window, "rows": trace.rows,
            "sinks": trace.scenario.get("sinks", 0), "frames": frames}


def pack(views: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """Store each distinct frame once: ``(frames, views)`` with ``view["frames"]`` as indices.

    >>> frames, views = pack([view(trace_ring(2, 1)), view(trace_ring(2, 2))])
    >>> len(frames), [v["frames"] for v in views]
    (3, [[0, 1], [0, 1, 2]])
    """
    table: list[dict] = []
    index: dict[str, int] = {}
    packed = []
    for v in views:
        ids = []
        for f in v["frames"]:
            key = json.dumps(f, sort_keys=True)
            if key not in index:
                index[key] = len(table)
                table.append(f)
            ids.append(index[key])
        packed.append({**v, "frames": ids})
    return table, packed


def unpack(frames: Sequence[dict], views: Sequence[dict]) -> list[dict]:
    """The inverse of :func:`pack` (what the JavaScript view does to draw a trace)."""
    return [{**v, "frames": [frames[i] for i in v["frames"]]} for v in views]


def _pack_traces(traces: Sequence[Trace]) -> tuple[list[dict], list[dict]]:
    """:func:`pack` the traces' views, after checking that they are traces."""
    for t in traces:
        if not isinstance(t, Trace):
            raise TypeError(f"trace must be a ringviz.book.trace.Trace, got {type(t).__name__}")
    return pack([view(t) for t in traces])


def _label(value: object) -> str:
    """How a grid value reads in a drop-down: a ``None`` chunk is "all", tuples are listed."""
    if value is None:
        return "all"  # short: a drop-down is as wide as its longest option
    if isinstance(value, tuple | list):
        return ", ".join(map(str, value))
    return str(value)


class RingStepper(anywidget.AnyWidget):
    """Step through a trace: prev / next / play, a slider, a caption per step, and (with
    ``vary=``) drop-downs that switch between traces precomputed for a parameter grid.

    Keys (listed under the drawing): Left/Right step the stepper on screen with no click first,
    unless a text field or a drop-down elsewhere on the page has focus; the stepper's own
    drop-down keeps Up/Down and passes Left/Right on. Home/End jump to the first/last step and
    Space plays, once the stepper has focus (an arrow press gives it). Focus draws an outline.

    Used in chapters 3 (ring indexing), 5 (masks), 6 (prefill), 7 (batching) and 8 (sinks).
    """

    _esm = _HERE / "stepper.js"
    _css = _HERE / "stepper.css"
    frames = traitlets.List().tag(sync=True)  # every distinct frame of the grid, once
    views = traitlets.List().tag(sync=True)  # per grid point: view(trace), frames as indices
    params = traitlets.List().tag(sync=True)  # [{"name", "label", "values": [str]}], grid axes
    choice = traitlets.Int(0).tag(sync=True)  # index into views (row-major over params)
    frame = traitlets.Int(0).tag(sync=True)  # index of the frame on screen
    colors = traitlets.Dict(COLORS).tag(sync=True)  # the matplotlib figures' palette
    show_circle = traitlets.Bool(True).tag(sync=True)  # also draw a one-row ring as a circle
    show_band = traitlets.Bool(True).tag(sync=True)  # draw the step's query x key mask

    def __init__(self, trace: Trace | Sequence[Trace], *, params: Sequence[dict] = (),
                 choice: int = 0, **kwargs: object) -> None:
        traces = [trace] if isinstance(trace, Trace) else list(trace)
        frames, views = _pack_traces(traces)
        size = math.prod(len(p["values"]) for p in params)
        if not traces or len(traces) != size:
            raise ValueError(f"{len(traces)} traces for a grid of {size} points")
        self._traces = traces
        super().__init__(frames=frames, views=views, params=list(params), choice=choice,
                         **kwargs)

    @classmethod
    def grid(cls, build: Callable[..., Trace], settings: Mapping[str, object],
             vary: Mapping[str, Sequence[object]] | None = None,
             **kwargs: object) -> RingStepper:
        """One trace per combination of ``vary``'s values, built by ``build(**settings)``.

        ``settings`` are the values shown first; each varied one must be among its values.
        The grid is computed here (Python, the real caches); the page only selects from it.
        """
        vary = dict(vary or {})
        axes = [(name, list(values)) for name, values in vary.items()]
        for name, values in axes:
            if name not in settings:
                raise ValueError(f"vary names {name!r}, which the settings do not set")
            if not values or len(set(map(_label, values))) != len(values):
                raise ValueError(f"vary[{name!r}] needs distinct values, got {values}")
            if settings[name] not in values:
                raise ValueError(f"{name}={settings[name]!r} is not among vary[{name!r}] = "
                                 f"{values}")
        size = math.prod(len(values) for _, values in axes)
        if size > MAX_GRID:
            raise ValueError(f"a grid of {size} traces is too heavy for a page (at most "
                             f"{MAX_GRID})")
        traces, choice = [], 0
        for i, combo in enumerate(itertools.product(*(values for _, values in axes))):
            point = {**settings, **dict(zip(vary, combo, strict=True))}
            traces.append(build(**point))
            if all(point[name] == settings[name] for name in vary):
                choice = i
        params = [{"name": name, "label": LABELS.get(name, name),
                   "values": [_label(v) for v in values]} for name, values in axes]
        return cls(traces, params=params, choice=choice, **kwargs)

    @classmethod
    def from_scenario(cls, *, window: int = 8, prompt: int = 12, chunk: int | None = None,
                      decode_steps: int = 4, batch_lengths: tuple[int, ...] | None = None,
                      sinks: int = 0, vary: Mapping[str, Sequence[object]] | None = None,
                      **kwargs: object) -> RingStepper:
        """Run :class:`ringviz.book.trace.Scenario` (each point of ``vary``) through the real cache.

        ``vary={"window": (3, 4, 5), "chunk": (2, 3, None)}`` embeds 9 traces and adds two
        drop-downs to the page; ``sinks=S`` draws the cache's S sink slots beside the ring.
        """
        settings = dict(window=window, prompt=prompt, chunk=chunk, decode_steps=decode_steps,
                        batch_lengths=batch_lengths, sinks=sinks)
        return cls.grid(lambda **s: trace_scenario(Scenario(**s)), settings, vary, **kwargs)

    @classmethod
    def from_ring(cls, *, window: int = 4, tokens: int = 11,
                  vary: Mapping[str, Sequence[object]] | None = None,
                  **kwargs: object) -> RingStepper:
        """Push tokens into the teaching :class:`ringviz.RingKV` (each point of ``vary``)."""
        return cls.grid(trace_ring, dict(window=window, tokens=tokens), vary, **kwargs)

    @traitlets.validate("choice")
    def _valid_choice(self, proposal: dict) -> int:
        if not 0 <= proposal["value"] < len(self.views):
            raise traitlets.TraitError(f"choice must be in 0..{len(self.views) - 1}, "
                                       f"got {proposal['value']}")
        return proposal["value"]

    @traitlets.validate("frame")
    def _valid_frame(self, proposal: dict) -> int:
        n = len(self.views[self.choice]["frames"]) if self.views else 0
        if not 0 <= proposal["value"] < max(n, 1):
            raise traitlets.TraitError(f"frame must be in 0..{n - 1}, got {proposal['value']}")
        return proposal["value"]

    def show(self, trace: Trace) -> None:
        """Replace the grid by one trace (what :class:`Controls` does on every change)."""
        frames, views = _pack_traces([trace])
        self._traces = [trace]
        with self.hold_trait_notifications():
            self.frame, self.choice, self.params = 0, 0, []
            self.frames, self.views = frames, views

    def to_trace(self) -> Trace:
        """The trace on display (the grid point the drop-downs select)."""
        return self._traces[self.choice]

    def static_figure(self, max_frames: int = 10) -> Figure:
        """The same frames as a matplotlib strip (for print, search and no-JavaScript readers)."""
        return draw_frames(self.to_trace(), max_frames=max_frames)


class Controls(widgets.VBox):
    """Sliders for W, prompt, chunk, decode steps and batch lengths above a live stepper.

    Every change rebuilds the trace in Python from a new :class:`Scenario`; input that makes no
    valid scenario shows its error and leaves the stepper as it was. Needs a kernel (the
    rendered book uses ``RingStepper.from_scenario(vary=...)`` instead).
    """

    def __init__(self, *, window: int = 8, prompt: int = 12, chunk: int | None = None,
                 decode_steps: int = 4, batch_lengths: tuple[int, ...] | None = None) -> None:
        scenario = Scenario(window=window, prompt=prompt, chunk=chunk,
                            decode_steps=decode_steps, batch_lengths=batch_lengths)
        self.stepper = RingStepper(trace_scenario(scenario))
        slider = dict(continuous_update=False, style={"description_width": "110px"})
        self.window = widgets.IntSlider(window, 1, 32, description="window W", **slider)
        self.prompt = widgets.IntSlider(prompt, 1, 64, description="prompt tokens", **slider)
        self.chunk = widgets.IntSlider(chunk or 0, 0, 64, description="chunk (0 = all)",
                                       **slider)
        self.decode_steps = widgets.IntSlider(decode_steps, 0, 32, description="decode steps",
                                              **slider)
        self.batch = widgets.Text(", ".join(map(str, batch_lengths or ())),
                                  description="batch lengths", placeholder="e.g. 12, 7, 3",
                                  continuous_update=False, style=slider["style"])
        self.message = widgets.HTML()
        controls = [self.window, self.prompt, self.chunk, self.decode_steps, self.batch]
        for control in controls:
            control.observe(self.rebuild, names="value")
        super().__init__([*controls, self.message, self.stepper])
        self.rebuild()

    def scenario(self) -> Scenario:
        """The scenario the controls describe (raises ValueError on bad batch lengths)."""
        text = self.batch.value.replace(",", " ").split()
        try:
            lengths = tuple(int(x) for x in text) or None
        except ValueError:
            raise ValueError(f"batch lengths must be integers, got {self.batch.value!r}") from None
        return Scenario(window=self.window.value, prompt=self.prompt.value,
                        chunk=self.chunk.value or None, decode_steps=self.decode_steps.value,
                        batch_lengths=lengths)

    def rebuild(self, change: dict | None = None) -> None:
        """Recompute the trace from the controls; show the error instead if they are invalid."""
        try:
            trace = trace_scenario(self.scenario())
        except (TypeError, ValueError) as err:
            self.message.value = f"<span style='color:{EVICT_COLOR}'>{err}</span>"
            return
        self.message.value = ""
        self.stepper.show(trace)


def interactive_stepper(**scenario: object) -> Controls:
    """Live stepper with controls: ``interactive_stepper(window=8, prompt=12, chunk=4)``."""
    return Controls(**scenario)
