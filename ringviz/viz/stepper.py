"""The ring stepper: a trace in one synced trait, stepped by a plain-JavaScript SVG view.

The whole trace (every frame) lives in the ``trace`` trait, so the saved notebook embeds it and
the rendered book steps through it with no kernel; ``frame`` is the only thing that changes.
:class:`Controls` adds ipywidgets sliders that rebuild the trace in Python (live kernel only).
"""

from __future__ import annotations

import pathlib

import anywidget
import ipywidgets as widgets
import traitlets
from matplotlib.figure import Figure

from ringviz.trace import Scenario, Trace, trace_scenario
from ringviz.viz.draw import draw_frames
from ringviz.viz.style import EDGE_COLOR, EVICT_COLOR, START_COLOR, STATE_COLORS, WRITE_COLOR

_HERE = pathlib.Path(__file__).parent
COLORS = {**STATE_COLORS, "write": WRITE_COLOR, "start": START_COLOR, "evict": EVICT_COLOR,
          "edge": EDGE_COLOR}


class RingStepper(anywidget.AnyWidget):
    """Step through a trace: prev / next / play, a slider, arrow keys, a caption per step.

    Used in chapters 3 (ring indexing), 5 (masks), 6 (prefill) and 7 (batching).
    """

    _esm = _HERE / "stepper.js"
    _css = _HERE / "stepper.css"
    trace = traitlets.Dict().tag(sync=True)  # Trace.to_dict(): every frame, embedded in the page
    frame = traitlets.Int(0).tag(sync=True)  # index of the frame on screen
    colors = traitlets.Dict(COLORS).tag(sync=True)  # the matplotlib figures' palette
    show_circle = traitlets.Bool(True).tag(sync=True)  # also draw a one-row ring as a circle
    show_band = traitlets.Bool(True).tag(sync=True)  # draw the step's query x key mask

    def __init__(self, trace: Trace, **kwargs: object) -> None:
        if not isinstance(trace, Trace):
            raise TypeError(f"trace must be a ringviz.trace.Trace, got {type(trace).__name__}")
        super().__init__(trace=trace.to_dict(), **kwargs)

    @classmethod
    def from_scenario(cls, *, window: int = 8, prompt: int = 12, chunk: int | None = None,
                      decode_steps: int = 4, batch_lengths: tuple[int, ...] | None = None,
                      **kwargs: object) -> RingStepper:
        """Run a :class:`ringviz.trace.Scenario` through the real cache and step through it."""
        scenario = Scenario(window=window, prompt=prompt, chunk=chunk,
                            decode_steps=decode_steps, batch_lengths=batch_lengths)
        return cls(trace_scenario(scenario), **kwargs)

    @traitlets.validate("frame")
    def _valid_frame(self, proposal: dict) -> int:
        n = len(self.trace.get("frames", ()))
        if not 0 <= proposal["value"] < max(n, 1):
            raise traitlets.TraitError(f"frame must be in 0..{n - 1}, got {proposal['value']}")
        return proposal["value"]

    def to_trace(self) -> Trace:
        """The trace on display, as a :class:`Trace`."""
        return Trace.from_dict(self.trace)

    def static_figure(self, max_frames: int = 10) -> Figure:
        """The same frames as a matplotlib strip (for print, search and no-JavaScript readers)."""
        return draw_frames(self.to_trace(), max_frames=max_frames)


class Controls(widgets.VBox):
    """Sliders for W, prompt, chunk, decode steps and batch lengths above a live stepper.

    Every change rebuilds the trace in Python from a new :class:`Scenario`; input that makes no
    valid scenario shows its error and leaves the stepper as it was. Needs a kernel.
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
        for control in (self.window, self.prompt, self.chunk, self.decode_steps, self.batch):
            control.observe(self.rebuild, names="value")
        super().__init__([self.window, self.prompt, self.chunk, self.decode_steps, self.batch,
                          self.message, self.stepper])
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
        self.stepper.frame = 0
        self.stepper.trace = trace.to_dict()


def interactive_stepper(**scenario: object) -> Controls:
    """Live stepper with controls: ``interactive_stepper(window=8, prompt=12, chunk=4)``."""
    return Controls(**scenario)
