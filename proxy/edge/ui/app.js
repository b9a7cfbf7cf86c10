// The ctxproxy inspector: the sessions list and one session's view, drawn from the operator API under /ctx.
// Plain script, no library, no build step. The chart is inline SVG. Routes: #/ (list), #/s/<id>[/r/<request>]
// (a session on disk), #/i/<id>[/r/<request>] (an incognito one, held in memory: its ids are its own).
"use strict";

const API = "/ctx";
const MARK_KINDS = ["spill", "elide", "fold", "drop", "note", "hide", "pin", "unpin", "mirror"];
const SERIES = [
  ["agent", "agent_tokens", "tokens the agent sent"],
  ["upstream", "upstream_tokens", "tokens sent upstream"],
  ["prompt", "prompt_tokens", "model's usage.prompt_tokens"],
  ["reused", "reused_tokens", "prefix reused from the request before"],
];
const STUB_ID = /\b(?:overflow|folded) id=([0-9a-f]{64})/g;
const RAW_PAGE = 60;
const CUT_KINDS = new Set(["spill", "elide", "drop", "note"]);  // what a restore undoes (a fold is not one)
const MIN_CUT_CHARS = 600;  // shorter results are never cut: their stub would not be smaller

const state = { sessions: [], sort: ["updated_at", -1], session: null, rounds: null, request: null,
  projection: null, rawShown: RAW_PAGE, overflow: null, timer: null, requests: 0, incognito: false };

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

async function api(path, options) {
  const answer = await fetch(API + path, Object.assign({ credentials: "same-origin" }, options || {}));
  const text = await answer.text();
  const data = text ? JSON.parse(text) : {};
  if (!answer.ok) throw new Error((data.error && data.error.message) || answer.status + " " + answer.statusText);
  return data;
}

function toast(text, bad) {
  const t = $("toast");
  t.textContent = text;
  t.className = bad ? "show bad" : "show";
  setTimeout(() => { t.className = ""; }, 4000);
}

const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en"));
const ago = (iso) => {
  if (!iso) return "–";
  const s = Math.round((Date.now() - Date.parse(iso)) / 1000);
  return s < 60 ? s + " s ago" : s < 3600 ? Math.round(s / 60) + " min ago" : Math.round(s / 3600) + " h ago";
};

// --- routing -------------------------------------------------------------------------------------------------
function route() {
  clearInterval(state.timer);
  const m = location.hash.match(/^#\/([si])\/([^/]+)(?:\/r\/(\d+))?/);
  $("list-view").hidden = !!m;
  if (!m) delete $("list-view").dataset.left;
  $("session-view").hidden = !m;
  if (!m) { loadList(); state.timer = setInterval(loadList, 3000); return; }
  const id = decodeURIComponent(m[2]);
  const request = m[3] ? Number(m[3]) : null;
  const incognito = m[1] === "i";
  if (!state.session || state.session.id !== id || state.incognito !== incognito || !$("list-view").dataset.left) {
    state.rounds = null; state.projection = null;
  }
  state.incognito = incognito;
  $("list-view").dataset.left = "1";
  openSession(id, request);
  state.timer = setInterval(() => refreshSession(id), 3000);
}

// --- the sessions list ---------------------------------------------------------------------------------------
async function loadList() {
  try {
    state.sessions = (await api("/overview")).sessions;
    drawList();
  } catch (e) { toast("sessions: " + e.message, true); }
}

function drawList() {
  const words = $("filter").value.trim().toLowerCase();
  const onlyIncognito = $("only-incognito").checked;
  const [key, dir] = state.sort;
  const rows = state.sessions.filter((s) => (!onlyIncognito || s.incognito) &&
    (!words || [s.id, s.model, s.parent_id, ...(s.children || [])].join(" ").toLowerCase().includes(words)));
  rows.sort((a, b) => {
    const x = a[key], y = b[key];
    if (x === y) return 0;
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * dir;
  });
  const body = $("sessions").tBodies[0];
  body.replaceChildren(...rows.map(sessionRow));
  $("count").textContent = rows.length + " of " + state.sessions.length + " sessions";
  for (const th of $("sessions").tHead.rows[0].cells) {
    th.classList.toggle("sorted", th.dataset.key === key);
    th.dataset.dir = th.dataset.key === key ? (dir > 0 ? "▲" : "▼") : "";
  }
}

function sessionHash(id, incognito) { return "#/" + (incognito ? "i" : "s") + "/" + encodeURIComponent(id); }
function sessionLink(id, incognito) { return el("a", { href: sessionHash(id, incognito) }, id); }
const scope = (sep) => (state.incognito ? sep + "incognito=true" : "");

function sessionRow(s) {
  const forks = [];
  if (s.parent_id) forks.push("forked from ", sessionLink(s.parent_id, s.incognito), " at message " + s.shared_len);
  if (s.children && s.children.length) {
    if (forks.length) forks.push("; ");
    forks.push(s.children.length + " fork(s): ");
    s.children.forEach((c, i) => { if (i) forks.push(", "); forks.push(sessionLink(c, s.incognito)); });
  }
  return el("tr", { "data-session": s.id, "data-incognito": s.incognito ? "1" : null },
    el("td", {}, sessionLink(s.id, s.incognito)), el("td", {}, s.model || "–"), el("td", { class: "num" }, fmt(s.requests)),
    el("td", { class: "num" }, fmt(s.agent_tokens)), el("td", { class: "num" }, fmt(s.upstream_tokens)),
    el("td", { class: "num" }, s.reuse === null || s.reuse === undefined ? "–" : Math.round(s.reuse * 100) + " %"),
    el("td", { title: s.updated_at }, ago(s.updated_at)), el("td", {}, forks.length ? forks : "–"),
    el("td", {}, s.incognito ? el("span", { class: "badge incognito" }, "incognito") : ""));
}

// --- one session ---------------------------------------------------------------------------------------------
async function openSession(id, request) {
  const t0 = performance.now();
  try {
    if (!state.rounds || state.session.id !== id) await loadRounds(id);
    const rounds = state.rounds.rounds;
    const chosen = request || (rounds.length ? rounds[rounds.length - 1].request_id : null);
    if (chosen !== null && (!state.projection || state.projection.request_id !== chosen)) {
      state.rawShown = RAW_PAGE;
      await loadRequest(chosen);
    }
    document.body.dataset.render = String(Math.round(performance.now() - t0));
  } catch (e) { toast("session: " + e.message, true); }
}

async function loadRounds(id) {
  state.rounds = await api("/sessions/" + encodeURIComponent(id) + "/rounds" + scope("?"));
  state.session = state.rounds.session;
  state.requests = state.session.requests;
  drawSession();
}

async function refreshSession(id) {
  try {
    if (state.incognito) { await loadRounds(id); return; }  // the summary route reads the disk's journal only
    const s = await api("/sessions/" + encodeURIComponent(id));
    if (s.requests !== state.requests) { await loadRounds(id); }
  } catch (e) { toast("session: " + e.message, true); }
}

function drawSession() {
  const s = state.session, rounds = state.rounds.rounds;
  $("session-title").textContent = "Session " + s.id;
  const bits = [s.model || "model unknown", s.requests + " requests", s.messages + " messages now",
    "last activity " + ago(s.updated_at)];
  if (s.parent_id) bits.push("forked from " + s.parent_id);
  if (s.incognito) bits.push("incognito (in memory only)");
  $("session-summary").textContent = bits.join(" · ");
  drawChart(rounds, state.rounds.lines);
  drawTimeline();
}

function drawChart(rounds, lines) {
  const chart = $("chart");
  const W = Math.max(chart.clientWidth || 900, 300), H = 300, L = 64, R = 12, T = 30, B = 26;
  chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
  chart.replaceChildren();
  const n = Math.max(rounds.length, 1);
  const values = rounds.flatMap((r) => SERIES.map(([, key]) => r[key] || 0));
  const top = Math.max(lines.window, ...values, 1);
  const x = (i) => L + (n === 1 ? (W - L - R) / 2 : (i * (W - L - R)) / (n - 1));
  const y = (v) => T + (H - T - B) * (1 - v / top);
  chart.append(svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, class: "plot" }));
  for (const [name, value] of [["window", lines.window], ["budget", lines.budget], ["target", lines.target]]) {
    const g = svg("g", { class: "limit " + name, "data-line": name, "data-value": value });
    g.append(svg("line", { x1: L, x2: W - R, y1: y(value), y2: y(value) }));
    const label = svg("text", { x: L + 4, y: y(value) - 3 });
    label.textContent = name + " " + fmt(value);
    g.append(label);
    chart.append(g);
  }
  for (const [name, key] of SERIES) {
    const points = [];
    rounds.forEach((r, i) => { if (r[key] !== null && r[key] !== undefined) points.push(`${x(i).toFixed(1)},${y(r[key]).toFixed(1)}`); });
    chart.append(svg("polyline", { class: "series " + name, "data-series": name, "data-points": points.length,
      points: points.join(" ") }));
  }
  drawMarkers(chart, rounds, x, T);
  drawAxes(chart, rounds, top, x, y, { W, H, L, R, T, B });
  drawHits(chart, rounds, x, { W, H, L, R, T, B });
  $("legend").replaceChildren(...SERIES.map(([name, , label]) => el("span", { class: "key " + name }, label)));
}

function drawMarkers(chart, rounds, x, T) {
  const group = svg("g", { class: "markers" });
  rounds.forEach((r, i) => {
    const kinds = MARK_KINDS.filter((k) => r.marks[k]);
    if (r.ops.length) kinds.push("op");
    kinds.forEach((kind, j) => {
      const m = svg("circle", { cx: x(i), cy: T - 6 - j * 6, r: 3, class: "mark " + kind, "data-mark": kind,
        "data-request": r.request_id });
      const tip = svg("title", {});
      tip.textContent = `request ${r.request_id}: ` + (kind === "op" ? "context tools: " + r.ops.join(", ")
        : (r.marks[kind] + " " + kind));
      m.append(tip);
      group.append(m);
    });
  });
  chart.append(group);
}

function drawAxes(chart, rounds, top, x, y, box) {
  for (const v of [0, top / 2, top]) {
    const t = svg("text", { x: box.L - 6, y: y(v) + 4, class: "axis", "text-anchor": "end" });
    t.textContent = fmt(Math.round(v));
    chart.append(t);
  }
  const step = Math.max(1, Math.ceil(rounds.length / 10));
  rounds.forEach((r, i) => {
    if (i % step && i !== rounds.length - 1) return;
    const t = svg("text", { x: x(i), y: box.H - 8, class: "axis", "text-anchor": "middle" });
    t.textContent = "#" + (i + 1);
    chart.append(t);
  });
}

function drawHits(chart, rounds, x, box) {
  const selected = state.projection ? state.projection.request_id : null;
  const width = Math.max(2, (box.W - box.L - box.R) / Math.max(rounds.length, 1));
  const group = svg("g", { class: "hits" });
  rounds.forEach((r, i) => {
    const hit = svg("rect", { x: x(i) - width / 2, y: box.T, width, height: box.H - box.T - box.B,
      class: r.request_id === selected ? "hit selected" : "hit", "data-request": r.request_id });
    const tip = svg("title", {});
    tip.textContent = `request ${r.request_id} (#${i + 1}): agent ${fmt(r.agent_tokens)}, upstream ` +
      `${fmt(r.upstream_tokens)}, usage ${fmt(r.prompt_tokens)}, reused ${fmt(r.reused_tokens)}; ${r.outcome || "no answer"}`;
    hit.append(tip);
    hit.addEventListener("click", () => { location.hash = sessionHash(state.session.id, state.incognito) + "/r/" + r.request_id; });
    group.append(hit);
  });
  chart.append(group);
}

function drawTimeline() {
  const { cuts, ops } = state.rounds;
  const items = cuts.map((c) => ({ at: c.created_at, node: cutItem(c) }))
    .concat(ops.map((o) => ({ at: o.created_at, node: opItem(o) })));
  items.sort((a, b) => (a.at < b.at ? -1 : a.at > b.at ? 1 : 0));
  $("timeline").replaceChildren(...items.slice(-300).map((i) => i.node));
  if (items.length > 300) $("timeline").prepend(el("li", { class: "muted" }, (items.length - 300) + " earlier entries not shown"));
}

function cutItem(c) {
  const where = c.request_id ? "request " + c.request_id : "operator";
  const body = c.overflow_id ? overflowLink(c.overflow_id, c.kind) : null;
  return el("li", { class: "decision " + c.kind, "data-kind": c.kind },
    el("span", { class: "when", title: c.created_at }, c.created_at.slice(11, 19)), " ",
    el("span", { class: "badge " + c.kind }, c.kind), " ", c.target, c.count ? ` (${c.count} messages)` : "",
    " · ", c.source, " · ", where, body ? [" · ", body] : null);
}

function opItem(o) {
  return el("li", { class: "op", "data-op": o.op },
    el("span", { class: "when", title: o.created_at }, o.created_at.slice(11, 19)), " ",
    el("span", { class: "badge op" }, "ctx " + o.op), " ", o.ok ? "applied" : "refused",
    o.handles.length ? " · " + o.handles.join(", ") : "", o.tokens_freed ? ` · ${fmt(o.tokens_freed)} tokens freed` : "",
    ` · request ${o.request_id}, round ${o.round}`);
}

// --- one request: the history beside the projection -----------------------------------------------------------
async function loadRequest(requestId) {
  state.projection = await api("/requests/" + requestId + "/projection" + scope("?"));
  drawRequest();
  drawChart(state.rounds.rounds, state.rounds.lines);
}

function drawRequest() {
  const p = state.projection;
  const round = state.rounds.rounds.find((r) => r.request_id === p.request_id) || {};
  $("request-head").replaceChildren(el("h2", {}, `Request ${p.request_id}`),
    el("p", { class: "muted" }, `${fmt(round.agent_tokens)} tokens sent by the agent → ${fmt(round.upstream_tokens)} ` +
      `upstream (usage ${fmt(round.prompt_tokens)}); ${fmt(round.reused_messages)} messages reused from the request ` +
      `before; ${round.outcome || "no answer"} ${round.status || ""}`, " · ",
      el("a", { href: API + "/requests/" + p.request_id + "/upstream" + scope("?"), target: "_blank" }, "upstream body (JSON)")));
  const cutBy = new Map();
  for (const c of p.cuts) {
    if (CUT_KINDS.has(c.kind)) cutBy.set(c.target, c);
    else if (c.kind === "restore") cutBy.delete(c.target);
  }
  const kindOf = new Map(p.cuts.filter((c) => c.overflow_id).map((c) => [c.overflow_id, c.kind]));
  const pins = new Set(p.pins);
  const folded = foldOf(p);
  const hidden = Math.max(0, p.raw.length - state.rawShown);
  const raw = p.raw.slice(hidden).map((item, i) =>
    rawMessage(item, folded.has(hidden + i) ? folded.get(hidden + i) : cutBy.get(item.id), pins.has(item.id)));
  if (hidden) raw.unshift(el("button", { class: "more", type: "button", onclick: () => { state.rawShown += 200; drawRequest(); } },
    `show ${Math.min(200, hidden)} earlier of ${hidden} not shown`));
  $("raw").replaceChildren(...raw);
  const sent = p.sent || [];
  const sentHidden = Math.max(0, sent.length - state.rawShown);
  const shown = sent.slice(sentHidden).map((m, i) => sentMessage(m, sentHidden + i, kindOf));
  if (sentHidden) shown.unshift(el("p", { class: "muted" }, `${sentHidden} earlier messages not shown`));
  $("sent").replaceChildren(...(p.sent ? shown : [el("p", { class: "muted" }, "Nothing went upstream for this request.")]));
}

function foldOf(p) {
  // The fold in force (the newest): the raw messages from its target to its `until`, but the pinned ones.
  const folds = p.cuts.filter((c) => c.kind === "fold");
  const out = new Map();
  if (!folds.length) return out;
  const fold = folds[folds.length - 1];
  const ids = p.raw.map((item) => item.id);
  const first = ids.indexOf(fold.target), last = ids.indexOf(fold.until);
  if (first < 0 || last < first) return out;
  for (let i = first; i <= last; i++) if (!p.pins.includes(ids[i])) out.set(i, fold);
  return out;
}

function preview(message) {
  let text = message.content;
  if (Array.isArray(text)) text = text.map((p) => p.text || "[" + p.type + "]").join("\n");
  if (text === null || text === undefined) text = "";
  const calls = (message.tool_calls || []).map((c) => `→ ${c.function && c.function.name}(${(c.function && c.function.arguments) || ""})`);
  return [text, ...calls].filter(Boolean).join("\n");
}

function body(text) {
  const pre = el("pre", { class: "content" });
  if (text.length > 600) {
    pre.textContent = text.slice(0, 600);
    pre.append(el("button", { type: "button", class: "link", onclick: (e) => { e.target.remove(); pre.textContent = text; } }, ` … ${fmt(text.length - 600)} more characters`));
  } else pre.textContent = text;
  return pre;
}

function rawMessage(item, cut, pinned) {
  const m = item.message;
  const head = el("div", { class: "head" }, el("span", { class: "role" }, m.role), " ", el("code", {}, item.id));
  if (pinned) head.append(" ", el("span", { class: "badge pin", "data-mark": "pin" }, "pinned"));
  if (cut && cut.overflow_id) head.append(" ", overflowLink(cut.overflow_id, cut.kind));
  else if (cut) head.append(" ", el("span", { class: "badge " + cut.kind, "data-mark": cut.kind }, cut.kind));
  if (m.role !== "system" && m.role !== "developer" && !state.incognito) {  // actions: sessions on disk
    head.append(" ", el("button", { type: "button", class: "action", "data-action": pinned ? "unpin" : "pin",
      onclick: () => changePin(item.id, !pinned) }, pinned ? "unpin" : "pin"));
    if (cut && !pinned && cut.kind !== "fold") head.append(" ", actionButton("restore", item.id));
    else if (!cut && !pinned && m.role === "tool" && typeof m.content === "string" && m.content.length >= MIN_CUT_CHARS) {
      head.append(" ", actionButton("drop", item.id));
    }
  }
  return el("div", { class: "message " + m.role + (pinned ? " pinned" : ""), "data-id": item.id }, head, body(preview(m)));
}

function sentMessage(m, index, kindOf) {
  const text = preview(m);
  const head = el("div", { class: "head" }, el("span", { class: "role" }, m.role), " ", el("span", { class: "muted" }, "#" + index));
  const ids = [...new Set([...text.matchAll(STUB_ID)].map((x) => x[1]))];
  for (const id of ids) head.append(" ", overflowLink(id, kindOf.get(id) || (text.includes("[folded id=" + id) ? "fold" : "stub")));
  return el("div", { class: "message " + m.role + (ids.length ? " stubbed" : ""), "data-index": index }, head, body(text));
}

function overflowLink(id, kind) {
  return el("button", { type: "button", class: "badge stub " + kind, "data-mark": kind, "data-overflow": id,
    title: "open the cut body " + id, onclick: () => openOverflow(id, 0) }, `${kind} ${id.slice(0, 8)}…`);
}

function actionButton(verb, id) {
  return el("button", { type: "button", class: "action", "data-action": verb, onclick: () => cutAction(verb, id) }, verb);
}

async function cutAction(verb, id) {
  const what = verb === "drop" ? "Drop it from the session's next requests (its body is kept in the overflow store)"
    : "Restore it whole for the next request (the rules may cut it again if the request is over budget)";
  if (!confirm(`${verb}: ${id} in session ${state.session.id}. ${what}? Journaled as an operator decision.`)) return;
  try {
    await api("/sessions/" + encodeURIComponent(state.session.id) + "/" + verb, { method: "POST",
      headers: { "content-type": "application/json" }, body: JSON.stringify({ handle: id }) });
    toast(`${verb}: ${id}, from the next request on`);
    await loadRounds(state.session.id);
    await loadRequest(state.projection.request_id);
  } catch (e) { toast(`${verb}: ${e.message}`, true); }
}

async function changePin(id, pin) {
  const verb = pin ? "Pin" : "Unpin";
  if (!confirm(`${verb} ${id} in session ${state.session.id}? The next request of the session honours it; the ` +
    "change is journaled as an operator decision.")) return;
  try {
    await api("/sessions/" + encodeURIComponent(state.session.id) + "/pins", { method: pin ? "POST" : "DELETE",
      headers: { "content-type": "application/json" }, body: JSON.stringify({ handle: id }) });
    toast(`${verb}ned ${id}: the next request honours it`);
    await loadRounds(state.session.id);
    await loadRequest(state.projection.request_id);
  } catch (e) { toast(`${verb}: ${e.message}`, true); }
}

// --- a cut body, paged, with grep ------------------------------------------------------------------------------
async function openOverflow(id, offset) {
  const grep = $("overflow-grep").value;
  const q = new URLSearchParams({ offset, limit: 200, grep });
  if (state.incognito) q.set("incognito", "true");
  try {
    const page = await api(`/sessions/${encodeURIComponent(state.session.id)}/overflow/${id}/lines?${q}`);
    state.overflow = { id, offset, total: page.total };
    $("overflow-title").textContent = `${page.tool} ${page.call_id} · ${fmt(page.bytes)} bytes · ${id}`;
    $("overflow-body").textContent = page.lines.map(([n, t]) => String(n + 1).padStart(5) + "  " + t).join("\n") || "(no line matches)";
    $("overflow-range").textContent = page.total ? `lines ${offset + 1}–${Math.min(offset + 200, page.total)} of ${page.total}` +
      (grep ? " matching" : "") : "";
    $("overflow-prev").disabled = offset <= 0;
    $("overflow-next").disabled = offset + 200 >= page.total;
    if (!$("overflow").open) $("overflow").showModal();
  } catch (e) { toast("overflow: " + e.message, true); }
}

// --- live events -----------------------------------------------------------------------------------------------
function listen() {
  const source = new EventSource(API + "/events");
  source.onopen = () => { $("live").textContent = "live"; $("live").className = "live on"; };
  source.onerror = () => { $("live").textContent = "live: reconnecting…"; $("live").className = "live"; };
  source.addEventListener("context_op", (e) => {
    const op = JSON.parse(e.data);
    if (!state.session || op.session !== state.session.id || $("session-view").hidden) return;
    $("events").prepend(el("li", { class: "op", "data-op": op.op }, new Date().toISOString().slice(11, 19), " ",
      el("span", { class: "badge op" }, "ctx " + op.op), " ", op.ok ? "applied" : "refused",
      op.handles.length ? " · " + op.handles.join(", ") : "", op.tokens_freed ? ` · ${fmt(op.tokens_freed)} tokens freed` : "",
      ` · round ${op.round}`));
  });
}

// --- wiring ----------------------------------------------------------------------------------------------------
$("filter").addEventListener("input", drawList);
$("only-incognito").addEventListener("change", drawList);
for (const th of $("sessions").tHead.rows[0].cells) {
  th.addEventListener("click", () => {
    const key = th.dataset.key;
    state.sort = [key, state.sort[0] === key ? -state.sort[1] : (key === "id" || key === "model" ? 1 : -1)];
    drawList();
  });
}
$("overflow-grep").addEventListener("change", () => openOverflow(state.overflow.id, 0));
$("overflow-prev").addEventListener("click", () => openOverflow(state.overflow.id, Math.max(0, state.overflow.offset - 200)));
$("overflow-next").addEventListener("click", () => openOverflow(state.overflow.id, state.overflow.offset + 200));
window.addEventListener("hashchange", route);
window.addEventListener("resize", () => { if (state.rounds && !$("session-view").hidden) drawChart(state.rounds.rounds, state.rounds.lines); });
listen();
route();
