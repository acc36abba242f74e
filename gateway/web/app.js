// The gateway's built-in page: a chat over /v1/chat/completions (SSE) and a live cluster view
// polling /v1/cluster. Model output is only ever inserted as text (textContent), never as HTML.
"use strict";

const KEY_STORAGE = "raging.apiKey";
const POLL_MS = 1500;
const $ = (id) => document.getElementById(id);

class AuthError extends Error {}

// ---- API access: every data call carries the key the user gave, when there is one.

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers) });
  if (response.status === 401) {
    needKey(apiKey() ? "that key was refused" : "this gateway needs an API key");
    throw new AuthError(await errorMessage(response));
  }
  return response;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || `HTTP ${response.status}`;
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

function needKey(why) {
  $("key-status").textContent = why;
  $("key-status").className = "error";
  $("api-key").focus();
}

function saveKey(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
  $("api-key").value = "";
  $("key-status").textContent = key ? "key set for this tab" : "no key";
  $("key-status").className = "muted";
  loadModels();
  pollCluster();
}

// ---- Chat

const conversation = [];  // {role, content} of the turns so far
let inFlight = null;  // the AbortController of the answer being streamed
let chatNumber = 0;  // "New chat" starts the next: an answer of an earlier one is not kept

async function loadModels() {
  try {
    const response = await api("/v1/models");
    if (!response.ok) throw new Error(await errorMessage(response));
    const select = $("model");
    const chosen = select.value;
    select.replaceChildren();
    for (const card of (await response.json()).data) {
      const option = document.createElement("option");
      option.value = option.textContent = card.id;
      select.append(option);
    }
    if (chosen) select.value = chosen;
    if (!select.value && select.options.length) select.selectedIndex = 0;
  } catch (err) {
    if (!(err instanceof AuthError)) $("key-status").textContent = `models: ${err.message}`;
  }
}

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  box.append(body);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || inFlight) return;
  $("prompt").value = "";
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  answer(addMessage("assistant", "")).finally(() => setBusy(null));
}

function setBusy(controller) {
  inFlight = controller;
  $("send").disabled = controller !== null;
  $("stop").disabled = controller === null;
}

function requestBody() {
  const body = {
    model: $("model").value, messages: conversation, stream: true,
    stream_options: { include_usage: true },
  };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const temperature = parseFloat($("temperature").value);
  if (temperature >= 0) body.temperature = temperature;
  return body;
}

// Streams one answer into `box`, then shows its stats; a stop keeps what arrived so far.
async function answer(box) {
  const chat = chatNumber;
  const controller = new AbortController();
  setBusy(controller);
  box.classList.add("streaming");
  const run = { text: "", started: performance.now(), first: null, ended: null,
                tokens: null, chunks: 0, timing: null, finish: null };
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", signal: controller.signal, body: JSON.stringify(requestBody()),
      headers: { "Content-Type": "application/json", "X-Raging-Timing": "true" },
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readStream(response.body, (chunk) => onChunk(box, run, chunk));
  } catch (err) {
    if (err.name === "AbortError") run.finish = "stopped";
    else fail(box, run, err.message);
  }
  run.ended = performance.now();
  box.classList.remove("streaming");
  if (chat !== chatNumber) return;  // its chat was cleared while it streamed
  if (run.text) conversation.push({ role: "assistant", content: run.text });
  else conversation.pop();  // not answered (an error, or stopped first): not part of the chat
  showStats(box, run);
}

// Calls `onData` with each `data:` payload of an SSE body, parsed (the "[DONE]" end excluded).
async function readStream(body, onData) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    const lines = pending.split("\n");
    pending = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;  // blank separators and ": keepalive"
      const payload = line.slice(5).trim();
      if (payload === "[DONE]") return;
      onData(JSON.parse(payload));
    }
  }
}

function onChunk(box, run, chunk) {
  if (chunk.error) throw new Error(chunk.error.message);
  for (const choice of chunk.choices || []) {
    const piece = (choice.delta && choice.delta.content) || "";
    if (piece) {
      if (run.first === null) run.first = performance.now();
      run.text += piece;
      run.chunks += 1;
      box.querySelector(".text").textContent = run.text;
    }
    if (choice.finish_reason) run.finish = choice.finish_reason;
  }
  if (chunk.usage) run.tokens = chunk.usage.completion_tokens;
  if (chunk.raging && chunk.raging.timing) run.timing = chunk.raging.timing;
  box.scrollIntoView({ block: "end" });
}

function fail(box, run, message) {
  box.classList.add("failed");
  run.finish = "error";
  const note = document.createElement("div");
  note.className = "error";
  note.textContent = message;
  box.append(note);
}

function showStats(box, run) {
  const stats = document.createElement("div");
  stats.className = "stats";
  const tokens = run.tokens !== null ? run.tokens : run.chunks;
  const parts = [`${tokens} tokens`];
  if (run.first !== null) {
    parts.push(`TTFT ${Math.round(run.first - run.started)} ms`);
    const decodeS = (run.ended - run.first) / 1000;
    if (tokens > 1 && decodeS > 0) parts.push(`${((tokens - 1) / decodeS).toFixed(1)} tok/s`);
  }
  if (run.finish) parts.push(run.finish);
  stats.textContent = parts.join(" · ");
  if (run.timing) stats.append(timingLine(run.timing));
  box.append(stats);
  box.scrollIntoView({ block: "end" });
}

// The per-stage timing the gateway adds when asked (X-Raging-Timing): name -> milliseconds.
function timingLine(timing) {
  const line = document.createElement("span");
  line.className = "timing";
  const entries = [];
  const collect = (prefix, value) => {
    if (typeof value === "number") {
      entries.push(prefix.endsWith("_ms") ? `${prefix.slice(0, -3)} ${value.toFixed(1)} ms`
                                          : `${prefix} ${value}`);  // a count, as resumed
    }
    else if (value && typeof value === "object") {
      for (const [name, inner] of Object.entries(value)) collect(prefix ? `${prefix}.${name}` : name, inner);
    }
  };
  collect("", timing);
  line.textContent = `stages: ${entries.join(" · ")}`;
  return line;
}

function stop() {
  if (inFlight) inFlight.abort();
}

function clearChat() {
  stop();
  chatNumber += 1;
  conversation.length = 0;
  $("messages").replaceChildren();
}

// ---- Cluster view

let polling = false;

async function pollCluster() {
  if (polling) return;
  polling = true;
  try {
    const response = await api("/v1/cluster");
    if (!response.ok) throw new Error(await errorMessage(response));
    renderCluster(await response.json());
    $("cluster-error").hidden = true;
  } catch (err) {
    $("cluster-error").textContent = `cluster view unavailable: ${err.message}`;
    $("cluster-error").hidden = false;
    $("health").textContent = err instanceof AuthError ? "needs a key" : "unreachable";
    $("health").className = "badge error";
  } finally {
    polling = false;
  }
}

function renderCluster(view) {
  $("health").textContent = view.status;
  $("health").className = `badge ${view.status}`;
  $("cluster-updated").textContent = `updated ${new Date(view.time * 1000).toLocaleTimeString()}`;
  const r = view.requests;
  setSummary($("summary"), [
    ["prefill", countRole(view, "prefill"), view.expected.prefill],
    ["decode", countRole(view, "decode"), view.expected.decode],
    ["in flight", r.in_flight], ["awaiting first token", r.awaiting_first_token],
    ["queued prompt tokens", r.queued_prompt_tokens],
  ]);
  $("workers").tBodies[0].replaceChildren(...view.workers.map(workerRow));
  renderLatency(view.latency);
  setSummary($("decisions"), Object.entries(view.decisions));
  renderEvents(view.events);
}

function countRole(view, role) {
  return view.workers.filter((w) => w.role === role).length;
}

// Label/value pairs as "label: value" (or "value / expected") items.
function setSummary(element, items) {
  element.replaceChildren(...items.map(([label, value, expected]) => {
    const item = document.createElement("span");
    const number = document.createElement("b");
    number.textContent = expected === undefined ? String(value) : `${value} / ${expected}`;
    item.append(`${label}: `, number);
    return item;
  }));
}

function cell(text, numeric = false) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "–" : String(text);
  if (numeric) td.className = "num";
  return td;
}

function workerRow(worker) {
  const row = document.createElement("tr");
  row.className = worker.state;
  row.dataset.workerId = worker.id;
  row.append(cell(worker.id), cell(worker.role), cell(worker.host || "?"), cell(worker.state),
             kvCell(worker), cell(worker.running, true), cell(worker.waiting, true),
             cell(worker.queued_tokens, true), cell(worker.requests, true),
             cell(`${worker.last_heartbeat_s.toFixed(1)} s ago`, true));
  return row;
}

function kvCell(worker) {
  const td = cell("");
  const used = worker.kv_blocks_used;
  const meter = document.createElement("span");
  meter.className = "meter";
  const fill = document.createElement("span");
  fill.style.width = `${used === null ? 0 : (100 * used) / worker.kv_blocks_total}%`;
  meter.append(fill);
  td.replaceChildren(meter, `${used === null ? "–" : used} / ${worker.kv_blocks_total}`);
  return td;
}

function renderLatency(latency) {
  $("window-min").textContent = String(Math.round(latency.window_s / 60));
  const show = (s) => (s.count ? `${s.mean_ms} ms mean, ${s.max_ms} max (${s.count})` : "none yet");
  setSummary($("latency"), [["TTFT", show(latency.ttft)], ["TPOT", show(latency.tpot)]]);
  drawChart($("latency-chart"), latency);
}

// Bars of each bucket's mean TTFT and TPOT, the newest at the right; each series is scaled to
// its own peak, which is written in the top left.
function drawChart(canvas, latency) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const slots = Math.round(latency.window_s / latency.bucket_s);
  const slot = canvas.width / slots;
  const newest = Math.floor(Date.now() / 1000 / latency.bucket_s);
  const series = [["ttft", "#2f6fde", 0], ["tpot", "#e07b00", 1]];
  ctx.font = "11px system-ui, sans-serif";
  for (const [name, color, offset] of series) {
    const points = latency.buckets.filter((b) => b[name].count);
    const peak = Math.max(...points.map((b) => b[name].mean_ms), 1);
    ctx.fillStyle = color;
    for (const bucket of points) {
      const age = newest - Math.round(bucket.start / latency.bucket_s);
      const height = (canvas.height - 20) * (bucket[name].mean_ms / peak);
      const left = canvas.width - (age + 1) * slot + offset * slot / 2;
      ctx.fillRect(left + 1, canvas.height - height, slot / 2 - 2, height);
    }
    if (points.length) ctx.fillText(`${name.toUpperCase()} peak ${peak.toFixed(0)} ms`, 4 + offset * 150, 12);
  }
}

function renderEvents(events) {
  $("events").replaceChildren(...events.slice().reverse().map((event) => {
    const item = document.createElement("li");
    item.className = event.kind;
    const when = new Date(event.at * 1000).toLocaleTimeString();
    const where = event.host ? ` on ${event.host}` : "";
    const why = event.detail ? `: ${event.detail}` : "";
    item.textContent = `${when} ${event.worker_id} (${event.role}${where}) ${event.kind}${why}`;
    return item;
  }));
}

// ---- Wiring

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", saveKey);
  $("compose").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    // An Enter that confirms an input method's conversion (Japanese, Chinese, Korean) is
    // not a send (keyCode 229: Safari's, as the composition ends).
    const composing = event.isComposing || event.keyCode === 229;
    if (event.key === "Enter" && !event.shiftKey && !composing) send(event);
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clearChat);
  if (apiKey()) $("key-status").textContent = "key set for this tab";
  loadModels();
  pollCluster();
  setInterval(pollCluster, POLL_MS);
});
