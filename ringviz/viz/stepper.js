// The ring stepper's view: draws one frame of a ringviz trace as SVG and steps through frames.
// It only renders what the trace says (computed in Python by the real caches); it never
// re-implements the ring. Works live (frame syncs to Python) and in a static page (no kernel).

/**
 * @typedef {{kind: string, caption: string, positions: number[][], start: number[],
 *   written: number[][], evicted: number[][], moved: number[], queries: number[][],
 *   keys: number[][], band: boolean[][][], slot_state: string[][]}} Frame
 * @typedef {{layout: string, window: number, rows: number, frames: Frame[]}} Trace
 */

const SVG = "http://www.w3.org/2000/svg";

/** @param {string} tag @param {Record<string, string | number>} attrs @param {Element} [parent] */
function el(tag, attrs, parent) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (parent) parent.appendChild(node);
  return node;
}

/** @param {Element} parent @param {number} x @param {number} y @param {string} text */
function label(parent, x, y, text, attrs = {}) {
  const t = el("text", { x, y, "text-anchor": "middle", "dominant-baseline": "central", ...attrs }, parent);
  t.textContent = text;
  return t;
}

/** @param {Frame} f @param {number} row */
function states(f, row) {
  return f.slot_state.length ? f.slot_state[row] : f.positions[row].map((p) => (p < 0 ? "empty" : "visible"));
}

/** Slot of the row's newest token (the write pointer), or -1 when the row is empty. */
function writeSlot(/** @type {number[]} */ positions) {
  const newest = Math.max(...positions);
  return newest < 0 ? -1 : positions.indexOf(newest);
}

/** One row of slots with pointers and evictions; returns the height used. */
function drawRow(svg, trace, f, row, x0, y0, cell, colors) {
  const written = new Set(f.written[row]);
  const st = states(f, row);
  f.positions[row].forEach((pos, s) => {
    const x = x0 + s * cell;
    const w = written.has(s);
    el("rect", {
      x: x + 2, y: y0, width: cell - 4, height: cell - 4, rx: 3,
      fill: pos < 0 ? "url(#ringviz-hatch)" : colors[st[s]],
      stroke: w ? colors.write : colors.edge, "stroke-width": w ? 3.5 : 1,
      class: `slot slot-${st[s]}${w ? " slot-written" : ""}`,
    }, svg);
    if (pos >= 0) label(svg, x + cell / 2, y0 + (cell - 4) / 2, String(pos), { "font-weight": w ? "bold" : "normal" });
  });
  const end = x0 + trace.window * cell + 8;
  if (f.evicted[row].length) {
    label(svg, end, y0 + cell / 2 - 2, `evicted ${f.evicted[row].join(", ")}`,
      { "text-anchor": "start", fill: colors.evict, class: "evicted" });
  }
  if (trace.layout === "ring") {
    const ws = writeSlot(f.positions[row]);
    if (ws >= 0) {
      // both pointers on one line under the row: write right of centre, start left of it
      const tri = (s, dx, color, name) => {
        const cx = x0 + s * cell + cell / 2 + dx, cy = y0 + cell + 1;
        el("path", { d: `M${cx},${cy} l-6,10 h12 z`, fill: color, class: name }, svg);
      };
      tri(ws, 7, colors.write, "write-pointer");
      tri(f.start[row], -7, colors.start, "start-pointer");
    }
  }
  if (trace.rows > 1) {
    label(svg, x0 - 8, y0 + cell / 2 - 2, `row ${row}`, { "text-anchor": "end", class: "row-label" });
  }
  return cell + 22;
}

/** The ring as a circle (single-row ring traces): slot 0 at 12 o'clock, clockwise. */
function drawCircle(svg, trace, f, cx, cy, r, colors) {
  const W = trace.window, st = states(f, 0), written = new Set(f.written[0]);
  const pt = (a, rad) => [cx + rad * Math.sin(a), cy - rad * Math.cos(a)];
  for (let s = 0; s < W; s++) {
    const a0 = (2 * Math.PI * s) / W, a1 = (2 * Math.PI * (s + 1)) / W, big = a1 - a0 > Math.PI ? 1 : 0;
    const [x0, y0] = pt(a0, r), [x1, y1] = pt(a1, r), [x2, y2] = pt(a1, r * 0.6), [x3, y3] = pt(a0, r * 0.6);
    const pos = f.positions[0][s];
    el("path", {
      d: `M${x0},${y0} A${r},${r} 0 ${big} 1 ${x1},${y1} L${x2},${y2} A${r * 0.6},${r * 0.6} 0 ${big} 0 ${x3},${y3} Z`,
      fill: pos < 0 ? "url(#ringviz-hatch)" : colors[st[s]],
      stroke: written.has(s) ? colors.write : colors.edge, "stroke-width": written.has(s) ? 3.5 : 1,
    }, svg);
    const [tx, ty] = pt((a0 + a1) / 2, r * 0.8);
    if (pos >= 0) label(svg, tx, ty, String(pos));
    const [sx, sy] = pt((a0 + a1) / 2, r * 1.13);
    label(svg, sx, sy, String(s), { fill: colors.edge, "font-size": 10 });
  }
  const ws = writeSlot(f.positions[0]);
  if (ws >= 0) {
    for (const [s, color, rad] of [[ws, colors.write, 0.55], [f.start[0], colors.start, 0.42]]) {
      const [ex, ey] = pt((2 * Math.PI * (s + 0.5)) / W, r * rad);
      el("line", { x1: cx, y1: cy, x2: ex, y2: ey, stroke: color, "stroke-width": 3, "marker-end": `url(#ringviz-arrow-${color === colors.write ? "w" : "s"})` }, svg);
    }
  }
}

/** Queries x keys of the current step (single-row traces), coloured like the slots. */
function drawBand(svg, trace, f, x0, y0, cell, colors) {
  const q = f.queries[0], k = f.keys[0];
  label(svg, x0, y0 + 6, `mask of this step: query (rows) x key position (columns), W=${trace.window}`,
    { "text-anchor": "start", "font-size": 11 });
  const top = y0 + 18;
  k.forEach((key, j) => label(svg, x0 + 34 + j * cell + cell / 2, top + 6, String(key), { "font-size": 9 }));
  q.forEach((query, i) => {
    const y = top + 14 + i * cell;
    label(svg, x0 + 28, y + cell / 2, String(query), { "text-anchor": "end", "font-size": 9 });
    k.forEach((key, j) => {
      const state = f.band[0][i][j] ? "visible" : key > query ? "future" : "stale";
      el("rect", { x: x0 + 34 + j * cell, y, width: cell - 1, height: cell - 1, fill: colors[state], class: `band-${state}` }, svg);
    });
  });
  const used = new Set(q.flatMap((query, i) => k.map((key, j) => (f.band[0][i][j] ? "visible" : key > query ? "future" : "stale"))));
  let lx = x0 + 40 + k.length * cell + 16;
  for (const state of ["visible", "stale", "future"].filter((s) => used.has(s))) {
    el("rect", { x: lx, y: top + 14, width: 12, height: 12, fill: colors[state] }, svg);
    label(svg, lx + 16, top + 20, state, { "text-anchor": "start", "font-size": 10 });
    lx += 30 + state.length * 6;
  }
  return 32 + q.length * cell;
}

function defs(svg, colors) {
  const d = el("defs", {}, svg);
  const p = el("pattern", { id: "ringviz-hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" }, d);
  el("rect", { width: 6, height: 6, fill: "#fff" }, p);
  el("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#bbb", "stroke-width": 2 }, p);
  for (const [id, color] of [["w", colors.write], ["s", colors.start], ["e", colors.edge]]) {
    const m = el("marker", { id: `ringviz-arrow-${id}`, viewBox: "0 0 10 10", refX: 8, refY: 5, markerWidth: 4, markerHeight: 4, orient: "auto" }, d);
    el("path", { d: "M0,0 L10,5 L0,10 z", fill: color }, m);
  }
}

function legend(svg, x, y, colors, ring) {
  const items = [["visible", colors.visible], ["empty", "url(#ringviz-hatch)"], ["written", "#fff"]];
  let cx = x;
  for (const [name, fill] of items) {
    el("rect", { x: cx, y, width: 14, height: 14, fill, stroke: name === "written" ? colors.write : colors.edge, "stroke-width": name === "written" ? 3 : 1 }, svg);
    label(svg, cx + 20, y + 7, name, { "text-anchor": "start", "font-size": 11 });
    cx += 34 + name.length * 6;
  }
  if (!ring) return;
  for (const [name, color] of [["write pointer", colors.write], ["start", colors.start]]) {
    el("path", { d: `M${cx + 7},${y + 1} l-6,11 h12 z`, fill: color }, svg);
    label(svg, cx + 18, y + 7, name, { "text-anchor": "start", "font-size": 11 });
    cx += 30 + name.length * 6;
  }
}

/** Redraw the whole SVG for the model's current frame. */
function draw(model, svg, caption, slider, counter) {
  /** @type {Trace} */
  const trace = model.get("trace");
  const colors = model.get("colors");
  const n = trace.frames.length;
  const i = Math.max(0, Math.min(model.get("frame"), n - 1));
  const f = trace.frames[i];
  svg.replaceChildren();
  defs(svg, colors);
  const cell = Math.max(22, Math.min(44, Math.floor(440 / trace.window)));
  const x0 = trace.rows > 1 ? 60 : 20;
  const ring = trace.layout === "ring";
  let y = ring ? 40 : 12;
  if (ring) {
    const x1 = x0 + (trace.window - 0.5) * cell, xa = x0 + cell / 2;
    el("path", { d: `M${x1},${y - 4} C${x1},${y - 22} ${xa},${y - 22} ${xa},${y - 6}`, fill: "none", stroke: colors.edge, "marker-end": "url(#ringviz-arrow-e)" }, svg);
    label(svg, x0, y - 28, `after slot ${trace.window - 1} the next write wraps to slot 0`, { "text-anchor": "start", "font-size": 10, fill: colors.edge });
  }
  for (let row = 0; row < trace.rows; row++) y += drawRow(svg, trace, f, row, x0, y, cell, colors);
  let width = x0 + trace.window * cell + 150;
  let height = y;
  if (ring && trace.rows === 1 && model.get("show_circle")) {
    const r = 80;
    drawCircle(svg, trace, f, width + r + 10, r + 20, r, colors);
    width += 2 * r + 40;
    height = Math.max(height, 2 * r + 40);
  }
  legend(svg, x0, height + 2, colors, ring);
  width = Math.max(width, x0 + (ring ? 450 : 260));  // room for the legend
  height += 24;
  if (ring && trace.rows === 1 && model.get("show_band") && f.queries[0].length && f.keys[0].length) {
    const bcell = Math.max(8, Math.min(16, Math.floor(400 / f.keys[0].length)));
    height += drawBand(svg, trace, f, x0, height + 4, bcell, colors) + 8;
    width = Math.max(width, x0 + 40 + f.keys[0].length * bcell + 220);
  }
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("width", String(width));
  svg.setAttribute("height", String(height));
  caption.textContent = f.caption;
  svg.setAttribute("aria-label", `step ${i}: ${f.caption}`);
  slider.max = String(n - 1);
  slider.value = String(i);
  counter.textContent = `step ${i} / ${n - 1}`;
}

function render({ model, el: host }) {
  const root = document.createElement("div");
  root.className = "ringviz-stepper";
  root.tabIndex = 0;
  const bar = document.createElement("div");
  bar.className = "ringviz-controls";
  const button = (text, title) => {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = text;
    b.title = title;
    bar.appendChild(b);
    return b;
  };
  const prev = button("◀ prev", "previous step (left arrow)");
  const play = button("▶ play", "play / pause (space)");
  const next = button("next ▶", "next step (right arrow)");
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
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("role", "img");
  root.append(bar, caption, svg);
  host.appendChild(root);

  const count = () => model.get("trace").frames.length;
  const go = (/** @type {number} */ i) => {
    model.set("frame", Math.max(0, Math.min(i, count() - 1)));
    try {
      model.save_changes();
    } catch (err) {
      // static page: no kernel to sync with; the view has already followed model.set
    }
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
  root.addEventListener("keydown", (e) => {
    const moves = { ArrowLeft: -1, ArrowRight: 1 };
    if (e.key in moves) { stop(); go(model.get("frame") + moves[e.key]); }
    else if (e.key === " ") toggle();
    else return;
    e.preventDefault();
  });
  const redraw = () => draw(model, svg, caption, slider, counter);
  model.on("change:frame", redraw);
  model.on("change:trace", redraw);
  redraw();
  return () => { stop(); model.off("change:frame", redraw); model.off("change:trace", redraw); };
}

export default { render };
