// The chat playground: streams /v1/chat/completions (fetch + ReadableStream, SSE framing)
// and renders each delta as it arrives; every reply shows its TTFT and decode speed.
"use strict";

const $ = (id) => document.getElementById(id);
const turns = []; // this conversation's {role, content} messages, system prompt excluded
let controller = null; // aborts the reply in flight (Stop)
let conversation = 0; // bumped by New chat, so a reply cut off by it is not kept

function setStatus(text, bad) {
  $("chat-status").textContent = text;
  $("chat-status").classList.toggle("bad", Boolean(bad));
}

async function loadModels() {
  try {
    const response = await apiFetch("/v1/models");
    if (!response.ok) {
      setStatus(`cannot list models: ${await errorText(response)}`, true);
      return;
    }
    const models = (await response.json()).data.map((m) => m.id);
    const select = $("model");
    select.replaceChildren(...models.map((id) => new Option(id, id)));
    $("model-name").textContent = models[0] || "";
    setStatus("", false);
  } catch (err) {
    setStatus(`cannot reach the server: ${err.message}`, true);
  }
}

function addMessage(role, text) {
  const empty = $("messages").querySelector(".empty");
  if (empty) empty.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  el.append(label, content, meta);
  $("messages").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

// The sampling fields the user filled in, by their OpenAI names.
function samplingFields() {
  const fields = {};
  const number = (id) => {
    const raw = $(id).value.trim();
    return raw === "" ? null : Number(raw);
  };
  for (const [name, id] of [
    ["temperature", "temperature"], ["top_p", "top-p"], ["top_k", "top-k"],
    ["max_tokens", "max-tokens"], ["seed", "seed"],
  ]) {
    const value = number(id);
    if (value !== null && !Number.isNaN(value)) fields[name] = value;
  }
  const stop = $("stop-seq").value;
  if (stop) fields.stop = [stop];
  return fields;
}

// Yields each `data:` payload of a server-sent-event stream, parsed, until [DONE].
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// Reply stats: TTFT is send -> first content; tokens/s is the decode rate after it.
function showReplyStats(reply, stats) {
  const { start, firstAt, lastAt, tokens, finish } = stats;
  const parts = [];
  if (firstAt !== null) {
    const ttft = firstAt - start;
    reply.dataset.ttftMs = ttft.toFixed(1);
    parts.push(`TTFT ${formatNumber(ttft)} ms`);
  }
  if (tokens > 1 && lastAt > firstAt) {
    const rate = (tokens - 1) / ((lastAt - firstAt) / 1000);
    reply.dataset.tokensPerS = rate.toFixed(2);
    parts.push(`${formatNumber(rate, 1)} tokens/s`);
  }
  reply.dataset.completionTokens = String(tokens);
  parts.push(`${tokens} tokens`);
  if (finish) parts.push(`finish: ${finish}`);
  reply.querySelector(".meta").textContent = parts.join(" · ");
  reply.querySelector(".meta").title =
    "TTFT: from sending to the first streamed token; tokens/s: generation speed after it";
}

async function send(text) {
  const mine = conversation;
  const system = $("system-prompt").value.trim();
  turns.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.classList.add("streaming");
  const content = reply.querySelector(".content");
  const body = Object.assign({
    model: $("model").value || undefined,
    messages: (system ? [{ role: "system", content: system }] : []).concat(turns),
    stream: true,
    stream_options: { include_usage: true },
  }, samplingFields());
  const stats = { start: performance.now(), firstAt: null, lastAt: null, tokens: 0, finish: null };
  let answer = "";
  let chunks = 0;
  controller = new AbortController();
  setBusy(true);
  setStatus("generating…", false);
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const event of sseEvents(response)) {
      if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
      if (event.usage) stats.tokens = event.usage.completion_tokens;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      if (choice.finish_reason) stats.finish = choice.finish_reason;
      const delta = choice.delta && choice.delta.content;
      if (!delta) continue;
      const now = performance.now();
      if (stats.firstAt === null) stats.firstAt = now;
      stats.lastAt = now;
      answer += delta;
      chunks += 1;
      content.textContent = answer;
      reply.dataset.chunks = String(chunks);
      reply.scrollIntoView({ block: "end" });
    }
    turns.push({ role: "assistant", content: answer });
    stats.tokens = stats.tokens || chunks;
    showReplyStats(reply, stats);
    setStatus("", false);
  } catch (err) {
    if (err.name === "AbortError") {
      if (mine === conversation) turns.push({ role: "assistant", content: answer });
      stats.tokens = chunks;
      stats.finish = "stopped";
      showReplyStats(reply, stats);
      setStatus("stopped", false);
    } else {
      turns.pop(); // the failed turn leaves the conversation as it was
      reply.classList.add("error");
      reply.querySelector(".meta").textContent = err.message;
      setStatus("the request failed", true);
    }
  } finally {
    controller = null;
    reply.classList.remove("streaming");
    reply.classList.add("done");
    setBusy(false);
  }
}

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("user-input").value.trim();
  if (!text || controller) return;
  $("user-input").value = "";
  send(text);
});
$("user-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  conversation += 1;
  if (controller) controller.abort();
  turns.length = 0;
  $("messages").replaceChildren();
  setStatus("", false);
});
initKeyBar(loadModels);
loadModels();
