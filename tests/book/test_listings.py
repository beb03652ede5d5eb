"""The package code the chapters show (``literalinclude``) fits the book's column.

The rendered article wraps a listing's line past 93 to 94 characters at 1280 px, in a dropdown
too (the listings' font size and the dropdowns' padding are in ``book/_static/ringviz.css``), and
a wrapped line continues at the left edge, where it reads like a real line break. So every line of a listed object is at most
:data:`COLUMN` characters. The museum's transcriptions of other projects' code
(``ringviz/conformance/museum.py``) keep their upstream lines and are left out.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COLUMN = 92
TRANSCRIPTIONS = {"ringviz/conformance/museum.py"}
_INCLUDE = re.compile(r"```\{literalinclude\}\s+(\S+)\n((?::[^\n]*\n)*)")
_OPTION = re.compile(r":([a-z-]+):\s*(.*)")


def _markdown(page: Path) -> str:
    if page.suffix != ".ipynb":
        return page.read_text()
    cells = json.loads(page.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _object_lines(source: str, dotted: str) -> list[str]:
    """The lines of ``dotted`` (``Class.method`` or a function), decorators included."""
    body, node = ast.parse(source).body, None
    for name in dotted.split("."):
        node = next(n for n in body if getattr(n, "name", None) == name)
        body = getattr(node, "body", [])
    start = node.lineno - 1 - len(node.decorator_list)
    return source.splitlines()[start:node.end_lineno]


def listings() -> list[tuple[str, str, str | None]]:
    """(page, included file relative to the repository, pyobject or None) of every listing."""
    pages = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "book").glob("*.md"))
    found = []
    for page in pages:
        for match in _INCLUDE.finditer(_markdown(page)):
            path = (page.parent / match.group(1)).resolve().relative_to(ROOT).as_posix()
            options = dict(_OPTION.findall(match.group(2)))
            found.append((page.name, path, options.get("pyobject")))
    return found


def test_the_chapters_list_package_code():
    """The check below would pass vacuously if the pattern found no listing (the book lists
    fewer since its chapters show the calls instead of API listings; still dozens)."""
    assert len({(path, obj) for _, path, obj in listings()}) >= 20


@pytest.mark.parametrize(("page", "path", "obj"),
                         [x for x in listings() if x[1] not in TRANSCRIPTIONS])
def test_listed_code_fits_the_column(page, path, obj):
    source = (ROOT / path).read_text()
    lines = _object_lines(source, obj) if obj else source.splitlines()
    long = [line.strip()[:60] for line in lines if len(line) > COLUMN]
    assert not long, f"{page} lists {path} {obj or ''} with lines over {COLUMN} columns: {long}"
