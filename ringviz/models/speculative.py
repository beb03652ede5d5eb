"""Greedy speculative decoding on a real model whose layers keep their KV in draft rings
(:mod:`ringviz.book.speculative` engines), with a prompt-lookup draft. One cycle::

    chunk = [target's last token, k draft tokens] -> verify (one forward, k + 1 positions)
    -> keep the drafts the target's argmax agrees with -> commit them to every layer's ring

With greedy acceptance the output must equal plain greedy decoding token for token; that is the
test a ring that loses keys fails.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringviz.book.speculative import DraftRing
from ringviz.cache import MakeStep, Step
from ringviz.checks import check_int
from ringviz.hf.cache import FullLayer
from ringviz.models.drive import RingRunner


class DraftRunner(RingRunner):
    """A ``RingRunner`` whose sliding layers hold ``engine`` rings, put under the model through
    the seam (``ring=``): ``forward`` prefills, then :meth:`verify` and :meth:`commit` per cycle.

    Full-attention layers (Gemma 3's) keep their ``FullLayer``: slot = position, so a rejected
    draft's keys are overwritten by the next chunk, and :meth:`commit` forgets their columns.
    No attention sinks: a draft engine has none.
    """

    def __init__(self, model, engine: type[DraftRing], window: int | None, max_draft: int,
                 length: int, batch_size: int = 1) -> None:
        self.engine, self.max_draft = engine, check_int("max_draft", max_draft)
        self.engines: list[DraftRing] = []  # one per sliding layer, made at its first step
        self._verifying, self._verified = False, 0
        super().__init__(model, batch_size, window, length, ring=self._engine_ring)

    def _engine_ring(self, window: int) -> MakeStep:
        """The seam's ring factory: a make_step whose step prefills or verifies an engine."""
        param = next(self.model.parameters())

        def make_step(*, batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype | None = None,
                      device: torch.device | str | None = None) -> Step:
            ring = self.engine(batch_size, num_kv_heads, window, head_dim, self.max_draft,
                               dtype=param.dtype if dtype is None else dtype,
                               device=param.device if device is None else device)
            self.engines.append(ring)
            return lambda q, k, v, positions: (ring.verify if self._verifying
                                               else ring.prefill)(q, k, v, positions)

        return make_step

    def reset(self) -> None:
        """Empty every layer; each sliding layer makes a fresh engine at its next step."""
        super().reset()
        self.engines.clear()
        self._verifying, self._verified = False, 0

    def verify(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` of a draft chunk; every layer then waits for a commit."""
        self._verifying = True
        try:
            out = self.forward(input_ids, positions)
        finally:
            self._verifying = False
        self._verified = positions.shape[1]
        return out

    def commit(self, accepted: torch.Tensor) -> None:
        """Keep the first ``accepted[b]`` tokens of the verified chunk in every layer."""
        for ring in self.engines:
            ring.commit(accepted)
        rejected = self._verified - accepted.to(self._next.device)  # (B,)
        self._next -= rejected
        for layer in self.caches:
            if isinstance(layer, FullLayer):  # columns no row kept any more
                layer.crop(-int(rejected.min()))
        self._verified = 0


def lookup_draft(seq: list[int], k: int, ngram: int = 2) -> list[int]:
    """Prompt-lookup draft: the ``k`` tokens after the latest earlier copy of the last n-gram.

    Padded with the last token when the copy is too short or there is none.

    >>> lookup_draft([5, 6, 7, 8, 5, 6], k=3)
    [7, 8, 5]
    >>> lookup_draft([1, 2, 3], k=2)
    [3, 3]
    """
    tail = seq[-ngram:]
    at = next((i for i in range(len(seq) - ngram - 1, -1, -1) if seq[i:i + ngram] == tail), None)
    follow = [] if at is None else seq[at + ngram:at + ngram + k]
    return (follow + [seq[-1]] * k)[:k]


@torch.no_grad()
def speculative_generate(runner: DraftRunner, prompt: torch.Tensor, new_tokens: int, *,
                         draft: Callable[[list[int], int], list[int]] = lookup_draft,
                         ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Greedy speculative decoding of one row through ``runner`` (batch size 1).

    ``draft(tokens so far, k)`` proposes the next ``k`` tokens (default: prompt lookup).
    Returns the ``new_tokens`` generated ids, the logits ``(L, vocab)`` the target computed at
    every committed position ``0 .. L-1`` (prompt and accepted tokens), and the tokens kept
    per cycle.
    """
    if runner.batch_size != 1 or prompt.ndim != 1 or new_tokens < 1:
        raise ValueError("speculative_generate decodes one row: a (P,) prompt, a runner of "
                         f"batch size 1, new_tokens >= 1 (got {new_tokens})")
    device, k = prompt.device, runner.max_draft
    logits = [runner.forward(prompt[None], torch.arange(len(prompt), device=device)[None])[0]]
    seq, nxt, kept = prompt.tolist(), int(logits[0][-1].argmax()), []
    while len(seq) - len(prompt) + 1 < new_tokens:
        guess = draft(seq + [nxt], k)
        if len(guess) != k:
            raise ValueError(f"draft proposed {len(guess)} tokens, not k = {k}")
        n = len(seq)
        chunk = torch.tensor([[nxt, *guess]], device=device)
        out = runner.verify(chunk, torch.arange(n, n + k + 1, device=device)[None])[0]
        pred = out.argmax(-1).tolist()  # the target's token after each chunk position
        a = next((i for i in range(k) if guess[i] != pred[i]), k)  # drafts accepted
        runner.commit(torch.tensor([a + 1], device=device))
        seq += [nxt, *guess[:a]]
        logits.append(out[:a + 1])
        nxt = pred[a]
        kept.append(a + 1)
    generated = torch.tensor(seq[len(prompt):] + [nxt], device=device)[:new_tokens]
    return generated, torch.cat(logits)[:len(prompt) + new_tokens - 1], kept
