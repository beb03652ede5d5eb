"""The stepper in a real browser: build a one-page book, open it from disk, click, look.

Uses the repository's own _config.yml (theme, offline settings, the widget JS keys), so this
checks what readers get: the embedded trace steps with no kernel, and no request leaves the
machine. Needs Debian's ``chromium`` and Python ``playwright``; skips without them unless
``RINGVIZ_REQUIRE_BROWSER=1`` (CI), where it fails.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")
OFFLINE_EXT = "ringviz.book.offline"
FONT_FACE_SRCS = """() => {
  const out = [];
  for (const sheet of document.styleSheets) {
    let rules;
    try { rules = sheet.cssRules; } catch (e) { continue; }  // unreadable: not a <style> tag
    for (const r of rules) if (r instanceof CSSFontFaceRule) out.push(r.style.getPropertyValue("src"));
  }
  return out;
}"""

pytestmark = pytest.mark.browser


def _need(reason: str) -> None:
    if os.environ.get("RINGVIZ_REQUIRE_BROWSER") == "1":
        pytest.fail(f"RINGVIZ_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    if not pathlib.Path(CHROMIUM).is_file():
        _need("chromium is not installed (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("python playwright is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def book(tmp_path_factory) -> pathlib.Path:
    """A one-notebook Jupyter Book with three steppers, built with the repo's _config.yml."""
    src = tmp_path_factory.mktemp("book")
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    extensions = config["sphinx"].setdefault("extra_extensions", [])
    if OFFLINE_EXT not in extensions:  # test_book_config_keeps_pages_offline reports it
        extensions.append(OFFLINE_EXT)
    sphinx = config["sphinx"]["config"]
    for key in ("html_extra_path", "html_static_path"):  # the repo's paths, from the tmp root
        sphinx[key] = [str(ROOT / p) for p in sphinx.get(key, [])]
    config["execute"] = {**config.get("execute", {}), "execute_notebooks": "force"}
    (src / "_config.yml").write_text(yaml.safe_dump(config, sort_keys=False))  # script order
    (src / "_toc.yml").write_text("format: jb-book\nroot: stepper\n")
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Stepper"),
        nbformat.v4.new_code_cell("import ringviz.book as viz\n"
                                  "viz.RingStepper.from_scenario(window=4, prompt=6, "
                                  "decode_steps=3, vary={'window': (3, 4, 5)})"),
        nbformat.v4.new_code_cell("viz.RingStepper.from_scenario(window=4, prompt=5, chunk=2, "
                                  "decode_steps=1, batch_lengths=(5, 2))"),
        nbformat.v4.new_code_cell("viz.RingStepper.from_scenario(window=4, prompt=3, "
                                  "decode_steps=4, sinks=2, vary={'sinks': (0, 2)})"),
    ]
    nbformat.write(nb, src / "stepper.ipynb")
    out = subprocess.run([str(pathlib.Path(sys.executable).with_name("jupyter-book")), "build",
                          str(src), "-W", "-n", "--keep-going"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return src / "_build" / "html" / "stepper.html"


def _open(browser, book, scheme: str):
    """The built page, opened from disk in a colour scheme; every request and error recorded."""
    page = browser.new_page(viewport={"width": 1280, "height": 900}, color_scheme=scheme)
    log = {"requests": [], "external": [], "errors": [], "failed": []}

    def route(r):
        url = r.request.url
        log["requests"].append(url)
        if url.startswith(LOCAL_SCHEMES):
            r.continue_()
        else:
            log["external"].append(url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda err: log["errors"].append(str(err)))
    page.on("requestfailed", lambda req: log["failed"].append(req.url))
    page.goto(book.as_uri())
    page.wait_for_selector(".ringviz-stepper svg .slot", timeout=30_000)
    page.log = log
    return page


@pytest.fixture
def page(browser, book):
    page = _open(browser, book, "light")
    yield page
    page.close()


@pytest.fixture
def dark_page(browser, book):
    page = _open(browser, book, "dark")
    yield page
    page.close()


CONTRAST = """el => {
  const lum = c => c.match(/[\\d.]+/g).slice(0, 3).map(x => x / 255)
    .map(x => x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4)
    .reduce((s, x, i) => s + [0.2126, 0.7152, 0.0722][i] * x, 0);
  const s = getComputedStyle(el), [a, b] = [lum(s.color), lum(s.backgroundColor)].sort((x, y) => y - x);
  return (a + 0.05) / (b + 0.05);
}"""


def test_book_config_keeps_pages_offline():
    """The book loads the extension that drops sphinx-thebe's duplicate script (a page error)."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert OFFLINE_EXT in config["sphinx"].get("extra_extensions", []), (
        f"add {OFFLINE_EXT} to sphinx: extra_extensions in _config.yml")


def test_page_is_offline_and_error_free(page):
    page.wait_for_timeout(500)
    assert page.log["external"] == [], page.log["external"]
    assert page.log["errors"] == [], page.log["errors"]
    # html-manager's bundled Font Awesome 5 asks for its fonts beside its module, a folder
    # ringviz-widgets.js maps to the served html-manager/; nothing may fail, fonts included
    assert page.log["failed"] == [], page.log["failed"]
    # whether a font is fetched depends on timing; where every @font-face points does not
    srcs = page.evaluate(FONT_FACE_SRCS)
    bundled = re.findall(r'url\("?([^")]*/[0-9a-f]{20}\.\w+)', " ".join(srcs))
    assert bundled, srcs  # html-manager's Font Awesome CSS is on the page
    assert all("/ringviz-widgets/html-manager/" in u for u in bundled), sorted(set(bundled))
    served = [u for u in page.log["requests"] if "ringviz-widgets/" in u]
    assert any("anywidget/index.js" in u for u in served), served


def test_each_stepper_draws_once(page):
    assert page.locator(".ringviz-stepper").count() == 3


def test_next_prev_and_keys_change_the_drawing(page, tmp_path):
    stepper = page.locator(".ringviz-stepper").first
    svg, caption = stepper.locator("svg"), stepper.locator(".ringviz-caption")
    before_svg, before_caption = svg.inner_html(), caption.inner_text()
    assert before_caption == "empty cache: every slot is free"
    stepper.screenshot(path=str(tmp_path / "before.png"))
    stepper.get_by_role("button", name="next").click()
    assert svg.inner_html() != before_svg
    assert caption.inner_text().startswith("tokens 0..5 (6 > W=4)")
    assert stepper.locator(".slot-written").count() == 4
    stepper.get_by_role("button", name="next").click()
    assert caption.inner_text() == "token 6 written to slot 2, evicting token 2; start -> slot 3"
    stepper.screenshot(path=str(tmp_path / "after.png"))
    stepper.press("ArrowLeft")
    stepper.press("ArrowLeft")
    assert caption.inner_text() == before_caption
    assert svg.inner_html() == before_svg
    assert page.log["errors"] == []


def test_play_runs_to_the_end(page):
    stepper = page.locator(".ringviz-stepper").first
    stepper.get_by_role("button", name="play").click()
    counter = stepper.locator(".ringviz-counter")
    page.wait_for_function("el => el.textContent === 'step 4 / 4'", arg=counter.element_handle(),
                           timeout=10_000)
    assert stepper.get_by_role("button", name="play").inner_text() == "▶ play"  # stopped


def test_slider_reaches_the_last_frame(page):
    stepper = page.locator(".ringviz-stepper").nth(1)
    stepper.locator("input[type=range]").fill("4")
    text = stepper.locator(".ringviz-caption").inner_text()
    assert text.startswith("row 0: token 5 written to slot 1"), text
    assert "row 1: token 2 written to slot 2" in text
    assert stepper.locator(".ringviz-counter").inner_text() == "step 4 / 4"


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_buttons_are_legible_in_both_schemes(browser, book, scheme):
    """WCAG AA: button and drop-down text against their own background at least 4.5:1."""
    page = _open(browser, book, scheme)
    try:
        stepper = page.locator(".ringviz-stepper").first
        controls = stepper.locator("button, select")
        assert controls.count() == 4  # prev, play, next, the window drop-down
        ratios = [controls.nth(i).evaluate(CONTRAST) for i in range(controls.count())]
        assert min(ratios) >= 4.5, ratios
        background = stepper.evaluate("el => getComputedStyle(el).backgroundColor")
        dark = background == "rgb(30, 33, 39)"  # --rv-bg of the dark scheme
        assert dark == (scheme == "dark"), background
    finally:
        page.close()


def test_play_becoming_pause_moves_nothing(page):
    stepper = page.locator(".ringviz-stepper").first
    boxes = [stepper.locator("button").nth(i).bounding_box() for i in range(3)]
    stepper.get_by_role("button", name="play").click()
    assert stepper.get_by_role("button", name="pause").count() == 1
    assert [stepper.locator("button").nth(i).bounding_box() for i in range(3)] == boxes


def test_caption_shows_the_step_arithmetic(page):
    stepper = page.locator(".ringviz-stepper").first
    for _ in range(2):
        stepper.get_by_role("button", name="next").click()
    assert stepper.locator(".ringviz-arithmetic").inner_text() == (
        "pos 6 -> slot 6 % 4 = 2; evicts 2 = 6 - 4; start = (6 + 1) % 4 = 3")
    labels = stepper.locator("svg .slot-index")
    assert [labels.nth(i).text_content() for i in range(labels.count())] == [
        "slot 0", "1", "2", "3"]


def test_window_drop_down_switches_to_the_precomputed_trace(page):
    """The drop-down only selects a trace Python computed; the page shows that trace's frame."""
    from ringviz.book.trace import Scenario, trace_scenario

    stepper = page.locator(".ringviz-stepper").first
    svg, caption = stepper.locator("svg"), stepper.locator(".ringviz-caption")
    for _ in range(2):
        stepper.get_by_role("button", name="next").click()
    before = svg.inner_html()
    stepper.locator("select").select_option(label="3")
    expected = trace_scenario(Scenario(window=3, prompt=6, decode_steps=3)).frames[2]
    assert caption.inner_text() == expected.caption  # the place in the run is kept
    assert stepper.locator(".ringviz-arithmetic").inner_text() == expected.arithmetic
    assert svg.inner_html() != before
    assert stepper.locator("svg .slot").count() == 3
    stepper.locator("select").select_option(label="5")
    assert stepper.locator("svg .slot").count() == 5
    assert stepper.locator(".ringviz-counter").inner_text() == "step 2 / 4"
    assert page.log["errors"] == [] and page.log["external"] == []


def test_dark_page_steps_offline(dark_page):
    stepper = dark_page.locator(".ringviz-stepper").first
    stepper.get_by_role("button", name="next").click()
    assert stepper.locator(".slot-written").count() == 4
    assert dark_page.log["errors"] == [] and dark_page.log["external"] == []


def test_sink_slots_stand_apart_from_the_ring(page):
    """Sink slots are drawn in their own colour, under a 'sinks' bracket, with a gap before the
    ring; the sinks drop-down switches to the precomputed plain ring."""
    from ringviz.book.trace import Scenario, trace_scenario

    stepper = page.locator(".ringviz-stepper").nth(2)
    assert stepper.locator("svg .sink-label").text_content() == "sinks"
    stepper.get_by_role("button", name="next").click()
    expected = trace_scenario(Scenario(window=4, prompt=3, decode_steps=4, sinks=2)).frames[1]
    assert stepper.locator(".ringviz-arithmetic").inner_text() == expected.arithmetic
    assert stepper.locator("svg .slot-sink").count() == 2
    boxes = [stepper.locator("svg .slot").nth(i).bounding_box() for i in range(6)]
    gap = [boxes[i + 1]["x"] - boxes[i]["x"] - boxes[i]["width"] for i in range(5)]
    assert gap[1] > gap[0] + 10 and gap[1] > gap[2] + 10, gap  # sinks | ring
    labels = stepper.locator("svg .slot-index")
    assert [labels.nth(i).text_content() for i in range(6)] == ["slot 0", "1", "2", "3", "4", "5"]
    stepper.locator("select").select_option(label="0")
    assert stepper.locator("svg .slot").count() == 4
    assert stepper.locator("svg .slot-sink").count() == 0
    assert stepper.locator("svg .sink-label").count() == 0
    assert page.log["errors"] == []


# Keyboard (issue 27): the arrows step the stepper on screen with no click first, Home/End jump,
# the controls draw a focus outline, and the keys are listed under each stepper.
MOST_VISIBLE = """() => {
  const area = el => { const r = el.getBoundingClientRect();
    const h = Math.min(r.bottom, innerHeight) - Math.max(r.top, 0);
    const w = Math.min(r.right, innerWidth) - Math.max(r.left, 0);
    return h > 0 && w > 0 ? h * w : 0; };
  const all = [...document.querySelectorAll(".ringviz-stepper")].map(area);
  return all.indexOf(Math.max(...all));
}"""


def _counters(page) -> list[str]:
    c = page.locator(".ringviz-stepper .ringviz-counter")
    return [c.nth(i).inner_text() for i in range(c.count())]


def _scroll_to(page, n: int) -> None:
    page.locator(".ringviz-stepper").nth(n).evaluate("el => el.scrollIntoView({block: 'center'})")
    page.wait_for_timeout(100)


def test_arrows_step_the_stepper_on_screen_without_a_click(page):
    assert page.evaluate("document.activeElement === document.body")  # nothing clicked, no focus
    for n in (0, 2):
        _scroll_to(page, n)
        page.evaluate("document.activeElement.blur()")
        assert page.evaluate(MOST_VISIBLE) == n
        before = _counters(page)
        page.keyboard.press("ArrowRight")
        after = _counters(page)
        assert after[n] == before[n].replace("step 0", "step 1"), (before, after)
        assert [a for i, a in enumerate(after) if i != n] == [
            b for i, b in enumerate(before) if i != n]  # the others did not move
        page.keyboard.press("ArrowLeft")
        assert _counters(page) == before
    assert page.log["errors"] == []


def test_arrows_leave_a_text_field_alone(page):
    _scroll_to(page, 0)
    page.evaluate("""() => { const i = document.createElement('input'); i.id = 'probe';
        document.querySelector('.ringviz-stepper').before(i); i.focus(); }""")
    before = _counters(page)
    page.keyboard.press("ArrowRight")
    assert _counters(page) == before
    assert page.evaluate("document.activeElement.id") == "probe"


def test_a_focused_drop_down_keeps_up_down_and_gives_left_right_to_the_stepper(page):
    stepper = page.locator(".ringviz-stepper").first
    select = stepper.locator("select")
    select.focus()
    page.keyboard.press("ArrowRight")  # steps, and the window stays 4
    assert stepper.locator(".ringviz-counter").inner_text() == "step 1 / 4"
    assert select.evaluate("s => s.options[s.selectedIndex].text") == "4"
    page.keyboard.press("ArrowDown")  # the drop-down's own key: the next window
    assert select.evaluate("s => s.options[s.selectedIndex].text") == "5"
    assert stepper.locator("svg .slot").count() == 5
    page.keyboard.press("ArrowRight")  # still steps, focus still on the drop-down
    assert stepper.locator(".ringviz-counter").inner_text() == "step 2 / 4"
    assert page.evaluate("document.activeElement.tagName") == "SELECT"


def test_home_and_end_jump_to_the_first_and_last_step(page):
    stepper = page.locator(".ringviz-stepper").first
    counter = stepper.locator(".ringviz-counter")
    _scroll_to(page, 0)
    page.keyboard.press("ArrowRight")  # no click: the arrow focuses the stepper it stepped
    assert page.evaluate("document.activeElement.classList.contains('ringviz-stepper')")
    page.keyboard.press("End")
    assert counter.inner_text() == "step 4 / 4"
    page.keyboard.press("Home")
    assert counter.inner_text() == "step 0 / 4"
    stepper.get_by_role("button", name="next").focus()  # from a button too
    page.keyboard.press("End")
    assert counter.inner_text() == "step 4 / 4"


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_controls_draw_a_focus_outline(browser, book, scheme):
    """Tab through the first stepper: the stepper, its drop-down and each button draw a 2 px
    outline in the focus colour (light #0072B2, dark #56B4E9)."""
    focus = {"light": "rgb(0, 114, 178)", "dark": "rgb(86, 180, 233)"}[scheme]
    page = _open(browser, book, scheme)
    try:
        _scroll_to(page, 0)
        page.keyboard.press("ArrowRight")  # focuses the stepper
        seen = []
        for _ in range(5):  # the stepper, then select, prev, play, next
            style = page.evaluate("""() => { const el = document.activeElement, s = getComputedStyle(el);
                return [el.tagName, el.matches(':focus-visible'), s.outlineStyle, s.outlineWidth,
                        s.outlineColor]; }""")
            seen.append(style)
            page.keyboard.press("Tab")
        assert [s[0] for s in seen] == ["DIV", "SELECT", "BUTTON", "BUTTON", "BUTTON"], seen
        assert all(s[1:] == [True, "solid", "2px", focus] for s in seen), seen
    finally:
        page.close()


def test_keys_are_listed_under_each_stepper(page):
    hints = page.locator(".ringviz-stepper .ringviz-keys")
    assert hints.count() == 3
    text = hints.first.inner_text()
    for key in ("←", "→", "Home", "End", "Space", "↑"):
        assert key in text, text
    assert "↑" not in hints.nth(1).inner_text()  # no drop-down there
    size = float(hints.first.evaluate("el => getComputedStyle(el).fontSize")[:-2])
    assert size < 14  # small print, under the 14 px of the stepper's text
    box, svg = hints.first.bounding_box(), page.locator(".ringviz-stepper svg").first.bounding_box()
    assert box["y"] >= svg["y"] + svg["height"] - 1  # under the drawing
