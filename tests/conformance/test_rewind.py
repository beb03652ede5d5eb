"""check(rewind=True): rings that rewind right pass, each way of rewinding wrong is caught."""

import math

import pytest
import torch
from hypothesis import given, settings

from ringviz import band_mask
from ringviz.conformance import Rewind, Schedule, Unsupported, check
from ringviz.conformance.adapters import mlx_rotating, ringviz_draft, ringviz_ring
from ringviz.conformance.peers import run
from ringviz.conformance.probe import evaluate
from ringviz.conformance.schedule import fit_rewinds, schedules


class ToyRing:
    """A batch of rings of ``window + drafts`` slots, masked by stored positions: a chunk
    attends over ``[ring | chunk]``, then each real token goes to slot ``pos % C``.

    ``rewind(n)`` forgets each row's newest ``n`` positions, or raises Unsupported where a
    later token overwrote a key the next query needs. ``bug`` breaks it one way:
    ``"nothing"`` forgets nothing, ``"one_more"`` forgets ``n + 1``, ``"keep_cached"`` moves
    back its counter only and skips a write whose slot already holds that position (the
    forgotten key stays), ``"counter"`` moves back
    the row's counter and reads each slot's position from it (as a ring that stores no
    positions does), leaving a forgotten key in its slot under an older position, and never
    declines.
    """

    def __init__(self, spec: dict, window: int, drafts: int, bug: str | None) -> None:
        B, H, D = spec["batch_size"], spec["num_kv_heads"], spec["head_dim"]
        self.window, self.C, self.bug = window, window + drafts, bug
        store = dict(dtype=spec["dtype"], device=spec["device"])
        self.k, self.v = torch.zeros(B, H, self.C, D, **store), torch.zeros(B, H, self.C, D,
                                                                            **store)
        self.pos = torch.full((B, self.C), -1, device=spec["device"])
        self.length = torch.zeros(B, dtype=torch.int64, device=spec["device"])

    def __call__(self, q, k, v, positions):
        keys, values = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        ring = self.pos.masked_fill(self.pos >= self.length[:, None], -1)  # past the counter
        kpos = torch.cat([ring, positions], 1)
        mask = band_mask(positions, kpos, self.window) & (kpos >= 0)[:, None, :]
        G = q.shape[1] // k.shape[1]
        scores = q @ keys.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
        weights = scores.masked_fill(~mask[:, None], -math.inf).softmax(-1).nan_to_num(0.0)
        for b, t in (positions >= 0).nonzero().tolist():
            p = int(positions[b, t])
            self.length[b] = p + 1
            if self.bug == "keep_cached" and int(self.pos[b, p % self.C]) == p:
                continue  # "already cached"
            self.k[b, :, p % self.C], self.v[b, :, p % self.C] = k[b, :, t], v[b, :, t]
            self.pos[b, p % self.C] = p
        return weights @ values.repeat_interleave(G, 1)

    def rewind(self, n: int) -> None:
        if self.bug == "nothing":
            return
        if self.bug == "keep_cached":
            self.length = self.length - n
            return
        new = (self.length - n - int(self.bug == "one_more")).clamp_min(0)
        if self.bug == "counter":
            slot = torch.arange(self.C, device=new.device)
            last = slot + self.C * torch.div(new[:, None] - 1 - slot, self.C,
                                             rounding_mode="floor")
            self.pos, self.length = last.masked_fill(last < 0, -1), new
            return
        for b, m in enumerate(new.tolist()):
            held = set(self.pos[b].tolist())
            if any(p not in held for p in range(max(0, m - self.window + 1), m)):
                raise Unsupported(f"row {b}: the keys before {m} are overwritten")
        self.pos.masked_fill_(self.pos >= new[:, None], -1)
        self.length = new


def toy(window: int, drafts: int = 2, bug: str | None = None):
    return lambda **spec: ToyRing(spec, window, drafts, bug)


def test_a_ring_that_rewinds_right_passes():
    report = check(toy(5), window=5, batch_size=2, ragged=True, rewind=True, examples=60)
    assert report.ok and report.rewind, str(report)
    assert "rewinds" in str(report).splitlines()[0]


@pytest.mark.parametrize(("sinks", "batch_size", "ragged"),
                         [(0, 1, False), (2, 1, False), (1, 3, True), (0, 2, True)])
def test_ringviz_draft_ring_passes_with_rewinds(sinks, batch_size, ragged):
    report = check(ringviz_draft(5, sinks=sinks), window=5, sinks=sinks,
                   batch_size=batch_size, ragged=ragged, rewind=True, examples=40)
    assert report.ok, str(report)


def test_a_rewind_that_forgets_nothing_is_caught_as_window():
    report = check(toy(5, bug="nothing"), window=5, rewind=True, examples=60)
    assert report.properties() == ["window"], str(report)
    f = report.failures[0]
    assert f.rewinds and f.forgotten, str(f)  # it saw a key a rewind forgot
    missing, extra = f.difference()
    assert set(f.forgotten) <= set(extra)
    assert "rewind" in f.where() and "a rewind took them back" in str(f)


def test_a_rewind_that_forgets_one_too_many_is_caught():
    report = check(toy(5, bug="one_more"), window=5, rewind=True, examples=60)
    assert report.properties() == ["window"], str(report)
    f = report.failures[0]
    missing, extra = f.difference()
    assert missing and not extra and not f.forgotten, str(f)


def test_stale_keys_under_a_rewound_counter_are_caught_after_the_wrap():
    report = check(toy(5, bug="counter"), window=5, rewind=True, examples=50)
    assert report.properties() == ["window"], str(report)
    f = report.failures[0]
    fed = sum(f.schedule[:f.rewinds[0].after + 1])
    assert fed > 5 + 2 and f.forgotten, str(f)  # rewound once its 7 slots had wrapped
    # with draft slots it never wraps in these schedules, and passes
    assert check(toy(5, drafts=40, bug="counter"), window=5, rewind=True, examples=40).ok


def test_rewind_needs_a_rewind_method_and_changes_nothing():
    calls = []

    def make_step(**shape):
        step = ringviz_ring(4)(**shape)
        return lambda *args: calls.append(args) or step(*args)

    with pytest.raises(TypeError, match="rewind"):
        check(make_step, window=4, rewind=True, examples=5)
    assert calls == []  # no schedule ran
    with pytest.raises(TypeError, match="rewind must be a bool"):
        check(toy(4), window=4, rewind=1)


def test_a_rewind_the_cache_declines_is_skipped_and_counted():
    report = check(ringviz_draft(4, drafts=0), window=4, rewind=True, examples=60)
    assert report.ok and report.skipped > 0, str(report)
    assert "declined" in str(report)


def test_a_re_prefill_feeds_the_same_keys_and_a_cache_that_keeps_them_shows_twice():
    s = Schedule((4, 2), rewinds=(Rewind(0, 2, same=True),))
    assert s.token_ids().tolist() == [[0, 1, 2, 3, 2, 3]]
    kw = dict(window=4, sinks=0, dtype=torch.float64, device=torch.device("cpu"), seed=0)
    assert evaluate(toy(4), s, **kw) is None  # same keys: the values run agrees too
    f = evaluate(toy(4, bug="nothing"), s, **kw)
    assert f.property == "window" and f.seen == [0, 1, 2, 2] and f.forgotten == [2]
    new = Schedule((4, 2), rewinds=(Rewind(0, 2),))
    assert new.token_ids().tolist() == [[0, 1, 2, 3, 4, 5]]
    assert evaluate(toy(4, bug="nothing"), new, **kw).forgotten == [2]


def test_a_forgotten_key_kept_in_place_of_a_new_draft_is_caught_by_its_id():
    # keeps a forgotten key when the same position comes again (a prompt cache that believes
    # it holds the token): right for a re-prefill, wrong for a new draft, whose position
    # alone looks right
    kw = dict(window=4, sinks=0, dtype=torch.float64, device=torch.device("cpu"), seed=0)
    same = Schedule((4, 2, 1), rewinds=(Rewind(0, 2, same=True),))
    assert evaluate(toy(4, bug="keep_cached"), same, **kw) is None
    new = Schedule((4, 2, 1), rewinds=(Rewind(0, 2),))
    f = evaluate(toy(4, bug="keep_cached"), new, **kw)
    assert f.property == "window" and f.position == 4 and f.forgotten == [2, 3]
    assert f.seen == f.expected == [1, 2, 3, 4] and f.difference() == ([], [])
    assert "a rewind took them back" in str(f)
    report = check(toy(5, bug="keep_cached"), window=5, rewind=True, examples=60)
    assert report.properties() == ["window"] and report.failures[0].forgotten, str(report)


def test_schedules_rewind_only_where_every_row_holds_the_tokens():
    assert fit_rewinds((3, 2, 2), (0, 2), [(0, 5, False), (1, 1, True), (0, 1, False)]) == \
        (Rewind(0, 1, False), Rewind(1, 1, True))  # cut to row 1's one token; first per chunk
    assert fit_rewinds((1, 2), (0, 1), [(0, 1, False)]) == ()  # row 1 holds nothing yet
    with pytest.raises(ValueError, match="real tokens"):
        Schedule((2, 2), (0, 2), rewinds=((0, 1),))
    with pytest.raises(ValueError, match="after distinct chunks"):
        Schedule((2, 2), rewinds=((1, 1),))  # nothing after it
    with pytest.raises(TypeError, match="n: int"):
        Schedule((2, 2), rewinds=((0, 1.5),))


def test_drawn_schedules_rewind_and_without_rewind_never():
    drawn = []

    @settings(max_examples=40, database=None, derandomize=True)
    @given(schedules(window=4, sinks=1, batch_size=2, ragged=True, rewind=True),
           schedules(window=4, sinks=1, batch_size=2, ragged=True))
    def draw(with_rewinds, without):
        drawn.append(with_rewinds)
        assert not without.rewinds

    draw()
    assert sum(bool(s.rewinds) for s in drawn) > len(drawn) // 2


def test_mlx_rotating_trim_after_the_ring_fills_is_caught():
    # mlx-lm #1423: once offset reaches max_size, is_trimmable() is False and
    # trim_prompt_cache trims nothing; the speculative decoder does not look at the count
    report = check(mlx_rotating(6), window=6, rewind=True, examples=60, dtype=torch.float32)
    assert report.properties() == ["window"], str(report)
    f = report.failures[0]
    assert (f.schedule, f.rewinds) == ([6, 1], [Rewind(0, 1, False)])
    assert f.seen == [1, 2, 3, 4, 5, 5] and f.forgotten == [5]
    step = mlx_rotating(6)(batch_size=1, num_heads=2, num_kv_heads=1, head_dim=8,
                           dtype=torch.float32, device="cpu")
    x = torch.zeros(1, 1, 3, 8)
    for _ in range(2):
        step(torch.zeros(1, 2, 3, 8), x, x, torch.zeros(1, 3, dtype=torch.int64))
        step.rewind(1)
        step(torch.zeros(1, 2, 1, 8), x[:, :, :1], x[:, :, :1],
             torch.zeros(1, 1, dtype=torch.int64))
    assert step.trimmed == [(1, 1), (1, 0)]  # trims before the ring is full, not after


def test_rewind_peers_run_with_rewinds():
    report = run("ringviz_draft", examples=20)
    assert report.ok and report.rewind and report.to_dict()["rewind"] is True
    assert not run("mlx_rotating_rewind", examples=30).ok
