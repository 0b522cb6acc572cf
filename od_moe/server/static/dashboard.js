// od-moe dashboard: polls /dashboard/data twice a second and draws it. Every figure element also carries
// the raw number in data-value, so a test (or a script) can read what the page shows.
"use strict";

const POLL_MS = 500;
const PLOT_S = 300;
const MIN_SPAN_S = 20;
let updates = 0;
let lastOk = 0;

const $ = (id) => document.getElementById(id);

function pct(x) { return x == null ? "–" : (100 * x).toFixed(1) + "%"; }
function num(x, digits) { return x == null ? "–" : x.toFixed(digits); }
function bytes(x) {
  if (x == null) return "–";
  // decimal units, as everything od-moe prints (od_moe/units.py)
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (x >= 1000 && i < units.length - 1) { x /= 1000; i += 1; }
  return (i ? x.toFixed(1) : x.toFixed(0)) + " " + units[i];
}

function show(id, value, text) {
  const el = $(id);
  el.textContent = text;
  el.dataset.value = value == null ? "" : String(value);
}

function plot(id, points, column, top, span) {
  // points: [seconds ago (<= 0), hit rate, tok/s]; x spans the last `span` seconds, y 0..top
  const line = $(id).querySelector("polyline");
  const xy = points
    .filter((p) => p[column] != null && p[0] >= -span)
    .map((p) => {
      const x = 300 * (1 + p[0] / span);
      const y = 100 - 96 * Math.min(p[column] / top, 1) - 2;
      return x.toFixed(1) + "," + y.toFixed(1);
    });
  line.setAttribute("points", xy.join(" "));
  $(id).dataset.points = String(xy.length);
}

const colors = {};
function color(code) {
  if (!colors[code]) {
    const name = { p: "--pinned", u: "--unused", f: "--prefetch", d: "--demand", ".": "--absent" }[code];
    colors[code] = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }
  return colors[code];
}

function drawStrip(layers) {
  // one row per MoE layer, one cell per expert id
  const canvas = $("strip");
  const rows = layers.length, cols = rows ? layers[0].length : 0;
  if (!rows || !cols) return;
  const cell = Math.max(2, Math.min(14, Math.floor(1200 / cols)));
  const rowH = Math.max(3, Math.min(14, Math.floor(480 / rows)));
  canvas.width = cols * cell;
  canvas.height = rows * rowH;
  const ctx = canvas.getContext("2d");
  const counts = { p: 0, u: 0, f: 0, d: 0 };
  layers.forEach((row, r) => {
    for (let c = 0; c < row.length; c += 1) {
      const code = row[c];
      if (code in counts) counts[code] += 1;
      ctx.fillStyle = color(code);
      ctx.fillRect(c * cell, r * rowH, cell - (cell > 3 ? 1 : 0), rowH - (rowH > 3 ? 1 : 0));
    }
  });
  canvas.dataset.resident = String(counts.p + counts.u + counts.f + counts.d);
  canvas.dataset.counts = JSON.stringify(counts);
}

function drawRanks(ranks) {
  // across ranks: one row per rank (its layers, state, decode hit rate and reads); hidden on one process
  $("ranks").hidden = !ranks;
  const body = $("rank-rows");
  body.replaceChildren(...(ranks || []).map((r) => {
    const row = document.createElement("tr");
    const layers = r.layers ? r.layers[0] + "–" + r.layers[1] : "–";
    for (const text of [String(r.rank), layers, r.state, pct(r.decode_hit_rate), bytes(r.bytes_read),
      r.experts_read == null ? "–" : String(r.experts_read)]) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.appendChild(cell);
    }
    row.className = r.state === "ok" ? "" : "bad";
    return row;
  }));
}

function render(d) {
  const dec = d.decode, pre = d.prefetch, req = d.requests;
  $("model").textContent = d.model;
  const status = $("status");
  status.textContent = d.status;
  status.className = "status" + (d.status === "ok" ? "" : " bad");
  $("policy").textContent = "prefetch: " + pre.policy + (pre.mode ? " (" + pre.mode + ")" : "") +
    " · misses: " + d.cache.miss_policy;
  show("hit-rate", dec.hit_rate, pct(dec.hit_rate));
  show("recent-hit-rate", d.recent.hit_rate, pct(d.recent.hit_rate));
  show("tok-s", d.recent.tok_s, num(d.recent.tok_s, 1));
  show("tokens", dec.generated_tokens, String(dec.generated_tokens));
  show("passes", dec.passes, String(dec.passes));
  show("precision", pre.precision, pct(pre.precision));
  show("prefetch-useful", pre.useful, String(pre.useful));
  show("prefetch-wasted", pre.wasted, String(pre.wasted));
  show("stall", dec.stall_ms_per_pass, dec.stall_ms_per_pass == null ? "–" :
    num(dec.stall_ms_per_pass, 2) + " ms");
  show("bytes", dec.bytes_per_pass, bytes(dec.bytes_per_pass));
  show("bytes-total", dec.bytes_read, bytes(dec.bytes_read));
  show("experts-per-token", dec.experts_per_token, num(dec.experts_per_token, 2));
  $("experts-moved-as").textContent = dec.experts_moved_as;
  const drafts = d.drafts;
  show("acceptance", drafts.acceptance_rate, pct(drafts.acceptance_rate));
  show("draft-accepted", drafts.accepted, String(drafts.accepted));
  show("drafted", drafts.drafted, String(drafts.drafted));
  $("draft-model").textContent = drafts.model == null ? "none" : drafts.model + " (" +
    drafts.num_draft_tokens + " a pass)";
  const tiers = d.tiers, held = tiers.experts_per_layer;
  show("tiers", held.disk, held.device + " / " + held.host + " / " + held.disk);
  $("tier-lanes").textContent = ["device", "host", "disk"]
    .map((k) => k + " " + pct(tiers.lane_shares[k])).join(", ");
  show("disk-read", tiers.disk_bytes_read, bytes(tiers.disk_bytes_read));
  show("disk-wait", tiers.disk_wait_ms_per_pass, tiers.disk_wait_ms_per_pass == null ? "–" :
    num(tiers.disk_wait_ms_per_pass, 2) + " ms");
  show("reruns", tiers.reruns, String(tiers.reruns));
  $("host-eviction").textContent = tiers.host_eviction == null ? "" :
    "(host tier evicts by " + tiers.host_eviction + ")";
  show("device-memory", d.memory.device_bytes, d.memory.device_bytes == null ? "none of its own" :
    bytes(d.memory.device_bytes));
  show("host-memory", d.memory.host_bytes, bytes(d.memory.host_bytes));
  show("in-flight", req.in_flight, String(req.in_flight));
  show("completed", req.completed, String(req.completed));
  show("cancelled", req.cancelled, String(req.cancelled));
  show("failed", req.failed, String(req.failed));
  const batch = d.batch, each = batch.running.map((r) => r.tok_s).filter((x) => x != null);
  show("batch-size", batch.size, String(batch.size));
  show("batch-max", batch.max_batch, String(batch.max_batch));
  show("queued", batch.queued, String(batch.queued));
  show("request-tok-s", each.length ? each.join(",") : null,
    each.length ? each.map((x) => num(x, 1)).join(" · ") : "–");
  const peak = Math.max(1, ...d.history.map((p) => p[2] || 0));
  show("tok-s-peak", peak, num(peak, 1));
  // the x axis grows with the samples kept, from MIN_SPAN_S to PLOT_S seconds
  const oldest = d.history.length ? -d.history[0][0] : 0;
  const span = Math.min(PLOT_S, Math.max(MIN_SPAN_S, Math.ceil(oldest / 10) * 10));
  const since = span >= 120 ? (span / 60).toFixed(0) + " min" : span + " s";
  $("span-hit").textContent = since;
  $("span-tok-s").textContent = since;
  plot("plot-hit", d.history, 1, 1, span);
  plot("plot-tok-s", d.history, 2, peak, span);
  $("cache-shape").textContent = d.cache.layers.length + " layers × " + d.cache.num_experts +
    " experts, " + d.cache.capacity + " slots each";
  drawStrip(d.cache.layers);
  drawRanks(d.ranks);
  updates += 1;
  lastOk = Date.now();
  document.body.dataset.updates = String(updates);
}

async function poll() {
  try {
    const r = await fetch("/dashboard/data", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    const status = $("status");
    status.textContent = "unreachable";
    status.className = "status bad";
  }
  $("age").textContent = lastOk ? ((Date.now() - lastOk) / 1000).toFixed(1) + " s ago" : "never";
  setTimeout(poll, POLL_MS);
}

poll();
