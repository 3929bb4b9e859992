// The live dashboard: polls GET /dashboard/stats?since=<last second seen> once a second,
// keeps the window of per-second samples here, and redraws tiles, charts and tier table.
"use strict";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);
let samples = []; // per-second samples, oldest first (see StatsHistory.Sample)
let lastT = 0; // the newest sample's second: the next poll asks only for later ones
let serverStart = null; // a restarted server starts a new history

function setStatus(text, bad) {
  $("dash-status").textContent = text;
  $("dash-status").classList.toggle("bad", Boolean(bad));
}

// Sets a tile's shown text, its sub line and the raw value (data-value, for scripts).
function setTile(id, value, text, sub) {
  const tile = $(id);
  tile.dataset.value = String(value);
  tile.querySelector(".value").textContent = text;
  tile.querySelector(".sub").textContent = sub || "";
}

const percent = (fraction) => (fraction === null ? "–" : `${formatNumber(fraction * 100, 1)}%`);
const ratio = (part, whole) => (whole > 0 ? part / whole : null);

function renderTiles(snap) {
  const { current, totals } = snap;
  setTile("tile-running", current.num_running_reqs, formatNumber(current.num_running_reqs));
  setTile("tile-waiting", current.num_waiting_reqs, formatNumber(current.num_waiting_reqs));
  const peak = Math.max(current.kv_cache_usage, ...samples.map((s) => s.kv_cache_usage));
  setTile("tile-kv", current.kv_cache_usage, percent(current.kv_cache_usage),
    `peak in view ${percent(peak)}`);
  $("tile-kv").dataset.peak = String(peak);
  const hitRate = ratio(totals.prefix_cache_hits, totals.prefix_cache_queries);
  setTile("tile-prefix", hitRate === null ? "" : hitRate, percent(hitRate),
    `${formatNumber(totals.prefix_cache_hits)} of ${formatNumber(totals.prefix_cache_queries)} prompt tokens`);
  const reasons = Object.entries(totals.finished_by_reason).map(([r, n]) => `${r} ${n}`).join(", ");
  setTile("tile-finished", totals.requests_finished, formatNumber(totals.requests_finished), reasons);
  setTile("tile-preemptions", totals.num_preemptions, formatNumber(totals.num_preemptions));
  const recent = samples.slice(-10);
  const seconds = Math.max(recent.length, 1);
  const genRate = recent.reduce((a, s) => a + s.generation_tokens, 0) / seconds;
  const promptRate = recent.reduce((a, s) => a + s.prompt_tokens, 0) / seconds;
  setTile("tile-throughput", genRate, `${formatNumber(genRate, 1)} tok/s`,
    `prompt ${formatNumber(promptRate, 1)} tok/s`);
  setTile("tile-tokens", totals.generation_tokens, formatNumber(totals.generation_tokens),
    `prompt tokens ${formatNumber(totals.prompt_tokens)}`);
  const ttft = ratio(totals.time_to_first_token_sum_s, totals.time_to_first_token_count);
  setTile("tile-ttft", ttft === null ? "" : ttft, ttft === null ? "–" : `${formatNumber(ttft * 1000)} ms`,
    totals.requests_finished
      ? `mean e2e ${formatNumber((totals.e2e_latency_sum_s / totals.requests_finished) * 1000)} ms`
      : "");
}

function renderCharts(snap) {
  const t1 = Math.floor(snap.time);
  const t0 = t1 - snap.window_s;
  const times = samples.map((s) => s.t);
  const series = (label, color, pick) => ({ label, color, values: samples.map(pick) });
  drawLineChart($("chart-requests"), {
    t0, t1, times, digits: 0,
    series: [series("running", "#2f6fed", (s) => s.num_running_reqs),
      series("waiting", "#f59e0b", (s) => s.num_waiting_reqs)],
  });
  drawLineChart($("chart-kv"), {
    t0, t1, times, yMax: 100, unit: "%",
    series: [series("KV usage", "#7c3aed", (s) => s.kv_cache_usage * 100)],
  });
  drawLineChart($("chart-throughput"), {
    t0, t1, times,
    series: [series("generation", "#16a34a", (s) => s.generation_tokens / snap.interval_s),
      series("prompt", "#0ea5e9", (s) => s.prompt_tokens / snap.interval_s)],
  });
  // Lookups happen only when requests are scheduled: the rate over the whole view so far
  // reads better than one that exists in a few seconds only.
  let queries = 0;
  let hits = 0;
  const hitRates = samples.map((s) => {
    queries += s.prefix_cache_queries;
    hits += s.prefix_cache_hits;
    return queries ? (hits / queries) * 100 : null;
  });
  drawLineChart($("chart-prefix"), {
    t0, t1, times, yMax: 100, unit: "%",
    series: [{ label: "prefix hits (in view)", color: "#db2777", values: hitRates },
      series("engine busy", "#64748b", (s) => Math.min(s.engine_busy_s / snap.interval_s, 1) * 100)],
  });
}

// One row per engine core (data parallelism: -dp N gives N; otherwise the one core).
function renderEngines(engines) {
  const rows = (engines || []).map((e) => {
    const cells = [
      ["engine", e.engine, String(e.engine)],
      ["num_running_reqs", e.num_running_reqs, formatNumber(e.num_running_reqs)],
      ["num_waiting_reqs", e.num_waiting_reqs, formatNumber(e.num_waiting_reqs)],
      ["kv_cache_usage", e.kv_cache_usage, percent(e.kv_cache_usage)],
      ["prefix_hit_rate", "", percent(ratio(e.prefix_cache_hits, e.prefix_cache_queries))],
      ["busy_s", e.busy_s, e.busy_s.toFixed(1)],
    ];
    const tr = document.createElement("tr");
    tr.dataset.engine = String(e.engine);
    for (const [field, raw, text] of cells) {
      const td = document.createElement("td");
      td.dataset.field = field;
      td.dataset.value = String(raw);
      td.textContent = text;
      tr.append(td);
    }
    return tr;
  });
  $("engines").querySelector("tbody").replaceChildren(...rows);
}

function renderTiers(tiers) {
  const names = Object.keys(tiers).sort();
  $("tiers-empty").hidden = names.length > 0;
  $("tiers").hidden = names.length === 0;
  const rows = names.map((name) => {
    const t = tiers[name];
    const cells = [
      ["tier", name, name],
      ["hits", t.hits, formatNumber(t.hits)],
      ["misses", t.misses, formatNumber(t.misses)],
      ["hit_rate", "", percent(ratio(t.hits, t.hits + t.misses))],
      ["bytes_stored", t.bytes_stored, formatBytes(t.bytes_stored)],
      ["bytes_retrieved", t.bytes_retrieved, formatBytes(t.bytes_retrieved)],
      ["evictions", t.evictions, formatNumber(t.evictions)],
      ["errors", t.errors, formatNumber(t.errors)],
    ];
    const tr = document.createElement("tr");
    tr.dataset.tier = name;
    for (const [field, raw, text] of cells) {
      const td = document.createElement("td");
      td.dataset.field = field;
      td.dataset.value = String(raw === undefined ? "" : raw);
      td.textContent = text;
      tr.append(td);
    }
    return tr;
  });
  $("tiers").querySelector("tbody").replaceChildren(...rows);
}

async function poll() {
  try {
    const response = await apiFetch(`/dashboard/stats?since=${lastT}`);
    if (!response.ok) {
      setStatus(`cannot read stats: ${await errorText(response)}`, true);
      return;
    }
    const snap = await response.json();
    if (serverStart !== snap.start_time) {
      // First contact, or the server restarted: start over from its whole history.
      const restarted = serverStart !== null;
      serverStart = snap.start_time;
      samples = [];
      if (restarted) {
        lastT = 0;
        await poll();
        return;
      }
    }
    samples.push(...snap.history);
    if (samples.length) lastT = samples[samples.length - 1].t;
    samples = samples.filter((s) => s.t > snap.time - snap.window_s);
    $("model-name").textContent = snap.model;
    renderTiles(snap);
    renderCharts(snap);
    renderEngines(snap.engines);
    renderTiers(snap.tiers);
    const clock = new Date(snap.time * 1000).toLocaleTimeString("en-GB", { hour12: false });
    setStatus(`live · updated ${clock} · one sample per second, last ${snap.window_s / 60} minutes`, false);
  } catch (err) {
    setStatus(`cannot reach the server: ${err.message}`, true);
  }
}

async function loop() {
  await poll();
  setTimeout(loop, POLL_MS);
}

initKeyBar(() => {
  lastT = 0;
  serverStart = null;
  poll();
});
loop();
