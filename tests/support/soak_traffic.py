"""The requests of a soak run: a plan of kinds drawn from a seed, the conversations that grow, regenerate and edit
while their requests go out from different client threads, and the bad requests with the error each must get."""

from __future__ import annotations

import base64
import itertools
import random
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Kinds of the plan and their shares; "conversation" becomes new / follow-up / regenerate / edit in the plan.
KIND_WEIGHTS = {"text": 0.14, "image": 0.12, "audio": 0.10, "cancelled": 0.08, "bad": 0.10, "conversation": 0.46}
CONVERSATION_STEPS = {"follow-up": 0.6, "regenerate": 0.2, "edit": 0.2}
MAX_QUESTIONS = 6  # a conversation is closed after this many questions (another one is opened)
MAX_IMAGES = 2  # in a request or a conversation: the largest prompt is sent before the first memory sample
CANCEL_MAX_TOKENS = 48  # a cancelled stream asks for this many (~0.25 s on the tiny package): the server stops it

PROMPTS = ("Describe what you get.", "Name three colours and say why you like them.", "What is the capital of France?",
           "Tell me a short story about a lighthouse.", "Explain how a bicycle works.", "Summarise this in one line.",
           "What would you cook tonight?", "Count from one to ten.", "Which planet is the largest?",
           "Give me a haiku about rain.", "What is in front of you?", "Translate 'good morning' into Spanish.")
SYSTEMS = (None, None, "You are a concise assistant.", "Answer like a pirate.")


@dataclass(frozen=True, order=True)
class Question:
    text: str
    images: tuple[Path, ...] = ()
    audios: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Media:
    images: tuple[Path, ...]  # photographs, PNG and JPEG
    audios: tuple[Path, ...]  # wav clips
    not_image: bytes  # bytes that are no PNG or JPEG (a wav clip)


@dataclass(frozen=True)
class BadCase:
    """A request the server must refuse: `fields` for the openai client, or a `raw` body sent as it is."""

    name: str
    status: int
    code: str | None
    fragment: str  # a piece of the error message
    fields: dict[str, Any] = field(default_factory=dict)
    raw: bytes | None = None


@dataclass
class Conversation:
    """A client's conversation: the questions asked and the server's answers, as a chat app keeps them."""

    number: int
    system: str | None
    questions: list[Question] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    busy: bool = False  # a request of it is out


@dataclass
class Step:
    """One request to send."""

    index: int
    kind: str  # text, image, audio, cancelled, bad, new, follow-up, regenerate, edit
    stream: bool
    messages: list[dict] = field(default_factory=list)
    system: str | None = None
    asked: tuple[Question, ...] = ()  # the conversation this request asks Chat to answer (its last question)
    conversation: Conversation | None = None
    bad: BadCase | None = None
    chunks_before_cancel: int = 1

    @property
    def checked(self) -> bool:
        """Its answer is compared with Chat's."""
        return self.kind not in ("cancelled", "bad")

    def describe(self) -> str:
        """Which request this was and what it sent, e.g. "request 12 (edit, streamed; system; 3 questions: q1
        astronaut.png clip_1s.wav, q3 coffee.jpg)"."""
        if self.bad is not None:
            return f"request {self.index} (bad: {self.bad.name}{', streamed' if self.stream else ''})"
        media = [" ".join([f"q{i + 1}", *(p.name for p in (*q.images, *q.audios))])
                 for i, q in enumerate(self.asked) if q.images or q.audios]
        questions = f"{len(self.asked)} question{'s' if len(self.asked) != 1 else ''}"
        return (f"request {self.index} ({self.kind}, {'streamed' if self.stream else 'json'}; "
                f"{'system; ' if self.system else ''}{questions}{': ' + ', '.join(media) if media else ''})")


def photographs(folder: Path) -> tuple[Path, ...]:
    """Photographs shipped with scikit-image (no download), written as PNG and JPEG files."""
    from PIL import Image
    from skimage import data

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    # The first two make the longest two-image prompt on the tiny package (1333 + 693 image tokens).
    for name, suffix in (("astronaut", ".png"), ("chelsea", ".jpg"), ("coffee", ".jpg"), ("rocket", ".png")):
        path = folder / f"{name}{suffix}"
        Image.fromarray(getattr(data, name)()).convert("RGB").save(path, **({"quality": 90} if suffix == ".jpg"
                                                                           else {}))
        paths.append(path)
    return tuple(paths)


def soak_media(folder: Path) -> Media:
    """The photographs and three clips (8 and 16 kHz) a run sends, written to `folder`."""
    from builder_plugin.testing.media import make_wav

    # The longest clip first.
    audios = (make_wav(folder / "clip_3s_8k.wav", 3.0, sample_rate=8000, seed=3),
              make_wav(folder / "clip_1s.wav", 1.0, seed=1), make_wav(folder / "clip_2s.wav", 2.0, seed=2))
    return Media(photographs(folder), audios, audios[0].read_bytes())


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def image_part(path: Path) -> dict:
    mime = "image/png" if path.suffix == ".png" else "image/jpeg"
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64(path.read_bytes())}"}}


def audio_part(path: Path) -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(path.read_bytes()), "format": "wav"}}


def user_message(question: Question) -> dict:
    """A user message with its media first (where Chat puts their tags when the text writes none)."""
    if not question.images and not question.audios:
        return {"role": "user", "content": question.text}
    parts = [image_part(p) for p in question.images] + [audio_part(p) for p in question.audios]
    return {"role": "user", "content": [*parts, {"type": "text", "text": question.text}]}


def messages_for(system: str | None, asked: tuple[Question, ...], answers: list[str]) -> list[dict]:
    """What a client sends: the system message, every earlier question with the answer it got, the last question."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    for question, answer in zip(asked[:-1], answers):
        messages += [user_message(question), {"role": "assistant", "content": answer}]
    return [*messages, user_message(asked[-1])]


def bad_cases(media: Media) -> tuple[BadCase, ...]:
    """Requests the server must refuse, each with the status, error code and message it must get."""
    hi = {"role": "user", "content": "Hi"}

    def image_of(data: bytes, mime: str = "image/png") -> dict:
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:{mime};base64,"
                                                                                      f"{b64(data)}"}},
                                            {"type": "text", "text": "What is this?"}]}

    not_audio = {"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": b64(media.images[0].read_bytes()), "format": "wav"}},
        {"type": "text", "text": "Listen."}]}
    return (
        BadCase("malformed JSON", 400, "invalid_json", "not valid JSON", raw=b'{"messages": [{"role": "user", '),
        BadCase("unknown model", 404, "model_not_found", "'gpt-5' is not served", {"model": "gpt-5",
                                                                                   "messages": [hi]}),
        BadCase("not an image", 400, "invalid_image_format", "not a readable image", {"messages": [
            image_of(media.not_image)]}),
        BadCase("text as a JPEG", 400, "invalid_image_format", "not a readable image", {"messages": [
            image_of(b"plain text, no picture", "image/jpeg")]}),
        BadCase("bad base64", 400, "invalid_base64", "not valid base64", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,not base64!"}}]}]}),
        BadCase("not audio", 400, "invalid_audio_format", "not a readable audio clip", {"messages": [not_audio]}),
        BadCase("assistant last", 400, None, "the last message must be a user or tool message", {"messages": [
            hi, {"role": "assistant", "content": "Hello"}]}),
        BadCase("unknown role", 400, None, "unsupported role 'function'", {"messages": [
            {"role": "function", "content": "x"}]}),
        BadCase("two choices", 400, None, "only one choice", {"messages": [hi], "n": 2}),
    )


@dataclass(frozen=True)
class Planned:
    """A request of the plan: all of it but the answers a conversation's history holds."""

    index: int
    kind: str  # text, image, audio, cancelled, bad, new, follow-up, regenerate, edit
    stream: bool
    system: str | None = None
    question: Question | None = None  # the new question (of an edit: its new text, the media stay)
    conversation: int | None = None
    bad: BadCase | None = None
    chunks_before_cancel: int = 1


class Traffic:
    """The plan of a run and the conversations in it; `take` and `finish` are called from the client threads.

    The whole plan is drawn from the seed up front, so a run sends the same requests whichever thread sends which
    (a conversation's history holds the server's answers, the same ones while they equal Chat's): a failure seen
    once comes back with the same seed.

    The first `clients` requests are the largest prompt of the run (MAX_IMAGES photographs, a clip and a
    conversation's worth of text), meant to be sent at once (see `burst`), then comes one request of each kind: by
    the first memory and thread sample every session is in use, the largest inputs were prepared and as many
    requests were read at once as there are clients. The rest are drawn from KIND_WEIGHTS. A conversation's
    requests go out one at a time, in plan order, from whichever thread is free; up to `clients` + 2 are open at
    once."""

    def __init__(self, requests: int, seed: int, media: Media, max_tokens: int, clients: int) -> None:
        self.media = media
        self.max_tokens = max_tokens
        self.bad = bad_cases(media)
        self.burst = min(clients, requests)  # the first requests, one per client
        self.plan = _Planner(random.Random(seed), self, open_conversations=clients + 2).plan(requests, self.burst)
        self.conversations: dict[int, Conversation] = {}
        self._untaken = list(range(len(self.plan)))
        self._changed = threading.Condition()

    @property
    def kinds(self) -> list[str]:
        return [p.kind for p in self.plan]

    def take(self, until: int | None = None, deadline: float | None = None) -> Step | None:
        """The first request of the plan before number `until` that may go now (a conversation's next one waits for
        its last answer); None when all of them were taken, or at `deadline` (time.monotonic)."""
        limit = len(self.plan) if until is None else min(until, len(self.plan))
        with self._changed:
            while True:
                pending = [i for i in self._untaken if i < limit]
                if not pending:
                    return None
                for index in pending:
                    planned = self.plan[index]
                    conversation = None if planned.conversation is None else self.conversations.setdefault(
                        planned.conversation, Conversation(planned.conversation, planned.system))
                    if conversation is None or not conversation.busy:
                        self._untaken.remove(index)
                        return self._step(planned, conversation)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._changed.wait(timeout=remaining)

    def finish(self, step: Step, answer: Answer | None) -> None:
        """Record a conversation step's answer (None: it failed, and the conversation stays as it was)."""
        conversation = step.conversation
        if conversation is None:
            return
        with self._changed:
            conversation.busy = False
            if answer is not None and len(step.asked) > len(conversation.questions):
                conversation.questions.append(step.asked[-1])
                conversation.answers.append(answer.text)
            elif answer is not None:  # regenerate, edit: the last question's answer is replaced
                conversation.questions[-1] = step.asked[-1]
                conversation.answers[-1] = answer.text
            self._changed.notify_all()

    def _step(self, planned: Planned, conversation: Conversation | None) -> Step:
        if planned.kind == "bad":
            return Step(planned.index, "bad", planned.stream, bad=planned.bad)
        if conversation is None:
            asked = (planned.question,)
            return Step(planned.index, planned.kind, planned.stream, messages_for(planned.system, asked, []),
                        planned.system, asked, chunks_before_cancel=planned.chunks_before_cancel)
        conversation.busy = True
        asked, kind = tuple(conversation.questions), planned.kind
        if kind in ("new", "follow-up") or not asked:  # not asked: its first requests failed, this one starts it
            kind = "follow-up" if asked else "new"
            asked += (planned.question,)
        elif kind == "edit":
            asked = (*asked[:-1], replace(asked[-1], text=planned.question.text))
        answers = conversation.answers[:len(asked) - 1]
        return Step(planned.index, kind, planned.stream, messages_for(conversation.system, asked, answers),
                    conversation.system, asked, conversation)


class _Planner:
    """Draws the plan: which kind each request is, its text and media, and which conversation it continues."""

    def __init__(self, rng: random.Random, traffic: Traffic, open_conversations: int) -> None:
        self.rng = rng
        self.media = traffic.media
        self.max_tokens = traffic.max_tokens
        self.bad = traffic.bad
        self.open_conversations = open_conversations
        self.open: list[tuple[int, str | None, list[Question]]] = []  # (number, system, questions so far)
        self.opened = 0

    def plan(self, requests: int, largest: int) -> list[Planned]:
        first = list(KIND_WEIGHTS)
        self.rng.shuffle(first)
        rest = self.rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()), k=requests)
        kinds = (["largest"] * largest + first + rest)[:requests]
        return [self._planned(index, kind) for index, kind in enumerate(kinds)]

    def _planned(self, index: int, kind: str) -> Planned:
        rng = self.rng
        stream = rng.random() < 0.5
        if kind == "conversation":
            return self._conversation_step(index, stream)
        if kind == "bad":
            case = rng.choice(self.bad)
            return Planned(index, kind, stream and case.raw is None, bad=case)
        system = rng.choice(SYSTEMS)
        if kind == "largest":
            return Planned(index, "image", stream, system, self._largest(index))
        if kind == "cancelled":
            return Planned(index, kind, True, system, self._question("text", f"request {index}"),
                           chunks_before_cancel=rng.choice((1, 2)))
        return Planned(index, kind, stream, system, self._question(kind, f"request {index}"))

    def _conversation_step(self, index: int, stream: bool) -> Planned:
        rng = self.rng
        if not self.open or (len(self.open) < self.open_conversations and rng.random() < 0.25):
            self.open.append((self.opened, rng.choice(SYSTEMS), []))
            self.opened += 1
        number, system, questions = rng.choice(self.open)
        where = f"conversation {number}, request {index}"
        if not questions:
            kind = "new"
            question = self._question(rng.choice(("text", "text", "image", "audio")), where)
        else:
            kind = rng.choices(list(CONVERSATION_STEPS), weights=list(CONVERSATION_STEPS.values()))[0]
            question = self._question("text", where)
            if kind == "follow-up":
                # New media in a follow-up (the server starts a new generator), another photograph than before.
                seen = {p for q in questions for p in q.images}
                if len(seen) < MAX_IMAGES and rng.random() < 0.1:
                    question = replace(question, images=(rng.choice([p for p in self.media.images
                                                                     if p not in seen]),))
            elif kind == "edit":
                question = replace(questions[-1], text=question.text.replace(f"request {index}",
                                                                             f"edited in request {index}"))
        if kind in ("new", "follow-up"):
            questions.append(question)
        elif kind == "edit":
            questions[-1] = question
        if len(questions) >= MAX_QUESTIONS:
            self.open = [c for c in self.open if c[0] != number]
        return Planned(index, kind, stream, system, question, number)

    def _largest(self, index: int) -> Question:
        """A prompt longer than any other of the run: the photographs that make the longest prompt together, the
        longest clip, and text at least as long as a conversation's MAX_QUESTIONS questions and answers (prefill
        memory grows with the prompt's length, and the allocators keep what they grew to)."""
        words = MAX_QUESTIONS * (self.max_tokens + 20)  # a word is at least a token; a question ~15 tokens
        text = " ".join(itertools.islice(itertools.cycle(" ".join(PROMPTS).split()), words))
        return Question(f"{text} (request {index})", self.media.images[:MAX_IMAGES], self.media.audios[:1])

    def _question(self, kind: str, where: str) -> Question:
        rng = self.rng
        text = f"{rng.choice(PROMPTS)} ({where})"
        images, audios = self.media.images, self.media.audios
        if kind == "image":
            count = 2 if rng.random() < 0.2 else 1
            return Question(text, tuple(rng.sample(images, count)))
        if kind == "audio":
            with_image = rng.random() < 0.2
            return Question(text, (rng.choice(images),) if with_image else (), (rng.choice(audios),))
        return Question(text)
