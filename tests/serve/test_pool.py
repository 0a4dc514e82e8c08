"""builder_plugin.serve.pool, without HTTP: which kept conversation a request takes, and the KV budget kept by
releasing idle conversations, least recently used first (never one that is answering)."""

from __future__ import annotations

import pytest

from builder_plugin.runtime import Chat, Package, Turn
from builder_plugin.serve.pool import ConversationPool, default_kv_budget

NEW_TOKENS = 2


@pytest.fixture(scope="module")
def opened(tiny_package) -> Package:
    return Package(tiny_package)


def _answer(pool: ConversationPool, system: str | None, history: list[Turn], question: str) -> tuple:
    """One request through the pool as the worker makes it: acquire, resume, reserve, answer, release."""
    slot = pool.acquire(system, None, history, Turn(question))
    assert slot is not None
    slot.chat.resume(system, None, history)
    answering = slot.chat.prepare(Turn(question), max_new_tokens=NEW_TOKENS)
    pool.reserve(slot, answering.kv_tokens)
    list(answering)
    pool.release(slot)
    return slot, slot.chat.turns[-1]


def test_a_request_takes_the_conversation_it_continues(opened):
    pool = ConversationPool(opened, 3, 1 << 40)
    first, turn = _answer(pool, "Be brief.", [], "Hello!")
    other, _ = _answer(pool, "Be brief.", [], "Something else.")
    assert other is not first  # nothing shared: an empty conversation, the kept one stays
    again, _ = _answer(pool, "Be brief.", [turn], "And then?")
    assert again is first and first.chat.last_stats.reused_tokens > 0
    moved, _ = _answer(pool, "Be long.", [turn], "And then?")  # another system prompt shares nothing
    assert moved is not first
    assert pool.live_conversations == 3 and pool.kv_bytes == sum(s.chat.kv_tokens for s in pool.slots) * \
        opened.kv_bytes_per_token


def test_the_budget_releases_idle_conversations_least_recently_used_first(opened):
    probe = Chat(opened)
    list(probe.ask("Hello!", max_new_tokens=NEW_TOKENS))
    one = probe.kv_tokens * opened.kv_bytes_per_token  # a short conversation's cache
    pool = ConversationPool(opened, 3, int(2.5 * one))
    oldest, _ = _answer(pool, None, [], "First.")
    newer, _ = _answer(pool, None, [], "Second.")
    assert pool.live_conversations == 2
    third, _ = _answer(pool, None, [], "Third.")  # a third cache does not fit: the oldest idle one goes
    assert not oldest.holds_generator and newer.holds_generator and third.holds_generator
    assert pool.kv_bytes <= pool.kv_budget_bytes


def test_an_answering_conversation_is_never_released(opened):
    pool = ConversationPool(opened, 2, 1)  # a budget nothing fits in
    busy = pool.acquire(None, None, [], Turn("Long."))
    answering = busy.chat.prepare(Turn("Long."), max_new_tokens=8)
    pool.reserve(busy, answering.kv_tokens)
    next(answering)  # its cache is allocated and in use
    _answer(pool, None, [], "Short.")  # over the budget: it may not release the busy one, nor wait for it
    assert busy.holds_generator and busy.busy
    list(answering)
    pool.release(busy)
    pool.close()
    assert pool.live_conversations == 0


def test_default_budget(opened):
    full = opened.max_length * opened.kv_bytes_per_token
    assert default_kv_budget(opened, 4, None) == 4 * full
    assert default_kv_budget(opened, 4, 10 * full) == 4 * full
    assert default_kv_budget(opened, 4, 2 * full) == full  # half the memory available
