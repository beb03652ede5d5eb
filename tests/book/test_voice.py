"""A teacher's voice on the main path: plumbing out of sight, few numbers per paragraph.

Every visible code cell of a main chapter ("When it breaks", chapters 1-15) is the artefact the
reader came for; a cell that glues numbers for the prose is plumbing and must be hidden (its tags
include one of `HIDDEN`). A prose paragraph (a markdown block between blank lines; each list item
and heading counts alone; tables, code and figure or glue directives are not prose) carries at
most `MAX_GLUED` glued numbers: the exact values and their spread belong in a figure, a table or
the evidence part. A shown code line fits the rendered column (`MAX_CODE_COLUMNS`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prose_words import MAIN, main_chapters, page_markdown, paragraphs, toc_parts

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = {"remove-cell", "remove-input", "hide-input", "hide-cell"}
MAX_GLUED = 2
MAX_CODE_COLUMNS = 82  # the code column at 1280 px holds 83; a longer line wraps to column 0

_GLUE_CALL = re.compile(r"\bglue\w*\(")  # glue( and the chapters' glue_all( helpers
_GLUE_ROLE = re.compile(r"\{glue(?::\w+)?\}`")  # {glue}`k`, {glue:text}`k`, {glue:md}`k`


def visible_glue_cells(notebook: Path) -> list[str]:
    """The first line of every code cell that calls glue and is shown to the reader."""
    found = []
    for cell in json.loads(notebook.read_text())["cells"]:
        source = "".join(cell["source"])
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] == "code" and _GLUE_CALL.search(source) and not tags & HIDDEN:
            found.append(source.strip().splitlines()[0])
    return found


def wide_visible_lines(notebook: Path) -> list[str]:
    """The lines of shown code cells longer than `MAX_CODE_COLUMNS`: they would wrap."""
    return [line for cell in json.loads(notebook.read_text())["cells"]
            if cell["cell_type"] == "code"
            and not set(cell.get("metadata", {}).get("tags", [])) & HIDDEN
            for line in "".join(cell["source"]).splitlines() if len(line) > MAX_CODE_COLUMNS]


def crowded_paragraphs(markdown: str) -> list[str]:
    """The paragraphs of `markdown` with more than `MAX_GLUED` glued values.

    >>> crowded_paragraphs("{glue}`a` and {glue:text}`b`.\\n\\n{glue:md}`c`, {glue}`d`, {glue}`e`")
    ['{glue:md}`c`, {glue}`d`, {glue}`e`']
    """
    return [p for p in paragraphs(markdown) if len(_GLUE_ROLE.findall(p)) > MAX_GLUED]


def _id(path: Path) -> str:
    return path.stem


@pytest.mark.parametrize("notebook", main_chapters(ROOT), ids=_id)
def test_no_visible_code_cell_calls_glue(notebook):
    cells = visible_glue_cells(notebook)
    assert not cells, f"{notebook.name}: glue in {len(cells)} visible cell(s), tag them " \
        f"hide-input or remove-cell: {cells}"


@pytest.mark.parametrize("notebook", main_chapters(ROOT), ids=_id)
def test_shown_code_fits_the_column(notebook):
    wide = wide_visible_lines(notebook)
    assert not wide, f"{notebook.name}: {len(wide)} shown code line(s) over " \
        f"{MAX_CODE_COLUMNS} characters wrap at 1280 px: {wide}"


@pytest.mark.parametrize("page", toc_parts(ROOT)[MAIN], ids=_id)
def test_no_paragraph_holds_more_than_two_glued_numbers(page):
    crowded = [p for text in page_markdown(page) for p in crowded_paragraphs(text)]
    shown = "\n---\n".join(p[:160] for p in crowded)
    assert not crowded, f"{page.name}: {len(crowded)} paragraph(s) with over {MAX_GLUED} " \
        f"glued numbers:\n{shown}"
