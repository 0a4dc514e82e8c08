// The chat page: conversations (kept in this browser), a composer with pictures and sound, streamed answers.

import { ApiError, listModels, streamChat } from "./api.js";
import { render } from "./markdown.js";
import { Recorder, attachment } from "./media.js";
import { Store } from "./store.js";

const $ = (id) => document.getElementById(id);
const store = new Store();
const recorder = new Recorder();
const STORAGE_FULL = "This browser's storage for the page is full: the conversation is kept only until the page " +
  "closes. Delete old conversations (pictures and sound take the most room) to keep new ones.";

let current = store.conversations[0] ?? store.create(); // the conversation shown
let pending = []; // the attachments of the message being written
let answering = null; // {controller, conversation} while an answer streams
let model = null; // the server's model card

// ---- the conversation shown ----------------------------------------------------------------------------------------

function showConversation(conversation) {
  current = conversation;
  $("messages").replaceChildren(...conversation.messages.map(messageView));
  scrollToEnd(true);
  renderList();
}

function messageView(message) {
  const view = element("article", "message " + message.role);
  view.append(element("div", "who", message.role === "user" ? "You" : "Assistant"));
  const body = element("div", "body");
  const media = element("div", "media");
  const text = element("div", "text");
  body.append(media, text);
  view.append(body, element("div", "meta"));
  if (message.role === "user") {
    for (const part of typeof message.content === "string" ? [] : message.content) {
      if (part.type === "image_url") {
        const img = element("img");
        img.src = part.image_url.url;
        img.alt = part.name ?? "attached picture";
        media.append(img);
      } else if (part.type === "input_audio") {
        const audio = element("audio");
        audio.controls = true;
        audio.src = `data:audio/${part.input_audio.format};base64,${part.input_audio.data}`;
        audio.setAttribute("aria-label", "attached sound");
        media.append(audio);
      }
    }
    text.textContent = typeof message.content === "string" ? message.content
      : message.content.filter((part) => part.type === "text").map((part) => part.text).join("\n");
  }
  if (!media.childElementCount) media.remove();
  fillAnswer(view, message);
  return view;
}

/** Show an assistant message's text (Markdown) and its state. */
function fillAnswer(view, message) {
  if (message.role !== "assistant") return;
  const meta = message.meta ?? {};
  view.dataset.state = meta.state ?? "done";
  view.setAttribute("aria-busy", String(meta.state === "streaming")); // read out once complete
  view.querySelector(".text").replaceChildren(render(message.content ?? ""));
  const notes = [];
  // a prompt with a picture or sound can take many seconds on a CPU before its first word: say so as it goes
  if (meta.state === "streaming" && !message.content && meta.started) {
    notes.push(`waiting for the first word · ${Math.floor((Date.now() - meta.started) / 1000)} s`);
  }
  if (meta.state === "stopped") notes.push("stopped");
  if (meta.finish === "length") notes.push("cut at the token limit");
  if (meta.usage) {
    // the rate after the first word, as the server's log gives it (the wait before it is shown apart); answers kept
    // from before the page timed their first word: over the whole answer
    const after = meta.firstWord !== undefined;
    const tokens = meta.usage.completion_tokens - (after ? 1 : 0), streamed = meta.seconds - (meta.firstWord ?? 0);
    const perSecond = tokens > 0 && streamed > 0 ? ` · ${(tokens / streamed).toFixed(1)} tokens/s` : "";
    notes.push(`${meta.usage.completion_tokens} tokens${perSecond}`);
  }
  if (meta.firstWord !== undefined && meta.state !== "streaming") {
    notes.push(`first word after ${meta.firstWord.toFixed(1)} s`);
  }
  const line = view.querySelector(".meta");
  line.replaceChildren(notes.join(" · "));
  if (meta.error) line.append(element("div", "error", meta.error));
}

function scrollToEnd(always = false) {
  const log = $("messages");
  if (always || log.scrollHeight - log.scrollTop - log.clientHeight < 80) log.scrollTop = log.scrollHeight;
}

// ---- the list of conversations -------------------------------------------------------------------------------------

function renderList() {
  const items = store.conversations.map((conversation) => {
    const item = element("li");
    const open = element("button", "open", conversation.title || "New chat");
    open.type = "button";
    open.title = conversation.title;
    if (conversation.id === current.id) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => {
      stopAnswer();
      showConversation(conversation);
      toggleList(false);
    });
    const remove = element("button", "delete", "✕");
    remove.type = "button";
    remove.setAttribute("aria-label", `Delete “${conversation.title || "New chat"}”`);
    remove.addEventListener("click", () => deleteConversation(conversation));
    item.append(open, remove);
    return item;
  });
  $("conversation-list").replaceChildren(...items);
}

function deleteConversation(conversation) {
  if (!window.confirm(`Delete “${conversation.title || "New chat"}”?`)) return;
  if (answering?.conversation === conversation) stopAnswer();
  store.remove(conversation.id);
  if (conversation === current) showConversation(store.conversations[0] ?? store.create());
  else renderList();
}

function newConversation() {
  stopAnswer();
  showConversation(store.create());
  toggleList(false);
  $("question").focus();
}

function toggleList(open = !document.body.classList.contains("show-list")) {
  document.body.classList.toggle("show-list", open);
  $("toggle-list").setAttribute("aria-expanded", String(open));
}

// ---- asking --------------------------------------------------------------------------------------------------------

async function send() {
  if (answering) return;
  if (recorder.recording) await toggleRecording();
  const text = $("question").value.trim();
  if (!text && !pending.length) return;
  // a picture keeps the detail it was sent with, so its conversation reads the same each time it is sent again
  const { imageDetail } = store.settings;
  const parts = pending.map((item) => item.kind === "image"
    ? { type: "image_url", image_url: { url: item.url, ...(imageDetail && { detail: imageDetail }) }, name: item.name }
    : { type: "input_audio", input_audio: { data: item.data, format: item.format }, name: item.name });
  const message = { role: "user", content: parts.length ? [...parts, ...(text ? [{ type: "text", text }] : [])] : text };
  const conversation = current;
  conversation.messages.push(message);
  conversation.title ||= (text || pending[0].name).slice(0, 80);
  $("question").value = "";
  pending = [];
  renderAttachments();
  if (!store.touch(conversation)) notice(STORAGE_FULL);
  renderList();
  $("messages").append(messageView(message));
  scrollToEnd(true);
  await answer(conversation);
}

async function answer(conversation) {
  const controller = new AbortController();
  answering = { controller, conversation };
  setBusy(true);
  const message = { role: "assistant", content: "", meta: { state: "streaming", started: Date.now() } };
  const view = messageView(message);
  $("messages").append(view);
  scrollToEnd(true);
  const started = performance.now();
  const waiting = setInterval(() => fillAnswer(view, message), 1000); // the wait's seconds, until the first word
  let frame = 0;
  try {
    const { apiKey } = store.settings;
    for await (const chunk of streamChat(request(conversation), apiKey, controller.signal)) {
      const choice = chunk.choices?.[0];
      if (choice?.delta?.content) {
        if (!message.content) {
          clearInterval(waiting);
          message.meta.firstWord = (performance.now() - started) / 1000;
        }
        message.content += choice.delta.content;
        frame ||= requestAnimationFrame(() => {
          frame = 0;
          fillAnswer(view, message);
          scrollToEnd();
        });
      }
      if (choice?.finish_reason) message.meta.finish = choice.finish_reason;
      if (chunk.usage) message.meta.usage = chunk.usage;
    }
    message.meta.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      message.meta.state = "stopped";
    } else {
      message.meta.state = "error";
      message.meta.error = error instanceof ApiError || error instanceof TypeError ? error.message : String(error);
    }
  }
  cancelAnimationFrame(frame);
  clearInterval(waiting);
  delete message.meta.started;
  message.meta.seconds = (performance.now() - started) / 1000;
  conversation.messages.push(message);
  answering = null;
  setBusy(false);
  if (conversation === current) {
    fillAnswer(view, message);
    scrollToEnd();
  }
  if (!store.touch(conversation)) notice(STORAGE_FULL);
  renderList();
}

/** The chat-completions body for `conversation`: the settings' system prompt, then its messages in the API's form
 * (answers that failed are left out; their question is merged with the next by the server). */
function request(conversation) {
  const { system, maxTokens, temperature } = store.settings;
  const messages = system.trim() ? [{ role: "system", content: system }] : [];
  for (const message of conversation.messages) {
    if (message.role === "assistant" && (message.meta?.state === "error" || !message.content)) continue;
    const content = typeof message.content === "string" ? message.content
      : message.content.map(({ name, ...part }) => part); // the file name is the page's own
    messages.push({ role: message.role, content });
  }
  const body = { messages };
  if (model) body.model = model.id;
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  if (temperature !== "") body.temperature = Number(temperature);
  return body;
}

function stopAnswer() {
  answering?.controller.abort();
}

function setBusy(busy) {
  $("send").disabled = busy;
  if (!busy && document.activeElement === $("stop")) $("question").focus();
  $("stop").hidden = !busy;
}

// ---- attachments ---------------------------------------------------------------------------------------------------

async function attach(files) {
  for (const file of files) {
    try {
      pending.push(await attachment(file));
    } catch (error) {
      notice(error.message);
    }
  }
  renderAttachments();
}

function renderAttachments() {
  const items = pending.map((item, index) => {
    const li = element("li");
    if (item.kind === "image") {
      const img = element("img");
      img.src = item.url;
      img.alt = "";
      li.append(img);
    } else {
      li.append("🎙 ");
    }
    li.append(element("span", "", item.name));
    const remove = element("button", "", "✕");
    remove.type = "button";
    remove.setAttribute("aria-label", `Remove ${item.name}`);
    remove.addEventListener("click", () => {
      pending.splice(index, 1);
      renderAttachments();
    });
    li.append(remove);
    return li;
  });
  $("attachments").replaceChildren(...items);
}

async function toggleRecording() {
  const button = $("record");
  try {
    if (recorder.recording) {
      button.disabled = true;
      pending.push(await recorder.stop());
      renderAttachments();
    } else {
      await recorder.start();
    }
  } catch (error) {
    notice(error.message);
  } finally {
    button.disabled = false;
    button.setAttribute("aria-pressed", String(recorder.recording));
    button.textContent = recorder.recording ? "Stop recording" : "Record";
  }
}

// ---- the server and the settings -----------------------------------------------------------------------------------

async function loadModel() {
  try {
    [model] = await listModels(store.settings.apiKey);
    $("model").textContent = model.id;
    document.title = `${model.id} · chat`;
    $("max-tokens").placeholder = `server default (${model.max_tokens})`;
    notice("");
  } catch (error) {
    model = null;
    $("model").textContent = "Chat";
    notice(error.status === 401 ? `This server needs an API key: enter it in Settings. (${error.message})`
      : `The server did not answer: ${error.message}`);
  }
}

function openSettings() {
  const { apiKey, system, maxTokens, temperature, imageDetail } = store.settings;
  $("api-key").value = apiKey;
  $("system-prompt").value = system;
  $("max-tokens").value = maxTokens;
  $("temperature").value = temperature;
  $("image-detail").value = imageDetail;
  $("settings").returnValue = ""; // closed with Escape, it keeps the last value
  $("settings").showModal();
}

function saveSettings() {
  if ($("settings").returnValue !== "save") return;
  const settings = { apiKey: $("api-key").value.trim(), system: $("system-prompt").value,
                     maxTokens: $("max-tokens").value.trim(), temperature: $("temperature").value.trim(),
                     imageDetail: $("image-detail").value };
  const keyChanged = settings.apiKey !== store.settings.apiKey;
  if (!store.saveSettings(settings)) notice(STORAGE_FULL);
  if (keyChanged || !model) loadModel();
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

function element(name, className = "", text = "") {
  const node = document.createElement(name);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}

// ---- wiring --------------------------------------------------------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("question").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
$("question").addEventListener("paste", (event) => {
  if (event.clipboardData?.files.length) {
    event.preventDefault();
    attach([...event.clipboardData.files]);
  }
});
$("composer").addEventListener("dragover", (event) => event.preventDefault());
$("composer").addEventListener("drop", (event) => {
  event.preventDefault();
  attach([...event.dataTransfer.files]);
});
$("attach").addEventListener("change", (event) => {
  attach([...event.target.files]);
  event.target.value = "";
});
$("record").addEventListener("click", toggleRecording);
$("stop").addEventListener("click", stopAnswer);
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && answering && !$("settings").open) stopAnswer();
});
$("new-chat").addEventListener("click", newConversation);
$("toggle-list").addEventListener("click", () => toggleList());
$("open-settings").addEventListener("click", openSettings);
$("settings").addEventListener("close", saveSettings);

showConversation(current);
loadModel();
