"""Count each chapter's prose words: the words a reader reads, not code, outputs or markup.

Run from the repository root: `.venv/bin/python tests/book/prose_words.py` prints one row per
page in `_toc.yml`, grouped by part, and exits 1 if the main path is over its budgets: at most
22,000 prose words in all and 2,000 on any one page, every numbered chapter ending in a
"What to remember" section. The main path is the root page, "When it breaks" and every numbered
part (chapters 1-15); the other parts ("The evidence", "Reference") are counted on their own and
have no budget. `tests/book/test_prose.py` asserts the same budgets.

Prose is the text of markdown cells (notebooks) or of the page (`.md`), after dropping code
fences, directive option lines, figure and glue directives, math, HTML comments and tags; a glued
value or a role counts as one word.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

MAIN_BUDGET = 22_000  # prose words on the whole main path
PAGE_BUDGET = 2_000  # prose words on any one page of the main path
MAIN = "main path"
MAIN_CAPTIONS = ("When it breaks",)  # unnumbered parts that belong to the main path
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


def _prose_lines(markdown: str) -> list[str]:
    """The lines of `markdown` a reader reads as prose; every dropped line becomes blank."""
    text = _COMMENT.sub(" ", _DISPLAY_MATH.sub(" ", markdown))
    kept: list[str] = []
    skip: list[bool] = []  # one entry per open fence: is its body skipped?
    for line in text.splitlines():
        stripped = line.strip()
        fence = _FENCE.match(stripped)
        drop = True
        if fence:
            name = stripped[len(fence.group(1)):].strip()
            if name:  # an opening fence: directives other than prose containers are skipped
                directive = name.strip("{}").split()[0] if name.startswith("{") else ""
                skipped = not name.startswith("{") or any(directive.startswith(s) for s in _SKIPPED)
                skip.append(skipped or (bool(skip) and skip[-1]))
            elif skip:
                skip.pop()
        elif skip and skip[-1]:
            pass
        elif skip and stripped.startswith(":") and re.match(r"^:[\w-]+:", stripped):
            pass  # a directive's option line
        elif stripped.startswith("---") or stripped.startswith("(") and stripped.endswith(")="):
            pass  # front matter rules and MyST targets
        else:
            drop = False
        kept.append("" if drop else line)
    return kept


def prose(markdown: str) -> str:
    """The prose of one markdown text, markup removed.

    >>> prose("Hi $x^2$ there.\\n```{glue:figure} f\\n:name: x\\n```\\n{glue:text}`n` keys").split()
    ['Hi', 'there.', 'G', 'keys']
    """
    out = "\n".join(_prose_lines(markdown))
    out = _INLINE_MATH.sub(" ", out)
    out = _ROLE.sub("G", out)
    out = _LINK.sub(r"\1", out)
    return _TAG.sub(" ", out)


def paragraphs(markdown: str) -> list[str]:
    """The prose paragraphs of a markdown text, markup kept: blocks between blank lines, each
    list item and heading its own paragraph; tables, code, figures and glue directives dropped.

    >>> paragraphs("# Title\\nOne\\ntwo.\\n\\n- a\\n- b\\n\\n| x |\\n|---|\\n\\n```{glue:figure} f\\nCap\\n```")
    ['# Title', 'One\\ntwo.', '- a', '- b']
    """
    out: list[list[str]] = [[]]
    for line in _prose_lines(markdown) + [""]:
        stripped = line.strip()
        if not stripped or re.match(r"^(#+ |[-*+] |\d+\. )", stripped):
            out.append([])
        if stripped:
            out[-1].append(stripped)
        if stripped.startswith("#"):
            out.append([])
    blocks = ["\n".join(b) for b in out if b]
    return [b for b in blocks if not all(x.startswith("|") for x in b.splitlines())]


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


def page_file(root: Path, name: str) -> Path:
    """The `.ipynb` or `.md` file a `_toc.yml` entry names."""
    for suffix in (".ipynb", ".md"):
        if (root / (name + suffix)).exists():
            return root / (name + suffix)
    raise ValueError(f"_toc.yml lists {name!r}, which has no .ipynb or .md file")


def toc_parts(root: Path) -> dict[str, list[Path]]:
    """Pages by part, in reading order: `MAIN` (the root, "When it breaks" and the numbered
    parts), then every other part under its caption."""
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    parts: dict[str, list[Path]] = {MAIN: [page_file(root, toc["root"])]}
    for part in toc["parts"]:
        main = part.get("numbered", False) or part.get("caption") in MAIN_CAPTIONS
        group = MAIN if main else part.get("caption", "")
        parts.setdefault(group, []).extend(page_file(root, c["file"]) for c in part["chapters"])
    return parts


def toc_pages(root: Path) -> list[Path]:
    """Every page `_toc.yml` lists, root first, in reading order."""
    return [page for pages in toc_parts(root).values() for page in pages]


def main_chapters(root: Path) -> list[Path]:
    """The notebooks of the main path: "When it breaks" and chapters 1-15."""
    return [p for p in toc_parts(root)[MAIN] if p.suffix == ".ipynb"]


def words(path: Path) -> int:
    """The prose words of one page."""
    return sum(count_words(t) for t in page_markdown(path))


def has_summary(path: Path) -> bool:
    """Whether a page has a "What to remember" heading."""
    return any(re.search(rf"^#+ .*{SUMMARY}", t, re.M) for t in page_markdown(path))


def main(root: Path = Path(".")) -> int:
    """Print the table by part; exit status 1 if the main path breaks a budget."""
    bad = 0
    for group, pages in toc_parts(root).items():
        print(f"{group:45} {'prose words':>11}  {SUMMARY}")
        for path in pages:
            n, summary = words(path), has_summary(path)
            over = group == MAIN and n > PAGE_BUDGET
            missing = group == MAIN and path.suffix == ".ipynb" and not summary
            bad += over or missing
            flag = " OVER" if over else ""
            print(f"  {str(path.relative_to(root)):43} {n:>11,}  {'yes' if summary else '-'}{flag}")
        total = sum(words(p) for p in pages)
        budget = f" (budget {MAIN_BUDGET:,}{', OVER' if total > MAIN_BUDGET else ''})"
        bad += group == MAIN and total > MAIN_BUDGET
        print(f"  {'total':43} {total:>11,}{budget if group == MAIN else ''}\n")
    return 1 if bad else 0


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    sys.exit(main(root))
