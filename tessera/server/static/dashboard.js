// The Tessera dashboard: polls /v1/stats and draws its series as SVG line charts.
// Plain JavaScript with no library and no build step: the page must work offline from the
// package alone (docs/dashboard.md says why this over a bundled charting library).
"use strict";

const KEY_STORAGE = "tessera-api-key";
const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["var(--c1)", "var(--c2)", "var(--c3)", "var(--c4)"];

// chart name -> lines [label, series key, scale]; `max` fixes the top of the y axis.
const CHARTS = {
  ttft: {unit: "ms", lines: [["p50", "ttft_p50_ms", 1], ["p99", "ttft_p99_ms", 1]]},
  itl: {unit: "ms", lines: [["p50", "itl_p50_ms", 1], ["p99", "itl_p99_ms", 1]]},
  tps: {unit: "tok/s", lines: [["output", "output_tokens_per_s", 1]]},
  queue: {unit: "", lines: [["running", "running", 1], ["waiting", "waiting", 1]]},
  kv: {unit: "%", max: 100, lines: [["device", "kv_usage", 100], ["host tier", "host_kv_usage", 100]]},
  prefix: {unit: "%", max: 100, lines: [["hit rate", "prefix_hit_rate", 100]],
           empty: "no prompt tokens looked up in this window"},
  spec: {unit: "%", max: 100, lines: [["accepted", "spec_acceptance", 100]],
         empty: "no draft tokens (speculative decoding off or idle)"},
  events: {unit: "", lines: [["preemptions", "preemptions", 1], ["rejected", "rejected", 1]]},
};

let apiKey = sessionStorage.getItem(KEY_STORAGE) || "";
let timer = null;

function $(sel) { return document.querySelector(sel); }

function svgEl(name, attrs, parent) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function fmt(v, unit) {
  if (v === null || v === undefined) return "-";
  if (v === Math.round(v) && Math.abs(v) < 1e4) return String(v);
  if (Math.abs(v) < 1) return v.toFixed(2);
  if (unit === "%" || Math.abs(v) < 10) return v.toFixed(1);
  return Math.round(v).toLocaleString("en-US");
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString("en-GB", {hour12: false});
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// One line chart: times `t` (s since the epoch), `lines` of [label, values], decision times as marks.
function drawChart(fig, t, lines, spec, marks) {
  const svg = fig.querySelector("svg");
  const W = Math.max(200, svg.clientWidth || 400), H = Math.max(100, svg.clientHeight || 160);
  const L = 44, R = 8, T = 8, B = 18;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const all = lines.flatMap(([, vs]) => vs.filter((v) => v !== null));
  const top = spec.max !== undefined ? spec.max : niceMax(Math.max(0, ...all));
  const t1 = t.length ? t[t.length - 1] : Date.now() / 1000, t0 = t.length ? Math.min(t[0], t1 - 60) : t1 - 60;
  const x = (s) => L + (W - L - R) * (s - t0) / Math.max(1e-9, t1 - t0);
  const y = (v) => T + (H - T - B) * (1 - v / top);
  for (let i = 0; i <= 4; i++) {
    const v = top * i / 4;
    svgEl("line", {class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v)}, svg);
    svgEl("text", {x: L - 4, y: y(v) + 3, "text-anchor": "end"}, svg).textContent = fmt(v, spec.unit);
  }
  for (let i = 0; i <= 3; i++) {
    const s = t0 + (t1 - t0) * i / 3;
    svgEl("text", {x: x(s), y: H - 4, "text-anchor": i === 0 ? "start" : i === 3 ? "end" : "middle"}, svg)
      .textContent = clock(s);
  }
  for (const m of marks) {
    if (m >= t0 && m <= t1) svgEl("line", {class: "mark", x1: x(m), x2: x(m), y1: T, y2: H - B}, svg);
  }
  let points = 0;
  lines.forEach(([, vs], i) => {
    let d = "", pen = false;
    vs.forEach((v, j) => {
      if (v === null) { pen = false; return; }
      d += `${pen ? "L" : "M"}${x(t[j]).toFixed(1)},${y(Math.min(v, top)).toFixed(1)}`;
      pen = true;
      points++;
    });
    // Colours through the style (CSSOM): presentation attributes do not take var().
    if (d) svgEl("path", {class: "line", d}, svg).style.stroke = COLORS[i % COLORS.length];
  });
  if (!points) {
    svgEl("text", {class: "empty", x: (L + W) / 2, y: H / 2, "text-anchor": "middle"}, svg)
      .textContent = spec.empty || "no data yet";
  }
  svg.dataset.points = String(points);
  const legend = fig.querySelector(".legend");
  legend.replaceChildren();
  lines.forEach(([label, vs], i) => {
    const item = document.createElement("span");
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = COLORS[i % COLORS.length];
    const now = document.createElement("span");
    now.className = "now";
    const last = vs.length ? vs[vs.length - 1] : null;
    now.textContent = `${fmt(last, spec.unit)}${spec.unit && last !== null ? " " + spec.unit : ""}`;
    item.append(sw, `${label} `, now);
    legend.appendChild(item);
  });
}

function renderFigures(totals) {
  const used = (totals["tessera:num_total_kv_blocks"] ?? 0) - (totals["tessera:num_free_kv_blocks"] ?? 0);
  const values = {...totals, kv_blocks_used: used};
  for (const el of document.querySelectorAll("[data-metric]")) {
    const v = values[el.dataset.metric];
    el.dataset.value = v === undefined ? "" : String(v);
    el.textContent = v === undefined ? "-" : Math.round(v).toLocaleString("en-US");
  }
}

function renderCharts(stats, marks) {
  const s = stats.series, t = s.t || [];
  for (const [name, spec] of Object.entries(CHARTS)) {
    const fig = document.querySelector(`[data-chart="${name}"]`);
    const lines = spec.lines.map(([label, key, scale]) =>
      [label, (s[key] || t.map(() => null)).map((v) => (v === null ? null : v * scale))]);
    drawChart(fig, t, lines, spec, marks);
  }
  const span = t.length ? t[t.length - 1] - t[0] : 0;
  const spanText = span < 120 ? `${Math.round(span)} s` : `${Math.round(span / 60)} min`;
  $("#window-note").textContent = `Charts: the last ${spanText}; rates and percentiles over sliding `
    + `${stats.window_s} s windows, sampled every ${stats.interval_s} s.`;
}

function renderDecisions(decisions, t0, t1) {
  const list = $("#decisions");
  list.replaceChildren();
  $("#no-decisions").hidden = decisions.length > 0;
  for (const d of decisions.slice().reverse()) {
    const li = document.createElement("li");
    const when = document.createElement("span");
    when.className = "when";
    when.textContent = d.wall_time ? clock(d.wall_time) : "";
    const knob = document.createElement("span");
    knob.className = "knob";
    const change = d.knob !== undefined ? `${d.knob}: ${d.old} \u2192 ${d.new}` : (d.decision || d.stage || "");
    knob.textContent = `[${d.source}] ${change}`;
    const why = [d.reason, d.figure, d.threshold && `threshold ${d.threshold}`].filter(Boolean).join("; ");
    li.append(when, knob, why ? ` \u2014 ${why}` : "");
    list.appendChild(li);
  }
  const svg = $("#timeline");
  const W = Math.max(200, svg.clientWidth || 400), H = 36;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const times = decisions.map((d) => d.wall_time).filter(Boolean);
  const lo = Math.min(t0, ...times), hi = Math.max(t1, ...times);
  const x = (s) => 8 + (W - 16) * (s - lo) / Math.max(1e-9, hi - lo);
  svgEl("line", {class: "grid", x1: 8, x2: W - 8, y1: 14, y2: 14}, svg);
  for (const s of times) svgEl("circle", {cx: x(s), cy: 14, r: 4}, svg);
  svgEl("text", {x: 8, y: 32}, svg).textContent = clock(lo);
  svgEl("text", {x: W - 8, y: 32, "text-anchor": "end"}, svg).textContent = clock(hi);
}

function renderConfig(config) {
  const body = $("#config tbody");
  body.replaceChildren();
  const started = config.configured || {}, live = config.in_force || {};
  const keys = [...new Set([...Object.keys(live), ...Object.keys(started)])];
  for (const k of keys) {
    if (k === "extra" && !Object.keys(started[k] || {}).length) continue;
    const tr = document.createElement("tr");
    const show = (v) => (typeof v === "string" ? v : JSON.stringify(v));
    const a = k in started ? show(started[k]) : "", b = k in live ? show(live[k]) : "";
    if (a && b && a !== b) tr.className = "changed";
    for (const text of [k, a, b || a]) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

async function checkHealth() {
  try {
    const r = await fetch("/health", {cache: "no-store"});
    return r.ok;
  } catch (e) {
    return false;
  }
}

async function refresh() {
  let next = 2;
  const status = $("#status");
  try {
    const headers = apiKey ? {Authorization: `Bearer ${apiKey}`} : {};
    const r = await fetch("/v1/stats", {headers, cache: "no-store"});
    if (r.status === 401) {
      $("#main").hidden = true;
      $("#key-form").hidden = false;
      $("#key-error").textContent = apiKey ? "That key was refused." : "";
      status.dataset.state = "error";
      status.textContent = "API key required";
      return;  // the form restarts the polling
    }
    if (!r.ok) throw new Error(`/v1/stats answered ${r.status}`);
    const stats = await r.json();
    next = stats.interval_s || next;
    const healthy = await checkHealth();
    $("#key-form").hidden = true;
    $("#main").hidden = false;
    $("#model").textContent = stats.model;
    status.dataset.state = healthy ? "ok" : "error";
    status.textContent = healthy ? "healthy" : "unhealthy (/health)";
    const marks = (stats.decisions || []).map((d) => d.wall_time).filter(Boolean);
    const t = stats.series.t || [];
    renderFigures(stats.totals);
    renderCharts(stats, marks);
    renderDecisions(stats.decisions || [], t.length ? t[0] : stats.time - 60, stats.time);
    renderConfig(stats.config || {});
    $("#updated").textContent = clock(stats.time);
    const counter = $("#refreshes");
    counter.dataset.count = String(Number(counter.dataset.count) + 1);
  } catch (e) {
    status.dataset.state = "error";
    status.textContent = `unreachable: ${e.message}`;
  }
  timer = setTimeout(refresh, next * 1000);
}

function start() {
  $("#key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    apiKey = $("#key-input").value.trim();
    sessionStorage.setItem(KEY_STORAGE, apiKey);
    clearTimeout(timer);
    refresh();
  });
  refresh();
}

document.addEventListener("DOMContentLoaded", start);
