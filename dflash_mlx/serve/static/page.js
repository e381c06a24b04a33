// The chat page: streams replies from this server's /v1/chat/completions and marks each
// piece of a reply by where it came from (the chunks' dflash.sources): text the target
// accepted from the drafter's drafts, or the target's own token of each verify cycle.
"use strict";

const $ = (id) => document.getElementById(id);
let conversation = [];  // the messages so far, as the API takes them
let key = sessionStorage.getItem("dflash-mlx-key") || "";

function headers() {
  const sent = { "Content-Type": "application/json" };
  if (key) sent.Authorization = `Bearer ${key}`;
  return sent;
}

function askForKey() {
  $("key-field").hidden = false;
  $("key").focus();
}

async function showModel() {
  const response = await fetch("v1/models", { headers: headers() });
  if (response.status === 401) return askForKey();
  if (response.ok) $("model").textContent = (await response.json()).data[0].id;
}

function addTurn(role) {
  const root = document.createElement("div");
  root.className = `turn ${role}`;
  for (const part of ["who", "reasoning", "text", "info"]) {
    const element = document.createElement("div");
    element.className = part;
    root.append(element);
  }
  root.querySelector(".who").textContent = role === "user" ? "you" : "model";
  $("log").append(root);
  return root;
}

// Add `text` to `element` in a span of its source's class, joining the last span if alike.
function append(element, text, source) {
  const last = element.lastElementChild;
  if (last && last.className === source) {
    last.textContent += text;
  } else {
    const span = document.createElement("span");
    span.className = source;
    span.textContent = text;
    element.append(span);
  }
}

function showStats(stats) {
  if (stats.tau === undefined) return;
  $("tau").textContent = stats.tau.toFixed(2);
  $("tps").textContent = stats.generation_tps.toFixed(1);
  $("tokens").textContent = stats.generation_tokens;
  $("accepted").textContent = stats.accepted;
  $("strategy").textContent = stats.strategy ?? "";
}

// The server-sent events of a streamed response, as parsed JSON, until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") return;
        yield JSON.parse(line.slice(6));
      }
    }
  }
}

async function ask(question) {
  const drafting = $("draft").checked;
  addTurn("user").querySelector(".text").textContent = question;
  const turn = addTurn("assistant");
  turn.dataset.state = "streaming";
  turn.dataset.drafting = drafting;
  const text = turn.querySelector(".text");
  const messages = [...conversation, { role: "user", content: question }];
  const body = { messages, stream: true };
  if ($("max-tokens").value) body.max_tokens = Number($("max-tokens").value);
  if (!drafting) body.dflash = { draft: false };
  let reply = "";
  let last = {};
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body),
    });
    if (!response.ok) {
      if (response.status === 401) askForKey();
      const refusal = await response.json().catch(() => ({}));
      throw new Error(refusal.error?.message || `HTTP ${response.status}`);
    }
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices?.[0]?.delta ?? {};
      if (delta.reasoning) turn.querySelector(".reasoning").textContent += delta.reasoning;
      reply += delta.content ?? "";
      const sources = chunk.dflash?.sources ?? [[delta.content ?? "", "target"]];
      for (const [piece, source] of sources) if (piece) append(text, piece, source);
      if (chunk.dflash) showStats((last = chunk.dflash));
      $("log").scrollTop = $("log").scrollHeight;
    }
    conversation = [...messages, { role: "assistant", content: reply }];
    const mode = drafting ? "drafting" : "drafting off";
    turn.querySelector(".info").textContent =
      `${mode}: τ ${last.tau?.toFixed(2)}, ${last.generation_tps?.toFixed(1)} tok/s, ` +
      `${last.generation_tokens} tokens, ${last.accepted} from drafts (${last.strategy})`;
    turn.dataset.state = "done";
  } catch (error) {
    turn.classList.add("error");
    append(text, ` ${error.message}`, "error");
    turn.dataset.state = "error";
  }
}

$("ask").addEventListener("submit", async (event) => {
  event.preventDefault();
  const question = $("prompt").value.trim();
  if (!question || $("send").disabled) return;
  $("prompt").value = "";
  $("send").disabled = true;
  try {
    await ask(question);
  } finally {
    $("send").disabled = false;
  }
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("ask").requestSubmit();
  }
});
$("key").addEventListener("change", () => {
  key = $("key").value.trim();
  sessionStorage.setItem("dflash-mlx-key", key);
  showModel();
});
$("clear").addEventListener("click", () => {
  conversation = [];
  $("log").replaceChildren();
});
showModel();
