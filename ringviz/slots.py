"""Where a position lives in a ring, and which keys a step sees: functions of positions alone.

A ring row is ``[ S sink slots | C ring slots | spare ]``. :func:`home_slots` is the one slot
rule (``RingKVCache.write`` stores by it); :func:`step_key_positions` predicts the positions of
the keys a step attends over, before anything is written, so a mask can be built once for every
layer that shares it (``ringviz.hf``'s forward plan) and still equal the ring's own.
"""

from __future__ import annotations

import torch


def home_slots(positions: torch.Tensor, sinks: int, capacity: int) -> torch.Tensor:
    """The slot position ``pos`` is stored in: a sink's own slot ``pos`` if ``pos < sinks``,
    else ``sinks + pos % capacity`` (``pos % capacity`` without sinks).

    >>> home_slots(torch.tensor([0, 1, 5, 9]), sinks=2, capacity=4).tolist()
    [0, 1, 3, 3]
    """
    if not sinks:
        return positions % capacity
    return torch.where(positions < sinks, positions, sinks + positions % capacity)


def chunk_key_positions(stored: torch.Tensor, positions: torch.Tensor, sinks: int
                        ) -> torch.Tensor:
    """Positions ``(B, S + C + T)`` of ``RingKVCache.keys_with_chunk``'s keys.

    ``stored`` ``(B, S + C)`` is what the slots hold, ``positions`` ``(B, T)`` the chunk's. With
    sinks, the chunk's sink tokens take their sink columns and read -1 in the chunk part. A
    function of positions alone, so a mask can be built before the ring's storage exists.

    >>> chunk_key_positions(torch.full((1, 4), -1), torch.tensor([[0, 1, 2]]), sinks=1).tolist()
    [[0, -1, -1, -1, -1, 1, 2]]
    """
    positions = positions.to(torch.int64)
    if not sinks:
        return torch.cat([stored, positions], dim=1)
    B = stored.shape[0]
    slot = torch.where((positions >= 0) & (positions < sinks), positions, sinks)  # sinks: scratch
    scratch = torch.full((B, 1), -1, dtype=torch.int64, device=stored.device)
    sink_pos = torch.cat([stored[:, :sinks], scratch], dim=1).scatter_(1, slot, positions)
    return torch.cat([sink_pos[:, :sinks], stored[:, sinks:],
                      positions.masked_fill(positions < sinks, -1)], dim=1)


def step_key_positions(stored: torch.Tensor | None, q_positions: torch.Tensor, sinks: int,
                       capacity: int) -> torch.Tensor:
    """Positions ``(B, K)`` of the keys a ring step attends over, from positions alone.

    ``stored`` ``(B, S + C)`` is what the slots hold (None: an empty ring not yet allocated).
    Decode (``T == 1``): the slots as they will be once the query is written (its home slot
    holds it). A chunk: :func:`chunk_key_positions`, or the chunk alone into an empty ring
    without sinks (one host sync, asked for chunks only). So one mask can be built before the
    write, once for every layer that shares it.

    >>> step_key_positions(torch.tensor([[4, 1, 2, 3]]), torch.tensor([[5]]), 0, 4).tolist()
    [[4, 5, 2, 3]]
    """
    q_positions = q_positions.to(torch.int64)
    B, T = q_positions.shape
    empty = stored is None or (T > 1 and not bool((stored >= 0).any()))
    if T > 1 and empty and not sinks:
        return q_positions
    if stored is None:
        stored = torch.full((B, sinks + capacity), -1, dtype=torch.int64,
                            device=q_positions.device)
    if T > 1:
        return chunk_key_positions(stored, q_positions, sinks)
    slots = torch.arange(stored.shape[1], device=stored.device)
    home = home_slots(q_positions, sinks, capacity)  # (B, 1); a padding query writes nothing
    return torch.where((slots == home) & (q_positions >= 0), q_positions, stored)
