// minfer viz: the prefill and decode graphs (Cytoscape.js), a traced generation streamed over
// SSE, per-node statistics of a chosen step, and the CPU-vs-torch diff. No build step, no CDN.
"use strict";

const KINDS = ["prefill", "decode"];
const BACKEND_BG = { cpu: "#cfe2ff", torch: "#ffe5b4" };
const MIXED_BG = "#e5dcf7";
const NO_DATA_BG = "#eceff3";
const RAMP = ["#440154", "#3b528b", "#21918c", "#5ec962", "#fde725"];  // viridis
const DIFF_RAMP = ["#1a9850", "#a6d96a", "#fee08b", "#f46d43", "#a50026"];

const state = {
  info: null,
  graphs: {},                     // kind -> described graph
  expanded: { prefill: new Set(), decode: new Set() },
  cys: {},
  steps: [],                      // step summaries of the current run / trace
  stepData: new Map(),            // step -> full record (per-node stats)
  selected: null,                 // selected step number
  node: null,                     // { kind, id }
  diff: null,
  colourBy: "backend",
};

const $ = (id) => document.getElementById(id);

async function api(path, options) {
  const resp = await fetch(path, options);
  if (!resp.ok) {
    let message = resp.statusText;
    try { const body = await resp.json(); message = body.error || JSON.stringify(body.detail); }
    catch (_) { /* not JSON */ }
    throw new Error(`${resp.status}: ${message}`);
  }
  return resp.json();
}

function setStatus(text, bad) {
  const el = $("status");
  el.textContent = text;
  el.className = bad ? "warn" : "";
}

function fmt(x) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (!Number.isFinite(x)) return String(x);
  if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e5)) return x.toExponential(3);
  return Number.isInteger(x) ? String(x) : x.toFixed(4);
}

function esc(s) {
  return String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

function showToken(text) {
  return JSON.stringify(text).slice(1, -1) || "∅";
}

// -- colours ---------------------------------------------------------------------------------
function lerp(a, b, t) { return Math.round(a + (b - a) * t); }

function ramp(stops, t) {
  t = Math.min(1, Math.max(0, t));
  const x = t * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const f = x - i;
  const a = stops[i], b = stops[i + 1];
  const ch = (s, k) => parseInt(s.slice(1 + 2 * k, 3 + 2 * k), 16);
  const rgb = [0, 1, 2].map((k) => lerp(ch(a, k), ch(b, k), f));
  return `rgb(${rgb.join(",")})`;
}

function isDark(colour) {
  const m = colour.match(/\d+/g);
  const rgb = colour.startsWith("#")
    ? [1, 3, 5].map((i) => parseInt(colour.slice(i, i + 2), 16)) : m.map(Number);
  return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 140;
}

function logScale(v, lo, hi) {
  if (!(v > 0)) return 0;
  return (Math.log10(v) - Math.log10(lo)) / (Math.log10(hi) - Math.log10(lo));
}

// -- graph elements --------------------------------------------------------------------------
function groupOf(n) { return n.input ? "inputs" : n.group; }

function groupLabel(group, members) {
  const name = group === "inputs" ? "inputs" : `layer ${group.slice(1)}`;
  return `${name}  ·  ${members.length} nodes`;
}

function elementsFor(kind) {
  const g = state.graphs[kind];
  const expanded = state.expanded[kind];
  const members = new Map();
  for (const n of g.nodes) {
    const grp = groupOf(n);
    if (grp) {
      if (!members.has(grp)) members.set(grp, []);
      members.get(grp).push(n);
    }
  }
  const rep = (n) => {
    const grp = groupOf(n);
    return grp && !expanded.has(grp) ? `g:${grp}` : `n${n.id}`;
  };
  const els = [];
  for (const [grp, list] of members) {
    els.push({ data: { id: `g:${grp}`, group: grp, label: groupLabel(grp, list), bg: NO_DATA_BG, fg: "#111827",
                       ...labelBox(groupLabel(grp, list), 11),
                       collapsed: !expanded.has(grp), members: list.map((n) => n.id) },
               classes: expanded.has(grp) ? "frame" : "group" });
  }
  for (const n of g.nodes) {
    const grp = groupOf(n);
    if (grp && !expanded.has(grp)) continue;
    const classes = [n.fused ? "fused" : "", n.tail ? "tail" : "", n.orphaned ? "orphan" : "",
                     n.input ? "input" : "", n.output ? "output" : ""].filter(Boolean);
    const data = { id: `n${n.id}`, node: n.id, label: `${n.name}\n${n.op}`,
                   members: [n.id], bg: NO_DATA_BG, fg: "#111827",
                   ...labelBox(`${n.name}\n${n.op}`, 9) };
    if (grp) data.parent = `g:${grp}`;
    els.push({ data, classes: classes.join(" ") });
  }
  const seen = new Set();
  for (const [src, dst] of g.edges) {
    const a = rep(g.nodes[src]), b = rep(g.nodes[dst]);
    const key = `${a}>${b}`;
    if (a === b || seen.has(key)) continue;
    seen.add(key);
    els.push({ data: { id: `e${key}`, source: a, target: b },
               classes: g.nodes[src].input ? "from-input" : "" });
  }
  return els;
}

const STYLE = [
  { selector: "node", style: {
      "shape": "round-rectangle", "label": "data(label)", "text-wrap": "wrap",
      "text-valign": "center", "font-size": 9, "font-family": "ui-monospace, monospace",
      "width": "data(w)", "height": "data(h)", "padding": "0px", "color": "data(fg)",
      "background-color": "data(bg)", "border-width": 1, "border-color": "#94a3b8" } },
  { selector: "node.group", style: {
      "font-size": 11, "font-weight": 600, "border-width": 1.5,
      "border-color": "#64748b" } },
  { selector: "node.frame", style: {
      "background-opacity": 0.06, "background-color": "#64748b", "border-style": "dashed",
      "text-valign": "top", "text-halign": "center", "font-size": 10, "color": "#475569",
      "padding": "10px" } },
  { selector: "node.fused", style: { "border-color": "#7c3aed", "border-width": 3 } },
  { selector: "node.tail", style: { "border-color": "#059669", "border-width": 3,
                                    "border-style": "double" } },
  { selector: "node.orphan", style: { "border-style": "dashed", "opacity": 0.5 } },
  { selector: "node.input", style: { "shape": "tag" } },
  { selector: "node.output", style: { "border-width": 3, "border-color": "#111827" } },
  { selector: "node:selected", style: { "overlay-color": "#2563eb", "overlay-opacity": 0.25,
                                        "overlay-padding": 4 } },
  { selector: "edge", style: {
      "width": 1.2, "line-color": "#94a3b8", "target-arrow-color": "#94a3b8",
      "target-arrow-shape": "triangle", "arrow-scale": 0.7, "curve-style": "bezier" } },
  { selector: "edge.from-input", style: { "line-style": "dotted", "opacity": 0.35 } },
];

// A layered (Sugiyama-style) layout of a DAG, small enough to own: each node's level is its
// longest path from a root (a node far above its readers moves down); within a level nodes sit in the order of their parents' mean x.
function layered(cy) {
  const nodes = cy.nodes().not(":parent");
  const ids = nodes.map((n) => n.id());
  const preds = new Map(ids.map((id) => [id, []]));
  const succs = new Map(ids.map((id) => [id, []]));
  cy.edges().forEach((e) => {
    if (preds.has(e.target().id()) && succs.has(e.source().id())) {
      preds.get(e.target().id()).push(e.source().id());
      succs.get(e.source().id()).push(e.target().id());
    }
  });
  const indeg = new Map(ids.map((id) => [id, preds.get(id).length]));
  const level = new Map();
  const queue = ids.filter((id) => indeg.get(id) === 0);
  queue.forEach((id) => level.set(id, 0));
  for (let i = 0; i < queue.length; i++) {
    const id = queue[i];
    for (const t of succs.get(id)) {
      level.set(t, Math.max(level.get(t) ?? 0, level.get(id) + 1));
      indeg.set(t, indeg.get(t) - 1);
      if (indeg.get(t) === 0) queue.push(t);
    }
  }
  ids.forEach((id) => { if (!level.has(id)) level.set(id, 0); });  // not a DAG: flatten
  for (const id of [...queue].reverse()) {  // a node far above its readers moves down to them
    const outs = succs.get(id).map((t) => level.get(t));
    const below = outs.length ? Math.min(...outs) - 1 : 0;
    if (preds.get(id).length && below - level.get(id) > 1) level.set(id, below);
  }
  const rows = [];
  for (const id of queue.length === ids.length ? queue : ids) {
    const l = level.get(id);
    (rows[l] = rows[l] || []).push(id);
  }
  const width = new Map(nodes.map((n) => [n.id(), labelWidth(n)]));
  const x = new Map();
  const pos = new Map();
  const gapX = 18, gapY = 62;
  rows.forEach((row, l) => {
    if (!row) return;
    const key = (id) => {
      const xs = preds.get(id).filter((p) => x.has(p)).map((p) => x.get(p));
      return xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : 0;
    };
    row.sort((a, b) => key(a) - key(b));
    const total = row.reduce((acc, id) => acc + width.get(id) + gapX, -gapX);
    let cursor = -total / 2;
    for (const id of row) {
      x.set(id, cursor + width.get(id) / 2);
      pos.set(id, { x: x.get(id), y: l * gapY });
      cursor += width.get(id) + gapX;
    }
  });
  return pos;
}

function labelBox(label, size) {
  // a monospace label's box: the longest line at the font size, plus padding
  const lines = String(label).split("\n");
  const pad = size >= 11 ? 10 : 7;
  return { w: Math.round(Math.max(...lines.map((l) => l.length)) * size * 0.62 + 2 * pad),
           h: Math.round(lines.length * size * 1.25 + 2 * pad - 4) };
}

function labelWidth(ele) { return ele.data("w") || 0; }

// Readable first: as wide as the panel allows up to 100 %, the top of the graph (or the layer
// just opened) in view; the wheel scrolls, ctrl+wheel zooms, "fit" shows everything.
function view(kind, focus) {
  const cy = state.cys[kind];
  const box = cy.elements().boundingBox();
  const w = cy.width();
  const zoom = Math.min(1.0, (w - 24) / box.w);
  cy.zoom(zoom);
  const target = focus ? cy.getElementById(focus) : null;
  const top = target && target.nonempty() ? target.boundingBox() : box;
  cy.pan({ x: w / 2 - zoom * (box.x1 + box.w / 2), y: 16 - zoom * top.y1 });
}

function fitAll(kind) {
  const cy = state.cys[kind];
  if (cy) cy.fit(undefined, 12);
}

function onWheel(kind, e) {
  const cy = state.cys[kind];
  if (!cy) return;
  e.preventDefault();
  if (e.ctrlKey || e.metaKey) {
    const level = cy.zoom() * (e.deltaY < 0 ? 1.15 : 1 / 1.15);
    cy.zoom({ level, renderedPosition: { x: e.offsetX, y: e.offsetY } });
  } else {
    cy.panBy({ x: -e.deltaX, y: -e.deltaY });
  }
}

function render(kind, focus) {
  const g = state.graphs[kind];
  const container = $(`cy-${kind}`);
  if (state.cys[kind]) state.cys[kind].destroy();
  if (!g) { state.cys[kind] = null; return; }
  const cy = cytoscape({ container, elements: elementsFor(kind), style: STYLE,
                         layout: { name: "preset" }, userZoomingEnabled: false,
                         minZoom: 0.05, maxZoom: 4 });
  state.cys[kind] = cy;
  recolour(kind);
  const pos = layered(cy);
  cy.nodes().not(":parent").positions((ele) => pos.get(ele.id()));
  view(kind, focus);
  cy.on("tap", "node", (evt) => onTap(kind, evt.target));
  $(`${kind}-info`).textContent =
    `${g.n_tokens} token${g.n_tokens > 1 ? "s" : ""} → ${g.n_out} row${g.n_out > 1 ? "s" : ""}`
    + ` · ${g.nodes.length} nodes · ${g.edges.length} edges · graph #${g.uid}`;
}

function onTap(kind, ele) {
  const grp = ele.data("group");
  if (grp !== undefined) {
    const set = state.expanded[kind];
    if (set.has(grp)) set.delete(grp); else set.add(grp);
    render(kind, `g:${grp}`);
    return;
  }
  state.node = { kind, id: ele.data("node") };
  showNode();
}

// -- colouring -------------------------------------------------------------------------------
function stepOfKind(kind) {
  if (state.selected === null) return null;
  const rec = state.stepData.get(state.selected);
  return rec && rec.kind === kind && rec.graph === state.graphs[kind]?.uid ? rec : null;
}

function diffOfKind(kind) {
  const d = state.diff;
  const g = state.graphs[kind];
  if (!d || !g) return null;
  const fits = d.steps.filter((s) => s.kind === kind && s.max_abs.length === g.nodes.length);
  if (!fits.length) return null;
  return fits.find((s) => s.step === state.selected) || fits[0];
}

function nodeValues(kind) {
  // node id -> the number the current colour mode shows (or undefined)
  const g = state.graphs[kind];
  const vals = new Array(g.nodes.length);
  if (state.colourBy === "diff") {
    const d = diffOfKind(kind);
    if (d) d.max_abs.forEach((v, i) => { if (v !== null) vals[i] = v; });
    return vals;
  }
  const rec = stepOfKind(kind);
  if (!rec) return vals;
  for (const r of rec.nodes) {
    if (state.colourBy === "time") vals[r.id] = r.t_us;
    else if (r.stats && state.colourBy === "absmax") vals[r.id] = r.stats.absmax;
    else if (r.stats) vals[r.id] = r.stats.nan + r.stats.inf;
  }
  return vals;
}

function recolour(kind) {
  const cy = state.cys[kind];
  const g = state.graphs[kind];
  if (!cy || !g) return;
  const vals = nodeValues(kind);
  const mode = state.colourBy;
  cy.nodes().forEach((ele) => {
    const ids = ele.data("members");
    let bg = NO_DATA_BG;
    if (mode === "backend") {
      const set = new Set(ids.map((i) => g.nodes[i].backend));
      bg = set.size === 1 ? BACKEND_BG[[...set][0]] || NO_DATA_BG : MIXED_BG;
    } else {
      const got = ids.map((i) => vals[i]).filter((v) => v !== undefined);
      if (got.length) {
        const v = mode === "time" ? got.reduce((a, b) => a + b, 0)
                                  : got.reduce((a, b) => (Number.isNaN(b) || b > a ? b : a));
        bg = colourFor(mode, v);
      }
    }
    ele.data("bg", bg);
    ele.data("fg", isDark(bg) ? "#f9fafb" : "#111827");
  });
}

function colourFor(mode, v) {
  if (Number.isNaN(v)) return "#dc2626";
  if (mode === "nonfinite") return v > 0 ? "#dc2626" : "#bbf7d0";
  if (mode === "diff") return v === 0 ? "#d9f0d3" : ramp(DIFF_RAMP, logScale(v, 1e-6, 1));
  if (mode === "time") return ramp(RAMP, logScale(v, 1, 1e5));
  return ramp(RAMP, logScale(v, 1e-2, 1e3));
}

function recolourAll() {
  KINDS.forEach(recolour);
  legend();
  if (state.node) showNode();
}

function legend() {
  const mode = state.colourBy;
  const grad = (stops) => `<i class="grad" style="background:linear-gradient(90deg,${stops.join(",")})"></i>`;
  let scale;
  if (mode === "backend") {
    scale = `<span><i style="background:${BACKEND_BG.cpu}"></i>cpu</span>`
      + `<span><i style="background:${BACKEND_BG.torch}"></i>torch</span>`
      + `<span><i style="background:${MIXED_BG}"></i>mixed (a layer)</span>`;
  } else if (mode === "diff") {
    scale = `<span>max |Δ| 1e-6 ${grad(DIFF_RAMP)} 1</span>`;
  } else if (mode === "time") {
    scale = `<span>time 1 µs ${grad(RAMP)} 100 ms</span>`;
  } else if (mode === "absmax") {
    scale = `<span>|x| max 0.01 ${grad(RAMP)} 1000</span>`;
  } else {
    scale = `<span><i style="background:#bbf7d0"></i>finite</span>`
      + `<span><i style="background:#dc2626"></i>NaN or Inf</span>`;
  }
  $("legend").innerHTML = scale
    + `<span><i style="border:3px solid #7c3aed"></i>fused</span>`
    + `<span><i style="border:3px double #059669"></i>tail rows</span>`
    + `<span><i style="border:1px dashed #555;opacity:.5"></i>orphaned by fusion</span>`
    + `<span><i style="background:${NO_DATA_BG}"></i>no data</span>`;
}

// -- the node panel --------------------------------------------------------------------------
function row(k, v) { return `<tr><td>${esc(k)}</td><td>${v}</td></tr>`; }

function nodeName(n) { return n.layer >= 0 && !n.name.endsWith(`.${n.layer}`) ? `${n.name}.${n.layer}` : n.name; }

function showNode() {
  const { kind, id } = state.node;
  const g = state.graphs[kind];
  const n = g.nodes[id];
  $("node-empty").hidden = true;
  let html = `<h3>${esc(n.name)}</h3><table class="kv">`;
  html += row("graph", `${kind} #${g.uid}, node ${n.id}`);
  html += row("op", esc(n.op)) + row("layer", n.layer >= 0 ? n.layer : "–");
  html += row("backend", esc(n.backend)) + row("shape", `[${n.shape.join(", ")}]`);
  html += row("dtype", esc(n.dtype));
  for (const [k, v] of Object.entries(n.payload)) {
    if (k !== "layer") html += row(k, esc(fmt(v)));
  }
  for (const w of n.weights) html += row("weight", `${esc(w.name)} <b>${esc(w.type)}</b>`);
  if (n.buffer) {
    const names = n.buffer.shared_with.map((i) => nodeName(g.nodes[i]));
    const shown = names.slice(0, 6).join(", ") + (names.length > 6 ? ` … (+${names.length - 6})` : "");
    html += row("buffer", `slot ${n.buffer.slot}, ${n.buffer.elements} f32`);
    html += row("reused by", names.length ? `${names.length} nodes: ${esc(shown)}` : "none");
  } else {
    html += row("buffer", n.orphaned ? "none (orphaned)" : "none (KV region / view)");
  }
  const flags = [n.fused && "fused", n.tail && "tail rows", n.orphaned && "orphaned",
                 n.input && "input", n.output && "output"].filter(Boolean);
  if (flags.length) html += row("marks", flags.join(", "));
  html += row("reads", n.srcs.map((s) => `${esc(nodeName(g.nodes[s]))} `
    + `[${g.nodes[s].shape.join(", ")}]`).join("<br>") || "–");
  html += "</table>";
  $("node-payload").innerHTML = html;
  showStats(kind, n);
}

function showStats(kind, n) {
  const rec = stepOfKind(kind);
  const r = rec ? rec.nodes.find((x) => x.id === n.id) : null;
  const d = diffOfKind(kind);
  let html = "";
  if (r && r.stats) {
    const s = r.stats;
    const bad = s.nan + s.inf > 0 ? ' class="warn"' : "";
    html += `<h3>Output at step ${rec.step}</h3><table class="kv">`;
    for (const k of ["min", "max", "mean", "std", "absmax"]) html += row(k, fmt(s[k]));
    html += `<tr${bad}><td>NaN / Inf</td><td>${s.nan} / ${s.inf}</td></tr>`;
    html += row("time", `${fmt(r.t_us)} µs`) + "</table>";
  } else if (r) {
    html += `<h3>Step ${rec.step}</h3><table class="kv">${row("time", `${fmt(r.t_us)} µs`)}</table>`;
  } else if (state.selected !== null) {
    html += `<div class="hint">The selected step ran the other graph.</div>`;
  }
  if (d && d.max_abs[n.id] !== undefined) {
    html += `<table class="kv">${row("max |Δ| cpu vs torch", fmt(d.max_abs[n.id]))}</table>`;
  }
  $("node-stats").innerHTML = html;
  drawHeat(r && r.heat);
}

function drawHeat(heat) {
  const canvas = $("heatmap");
  if (!heat || !heat.rows) { canvas.hidden = true; return; }
  const bytes = Uint8Array.from(atob(heat.b64), (c) => c.charCodeAt(0));
  const vals = new Int8Array(bytes.buffer);
  const cell = Math.max(2, Math.floor(256 / heat.cols));
  canvas.width = heat.cols * cell;
  canvas.height = heat.rows * cell;
  canvas.style.height = `${Math.max(16, (canvas.height / canvas.width) * 276)}px`;
  const ctx = canvas.getContext("2d");
  for (let r = 0; r < heat.rows; r++) {
    for (let c = 0; c < heat.cols; c++) {
      const v = vals[r * heat.cols + c] / 127;  // -1 .. 1 of the block's signed |max|
      const t = Math.abs(v);
      ctx.fillStyle = v >= 0 ? `rgb(255,${lerp(255, 40, t)},${lerp(255, 40, t)})`
                             : `rgb(${lerp(255, 40, t)},${lerp(255, 90, t)},255)`;
      ctx.fillRect(c * cell, r * cell, cell, cell);
    }
  }
  canvas.hidden = false;
  canvas.title = `rows × columns pooled (signed largest |x| per cell), scale ±${fmt(heat.scale)}`;
}

// -- steps -----------------------------------------------------------------------------------
function bars(el, items, unit) {
  const top = Math.max(...items.map(([, v]) => v), 1e-12);
  el.innerHTML = items.map(([label, v, shown]) =>
    `<div class="bar"><span class="label" title="${esc(label)}">${esc(label)}</span>`
    + `<span class="track"><span class="fill" style="display:block;width:${(100 * v / top).toFixed(1)}%"></span></span>`
    + `<span class="val">${shown ?? v.toFixed(2) + unit}</span></div>`).join("");
}

function addStepButton(summary) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = summary.kind === "prefill" ? `prefill ${summary.n_tokens}` : `${summary.step}`;
  b.className = summary.kind;
  b.dataset.step = summary.step;
  b.title = `${summary.kind}, position ${summary.pos}, ${summary.time_ms.toFixed(2)} ms`;
  b.addEventListener("click", () => selectStep(summary.step));
  $("steps").appendChild(b);
}

async function selectStep(step) {
  const summary = state.steps.find((s) => s.step === step);
  if (!summary) return;
  if (!state.stepData.has(step)) state.stepData.set(step, await api(`/api/trace/${step}`));
  if (state.graphs[summary.kind]?.uid !== summary.graph) {
    state.graphs[summary.kind] = await api(`/api/graph?uid=${summary.graph}`);
    render(summary.kind);
  }
  state.selected = step;
  document.querySelectorAll("#steps button").forEach((b) =>
    b.classList.toggle("sel", Number(b.dataset.step) === step));
  document.querySelectorAll(".tok").forEach((t) =>
    t.classList.toggle("sel", Number(t.dataset.step) === step));
  KINDS.forEach((k) => $(`cy-${k}`).parentElement.classList.toggle("active", k === summary.kind));
  $("step-title").textContent = `${step} · ${summary.kind} · pos ${summary.pos}`;
  $("step-time").textContent = `(${summary.time_ms.toFixed(2)} ms)`;
  bars($("top5"), summary.top.map((t) => [showToken(t.text) || `#${t.id}`, t.p,
                                          `${(100 * t.p).toFixed(1)}%`]), "");
  bars($("op-times"), Object.entries(summary.ops).map(([k, v]) => [k, v]), " ms");
  if (state.colourBy === "backend") { state.colourBy = "absmax"; $("colour-by").value = "absmax"; }
  recolourAll();
}

// -- running ---------------------------------------------------------------------------------
function resetRun() {
  state.steps = [];
  state.stepData.clear();
  state.selected = null;
  $("steps").innerHTML = "";
  $("output").innerHTML = "";
  $("top5").innerHTML = "";
  $("op-times").innerHTML = "";
}

function runBody() {
  return JSON.stringify({ prompt: $("prompt").value, chat: $("chat").checked,
                          max_tokens: Number($("max-tokens").value),
                          temperature: Number($("temperature").value) });
}

async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      yield [name, JSON.parse(data)];
    }
  }
}

function busy(on) {
  $("run").disabled = on;
  $("diff").disabled = on;
}

async function run() {
  busy(true);
  resetRun();
  setStatus("prefilling (the first run compiles kernels)…");
  try {
    const resp = await fetch("/api/generate", { method: "POST", body: runBody(),
                                                headers: { "Content-Type": "application/json" } });
    if (!resp.ok) throw new Error(`${resp.status}: ${(await resp.json()).error || resp.statusText}`);
    let last = null;
    for await (const [name, ev] of sseEvents(resp)) {
      if (name === "step") {
        state.steps.push(ev);
        addStepButton(ev);
        last = ev.step;
        setStatus(`step ${ev.step} (${ev.kind}) ${ev.time_ms.toFixed(1)} ms`);
      } else if (name === "token") {
        const span = document.createElement("span");
        span.className = "tok";
        span.textContent = ev.text.trim() ? ev.text : showToken(ev.text);
        if (!ev.text.trim()) span.classList.add("ws");
        span.dataset.step = last;
        span.title = `token ${ev.id}, drawn from step ${last}`;
        span.addEventListener("click", () => selectStep(Number(span.dataset.step)));
        $("output").appendChild(span);
      } else if (name === "done") {
        setStatus(`done (${ev.reason}): ${ev.n_tokens} tokens, `
          + `${ev.timings.decode_tokens_per_s.toFixed(1)} tok/s decode (traced)`);
      } else if (name === "error") {
        setStatus(ev.message, true);
      }
    }
    await loadGraphs();
    if (state.steps.length) await selectStep(state.steps[0].step);
  } catch (err) {
    setStatus(String(err.message || err), true);
  } finally {
    busy(false);
  }
}

async function runDiff() {
  busy(true);
  setStatus("running the prompt on cpu and torch…");
  try {
    const body = JSON.parse(runBody());
    state.diff = await api("/api/diff", { method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ prompt: body.prompt, chat: body.chat,
                             max_tokens: Math.min(4, body.max_tokens) }) });
    const first = state.diff.steps[0];
    const worst = first && first.worst ? first.worst : null;
    const g = state.graphs[first?.kind];
    setStatus(worst ? `largest |Δ| at step 0: ${fmt(worst.value)} in `
      + `${g && g.nodes.length === first.max_abs.length ? g.nodes[worst.id].name : "node " + worst.id}`
      : "diff done");
    state.colourBy = "diff";
    $("colour-by").value = "diff";
    recolourAll();
  } catch (err) {
    setStatus(String(err.message || err), true);
  } finally {
    busy(false);
  }
}

// -- start -----------------------------------------------------------------------------------
async function loadGraphs() {
  for (const kind of KINDS) {
    try {
      state.graphs[kind] = await api(`/api/graph?kind=${kind}`);
    } catch (err) {
      state.graphs[kind] = null;
      $(`${kind}-info`).textContent = String(err.message || err);
    }
    render(kind);
  }
}

async function start() {
  state.info = await api("/api/info");
  $("model").textContent = state.info.model;
  $("mode").textContent = state.info.live ? "live" : "saved trace";
  $("run-box").hidden = !state.info.live;
  $("colour-by").addEventListener("change", (e) => { state.colourBy = e.target.value; recolourAll(); });
  $("collapse-all").addEventListener("click", () => {
    KINDS.forEach((k) => { state.expanded[k].clear(); render(k); });
  });
  $("run").addEventListener("click", run);
  for (const kind of KINDS) {
    $(`cy-${kind}`).addEventListener("wheel", (e) => onWheel(kind, e), { passive: false });
    $(`fit-${kind}`).addEventListener("click", () => fitAll(kind));
  }
  $("diff").addEventListener("click", runDiff);
  legend();
  await loadGraphs();
  state.steps = await api("/api/steps");
  state.steps.forEach(addStepButton);
  if (state.steps.length) await selectStep(state.steps[0].step);
}

start().catch((err) => setStatus(String(err.message || err), true));
