"""Kept conversations: up to `max_conversations` Chats on the one opened package, each holding one conversation and
its kept decoding (KV cache), with the KV positions they hold kept under a byte budget.

A request takes the idle conversation it shares the most turns with (same system prompt and tools): the Chat then
prefills only what is new, rewinding to the shared turns when the request edits or asks again a later one. Without
one, it takes an empty conversation, else the least recently used one. Before an answer allocates a new KV cache
(``reserve``), idle conversations are released, least recently used first, until the budget holds it; answers in
progress are never cut short, so when they alone exceed the budget the newcomer waits for one to end (unless none is
running)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from builder_plugin.memory import proc_kib_field
from builder_plugin.runtime import Chat, Package, Turn

log = logging.getLogger("builder_plugin.serve")

GB = 1 << 30
BUDGET_SHARE_OF_AVAILABLE = 0.5  # of the memory available once the model is loaded


@dataclass
class Slot:
    chat: Chat
    busy: bool = False
    used: float = field(default=0.0)  # time.monotonic() of its last answer

    @property
    def holds_generator(self) -> bool:
        return self.chat.kv_tokens > 0


class ConversationPool:
    """The slots and their state, guarded by one lock (the worker changes them, other threads read the gauges)."""

    def __init__(self, package: Package, max_conversations: int, kv_budget_bytes: int,
                 new_chat: Callable[[Package], Chat] = Chat) -> None:
        if max_conversations < 1:
            raise ValueError("max_conversations must be at least 1")
        if kv_budget_bytes <= 0:
            raise ValueError("the KV budget must be positive")
        self.package = package
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_bytes_per_token = package.kv_bytes_per_token
        self.slots = [Slot(new_chat(package)) for _ in range(max_conversations)]
        self._lock = threading.Lock()

    @property
    def max_conversations(self) -> int:
        return len(self.slots)

    @property
    def live_conversations(self) -> int:
        with self._lock:
            return sum(slot.holds_generator for slot in self.slots)

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV cache the kept decodings hold."""
        with self._lock:
            return self._held(self.slots)

    @property
    def busy_kv_bytes(self) -> int:
        with self._lock:
            return self._held(s for s in self.slots if s.busy)

    def acquire(self, system: str | None, tools: str | None, history: Sequence[Turn],
                question: Turn | None) -> Slot | None:
        """The idle slot to answer this conversation in (`question` None: a raw prompt, which reuses none), marked
        busy; None when every slot is answering."""
        with self._lock:
            idle = [slot for slot in self.slots if not slot.busy]
            if not idle:
                return None
            scored = [(_shared_turns(slot, system, tools, history, question), slot.used, slot) for slot in idle]
            score, _, best = max(scored, key=lambda item: item[:2])
            if score == 0:  # nothing to reuse: an empty slot, else the least recently used
                best = min(idle, key=lambda slot: (slot.holds_generator, slot.used))
            best.busy = True
            return best

    def release(self, slot: Slot) -> None:
        with self._lock:
            slot.busy = False
            slot.used = time.monotonic()

    def reserve(self, slot: Slot, tokens: int) -> None:
        """Before `slot`'s answer allocates a KV cache of `tokens` positions (0: it extends its kept one): release
        idle conversations, least recently used first, until it fits the budget (or none is left to release)."""
        if tokens == 0:
            return
        need = tokens * self.kv_bytes_per_token
        while True:
            with self._lock:
                held = self._held(s for s in self.slots if s is not slot)
                victims = [s for s in self.slots if s is not slot and not s.busy and s.holds_generator]
                if held + need <= self.kv_budget_bytes or not victims:
                    break
                victim = min(victims, key=lambda s: s.used)
                victim.chat.release()
        if held + need > self.kv_budget_bytes:
            log.info("answers in progress hold %.2f GB of KV cache, over the budget of %.2f GB (--kv-budget-gb)",
                     (held + need) / GB, self.kv_budget_bytes / GB)

    def close(self) -> None:
        """Free every kept decoding."""
        with self._lock:
            for slot in self.slots:
                slot.chat.clear()

    def _held(self, slots) -> int:
        return sum(slot.chat.kv_tokens for slot in slots) * self.kv_bytes_per_token


def _shared_turns(slot: Slot, system: str | None, tools: str | None, history: Sequence[Turn],
                  question: Turn | None) -> int:
    """How much of this slot's kept conversation the request can reuse: the turns it shares, plus one when the
    request asks the next kept question again (0: nothing)."""
    chat = slot.chat
    if question is None or not slot.holds_generator or chat.system != system or chat.tools != tools:
        return 0
    kept = chat.turns
    shared = 0
    while shared < min(len(kept), len(history)) and kept[shared] == history[shared]:
        shared += 1
    if shared < len(history):
        return 0  # the request's history goes on differently: it is prefilled whole anyway
    again = shared < len(kept) and kept[shared].asks_as(question)
    return shared + again


def default_kv_budget(package: Package, max_conversations: int, available_bytes: int | None) -> int:
    """Half the memory available once the model is loaded, and no more than `max_conversations` decodings of the
    maximum length."""
    most = package.max_length * package.kv_bytes_per_token * max_conversations
    return most if available_bytes is None else min(most, int(available_bytes * BUDGET_SHARE_OF_AVAILABLE))


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        return proc_kib_field("/proc/meminfo", "MemAvailable")
    except OSError:
        return None
