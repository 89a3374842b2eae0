// The live queue page: polls /queue every second, and /metrics (prediction quality) and /history
// (the last 15 minutes, for the charts) every few seconds, and renders them.
// No build step, no dependencies (charts.js draws the charts), no prompt text (the proxy never exposes any).
//
// Keys: when the proxy wants a key for its data (status_requires_key), /queue answers 401 and the
// page asks for one. The key is kept in this tab's session storage (gone when the tab closes) and
// sent as "Authorization: Bearer KEY" with every request for data. The page's own files need none.
"use strict";

const POLL_MS = 1000;
const SLOW_EVERY = 5; // polls between reads of /metrics and /history
const TIMELINE_ROWS = 30;
const TIMELINE_RECENT_S = 60; // the timeline shows requests that ended within this, or within the oldest active one's time
const WAITING_ROWS = 100; // the page lists the head of the queue; the summary counts all of it
const MIN_TAU_ANSWERS = 10; // fewer answers than this say too little for a rank correlation
const HEADER_MODELS = 3; // models named in the header's prediction quality
const CHART_MODELS = 6; // models with a color of their own in the answers' chart (the others share one)
const TENANT_ROWS = 20; // tenants listed: the bounded ones, then the busiest
const KEY_STORAGE = "clairvoyant.key";
const CLASS_COLORS = { short: "#2e8b57", medium: "#b7791f", long: "#c0392b", pending: "#7f8c8d" };
const PALETTE = ["#3d7dd8", "#d8763d", "#8e44ad", "#16a085", "#c0392b", "#2c3e50", "#d4ac0d", "#e84393", "#7f8c8d"];

class KeyNeeded extends Error {
  constructor(refused) {
    super(refused ? "the key was refused" : "a key is needed");
    this.refused = refused; // a key was sent, and the proxy did not accept it
  }
}

// -- fetching --------------------------------------------------------------------------------
function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

async function fetchData(path) {
  const key = storedKey();
  const response = await fetch(path, { cache: "no-store", headers: key ? { Authorization: `Bearer ${key}` } : {} });
  if (response.status === 401) throw new KeyNeeded(key !== "");
  if (!response.ok) throw new Error(`${path} answered ${response.status}`);
  return response;
}

// -- small helpers ---------------------------------------------------------------------------
function text(value, digits) {
  if (value === null || value === undefined || value === "") return "–";
  if (typeof value === "number") {
    if (!Number.isFinite(value)) return "–";
    return digits !== undefined ? value.toFixed(digits) : String(value);
  }
  return String(value);
}

const tenantName = (tenant) => tenant || "default";
const modelName = (model) => model || "default";

function cell(row, value, className) {
  const td = document.createElement("td");
  if (value instanceof Node) td.appendChild(value);
  else td.textContent = value;
  if (className) td.className = className;
  row.appendChild(td);
}

function fillTable(id, items, columns, emptyText) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  if (!items.length) {
    const tr = document.createElement("tr");
    cell(tr, emptyText, "empty");
    tr.firstChild.colSpan = columns.length;
    body.appendChild(tr);
    return;
  }
  for (const item of items) {
    const tr = document.createElement("tr");
    if (item.request_id !== undefined) tr.dataset.requestId = item.request_id;
    for (const [value, className] of columns.map((f) => f(item))) cell(tr, value, className);
    body.appendChild(tr);
  }
}

const classCell = (r) => [r.predicted_class, `class-${r.predicted_class}`];

// A color per name, the same for the same name on every redraw.
// A color per name (at most PALETTE.length - 1 of them; any other name gets the last, grey).
function colorFor(names) {
  const colors = new Map();
  names.slice(0, PALETTE.length - 1).forEach((name, i) => colors.set(name, PALETTE[i]));
  return (name) => colors.get(name) || PALETTE[PALETTE.length - 1];
}

// -- the queue (every poll) ------------------------------------------------------------------
function renderSummary(queue) {
  document.getElementById("summary").textContent =
    `policy ${queue.policy} · ${queue.in_flight.length}/${queue.slots} slots busy · ${queue.waiting_count} waiting` +
    (queue.waiting_count > queue.waiting.length ? ` (first ${queue.waiting.length} listed)` : "") +
    ` · queue drained in ~${text(queue.tail_eta_s, 1)} s` +
    ((queue.backends || []).length > 1
      ? " · " + queue.backends.map((b) => `${b.name} ${b.healthy ? `${b.in_flight}/${b.slots}` : "down"}`).join(", ")
      : "");
}

function renderBackends(queue) {
  const prior = queue.model_switch?.load_prior_s;
  fillTable("backends", queue.backends || [], [
    (b) => [b.name],
    (b) => [b.healthy ? "up" : "down", b.healthy ? "" : "bad"],
    (b) => [`${b.in_flight}/${b.slots}`],
    (b) => [b.holds === null || b.holds === undefined ? "–" : modelName(b.holds)],
    (b) => [(b.loaded_models || []).join(", ") || "–"],
    (b) => [b.switched_ago_s === null || b.switched_ago_s === undefined ? "never" : `${text(b.switched_ago_s, 0)} s ago`],
    (b) => {
      const loads = Object.entries(b.load_s || {});
      return [loads.length
        ? loads.map(([model, x]) => `${modelName(model)} ${text(x.load_s, 1)} s (${x.observations} loads)`).join(", ")
        : `none measured (counted as ${text(prior, 1)} s)`];
    },
    (b) => [`${text(b.slowness, 2)}×`],
  ], "no backend");
  const sw = queue.model_switch;
  const byModel = Object.entries(sw?.waiting_by_model || {}).map(([m, n]) => `${m} ${n}`).join(", ");
  document.getElementById("switch").textContent = !sw
    ? ""
    : (sw.bound_s > 0
      ? `Model switches: a backend serves the model it holds until a request for another has been put off ${text(sw.bound_s, 0)} s; ` +
        `loads under ${text(sw.free_load_s, 1)} s are no reason to wait.`
      : "Model switches: not held off (model_switch_bound_s = 0).") +
      (byModel ? ` Waiting by model: ${byModel}.` : "");
}

function renderTimeline(queue) {
  // Every request on one time axis, up to now: what is running or waiting, and what ended lately.
  // Requests that ended long ago stay off it, so that the current ones get the width.
  const active = [
    ...queue.in_flight.map((r) => ({ ...r, start: r.waited_s, dispatched: r.running_s, end: 0, state: "running" })),
    ...queue.waiting.map((r) => ({ ...r, start: r.waited_s, dispatched: null, end: 0, state: "queued" })),
  ];
  const lookback = Math.max(TIMELINE_RECENT_S, ...active.map((r) => r.start));
  const ended = queue.recent
    .filter((r) => r.ended_ago_s <= lookback)
    .map((r) => ({
      ...r,
      start: r.ended_ago_s + (r.service_s || 0) + r.waited_s,
      dispatched: r.service_s === null ? null : r.ended_ago_s + r.service_s,
      end: r.ended_ago_s,
      state: r.outcome,
    }));
  const rows = [...active, ...ended].slice(0, TIMELINE_ROWS);
  const span = spanCeiling(Math.max(5, ...rows.map((r) => Math.min(r.start, lookback))));
  const pct = (ago) => `${(100 * (1 - Math.min(Math.max(ago, 0), span) / span)).toFixed(2)}%`;
  const box = document.getElementById("timeline");
  box.replaceChildren(timelineAxis(span));
  for (const r of rows) {
    const row = document.createElement("div");
    row.className = "row";
    row.dataset.requestId = r.request_id;
    const id = document.createElement("span");
    id.className = "id";
    id.textContent = id.title = r.request_id;
    const state = document.createElement("span");
    state.className = `state state-${r.state}`;
    state.textContent = r.state.replace("_", " ");
    const bar = document.createElement("div");
    bar.className = "bar";
    const queuedEnd = r.dispatched === null ? r.end : r.dispatched;
    const queued = document.createElement("span");
    queued.className = "queued";
    queued.style.left = pct(r.start);
    queued.style.right = `calc(100% - ${pct(queuedEnd)})`;
    bar.appendChild(queued);
    if (r.dispatched !== null) {
      const running = document.createElement("span");
      running.className = "running";
      running.style.left = pct(r.dispatched);
      running.style.right = `calc(100% - ${pct(r.end)})`;
      bar.appendChild(running);
    }
    const tokens = document.createElement("span");
    tokens.className = "tokens";
    tokens.textContent = `predicted ${text(r.predicted_tokens, 0)} · actual ${text(r.output_tokens)}`;
    row.append(id, state, bar, tokens);
    box.appendChild(row);
  }
}

function timelineAxis(span) {
  // The timeline's own axis: seconds ago, from the left edge (span) to now.
  const axis = document.createElement("div");
  axis.className = "row axis time";
  const scale = document.createElement("div");
  scale.className = "scale";
  for (const fraction of [0, 0.25, 0.5, 0.75, 1]) {
    const label = document.createElement("span");
    const ago = span * (1 - fraction);
    label.textContent = ago === 0 ? "now" : `${text(ago, ago < 10 ? 1 : 0)} s ago`;
    label.style.left = `${100 * fraction}%`;
    scale.appendChild(label);
  }
  const title = document.createElement("span");
  title.className = "id";
  title.textContent = "request";
  const state = document.createElement("span");
  state.textContent = "state";
  const tokens = document.createElement("span");
  tokens.textContent = "tokens";
  axis.append(title, state, scale, tokens);
  return axis;
}

function renderCluster(cluster) {
  // With replicas (/queue's "cluster" part): the replicas' health, and the whole cluster's slots and
  // queue with the replica that holds each request. Without it the section stays hidden.
  const state = document.getElementById("cluster-state");
  document.getElementById("cluster").hidden = !cluster;
  for (const label of document.querySelectorAll(".on-replica")) label.hidden = !cluster;
  if (!cluster) {
    state.textContent = "";
    state.className = "";
    return;
  }
  const degraded = cluster.mode === "local";
  const live = cluster.replicas.filter((r) => r.live).length;
  state.textContent = `cluster ${cluster.name} · replica ${cluster.replica} · ` +
    (degraded ? "degraded: scheduling locally" : `${cluster.mode} · ${live}/${cluster.replicas.length} replicas live · ${cluster.waiting_count} waiting in the cluster`);
  state.className = degraded ? "degraded" : "";
  const mode = document.getElementById("cluster-mode");
  mode.textContent = (degraded
    ? `Replica ${cluster.replica} cannot reach Redis: it schedules locally on its share of the slots until Redis answers again.`
    : `Replica ${cluster.replica} answers, scheduling through Redis; a slot is leased for ${text(cluster.lease_s, 1)} s at a time and renewed while its request runs.`) +
    (cluster.quiet_s > 0 ? ` Redis lost its state: no new grants for ${text(cluster.quiet_s, 1)} s.` : "") +
    (cluster.error ? ` The shared state could not be read: ${cluster.error}` : "");
  mode.className = degraded || cluster.error ? "note degraded" : "note";
  fillTable("replicas", cluster.replicas, [
    (r) => [r.replica === cluster.replica ? `${r.replica} (this one)` : r.replica],
    (r) => [r.live ? "live" : "gone", r.live ? "" : "bad"],
    (r) => [`${text(r.beat_age_s, 1)} s ago`],
  ], "no replica reported");
  fillTable("cluster-slots", cluster.leases, [
    (l) => [`${l.backend} #${l.slot}`], (l) => [l.request_id], (l) => [l.replica], (l) => [text(l.expires_in_s, 1)],
  ], "all slots idle");
  fillTable("cluster-waiting", cluster.waiting.map((w, i) => ({ ...w, position: i })), [
    (w) => [w.position], (w) => [w.request_id], (w) => [w.replica], (w) => [modelName(w.model)],
    (w) => [text(w.predicted_s, 1)], (w) => [text(w.waited_s, 1)], (w) => [tenantName(w.tenant)], (w) => [w.priority],
    (w) => [w.overdue ? "overdue" : "", w.overdue ? "bad" : ""],
  ], "nobody waits");
  document.getElementById("cluster-more").textContent = cluster.waiting_count > cluster.waiting.length
    ? `and ${cluster.waiting_count - cluster.waiting.length} more waiting` : "";
}

function render(queue) {
  renderSummary(queue);
  renderCluster(queue.cluster);
  const pool = (queue.backends || []).length > 1;
  fillTable("slots", queue.in_flight, [
    (r) => [pool ? `${r.backend} #${r.slot}` : r.slot], (r) => [r.request_id], (r) => [modelName(r.model)], classCell,
    (r) => [text(r.predicted_tokens, 0)], (r) => [text(r.predicted_s, 1)], (r) => [text(r.running_s, 1)],
    (r) => [tenantName(r.tenant)], (r) => [r.priority],
  ], "all slots idle");
  fillTable("waiting", queue.waiting, [
    (r) => [r.position], (r) => [r.request_id], (r) => [modelName(r.model)], classCell,
    (r) => [text(r.predicted_tokens, 0)], (r) => [text(r.eta_s, 1)], (r) => [text(r.waited_s, 1)],
    (r) => [tenantName(r.tenant)], (r) => [r.priority],
  ], "nobody waits");
  renderBackends(queue);
  renderTenants(queue.tenants || {}, lastHistory);
  renderTimeline(queue);
}

// -- prediction quality (from /metrics) ------------------------------------------------------
let quality = new Map(); // model -> {tau, answers}

function parseQuality(metricsText) {
  // clairvoyant_prediction_kendall_tau{model="..."} 0.42 (NaN while undefined)
  // clairvoyant_prediction_quality_window_requests{model="..."} 180
  const found = new Map();
  const line = /^clairvoyant_prediction_(kendall_tau|quality_window_requests)\{model="((?:[^"\\]|\\.)*)"\} (\S+)$/gm;
  for (const [, metric, escaped, value] of metricsText.matchAll(line)) {
    const model = escaped.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    const entry = found.get(model) || { tau: null, answers: 0 };
    if (metric === "kendall_tau") entry.tau = Number(value); // Number("NaN") is NaN: checked where shown
    else entry.answers = Number(value) || 0;
    found.set(model, entry);
  }
  return found;
}

// "tau 0.42 over 180 answers", or why there is none yet.
function describeQuality(q) {
  if (!q) return "no quality figures yet (/metrics has none for it)";
  if (q.answers < MIN_TAU_ANSWERS || !Number.isFinite(q.tau)) {
    return `not enough data yet (${q.answers} answer${q.answers === 1 ? "" : "s"}; tau needs ${MIN_TAU_ANSWERS} that differ)`;
  }
  return `tau ${q.tau.toFixed(2)} over ${q.answers} answers`;
}

function renderQuality() {
  const models = [...quality.entries()].sort((a, b) => b[1].answers - a[1].answers);
  const shown = models.slice(0, HEADER_MODELS).map(([model, q]) => {
    const tau = q.answers >= MIN_TAU_ANSWERS && Number.isFinite(q.tau) ? q.tau.toFixed(2) : "not enough data";
    return `${modelName(model)} ${tau}`;
  });
  const more = models.length - shown.length;
  document.getElementById("quality").textContent = models.length
    ? "prediction tau: " + shown.join(", ") + (more > 0 ? ` (+${more} more models)` : "")
    : "";
}

// -- the charts (from /history) --------------------------------------------------------------
let lastHistory = null;

function chartSpan(history) {
  // From the oldest sample to now: the whole window once the proxy has run that long.
  return Math.min(history.window_s, spanCeiling(Math.max(30, history.covered_s)));
}

function renderCharts(history) {
  const span = chartSpan(history);
  const ago = history.series.ago_s;
  const zipped = (values) => ago.map((a, i) => [a, values[i]]);

  const queueLines = [
    { label: "waiting", color: "#8a93a0", points: zipped(history.series.waiting) },
    { label: "in flight", color: "#3d7dd8", points: zipped(history.series.in_flight) },
  ];
  timeChart(chartBox("queue"), { spanS: span, lines: queueLines, integer: true, empty: "no samples yet" });
  legend(legendBox("queue"), queueLines);

  const waitLines = [];
  for (const [cls, series] of Object.entries(history.waits.by_class)) {
    const color = CLASS_COLORS[cls] || CLASS_COLORS.pending;
    const points = (values) => history.waits.ago_s.map((a, i) => [a, values[i]]);
    if (!series.count.some((n) => n > 0)) continue;
    waitLines.push({ label: `${cls} P50`, color, points: points(series.p50), dots: true });
    waitLines.push({ label: `${cls} P95`, color, dash: "5 3", points: points(series.p95), dots: true });
  }
  timeChart(chartBox("waits"), { spanS: span, lines: waitLines, unit: " s", empty: "no request has waited yet" });
  legend(legendBox("waits"), waitLines);

  // The models with the most answers get a color each; a server that echoes any name may show many.
  const perModel = new Map();
  for (const a of history.answers) perModel.set(a.model, (perModel.get(a.model) || 0) + 1);
  const ranked = [...perModel.keys()].sort((a, b) => perModel.get(b) - perModel.get(a));
  const models = ranked.slice(0, CHART_MODELS);
  const color = colorFor(models);
  scatterChart(chartBox("answers"), {
    points: history.answers.map((a) => ({
      x: a.predicted_tokens, y: a.output_tokens, color: color(a.model),
      title: `${modelName(a.model)}: predicted ${text(a.predicted_tokens, 0)}, actual ${a.output_tokens}`,
    })),
    xLabel: "predicted tokens", yLabel: "actual tokens",
  });
  const others = ranked.length - models.length;
  legend(legendBox("answers"), [
    ...models.map((m) => ({ label: `${modelName(m)}: ${describeQuality(quality.get(m))}`, color: color(m) })),
    ...(others > 0 ? [{ label: `${others} other models`, color: color(null) }] : []),
  ]);

  const tenants = Object.keys(history.tenants);
  const tenantColor = colorFor(tenants);
  const tenantLines = tenants
    .filter((t) => history.tenants[t].waits_counted > 0)
    .map((t) => ({
      label: `${tenantName(t)} P95`, color: tenantColor(t), dots: true,
      points: history.waits.ago_s.map((a, i) => [a, history.tenants[t].waits.p95[i]]),
    }));
  timeChart(chartBox("tenants"), { spanS: span, lines: tenantLines, unit: " s", empty: "no tenant has waited yet" });
  legend(legendBox("tenants"), tenantLines);

  // Each bounded tenant's use as a share of its limit: the fuller of its two limits that move by the minute.
  const limitLines = tenants
    .filter((t) => history.tenants[t].limits.max_concurrent || history.tenants[t].limits.requests_per_minute)
    .map((t) => {
      const { limits, series } = history.tenants[t];
      const share = (i) => {
        const shares = [
          limits.max_concurrent && series.in_system[i] !== null ? series.in_system[i] / limits.max_concurrent : null,
          limits.requests_per_minute && series.requests_last_minute[i] !== null
            ? series.requests_last_minute[i] / limits.requests_per_minute : null,
        ].filter((v) => v !== null);
        return shares.length ? 100 * Math.max(...shares) : null;
      };
      return { label: tenantName(t), color: tenantColor(t), points: ago.map((a, i) => [a, share(i)]) };
    });
  timeChart(chartBox("limits"), {
    spanS: span, lines: limitLines, unit: "%", rules: [{ value: 100, label: "limit", color: "#c0392b" }],
    empty: "no tenant has a limit on requests",
  });
  legend(legendBox("limits"), limitLines);
}

const chartBox = (name) => document.querySelector(`#chart-${name} .chart`);
const legendBox = (name) => document.querySelector(`#chart-${name} .legend`);

// Use against a limit: "3 of 4" with a bar, or "3 (no limit)".
function usage(value, limit) {
  const box = document.createElement("span");
  box.className = "usage";
  if (limit === undefined || limit === null) {
    box.textContent = `${text(value)} (no limit)`;
    return box;
  }
  const bar = document.createElement("span");
  bar.className = "meter";
  const fill = document.createElement("span");
  const share = limit > 0 ? Math.min(1, value / limit) : 1;
  fill.style.width = `${(100 * share).toFixed(1)}%`;
  if (share >= 1) fill.className = "full";
  else if (share >= 0.8) fill.className = "high";
  bar.appendChild(fill);
  box.append(bar, document.createTextNode(`${text(value)} of ${text(limit)}`));
  return box;
}

function renderTenants(tenantsNow, history) {
  // Use now from /queue; waits over the window from /history.
  const names = [...new Set([...Object.keys(tenantsNow), ...Object.keys(history?.tenants || {})])];
  const rows = names.map((name) => ({ name, now: tenantsNow[name] || history?.tenants?.[name] || {}, past: history?.tenants?.[name] }));
  const bounded = (t) => Object.keys(t.now.limits || {}).length > 0;
  rows.sort((a, b) => bounded(b) - bounded(a) || (b.now.in_system || 0) - (a.now.in_system || 0) || a.name.localeCompare(b.name));
  const hidden = rows.length - TENANT_ROWS;
  document.getElementById("tenants-more").textContent = hidden > 0 ? `and ${hidden} more tenants, less busy` : "";
  fillTable("tenants", rows.slice(0, TENANT_ROWS), [
    (t) => [tenantName(t.name)],
    (t) => [t.past && t.past.waits_counted ? `${text(t.past.wait_p50_s, 2)} s / ${text(t.past.wait_p95_s, 2)} s (${t.past.waits_counted})` : "no waits yet"],
    (t) => [usage(t.now.in_system || 0, t.now.limits?.max_concurrent)],
    (t) => [usage(t.now.requests_last_minute || 0, t.now.limits?.requests_per_minute)],
    (t) => [usage(t.now.tokens_today || 0, t.now.limits?.tokens_per_day)],
  ], "no tenant has sent a request yet");
}

// -- the key ---------------------------------------------------------------------------------
function askForKey(refused) {
  // No data stays on the page while it is locked.
  document.getElementById("live").hidden = true;
  for (const body of document.querySelectorAll("#live tbody")) body.replaceChildren();
  for (const box of document.querySelectorAll("#live .chart, #live .legend, #timeline")) box.replaceChildren();
  for (const id of ["summary", "quality", "switch", "tenants-more", "cluster-state", "cluster-mode", "cluster-more"]) {
    document.getElementById(id).textContent = "";
  }
  document.getElementById("cluster").hidden = true;
  lastHistory = null;
  quality = new Map();
  if (refused) sessionStorage.removeItem(KEY_STORAGE);
  document.getElementById("login-error").textContent = refused ? "The proxy refused that key." : "";
  document.getElementById("forget").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("key").focus();
}

function showLive() {
  document.getElementById("login").hidden = true;
  document.getElementById("live").hidden = false;
  document.getElementById("forget").hidden = !storedKey();
}

document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = document.getElementById("key");
  sessionStorage.setItem(KEY_STORAGE, input.value.trim());
  input.value = "";
  document.getElementById("login").hidden = true;
  restart();
});

document.getElementById("forget").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORAGE);
  stop();
  askForKey(false);
});

// -- polling ---------------------------------------------------------------------------------
let polls = 0;
let timer = null;
let run = 0; // one polling loop at a time: a poll of an older run ends quietly

function setStatus(message) {
  const status = document.getElementById("status");
  status.textContent = message;
  status.className = message ? "status error" : "status";
}

async function poll(current) {
  timer = null;
  try {
    const queue = await (await fetchData(`/queue?limit=${WAITING_ROWS}`)).json();
    const slow = polls++ % SLOW_EVERY === 0;
    const [metrics, history] = slow
      ? await Promise.all([fetchData("/metrics").then((r) => r.text()), fetchData("/history").then((r) => r.json())])
      : [null, null];
    if (current !== run) return;
    showLive();
    if (slow) {
      quality = parseQuality(metrics);
      lastHistory = history;
      renderQuality();
      renderCharts(history);
    }
    render(queue);
    setStatus("");
  } catch (error) {
    if (current !== run) return;
    if (error instanceof KeyNeeded) {
      askForKey(error.refused); // polling stops until a key is entered
      return;
    }
    setStatus(`cannot reach the proxy: ${error.message}`);
  }
  timer = setTimeout(poll, POLL_MS, current);
}

function stop() {
  run += 1;
  clearTimeout(timer);
}

function restart() {
  stop();
  polls = 0;
  poll(run);
}

poll(run);
