// Line charts drawn as plain SVG: a fixed time window scrolling to the right, a y axis
// from 0, and one polyline per series (a null value breaks the line).
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, String(value));
  if (text !== undefined) el.textContent = text;
  return el;
}

function clockLabel(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString("en-GB", { hour12: false });
}

// A y-axis top at or above `max`: 1, 2 or 5 times a power of ten.
function niceCeiling(max) {
  if (!(max > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(max));
  for (const step of [1, 2, 5, 10]) if (step * power >= max) return step * power;
  return 10 * power;
}

/**
 * Draws into `svg` (replacing what was there).
 * spec: {t0, t1: window in unix seconds; times: [unix seconds];
 *        series: [{label, color, values: [number|null]}]; yMax?: fixed top; unit?: suffix;
 *        digits?: decimals of the legend's latest values (1 unless given)}
 */
function drawLineChart(svg, spec) {
  const width = svg.clientWidth || 420;
  const height = svg.clientHeight || 170;
  const pad = { left: 42, right: 10, top: 18, bottom: 18 };
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();
  const unit = spec.unit || "";
  const all = spec.series.flatMap((s) => s.values.filter((v) => v !== null));
  const top = spec.yMax !== undefined ? spec.yMax : niceCeiling(Math.max(0, ...all));
  const span = Math.max(spec.t1 - spec.t0, 1);
  const x = (t) => pad.left + ((t - spec.t0) / span) * (width - pad.left - pad.right);
  const y = (v) => height - pad.bottom - (v / top) * (height - pad.top - pad.bottom);

  for (const fraction of [0, 0.5, 1]) {
    const value = top * fraction;
    svg.append(svgEl("line", { class: "grid", x1: pad.left, x2: width - pad.right, y1: y(value), y2: y(value) }));
    const label = formatNumber(value, top < 10 && value % 1 ? 1 : 0) + unit;
    svg.append(svgEl("text", { class: "axis-label", x: pad.left - 4, y: y(value) + 3, "text-anchor": "end" }, label));
  }
  svg.append(svgEl("text", { class: "axis-label", x: pad.left, y: height - 4 }, clockLabel(spec.t0)));
  svg.append(svgEl("text", { class: "axis-label", x: width - pad.right, y: height - 4, "text-anchor": "end" }, "now"));

  spec.series.forEach((series, index) => {
    let points = [];
    const flush = () => {
      if (points.length === 1) {
        svg.append(svgEl("circle", { cx: points[0][0], cy: points[0][1], r: 2, fill: series.color }));
      } else if (points.length) {
        const text = points.map(([px, py]) => `${px.toFixed(1)},${py.toFixed(1)}`).join(" ");
        svg.append(svgEl("polyline", { points: text, fill: "none", stroke: series.color, "stroke-width": 1.8, "stroke-linejoin": "round" }));
      }
      points = [];
    };
    spec.times.forEach((t, i) => {
      const v = series.values[i];
      if (v === null || v === undefined || t < spec.t0) flush();
      else points.push([x(t), y(Math.min(v, top))]);
    });
    flush();
    const last = series.values.length ? series.values[series.values.length - 1] : null;
    const legendX = width - pad.right - (spec.series.length - index) * 190;
    svg.append(svgEl("rect", { x: legendX, y: 4, width: 9, height: 9, fill: series.color }));
    const digits = spec.digits === undefined ? 1 : spec.digits;
    const shown = last === null ? "–" : formatNumber(last, digits) + unit;
    svg.append(svgEl("text", { class: "legend", x: legendX + 13, y: 12 }, `${series.label}: ${shown}`));
  });
}
