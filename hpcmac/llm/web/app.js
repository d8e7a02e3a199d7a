// hpcmac serve's live page: /v1/cluster once, /metrics.json every second, chat through
// /v1/chat/completions (streamed). No build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
let key = localStorage.getItem("hpcmac.key") || "";
let model = null;
const history = [];  // the chat's messages

function headers(json) {
  const h = {};
  if (key) h["Authorization"] = "Bearer " + key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function api(path, init) {
  const r = await fetch(path, Object.assign({headers: headers(false)}, init || {}));
  if (r.status === 401) {
    $("key-box").classList.add("need");
    $("status").textContent = "this server needs an API key";
    throw new Error("401");
  }
  return r;
}

function el(tag, attrs, text) {
  const e = document.createElementNS(tag === "svg" || attrs.svg ? "http://www.w3.org/2000/svg"
                                     : "http://www.w3.org/1999/xhtml", tag);
  for (const [k, v] of Object.entries(attrs)) if (k !== "svg") e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function gib(b) { return b == null ? "-" : (b / 2 ** 30).toFixed(2) + " GiB"; }

function bar(frac, over) {
  const d = document.createElement("div");
  d.className = "bar" + (over ? " over" : "");
  const i = document.createElement("div");
  i.style.width = Math.max(0, Math.min(100, 100 * frac)).toFixed(1) + "%";
  d.appendChild(i);
  return d;
}

function drawCluster(c) {
  const svg = $("hosts");
  svg.innerHTML = "";
  const W = svg.clientWidth || 600, hostW = Math.min(260, (W - 20) / c.hosts.length - 20);
  const pos = {};
  const layer = () => svg.appendChild(el("g", {svg: 1}));
  const hostLayer = layer(), linkLayer = layer(), rankLayer = layer();  // links over hosts, under ranks
  c.hosts.forEach((h, i) => {
    const x = 10 + i * (hostW + 20), y = 10, hh = 40 + 46 * Math.ceil(h.ranks.length / 3);
    const g = el("g", {svg: 1, class: "host", "data-host": h.name});
    g.appendChild(el("rect", {svg: 1, x, y, width: hostW, height: hh, rx: 8,
                              fill: "#eef3fb", stroke: "#3b7dd8"}));
    g.appendChild(el("text", {svg: 1, x: x + 10, y: y + 18, "font-weight": "bold"},
                     "host " + h.name));
    h.ranks.forEach((r, j) => {
      const cx = x + 40 + (j % 3) * 70, cy = y + 52 + 46 * Math.floor(j / 3);
      pos[r] = [cx, cy];
      const rk = c.ranks.find((q) => q.rank === r) || {};
      const rg = el("g", {svg: 1, class: "rank", "data-rank": r, "data-host": h.name});
      rg.appendChild(el("circle", {svg: 1, cx, cy, r: 18, fill: "#fff", stroke: "#1d2330"}));
      rg.appendChild(el("text", {svg: 1, x: cx, y: cy + 4, "text-anchor": "middle"}, "r" + r));
      const t = el("title", {svg: 1}, `rank ${r}: stage ${rk.stage}, tensor rank ${rk.tp_rank}`);
      rg.appendChild(t);
      rankLayer.appendChild(rg);
    });
    hostLayer.appendChild(g);
  });
  const tbody = $("links").querySelector("tbody");
  tbody.innerHTML = "";
  c.links.forEach((l, i) => {
    const [a, b] = [pos[l.from], pos[l.to]];
    if (a && b) {
      const bend = l.kind === "tokens back" ? 26 : (l.kind === "tensor" ? -26 : 0);
      const mx = (a[0] + b[0]) / 2, my = (a[1] + b[1]) / 2 + bend;
      const p = el("path", {svg: 1, d: `M${a[0]},${a[1]} Q${mx},${my} ${b[0]},${b[1]}`,
                            fill: "none", stroke: l.kind === "tensor" ? "#d8903b" : "#3b7dd8",
                            "stroke-width": 2, "stroke-dasharray": l.kind === "tokens back" ? "4 3" : ""});
      p.appendChild(el("title", {svg: 1}, `${l.kind}: ${l.transport}`));
      linkLayer.appendChild(p);
    }
    const tr = document.createElement("tr");
    tr.className = "link";
    for (const v of [`rank ${l.from} \u2192 rank ${l.to}`, l.kind, l.transport]) {
      const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
    }
    tbody.appendChild(tr);
  });
  if (!c.links.length) {
    const tr = document.createElement("tr");
    tr.innerHTML = '<td colspan="3" class="muted">one rank: no links</td>';
    tbody.appendChild(tr);
  }
}

function drawPlacement(c) {
  const tbody = $("placement").querySelector("tbody");
  tbody.innerHTML = "";
  for (const r of c.ranks) {
    const tr = document.createElement("tr");
    tr.className = "placed";
    const ex = r.ranges && r.ranges.expert_ffn ? r.ranges.expert_ffn[1] - r.ranges.expert_ffn[0] : 0;
    const cells = [r.rank, r.host, r.stage, r.tp_rank,
                   r.layers ? `[${r.layers[0]}, ${r.layers[1]})` : "-", r.heads ?? "-",
                   r.kv_heads ?? "-", r.ffn ?? "-", ex || "-", r.vocab ?? "-"];
    for (const v of cells) {
      const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
    }
    const td = document.createElement("td");
    td.textContent = `${gib(r.need_bytes)} / ${gib(r.budget_bytes)}`;
    if (r.budget_bytes) td.appendChild(bar(r.need_bytes / r.budget_bytes, r.need_bytes > r.budget_bytes));
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
}

function drawPlot(hist) {
  const cv = $("plot"), g = cv.getContext("2d");
  const W = cv.width, H = cv.height;
  // 5-second bins over the last 10 minutes, in tokens per second
  const bins = [];
  for (let i = 0; i + 5 <= hist.length; i += 5) {
    bins.push(hist.slice(i, i + 5).reduce((s, p) => s + p[1], 0) / 5);
  }
  const top = Math.max(1, ...bins);
  g.clearRect(0, 0, W, H);
  g.strokeStyle = "#eef0f4"; g.fillStyle = "#8a93a8"; g.font = "11px sans-serif";
  for (let k = 0; k <= 4; k++) {
    const y = H - 16 - (H - 26) * k / 4;
    g.beginPath(); g.moveTo(30, y); g.lineTo(W, y); g.stroke();
    g.fillText((top * k / 4).toFixed(top < 8 ? 1 : 0), 2, y + 4);
  }
  g.fillText("-10 min", 32, H - 3); g.fillText("now", W - 24, H - 3);
  g.strokeStyle = "#3b7dd8"; g.lineWidth = 2; g.beginPath();
  bins.forEach((v, i) => {
    const x = 30 + (W - 34) * i / Math.max(1, bins.length - 1);
    const y = H - 16 - (H - 26) * v / top;
    if (i) g.lineTo(x, y); else g.moveTo(x, y);
  });
  g.stroke();
}

function drawLive(m) {
  $("tok-s").textContent = m.tok_s_10s.toFixed(1);
  $("running").textContent = `${m.running} / ${m.slots}`;
  $("waiting").textContent = m.waiting;
  $("kv").textContent = m.kv_capacity ? (100 * m.kv_tokens / m.kv_capacity).toFixed(1) + "%" : "-";
  $("ttft").textContent = m.ttft_mean_s == null ? "-" : (1000 * m.ttft_mean_s).toFixed(0) + " ms";
  drawPlot(m.history);
  const tbody = $("busy").querySelector("tbody");
  tbody.innerHTML = "";
  for (const r of m.ranks) {
    const tr = document.createElement("tr");
    tr.className = "busy-rank";
    for (const v of [r.rank, r.host, r.busy == null ? "not reported" : (100 * r.busy).toFixed(0) + "%"]) {
      const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
    }
    const td = document.createElement("td");
    td.appendChild(bar(r.busy || 0, false));
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
}

async function loadCluster() {
  const c = await (await api("/v1/cluster")).json();
  model = c.model;
  $("model").textContent = c.model;
  $("layout").textContent = `${c.layout.describe} \u00b7 ${c.transport} \u00b7 ${c.slots} slots \u00b7 context ${c.context}`;
  drawCluster(c);
  drawPlacement(c);
}

async function poll() {
  try {
    if (model === null) await loadCluster();
    drawLive(await (await api("/metrics.json")).json());
    $("status").textContent = "live";
  } catch (e) {
    if (e.message !== "401") $("status").textContent = "no answer: " + e.message;
  }
  setTimeout(poll, 1000);
}

function addMsg(role, text) {
  const d = document.createElement("div");
  d.className = "msg " + role;
  d.textContent = text;
  $("chat-log").appendChild(d);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return d;
}

async function send() {
  const text = $("chat-input").value.trim();
  if (!text) return;
  $("chat-input").value = "";
  $("chat-send").disabled = true;
  history.push({role: "user", content: text});
  addMsg("user", text);
  const out = addMsg("assistant", "");
  let answer = "";
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(true),
      body: JSON.stringify({model, messages: history, stream: true,
                            temperature: parseFloat($("chat-temp").value),
                            max_tokens: parseInt($("chat-max").value, 10)})});
    if (!r.ok) throw new Error((await r.json()).error.message);
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, i).trim();
        buf = buf.slice(i + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const ev = JSON.parse(data);
        if (ev.error) throw new Error(ev.error.message);
        const piece = ev.choices[0].delta.content;
        if (piece) { answer += piece; out.textContent = answer; }
        if (ev.choices[0].finish_reason) out.dataset.finish = ev.choices[0].finish_reason;
      }
    }
    history.push({role: "assistant", content: answer});
    out.dataset.done = "1";
  } catch (e) {
    out.className = "msg error";
    out.textContent = "error: " + e.message;
    history.pop();
  }
  $("chat-send").disabled = false;
}

$("chat-send").addEventListener("click", send);
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
$("key-save").addEventListener("click", () => {
  key = $("key").value.trim();
  localStorage.setItem("hpcmac.key", key);
  $("key-box").classList.remove("need");
  $("status").textContent = "connecting...";
});
poll();
