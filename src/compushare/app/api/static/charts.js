// Small line charts in inline SVG, drawn by hand (no library): the dashboard's history.
// lineChart(figure, {title, times, series: [{name, values, color, dashed}], max, unit})
// fills `figure` with a caption, an SVG with labelled axes and a legend of the
// latest values. Every label is set as textContent.
"use strict";

const CHART = {width: 360, height: 150, left: 46, right: 10, top: 10, bottom: 22};
const SVG_NS = "http://www.w3.org/2000/svg";

function svgNode(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = Math.pow(10, Math.floor(Math.log10(value)));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

function formatValue(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const size = Math.abs(value);
  if (size >= 1e6) return (value / 1e6).toFixed(1) + "M";
  if (size >= 1e4) return (value / 1e3).toFixed(0) + "k";
  if (size >= 100 || Number.isInteger(value)) return String(Math.round(value));
  return value.toFixed(size >= 10 ? 1 : 2);
}

function lineChart(figure, options) {
  const {width, height, left, right, top, bottom} = CHART;
  const times = options.times || [];
  const series = options.series || [];
  const plotted = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
  const max = niceMax(options.max !== undefined && options.max > 0 ? options.max : Math.max(0, ...plotted));
  const t1 = times.length ? times[times.length - 1] : 0;
  const span = Math.max(options.window || 0, times.length > 1 ? t1 - times[0] : 0, 1);
  const x = (t) => left + (width - left - right) * (1 - (t1 - t) / span);
  const y = (v) => top + (height - top - bottom) * (1 - v / max);

  const svg = svgNode("svg", {viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img",
                              "aria-label": options.title});
  for (const fraction of [0, 0.5, 1]) {  // the value axis: 0, half and the top
    const value = max * fraction;
    svg.append(svgNode("line", {x1: left, x2: width - right, y1: y(value), y2: y(value), class: "grid"}),
               svgNode("text", {x: left - 5, y: y(value) + 4, "text-anchor": "end", class: "tick"},
                       formatValue(value)));
  }
  for (const fraction of [0, 0.5, 1]) {  // the time axis: minutes before the last sample
    const ago = span * (1 - fraction);
    const label = ago < 1 ? "now" : ago >= 60 ? "-" + (ago / 60).toFixed(ago % 60 ? 1 : 0) + " min"
                                              : "-" + Math.round(ago) + " s";
    svg.append(svgNode("text", {x: x(t1 - ago), y: height - 6, class: "tick",
                                "text-anchor": fraction === 0 ? "start" : fraction === 1 ? "end" : "middle"},
                       label));
  }
  svg.append(svgNode("line", {x1: left, x2: left, y1: top, y2: height - bottom, class: "axis"}),
             svgNode("line", {x1: left, x2: width - right, y1: height - bottom, y2: height - bottom,
                              class: "axis"}));
  for (const s of series) {
    let path = "";
    let pen = false;
    s.values.forEach((value, i) => {
      if (value === null || value === undefined || i >= times.length) { pen = false; return; }
      path += (pen ? "L" : "M") + x(times[i]).toFixed(1) + " " + y(Math.min(value, max)).toFixed(1);
      pen = true;
    });
    if (path) {
      svg.append(svgNode("path", {d: path, fill: "none", stroke: s.color, "stroke-width": 1.8,
                                  "stroke-dasharray": s.dashed ? "4 3" : "none", class: "series"}));
    }
  }

  const legend = document.createElement("div");
  legend.className = "legend";
  for (const s of series) {
    const latest = [...s.values].reverse().find((v) => v !== null && v !== undefined);
    const item = document.createElement("span");
    item.className = "legend-item";
    const swatch = document.createElement("i");
    swatch.style.background = s.color;
    const label = document.createElement("span");
    label.textContent = s.name + ": " + formatValue(latest ?? null) + (options.unit ? " " + options.unit : "");
    item.append(swatch, label);
    legend.append(item);
  }
  const caption = document.createElement("figcaption");
  caption.textContent = options.title;
  figure.replaceChildren(caption, svg, legend);
}
