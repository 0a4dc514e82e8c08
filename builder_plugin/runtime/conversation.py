"""A conversation: its system prompt and tools, its answered turns, the token ids of answers given here, and how much
of a kept generation a next question can reuse. Pure: no onnxruntime-genai (token ids come in as lists).

Answers keep their token ids: a conversation prompted again from its turns (new media, ``restore``, a follow-up that
does not fit) gets the ids the answers were generated as, not a re-tokenisation of their text, so it is the same
token sequence whichever way it is run. ``restore`` finds them for turns that were answered here recently.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from builder_plugin.media import Media
from builder_plugin.runtime.prompt import Turn, build_prompt

ANSWER_MEMORY = 256  # answers whose token ids are remembered for conversations restored from text


@dataclass(frozen=True)
class Markers:
    """The token ids the conversation's structure is read from."""

    assistant_id: int  # <|assistant|>: a question ends with it
    end_id: int  # <|end|>: an answer ends with it


@dataclass(frozen=True)
class Held:
    """What a kept generation holds: the conversation it was prompted with (system, tools, the answered turns it
    holds) and its token ids (prompt ids, then generated and appended ids)."""

    system: str | None
    tools: str | None
    turns: tuple[Turn, ...]
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Reuse:
    """A kept generation's first `keep` ids are the conversation so far; the question's own ids come after them
    (`asked_again`: the question is the one those ids end with, answered again: it has no ids of its own)."""

    keep: int
    asked_again: bool


class AnswerMemory:
    """The token ids of recent answers, by the conversation that led to them (system, tools, turns up to the answer);
    shared by the conversations on one package (a server's request may land in any of them) and safe between
    threads."""

    def __init__(self, size: int = ANSWER_MEMORY) -> None:
        self.size = size
        self._ids: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, key: tuple, ids: tuple[int, ...] | None) -> None:
        with self._lock:
            self._ids[key] = ids
            self._ids.move_to_end(key)
            while len(self._ids) > self.size:
                self._ids.popitem(last=False)

    def recall(self, key: tuple) -> tuple[int, ...] | None:
        with self._lock:
            return self._ids.get(key)


class Conversation:
    """System prompt, tools (the JSON text the chat template puts in the system message) and answered turns; the ids
    of answers given are kept in `memory` (its own unless one is shared)."""

    def __init__(self, system: str | None = None, tools: str | None = None,
                 memory: AnswerMemory | None = None) -> None:
        self.system = system
        self.tools = tools
        self.turns: list[Turn] = []
        self.memory = memory if memory is not None else AnswerMemory()

    def clear(self) -> None:
        self.turns = []

    def restore(self, turns: Sequence[Turn]) -> None:
        """Make `turns` (answered) the conversation so far, with the answer ids remembered for them."""
        if any(t.assistant is None for t in turns):
            raise ValueError("restored turns must all be answered")
        restored = []
        for i, turn in enumerate(turns):
            if turn.answer_ids is None:
                ids = self.memory.recall((self.system, self.tools, tuple(turns[:i + 1])))
                turn = replace(turn, answer_ids=ids) if ids is not None else turn
            restored.append(turn)
        self.turns = restored

    def record(self, turn: Turn) -> None:
        """`turn` (answered) is the conversation's next."""
        self.turns.append(turn)
        self.memory.remember((self.system, self.tools, tuple(self.turns)), turn.answer_ids)

    def with_question(self, question: Turn) -> list[Turn]:
        return [*self.turns, question]

    def prompt(self, question: Turn, header: str | None) -> str:
        """The chat prompt of the conversation and `question` (`header`: the system message rendered with the tools)."""
        return build_prompt(self.with_question(question), self.system, header)

    def media(self, question: Turn) -> tuple[list[Media], list[Media]]:
        """Every image and clip of the conversation and `question`, in order."""
        turns = self.with_question(question)
        return [m for t in turns for m in t.images], [m for t in turns for m in t.audios]

    def has_media(self, question: Turn) -> tuple[bool, bool]:
        images, audios = self.media(question)
        return bool(images), bool(audios)

    def holds(self, held: Held) -> bool:
        """The held generation was prompted with this conversation's system prompt and tools, and holds its turns (and
        maybe later ones, which a next question may rewind)."""
        return (held.system, held.tools) == (self.system, self.tools) and \
            held.turns[:len(self.turns)] == tuple(self.turns)

    def reuse(self, held: Held, question: Turn, markers: Markers) -> Reuse | None:
        """How many of `held`'s ids this conversation with `question` next starts with; None when it shares too little.

        The conversation's turns are the first of the turns the generation holds (``restore``). `question` follows
        them after the last one's answer, or, when it asks the next held question again (an answer regenerated),
        right after that question. Media must all be in the kept ids: new media need a new generation, and so do media
        only the dropped turns had (the generation's processor tensors hold them)."""
        if not self.holds(held):
            return None
        count = len(self.turns)
        if count == len(held.turns):
            return None if question.images or question.audios else Reuse(len(held.ids), False)
        dropped = held.turns[count:]
        again = dropped[0].asks_as(question)
        if any(t.images or t.audios for t in dropped[1 if again else 0:]) or \
                (not again and (question.images or question.audios)):
            return None
        marks = turn_marks(held.ids, markers, len(held.turns))
        if marks is None or (not again and count == 0):
            return None
        return Reuse(marks[count][0], True) if again else Reuse(marks[count - 1][1], False)

    def answer_ids_in(self, prompt_ids: list[int], question: Turn, markers: Markers) -> list[int]:
        """The prompt ids with each answer's span (between its turn's <|assistant|> and the next <|end|>) replaced by
        the ids it was generated as; unchanged when the prompt's <|assistant|> ids do not pair up with the turns."""
        turns = self.with_question(question)
        if all(t.answer_ids is None for t in turns):
            return prompt_ids
        starts = [i + 1 for i, t in enumerate(prompt_ids) if t == markers.assistant_id]
        if len(starts) != len(turns):
            return prompt_ids
        out: list[int] = []
        done = 0
        for start, turn in zip(starts, turns):
            if turn.answer_ids is None or turn.assistant is None:
                continue
            stop = prompt_ids.index(markers.end_id, start) if markers.end_id in prompt_ids[start:] else len(prompt_ids)
            out += prompt_ids[done:start] + list(turn.answer_ids)
            done = stop
        return out + prompt_ids[done:]


def turn_marks(ids: Sequence[int], markers: Markers, count: int) -> list[tuple[int, int]] | None:
    """Per answered turn in `ids`, where its question ends (after <|assistant|>) and where its answer ends (after
    the <|end|> that closes it, or the end of `ids` for a last answer cut short); None unless `ids` holds exactly
    `count` questions."""
    starts = [i + 1 for i, t in enumerate(ids) if t == markers.assistant_id]
    if len(starts) != count:
        return None
    marks = []
    for i, start in enumerate(starts):
        limit = starts[i + 1] if i + 1 < count else len(ids)
        ends = [j + 1 for j in range(start, limit) if ids[j] == markers.end_id]
        marks.append((start, ends[0] if ends else limit))
    return marks
