// Strata's chat page: plain JavaScript, no dependency, no build step. Every text from the server or the
// model is put in the page with textContent (never as HTML), so a reply or title holding markup does nothing.
"use strict";

const KEY_STORE = "strata.apiKey";
const PAGE = 20;
const $ = (id) => document.getElementById(id);

const state = {
  key: localStorage.getItem(KEY_STORE) || "",
  currentId: null,
  messages: [], // the open conversation as chat messages ({role, content})
  controller: null, // the streaming request's AbortController
  offset: 0,
  query: "",
};

// --- requests ---------------------------------------------------------------------------------

let keyWaiters = [];

function askKey(message) {
  return new Promise((resolve) => {
    keyWaiters.push(resolve);
    $("key-error").textContent = message || "";
    if (!$("key-dialog").open) $("key-dialog").showModal();
    $("key-input").focus();
  });
}

async function api(path, options = {}) {
  for (;;) {
    const headers = Object.assign({}, options.headers || {});
    if (state.key) headers.Authorization = "Bearer " + state.key;
    const response = await fetch(path, Object.assign({}, options, { headers }));
    if (response.status !== 401) return response;
    // Asked until a key works: every request waiting for it goes on with the same key.
    await askKey(state.key ? "That key was refused." : "");
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return "HTTP " + response.status;
}

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").classList.toggle("error", Boolean(isError));
}

// --- rendering (text only) ----------------------------------------------------------------------

function renderBody(target, text) {
  // ``` fences become code blocks; everything else stays plain text (no links, no HTML).
  target.replaceChildren();
  const parts = text.split("```");
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      const newline = part.indexOf("\n");
      code.textContent = newline >= 0 && /^[\w+-]*$/.test(part.slice(0, newline)) ? part.slice(newline + 1) : part;
      pre.appendChild(code);
      target.appendChild(pre);
    } else if (part) {
      const span = document.createElement("span");
      span.textContent = part;
      target.appendChild(span);
    }
  });
}

function addMessage(role, content) {
  const li = document.createElement("li");
  li.className = role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  renderBody(body, content);
  const stats = document.createElement("div");
  stats.className = "stats";
  li.append(label, body, stats);
  $("messages").appendChild(li);
  li.scrollIntoView({ block: "end" });
  return li;
}

function showConversation() {
  $("messages").replaceChildren();
  for (const m of state.messages) addMessage(m.role, m.content);
}

function formatBytes(n) {
  const units = ["B", "kB", "MB", "GB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function formatWhen(seconds) {
  const age = Date.now() / 1000 - seconds;
  if (age < 60) return "just now";
  if (age < 3600) return Math.round(age / 60) + " min ago";
  if (age < 86400) return Math.round(age / 3600) + " h ago";
  return new Date(seconds * 1000).toLocaleString();
}

function conversationItem(c) {
  const li = document.createElement("li");
  li.dataset.id = c.id;
  if (c.id === state.currentId) li.classList.add("current");
  const title = document.createElement("button");
  title.type = "button";
  title.className = "title";
  title.textContent = c.title || "(empty)";
  title.addEventListener("click", () => openConversation(c.id));
  const meta = document.createElement("div");
  meta.className = "muted";
  const turns = c.n_messages === null ? "" : c.n_messages + " messages · ";
  meta.textContent = turns + c.n_tokens + " tokens · " + formatBytes(c.n_bytes) + " · " + formatWhen(c.used_at) + " · " + c.where.join(", ");
  const actions = document.createElement("div");
  actions.className = "actions";
  const download = document.createElement("button");
  download.type = "button";
  download.textContent = "Download";
  download.addEventListener("click", () => downloadConversation(c.id));
  const rename = document.createElement("button");
  rename.type = "button";
  rename.className = "rename";
  rename.textContent = "Rename";
  rename.addEventListener("click", () => renameConversation(c.id, c.title));
  const remove = document.createElement("button");
  remove.type = "button";
  remove.className = "delete";
  remove.textContent = "Delete";
  remove.addEventListener("click", () => deleteConversation(c.id, c.title));
  actions.append(rename, download, remove);
  li.append(title, meta, actions);
  return li;
}

// --- the list -----------------------------------------------------------------------------------

async function loadList(append) {
  if (!append) state.offset = 0;
  const params = new URLSearchParams({ offset: String(state.offset), limit: String(PAGE) });
  if (state.query) params.set("q", state.query);
  const response = await api("/conversations?" + params);
  if (!response.ok) {
    $("list-note").textContent = await errorText(response);
    $("conversations").replaceChildren();
    $("more").hidden = true;
    return;
  }
  const page = await response.json();
  const items = page.conversations.map(conversationItem);
  if (append) $("conversations").append(...items); else $("conversations").replaceChildren(...items);
  // A page may hold fewer than asked: an object refused when read is left out of it (the rows stay counted).
  state.offset = Math.min(page.total, page.offset + page.limit);
  $("more").hidden = state.offset >= page.total;
  $("list-note").textContent = (page.total ? page.total + " kept" : "No kept conversations yet.") +
    (page.partial ? " (the search read the newest objects of the store only)" : "");
}

async function openConversation(id) {
  stop();
  const response = await api("/conversations/" + encodeURIComponent(id));
  if (!response.ok) { setStatus(await errorText(response), true); return; }
  const c = await response.json();
  state.currentId = c.id;
  state.messages = c.messages ? c.messages.filter((m) => m.content !== "" || m.role !== "assistant") : [];
  showConversation();
  if (!c.messages) addMessage("text", c.text);
  $("meta").textContent = c.title + " · " + c.n_tokens + " tokens kept (" + c.where.join(", ") + ")";
  for (const li of $("conversations").children) li.classList.toggle("current", li.dataset.id === c.id);
  closeListOnNarrow();
  $("input").focus();
}

async function deleteConversation(id, title) {
  if (!confirm("Delete “" + title + "”? Its session file is removed.")) return;
  const response = await api("/conversations/" + encodeURIComponent(id), { method: "DELETE" });
  if (!response.ok) { setStatus(await errorText(response), true); return; }
  if (state.currentId === id) newChat();
  setStatus("Deleted.");
  loadList(false);
}

async function renameConversation(id, title) {
  const wanted = prompt("New title:", title);
  if (wanted === null || !wanted.trim()) return;
  const response = await api("/conversations/" + encodeURIComponent(id), {
    method: "PATCH",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ title: wanted }),
  });
  if (!response.ok) { setStatus(await errorText(response), true); return; }
  setStatus("Renamed.");
  loadList(false);
}

async function downloadConversation(id) {
  const response = await api("/conversations/" + encodeURIComponent(id) + "/file");
  if (!response.ok) { setStatus(await errorText(response), true); return; }
  const url = URL.createObjectURL(await response.blob());
  const a = document.createElement("a");
  a.href = url;
  a.download = id + ".ssf";
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

async function uploadFile(file) {
  setStatus("Uploading " + file.name + "…");
  const response = await api("/conversations", {
    method: "POST",
    headers: { "Content-Type": "application/octet-stream" },
    body: file,
  });
  if (!response.ok) { setStatus("Upload refused: " + (await errorText(response)), true); return; }
  const c = await response.json();
  setStatus(c.created ? "Uploaded." : "Already kept.");
  await loadList(false);
  await openConversation(c.id);
}

function newChat() {
  stop();
  state.currentId = null;
  state.messages = [];
  $("messages").replaceChildren();
  $("meta").textContent = "";
  for (const li of $("conversations").children) li.classList.remove("current");
  $("input").focus();
}

// --- chatting -----------------------------------------------------------------------------------

function number(id) {
  const value = parseFloat($(id).value);
  return Number.isFinite(value) ? value : undefined;
}

function showProgress(p) {
  const done = p.total ? p.processed / p.total : 0;
  $("progress").hidden = false;
  $("progress-bar").style.width = Math.round(done * 100) + "%";
  $("progress-text").textContent = "prompt " + p.processed + " / " + p.total + " tokens (" + p.cache + " restored or reused)";
}

function statsText(t) {
  const parts = [];
  if (t.cache_n !== undefined) parts.push(t.cache_n + " tokens restored or reused");
  if (t.prompt_n !== undefined) parts.push(t.prompt_n + " prompt tokens in " + Math.round(t.prompt_ms || 0) + " ms");
  if (t.predicted_n !== undefined) parts.push(t.predicted_n + " tokens at " + (t.predicted_per_second || 0).toFixed(1) + " tok/s");
  return parts.join(" · ");
}

async function send(text) {
  if (state.controller) return;
  if (!state.messages.length && $("system").value.trim()) {
    state.messages.push({ role: "system", content: $("system").value.trim() });
    addMessage("system", state.messages[0].content);
  }
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  const body = reply.querySelector(".body");
  const stats = reply.querySelector(".stats");
  let content = "";
  const controller = new AbortController();
  state.controller = controller;
  $("send").hidden = true;
  $("stop").hidden = false;
  setStatus("Generating…");
  const request = {
    messages: state.messages,
    stream: true,
    return_progress: true,
    temperature: number("temperature"),
    top_k: number("top_k"),
    top_p: number("top_p"),
    min_p: number("min_p"),
    max_tokens: number("max_tokens"),
  };
  let stopped = false;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(request),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of frame.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || "error");
          if (chunk.prompt_progress) showProgress(chunk.prompt_progress);
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.content) {
            $("progress").hidden = true;
            content += delta.content;
            renderBody(body, content);
            reply.scrollIntoView({ block: "end" });
          }
          if (chunk.timings) {
            stats.textContent = statsText(chunk.timings);
            reply.scrollIntoView({ block: "end" });
          }
        }
      }
    }
    setStatus("");
  } catch (e) {
    if (controller.signal.aborted) { stopped = true; setStatus("Stopped."); }
    else setStatus(String(e.message || e), true);
  } finally {
    $("progress").hidden = true;
    state.controller = null;
    $("send").hidden = false;
    $("stop").hidden = true;
  }
  if (stopped) stats.textContent = "stopped";
  reply.dataset.done = stopped ? "stopped" : "done";
  if (content) state.messages.push({ role: "assistant", content });
  else if (!stopped) state.messages.pop();
  setTimeout(() => loadList(false), 1500);
}

function stop() {
  if (state.controller) state.controller.abort();
}

function closeListOnNarrow() {
  if (window.matchMedia("(max-width: 700px)").matches) $("sidebar").classList.add("closed");
}

// --- start ------------------------------------------------------------------------------------

async function loadProps() {
  const response = await api("/props");
  if (!response.ok) { setStatus(await errorText(response), true); return; }
  const props = await response.json();
  const model = String(props.model_alias || props.model_path || "").split("/").pop();
  const nCtx = props.default_generation_settings && props.default_generation_settings.n_ctx;
  $("model").textContent = model + (nCtx ? " · context " + nCtx : "");
}

function start() {
  $("key-form").addEventListener("submit", () => {
    state.key = $("key-input").value.trim();
    localStorage.setItem(KEY_STORE, state.key);
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve());
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("input").value;
    if (!text.trim() || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.controller) { event.preventDefault(); stop(); }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("more").addEventListener("click", () => loadList(true));
  $("toggle-list").addEventListener("click", () => $("sidebar").classList.toggle("closed"));
  let timer = null;
  $("search").addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => { state.query = $("search").value.trim(); loadList(false); }, 250);
  });
  $("upload").addEventListener("change", () => {
    const file = $("upload").files[0];
    $("upload").value = "";
    if (file) uploadFile(file);
  });
  loadProps().then(() => loadList(false));
}

document.addEventListener("DOMContentLoaded", start);
