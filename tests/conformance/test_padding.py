"""padding="any": rows that pad after they start (right padding, mid-row gaps). The correct
caches pass; a toy ring with either padding mutant passes under left padding alone and is
caught with a small schedule once rows pad anywhere; a failure names the layout it drew."""

import pytest
import torch

from ringviz.conformance import Schedule, check
from ringviz.conformance.adapters import ringviz_hf, ringviz_ring, ringviz_rows
from ringviz.conformance.seam import StepSpec, prebuilt

W = 4


class ToyRing:
    """A ring of W slots per row, one token at a time (write, then every query at that
    column attends), positions it keeps itself. ``bug``: ``"pad_slot"`` gives a padding token
    after the row's start a slot (it writes an empty key there); ``"offset_once"`` counts a
    row's positions from the columns fed, less its left padding, counted once (a gap after
    the start shifts every later position)."""

    def __init__(self, s: StepSpec, bug: str | None) -> None:
        B, H, D = s.batch_size, s.num_kv_heads, s.head_dim
        self.k = torch.zeros(B, H, W, D, dtype=s.dtype)
        self.v = torch.zeros_like(self.k)
        self.stored = torch.full((B, W), -1)
        self.written = [0] * B  # slots used per row
        self.fed = [0] * B  # columns fed per row, padding included
        self.lead = [0] * B  # left padding, counted until the row's first real token
        self.bug, self.group = bug, s.num_heads // s.num_kv_heads

    def _position(self, b: int, p: int) -> int:
        """The position the cache files row b's token under (-1: it writes nothing)."""
        started = self.fed[b] > self.lead[b]
        self.fed[b] += 1
        if p < 0 and not started:
            self.lead[b] += 1
            return -1
        if self.bug == "offset_once":
            return -1 if p < 0 else self.fed[b] - 1 - self.lead[b]
        if p < 0 and self.bug == "pad_slot":
            return -2  # a slot, but no key
        return p

    def __call__(self, q, k, v, positions):
        B, Hq, T, D = q.shape
        out = torch.zeros_like(q)
        for t in range(T):
            for b in range(B):
                p = self._position(b, int(positions[b, t]))
                if p == -1:
                    continue
                slot = self.written[b] % W
                self.written[b] += 1
                self.k[b, :, slot], self.v[b, :, slot] = (k[b, :, t], v[b, :, t]) if p >= 0 \
                    else (0.0, 0.0)
                self.stored[b, slot] = p
                if p < 0:
                    continue
                seen = (self.stored[b] >= 0) & (p - self.stored[b] < W)
                keys = self.k[b].repeat_interleave(self.group, 0)[:, seen]
                values = self.v[b].repeat_interleave(self.group, 0)[:, seen]
                w = torch.softmax(q[b, :, t, None] @ keys.transpose(-1, -2) * D ** -0.5, -1)
                out[b, :, t] = (w @ values)[:, 0]
        return out


def toy(bug=None):
    return prebuilt(lambda s: ToyRing(s, bug))


def test_the_toy_ring_is_right_with_padding_anywhere():
    assert check(toy(), window=W, batch_size=2, ragged=True, padding="any", examples=60).ok


@pytest.mark.parametrize("bug", ["pad_slot", "offset_once"])
def test_padding_mutants_pass_left_padding_and_are_caught_anywhere(bug):
    assert check(toy(bug), window=W, batch_size=2, ragged=True, examples=60).ok
    report = check(toy(bug), window=W, batch_size=2, ragged=True, padding="any", examples=100)
    assert report.properties() == ["window"], str(report)
    f = report.failures[0]
    assert f.pads[f.row] and sum(f.schedule) <= 3 * W  # a gap in the failing row, a few tokens
    text = str(report)
    assert "padding anywhere" in text and "rows pad after they start: positions" in text
    assert f"row {f.row} {f.positions()[f.row]}" in text  # the layout the kit drew
    assert -1 in f.positions()[f.row][f.positions()[f.row].index(0):]  # a pad after the start


@pytest.mark.parametrize(("name", "make_step", "layout"), [
    ("ringviz_ring", ringviz_ring(6, sinks=2), "padded"),
    ("ringviz_hf", ringviz_hf(6, sinks=2), "padded"),
    ("ringviz_rows", ringviz_rows(6, sinks=2), "rows")])
def test_correct_caches_pass_with_padding_anywhere(name, make_step, layout):
    report = check(make_step, window=6, sinks=2, batch_size=2, ragged=True, padding="any",
                   examples=60, layout=layout)
    assert report.ok and report.padding == "any", str(report)


def test_padding_anywhere_draws_gaps_and_right_padding():
    seen = []

    def record(**shape):
        step = ringviz_ring(W)(**shape)

        def run(q, k, v, positions):
            seen.append(positions.clone())
            return step(q, k, v, positions)

        return run

    check(record, window=W, batch_size=2, ragged=True, padding="any", examples=40)
    rows = [row for p in seen for row in p.tolist()]
    # a pad after a real token within one chunk: a gap or right padding
    assert any(-1 in row[row.index(r):] for row in rows for r in row if r >= 0)


def test_schedule_pads_and_bad_arguments():
    s = Schedule((3, 2), (0, 1), pads=((4,), (2,)))
    assert s.positions().tolist() == [[0, 1, 2, 3, -1], [-1, 0, -1, 1, 2]] and s.gapped
    with pytest.raises(ValueError, match="ragged=True"):
        check(ringviz_ring(W), window=W, padding="any")
    with pytest.raises(ValueError, match="padding must be one of"):
        check(ringviz_ring(W), window=W, padding="right")
    with pytest.raises(ValueError, match="do not combine"):
        check(ringviz_ring(W), window=W, batch_size=2, ragged=True, padding="any", rewind=True)
    with pytest.raises(ValueError, match="pad columns"):
        Schedule((2,), (0,), pads=((5,),))


def test_transformers_layers_window_by_column_so_a_mid_row_pad_costs_a_key():
    """Right under left padding, transformers' sliding layers and masks count the window in
    columns: a pad inside a row takes one of its W places (generate only left-pads)."""
    from ringviz.conformance.adapters import hf_dynamic_sliding

    assert check(hf_dynamic_sliding(6), window=6, batch_size=2, ragged=True, examples=40).ok
    report = check(hf_dynamic_sliding(6), window=6, batch_size=2, ragged=True, padding="any",
                   examples=100)
    f = report.failures[0]
    assert f.property == "window" and f.difference()[1] == [] and len(f.difference()[0]) == 1
    assert f.pads[f.row]
