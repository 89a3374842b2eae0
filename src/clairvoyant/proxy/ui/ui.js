// The live queue page: polls /queue (and /metrics for the prediction quality) and renders it.
// No build step, no dependencies, no prompt text (the proxy never exposes any).
"use strict";

const POLL_MS = 1000;
const QUALITY_EVERY = 5; // polls between /metrics reads
const TIMELINE_ROWS = 30;
const WAITING_ROWS = 100; // the page lists the head of the queue; the summary counts all of it

function text(value, digits) {
  if (value === null || value === undefined || value === "") return "–";
  return typeof value === "number" && digits !== undefined ? value.toFixed(digits) : String(value);
}

function cell(row, value, className) {
  const td = document.createElement("td");
  td.textContent = value;
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
    tr.dataset.requestId = item.request_id;
    for (const [value, className] of columns.map((f) => f(item))) cell(tr, value, className);
    body.appendChild(tr);
  }
}

const classCell = (r) => [r.predicted_class, `class-${r.predicted_class}`];

function renderTimeline(queue) {
  // Every request on one time axis: from the oldest arrival shown to now.
  const rows = [
    ...queue.in_flight.map((r) => ({ ...r, start: r.waited_s, dispatched: r.running_s, end: 0, state: "running" })),
    ...queue.waiting.map((r) => ({ ...r, start: r.waited_s, dispatched: null, end: 0, state: "queued" })),
    ...queue.recent.map((r) => ({
      ...r,
      start: r.ended_ago_s + (r.service_s || 0) + r.waited_s,
      dispatched: r.service_s === null ? null : r.ended_ago_s + r.service_s,
      end: r.ended_ago_s,
      state: r.outcome,
    })),
  ].slice(0, TIMELINE_ROWS);
  const span = Math.max(1, ...rows.map((r) => r.start));
  const pct = (ago) => `${(100 * (1 - ago / span)).toFixed(2)}%`;
  const box = document.getElementById("timeline");
  box.replaceChildren();
  for (const r of rows) {
    const row = document.createElement("div");
    row.className = "row";
    row.dataset.requestId = r.request_id;
    const id = document.createElement("span");
    id.className = "id";
    id.textContent = `${r.request_id} (${r.state})`;
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
    tokens.textContent = `predicted ${text(r.predicted_tokens, 0)} · actual ${text(r.output_tokens)}`;
    row.append(id, bar, tokens);
    box.appendChild(row);
  }
}

function render(queue) {
  document.getElementById("summary").textContent =
    `policy ${queue.policy} · ${queue.in_flight.length}/${queue.slots} slots busy · ${queue.waiting_count} waiting` +
    (queue.waiting_count > queue.waiting.length ? ` (first ${queue.waiting.length} listed)` : "") +
    ` · queue drained in ~${text(queue.tail_eta_s, 1)} s` +
    ((queue.backends || []).length > 1
      ? " · " + queue.backends.map((b) => `${b.name} ${b.healthy ? `${b.in_flight}/${b.slots}` : "down"}`).join(", ")
      : "");
  const pool = (queue.backends || []).length > 1;
  fillTable("slots", queue.in_flight, [
    (r) => [pool ? `${r.backend} #${r.slot}` : r.slot], (r) => [r.request_id], classCell, (r) => [text(r.predicted_tokens, 0)],
    (r) => [text(r.predicted_s, 1)], (r) => [text(r.running_s, 1)], (r) => [r.tenant || "default"], (r) => [r.priority],
  ], "all slots idle");
  fillTable("waiting", queue.waiting, [
    (r) => [r.position], (r) => [r.request_id], classCell, (r) => [text(r.predicted_tokens, 0)],
    (r) => [text(r.eta_s, 1)], (r) => [text(r.waited_s, 1)], (r) => [r.tenant || "default"], (r) => [r.priority],
  ], "nobody waits");
  renderTimeline(queue);
}

function renderQuality(metricsText) {
  // clairvoyant_prediction_kendall_tau{model="..."} 0.42
  const found = [...metricsText.matchAll(/^clairvoyant_prediction_kendall_tau\{model="([^"]*)"\} (\S+)$/gm)];
  document.getElementById("quality").textContent = found.length
    ? "prediction tau " + found.map(([, model, v]) => `${model || "default"} ${Number(v).toFixed(2)}`).join(", ")
    : "";
}

let polls = 0;
async function poll() {
  const status = document.getElementById("status");
  try {
    const response = await fetch(`/queue?limit=${WAITING_ROWS}`, { cache: "no-store" });
    if (!response.ok) throw new Error(`/queue answered ${response.status}`);
    render(await response.json());
    if (polls++ % QUALITY_EVERY === 0) {
      const metrics = await fetch("/metrics", { cache: "no-store" });
      if (metrics.ok) renderQuality(await metrics.text());
    }
    status.textContent = "";
    status.className = "status";
  } catch (error) {
    status.textContent = `cannot reach the proxy: ${error.message}`;
    status.className = "status error";
  }
  setTimeout(poll, POLL_MS);
}

poll();
