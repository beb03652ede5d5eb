"""The ring decode path on a real model, teacher-forced: :class:`RingRunner` drives ringviz.hf.

Hugging Face computes everything around attention (embeddings, RMSNorm, q/k/v projections,
RoPE at the positions we pass, MLP, logits) with its own modules, so the ring path and an HF
reference share every op but attention. The float64 tolerances of the tests and chapters
assume what ``load_model(dtype=float64)`` sets up: RMSNorms in float64, and the reference's
attention through PyTorch SDPA (HF's "eager" attention takes its softmax in float32).

A runner is a :class:`ringviz.hf.RingCache` (the one integration with transformers) fed
explicit positions, so every model ``ringviz.hf`` serves, the runner serves, with the same
numbers::

    runner.forward(ids, positions) -> cache plan (positions, masks per kind) -> HF layers:
        q, k, v (RoPE at positions) -> the layer's step: ring write -> attention

A forward stopped after some layers wrote (an exception, or Ctrl-C in a notebook) leaves the
layers out of step, so the runner refuses every call until :meth:`RingRunner.reset`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringviz.cache import MakeStep, RingKVCache
from ringviz.checks import check_int
from ringviz.hf.attention import ring_active
from ringviz.hf.cache import FullLayer, RingCache, RingLayer
from ringviz.hf.generation import PREFILL_CHUNK


class RingRunner:
    """One model's KV state for a batch of rows: a :class:`ringviz.hf.RingCache`, fed
    explicit positions (teacher forcing, ragged left-padded batches, chunked prefill).

    ``window``, ``sinks`` (with ``sink_convention``) and ``ring`` are the RingCache's: the
    sliding layers' window, the first positions every ring keeps beside it, and another ring
    under every sliding layer
    (the seam, e.g. a pitfall of :mod:`ringviz.conformance.pitfalls`).
    ``length``: the positions the run may reach, ``0 .. length-1`` (it sizes the full
    layers).
    ``caches[i]`` is layer i's store: a :class:`RingKVCache` (ring) or a ``FullLayer``; None
    under another ring.
    """

    def __init__(self, model, batch_size: int, window: int | None, length: int, *,
                 sinks: int = 0, sink_convention: str = "absolute",
                 ring: Callable[[int], MakeStep] | None = None) -> None:
        self.length = check_int("length", length)
        self.batch_size = check_int("batch_size", batch_size)
        self.model = model
        self.cache = RingCache(model, window=window, sinks=sinks,
                               sink_convention=sink_convention, ring=ring)
        self.windows = self.cache.windows
        param = next(model.parameters())
        self.cache.allocate(self.batch_size, self.length, param.dtype, param.device)
        self.caches = [layer.ring if isinstance(layer, RingLayer) else layer
                       for layer in self.cache.layers]
        self.prefill_chunk = PREFILL_CHUNK
        self._full = any(isinstance(c, FullLayer) for c in self.caches)
        self._next = torch.zeros(batch_size, dtype=torch.int64, device=param.device)

    def _first_ring(self) -> RingKVCache | None:
        """The first of the runner's own rings (None if every ring is another's)."""
        return next((c for c in self.caches if isinstance(c, RingKVCache)), None)

    def reset(self) -> None:
        """Empty every layer's store: the way back after an interrupted forward."""
        self.cache.reset()  # every layer (a ring layer resets its ring) and the refusal
        self._next.zero_()

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' stores (k, v and positions)."""
        return self.cache.nbytes

    def _check_call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Refuse a call on a cache an earlier forward left part-way (until :meth:`reset`),
        mismatched shapes, positions past the run's length, and (with full-attention layers,
        whose slot is the position) positions with gaps."""
        if self.cache.refused is not None:
            raise RuntimeError(f"{self.cache.refused} (or call runner.reset() and feed the "
                               f"sequence again from its start)")
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if input_ids.shape != positions.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions "
                             f"{tuple(positions.shape)} differ")
        newest = int(positions.max()) if positions.numel() else -1
        if newest >= self.length:
            raise ValueError(f"position {newest} is at or past the runner's length="
                             f"{self.length} (positions 0..{self.length - 1}): its full-"
                             f"attention layers would drop tokens; make a RingRunner with "
                             f"a larger length")
        if self._full and positions.ndim == 2 and positions.shape[0] == self.batch_size:
            real = positions >= 0
            expect = self._next.to(positions.device)[:, None] + real.cumsum(dim=1) - 1
            bad = real & (positions != expect)
            if bool(bad.any()):
                b = int(bad.nonzero()[0, 0])
                raise ValueError(f"row {b}: a full-attention layer stores position p in "
                                 f"slot p, so positions must continue the row at "
                                 f"{int(self._next[b])}, one per real token "
                                 f"(-1 = padding); got {positions[b].tolist()}")

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *,
                logits_to_keep: int = 0) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` of ``T`` new tokens per row; -1 positions are padding.

        ``logits_to_keep=n`` computes only the last ``n`` columns' logits (HF's argument;
        0 = all). Nothing is written when the call is refused.
        """
        self._check_call(input_ids, positions)
        ring = self._first_ring()
        # one host read; every ring of the forward then writes trusted
        self.cache.given_real = ring is not None and ring.check_positions(positions)
        self.cache.given_positions = positions
        with ring_active(self.model, self.cache):
            out = self.model(input_ids=input_ids, position_ids=positions, cache=self.cache,
                             use_cache=True, logits_to_keep=logits_to_keep)
        self._next += (positions >= 0).sum(dim=1).to(self._next.device)
        return out.logits

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, *,
                chunk: int | None = None, last_only: bool = False) -> torch.Tensor:
        """Feed a ``(B, T)`` prompt in column chunks of ``chunk``
        (default :attr:`prefill_chunk`).

        Equal to one forward over the whole prompt (the ring is exact for any chunking), but
        the attention scores and activations held at once scale with the chunk, not with T.
        Returns the logits ``(B, T, vocab)``, or with ``last_only`` just the last column's
        ``(B, 1, vocab)`` (the other chunks then skip the LM head). The whole prompt is
        checked before its first chunk is written.
        """
        chunk = self.prefill_chunk if chunk is None else check_int("chunk", chunk)
        self._check_call(input_ids, positions)
        T = positions.shape[1]
        if T <= chunk:  # one chunk: forward's own layer-0 check covers it
            return self.forward(input_ids, positions, logits_to_keep=1 if last_only else 0)
        ring = self._first_ring()
        if ring is not None:  # all chunks, before the first write
            ring.check_positions(positions)
        out = None
        for s in range(0, T, chunk):
            logits = self.forward(input_ids[:, s:s + chunk], positions[:, s:s + chunk],
                                  logits_to_keep=1 if last_only else 0)
            if last_only:
                out = logits
            else:  # filled in place: no second copy of T x vocab logits
                if s == 0:
                    out = logits.new_empty(logits.shape[0], T, logits.shape[2])
                out[:, s:s + chunk] = logits
        return out


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token rows of different lengths, padded on the left: ``(ids, positions)`` (B, T).

    >>> ids, pos = left_pad([torch.tensor([7, 8, 9]), torch.tensor([5])], pad_id=0)
    >>> ids.tolist(), pos.tolist()
    ([[7, 8, 9], [0, 0, 5]], [[0, 1, 2], [-1, -1, 0]])
    """
    T = max(len(r) for r in rows)
    device = rows[0].device
    ids = torch.full((len(rows), T), pad_id, dtype=torch.int64, device=device)
    positions = torch.full((len(rows), T), -1, dtype=torch.int64, device=device)
    for b, row in enumerate(rows):
        ids[b, T - len(row):] = row
        positions[b, T - len(row):] = torch.arange(len(row), device=device)
    return ids, positions


@torch.no_grad()
def ring_logits(runner: RingRunner, rows: list[torch.Tensor], prompt_lengths: list[int],
                progress: bool = False, *, prefill_chunk: int | None = None
                ) -> list[torch.Tensor]:
    """Teacher-forced ring decode: prefill each row's prompt, then one token per step.

    ``rows[b]`` holds row b's whole sequence; its first ``prompt_lengths[b]`` tokens are the
    prompt (one batched, left-padded prefill in chunks of ``prefill_chunk`` columns, see
    :meth:`RingRunner.prefill`), the rest are fed one per decode step. Rows must have the same
    number of decode tokens. Returns each row's logits ``(L_b, vocab)``.
    """
    from tqdm.auto import tqdm

    new = {len(r) - p for r, p in zip(rows, prompt_lengths, strict=True)}
    if len(new) != 1 or min(prompt_lengths) <= 0:
        raise ValueError("rows need prompts of >= 1 token and the same number of new tokens")
    n_new = new.pop()
    pad_id = int(rows[0][0])  # any valid id: padded tokens are never attended to
    ids, positions = left_pad([r[:p] for r, p in zip(rows, prompt_lengths, strict=True)],
                              pad_id)
    prefill = runner.prefill(ids, positions, chunk=prefill_chunk)  # (B, P_max, vocab)
    steps = []
    lengths = torch.tensor(prompt_lengths, device=ids.device)
    for i in tqdm(range(n_new), desc="ring decode", disable=not progress, leave=False):
        tok = torch.stack([r[p + i] for r, p in zip(rows, prompt_lengths, strict=True)])  # (B,)
        steps.append(runner.forward(tok[:, None], (lengths + i)[:, None]))  # (B, 1, vocab)
    decode = torch.cat(steps, dim=1) if steps else prefill[:, :0]
    return [torch.cat([prefill[b, prefill.shape[1] - p:], decode[b]])
            for b, p in enumerate(prompt_lengths)]


@torch.no_grad()
def ring_generate(runner: RingRunner, prompts: list[torch.Tensor], new_tokens: int, *,
                  prefill_chunk: int | None = None) -> list[torch.Tensor]:
    """Greedy decoding through the ring: each row's ``new_tokens`` next token ids.

    The prompts are prefilled in chunks (:meth:`RingRunner.prefill`); the whole run's last
    position must lie below the runner's length, checked before anything is written.
    """
    new_tokens = check_int("new_tokens", new_tokens)
    ids, positions = left_pad(prompts, pad_id=int(prompts[0][0]))
    last = int(positions[:, -1].max()) + new_tokens - 1
    if last >= runner.length:
        raise ValueError(f"generating {new_tokens} tokens reaches position {last}, at or past "
                         f"the runner's length={runner.length}")
    nxt = runner.prefill(ids, positions, chunk=prefill_chunk, last_only=True)[:, -1].argmax(-1)
    out = [nxt]
    pos = positions[:, -1] + 1  # (B,) next absolute position of each row
    for i in range(new_tokens - 1):
        nxt = runner.forward(nxt[:, None], (pos + i)[:, None])[:, -1].argmax(-1)  # (B,)
        out.append(nxt)
    return list(torch.stack(out, dim=1))  # B tensors of (new_tokens,)
