"""The book's word budgets (issue: a book half as long), counted by `prose_words.py`.

The main path (the intro, "When it breaks" and chapters 1-15) holds at most 22,000 prose words in
all and 2,000 on any one page; the evidence and the reference parts are counted apart and have no
budget. Every chapter of the main path ends its teaching with a "What to remember" section.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prose_words import (
    MAIN,
    MAIN_BUDGET,
    PAGE_BUDGET,
    has_summary,
    main_chapters,
    toc_parts,
    words,
)

ROOT = Path(__file__).resolve().parents[2]
PARTS = toc_parts(ROOT)


def _id(path: Path) -> str:
    return path.stem


def test_the_main_path_is_within_its_budget():
    counts = {p.stem: words(p) for p in PARTS[MAIN]}
    total = sum(counts.values())
    longest = ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:4])
    assert total <= MAIN_BUDGET, f"{total:,} prose words on the main path (longest: {longest})"


@pytest.mark.parametrize("page", PARTS[MAIN], ids=_id)
def test_each_main_page_is_within_its_budget(page):
    assert words(page) <= PAGE_BUDGET, f"{page.name}: {words(page):,} prose words"


@pytest.mark.parametrize("page", main_chapters(ROOT), ids=_id)
def test_each_main_chapter_has_what_to_remember(page):
    assert has_summary(page), f"{page.name} has no 'What to remember' section"


def test_the_evidence_is_counted_apart_from_the_main_path():
    assert "The evidence" in PARTS and "Reference" in PARTS, f"parts: {list(PARTS)}"
    main = set(PARTS[MAIN])
    for caption in ("The evidence", "Reference"):
        assert PARTS[caption] and not main & set(PARTS[caption]), caption
