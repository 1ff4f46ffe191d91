/**
 * GET /dashboard: the mesh at a glance, one self-contained page (no build,
 * no framework) that polls GET /api/dashboard (every second for a small
 * mesh, less often for a swarm: the answer's `refresh_ms`):
 *
 * - the availability map: layers × nodes, a cell per layer a node holds
 *   (solid: serving, pale: assigned and still loading), and per layer how
 *   many nodes serve it (red where none does); past a few dozen nodes, one
 *   row per span with how many nodes serve and load it;
 * - the node list, a page of 200 at a time (the tracker sums the rest): host,
 *   backend, weight format, status, span, throughput, RPM over the last
 *   heartbeats, tokens served, KV cache use (a bar: used of budget, with what
 *   this tracker's chats hold);
 * - the admission queue: chats running, waiting for KV room, longest wait;
 * - the recent routes.
 *
 * Node-supplied strings (backend, version) reach the page only through
 * textContent, never as markup.
 */
export const DASHBOARD_HTML = /* html */ `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>meshnet · mesh dashboard</title>
<style>
  :root { --bg:#0f1419; --panel:#171d24; --line:#2a323c; --text:#d8dee6; --dim:#8a96a3; --ok:#3fb950; --load:#2f5f3a; --bad:#f85149; --accent:#58a6ff; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; background:var(--bg); color:var(--text); }
  header { display:flex; align-items:baseline; gap:16px; padding:14px 22px; border-bottom:1px solid var(--line); }
  header h1 { font-size:18px; margin:0; }
  header .meta { color:var(--dim); font-size:13px; }
  main { padding:16px 22px; display:grid; gap:16px; grid-template-columns: 1fr; max-width:1280px; }
  section { background:var(--panel); border:1px solid var(--line); border-radius:8px; padding:14px 16px; }
  h2 { font-size:14px; margin:0 0 10px; color:var(--dim); font-weight:600; text-transform:uppercase; letter-spacing:.04em; }
  .model-title { display:flex; gap:12px; align-items:baseline; margin-bottom:8px; }
  .badge { padding:1px 8px; border-radius:10px; font-size:12px; }
  .badge.ok { background:#1f3d2a; color:var(--ok); } .badge.bad { background:#42201f; color:var(--bad); }
  table { border-collapse:collapse; width:100%; font-variant-numeric: tabular-nums; }
  th, td { text-align:left; padding:4px 8px; border-bottom:1px solid var(--line); white-space:nowrap; }
  th { color:var(--dim); font-weight:500; font-size:12px; }
  table.grid { width:auto; }
  .grid td, .grid th { padding:0; border:none; text-align:center; min-width:34px; }
  .grid th.l { font-size:11px; }
  .grid td.peer, .grid th.peer { text-align:right; padding-right:10px; font-family:ui-monospace, monospace; font-size:12px; color:var(--dim); white-space:nowrap; }
  .cell { display:block; height:20px; margin:1px; border-radius:3px; background:#1d242c; }
  .cell.serving { background:var(--ok); } .cell.loading { background:var(--load); }
  .cov { display:block; margin:1px; border-radius:3px; font-size:11px; height:18px; line-height:18px; color:#0f1419; font-weight:600; }
  .mono { font-family:ui-monospace, monospace; font-size:12px; }
  .dim { color:var(--dim); }
  .status-serving { color:var(--ok); } .status-loading { color:#d29922; } .status-idle { color:var(--dim); } .status-draining { color:#d29922; font-style:italic; } .status-unreachable { color:#f85149; }
  svg.spark { vertical-align:middle; }
  .route { font-family:ui-monospace, monospace; font-size:12px; }
  .empty { color:var(--dim); font-style:italic; }
  #err { color:var(--bad); }
  .kv { display:inline-block; width:70px; height:8px; background:#1d242c; border-radius:4px; overflow:hidden; vertical-align:middle; margin-right:6px; }
  .kv > span { display:block; height:100%; background:var(--accent); }
  .kv.busy > span { background:var(--bad); }
  .queue { display:flex; gap:22px; font-variant-numeric: tabular-nums; }
  .queue b { font-size:20px; font-weight:600; display:block; }
</style>
</head>
<body>
<header><h1>meshnet mesh</h1><span class="meta" id="meta">connecting…</span><span id="err"></span></header>
<main>
  <section><h2>Availability map</h2><div id="maps"></div></section>
  <section><h2>Admission queue</h2><div id="queue"></div></section>
  <section><h2>Nodes</h2><div id="nodes"></div></section>
  <section><h2>Recent routes</h2><div id="routes"></div></section>
  <section><h2>Spot-checks and offences</h2><div id="trust"></div></section>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
const short = (id) => id.slice(0, 8);
const span = (s) => (s ? s.start_layer + "–" + (s.end_layer - 1) : "–");
function ago(ms) { return ms < 1500 ? "now" : ms < 90000 ? Math.round(ms / 1000) + " s ago" : Math.round(ms / 60000) + " min ago"; }
function covColor(n, max) {
  if (n === 0) return "var(--bad)";
  const t = Math.min(1, n / Math.max(2, max));
  return "hsl(" + (90 + 40 * t) + ", 55%, " + (38 + 14 * t) + "%)";
}
function sparkline(values, w = 90, h = 18) {
  const NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("class", "spark"); svg.setAttribute("width", w); svg.setAttribute("height", h);
  if (values.length > 1) {
    const max = Math.max(1, ...values);
    const pts = values.map((v, i) => (i * (w - 2)) / (values.length - 1) + 1 + "," + (h - 1 - (v / max) * (h - 3))).join(" ");
    const p = document.createElementNS(NS, "polyline");
    p.setAttribute("points", pts); p.setAttribute("fill", "none"); p.setAttribute("stroke", "#58a6ff"); p.setAttribute("stroke-width", "1.5");
    svg.append(p);
  }
  return svg;
}

/** Past this many nodes of a model, the map has a row per span instead of a row per node. */
const MAP_NODE_ROWS = 40;
function spanRows(m, grid) {
  for (const g of m.spans) {
    const row = el("tr", {}, el("td", { class: "peer" }, "span " + g.start_layer + "–" + (g.end_layer - 1) + " · " + g.serving + " serving" + (g.loading ? ", " + g.loading + " loading" : "")));
    for (let l = 0; l < m.num_layers; l++) {
      const inside = g.start_layer <= l && l < g.end_layer;
      row.append(el("td", {}, el("span", { class: "cell" + (inside ? (g.serving ? " serving" : " loading") : "") })));
    }
    grid.append(row);
  }
}
function renderMaps(d) {
  const root = $("maps");
  root.replaceChildren();
  for (const m of d.models) {
    const nodes = d.nodes.filter((n) => n.model === m.name && (n.assignment || n.serving));
    const title = el("div", { class: "model-title" }, el("strong", {}, m.name), el("span", { class: "dim" }, m.num_layers + " layers · " + m.nodes + " node(s)"),
      m.complete ? el("span", { class: "badge ok" }, "every layer served") : el("span", { class: "badge bad" }, "missing layers " + m.missing_layers.join(", ")));
    const grid = el("table", { class: "grid" });
    const head = el("tr", {}, el("th", { class: "peer" }, "node \\\\ layer"));
    for (let l = 0; l < m.num_layers; l++) head.append(el("th", { class: "l dim" }, l));
    grid.append(head);
    if (m.nodes > MAP_NODE_ROWS) spanRows(m, grid);
    else for (const n of nodes) {
      const row = el("tr", {}, el("td", { class: "peer" }, short(n.peer_id) + " · " + n.host));
      for (let l = 0; l < m.num_layers; l++) {
        const serves = n.serving && n.serving.start_layer <= l && l < n.serving.end_layer;
        const assigned = n.assignment && n.assignment.start_layer <= l && l < n.assignment.end_layer;
        row.append(el("td", {}, el("span", { class: "cell" + (serves ? " serving" : assigned ? " loading" : ""), title: serves ? "serving" : assigned ? "assigned, loading" : "" })));
      }
      grid.append(row);
    }
    if (m.nodes === 0) grid.append(el("tr", {}, el("td", { class: "peer empty", colspan: String(m.num_layers + 1) }, "no node holds a layer yet")));
    const max = Math.max(0, ...m.coverage);
    const cov = el("tr", {}, el("td", { class: "peer" }, "coverage"));
    for (const c of m.coverage) cov.append(el("td", {}, el("span", { class: "cov", style: "background:" + covColor(c, max) }, c)));
    grid.append(cov);
    root.append(title, grid);
  }
}

const mib = (b) => (b / 1048576).toFixed(b < 10485760 ? 1 : 0);
function kvCell(kv) {
  if (!kv) return el("span", { class: "dim" }, "–");
  const frac = kv.budget_bytes > 0 ? Math.min(1, kv.used_bytes / kv.budget_bytes) : 1;
  const bar = el("span", { class: "kv" + (kv.busy ? " busy" : ""), title: "held by this tracker's chats: " + mib(kv.held_by_tracker_bytes) + " MiB" }, el("span", { style: "width:" + Math.round(frac * 100) + "%" }));
  return el("span", {}, bar, mib(kv.used_bytes) + " / " + mib(kv.budget_bytes) + " MiB" + (kv.sessions != null ? " · " + kv.sessions + (kv.sessions === 1 ? " session" : " sessions") : "") + (kv.busy ? " · busy" : ""));
}

function specCell(s) {
  if (!s || s.drafted === 0) return el("span", { class: "dim" }, "–");
  const title = "speculative decoding: " + s.accepted + " of " + s.drafted + " drafted tokens accepted; " + s.tokens + " tokens in " + s.trips + " trips";
  return el("span", { title }, Math.round((100 * s.accepted) / s.drafted) + "% · " + (s.tokens / Math.max(1, s.trips)).toFixed(2) + "/trip");
}

// rtc: a WebRTC data channel straight to the peer; fast / rpc: through the relay; link, direct: straight to a Node.js node.
const PATH_NAMES = { rtc: "data channel", fast: "relay", rpc: "relay /rpc", link: "link", direct: "HTTP" };
function pathsCell(paths) {
  if (!paths || paths.length === 0) return el("span", { class: "dim" }, "–");
  return el("span", {}, ...paths.map((p, i) => el("span", { class: "mono", title: "sent: " + Object.entries(p.sent).map(([k, v]) => k + " " + v).join(", ") + (p.rtc ? "; data channel " + p.rtc : "") },
    (i ? " · " : "") + short(p.peer_id) + " " + (PATH_NAMES[p.path] || p.path))));
}
// The path the sender of a hop last used to reach "to", from its heartbeat.
function pathOf(d, from, to) {
  const n = d.nodes.find((x) => x.peer_id === from);
  const p = n && n.hop_paths && n.hop_paths.find((x) => x.peer_id === to);
  return p ? PATH_NAMES[p.path] || p.path : "";
}

function renderQueue(d) {
  const q = d.queue;
  const stat = (n, label) => el("div", {}, el("b", {}, n), el("span", { class: "dim" }, label));
  $("queue").replaceChildren(el("div", { class: "queue" },
    stat(q.running, "chats running"), stat(q.length + " / " + q.max_length, "waiting for KV room"),
    stat((q.oldest_wait_ms / 1000).toFixed(1) + " s", "longest wait (limit " + Math.round(q.max_wait_ms / 1000) + " s)")));
}

let offset = 0;
function pager(d) {
  const p = d.page;
  if (p.total <= p.limit && p.offset === 0) return el("span");
  const btn = (label, to, off) => { const b = el("button", {}, label); b.disabled = off; b.onclick = () => { offset = to; refresh(); }; return b; };
  return el("div", { class: "dim" }, "nodes " + (p.offset + 1) + "–" + (p.offset + d.nodes.length) + " of " + p.total + " ",
    btn("◀ previous", Math.max(0, p.offset - p.limit), p.offset === 0), " ", btn("next ▶", p.offset + p.limit, p.offset + p.limit >= p.total));
}

function renderNodes(d) {
  const root = $("nodes");
  if (d.page.total === 0) { root.replaceChildren(el("div", { class: "empty" }, "No node has registered yet. Open a donor page, or run meshnet node / meshnet mesh.")); return; }
  const t = el("table", {}, el("tr", {}, ...["peer", "host", "backend", "weights", "status", "assigned", "serving", "layer-steps/s", "ms/layer", "RPM", "RPM (recent)", "tokens", "drafts", "queue", "budget", "KV cache", "hops go by", "last seen"].map((h) => el("th", {}, h))));
  for (const n of d.nodes) {
    t.append(el("tr", {},
      el("td", { class: "mono" }, short(n.peer_id)), el("td", {}, n.host), el("td", {}, n.backend), el("td", { class: "mono" }, n.weight_format),
      n.reachable === false
        ? el("td", { class: "status-unreachable", title: n.unreachable_reason }, n.status + ", unreachable")
        : el("td", { class: "status-" + n.status }, n.status),
      el("td", {}, span(n.assignment)), el("td", {}, span(n.serving)),
      el("td", {}, n.throughput.toFixed(0) + (n.duty_cycle < 1 ? " (" + Math.round(n.duty_cycle * 100) + " % cap)" : "")), el("td", {}, n.layer_ms.toFixed(2)), el("td", {}, n.rpm),
      el("td", {}, sparkline(n.rpm_history.map((h) => h.rpm))), el("td", {}, n.tokens_served), el("td", {}, specCell(n.speculation)), el("td", {}, n.queue_depth + n.in_flight),
      el("td", {}, Math.round(n.memory_budget_mb * 10) / 10 + " MiB"), el("td", {}, kvCell(n.kv)), el("td", {}, pathsCell(n.hop_paths)), el("td", { class: "dim" }, ago(n.last_seen_ms_ago))));
  }
  root.replaceChildren(pager(d), t);
}

function renderRoutes(d) {
  const root = $("routes");
  if (d.recent_routes.length === 0) { root.replaceChildren(el("div", { class: "empty" }, "No route yet: send a chat to /v1/chat/completions.")); return; }
  const t = el("table", {}, el("tr", {}, ...["when", "kind", "model", "route (node [layers])", "est. ms/token"].map((h) => el("th", {}, h))));
  const now = Date.now();
  for (const r of d.recent_routes.slice(0, 12)) {
    // Each arrow names the path that hop took (the sender's last report), the closing one the way back to the head.
    const path = r.hops.map((h, i) => (i ? "  →" + (pathOf(d, r.hops[i - 1].peer_id, h.peer_id) ? " " + pathOf(d, r.hops[i - 1].peer_id, h.peer_id) + " →  " : "  ") : "") + short(h.peer_id) + " [" + h.start_layer + "–" + (h.end_layer - 1) + "]").join("")
      + (r.hops.length > 1 && pathOf(d, r.hops[r.hops.length - 1].peer_id, r.hops[0].peer_id) ? "  ⤺ " + pathOf(d, r.hops[r.hops.length - 1].peer_id, r.hops[0].peer_id) : "");
    t.append(el("tr", {}, el("td", { class: "dim" }, ago(now - r.at)), el("td", {}, r.kind), el("td", {}, r.model), el("td", { class: "route" }, path), el("td", {}, r.cost_ms)));
  }
  root.replaceChildren(t);
}

function renderTrust(d) {
  const root = $("trust");
  const v = d.verification;
  if (!v || !v.enabled) { root.replaceChildren(el("div", { class: "empty" }, "Spot-checks are off (meshnet tracker --no-checks).")); return; }
  const now = Date.now();
  const t = el("table", {}, el("tr", {}, ...["peer", "checks", "passed", "in a row", "P(check)", "offences", "inconclusive", "refused", "quarantine"].map((h) => el("th", {}, h))));
  for (const [peer, n] of Object.entries(v.nodes)) {
    t.append(el("tr", {}, el("td", { class: "mono" }, short(peer)), el("td", {}, n.checks), el("td", {}, n.passes), el("td", {}, n.consecutive),
      el("td", {}, (n.check_probability * 100).toFixed(1) + " %"), el("td", {}, n.offences), el("td", {}, n.inconclusive), el("td", {}, n.refusals),
      el("td", { class: n.quarantined_until ? "status-idle" : "dim" }, n.quarantined_until ? "until " + new Date(n.quarantined_until).toLocaleTimeString() : "—")));
  }
  const kids = [t];
  if (v.offences.length === 0) kids.push(el("div", { class: "empty" }, "No offence: every check so far agreed, or was inconclusive."));
  else {
    const o = el("table", {}, el("tr", {}, ...["when", "node", "role", "layers", "what", "distance (checker / arbiter)", "threshold", "checker", "arbiter", "signed claim"].map((h) => el("th", {}, h))));
    for (const f of v.offences.slice(0, 20)) {
      o.append(el("tr", {}, el("td", { class: "dim" }, ago(now - f.at)), el("td", { class: "mono" }, short(f.peer)), el("td", {}, f.role),
        el("td", {}, f.start_layer + "–" + (f.end_layer - 1)), el("td", {}, f.kind + " · " + f.rows + " rows"),
        el("td", {}, f.checker.distance.toPrecision(3) + (f.arbiter ? " / " + f.arbiter.distance.toPrecision(3) : "")), el("td", {}, f.threshold),
        el("td", { class: "mono" }, short(f.checker.peer)), el("td", { class: "mono" }, f.arbiter ? short(f.arbiter.peer) : "—"),
        el("td", { class: "mono", title: f.claim.attestation }, f.claim.attestation.slice(0, 16) + "…")));
    }
    kids.push(o);
  }
  root.replaceChildren(...kids);
}

let timer = 0;
async function refresh() {
  clearTimeout(timer);
  let next = 1000;
  try {
    const res = await fetch("api/dashboard?offset=" + offset, { cache: "no-store" });
    if (!res.ok) throw new Error("HTTP " + res.status);
    const d = await res.json();
    next = d.refresh_ms || 1000;
    if (d.page.offset >= d.page.total && d.page.total > 0) { offset = 0; }
    $("meta").textContent = "tracker " + short(d.tracker.peer_id) + " · up " + d.tracker.uptime_s + " s · " + d.summary.nodes + " node(s) · " + d.models.map((m) => m.name).join(", ") + " · queue " + d.queue.length + (d.tracker.behind ? " · behind: heartbeats every " + Math.round(d.tracker.heartbeat_interval_ms / 1000) + " s" : "");
    $("err").textContent = "";
    renderMaps(d); renderQueue(d); renderNodes(d); renderRoutes(d); renderTrust(d);
  } catch (e) {
    $("err").textContent = "tracker unreachable: " + e.message;
  }
  timer = setTimeout(refresh, next);
}
refresh();
</script>
</body>
</html>
`;
