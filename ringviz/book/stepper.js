// The ring stepper's view: draws one frame of a ringviz trace as SVG and steps through frames.
// It only renders what the traces say (computed in Python by the real caches); it never
// re-implements the ring. The drop-downs pick one of the traces Python precomputed for a grid of
// settings. Works live (frame and choice sync to Python) and in a static page (no kernel).
// Colours of text, edges and controls come from CSS variables (stepper.css) that follow the
// page's light or dark theme; slot fills are the figures' palette, with dark text on them.
// A trace with sinks (view.sinks = S) holds S + W slots, [S sink slots | W ring slots]: the sink
// slots are drawn apart from the ring, under a bracket labelled "sinks".

/**
 * @typedef {{caption: string, arithmetic: string, positions: number[][], start: number[],
 *   written: number[][], evicted: number[][], queries: number[][], keys: number[][],
 *   band: string[][], states: string[]}} Frame
 *   band: per row, per query, one '1' (visible) or '0' per key; states: per row, one letter per
 *   slot (v visible, s stale, f future, e empty, k sink)
 * @typedef {{layout: string, window: number, rows: number, sinks?: number, frames: Frame[]}} View
 *   as synced, a view's frames are indices into the model's "frames" (each distinct frame once)
 * @typedef {{name: string, label: string, values: string[]}} Param
 */

// Keys: Left/Right step and Home/End jump to the first/last step, Space plays. The arrows need no
// click: pressed anywhere on the page they step the stepper most on screen, unless a text field,
// a drop-down or another control that uses the arrow keys has focus. Inside a stepper its own
// drop-down keeps Up/Down (they change its value) and gives Left/Right to the stepper; its slider
// keeps every key (they move the slider, which steps). Home/End act on the stepper that has focus
// (an arrow press or a click gives it focus), so elsewhere on the page they still scroll.

const SVG = "http://www.w3.org/2000/svg";
const STATE = { v: "visible", s: "stale", f: "future", e: "empty", k: "sink" };
const SINK_GAP = 18;  // px between the sink slots and the ring

/** x of slot s's left edge: sink slots first, then a gap, then the ring. */
function slotX(view, x0, cell, s) {
  const S = view.sinks || 0;
  return x0 + s * cell + (S && s >= S ? SINK_GAP : 0);
}

/** Width of a row of slots, sinks and gap included. */
function rowWidth(view, cell) {
  const S = view.sinks || 0;
  return (S + view.window) * cell + (S ? SINK_GAP : 0);
}
const FG = "var(--rv-fg)", MUTED = "var(--rv-muted)", EDGE = "var(--rv-edge)", EVICT = "var(--rv-evict)";

/** Attributes whose value is a CSS variable go into style (presentation attributes cannot). */
function el(tag, attrs, parent) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) {
    const s = String(v);
    if (s.startsWith("var(")) node.style.setProperty(k, s);
    else node.setAttribute(k, s);
  }
  if (parent) parent.appendChild(node);
  return node;
}

function label(parent, x, y, text, attrs = {}) {
  const t = el("text", { x, y, "text-anchor": "middle", "dominant-baseline": "central", fill: FG, ...attrs }, parent);
  t.textContent = text;
  return t;
}

/** @param {Frame} f @param {number} row */
function states(f, row) {
  return f.states.length ? [...f.states[row]].map((c) => STATE[c]) : f.positions[row].map((p) => (p < 0 ? "empty" : "visible"));
}

/** Slot of the row's newest token (the write pointer), or -1 when the row is empty. */
function writeSlot(/** @type {number[]} */ positions) {
  const newest = Math.max(...positions);
  return newest < 0 ? -1 : positions.indexOf(newest);
}

/** A slot's fill: empty slots are hatched, the rest take the palette colour of their state. */
function fill(pos, state, colors) {
  return pos < 0 ? "url(#ringviz-hatch)" : colors[state];
}

/** One row of slots with slot numbers, pointers and evictions; returns the height used. */
function drawRow(svg, view, f, row, x0, y0, cell, colors) {
  const written = new Set(f.written[row]), S = view.sinks || 0;
  const st = states(f, row);
  f.positions[row].forEach((pos, s) => {
    const x = slotX(view, x0, cell, s);
    const w = written.has(s);
    if (row === 0) label(svg, x + cell / 2, y0 - 8, s === 0 ? "slot 0" : String(s), { "font-size": 11, fill: MUTED, class: "slot-index" });
    el("rect", {
      x: x + 2, y: y0, width: cell - 4, height: cell - 4, rx: 3,
      fill: fill(pos, st[s], colors), stroke: w ? colors.write : EDGE, "stroke-width": w ? 3.5 : 1,
      class: `slot slot-${st[s]}${w ? " slot-written" : ""}`,
    }, svg);
    if (pos >= 0) label(svg, x + cell / 2, y0 + (cell - 4) / 2, String(pos), { fill: "#000", "font-weight": w ? "bold" : "normal" });
  });
  const end = x0 + rowWidth(view, cell) + 8;
  if (f.evicted[row].length) {
    label(svg, end, y0 + cell / 2 - 2, `evicted ${f.evicted[row].join(", ")}`,
      { "text-anchor": "start", fill: EVICT, class: "evicted", "font-weight": "bold" });
  }
  if (view.layout === "ring") {
    const ws = writeSlot(f.positions[row]);
    if (ws >= 0) {
      // both pointers on one line under the row: write right of centre, start left of it
      const tri = (s, dx, color, name) => {
        const cx = slotX(view, x0, cell, s) + cell / 2 + dx, cy = y0 + cell + 1;
        el("path", { d: `M${cx},${cy} l-6,10 h12 z`, fill: color, class: name }, svg);
      };
      tri(ws, 7, colors.write, "write-pointer");
      if (f.start[row] >= S) tri(f.start[row], -7, colors.start, "start-pointer");  // ring's start
    }
  }
  if (view.rows > 1) {
    label(svg, x0 - 8, y0 + cell / 2 - 2, `row ${row}`, { "text-anchor": "end", class: "row-label" });
  }
  return cell + 22;
}

/** The ring as a circle (single-row ring traces): its first slot at 12 o'clock, clockwise. With
 * sinks the circle is the ring part only (slots S .. S + W - 1). */
function drawCircle(svg, view, f, cx, cy, r, colors) {
  const W = view.window, S = view.sinks || 0, st = states(f, 0), written = new Set(f.written[0]);
  const pt = (a, rad) => [cx + rad * Math.sin(a), cy - rad * Math.cos(a)];
  for (let s = 0; s < W; s++) {
    const a0 = (2 * Math.PI * s) / W, a1 = (2 * Math.PI * (s + 1)) / W, big = a1 - a0 > Math.PI ? 1 : 0;
    const [x0, y0] = pt(a0, r), [x1, y1] = pt(a1, r), [x2, y2] = pt(a1, r * 0.6), [x3, y3] = pt(a0, r * 0.6);
    const pos = f.positions[0][S + s];
    el("path", {
      d: `M${x0},${y0} A${r},${r} 0 ${big} 1 ${x1},${y1} L${x2},${y2} A${r * 0.6},${r * 0.6} 0 ${big} 0 ${x3},${y3} Z`,
      fill: fill(pos, st[S + s], colors),
      stroke: written.has(S + s) ? colors.write : EDGE, "stroke-width": written.has(S + s) ? 3.5 : 1,
    }, svg);
    const [tx, ty] = pt((a0 + a1) / 2, r * 0.8);
    if (pos >= 0) label(svg, tx, ty, String(pos), { fill: "#000" });
    const [sx, sy] = pt((a0 + a1) / 2, r * 1.13);
    label(svg, sx, sy, String(S + s), { fill: MUTED, "font-size": 11 });
  }
  const ws = writeSlot(f.positions[0]);
  if (ws >= S) {
    for (const [s, color, rad] of [[ws, colors.write, 0.55], [f.start[0], colors.start, 0.42]]) {
      const [ex, ey] = pt((2 * Math.PI * (s - S + 0.5)) / W, r * rad);
      el("line", { x1: cx, y1: cy, x2: ex, y2: ey, stroke: color, "stroke-width": 3, "marker-end": `url(#ringviz-arrow-${color === colors.write ? "w" : "s"})` }, svg);
    }
  }
  label(svg, cx, cy + r + 24, S ? `slot = ${S} + pos % ${W}` : `slot = pos % ${W}`, { "font-size": 12, fill: MUTED });
}

/** Queries x keys of the current step (single-row traces), coloured like the slots. The key
 * axis is split into the keys that were in the ring and the step's own chunk (the queries);
 * chunk keys that the ring did not keep are marked "never stored". Returns the height used. */
function drawBand(svg, view, f, x0, y0, cell, rowsShown, colors) {
  const q = f.queries[0], k = f.keys[0], inChunk = new Set(q), kept = new Set(f.positions[0]);
  label(svg, x0, y0 + 8, `mask of this step: query (rows) x key in slot order (columns), W=${view.window}${view.sinks ? `, ${view.sinks} sinks` : ""}`,
    { "text-anchor": "start", "font-size": 13, "font-weight": "bold" });
  const gx = x0 + 40, top = y0 + 26;
  const ringKeys = k.filter((key) => !inChunk.has(key));
  const groups = [[view.sinks ? "sinks + ring" : "ring", 0, ringKeys.length], ["chunk", ringKeys.length, k.length]].filter((g) => g[2] > g[1] && q.length > 1);
  for (const [name, a, b] of groups) {
    el("path", { d: `M${gx + a * cell + 2},${top + 10} v-6 H${gx + b * cell - 2} v6`, fill: "none", stroke: MUTED }, svg);
    label(svg, gx + ((a + b) / 2) * cell, top - 4, name, { "font-size": 12, fill: MUTED });
  }
  const kTop = top + 14;
  k.forEach((key, j) => {
    const never = inChunk.has(key) && !kept.has(key);
    label(svg, gx + j * cell + cell / 2, kTop + 8, String(key), { "font-size": 12, "text-decoration": never ? "line-through" : "none", fill: never ? EVICT : FG, class: never ? "never-stored" : "key" });
  });
  const state = (i, j) => (f.band[0][i][j] === "1" ? "visible" : k[j] > q[i] ? "future" : "stale");
  q.forEach((query, i) => {
    const y = kTop + 18 + i * cell;
    label(svg, gx - 6, y + cell / 2, String(query), { "text-anchor": "end", "font-size": 12 });
    k.forEach((key, j) => {
      el("rect", { x: gx + j * cell, y, width: cell - 2, height: cell - 2, fill: colors[state(i, j)], class: `band-${state(i, j)}` }, svg);
    });
  });
  const used = new Set(q.flatMap((_, i) => k.map((__, j) => state(i, j))));
  let lx = gx + k.length * cell + 20;
  let ly = kTop + 18;
  for (const s of ["visible", "stale", "future"].filter((s) => used.has(s))) {
    el("rect", { x: lx, y: ly, width: 14, height: 14, fill: colors[s] }, svg);
    label(svg, lx + 20, ly + 7, s, { "text-anchor": "start", "font-size": 12 });
    ly += 20;
  }
  if (k.some((key) => inChunk.has(key) && !kept.has(key))) {
    label(svg, lx, ly + 7, "struck key: never stored", { "text-anchor": "start", "font-size": 12 });
  }
  return kTop + 18 + rowsShown * cell - y0;
}

function defs(svg, colors) {
  const d = el("defs", {}, svg);
  const p = el("pattern", { id: "ringviz-hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" }, d);
  el("rect", { width: 6, height: 6, fill: "var(--rv-bg)" }, p);
  el("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "var(--rv-hatch)", "stroke-width": 2 }, p);
  for (const [id, color] of [["w", colors.write], ["s", colors.start], ["e", EDGE]]) {
    const m = el("marker", { id: `ringviz-arrow-${id}`, viewBox: "0 0 10 10", refX: 8, refY: 5, markerWidth: 4, markerHeight: 4, orient: "auto" }, d);
    el("path", { d: "M0,0 L10,5 L0,10 z", fill: color }, m);
  }
}

function legend(svg, x, y, colors, ring, sinks) {
  const items = [...(sinks ? [["sink", colors.sink]] : []), ["visible", colors.visible], ["empty", "url(#ringviz-hatch)"], ["written", "var(--rv-bg)"]];
  let cx = x;
  for (const [name, color] of items) {
    el("rect", { x: cx, y, width: 14, height: 14, fill: color, stroke: name === "written" ? colors.write : EDGE, "stroke-width": name === "written" ? 3 : 1 }, svg);
    label(svg, cx + 20, y + 7, name, { "text-anchor": "start", "font-size": 12 });
    cx += 36 + name.length * 7;
  }
  if (!ring) return;
  for (const [name, color] of [["write pointer", colors.write], ["start", colors.start]]) {
    el("path", { d: `M${cx + 7},${y + 1} l-6,11 h12 z`, fill: color }, svg);
    label(svg, cx + 18, y + 7, name, { "text-anchor": "start", "font-size": 12 });
    cx += 32 + name.length * 7;
  }
}

/** The view on display, its frame indices resolved against the shared frame table. */
function currentView(model) {
  const table = model.get("frames"), v = model.get("views")[model.get("choice")];
  return { ...v, frames: v.frames.map((i) => table[i]) };
}

/** Redraw the whole SVG for the model's current trace and frame. The SVG keeps one size for
 * every frame of a trace (the band is sized for the step with the most queries), so stepping
 * never moves what lies below it. */
function draw(model, parts) {
  const { svg, caption, arithmetic, slider, counter, selects } = parts;
  /** @type {View} */
  const view = currentView(model);
  const colors = model.get("colors");
  const n = view.frames.length;
  const i = Math.max(0, Math.min(model.get("frame"), n - 1));
  const f = view.frames[i];
  svg.replaceChildren();
  defs(svg, colors);
  const S = view.sinks || 0;
  const cell = Math.max(26, Math.min(44, Math.floor(440 / (S + view.window))));
  const x0 = view.rows > 1 ? 60 : 20;
  const ring = view.layout === "ring";
  let y = ring ? 58 : 26;
  if (ring) {
    const last = S + view.window - 1;
    const x1 = slotX(view, x0, cell, last) + cell / 2, xa = slotX(view, x0, cell, S) + cell / 2;
    el("path", { d: `M${x1},${y - 20} C${x1},${y - 38} ${xa},${y - 38} ${xa},${y - 22}`, fill: "none", stroke: EDGE, "marker-end": "url(#ringviz-arrow-e)" }, svg);
    label(svg, slotX(view, x0, cell, S), y - 46, `after slot ${last} the next write wraps to slot ${S}`, { "text-anchor": "start", "font-size": 12, fill: MUTED });
  }
  if (S) {  // bracket over the sink slots, apart from the ring
    const a = x0 + 2, b = x0 + S * cell - 2;
    el("path", { d: `M${a},${y - 16} v-6 H${b} v6`, fill: "none", stroke: MUTED, class: "sink-bracket" }, svg);
    label(svg, (a + b) / 2, y - 32, "sinks", { "font-size": 12, fill: MUTED, class: "sink-label" });
  }
  for (let row = 0; row < view.rows; row++) y += drawRow(svg, view, f, row, x0, y, cell, colors);
  let width = x0 + rowWidth(view, cell) + 150;
  let height = y;
  if (ring && view.rows === 1 && model.get("show_circle")) {
    const r = 80;
    drawCircle(svg, view, f, width + r + 10, r + 24, r, colors);
    width += 2 * r + 40;
    height = Math.max(height, 2 * r + 64);
  }
  legend(svg, x0, height + 2, colors, ring, S);
  width = Math.max(width, x0 + (ring ? (S ? 550 : 480) : 280));  // room for the legend
  height += 24;
  const bandFrames = view.frames.filter((g) => g.queries.length && g.queries[0].length && g.keys[0].length);
  if (ring && view.rows === 1 && model.get("show_band") && bandFrames.length) {
    const maxKeys = Math.max(...bandFrames.map((g) => g.keys[0].length));
    const maxQueries = Math.max(...bandFrames.map((g) => g.queries[0].length));
    const bcell = Math.max(20, Math.min(30, Math.floor(520 / maxKeys)));
    if (f.queries[0].length && f.keys[0].length) drawBand(svg, view, f, x0, height + 4, bcell, maxQueries, colors);
    height += 4 + 40 + 18 + maxQueries * bcell + 8;
    width = Math.max(width, x0 + 40 + maxKeys * bcell + 200);
  }
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("width", String(width));
  svg.setAttribute("height", String(height));
  caption.textContent = f.caption;
  arithmetic.textContent = f.arithmetic;
  svg.setAttribute("aria-label", `step ${i}: ${f.caption}`);
  slider.max = String(n - 1);
  slider.value = String(i);
  counter.textContent = `step ${i} / ${n - 1}`;
  let rest = model.get("choice");  // choice -> one index per drop-down (row-major, last fastest)
  for (let p = selects.length - 1; p >= 0; p--) {
    const m = selects[p].options.length;
    selects[p].value = String(rest % m);
    rest = Math.floor(rest / m);
  }
}

/** Every stepper on the page, across module instances (each widget may load its own copy). */
function registry() {
  const g = /** @type {any} */ (globalThis);
  if (!g.__ringvizSteppers) {
    g.__ringvizSteppers = new Set();
    document.addEventListener("keydown", (e) => onPageKey(e, g.__ringvizSteppers));
  }
  return /** @type {Set<{root: HTMLElement, key: (e: KeyboardEvent, focused: boolean) => boolean}>} */ (g.__ringvizSteppers);
}

/** Elements whose own arrow keys a page-wide handler must leave alone. */
function usesArrows(/** @type {Element | null} */ node) {
  if (!node || !(node instanceof HTMLElement)) return false;
  if (node.isContentEditable) return true;
  if (node instanceof HTMLSelectElement || node instanceof HTMLTextAreaElement) return true;
  if (node instanceof HTMLInputElement) return !["button", "submit", "reset", "checkbox", "radio"].includes(node.type);
  const role = node.getAttribute("role") || "";
  return ["textbox", "combobox", "listbox", "slider", "spinbutton", "menu", "menubar", "tablist", "tree", "grid", "radiogroup"].includes(role);
}

/** Pixels of an element inside the viewport (0: off screen). */
function onScreen(/** @type {HTMLElement} */ node) {
  const r = node.getBoundingClientRect();
  const h = Math.min(r.bottom, window.innerHeight) - Math.max(r.top, 0);
  const w = Math.min(r.right, window.innerWidth) - Math.max(r.left, 0);
  return h > 0 && w > 0 ? h * w : 0;
}

const MIN_VISIBLE = 40 * 200;  // px²: a sliver at the window's edge does not take the keys

function onPageKey(/** @type {KeyboardEvent} */ e, steppers) {
  if (e.defaultPrevented || e.altKey || e.ctrlKey || e.metaKey) return;
  const focused = document.activeElement;
  let target = [...steppers].find((s) => s.root.contains(/** @type {Node} */ (e.target)));
  if (target && onScreen(target.root) >= MIN_VISIBLE) {
    if (target.key(e, true)) e.preventDefault();
    return;
  }
  // not in a stepper on screen: only the arrows, only when nothing else wants them
  if (!(e.key === "ArrowLeft" || e.key === "ArrowRight") || usesArrows(focused)) return;
  target = [...steppers].map((s) => [onScreen(s.root), s]).filter(([a]) => a >= MIN_VISIBLE)
    .sort((a, b) => b[0] - a[0]).map(([, s]) => s)[0];
  if (target && target.key(e, false)) {
    e.preventDefault();
    target.root.focus({ preventScroll: true });  // Home/End and Space now reach it; outline shows which
  }
}

function render({ model, el: host }) {
  const root = document.createElement("div");
  root.className = "ringviz-stepper";
  root.tabIndex = 0;
  root.setAttribute("aria-keyshortcuts", "ArrowLeft ArrowRight Home End Space");
  /** @type {Param[]} */
  const params = model.get("params");
  const settings = document.createElement("div");
  settings.className = "ringviz-params";
  const selects = params.map((p) => {
    const wrap = document.createElement("label");
    wrap.append(`${p.label} `);
    const s = document.createElement("select");
    s.name = p.name;
    p.values.forEach((v, j) => s.add(new Option(v, String(j))));
    wrap.appendChild(s);
    settings.appendChild(wrap);
    return s;
  });
  const bar = document.createElement("div");
  bar.className = "ringviz-controls";
  const button = (text, title, cls) => {
    const b = document.createElement("button");
    b.type = "button";
    b.className = cls;
    b.textContent = text;
    b.title = title;
    bar.appendChild(b);
    return b;
  };
  const prev = button("◀ prev", "previous step (left arrow)", "rv-prev");
  const play = button("▶ play", "play / pause (space)", "rv-play");
  const next = button("next ▶", "next step (right arrow)", "rv-next");
  const slider = document.createElement("input");
  slider.type = "range";
  slider.min = "0";
  slider.setAttribute("aria-label", "step");
  bar.appendChild(slider);
  const counter = document.createElement("span");
  counter.className = "ringviz-counter";
  bar.appendChild(counter);
  const caption = document.createElement("div");
  caption.className = "ringviz-caption";
  caption.setAttribute("aria-live", "polite");
  const arithmetic = document.createElement("div");
  arithmetic.className = "ringviz-arithmetic";
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("role", "img");
  const keys = document.createElement("div");
  keys.className = "ringviz-keys";
  keys.innerHTML = "Keys: <kbd>←</kbd> <kbd>→</kbd> previous / next step (no click needed while the "
    + "stepper is on screen) · <kbd>Home</kbd> <kbd>End</kbd> first / last step · <kbd>Space</kbd> "
    + "play / pause" + (params.length ? " · <kbd>↑</kbd> <kbd>↓</kbd> change a focused drop-down" : "");
  if (params.length) root.append(settings);
  root.append(bar, caption, arithmetic, svg, keys);
  host.appendChild(root);

  const count = () => model.get("views")[model.get("choice")].frames.length;
  const sync = () => {
    try {
      model.save_changes();
    } catch (err) {
      // static page: no kernel to sync with; the view has already followed model.set
    }
  };
  const go = (/** @type {number} */ i) => {
    model.set("frame", Math.max(0, Math.min(i, count() - 1)));
    sync();
  };
  const pick = () => {  // the drop-downs' indices -> the precomputed trace they name
    let c = 0;
    selects.forEach((s) => { c = c * s.options.length + Number(s.value); });
    const frames = model.get("views")[c].frames.length;
    model.set("frame", Math.min(model.get("frame"), frames - 1));  // keep the place if it exists
    model.set("choice", c);
    sync();
  };
  let timer = 0;
  const stop = () => { clearInterval(timer); timer = 0; play.textContent = "▶ play"; };
  const toggle = () => {
    if (timer) return stop();
    if (model.get("frame") >= count() - 1) go(0);
    play.textContent = "❚❚ pause";
    timer = setInterval(() => (model.get("frame") >= count() - 1 ? stop() : go(model.get("frame") + 1)), 900);
  };
  prev.addEventListener("click", () => { stop(); go(model.get("frame") - 1); });
  next.addEventListener("click", () => { stop(); go(model.get("frame") + 1); });
  play.addEventListener("click", toggle);
  slider.addEventListener("input", () => { stop(); go(Number(slider.value)); });
  selects.forEach((s) => s.addEventListener("change", () => { stop(); pick(); }));
  /** One key for this stepper; true when it was used. ``focused``: the key came from inside it. */
  const key = (/** @type {KeyboardEvent} */ e, focused) => {
    const on = e.target;
    if (on instanceof HTMLInputElement) return false;  // the slider: its own keys move it
    const moves = { ArrowLeft: -1, ArrowRight: 1 };
    if (e.key in moves) { stop(); go(model.get("frame") + moves[e.key]); return true; }
    if (!focused || on instanceof HTMLSelectElement) return false;  // Up/Down/Home/End: its own
    if (e.key === "Home" || e.key === "End") { stop(); go(e.key === "Home" ? 0 : count() - 1); return true; }
    if (e.key === " " && !(on instanceof HTMLButtonElement)) { toggle(); return true; }  // a button: click
    return false;
  };
  const steppers = registry();
  const me = { root, key };
  steppers.add(me);
  const redraw = () => draw(model, { svg, caption, arithmetic, slider, counter, selects });
  model.on("change:frame", redraw);
  model.on("change:choice", redraw);
  model.on("change:views", redraw);
  model.on("change:frames", redraw);
  redraw();
  return () => {
    steppers.delete(me);
    stop();
    for (const name of ["frame", "choice", "views", "frames"]) model.off(`change:${name}`, redraw);
  };
}

export default { render };
