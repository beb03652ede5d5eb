"""Read the built book as its reader does: every page at 1280 px, light and dark.

Run from the repository root after `make book`:
`.venv/bin/python tests/book/reader_check.py` prints one row per page of `_toc.yml` and exits 1
if any page breaks the book's rules:

- height: at most 14,000 px at 1280 px wide (a page longer than that wants splitting);
- sideways: no block that scrolls sideways (``scrollWidth > clientWidth``, code blocks included);
- contrast: every text element's colour against its nearest opaque background at least 4.5:1
  (WCAG AA), in both colour schemes; text inside figures, SVG and stepper widgets is left out
  (the widgets have their own browser tests);
- answers: every cell tagged as an exercise answer is collapsed until the reader asks (no
  answer printed in the open: an "Exercise" heading's checking cell must be hidden).

It serves `_build/html` itself on a free port and drives Debian's Chromium through playwright.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import socketserver
import sys
import threading
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"
WIDTH, MAX_HEIGHT, MIN_CONTRAST = 1280, 14_000, 4.5

# WCAG contrast of each text element against the first opaque background up its ancestors
_CONTRAST_JS = """
() => {
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => {
    const f = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const bg = (el) => {
    for (let e = el; e; e = e.parentElement) {
      const c = rgb(getComputedStyle(e).backgroundColor);
      if (c.length >= 3 && (c.length < 4 || c[3] > 0.5)) return c;
    }
    return [255, 255, 255];
  };
  const bad = [];
  let checked = 0, worst = 99;
  for (const el of document.querySelectorAll("article *")) {
    if (el.closest("svg, figure, .ringviz-stepper, .cell_output img, mjx-container, .MathJax")) continue;
    const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!own || !el.getClientRects().length) continue;
    const s = getComputedStyle(el);
    if (s.visibility === "hidden" || s.display === "none" || Number(s.opacity) < 0.1) continue;
    const a = lum(rgb(s.color)), b = lum(bg(el));
    const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    checked += 1;
    worst = Math.min(worst, ratio);
    if (ratio < __MIN__) bad.push(`${el.tagName.toLowerCase()}.${el.className}: ${ratio.toFixed(2)} "${el.textContent.trim().slice(0, 30)}"`);
  }
  return {checked, bad, worst, page: getComputedStyle(document.body).backgroundColor};
}
""".replace("__MIN__", str(MIN_CONTRAST))

_SIDEWAYS_JS = """
() => [...document.querySelectorAll("article *")]
  .filter((e) => e.scrollWidth > e.clientWidth + 1 && e.clientWidth > 0
                 && ["auto", "scroll"].includes(getComputedStyle(e).overflowX))
  .map((e) => `${e.tagName.toLowerCase()}.${e.className.split(" ")[0]}`)
"""

# answers: a cell that checks an exercise ("# Exercise" and an assert) must sit in a collapsed (hide-cell/-input) box
_ANSWERS_JS = """
() => [...document.querySelectorAll("div.cell")]
  .filter((c) => /#\\s*Exercise/.test(c.querySelector(".cell_input")?.innerText || "")
                 && /\\bassert\\b/.test(c.querySelector(".cell_input")?.innerText || ""))
  .filter((c) => !c.matches(".tag_hide-cell, .tag_hide-input, .tag_remove-input"))
  .map((c) => (c.querySelector(".cell_input")?.innerText || "").split("\\n")[0].slice(0, 60))
"""


def pages() -> list[str]:
    """The html path of every page in `_toc.yml`, in reading order."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [ch["file"] for part in toc["parts"] for ch in part["chapters"]]
    return [f"{f}.html" for f in files]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no line per request
        pass


@contextlib.contextmanager
def served(directory: Path):
    """An http server on a free local port for ``directory``; yields its base URL."""
    handler = functools.partial(_Quiet, directory=str(directory))
    with socketserver.TCPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()


def check_page(browser, url: str) -> dict:
    """Height, sideways blocks, contrast failures (both schemes) and open answers of one page."""
    row: dict = {}
    for scheme in ("light", "dark"):
        page = browser.new_page(viewport={"width": WIDTH, "height": 900}, color_scheme=scheme)
        page.goto(url, wait_until="load")
        page.wait_for_timeout(300)
        if scheme == "light":
            row["height"] = page.evaluate("document.documentElement.scrollHeight")
            row["sideways"] = page.evaluate(_SIDEWAYS_JS)
            row["answers"] = page.evaluate(_ANSWERS_JS)
        row[scheme] = page.evaluate(_CONTRAST_JS)
        page.close()
    return row


def main() -> int:
    from playwright.sync_api import sync_playwright

    if not (HTML / "index.html").exists():
        print("no built book: run `make book` first", file=sys.stderr)
        return 2
    failed = False
    with served(HTML) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        print(f"{'page':44s} {'height':>7s}  sideways  contrast<4.5 (light/dark)  worst  "
              f"open answers")
        for path in pages():
            row = check_page(browser, f"{base}/{path}")
            light, dark = row["light"], row["dark"]
            bad = (row["height"] > MAX_HEIGHT or row["sideways"] or light["bad"] or dark["bad"]
                   or row["answers"])
            failed |= bool(bad)
            print(f"{path:44s} {row['height']:7,d}  {len(row['sideways']):8d}  "
                  f"{len(light['bad']):5d}/{len(dark['bad']):<5d} of {light['checked']:5d}  "
                  f"{min(light['worst'], dark['worst']):5.1f}  "
                  f"{len(row['answers']):5d}{'  <-' if bad else ''}")
            for what in row["sideways"][:3] + light["bad"][:3] + dark["bad"][:3] + row["answers"]:
                print(f"    {what}")
        browser.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
