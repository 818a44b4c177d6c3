// The strata console: polls /health and /metrics once a second and draws the swarm. Every
// value from the network is written as text (textContent), never as markup.
"use strict";

const PERIOD_MS = 1000;
const WINDOW_S = 60;
const EVENT_FAMILIES = [
  "strata_refusals_total",
  "strata_failures_total",
  "strata_request_failures_total",
  "strata_migrations_total",
];
const history = new Map(); // series key -> [[time ms, value], ...] for the last WINDOW_S

function key() {
  return sessionStorage.getItem("strata-key") || "";
}

function headers() {
  const k = key();
  return k ? { authorization: "Bearer " + k } : {};
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  }
  return e;
}

// Prometheus text: [{name, labels: {..}, value}] for the samples (comments skipped).
function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    if (m[3]) {
      for (const l of m[3].matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) {
        labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
      }
    }
    out.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return out;
}

function labelText(labels, skip) {
  return Object.entries(labels)
    .filter(([k]) => !(skip || []).includes(k))
    .map(([k, v]) => k + "=" + v)
    .join(" ");
}

function bytes(n) {
  if (n == null) return "";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function range(text) {
  const m = /^(\d+)\.\.(\d+)$/.exec(text || "");
  return m ? [Number(m[1]), Number(m[2])] : null;
}

function drawModels(health, samples) {
  const root = document.getElementById("models");
  root.replaceChildren();
  const perToken = new Map();
  const sums = samples.filter((s) => s.name === "strata_inter_token_seconds_sum");
  for (const s of sums) {
    const count = samples.find(
      (c) => c.name === "strata_inter_token_seconds_count" && labelText(c.labels) === labelText(s.labels),
    );
    if (count && count.value > 0) perToken.set(s.labels.model + "/" + s.labels.route, s.value / count.value);
  }
  // Prefix-cache hit rate per route: finished sessions that started on cached blocks.
  const lookups = new Map();
  for (const s of samples.filter((s) => s.name === "strata_prefix_lookups_total")) {
    const key = s.labels.model + "/" + s.labels.route;
    const l = lookups.get(key) || { hit: 0, all: 0 };
    l.all += s.value;
    if (s.labels.outcome === "hit") l.hit += s.value;
    lookups.set(key, l);
  }
  for (const m of health.models || []) {
    const n = m.n_layers || 1;
    const shards = (health.shards || []).filter((s) => s.model === m.id);
    const box = el("div", { class: "model" });
    box.append(el("h2", {}, m.id, " ", el("small", {}, n + " layers · digest " + (m.digest || "").slice(0, 12))));
    // Coverage: how many shards that are up hold each layer.
    const cover = new Array(n).fill(0);
    for (const s of shards) {
      const r = range(s.layers);
      if (r && s.status === "up") for (let l = r[0]; l < Math.min(r[1], n); l++) cover[l]++;
    }
    const gaps = cover.filter((c) => c === 0).length;
    const map = el("div", { class: "coverage", "data-model": m.id });
    cover.forEach((c, l) => map.append(el("span", { class: "layer c" + Math.min(c, 3), title: "layer " + l + ": " + c + " shard(s) up" })));
    box.append(el("div", { class: "caption" }, gaps ? gaps + " of " + n + " layers have no shard up" : "every layer covered (darker: more replicas)"), map);
    for (const r of m.routes || []) {
      const row = el("div", { class: "route " + r.status, "data-route": r.name });
      const tpt = perToken.get(m.id + "/" + r.name);
      const hits = lookups.get(m.id + "/" + r.name);
      row.append(
        el("div", { class: "routehead" },
          el("b", {}, "route " + r.name), " ",
          el("span", { class: "pill " + r.status }, r.status), " ",
          r.sessions + " sessions", tpt ? " · " + (tpt * 1000).toFixed(1) + " ms/token" : "",
          hits && hits.all > 0
            ? el("span", { class: "hitrate", title: hits.hit + " of " + hits.all + " sessions started on cached prefix blocks" },
              " · prefix cache hits " + Math.round((100 * hits.hit) / hits.all) + "%")
            : ""),
      );
      const bar = el("div", { class: "bar" });
      for (const s of shards.filter((s) => s.route === r.name)) {
        const [a, b] = range(s.layers) || [0, 0];
        bar.append(
          el("div", { class: "seg " + s.status, style: "left:" + (100 * a) / n + "%;width:" + (100 * (b - a)) / n + "%",
            "data-shard": s.address, title: s.error || "" },
            s.address + " " + s.layers + " " + s.status),
        );
      }
      row.append(bar);
      box.append(row);
    }
    root.append(box);
  }
  const select = document.getElementById("chatmodel");
  const ids = (health.models || []).map((m) => m.id);
  if ([...select.options].map((o) => o.value).join() !== ids.join()) {
    select.replaceChildren(...ids.map((id) => el("option", { value: id }, id)));
  }
}

function drawShards(health) {
  const body = document.querySelector("#shards tbody");
  body.replaceChildren();
  for (const s of health.shards || []) {
    const total = s.kv_blocks_total, used = s.kv_blocks_in_use;
    const headroom = total ? (100 * (total - used)) / total : null;
    body.append(
      el("tr", { class: s.status, "data-shard": s.address },
        el("td", {}, s.address), el("td", {}, s.model), el("td", {}, s.route), el("td", {}, s.layers),
        el("td", {}, s.version ? "v" + s.version + " · protocol " + s.protocol : ""),
        el("td", {}, el("span", { class: "pill " + s.status }, s.status)),
        el("td", {}, s.sessions ?? ""), el("td", {}, total != null ? used + " / " + total : ""),
        el("td", {}, headroom != null ? headroom.toFixed(0) + "% (" + bytes(s.kv_bytes_in_use) + " used)" : ""),
        el("td", {}, s.evictions ?? ""), el("td", { class: "error" }, s.error || "")),
    );
  }
}

function drawMetrics(samples, now) {
  const build = samples.find((s) => s.name === "strata_build_info");
  if (build) document.getElementById("version").textContent = "v" + build.labels.version + " · protocol " + build.labels.protocol;
  const queues = document.querySelector("#queues tbody");
  queues.replaceChildren();
  for (const s of samples.filter((s) => s.name === "strata_queue_depth")) {
    queues.append(el("tr", {}, el("td", {}, (s.labels.model || "") + " " + (s.labels.route || "")),
      el("td", {}, labelText(s.labels, ["model", "route"])), el("td", {}, s.value)));
  }
  const events = document.querySelector("#events tbody");
  events.replaceChildren();
  for (const s of samples.filter((s) => EVENT_FAMILIES.includes(s.name))) {
    const k = s.name + "{" + labelText(s.labels) + "}";
    // A series first seen after the first poll started at 0 since then.
    const first = Number(document.body.dataset.polls || 0) === 0;
    const h = history.get(k) || (first ? [] : [[now, 0]]);
    h.push([now, s.value]);
    while (h.length && h[0][0] < now - WINDOW_S * 1000) h.shift();
    history.set(k, h);
    const recent = s.value - h[0][1];
    events.append(el("tr", { class: recent > 0 ? "recent" : "" },
      el("td", {}, s.name.replace(/^strata_|_total$/g, "")), el("td", {}, labelText(s.labels)),
      el("td", {}, s.value), el("td", {}, recent)));
  }
}

function drawRegistry(health) {
  const r = health.registry;
  document.getElementById("registry").textContent = r
    ? (r.connected ? "connected" : "DISCONNECTED") + " · " + r.members + " members · revision " + r.revision
    : "none (static routes)";
}

async function poll() {
  const now = Date.now();
  try {
    const [h, m] = await Promise.all([
      fetch("/health", { headers: headers(), cache: "no-store" }),
      fetch("/metrics", { headers: headers(), cache: "no-store" }),
    ]);
    if (h.status === 401 || m.status === 401) {
      document.getElementById("keyform").hidden = false;
      setStatus("needs an API key", "down");
      return;
    }
    const health = await h.json();
    const samples = parseMetrics(await m.text());
    setStatus(health.status, health.status === "ok" ? "up" : "down");
    drawModels(health, samples);
    drawShards(health);
    drawMetrics(samples, now);
    drawRegistry(health);
    document.getElementById("updated").textContent = "updated " + new Date(now).toLocaleTimeString();
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (e) {
    setStatus("tracker unreachable: " + e.message, "down");
  }
}

function setStatus(text, cls) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = "pill " + cls;
}

document.getElementById("keyform").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("strata-key", document.getElementById("key").value);
  document.getElementById("keyform").hidden = true;
  poll();
});

// The chat box: one streamed chat completion, tokens shown as they come.
document.getElementById("chat").addEventListener("submit", async (e) => {
  e.preventDefault();
  const out = document.getElementById("answer");
  out.textContent = "";
  const body = {
    model: document.getElementById("chatmodel").value,
    messages: [{ role: "user", content: document.getElementById("prompt").value }],
    max_tokens: 256,
    stream: true,
  };
  const r = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: Object.assign({ "content-type": "application/json" }, headers()),
    body: JSON.stringify(body),
  });
  if (!r.ok) {
    // Any request that needs a key asks for one (with --public-metrics the panels need none,
    // and the chat box is the first to learn that a key is wanted).
    out.textContent = r.status + ": " + (await r.text());
    if (r.status === 401) document.getElementById("keyform").hidden = false;
    return;
  }
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const data = event.replace(/^data: ?/, "");
      if (data === "[DONE]") return;
      try {
        const v = JSON.parse(data);
        if (v.error) out.textContent += "\n[" + v.error.message + "]";
        for (const c of v.choices || []) out.textContent += (c.delta && c.delta.content) || "";
      } catch (_) {
        // a keep-alive comment or a partial event: nothing to show
      }
    }
  }
});

poll();
setInterval(poll, PERIOD_MS);
