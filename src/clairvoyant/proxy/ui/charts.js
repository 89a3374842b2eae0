// Small SVG charts for the live page: lines over a time axis, and a log-log scatter.
// Plain functions, no dependencies, no build step. A value that is null, NaN or infinite is never
// drawn or printed: a line breaks there, and a chart with nothing to draw says so.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const CHART_HEIGHT = 190;
const MARGIN = { left: 46, right: 28, top: 12, bottom: 36 }; // room for a clock label centred on either edge
const TIME_STEPS_S = [5, 10, 15, 30, 60, 120, 300, 600, 900, 1800]; // time-axis tick spacings
const TIME_LABEL_PX = 64; // room for one clock label and a gap

function isNumber(value) {
  return typeof value === "number" && Number.isFinite(value);
}

function svgElement(name, attributes = {}, text) {
  const element = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, String(value));
  if (text !== undefined) element.textContent = text;
  return element;
}

// The smallest 1, 2 or 5 times a power of ten that is at least `value` (1 when there is nothing).
function niceCeiling(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= value);
}

// A time span rounded up to a whole number of steps: 5 s up to a minute, 30 s up to 5 minutes, then minutes.
function spanCeiling(seconds) {
  const step = seconds <= 60 ? 5 : seconds <= 300 ? 30 : 60;
  return Math.max(step, Math.ceil(seconds / step) * step);
}

// For counts: a ceiling whose half is a whole number too (2, 4, 10, 20, 50, ...).
function integerCeiling(value) {
  if (value <= 2) return 2;
  if (value <= 4) return 4;
  return niceCeiling(value) === 5 ? 10 : niceCeiling(value);
}

function formatNumber(value) {
  if (!isNumber(value)) return "–";
  if (Math.abs(value) >= 10000) return `${Math.round(value / 1000)}k`;
  if (Math.abs(value) >= 1000) return `${(value / 1000).toFixed(1).replace(/\.0$/, "")}k`;
  return Number.isInteger(value) ? String(value) : value.toFixed(value < 10 ? 1 : 0);
}

// Local wall-clock time of a moment given in milliseconds: 14:05, or 14:05:30 when ticks are seconds apart.
function formatClock(ms, withSeconds) {
  const d = new Date(ms);
  const two = (n) => String(n).padStart(2, "0");
  return `${two(d.getHours())}:${two(d.getMinutes())}` + (withSeconds ? `:${two(d.getSeconds())}` : "");
}

// An empty chart: the SVG with its plot area, sized to the box it goes in.
function chartFrame(box) {
  const width = Math.max(240, box.clientWidth || 480);
  const root = svgElement("svg", {
    viewBox: `0 0 ${width} ${CHART_HEIGHT}`, width, height: CHART_HEIGHT, role: "img", class: "chart-svg",
  });
  const plot = {
    left: MARGIN.left, right: width - MARGIN.right, top: MARGIN.top, bottom: CHART_HEIGHT - MARGIN.bottom,
  };
  root.appendChild(svgElement("rect", {
    x: plot.left, y: plot.top, width: plot.right - plot.left, height: plot.bottom - plot.top, class: "plot",
  }));
  box.replaceChildren(root);
  return { root, plot };
}

function valueAxis(root, plot, y, max, unit, integer) {
  const axis = svgElement("g", { class: "axis value" });
  const ticks = integer ? [...new Set([0, Math.round(max / 2), max])] : [0, max / 2, max];
  for (const value of ticks) {
    const py = y(value);
    axis.appendChild(svgElement("line", { x1: plot.left, x2: plot.right, y1: py, y2: py, class: "grid" }));
    axis.appendChild(svgElement("text", { x: plot.left - 6, y: py + 4, "text-anchor": "end" }, formatNumber(value) + unit));
  }
  root.appendChild(axis);
}

// The time axis: ticks at round local times, labelled with the clock, from `spanS` seconds ago to now.
function timeAxis(root, plot, x, spanS) {
  const axis = svgElement("g", { class: "axis time" });
  const nowMs = Date.now();
  const maxTicks = Math.max(2, Math.floor((plot.right - plot.left) / TIME_LABEL_PX));
  const step = TIME_STEPS_S.find((s) => spanS / s <= maxTicks) || TIME_STEPS_S[TIME_STEPS_S.length - 1];
  const lastTickS = Math.floor(nowMs / 1000 / step) * step;
  for (let tickS = lastTickS; tickS >= nowMs / 1000 - spanS; tickS -= step) {
    const px = x(nowMs / 1000 - tickS);
    axis.appendChild(svgElement("line", { x1: px, x2: px, y1: plot.bottom, y2: plot.bottom + 4, class: "tick" }));
    axis.appendChild(svgElement("text", { x: px, y: plot.bottom + 16, "text-anchor": "middle" }, formatClock(tickS * 1000, step < 60)));
  }
  axis.appendChild(svgElement("text", { x: plot.right, y: plot.bottom + 32, "text-anchor": "end", class: "axis-title" }, "local time"));
  root.appendChild(axis);
}

function noData(root, plot, message) {
  root.appendChild(svgElement("text", {
    x: (plot.left + plot.right) / 2, y: (plot.top + plot.bottom) / 2, "text-anchor": "middle", class: "no-data",
  }, message));
}

// Lines over time. `lines`: [{label, color, dash, points: [[seconds ago, value or null], ...], dots}],
// `spanS`: seconds shown back from now; `unit`: appended to the value axis' labels; `integer`: counts.
// `rules`: horizontal lines with a label (limits), [{value, label, color}].
function timeChart(box, { spanS, lines, unit = "", integer = false, rules = [], empty = "no data yet" }) {
  const { root, plot } = chartFrame(box);
  const values = lines.flatMap((line) => line.points.map(([, v]) => v)).filter(isNumber);
  const top = Math.max(0, ...values, ...rules.map((r) => r.value).filter(isNumber));
  const max = integer ? integerCeiling(top) : niceCeiling(top * 1.05);
  const x = (agoS) => plot.left + (plot.right - plot.left) * (1 - Math.min(Math.max(agoS, 0), spanS) / spanS);
  const y = (value) => plot.bottom - (plot.bottom - plot.top) * (value / max);
  valueAxis(root, plot, y, max, unit, integer);
  timeAxis(root, plot, x, spanS);
  for (const rule of rules.filter((r) => isNumber(r.value))) {
    const py = y(rule.value);
    root.appendChild(svgElement("line", { x1: plot.left, x2: plot.right, y1: py, y2: py, class: "rule", stroke: rule.color }));
    root.appendChild(svgElement("text", { x: plot.right - 4, y: py - 4, "text-anchor": "end", class: "rule-label", fill: rule.color }, rule.label));
  }
  for (const line of lines) {
    const shown = line.points.filter(([ago]) => isNumber(ago) && ago <= spanS);
    let path = "";
    let open = false;
    for (const [ago, value] of shown) {
      if (!isNumber(value)) {
        open = false;
        continue;
      }
      path += `${open ? "L" : "M"}${x(ago).toFixed(1)},${y(value).toFixed(1)}`;
      open = true;
    }
    const group = svgElement("g", { class: "series", "data-label": line.label });
    if (path) {
      group.appendChild(svgElement("path", { d: path, stroke: line.color, "stroke-dasharray": line.dash || "none", class: "line" }));
    }
    // Dots where asked for, and wherever a value stands alone (no line would show it).
    shown.forEach(([ago, value], i) => {
      const alone = !isNumber(shown[i - 1]?.[1]) && !isNumber(shown[i + 1]?.[1]);
      if (isNumber(value) && (line.dots || alone)) {
        group.appendChild(svgElement("circle", { cx: x(ago), cy: y(value), r: 2.5, fill: line.color }));
      }
    });
    root.appendChild(group);
  }
  if (!values.length) noData(root, plot, empty);
  return root;
}

// Predicted against actual, both on log scales, with the diagonal where they agree.
// `points`: [{x, y, color, title}]; values below 1 are drawn at 1.
function scatterChart(box, { points, xLabel, yLabel, empty = "no answers yet" }) {
  const { root, plot } = chartFrame(box);
  const shown = points.filter((p) => isNumber(p.x) && isNumber(p.y));
  const top = Math.max(10, ...shown.flatMap((p) => [p.x, p.y]));
  const decades = Math.max(1, Math.ceil(Math.log10(top)));
  const side = Math.min(plot.right - plot.left, plot.bottom - plot.top);
  const scale = (v) => Math.log10(Math.max(1, v)) / decades;
  const x = (v) => plot.left + side * scale(v);
  const y = (v) => plot.bottom - side * scale(v);
  const axes = svgElement("g", { class: "axis log" });
  for (let d = 0; d <= decades; d++) {
    const v = 10 ** d;
    axes.appendChild(svgElement("line", { x1: x(v), x2: x(v), y1: plot.bottom - side, y2: plot.bottom, class: "grid" }));
    axes.appendChild(svgElement("line", { x1: plot.left, x2: plot.left + side, y1: y(v), y2: y(v), class: "grid" }));
    axes.appendChild(svgElement("text", { x: x(v), y: plot.bottom + 16, "text-anchor": "middle" }, formatNumber(v)));
    axes.appendChild(svgElement("text", { x: plot.left - 6, y: y(v) + 4, "text-anchor": "end" }, formatNumber(v)));
  }
  axes.appendChild(svgElement("text", { x: plot.left + side, y: plot.bottom + 31, "text-anchor": "end", class: "axis-title" }, xLabel));
  axes.appendChild(svgElement("text", { x: plot.left + side + 8, y: plot.top + 10, class: "axis-title" }, yLabel));
  axes.appendChild(svgElement("line", { x1: x(1), y1: y(1), x2: x(10 ** decades), y2: y(10 ** decades), class: "diagonal" }));
  root.appendChild(axes);
  for (const p of shown) {
    const dot = svgElement("circle", { cx: x(p.x), cy: y(p.y), r: 3, fill: p.color, class: "dot" });
    if (p.title) dot.appendChild(svgElement("title", {}, p.title));
    root.appendChild(dot);
  }
  if (!shown.length) noData(root, plot, empty);
  return root;
}

// A legend under a chart: [{label, color, dash}] as small line samples and their labels.
function legend(box, items) {
  box.replaceChildren(...items.map((item) => {
    const entry = document.createElement("span");
    entry.className = "legend-item";
    const sample = svgElement("svg", { width: 22, height: 10 });
    sample.appendChild(svgElement("line", {
      x1: 1, x2: 21, y1: 5, y2: 5, stroke: item.color, "stroke-width": 2.5, "stroke-dasharray": item.dash || "none",
    }));
    entry.append(sample, document.createTextNode(item.label));
    return entry;
  }));
}
