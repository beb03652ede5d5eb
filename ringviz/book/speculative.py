"""Speculative decoding against a ring: what rejected draft tokens break, and two fixes.

One verify cycle, per row: the ring holds the committed positions ``< n``; the target model
checks a chunk of ``T <= k + 1`` tokens at positions ``n .. n + T - 1`` (the token it sampled
last, then ``k`` draft tokens) in one pass; the first ``m`` of them are accepted, the rest
rejected, and the next cycle starts at position ``n + m`` with a different token there.

Writing all ``T`` tokens into a ring of ``W`` slots evicts positions ``n - W .. n + T - 1 - W``.
After a rejection the next query (at ``n + m``) needs ``n + m - W + 1 ..``: every rejected token
after the first evicted one of those keys, and a ring cannot give it back. Three engines, one
interface (``prefill``, then ``verify`` / ``commit`` per cycle):

================== ================================================  ===========================
engine             verify, then commit ``m`` of ``T``                key columns, slots
================== ================================================  ===========================
OverwritingRing    ``step`` (attend ``[ring | chunk]``, write all);  W + T, W: wrong once two
                   ``truncate`` forgets the rejected tokens          or more are rejected
SpareSlotsRing     write all, attend over the ring of ``W + k``      W + k, W + k
                   slots (masked with ``W``); ``truncate``
CommitAcceptedRing attend ``[ring | chunk]``, write nothing; then    W + T, W
                   write the ``m`` accepted tokens only
================== ================================================  ===========================

>>> import torch
>>> ring = SpareSlotsRing(1, 1, window=4, head_dim=2, max_draft=3)
>>> x = torch.zeros(1, 1, 6, 2)
>>> _ = ring.prefill(x, x, x, torch.arange(6)[None])
>>> _ = ring.verify(x[:, :, :4], x[:, :, :4], x[:, :, :4], torch.arange(6, 10)[None])
>>> ring.commit(torch.tensor([1]))                  # 3 of the 4 rejected
>>> ring.lengths.tolist(), missing_positions(ring)
([7], [[]])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringviz.cache import RingKVCache
from ringviz.checks import check_int, check_kv, check_tensor
from ringviz.reference import windowed_attention_reference


class DraftRing:
    """A batch of rings that verifies draft chunks and commits each row's accepted prefix."""

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int,
                 max_draft: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        self.window = check_int("window", window)
        self.max_draft = check_int("max_draft", max_draft)
        self.cache = RingKVCache(batch_size, num_kv_heads, window, head_dim,
                                 capacity=self._capacity(window, max_draft), dtype=dtype,
                                 device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=self.cache.device)
        self._pending: tuple[torch.Tensor, ...] | None = None  # the verified chunk

    def _capacity(self, window: int, max_draft: int) -> int:
        return window

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    # ------------------------------------------------------------------ the cycle
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
        """Attend and store a prompt chunk, all of it committed: ``(B, Hq, T, D)``."""
        valid = self._check(q, k, v, positions, max_len=None)
        out = self.cache.step(q, k, v, positions, scale=scale)
        self.lengths += valid.sum(dim=1)
        return out

    def verify(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
        """The target's pass over a draft chunk: ``(B, Hq, T, D)``; then call :meth:`commit`."""
        valid = self._check(q, k, v, positions, max_len=self.max_draft + 1)
        out = self._verify(q, k, v, positions, scale)
        self._pending = (k, v, positions, valid)
        return out

    def commit(self, accepted: torch.Tensor) -> None:
        """Keep the first ``accepted[b]`` tokens of row b's verified chunk, drop the
        rest."""
        if self._pending is None:
            raise ValueError("commit() needs a verify() first")
        check_tensor("accepted", accepted, self.cache.device)
        if accepted.dtype not in (torch.int64, torch.int32) \
                or accepted.shape != self.lengths.shape:
            raise ValueError(f"accepted must be int64 or int32 of shape (B,) = "
                             f"{tuple(self.lengths.shape)}, got {accepted.dtype} "
                             f"{tuple(accepted.shape)}")
        k, v, positions, valid = self._pending
        n_valid = valid.sum(dim=1)  # (B,)
        if bool(((accepted < 0) | (accepted > n_valid)).any()):
            raise ValueError(f"accepted must lie in 0 .. the chunk's tokens per row "
                             f"{n_valid.tolist()}, got {accepted.tolist()}")
        keep = valid & (valid.cumsum(dim=1) <= accepted[:, None])  # (B, T)
        self._commit(k, v, positions, keep, self.lengths + accepted)
        self.lengths += accepted
        self._pending = None

    def _verify(self, q, k, v, positions, scale) -> torch.Tensor:
        return self.cache.step(q, k, v, positions, scale=scale)

    def _commit(self, k, v, positions, keep, lengths) -> None:
        self.cache.truncate(lengths)

    # ------------------------------------------------------------------ validation
    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, max_len: int | None) -> torch.Tensor:
        """Shapes, dtypes, and each row's tokens at its next positions: ``valid`` (B, T)."""
        if self._pending is not None:
            raise ValueError("commit() the verified chunk before the next call")
        c = self.cache
        check_kv(k, v, batch_size=c.batch_size, num_kv_heads=c.num_kv_heads,
                 head_dim=c.head_dim, dtype=c.dtype, device=c.device)
        check_tensor("q", q, c.device)
        T = k.shape[2]
        if q.dtype != c.dtype or q.ndim != 4 or q.shape[0] != c.batch_size \
                or q.shape[2:] != (T, c.head_dim) or q.shape[1] == 0 \
                or q.shape[1] % c.num_kv_heads:
            raise ValueError(f"q must be {c.dtype} (B={c.batch_size}, Hq = a multiple of "
                             f"{c.num_kv_heads}, T={T}, head_dim={c.head_dim}), got {q.dtype} "
                             f"{tuple(q.shape)}")
        check_tensor("positions", positions, c.device)
        if positions.dtype not in (torch.int64, torch.int32) \
                or positions.shape != (c.batch_size, T):
            raise ValueError(f"positions must be int64 or int32 (B, T) = {(c.batch_size, T)}, "
                             f"got {positions.dtype} {tuple(positions.shape)}")
        if max_len is not None and T > max_len:
            raise ValueError(f"a draft chunk holds at most max_draft + 1 = {max_len} tokens, "
                             f"got {T}")
        valid = positions >= 0
        expect = self.lengths[:, None] + valid.cumsum(dim=1) - 1  # (B, T)
        bad = (positions < -1) | (valid & (positions != expect))
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"row {b}: positions must continue the row's sequence at "
                             f"{int(self.lengths[b])}, one per token (-1 = padding), got "
                             f"{positions[b].tolist()}")
        return valid


class OverwritingRing(DraftRing):
    """The naive engine: a ring of ``window`` slots; verify writes every draft token.

    On rejection it forgets the rejected positions (``rollback=True``), without the check
    that would refuse (the keys they overwrote are gone: the next queries see a shorter
    window), or it keeps going with the rejected keys in place (``rollback=False``): they
    stay visible to the next chunk's queries beside the accepted tokens' keys.
    """

    def __init__(self, *args, rollback: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rollback = rollback

    def _verify(self, q, k, v, positions, scale):
        # without a rollback the ring already holds positions this chunk writes again
        return self.cache.step(q, k, v, positions, scale=scale, check=self.rollback)

    def _commit(self, k, v, positions, keep, lengths):
        if self.rollback:
            self.cache.truncate(lengths, check=False)  # forgets; cannot restore


class SpareSlotsRing(DraftRing):
    """Fix 1: ``window + max_draft`` slots, masked with ``window``; rejected tokens
    forgotten.

    The extra slots hold positions no query can see any more, so a chunk of up to
    ``max_draft + 1`` tokens evicts only keys older than its first query's window: it can be
    written before attending (one key source, as a kernel that reads only the cache wants),
    and taken back after.
    """

    def _capacity(self, window: int, max_draft: int) -> int:
        return window + max_draft

    def _verify(self, q, k, v, positions, scale):
        self.cache.write(k, v, positions)
        return self.cache.attend(q, positions, scale=scale)


class CommitAcceptedRing(DraftRing):
    """Fix 2: verify over ``[ring | chunk]`` without writing; commit only accepted
    tokens."""

    def _verify(self, q, k, v, positions, scale):
        return self.cache.attend_chunk(q, k, v, positions, scale=scale)

    def _commit(self, k, v, positions, keep, lengths):
        self.cache.write(k, v, torch.where(keep, positions, -1))  # rejected = padding


def missing_positions(ring: DraftRing) -> list[list[int]]:
    """Per row: positions the next query (at ``lengths[b]``) needs that the ring lacks."""
    return ring.cache.missing_positions(ring.lengths)


@dataclass
class Cycle:
    """One measured verify cycle of :func:`simulate`."""

    start: list[int]  # per row: position of the chunk's first token
    accepted: list[int]  # per row: tokens kept
    error: float  # max |verify output - windowed reference| over the chunk's real queries
    missing: list[list[int]]  # per row, after the commit: needed positions the ring lacks


def simulate(ring: DraftRing, accepted: list[list[int]], *, prompt: int, n_heads: int,
             seed: int = 0) -> list[Cycle]:
    """Prefill ``prompt`` random tokens, then run one verify cycle per ``accepted`` entry.

    Every cycle verifies ``max_draft + 1`` fresh random tokens per row (rejected tokens are
    replaced, as a new sample would be) and keeps ``accepted[c][b]`` of row b. Each verify
    output is compared with :func:`windowed_attention_reference` over the row's committed
    tokens plus the chunk: what the target model computes with no cache at all.
    """
    c = ring.cache
    check_int("prompt", prompt)
    check_int("n_heads", n_heads)
    if n_heads % c.num_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of {c.num_kv_heads}")
    if any(len(row) != c.batch_size for row in accepted):
        raise ValueError(f"each cycle needs one accepted count per row ({c.batch_size})")
    gen = torch.Generator(device=c.device).manual_seed(seed)

    def draw(T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shapes = ((n_heads, T), (c.num_kv_heads, T), (c.num_kv_heads, T))
        return tuple(torch.randn(c.batch_size, h, t, c.head_dim, generator=gen,
                                 dtype=c.dtype, device=c.device) for h, t in shapes)

    q, k, v = draw(prompt)
    ring.prefill(q, k, v, ring.lengths[:, None] + torch.arange(prompt, device=c.device))
    hist = [(k[b], v[b]) for b in range(c.batch_size)]  # committed (Hkv, n, D) per row
    cycles, T = [], ring.max_draft + 1
    for counts in accepted:
        q, k, v = draw(T)
        start = ring.lengths.clone()
        out = ring.verify(q, k, v, start[:, None] + torch.arange(T, device=c.device))
        error = max(_verify_error(out[b], q[b], k[b], v[b], *hist[b], ring.window)
                    for b in range(c.batch_size))
        ring.commit(torch.tensor(counts, device=c.device))
        hist = [(torch.cat([hk, k[b, :, :m]], 1), torch.cat([hv, v[b, :, :m]], 1))
                for b, ((hk, hv), m) in enumerate(zip(hist, counts, strict=True))]
        cycles.append(Cycle(start.tolist(), list(counts), error, missing_positions(ring)))
    return cycles


def _verify_error(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  hist_k: torch.Tensor, hist_v: torch.Tensor, window: int) -> float:
    """One row: max |out - reference| for the chunk's queries after the committed tokens."""
    n, T = hist_k.shape[1], k.shape[1]
    past_q = q.new_zeros(q.shape[0], n, q.shape[2])  # their outputs are not compared
    ref = windowed_attention_reference(
        torch.cat([past_q, q], 1)[None], torch.cat([hist_k, k], 1)[None],
        torch.cat([hist_v, v], 1)[None], torch.arange(n + T, device=q.device)[None], window)
    return float((out - ref[0, :, n:]).abs().max())
