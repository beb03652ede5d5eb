"""The reader's two ways in: the intro's 30-minute path and the "When it breaks" page.

The path must name at least six sections of chapters that exist, each by a link straight to the
section (``[Chapter N, *Title*](../notebooks/NN_name.ipynb#title-slug)``, the ids MyST gives
headings with ``myst_heading_anchors``) with a time in minutes; the titles must be headings of the
linked chapter and the anchors their slugs, so a renamed section breaks this test rather than the
reader's path. The path must take in the two sections a reader needs to trust the ring: chapter
3's argument that decode does not need slot order, and chapter 6's failure of that ring on a
chunk, which motivates attend-then-write. The
symptom page must hold at least ten symptom sections, each with its own label, linked from the
table at its top, and each linking a chapter that exists.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INTRO = ROOT / "book" / "intro.md"
SYMPTOMS = ROOT / "notebooks" / "when_it_breaks.ipynb"
PATH_HEADING = "## A 30-minute path"
MIN_PATH_ITEMS = 6
MIN_SYMPTOMS = 10
ON_THE_PATH = (  # (chapter, section) the path must link
    ("03_ring_indexing.ipynb", "Decode does not need order"),
    ("06_prefill.ipynb", "Chapter 3's ring on a chunk"),
)

_ITEM = re.compile(r"^\d+\. (.*?)(?=^\d+\. |^\S|\Z)", re.M | re.S)
_DOC = re.compile(r"\]\(([^)#\s]+)#([\w-]+)\)")
_TITLE = re.compile(r"\*([^*]+)\*")
_MINUTES = re.compile(r"\((\d+) min\b")
_LABEL = re.compile(r"^\(([\w-]+)\)=\s*\n## (.+)$", re.M)
_CHAPTER = re.compile(r"\{doc\}`[^`<]*<(\d\d_[\w]+)>`")


def slug(title: str) -> str:
    """The id MyST gives a heading: lower case, punctuation dropped, spaces as hyphens.

    >>> slug("The rule: rotate once, at the absolute position")
    'the-rule-rotate-once-at-the-absolute-position'
    """
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def headings(notebook: Path) -> set[str]:
    """The section titles (``#`` to ``###``) of a notebook's markdown cells."""
    cells = json.loads(notebook.read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return {m.group(1).strip() for m in re.finditer(r"^#{1,3} (.+)$", text, re.M)}


def path_items(intro: str) -> list[str]:
    """The numbered items of the intro's 30-minute path section."""
    if PATH_HEADING not in intro:
        return []
    section = intro.split(PATH_HEADING, 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in _ITEM.finditer(section)]


def resolve(target: str, page: Path) -> Path | None:
    """The file a ``{doc}`` target names, relative to ``page`` (None if there is none)."""
    for suffix in (".ipynb", ".md"):
        candidate = (page.parent / target).with_suffix(suffix)
        if candidate.is_file():
            return candidate
    return None


def symptom_sections(notebook: Path) -> dict[str, tuple[str, str]]:
    """label -> (title, the section's markdown up to the next labelled section)."""
    cells = json.loads(notebook.read_text())["cells"]
    text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    found = list(_LABEL.finditer(text))
    return {m.group(1): (m.group(2), text[m.end():found[i + 1].start() if i + 1 < len(found)
                                          else len(text)])
            for i, m in enumerate(found)}


def test_the_path_links_six_sections_that_exist():
    items = path_items(INTRO.read_text())
    assert len(items) >= MIN_PATH_ITEMS, f"the 30-minute path has {len(items)} items"
    seen = set()
    for item in items:
        doc, title, minutes = _DOC.search(item), _TITLE.search(item), _MINUTES.search(item)
        assert doc and title and minutes, f"an item needs a [*title*](page#id) link, (N min): {item}"
        chapter = resolve(doc.group(1), INTRO)
        assert chapter is not None, f"{doc.group(1)} is no page of the book"
        name = " ".join(title.group(1).split())  # a title may wrap across lines
        assert name in headings(chapter), f"{chapter.name} has no section {name!r}"
        assert doc.group(2) == slug(name), f"the link to {name!r} goes to #{doc.group(2)}"
        seen.add((chapter.name, name))
    assert len(seen) == len(items), "a section appears twice on the path"


def path_sections(intro: str, page: Path = INTRO) -> set[tuple[str, str]]:
    """(chapter file, section title) of every section the path links, by its anchor."""
    found = set()
    for item in path_items(intro):
        for target, anchor in _DOC.findall(item):
            chapter = resolve(target, page)
            if chapter is not None:
                found |= {(chapter.name, h) for h in headings(chapter) if slug(h) == anchor}
    return found


@pytest.mark.parametrize("chapter,section", ON_THE_PATH)
def test_the_path_links_the_sections_that_make_the_case(chapter, section):
    assert section in headings(ROOT / "notebooks" / chapter), f"{chapter} has no {section!r}"
    assert (chapter, section) in path_sections(INTRO.read_text()), \
        f"the 30-minute path does not link {chapter}#{slug(section)}"


def test_the_path_takes_about_half_an_hour():
    minutes = [int(_MINUTES.search(i).group(1)) for i in path_items(INTRO.read_text())]
    assert 20 <= sum(minutes) <= 35, f"the path adds up to {sum(minutes)} minutes"


def test_the_path_comes_before_the_first_undefined_term():
    intro = INTRO.read_text()
    path = intro.index(PATH_HEADING)
    for term in ("sinks", "paged", "assisted"):
        first = intro.find(term)
        assert first == -1 or first > path, f"{term!r} is used before the 30-minute path"


def test_when_it_breaks_has_ten_symptoms_each_linking_a_chapter():
    sections = symptom_sections(SYMPTOMS)
    assert len(sections) >= MIN_SYMPTOMS, f"{len(sections)} symptom sections"
    for title, body in sections.values():
        chapters = _CHAPTER.findall(body)
        assert chapters, f"section {title!r} links no chapter"
        for target in chapters:
            assert resolve(target, SYMPTOMS), f"section {title!r} links {target}, no page"


def test_the_symptom_table_links_every_section():
    sections = symptom_sections(SYMPTOMS)
    cells = json.loads(SYMPTOMS.read_text())["cells"]
    table = next("".join(c["source"]) for c in cells
                 if c["cell_type"] == "markdown" and "|---|" in "".join(c["source"]))
    linked = set(re.findall(r"\{ref\}`[^`<]*<([\w-]+)>`", table))
    assert linked == set(sections), f"table and sections differ: {linked ^ set(sections)}"


def test_when_it_breaks_ends_with_what_to_remember():
    cells = json.loads(SYMPTOMS.read_text())["cells"]
    last = "".join(cells[-1]["source"])
    assert last.startswith("## What to remember")


@pytest.mark.parametrize("page", [INTRO, SYMPTOMS])
def test_pages_exist_in_the_toc(page):
    toc = (ROOT / "_toc.yml").read_text()
    assert str(page.relative_to(ROOT).with_suffix("")) in toc
