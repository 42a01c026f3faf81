"""The daemon's dashboard: one page (no external resources: its charts' code is the
node's own static/charts.js) that polls /control/dashboard every 2 s with the token
from its URL fragment (`/dashboard#token=...`), and charts the node's last ten
minutes (app/history.py). Text that peers wrote (versions, ids) is only ever set as
textContent, never as HTML."""

DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>CompuShare dashboard</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
 h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.4em; }
 table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: left; border-bottom: 1px solid #ddd; }
 .cells { display: flex; gap: 2px; flex-wrap: wrap; }
 .cell { width: 22px; height: 22px; font-size: 11px; text-align: center; line-height: 22px; border-radius: 3px; }
 .c0 { background: #e55; color: #fff; } .c1 { background: #eb4; } .c2 { background: #5b5; color: #fff; }
 #error { color: #c00; }
 #charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(320px, 1fr)); gap: 14px; max-width: 1500px; }
 #charts figure { margin: 0; padding: 8px 10px; border: 1px solid #ddd; border-radius: 6px; }
 #charts figcaption { font-weight: 600; margin-bottom: 4px; }
 .chart { width: 100%; height: auto; display: block; }
 .chart .grid { stroke: #e4e4e4; } .chart .axis { stroke: #888; }
 .chart .tick { font-size: 10px; fill: #666; }
 .legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; }
 .legend i { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 4px; }
</style></head>
<body>
<h1>CompuShare: <span id="peer">…</span></h1>
<p id="error"></p>
<table id="node"><tbody>
 <tr><th>state</th><td id="state"></td></tr>
 <tr><th>blocks served</th><td id="span"></td></tr>
 <tr><th>karma</th><td id="karma"></td></tr>
 <tr><th>tokens served</th><td id="tokens"></td></tr>
 <tr><th>throughput</th><td id="throughput"></td></tr>
 <tr><th>API</th><td id="api"></td></tr>
 <tr><th>private sessions</th><td id="private"></td></tr>
 <tr><th>reachability</th><td id="reach"></td></tr>
</tbody></table>
<p><a id="chat-link" href="/chat">Chat with the swarm</a></p>
<h2>Last 10 minutes</h2>
<div id="charts">
 <figure id="chart-steps"></figure><figure id="chart-tokens"></figure>
 <figure id="chart-kv"></figure><figure id="chart-peers"></figure>
</div>
<h2>Coverage</h2><div id="coverage"></div>
<h2>Peers</h2>
<table><thead><tr><th>peer</th><th>karma</th><th>serves</th><th>state</th><th>load</th><th>free KV</th>
<th>version</th><th>private</th><th>reach</th></tr></thead><tbody id="peers"></tbody></table>
<h2>Downloads</h2><div id="downloads"></div>
<h2>Training</h2><div id="training"></div>
<script src="/static/charts.js"></script>
<script>
"use strict";
const token = new URLSearchParams(location.hash.slice(1)).get("token") || "";
function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function set(id, text) { document.getElementById(id).textContent = text; }
function render(d) {
  const n = d.node;
  set("peer", n.peer_id || "?");
  set("state", n.state || "?");
  set("span", n.start !== undefined ? n.start + ":" + n.end + " of " + n.model_id.slice(0, 12) : "-");
  set("karma", n.karma ? n.karma.score.toFixed(3) + " (" + n.karma.receipts + " receipts, " +
      (n.karma.compute_ms / 1000).toFixed(1) + " s of compute)" : "-");
  set("tokens", n.tokens_served ?? 0);
  set("throughput", (n.throughput ?? 0).toFixed(2) + " tokens/s");
  set("api", n.api || "-");
  const pv = n.private;
  set("private", pv ? "served: " + pv.sessions + " sessions, " + pv.requests + " encrypted requests, " +
      pv.compute_s.toFixed(1) + " s of HE compute, " +
      Object.values(pv.refused || {}).reduce((a, b) => a + b, 0) + " refused" : "not served");
  const net = n.net;
  set("reach", net ? net.reachability + (net.relays && net.relays.length ? ", through " + net.relays.length +
      " relays" : "") + (net.relay_offered && net.relay ? "; relaying " + net.relay.circuits_open +
      " circuits, " + (net.relay.relayed_bytes / 1e6).toFixed(1) + " MB relayed" : "") : "?");
  const coverage = document.getElementById("coverage");
  coverage.replaceChildren();
  for (const [id, m] of Object.entries(d.models)) {
    coverage.append(el("h3", (m.name ? m.name + " " : "") + id.slice(0, 12) + ": servers per block"));
    const cells = el("div", undefined, "cells model-coverage");
    m.coverage.forEach((count, block) => {
      const cell = el("div", count, "cell c" + Math.min(count, 2));
      cell.title = "block " + block + ": " + count + " servers";
      cells.append(cell);
    });
    coverage.append(cells);
  }
  const peers = document.getElementById("peers");
  peers.replaceChildren();
  for (const p of d.peers) {
    const row = el("tr", undefined, "peer-row");
    const s = p.serving[0];
    row.append(el("td", p.peer_id), el("td", p.karma == null ? "?" : p.karma.toFixed(3)),
               el("td", s ? s.start + ":" + s.end : "-"), el("td", s ? s.state : "-"),
               el("td", s ? Math.round(s.load * 100) + "%" : ""), el("td", s ? s.free : ""), el("td", p.version),
               el("td", p.private ? "yes" : "no", "private"),
               el("td", (p.reach || "unknown") + (p.relay ? ", relays" : ""), "reach"));
    peers.append(row);
  }
  const downloads = document.getElementById("downloads");
  downloads.replaceChildren();
  if (!d.downloads.length) downloads.append(el("p", "none"));
  for (const f of d.downloads) {
    const line = el("div", undefined, "download");
    const bar = el("progress");
    bar.max = f.total || 1; bar.value = f.done;
    line.append(el("span", "blocks " + f.blocks[0] + ":" + f.blocks[1] + " "), bar,
                el("span", " " + (f.done / 1e6).toFixed(1) + " / " + (f.total / 1e6).toFixed(1) + " MB" +
                           (f.finished ? " (done)" : "")));
    downloads.append(line);
  }
  const training = document.getElementById("training");
  training.replaceChildren(el("p", d.training ? d.training.line : "no training run on this data dir"));
}
function renderCharts(h) {
  if (!h || typeof lineChart !== "function") return;
  const t = h.time, window = 60;  // the time axis: at least a minute, at most the history (10 minutes)
  lineChart(document.getElementById("chart-steps"), {title: "Steps served per second", times: t, window,
    series: [{name: "steps/s", values: h.steps_s, color: "#3a7bd5"}]});
  lineChart(document.getElementById("chart-tokens"), {title: "Tokens computed per second (its sessions)", times: t,
    window, series: [{name: "tokens/s", values: h.tokens_s, color: "#2e9e5b"}]});
  const total = h.kv_total.length ? h.kv_total[h.kv_total.length - 1] : 0;
  lineChart(document.getElementById("chart-kv"), {title: "KV budget held (tokens)", times: t, window, max: total,
    series: [{name: "held", values: h.kv_used, color: "#d9822b"},
             {name: "budget", values: h.kv_total, color: "#999", dashed: true}]});
  lineChart(document.getElementById("chart-peers"), {title: "Peers known, by reachability", times: t, window,
    series: [{name: "all", values: h.peers, color: "#555"}, {name: "public", values: h.public, color: "#2e9e5b"},
             {name: "private", values: h.private, color: "#d9822b"},
             {name: "unknown", values: h.unknown, color: "#aaa", dashed: true}]});
}
async function poll() {
  try {
    const response = await fetch("/control/dashboard", {headers: {"Authorization": "Bearer " + token}});
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : response.status);
    set("error", "");
    render(body);
    renderCharts(body.history);
  } catch (e) {
    set("error", "cannot reach the node: " + e.message);
  }
}
document.getElementById("chat-link").href = "/chat" + location.hash;
poll();
setInterval(poll, 2000);
</script>
</body></html>
"""
