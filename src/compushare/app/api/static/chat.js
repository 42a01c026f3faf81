// CompuShare's chat page: conversations kept in this browser (localStorage), replies
// streamed from the node's OpenAI-compatible API (POST /v1/chat/completions with
// stream, read from fetch's body as server-sent events), the route of each reply.
// The token comes from the URL's fragment (/chat#token=...), which the browser never
// sends; it goes to the node only as Authorization: Bearer. Text that peers or the
// model wrote is only ever set as textContent, never as HTML.
"use strict";

const TOKEN = new URLSearchParams(location.hash.slice(1)).get("token") || "";
const STORE_KEY = "compushare.chats";
const CURRENT_KEY = "compushare.chat.current";
const SETTINGS_KEY = "compushare.chat.settings";
const PROMPT_HINT = "Message (Enter to send, Shift+Enter for a new line)";
const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

// -- conversations, kept in localStorage ----------------------------------------------

function loadChats() {
  try {
    const data = JSON.parse(localStorage.getItem(STORE_KEY) || "[]");
    return Array.isArray(data) ? data.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages)) : [];
  } catch (e) {
    return [];
  }
}

const state = {
  chats: loadChats(),  // newest first: {id, title, model, messages: [{role, content, meta}], updated}
  current: localStorage.getItem(CURRENT_KEY),
  models: [],  // /control/models
  defaultModel: "",
  controller: null,  // the AbortController of the reply streaming now
};

function saveChats() {
  try {
    localStorage.setItem(STORE_KEY, JSON.stringify(state.chats));
    localStorage.setItem(CURRENT_KEY, state.current || "");
  } catch (e) {
    showError("cannot save the conversations in this browser: " + e.message);
  }
}

function currentChat() {
  return state.chats.find((c) => c.id === state.current) || null;
}

function newChat() {
  const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  const chat = {id, title: "New chat", model: $("model").value || state.defaultModel, messages: [],
                updated: Date.now()};
  state.chats.unshift(chat);
  state.current = id;
  saveChats();
  return chat;
}

function switchChat(id) {
  if (state.controller) return;  // one reply at a time: stop it first
  state.current = id;
  const chat = currentChat();
  if (chat && chat.model && [...$("model").options].some((o) => o.value === chat.model)) {
    $("model").value = chat.model;
    modelChanged();
  }
  saveChats();
  render();
}

function deleteChat(id) {
  if (state.controller && id === state.current) return;
  state.chats = state.chats.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.chats.length ? state.chats[0].id : null;
  saveChats();
  render();
}

function touch(chat) {
  chat.updated = Date.now();
  state.chats = [chat, ...state.chats.filter((c) => c !== chat)];
  saveChats();
}

// -- rendering --------------------------------------------------------------------------

function renderChats() {
  const list = $("chats");
  list.replaceChildren();
  for (const chat of state.chats) {
    const item = el("li", undefined, chat.id === state.current ? "current" : "");
    item.dataset.id = chat.id;
    const title = el("span", chat.title || "New chat", "title");
    title.title = chat.title || "";
    const remove = el("button", "×", "delete");
    remove.type = "button";
    remove.title = "Delete this conversation";
    remove.setAttribute("aria-label", "Delete " + (chat.title || "conversation"));
    remove.addEventListener("click", (event) => { event.stopPropagation(); deleteChat(chat.id); });
    item.append(title, remove);
    item.addEventListener("click", () => switchChat(chat.id));
    list.append(item);
  }
}

function shortPeer(peer) {
  return peer.length > 16 ? peer.slice(0, 8) + "…" + peer.slice(-6) : peer;
}

function renderRoute(box, route) {
  box.replaceChildren();
  for (const hop of route || []) {
    const node = el("div", undefined, "hop" + (hop.private ? " private" : ""));
    const peer = el("span", hop.peer_id, "peer");
    peer.title = hop.peer_id;
    const reach = (hop.reach || "unknown") + (hop.relayed ? ", relayed" : "");
    node.append(el("span", "blocks " + hop.start + ":" + hop.end, "span"), peer,
                el("span", (hop.hardware || "?") + " · " + reach + (hop.private ? " · private" : ""), "detail"));
    node.title = "peer " + hop.peer_id + " computes blocks " + hop.start + ":" + hop.end;
    box.append(node);
  }
}

function statsText(meta) {
  const parts = [];
  const page = meta.page || {};
  if (page.first_token_s != null) parts.push("first token " + page.first_token_s.toFixed(2) + " s");
  if (page.tok_s != null) parts.push(page.tok_s.toFixed(1) + " tokens/s");
  if (page.tokens != null) parts.push(page.tokens + " tokens");
  const s = meta.stats;
  if (s) {
    const server = ["server: first token " + Number(s.first_token_s).toFixed(2) + " s",
                    Number(s.decode_tok_s).toFixed(1) + " tokens/s", s.tokens + " tokens"];
    if (s.failovers) server.push(s.failovers + " failovers");
    if (s.standby_takeovers) server.push(s.standby_takeovers + " standby takeovers");
    if (s.private) server.push("private");
    parts.push(server.join(", "));
  }
  return parts.join(" · ");
}

// A reply that is a JSON document (a reply format asked for one), indented; else its text.
function shownContent(message) {
  if (message.role !== "assistant" || !(message.meta && message.meta.format)) return message.content;
  try { return JSON.stringify(JSON.parse(message.content), null, 2); } catch (e) { return message.content; }
}

// Tool calls as a person reads them: name(arguments), one per line.
function renderCalls(box, calls) {
  box.replaceChildren();
  for (const call of calls || []) {
    let args = call.function.arguments;
    try { args = JSON.stringify(JSON.parse(args), null, 1).replace(/\n\s*/g, " "); } catch (e) { /* as streamed so far */ }
    box.append(el("div", "calls " + call.function.name + "(" + args + ")", "call"));
  }
  box.hidden = !(calls && calls.length);
}

function messageNode(message) {
  const node = el("div", undefined, "msg " + message.role);
  if (message.role === "tool") node.append(el("div", "result of " + (message.name || "the tool"), "status"));
  node.append(el("div", shownContent(message), "content" + (message.meta && message.meta.format ? " json" : "")));
  const calls = el("div", undefined, "tool-calls");
  renderCalls(calls, message.tool_calls);
  node.append(calls);
  if (message.role === "assistant") {
    const meta = message.meta || {};
    node.dataset.state = meta.state || "done";
    const status = el("div", meta.error || (meta.state === "stopped" ? "stopped" : ""), "status");
    const route = el("div", undefined, "route");
    renderRoute(route, meta.route);
    node.append(status, route, el("div", statsText(meta), "stats"));
    if (meta.model) node.title = "model " + meta.model;
  }
  return node;
}

function render() {
  renderChats();
  const chat = currentChat();
  const box = $("messages");
  box.replaceChildren();
  if (!chat || !chat.messages.length) {
    box.append(el("p", "Ask the swarm something. Replies stream token by token; the route under each reply " +
                       "shows which peers computed which blocks.", "note"));
  } else {
    for (const message of chat.messages) box.append(messageNode(message));
    box.scrollTop = box.scrollHeight;
  }
  updateButtons();
}

function updateButtons() {
  const busy = state.controller !== null;
  const chat = currentChat();
  const last = chat && chat.messages[chat.messages.length - 1];
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  $("regenerate").disabled = busy || !last || last.role !== "assistant";
  $("new-chat").disabled = busy;
}

function showError(text) {
  const box = $("error");
  box.textContent = text || "";
  box.hidden = !text;
}

// -- models and settings ------------------------------------------------------------------

async function api(path, options = {}) {
  const headers = Object.assign({"Authorization": "Bearer " + TOKEN}, options.headers || {});
  return fetch(path, Object.assign({}, options, {headers}));
}

async function errorOf(response) {
  try {
    const body = await response.json();
    if (body && body.error) return typeof body.error === "string" ? body.error : body.error.message;
  } catch (e) { /* not JSON */ }
  return "HTTP " + response.status + " " + response.statusText;
}

function selectedModel() {
  return state.models.find((m) => m.name === $("model").value) || null;
}

function modelChanged() {
  const model = selectedModel();
  const adapters = (model && model.adapters) || [];
  const picker = $("adapter");
  const kept = picker.value;
  picker.replaceChildren(el("option", "none"));
  picker.options[0].value = "";
  for (const name of adapters) {
    const option = el("option", name);
    option.value = name;
    picker.append(option);
  }
  picker.value = adapters.includes(kept) ? kept : "";
  $("adapter-label").hidden = !adapters.length;
  const notes = [];
  if (model) {
    notes.push(model.num_blocks + " blocks");
    if (!model.complete) notes.push("not every block has a server now");
    if (!model.private) notes.push("no provider offers private sessions");
  }
  $("model-note").textContent = notes.join(" · ");
  const chat = currentChat();
  if (chat && !state.controller && chat.model !== $("model").value) {
    chat.model = $("model").value;
    saveChats();
  }
}

async function loadModels() {
  const response = await api("/control/models");
  if (!response.ok) throw new Error(await errorOf(response));
  const body = await response.json();
  state.models = body.models || [];
  state.defaultModel = body.default || "";
  const picker = $("model");
  const kept = picker.value || (currentChat() && currentChat().model) || state.defaultModel;
  picker.replaceChildren();
  for (const model of state.models) {
    const flags = [model.served ? (model.complete ? "" : "some blocks unserved") : "not served now",
                   model.private ? "private mode offered" : ""].filter(Boolean);
    const option = el("option", model.name + (flags.length ? " (" + flags.join(", ") + ")" : ""));
    option.value = model.name;
    option.title = model.id;
    option.dataset.id = model.id;
    picker.append(option);
  }
  if (state.models.some((m) => m.name === kept)) picker.value = kept;
  modelChanged();
}

function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {}; } catch (e) { saved = {}; }
  for (const id of ["temperature", "top-p", "max-tokens", "reply-format", "schema", "tools"]) {
    if (saved[id] != null) $(id).value = saved[id];
  }
  for (const id of ["private", "standby"]) $(id).checked = Boolean(saved[id]);
  showSettings();
}

function showSettings() {
  $("temperature-value").textContent = Number($("temperature").value).toFixed(2);
  $("top-p-value").textContent = Number($("top-p").value).toFixed(2);
  const saved = {};
  for (const id of ["temperature", "top-p", "max-tokens", "reply-format", "schema", "tools"]) saved[id] = $(id).value;
  for (const id of ["private", "standby"]) saved[id] = $(id).checked;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(saved));
}

// The message as the API takes it: an assistant's tool calls, a tool result's call id.
function apiMessage(m) {
  const out = {role: m.role, content: m.content};
  if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
  if (m.tool_call_id) out.tool_call_id = m.tool_call_id;
  return out;
}

// The JSON of a settings field (tools, a schema), or an error naming it.
function jsonSetting(id, what) {
  try { return JSON.parse($(id).value); } catch (e) { throw new Error(what + " is not JSON: " + e.message); }
}

function requestBody(chat) {
  const body = {
    model: $("model").value || undefined,
    // A failed or empty reply is not part of what the model is asked to go on from.
    messages: chat.messages.filter((m) => m.role !== "assistant" ||
                                          ((m.content || (m.tool_calls || []).length) && !(m.meta && m.meta.error)))
      .map(apiMessage),
    stream: true, route: true,
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Math.max(1, Math.min(4096, Math.round(Number($("max-tokens").value) || 256))),
  };
  if ($("private").checked) body.private = true;
  if ($("standby").checked) body.standby = true;
  if ($("adapter").value) body.adapter = $("adapter").value;
  const format = $("reply-format").value;
  if (format === "json_object") body.response_format = {type: "json_object"};
  if (format === "json_schema") {
    body.response_format = {type: "json_schema", json_schema: {name: "reply", schema: jsonSetting("schema", "The JSON schema")}};
  }
  if ($("tools").value.trim()) body.tools = jsonSetting("tools", "The tools");
  return body;
}

// The calls of the last reply that no tool message answers yet (the next message answers the first).
function unansweredCall(chat) {
  const answered = new Set(chat.messages.filter((m) => m.role === "tool").map((m) => m.tool_call_id));
  const last = [...chat.messages].reverse().find((m) => m.role === "assistant");
  return ((last && last.tool_calls) || []).find((c) => !answered.has(c.id));
}

// -- streaming a reply ---------------------------------------------------------------------

// The server-sent events of a response body, one parsed `data:` payload at a time.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), {stream: !done});
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
    if (done) return;
  }
}

async function streamReply(chat) {
  let request;
  try { request = requestBody(chat); } catch (e) { showError(e.message); return; }
  const body = JSON.stringify(request);
  const message = {role: "assistant", content: "",
                   meta: {state: "streaming", model: $("model").value, route: [], page: {},
                          format: request.response_format ? request.response_format.type : undefined}};
  chat.messages.push(message);
  touch(chat);
  render();
  const node = $("messages").lastElementChild;
  const content = node.querySelector(".content");
  const callsBox = node.querySelector(".tool-calls");
  const status = node.querySelector(".status");
  const route = node.querySelector(".route");
  const stats = node.querySelector(".stats");
  const meta = message.meta;
  const controller = state.controller = new AbortController();
  updateButtons();
  status.textContent = "waiting for the swarm…";
  const sent = performance.now();
  let first = null, last = null, pieces = 0;
  const pageStats = () => {
    meta.page = {tokens: pieces};
    if (first !== null) meta.page.first_token_s = (first - sent) / 1000;
    if (pieces > 1 && last > first) meta.page.tok_s = (pieces - 1) / ((last - first) / 1000);
    stats.textContent = statsText(meta);
  };
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body, signal: controller.signal});
    if (!response.ok) throw new Error(await errorOf(response));
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(typeof chunk.error === "string" ? chunk.error : chunk.error.message);
      const extension = chunk.compushare;
      if (extension && extension.route) {
        meta.route = extension.route;
        renderRoute(route, meta.route);
      }
      if (extension && extension.stats) meta.stats = extension.stats;
      const choice = (chunk.choices || [])[0];
      for (const delta of (choice && choice.delta && choice.delta.tool_calls) || []) {
        message.tool_calls = message.tool_calls || [];
        const call = message.tool_calls[delta.index] = message.tool_calls[delta.index] ||
          {id: delta.id, type: "function", function: {name: "", arguments: ""}};
        if (delta.function && delta.function.name) call.function.name += delta.function.name;
        if (delta.function && delta.function.arguments) call.function.arguments += delta.function.arguments;
        renderCalls(callsBox, message.tool_calls);
        if (first === null) { first = performance.now(); status.textContent = ""; }
      }
      const text = choice && choice.delta && choice.delta.content;
      if (text) {
        last = performance.now();
        if (first === null) { first = last; status.textContent = ""; }
        pieces += 1;
        message.content += text;
        content.textContent = message.content;
        if (pieces % 8 === 1) pageStats();
        const box = $("messages");
        if (box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
      }
      if (choice && choice.finish_reason) meta.finish_reason = choice.finish_reason;
    }
    meta.state = "done";
    status.textContent = meta.finish_reason === "length" ? "stopped at max tokens" : "";
    content.textContent = shownContent(message);
    const call = meta.finish_reason === "tool_calls" && unansweredCall(chat);
    if (call) $("prompt").placeholder = "The result of " + call.function.name + " (sent as the tool's answer)";
  } catch (e) {
    if (controller.signal.aborted) {
      meta.state = "stopped";
      status.textContent = "stopped";
    } else {
      meta.state = "error";
      meta.error = e.message || String(e);
      status.textContent = meta.error;
      showError(meta.error);
    }
  } finally {
    state.controller = null;
    pageStats();
    node.dataset.state = meta.state;
    touch(chat);
    updateButtons();
  }
}

async function send(event) {
  if (event) event.preventDefault();
  if (state.controller) return;
  const text = $("prompt").value.trim();
  if (!text) return;
  showError("");
  const chat = currentChat() || newChat();
  if (!chat.messages.length) chat.title = text.length > 48 ? text.slice(0, 47) + "…" : text;
  chat.model = $("model").value;
  const call = unansweredCall(chat);  // a reply that called a tool: this message is its result
  chat.messages.push(call ? {role: "tool", content: text, tool_call_id: call.id, name: call.function.name}
                          : {role: "user", content: text});
  $("prompt").value = "";
  $("prompt").placeholder = PROMPT_HINT;
  await streamReply(chat);
}

async function regenerate() {
  const chat = currentChat();
  if (state.controller || !chat) return;
  while (chat.messages.length && chat.messages[chat.messages.length - 1].role === "assistant") chat.messages.pop();
  if (!chat.messages.length) return;
  showError("");
  await streamReply(chat);
}

function stop() {
  if (state.controller) state.controller.abort();  // the node cancels the generation when we hang up
}

// -- start ----------------------------------------------------------------------------------

function start() {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => { if (!state.controller) { newChat(); render(); } });
  $("model").addEventListener("change", modelChanged);
  for (const id of ["temperature", "top-p", "max-tokens", "private", "standby", "reply-format", "schema", "tools"]) {
    $(id).addEventListener("input", showSettings);
    $(id).addEventListener("change", showSettings);
  }
  $("dashboard-link").href = "/dashboard" + location.hash;
  loadSettings();
  if (!currentChat()) state.current = state.chats.length ? state.chats[0].id : null;
  render();
  if (!TOKEN) {
    showError("no token: open this page as /chat#token=<the token in the node's data dir, api.token>");
    return;
  }
  loadModels().catch((e) => showError("cannot list the models: " + e.message));
}

start();
