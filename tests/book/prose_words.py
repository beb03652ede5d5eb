"""Count each chapter's prose words: the words a reader reads, not code, outputs or markup.

Run from the repository root: `.venv/bin/python tests/book/prose_words.py` prints one row per
page in `_toc.yml` and flags chapters over the book's budget (2,500 prose words) or without a
"What to remember" section. Prose is the text of markdown cells (notebooks) or of the page (`.md`),
after dropping code fences, directive option lines, figure and glue directives, math, HTML
comments and tags; a glued value or a role counts as one word.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

BUDGET = 2500
SUMMARY = "What to remember"

_FENCE = re.compile(r"^(```+|:::+)")
_DISPLAY_MATH = re.compile(r"\$\$.*?\$\$", re.S)
_INLINE_MATH = re.compile(r"\$[^$\n]+\$")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_TAG = re.compile(r"<[^>\n]+>")
_ROLE = re.compile(r"\{[\w:-]+\}`[^`]*`")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_WORD = re.compile(r"[\w][\w'’.,%-]*")
_SKIPPED = ("figure", "glue", "image", "raw", "code-cell", "code", "literalinclude", "math", "table")


def prose(markdown: str) -> str:
    """The prose of one markdown text, markup removed.

    >>> prose("Hi $x^2$ there.\\n```{glue:figure} f\\n:name: x\\n```\\n{glue:text}`n` keys").split()
    ['Hi', 'there.', 'G', 'keys']
    """
    text = _COMMENT.sub(" ", _DISPLAY_MATH.sub(" ", markdown))
    kept: list[str] = []
    skip: list[bool] = []  # one entry per open fence: is its body skipped?
    for line in text.splitlines():
        stripped = line.strip()
        fence = _FENCE.match(stripped)
        if fence:
            name = stripped[len(fence.group(1)):].strip()
            if name:  # an opening fence: directives other than prose containers are skipped
                directive = name.strip("{}").split()[0] if name.startswith("{") else ""
                skipped = not name.startswith("{") or any(directive.startswith(s) for s in _SKIPPED)
                skip.append(skipped or (bool(skip) and skip[-1]))
            elif skip:
                skip.pop()
            continue
        if skip and skip[-1]:
            continue
        if skip and stripped.startswith(":") and re.match(r"^:[\w-]+:", stripped):
            continue  # a directive's option line
        if stripped.startswith("---") or stripped.startswith("(") and stripped.endswith(")="):
            continue  # front matter rules and MyST targets
        kept.append(line)
    out = "\n".join(kept)
    out = _INLINE_MATH.sub(" ", out)
    out = _ROLE.sub("G", out)
    out = _LINK.sub(r"\1", out)
    return _TAG.sub(" ", out)


def count_words(markdown: str) -> int:
    """Words in the prose of `markdown`.

    >>> count_words("# Two words\\n```python\\nx = 1\\n```\\nand $a+b$ three more.")
    5
    """
    return len(_WORD.findall(prose(markdown)))


def page_markdown(path: Path) -> list[str]:
    """The markdown texts of a page: each markdown cell of a notebook, or the whole `.md`."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    return [path.read_text()]


def toc_pages(root: Path) -> list[Path]:
    """Every page `_toc.yml` lists, root first, in reading order."""
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for p in toc["parts"] for c in p["chapters"]]
    pages = []
    for name in files:
        for suffix in (".ipynb", ".md"):
            if (root / (name + suffix)).exists():
                pages.append(root / (name + suffix))
                break
        else:
            raise ValueError(f"_toc.yml lists {name!r}, which has no .ipynb or .md file")
    return pages


def table(root: Path) -> list[tuple[str, int, bool]]:
    """(page, prose words, has a 'What to remember' heading) for every page in the TOC."""
    rows = []
    for path in toc_pages(root):
        texts = page_markdown(path)
        summary = any(re.search(rf"^#+ .*{SUMMARY}", t, re.M) for t in texts)
        rows.append((str(path.relative_to(root)), sum(count_words(t) for t in texts), summary))
    return rows


def main(root: Path = Path(".")) -> int:
    """Print the table; exit status 1 if a numbered chapter is over budget or lacks a summary."""
    rows = table(root)
    print(f"{'page':45} {'prose words':>11}  {SUMMARY}")
    bad = 0
    for page, words, summary in rows:
        chapter = page.startswith("notebooks/")
        flag = " OVER" if chapter and words > BUDGET else ""
        bad += bool(flag) or (chapter and not summary)
        print(f"{page:45} {words:>11,}  {'yes' if summary else '-'}{flag}")
    print(f"{'total':45} {sum(r[1] for r in rows):>11,}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
