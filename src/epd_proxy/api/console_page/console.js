// The epd-proxy console: polls /console/api/state and draws it. Read-only, no dependencies.
"use strict";

const STATE_URL = "/console/api/state";
const REQUEST_URL = "/console/api/request?id=";
const POLL_MS = 1500;
const KEY_STORE = "epd-proxy-admin-key";

const ROLE_NAMES = {
  encode: "Encoders (E)", prefill: "Prefill (P)", decode: "Decode (D)", prefill_decode: "Prefill + decode (PD)",
};
const ROLE_SHORT = { encode: "E", prefill: "P", decode: "D", prefill_decode: "PD" };
// A symbol beside every state's words: the state reads without colour.
const STATE_MARK = {
  healthy: "●", ejected: "✕", "half-open": "◐", draining: "⏸", leaving: "→", mixed: "≠",
};
// KV events: a symbol beside the words too.
const KV_EVENTS_MARK = { connected: "●", stale: "◌", off: "–" };
// A turn's multi-turn KV reuse outcome, short (the waterfall has the long words).
const KV_OUTCOME_SHORT = {
  reused: "reused (prefill read it)", local_prefill: "reused (no prefill)", opening: "opening turn",
  unmatched: "nothing to reuse",
};
const FLOW_TEXT = {
  "E+P+D": "Media go to the encoders, prefill computes the prompt's KV, the KV moves to a decode, decode streams the answer.",
  "P+D": "Prefill computes the prompt's KV, the KV moves to a decode, decode streams the answer.",
  "E+PD": "Media go to the encoders; one combined instance computes the prompt and streams the answer.",
  PD: "Each request goes whole to one combined instance.",
};

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") node.textContent = value;
    else if (name.startsWith("data-") || name.startsWith("aria-") || name === "role" || name === "scope") {
      node.setAttribute(name, value);
    } else node[name] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function ms(value) {
  if (value === null || value === undefined) return "–";
  if (value >= 10000) return (value / 1000).toFixed(1) + " s";
  if (value >= 100) return Math.round(value) + " ms";
  return value.toFixed(1) + " ms";
}

function num(value, digits) {
  if (value === null || value === undefined) return "–";
  return Number(value).toFixed(digits === undefined ? 1 : digits);
}

function pct(value) { return value === null || value === undefined ? "–" : (value * 100).toFixed(0) + " %"; }

function host(url) { return url.replace(/^https?:\/\//, ""); }

function clock(ts) { return new Date(ts * 1000).toLocaleTimeString([], { hour12: false }); }

async function getJson(url) {
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers["X-API-Key"] = key;
  const resp = await fetch(url, { headers, cache: "no-store" });
  if (resp.status === 401 || resp.status === 403) {
    let message = "";
    try { message = (await resp.json()).error.message; } catch (e) { /* not the envelope */ }
    const err = new Error(message || "refused");
    err.auth = true;
    throw err;
  }
  if (!resp.ok) throw new Error("HTTP " + resp.status);
  return resp.json();
}

// -- the cluster ---------------------------------------------------------------------------
function drawFlow(state) {
  const topology = state.proxy.topology;
  $("flow-text").textContent = FLOW_TEXT[topology] || "No instances yet.";
  const byRole = groupByRole(state.instances);
  const flow = $("flow");
  flow.replaceChildren();
  for (const role of ["encode", "prefill", "decode", "prefill_decode"]) {
    const list = byRole[role];
    if (!list || !list.length) continue;
    const inRotation = list.filter((i) => i.in_rotation).length;
    const inflight = list.reduce((n, i) => n + i.inflight, 0);
    flow.append(el("li", { className: "flow-step" + (inRotation < list.length ? " degraded" : "") },
      el("strong", { text: ROLE_NAMES[role] }),
      el("span", { text: `${inRotation} of ${list.length} in rotation` }),
      el("span", { text: `${inflight} in flight` })));
  }
}

function groupByRole(instances) {
  const out = {};
  for (const inst of instances) (out[inst.role] = out[inst.role] || []).push(inst);
  return out;
}

// A KV cache's fill: precise when small (a large cache under light load is a fraction of a
// per cent, never "0 %" while blocks are in use), with its blocks when the instance says its size.
function kvUsageText(load) {
  const u = load.kv_usage;
  const digits = u === 0 || u >= 0.1 ? 0 : u >= 0.01 ? 1 : 2;
  let text = `KV cache ${(u * 100).toFixed(digits)} %`;
  if (u > 0 && u < 0.0001) text = "KV cache < 0.01 %";
  if (load.kv_blocks) text += ` (${Math.round(u * load.kv_blocks).toLocaleString("en")} of ${load.kv_blocks.toLocaleString("en")} blocks)`;
  return text;
}

// What an instance's own /metrics said. An encoder holds no KV for the requests: its queue is what counts.
function loadText(inst) {
  if (!inst.load) return "not scraped";
  const queue = `${num(inst.load.waiting, 0)} waiting · ${num(inst.load.others, 0)} not from this proxy`;
  return inst.role === "encode" ? queue : `${kvUsageText(inst.load)} · ${queue}`;
}

function plural(n, word) { return `${n} ${word}${n === 1 ? "" : "s"}`; }

function kvEventsText(kv, workers) {
  const bits = [kv.state_text];
  if (kv.state !== "off") {
    bits.push(`${kv.blocks ?? 0} blocks indexed`);
    if (kv.streams > 1) bits.push(`${kv.connected} of ${kv.streams} ranks connected`);
    if (workers > 1) bits.push(`connected in ${kv.workers_connected} of ${kv.workers} workers`);
    const trouble = [];
    if (kv.restarts) trouble.push(plural(kv.restarts, "engine restart"));
    if (kv.gaps) trouble.push(plural(kv.gaps, "gap"));
    if (kv.lost) trouble.push(`${kv.lost} lost`);
    bits.push(trouble.length ? trouble.join(", ") : "no gaps or restarts");
    if (kv.last_event) bits.push(`last event ${clock(kv.last_event)}`);
  }
  return bits.join(" · ");
}

function heldText(held) {
  if (held.keeps_blocks === false) return "keeps no blocks after an answer: no multi-turn reuse here";
  if (held.keeps_blocks === null && !held.held_tokens) return "none yet (no answer from it has kept blocks)";
  const text = `${held.held_tokens} tokens of ${plural(held.held_conversations, "conversation")} kept for a next turn`;
  return text;
}

function instanceCard(inst, workers) {
  const mark = STATE_MARK[inst.state] || "?";
  const facts = el("dl", { className: "facts" });
  const fact = (name, value, attrs) => {
    if (value === null || value === undefined || value === "") return;
    facts.append(el("dt", { text: name }), el("dd", Object.assign({ text: value }, attrs || {})));
  };
  if (inst.ejected_until) fact("Back on trial at", clock(inst.ejected_until));
  if (workers > 1) fact("In rotation in", `${inst.workers_in_rotation} of ${inst.workers} workers`);
  fact("Source", inst.source || "–");
  fact("In flight", String(inst.inflight));
  fact(inst.role === "encode" ? "Queue" : "Load", loadText(inst), { "data-load": inst.role });
  fact("Requests", String(inst.requests));
  const errors = Object.entries(inst.errors).map(([k, n]) => `${k} ${n}`).join(", ");
  fact("Errors", errors || "none");
  if (inst.media) {
    const share = inst.media.items ? ` (${pct(inst.media.repeats_home / inst.media.items)})` : "";
    fact("Media items", `${inst.media.items}, ${inst.media.repeats_home} repeats sent back here${share}`);
  }
  fact("Models", inst.models === null ? "not read yet" : (inst.models.join(", ") || "none"));
  if (inst.adapters.length) fact("LoRA adapters", inst.adapters.join(", "));
  if (inst.active_adapters.length) fact("Active adapters", inst.active_adapters.join(", "));
  if (inst.kv_events) {
    fact("KV events", `${KV_EVENTS_MARK[inst.kv_events.state] || ""} ${kvEventsText(inst.kv_events, workers)}`.trim(),
         { className: "kv-events kv-" + inst.kv_events.state, "data-kv-events": inst.kv_events.state });
  }
  if (inst.kv_reuse) fact("Held KV", heldText(inst.kv_reuse), { "data-held-tokens": String(inst.kv_reuse.held_tokens) });
  return el("article", { className: "card state-" + inst.state, "data-url": inst.url, "data-state": inst.state,
                         "data-role": inst.role },
    el("h4", { text: host(inst.url) }),
    el("p", { className: "state" }, el("span", { className: "mark", "aria-hidden": "true", text: mark }), " ",
       el("span", { className: "state-text", text: inst.state_text })),
    inst.reason ? el("p", { className: "why" }, el("span", { className: "muted", text: "Why: " }), inst.reason) : null,
    facts);
}

function drawModels(state) {
  const names = Object.keys(state.models || {}).sort();
  const body = $("models").tBodies[0];
  body.replaceChildren();
  $("models-wrap").hidden = names.length === 0;
  for (const name of names) {
    const m = state.models[name];
    const roles = Object.entries(m.roles).map(([role, n]) => `${ROLE_SHORT[role] || role} ${n.in_rotation} in, ${n.out} out`);
    const ready = m.ready ? (m.media === false ? "✓ text only (no encoder)" : "✓ ready") : "✕ not ready";
    // data-label: a narrow screen shows each row as a block, every cell under its column's name.
    body.append(el("tr", { "data-model": name, className: m.ready ? "" : "failed" },
      el("th", { scope: "row", text: name + (m.parent ? ` (adapter of ${m.parent})` : "") }),
      el("td", { text: ready, "data-label": "Can serve" }),
      el("td", { text: m.why || "–", "data-label": "Why not", "data-why": m.why ? "yes" : "" }),
      el("td", { text: roles.join(" · "), "data-label": "Instances per role" })));
  }
}

function drawPanel(state) {
  const panel = state.panel || { state_store: null, tenants: null };
  const facts = $("proxy-facts");
  facts.replaceChildren();
  const fact = (name, value, attrs) => facts.append(el("dt", { text: name }), el("dd", Object.assign({ text: value }, attrs || {})));
  const p = state.proxy;
  const present = new Set(state.instances.map((i) => (i.role === "prefill_decode" ? "decode" : i.role)));
  const routing = Object.entries(p.routing).filter(([role]) => present.has(role));
  fact("Routing", routing.map(([role, name]) => `${ROLE_SHORT[role] || role} ${name}`).join(" · ") || "no instances");
  const store = panel.state_store;
  if (store) {
    const since = store.up || !store.down_since ? "" : ` since ${clock(store.down_since)}`;
    const errors = Object.entries(store.errors).map(([k, n]) => `${k} ${n}`).join(", ");
    fact("State store", `${store.up ? "●" : "✕"} ${store.kind}: ${store.state_text}${since}${errors ? ` (errors: ${errors})` : ""}`,
         { "data-store": store.up ? "up" : "down" });
  } else {
    fact("State store", "none: each process keeps its own (multi-turn reuse, Responses ids)", { "data-store": "none" });
  }
  fact("Admin key", p.admin_key ? "configured" : "none");
  const tenants = panel.tenants;
  $("tenants-wrap").hidden = !tenants;
  const body = $("tenants").tBodies[0];
  body.replaceChildren();
  if (!tenants) return;
  let counters = panel.tenants_store ? `(counters ${panel.tenants_store}${state.workers > 1 ? ", as the worker that answered sees them" : ""})` : "";
  if (panel.tenants_store_up === false) counters = "(counters shared: ✕ the store does not answer, their use is not known now)";
  $("tenants-store").textContent = counters;
  $("tenants-store").dataset.store = panel.tenants_store_up === false ? "down" : (panel.tenants_store || "");
  for (const key of tenants) {
    const limits = key.limits.map((l) => `${l.limit_name} ${l.used ?? "?"} of ${l.limit}${l.share === null ? "" : ` (${pct(l.share)})`}`);
    body.append(el("tr", { "data-tenant": key.key },
      el("th", { scope: "row", text: key.key }),
      el("td", { text: key.policy === key.key ? "own entry" : key.policy }),
      el("td", { text: key.class }),
      el("td", { text: limits.join(" · ") || "no limits" })));
  }
}

function drawCluster(state) {
  drawModels(state);
  const root = $("cluster");
  root.replaceChildren();
  const byRole = groupByRole(state.instances);
  if (!state.instances.length) {
    root.append(el("p", { className: "muted", text: "No instances in the roster." }));
    return;
  }
  for (const [role, list] of Object.entries(byRole)) {
    const routing = state.proxy.routing[role === "prefill_decode" ? "decode" : role];
    const section = el("section", { className: "role", "data-role": role, "aria-label": ROLE_NAMES[role] || role },
      el("h3", {}, ROLE_NAMES[role] || role, " ", el("span", { className: "muted", text: routing ? `routing: ${routing}` : "" })));
    const grid = el("div", { className: "cards" });
    for (const inst of list) grid.append(instanceCard(inst, state.workers));
    section.append(grid);
    root.append(section);
  }
}

// -- the gateway: every replica, from the summaries they publish to the shared store --------
const REPLICA_MARK = { live: "●", stale: "◌", stopped: "⏸" };

function replicaCells(r, traffic, label) {
  const t = traffic;
  const out = r ? r.out.map((i) => `${ROLE_SHORT[i.role] || i.role} ${host(i.url)} out${i.reason ? ": " + i.reason : ""}`) : [];
  const rotation = r ? `${r.instances_in_rotation} of ${r.instances}${out.length ? " — " + out.join("; ") : ""}` : "";
  return [
    el("td", { text: r ? `${REPLICA_MARK[r.state] || ""} ${r.state_text}${r.state === "live" ? "" : ` (last ${clock(r.published)})`}` : label,
               "data-label": "State" }),
    el("td", { text: num(t.rps, 2), "data-label": "Req/s" }),
    el("td", { text: num(t.errors_per_s, 2), "data-label": "Errors/s" }),
    el("td", { text: String(t.inflight), "data-label": "In flight" }),
    el("td", { text: `${ms(t.ttft_p50_ms)} / ${ms(t.ttft_p99_ms)}`, "data-label": "TTFT p50 / p99" }),
    el("td", { text: rotation, "data-label": "Instances in rotation" }),
    el("td", { text: r ? `${r.version}, ${r.workers > 1 ? `${r.workers_publishing} of ${r.workers} workers` : "1 process"}` : "",
               "data-label": "Version, workers" }),
  ];
}

function drawGateway(state) {
  const gw = state.gateway;
  if (!gw) return;
  $("gateway-scope").textContent = `(${gw.scope_text})`;
  $("gateway").dataset.scope = gw.scope;
  const note = $("gateway-note");
  $("replicas-wrap").hidden = !gw.shared;
  if (!gw.shared) {
    note.hidden = true;
    return;
  }
  const bits = [];
  if (gw.store && !gw.store.up) bits.push(`✕ the state store does not answer${gw.store.down_since ? ` since ${clock(gw.store.down_since)}` : ""}: only this replica is shown, as it knows itself`);
  const failed = Object.entries(gw.failures).filter(([, n]) => n).map(([k, n]) => `${k} ${n}`);
  if (failed.length) bits.push(`summaries not published or read: ${failed.join(", ")}`);
  const seen = (d) => `${host(d.url)} in rotation in ${d.in_rotation} of ${d.replicas}${d.replicas < gw.live ? ` (not in the roster of ${gw.live - d.replicas})` : ""}`;
  if (gw.disagree.length) bits.push(`replicas see differently: ${gw.disagree.map(seen).join("; ")}`);
  note.textContent = bits.join(" · ");
  note.hidden = !bits.length;
  note.dataset.store = gw.store && !gw.store.up ? "down" : "up";
  const body = $("replicas").tBodies[0];
  body.replaceChildren();
  for (const r of gw.replicas) {
    body.append(el("tr", { className: r.state, "data-replica": r.listen, "data-replica-state": r.state, "data-this": r.this ? "yes" : "" },
      el("th", { scope: "row", text: `${r.host} ${r.listen}${r.this ? " (this one)" : ""}` }),
      ...replicaCells(r, r.traffic)));
  }
  const foot = $("replicas").tFoot;
  foot.replaceChildren(el("tr", { "data-replica-sum": String(gw.live) },
    el("th", { scope: "row", text: `All ${plural(gw.live, "live replica")}${gw.stopped ? ` (${gw.stopped} not publishing, left out)` : ""}` }),
    ...replicaCells(null, gw.sum, "sum; latency: the slowest replica's")));
}

// -- the traffic ---------------------------------------------------------------------------
function errorText(row) {
  const kinds = Object.entries(row.errors_per_s);
  if (!kinds.length) return "none";
  return kinds.map(([k, r]) => `${k} ${num(r, 2)}/s`).join(", ") + ` (${pct(row.error_ratio)})`;
}

function drawTraffic(state) {
  const t = state.traffic;
  $("traffic-window").textContent = `(last ${num(Math.min(state.window_s, t.covered_s), 0)} s)`;
  const all = t.models["*"];
  const tiles = $("tiles");
  tiles.replaceChildren();
  const tile = (name, value, id) => tiles.append(el("div", { className: "tile", "data-tile": id },
    el("span", { className: "tile-value", text: value }), el("span", { className: "tile-name", text: name })));
  tile("requests / s", num(all.rps, 1), "rps");
  tile("errors / s", num(Object.values(all.errors_per_s).reduce((a, b) => a + b, 0), 2), "errors");
  tile("TTFT p50", ms(all.ttft_ms.p50), "ttft");
  tile("ITL p50", ms(all.itl_ms.p50), "itl");
  tile("tokens out / s", num(all.completion_tokens_per_s, 0), "tokens");
  tile("turns that reused KV", all.kv_turns ? `${all.reused_turns} of ${all.kv_turns}` : "–", "reused");
  const body = $("traffic").tBodies[0];
  body.replaceChildren();
  const models = Object.keys(t.models).filter((m) => m !== "*").sort();
  for (const model of models.length > 1 ? ["*", ...models] : (models.length ? models : ["*"])) {
    const r = t.models[model];
    body.append(el("tr", { "data-model": model },
      el("th", { scope: "row", text: model === "*" ? "all models" : model }),
      el("td", { text: num(r.rps, 2) }),
      el("td", { text: errorText(r) }),
      el("td", { text: `${ms(r.ttft_ms.p50)} / ${ms(r.ttft_ms.p90)} / ${ms(r.ttft_ms.p99)}` }),
      el("td", { text: `${ms(r.itl_ms.p50)} / ${ms(r.itl_ms.p99)}` }),
      el("td", { text: num(r.prompt_tokens_per_s, 0) }),
      el("td", { text: num(r.completion_tokens_per_s, 0) }),
      el("td", { text: pct(r.cached_ratio) }),
      el("td", { text: num(r.encoder_items_per_s, 2) }),
      el("td", { text: num(r.kv_transfers_per_s, 2) }),
      el("td", { text: num(r.retried_per_s, 2) }),
      el("td", { text: r.kv_turns ? `${r.reused_turns} of ${r.kv_turns}` : "–", "data-reused": String(r.reused_turns) })));
  }
}

// -- charts: the last minutes, from the states this page polled ----------------------------
// Each point is one poll's numbers (each over the traffic window, so a line is that window's
// moving value). Kept in the page only: a reload starts them again. Inline SVG, no library.
const HISTORY_S = 600;
const SVG_NS = "http://www.w3.org/2000/svg";
const CHART_W = 320;
const CHART_H = 90;
const PALETTE = ["#0b5cad", "#1a7f37", "#8250df", "#b42318", "#9a6700", "#0a7b83", "#bf3989", "#57606a"];
const history = [];

function remember(state) {
  const all = state.traffic.models["*"];
  const load = {};
  for (const inst of state.instances) {
    load[`${ROLE_SHORT[inst.role] || inst.role} ${host(inst.url)}`] = inst.inflight + (inst.load ? inst.load.others : 0);
  }
  const last = history[history.length - 1];
  if (last && last.t >= state.generated) return;
  history.push({
    t: state.generated, rps: all.rps, errors: Object.values(all.errors_per_s).reduce((a, b) => a + b, 0),
    ttft50: all.ttft_ms.p50, ttft99: all.ttft_ms.p99, itl50: all.itl_ms.p50, itl99: all.itl_ms.p99,
    reused: all.reused_turns_per_s, load,
  });
  while (history.length && history[0].t < state.generated - HISTORY_S) history.shift();
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

// One small chart: series [{name, values: [[t, v|null]], dash}], a value formatter.
function chart(id, title, series, fmt) {
  // The x axis: from the oldest point kept to now, at least a minute (a fresh page fills it from the right).
  const now = history.length ? history[history.length - 1].t : 0;
  const span = Math.max(60, Math.min(HISTORY_S, history.length ? now - history[0].t : 0));
  const start = now - span;
  const values = series.flatMap((s) => s.values.map(([, v]) => v)).filter((v) => v !== null && v !== undefined);
  const top = Math.max(...values, 0) * 1.1 || 1;
  const box = svg("svg", { viewBox: `0 0 ${CHART_W} ${CHART_H}`, preserveAspectRatio: "none", class: "chart-svg",
                            role: "img", "data-points": String(history.length) });
  box.append(svg("line", { x1: 0, y1: CHART_H - 0.5, x2: CHART_W, y2: CHART_H - 0.5, class: "axis" }));
  const legend = el("ul", { className: "legend" });
  const words = [];
  series.forEach((s, i) => {
    const points = s.values.filter(([, v]) => v !== null && v !== undefined)
      .map(([t, v]) => `${((t - start) / span * CHART_W).toFixed(1)},${(CHART_H - 1 - v / top * (CHART_H - 4)).toFixed(1)}`);
    const colour = s.colour || PALETTE[i % PALETTE.length];
    const line = svg("polyline", { points: points.join(" "), fill: "none", stroke: colour, "stroke-width": 1.6,
                                   "vector-effect": "non-scaling-stroke", "data-series": s.name });
    if (s.dash) line.setAttribute("stroke-dasharray", "4 3");
    box.append(line);
    const latest = s.values.length ? s.values[s.values.length - 1][1] : null;
    words.push(`${s.name} ${fmt(latest)}`);
    if (series.length > 1) {
      const swatch = el("span", { className: "swatch" + (s.dash ? " dashed" : ""), "aria-hidden": "true" });
      swatch.style.borderColor = colour;
      legend.append(el("li", {}, swatch, `${s.name} ${fmt(latest)}`));
    }
  });
  const peak = values.length ? Math.max(...values) : null;
  const over = span >= 120 ? `${Math.round(span / 60)} minutes` : `${Math.round(span)} s`;
  box.setAttribute("aria-label", `${title}, over the last ${over}: now ${words.join(", ")}; highest ${fmt(peak)}`);
  box.dataset.span = String(Math.round(span));
  return el("figure", { className: "chart", "data-chart": id },
    el("figcaption", {}, el("strong", { text: title }), " ",
       el("span", { className: "muted", text: series.length > 1 ? `max ${fmt(peak)}` : `now ${fmt(series[0].values.length ? series[0].values[series[0].values.length - 1][1] : null)} · max ${fmt(peak)}` })),
    box, series.length > 1 ? legend : null);
}

function drawCharts() {
  const root = $("charts");
  const at = (key) => history.map((p) => [p.t, p[key]]);
  const names = [...new Set(history.flatMap((p) => Object.keys(p.load)))].sort();
  const shown = names.slice(0, PALETTE.length);
  root.replaceChildren(
    chart("rps", "requests / s", [{ name: "requests / s", values: at("rps") }], (v) => num(v, 1)),
    chart("errors", "errors / s", [{ name: "errors / s", values: at("errors"), colour: "#b42318" }], (v) => num(v, 2)),
    chart("ttft", "TTFT", [{ name: "p50", values: at("ttft50") }, { name: "p99", values: at("ttft99"), dash: true }], ms),
    chart("itl", "ITL", [{ name: "p50", values: at("itl50") }, { name: "p99", values: at("itl99"), dash: true }], ms),
    chart("reused", "reused turns / s", [{ name: "reused turns / s", values: at("reused"), colour: "#9a6700" }], (v) => num(v, 2)),
    chart("load", "requests on each instance", shown.map((name) => ({ name, values: history.map((p) => [p.t, p.load[name] ?? null]) })),
          (v) => num(v, 0)));
  $("charts-note").textContent = names.length > shown.length ? `(the first ${shown.length} of ${names.length} instances)` : "";
}

// -- requests ------------------------------------------------------------------------------
function resultText(s) {
  if (s.outcome === "ok") return `${s.status} ok`;
  if (s.outcome === "in_band_error") return `${s.status} error in the stream`;
  if (s.status === 499) return "499 client went away";
  return `${s.status} ${s.outcome.replace("_", " ")}`;
}

function kvText(s) {
  if (!s.kv_outcome) return "–";
  return KV_OUTCOME_SHORT[s.kv_outcome] || ("not reused: " + s.kv_outcome.replaceAll("_", " "));
}

function legsText(s) {
  return s.legs.map(([role, url, failed]) => `${ROLE_SHORT[role] || role} ${host(url)}${failed ? " (failed)" : ""}`).join(", ") || "–";
}

function drawRecent(state) {
  const body = $("recent").tBodies[0];
  body.replaceChildren();
  $("recent-empty").hidden = state.recent.length > 0;
  for (const s of state.recent) {
    const show = el("button", { type: "button", className: "link", text: s.id, "aria-label": `Show the path of request ${s.id}` });
    show.addEventListener("click", () => showRequest(s.id, s));
    body.append(el("tr", { "data-request-id": s.id, className: s.outcome === "ok" ? "" : "failed" },
      el("td", { text: clock(s.end) }),
      el("td", {}, show),
      el("td", { text: s.model || "–" }),
      el("td", { text: s.path }),
      el("td", { text: resultText(s) }),
      el("td", { text: ms(s.total_ms) }),
      el("td", { text: ms(s.first_byte_ms) }),
      el("td", { text: `${s.prompt_tokens ?? "–"} / ${s.completion_tokens ?? "–"}` }),
      el("td", { text: kvText(s), "data-kv-outcome": s.kv_outcome || "" }),
      el("td", { text: legsText(s) })));
  }
}

function drawWaterfall(s) {
  const list = $("waterfall");
  list.replaceChildren();
  const total = Math.max(s.total_ms || 0, ...s.waterfall.map((w) => w.end_ms), 0.001);
  for (const w of s.waterfall) {
    const bar = el("span", { className: "bar bar-" + w.stage, "aria-hidden": "true" });
    bar.style.marginLeft = (100 * w.start_ms / total) + "%";
    bar.style.width = Math.max(0.5, 100 * (w.end_ms - w.start_ms) / total) + "%";
    const where = w.instances.map(host).join(", ");
    const failed = w.failed.length ? ` — failed on ${w.failed.map(host).join(", ")}` : "";
    const why = w.why ? ` (placed: ${w.why})` : "";
    const when = w.start_ms === w.end_ms ? `at ${ms(w.start_ms)}` : `${ms(w.start_ms)} → ${ms(w.end_ms)} (${ms(w.end_ms - w.start_ms)})`;
    list.append(el("li", { "data-stage": w.stage },
      el("span", { className: "wf-label" }, el("strong", { text: w.label }), where ? ` on ${where}` : "", why, failed),
      el("span", { className: "wf-time", text: when }),
      el("span", { className: "track" }, bar)));
  }
  if (!s.waterfall.length) list.append(el("li", { text: "No stage finished for this request." }));
}

function showDetail(s) {
  $("detail-h").textContent = `Request ${s.id}`;
  const facts = $("detail-facts");
  facts.replaceChildren();
  const fact = (name, value) => facts.append(el("dt", { text: name }), el("dd", { text: value }));
  fact("Result", resultText(s));
  fact("Model", s.model || "–");
  fact("API", `${s.method} ${s.path}${s.stream ? " (stream)" : ""}`);
  fact("Total", ms(s.total_ms));
  fact("First byte", ms(s.first_byte_ms));
  if (s.itl_ms !== null) fact("Mean gap between events", ms(s.itl_ms));
  fact("Tokens in / out / cached", `${s.prompt_tokens ?? "–"} / ${s.completion_tokens ?? "–"} / ${s.cached_tokens ?? "–"}`);
  if (s.items) fact("Media items", String(s.items));
  if (s.kv_outcome) fact("Multi-turn KV", kvText(s));
  fact("Instances, in order", legsText(s));
  drawWaterfall(s);
  const detail = $("detail");
  detail.hidden = false;
  detail.dataset.requestId = s.id;
}

async function showRequest(id, known) {
  if (known && known.waterfall) { showDetail(known); $("detail").focus(); return; }
  try {
    const found = await getJson(REQUEST_URL + encodeURIComponent(id));
    if (!found.requests.length) {
      $("detail-h").textContent = `No recent request with id ${id}`;
      $("detail-facts").replaceChildren();
      $("waterfall").replaceChildren();
      $("detail").hidden = false;
      delete $("detail").dataset.requestId;
      return;
    }
    showDetail(found.requests[0]);
    $("detail").focus();
  } catch (err) { problem(err); }
}

// -- the loop ------------------------------------------------------------------------------
function problem(err) {
  if (err.auth) {
    $("auth").hidden = false;
    if (err.message) $("auth-why").textContent = err.message;
    $("live").textContent = "waiting for the admin API key";
  } else {
    $("live").textContent = `not updated: ${err.message} (retrying)`;
  }
}

function draw(state) {
  const p = state.proxy;
  const bits = [`topology ${p.topology}`];
  if (p.kv_connector) bits.push(`KV connector ${p.kv_connector}`);
  bits.push(`${state.instances.length} instances`);
  bits.push(state.workers_configured > 1 ? `${state.workers} of ${state.workers_configured} workers answered` : "1 process");
  if (state.gateway && state.gateway.shared) bits.push(plural(state.gateway.live, "replica") + " live");
  $("summary").textContent = bits.join(" · ");
  drawGateway(state);
  drawFlow(state);
  drawCluster(state);
  drawPanel(state);
  drawTraffic(state);
  remember(state);
  drawCharts();
  drawRecent(state);
  $("live").textContent = `live: updated ${clock(state.generated)}`;
}

let timer = null;

// One poll at a time; none while the tab is hidden (the proxy stops recording 30 s after the
// last look), and one at once when it shows again or a key was entered.
async function poll() {
  clearTimeout(timer);
  timer = null;
  if (document.hidden) return;
  try {
    const state = await getJson(STATE_URL);
    $("auth").hidden = true;
    draw(state);
  } catch (err) {
    problem(err);
  }
  if (timer === null) timer = setTimeout(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  $("auth-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("auth-key").value);
    $("auth-key").value = "";
    $("auth").hidden = true;
    poll();
  });
  $("find").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const id = $("find-id").value.trim();
    if (id) showRequest(id, null);
  });
  $("detail-close").addEventListener("click", () => { $("detail").hidden = true; });
  const fromUrl = new URLSearchParams(location.search).get("id");
  if (fromUrl) { $("find-id").value = fromUrl; showRequest(fromUrl, null); }
  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });
  poll();
});
