// Shared by the playground and the dashboard: the API key and fetch calls that carry it.
// The key stays in this browser (localStorage); it is sent only to this server, as
// `Authorization: Bearer <key>`, which the server asks for when started with --api-key.
"use strict";

const KEY_STORAGE = "kvserve-api-key";
const PAGES = [["playground", "/", "Playground"], ["dashboard", "/dashboard", "Dashboard"]];

// The header both pages share: brand, page links, the model name and the API key form.
(function renderHeader() {
  const header = document.querySelector("header");
  const nav = PAGES.map(([page, href, title]) => {
    const active = page === header.dataset.page ? ' class="active"' : "";
    return `<a href="${href}"${active}>${title}</a>`;
  }).join("");
  header.innerHTML = `
    <span class="brand">kvserve</span>
    <nav>${nav}</nav>
    <span id="model-name"></span>
    <form id="key-form" class="key-bar">
      <label for="key-input">API key</label>
      <input id="key-input" type="password" autocomplete="off" placeholder="if started with --api-key">
      <button id="key-save" type="submit" class="secondary">Use key</button>
      <span id="key-msg"></span>
    </form>`;
})();

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

function apiHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

// fetch() with the key; a 401 marks the key bar so the user sees what is missing.
async function apiFetch(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = apiHeaders(opts.headers);
  const response = await fetch(path, opts);
  showKeyNeeded(response.status === 401);
  return response;
}

// One line from an error response (OpenAI's {"error": {"message": ...}} shape or text).
async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) {
    // not JSON: fall through to the raw text
  }
  return `${response.status}: ${text || response.statusText}`;
}

function showKeyNeeded(needed) {
  const bar = document.getElementById("key-form");
  bar.classList.toggle("needed", needed);
  document.getElementById("key-msg").textContent = needed
    ? (apiKey() ? "key rejected" : "this server needs an API key")
    : "";
}

// Wires the header's key form; onChange runs after the user sets or clears the key.
function initKeyBar(onChange) {
  const input = document.getElementById("key-input");
  input.value = apiKey();
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = input.value.trim();
    if (value) localStorage.setItem(KEY_STORAGE, value);
    else localStorage.removeItem(KEY_STORAGE);
    showKeyNeeded(false);
    onChange();
  });
}

function formatNumber(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toLocaleString("en-US", {
    maximumFractionDigits: digits === undefined ? 0 : digits,
    minimumFractionDigits: digits === undefined ? 0 : digits,
  });
}

function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = Number(bytes) || 0;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${formatNumber(value, unit ? 1 : 0)} ${units[unit]}`;
}
