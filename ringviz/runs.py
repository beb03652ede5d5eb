"""What a ring knows on the host about its rows, from what each call told it.

A decode loop must not read the ring back to decide things: on a GPU every read is a host sync.
So :class:`~ringviz.RingKVCache` keeps, beside its tensors, what its calls have already told
the host:

* each row's **run**, how many of its newest positions are consecutive (up to ``capacity``):
  a ring whose every row's run is ``capacity`` holds exactly each row's last ``capacity``
  positions, and a decode step at the next positions needs no mask (chapter 9);
* each row's **newest position** as Python ints, so a decode write can pick its slot
  ``pos % capacity`` on the host, and one strided copy stores it.

A validated call learns both in the one host read its validation makes anyway. A trusted call
(``check=False``) is never read: vouched with ``contiguous=True`` to be every row's next
positions it adds to the runs, but its newest positions stay unknown, so its slots are computed
on the device and a CUDA graph that captures it stays right on replay. ``truncate`` and
``take_rows`` forget what they cannot know.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ringviz.checks import check_positions


class Told(NamedTuple):
    """What one call tells a cache about its rows.

    ``grow > 0``: the call's ``grow`` tokens are every row's next positions (``next``);
    ``rows``: each row's run after the call, found on the device by validation; neither: the
    positions were not looked at (a trusted call), so nothing is known. ``newest``: each row's
    newest position after the call, on the host, when known. (A tuple: made in every decode
    step, where a frozen dataclass's construction costs a few microseconds more.)
    """

    grow: int = 0
    rows: torch.Tensor | None = None  # (B,)
    least: int = 0  # smallest run after the call (host)
    newest: list[int] | None = None  # (B,) host ints

    @property
    def next(self) -> bool:
        return self.grow > 0


class Runs:
    """Each row's run and newest position, as far as the calls so far have told.

    ``least``, the smallest run over the rows, and ``newest`` are host values, never read back
    in a decode step: a call at every row's next positions adds its T tokens to every run and
    touches no tensor; another validated call computes the runs on the device and reads their
    minimum, and the rows' newest positions, in its validation's one sync.
    """

    def __init__(self, batch_size: int, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.least = 0
        self.newest: list[int] | None = [-1] * batch_size  # an empty ring's, known
        self._rows = torch.zeros(batch_size, dtype=torch.int64, device=device)  # at last look
        self._since = 0  # tokens every row has grown by since then
        self._known = False  # whether _rows holds runs (else they are read as 0)

    def grown(self, T: int) -> Told:
        """A trusted call of ``T`` tokens, vouched to be every row's next positions.

        The newest positions are then not known: a trusted call's values are not read, and a
        slot picked on the host would be baked into a CUDA graph that captured the call.
        """
        return Told(grow=T, least=min(self.capacity, self.least + T))

    def validated(self, positions: torch.Tensor, last_pos: torch.Tensor, T: int) -> Told:
        """:func:`ringviz.checks.check_positions` of ``positions`` (B, T) after rows whose
        newest are ``last_pos`` (B,), and what they tell, in one host sync when valid."""
        if T == 1 and positions.dtype in (torch.int64, torch.int32) \
                and positions.shape == last_pos.shape + (1,):  # the decode loop's case
            if self.newest is None:  # one read, of both
                new, last = torch.stack([positions[:, 0].to(torch.int64), last_pos]).tolist()
            else:
                new, last = [p for (p,) in positions.tolist()], self.newest
            if all(p == q + 1 for p, q in zip(new, last, strict=True)):
                return Told(grow=1, least=min(self.capacity, self.least + 1), newest=new)
        pos = positions.to(torch.int64)
        runs: list[torch.Tensor] = []

        def runs_after(before: torch.Tensor) -> torch.Tensor:
            runs.append(self._after(pos, before))
            newest = torch.maximum(before[:, -1], pos[:, -1])  # padding (-1) never above
            return torch.cat([runs[0].min()[None], newest])

        least, *newest = check_positions(positions, last_pos, T, also=runs_after)
        return Told(rows=runs[0], least=least, newest=newest)

    def _after(self, positions: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """``(B,)`` runs once validated ``positions`` (B, T) are written; ``before`` (B, T) is
        each token's previous position in its row (-1 for none)."""
        real = positions >= 0
        gap = real & (positions != before + 1)  # a real token not right after its row's last
        seg = gap.cumsum(dim=1)  # (B, T): gaps so far
        tail = (real & (seg == seg[:, -1:])).sum(dim=1)  # real tokens from the last gap on
        now = (self._rows if self._known else torch.zeros_like(self._rows)) + self._since
        return torch.where(seg[:, -1] == 0, now + tail, tail).clamp_max(self.capacity)

    def commit(self, told: Told) -> None:
        """Take what a call that has now been written told."""
        if told.next:
            self._since += told.grow
        elif told.rows is not None:
            self._rows.copy_(told.rows)
            self._since, self._known = 0, True
        else:
            self._since, self._known = 0, False
        self.least, self.newest = told.least, told.newest

    def forget(self) -> None:
        self.commit(Told())

    def reset(self) -> None:
        """Every row empty again."""
        self.commit(Told(newest=[-1] * self._rows.shape[0]))

    def take_rows(self, index: torch.Tensor) -> None:
        """Rows rearranged (repeated, selected): each row's run goes with it; ``least`` stays
        a lower bound (the smallest of some of the same runs); the newest are forgotten."""
        self._rows = self._rows.index_select(0, index)
        self.newest = None
