// Conversations and settings, kept in this browser's localStorage (per origin: only pages of this server see them).
// A conversation: {id, title, updated, messages: [{role, content, meta}]}, its messages in the API's form plus what
// the page shows of an answer (meta: state, finish reason, usage, error).

const CONVERSATIONS = "builder_plugin.chat.conversations";
const SETTINGS = "builder_plugin.chat.settings";
const DEFAULT_SETTINGS = { apiKey: "", system: "", maxTokens: "", temperature: "", imageDetail: "" };

export class Store {
  constructor(storage = window.localStorage) {
    this.storage = storage;
    this.conversations = read(storage, CONVERSATIONS, []); // the most recently used first
    this.settings = { ...DEFAULT_SETTINGS, ...read(storage, SETTINGS, {}) };
  }

  /** A new conversation, kept once it has a message (see touch). */
  create() {
    return { id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`, title: "", updated: 0,
             messages: [] };
  }

  find(id) {
    return this.conversations.find((conversation) => conversation.id === id) ?? null;
  }

  /** Put `conversation` first in the list (adding it if new) and write the list; false when the browser's storage
   * is full (the conversation then lasts until the page closes). */
  touch(conversation) {
    conversation.updated = Date.now();
    this.conversations = [conversation, ...this.conversations.filter((c) => c.id !== conversation.id)];
    return this.save();
  }

  remove(id) {
    this.conversations = this.conversations.filter((conversation) => conversation.id !== id);
    return this.save();
  }

  save() {
    return write(this.storage, CONVERSATIONS, this.conversations);
  }

  saveSettings(settings) {
    this.settings = { ...DEFAULT_SETTINGS, ...settings };
    return write(this.storage, SETTINGS, this.settings);
  }
}

function read(storage, key, fallback) {
  try {
    return JSON.parse(storage.getItem(key)) ?? fallback;
  } catch {
    return fallback; // unreadable (edited by hand?): start afresh rather than not at all
  }
}

function write(storage, key, value) {
  try {
    storage.setItem(key, JSON.stringify(value));
    return true;
  } catch (error) {
    if (error.name === "QuotaExceededError") return false;
    throw error;
  }
}
