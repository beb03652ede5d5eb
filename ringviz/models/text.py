"""The shipped evaluation text (CC0, see ``data/README.md``) and its tokens.

It lives in the package so every experiment runs offline on the same input.
"""

from __future__ import annotations

from importlib.resources import files

import torch

from ringviz.checks import check_int

TEXT_FILE = "harbor_light.txt"


def eval_text() -> str:
    """The evaluation text, as shipped."""
    return files("ringviz.models").joinpath("data", TEXT_FILE).read_text(encoding="utf-8")


def eval_tokens(tokenizer, n: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The first ``n`` token ids of the text ``(n,)``, BOS first if the tokenizer adds one."""
    check_int("n", n)
    ids = tokenizer(eval_text())["input_ids"]
    if len(ids) < n:
        raise ValueError(f"the evaluation text has {len(ids)} tokens for this tokenizer; asked {n}")
    return torch.tensor(ids[:n], dtype=torch.int64, device=device)
