"""Pictures and steppers for ringviz: they draw traces, never compute ring state themselves.

Usage in a chapter::

    import ringviz.book as viz
    from ringviz.book.trace import Scenario, trace_ring, trace_scenario, trace_shift
    viz.set_style()                                   # once, first cell
    stepper = viz.RingStepper.from_scenario(window=8, prompt=13, chunk=None, decode_steps=4)
    stepper                                           # the widget; then, in the next cell,
    stepper.static_figure()                           # the same frames for print/static readers
    viz.RingStepper.from_scenario(window=4, prompt=7, chunk=3, batch_lengths=(7, 2, 5))
    viz.RingStepper(trace_ring(window=4, tokens=11), show_band=False)  # any trace
    viz.RingStepper.from_scenario(window=4, prompt=10, chunk=3,
                                  vary={"window": (3, 4, 5), "chunk": (2, 3, None)})
                                                      # drop-downs over precomputed traces
    viz.RingStepper.from_ring(window=4, tokens=11, vary={"window": range(2, 9)})
    viz.interactive_stepper(window=8, prompt=12)      # live: sliders rebuild the trace

    t = trace_scenario(Scenario(window=8, prompt=13))
    viz.draw_ring_row(t, frame=1); viz.draw_ring_circle(t, frame=1); viz.draw_batch(t)
    viz.draw_ring_and_shift(trace_ring(4, 6), trace_shift(4, 6))
    viz.draw_chunk_keys(t, frame=2)                   # a chunk's [ring | chunk] keys + mask
    viz.draw_padded_batch(pos_bt, cache.positions, window=4)  # (B, T) positions -> rings
    viz.draw_decode_mask(query_pos=9, positions=[8, 9, 2, 3], window=4)
    viz.draw_band_mask(range(4, 8), range(0, 8), window=4)
    viz.draw_rope_angles(t, frame=-1)
    viz.draw_rotation(query_pos=9, key_pos=6, window=4)  # RoPE at position vs at slot
    viz.plot_memory([{"cache": "ring", "tokens": 64, "bytes": 4096}, ...])
    viz.plot_latency([{"method": "ring", "window": 512, "ms_per_token": 0.2}, ...])

All drawing functions take ``ax=None`` and return the axes (``draw_frames`` and
``draw_ring_and_shift`` return a figure). In the rendered book the stepper runs from its
embedded state with JavaScript served by the book itself (see ``web/``).
"""

from ringviz.book.draw import (
    draw_batch,
    draw_chunk_keys,
    draw_frames,
    draw_padded_batch,
    draw_ring_and_shift,
    draw_ring_circle,
    draw_ring_row,
)
from ringviz.book.plots import (
    draw_band_mask,
    draw_decode_mask,
    draw_rope_angles,
    draw_rotation,
    plot_latency,
    plot_memory,
)
from ringviz.book.stepper import Controls, RingStepper, interactive_stepper
from ringviz.book.style import OKABE_ITO, STATE_COLORS, set_style

__all__ = [
    "OKABE_ITO",
    "STATE_COLORS",
    "Controls",
    "RingStepper",
    "draw_band_mask",
    "draw_batch",
    "draw_chunk_keys",
    "draw_decode_mask",
    "draw_frames",
    "draw_padded_batch",
    "draw_ring_and_shift",
    "draw_ring_circle",
    "draw_ring_row",
    "draw_rope_angles",
    "draw_rotation",
    "interactive_stepper",
    "plot_latency",
    "plot_memory",
    "set_style",
]
