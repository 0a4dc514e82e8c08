"""Kept conversations: up to `max_conversations` Chats on the one loaded package, each holding one conversation's
generator and KV cache, with the KV positions they hold kept under a byte budget.

A request takes the idle conversation it shares the most turns with (same system prompt and tools): the Chat then
prefills only what is new, rewinding to the shared turns when the request edits or asks again a later one. Without
one, it takes an empty conversation, else the least recently used one. Before a new generator is allocated, idle
conversations are released, least recently used first, until the budget holds it; answers in progress are never cut
short, so when they alone exceed the budget the newcomer waits for one to end (unless none is running)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from builder_plugin.memory import proc_kib_field
from builder_plugin.runtime import Chat, Turn

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
    def __init__(self, chat: Chat, max_conversations: int, kv_budget_bytes: int) -> None:
        if max_conversations < 1:
            raise ValueError("max_conversations must be at least 1")
        if kv_budget_bytes <= 0:
            raise ValueError("the KV budget must be positive")
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_bytes_per_token = chat.kv_bytes_per_token
        self.slots = [Slot(chat)] + [Slot(chat.sibling()) for _ in range(max_conversations - 1)]
        for slot in self.slots:
            slot.chat.before_new_generator = self._reserver(slot)
        self._lock = threading.Lock()  # the gauges are read from other threads

    @property
    def max_conversations(self) -> int:
        return len(self.slots)

    @property
    def live_conversations(self) -> int:
        return sum(slot.holds_generator for slot in self.slots)

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV cache the kept generators hold."""
        return sum(slot.chat.kv_tokens for slot in self.slots) * self.kv_bytes_per_token

    @property
    def busy_kv_bytes(self) -> int:
        return sum(slot.chat.kv_tokens for slot in self.slots if slot.busy) * self.kv_bytes_per_token

    def acquire(self, system: str | None, tools: str | None, history: Sequence[Turn], question: Turn) -> Slot | None:
        """The idle slot to answer this conversation in, marked busy; None when every slot is answering."""
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

    def close(self) -> None:
        """Free every kept generator."""
        for slot in self.slots:
            slot.chat.clear()

    def _reserver(self, slot: Slot):
        def reserve(tokens: int) -> None:
            """Release idle conversations, least recently used first, until `tokens` more positions fit."""
            need = tokens * self.kv_bytes_per_token
            while True:
                with self._lock:
                    held = sum(s.chat.kv_tokens for s in self.slots if s is not slot) * self.kv_bytes_per_token
                    victims = [s for s in self.slots if s is not slot and not s.busy and s.holds_generator]
                    if held + need <= self.kv_budget_bytes or not victims:
                        break
                    victim = min(victims, key=lambda s: s.used)
                victim.chat.release()
            if held + need > self.kv_budget_bytes:
                log.info("answers in progress hold %.2f GB of KV cache, over the budget of %.2f GB (--kv-budget-gb)",
                         (held + need) / GB, self.kv_budget_bytes / GB)

        return reserve


def _shared_turns(slot: Slot, system: str | None, tools: str | None, history: Sequence[Turn], question: Turn) -> int:
    """How much of this slot's kept conversation the request can reuse: the turns it shares, plus one when the
    request asks the next kept question again (0: nothing)."""
    chat = slot.chat
    if not slot.holds_generator or chat.system != system or chat.tools != tools:
        return 0
    kept = chat.turns
    shared = 0
    while shared < min(len(kept), len(history)) and kept[shared] == history[shared]:
        shared += 1
    if shared < len(history):
        return 0  # the request's history goes on differently: it is prefilled whole anyway
    again = shared < len(kept) and kept[shared].asks_as(question)
    return shared + again


def default_kv_budget(chat: Chat, max_conversations: int, available_bytes: int | None) -> int:
    """Half the memory available once the model is loaded, and no more than `max_conversations` generators of the
    maximum length."""
    most = chat.max_length * chat.kv_bytes_per_token * max_conversations
    return most if available_bytes is None else min(most, int(available_bytes * BUDGET_SHARE_OF_AVAILABLE))


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        return proc_kib_field("/proc/meminfo", "MemAvailable")
    except OSError:
        return None
