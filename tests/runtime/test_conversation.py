"""builder_plugin.runtime.conversation, without a model: how much of a kept generation a question reuses, and the
answer ids a conversation keeps. Token ids are written out by hand: 1 is <|assistant|>, 2 is <|end|>."""

from __future__ import annotations

import pytest

from builder_plugin.media import Media
from builder_plugin.runtime.conversation import AnswerMemory, Conversation, Held, Markers, Reuse, turn_marks
from builder_plugin.runtime.prompt import Turn

MARKERS = Markers(assistant_id=1, end_id=2)
PICTURE = Media("image", b"picture", "picture.png")
# Two answered turns as ids: question 10 11, answer 20 21; question 12, answer 22 (cut short: no <|end|>).
IDS = (10, 11, 1, 20, 21, 2, 12, 1, 22)
FIRST, SECOND = Turn("a", assistant="x"), Turn("b", assistant="y")


def _held(*turns: Turn, system: str | None = None) -> Held:
    return Held(system, None, turns, IDS)


def test_turn_marks_find_each_question_and_answer():
    assert turn_marks(IDS, MARKERS, 2) == [(3, 6), (8, 9)]
    assert turn_marks(IDS, MARKERS, 3) is None  # not that many questions


def test_a_follow_up_extends_everything_held():
    conversation = Conversation()
    conversation.restore([FIRST, SECOND])
    assert conversation.reuse(_held(FIRST, SECOND), Turn("c"), MARKERS) == Reuse(len(IDS), False)
    # new media need a new generation
    assert conversation.reuse(_held(FIRST, SECOND), Turn("c", images=(PICTURE,)), MARKERS) is None


def test_an_edited_or_regenerated_question_rewinds_to_what_is_shared():
    conversation = Conversation()
    conversation.restore([FIRST])
    assert conversation.reuse(_held(FIRST, SECOND), Turn("b, edited"), MARKERS) == Reuse(6, False)  # after answer 1
    assert conversation.reuse(_held(FIRST, SECOND), Turn("b"), MARKERS) == Reuse(8, True)  # after question 2
    conversation.restore([])
    assert conversation.reuse(_held(FIRST, SECOND), Turn("a"), MARKERS) == Reuse(3, True)
    assert conversation.reuse(_held(FIRST, SECOND), Turn("other"), MARKERS) is None  # nothing shared


def test_nothing_is_reused_across_system_prompts_or_dropped_media():
    conversation = Conversation(system="Be brief.")
    conversation.restore([FIRST])
    assert conversation.reuse(_held(FIRST, SECOND), Turn("c"), MARKERS) is None  # held under no system prompt
    assert conversation.reuse(_held(FIRST, SECOND, system="Be brief."), Turn("c"), MARKERS) == Reuse(6, False)
    with_media = Turn("b", images=(PICTURE,), assistant="y")
    assert conversation.reuse(_held(FIRST, with_media, system="Be brief."), Turn("c"), MARKERS) is None


def test_answer_ids_are_remembered_and_restored_from_text():
    memory = AnswerMemory()
    asked = Conversation(memory=memory)
    asked.record(Turn("a", assistant="x", answer_ids=(20, 21)))
    again = Conversation(memory=memory)  # another conversation on the same package
    again.restore([Turn("a", assistant="x")])
    assert again.turns[0].answer_ids == (20, 21)
    other = Conversation(system="Be brief.", memory=memory)
    other.restore([Turn("a", assistant="x")])
    assert other.turns[0].answer_ids is None  # another system prompt: another conversation
    # a prompt's answer spans are replaced by the ids they were generated as
    prompt = [10, 1, 99, 98, 2, 11, 1]
    assert again.answer_ids_in(prompt, Turn("b"), MARKERS) == [10, 1, 20, 21, 2, 11, 1]
    with pytest.raises(ValueError, match="answered"):
        again.restore([Turn("unanswered")])


def test_the_memory_is_bounded():
    memory = AnswerMemory(size=2)
    for i in range(3):
        memory.remember((i,), (i,))
    assert [memory.recall((i,)) for i in range(3)] == [None, (1,), (2,)]
