"""The Phi-4 chat prompt: turns, media tags and their numbering across a conversation."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from builder_plugin.media import Media
from builder_plugin.runtime.errors import TagMismatchError

END = "<|end|>"  # end of a turn; also the end-of-sequence token that closes an answer
ASSISTANT = "<|assistant|>"
USER, TOOL = "user", "tool"  # roles of a question: a user's, or the results of the calls in the answer before it
_TAG = re.compile(r"<\|(image|audio)_(\d+)\|>")
PLACEHOLDERS = ("<|endoftext10|>", "<|endoftext11|>")  # the image and audio placeholders the processor writes
_PLACEHOLDER = re.compile("|".join(map(re.escape, PLACEHOLDERS)))


@dataclass(frozen=True)
class Turn:
    """One question with its attached files and, once answered, the answer (and, when known, the token ids the
    answer was generated as: a prompt rebuilt from the turns then uses them instead of re-tokenising the text).
    A ``tool`` turn carries the results of the tool calls the answer before it made, as the chat template renders
    them (``<|tool|>result<|end|>`` per result)."""

    user: str
    images: tuple[Media, ...] = ()  # decoded (runtime.open_image): equal when their canonical bytes are
    audios: tuple[Media, ...] = ()
    assistant: str | None = None
    answer_ids: tuple[int, ...] | None = field(default=None, compare=False)
    role: str = USER

    def __post_init__(self) -> None:
        check_tags(self.user, len(self.images), len(self.audios))  # once: a prompt built from turns trusts them

    def asks_as(self, other: Turn) -> bool:
        """Both turns ask the same question (text, files and role), whatever their answers."""
        return (self.user, self.images, self.audios, self.role) == (other.user, other.images, other.audios, other.role)


def check_tags(text: str, num_images: int, num_audios: int) -> None:
    """Raise TagMismatchError unless the tags written in `text` fit the attached files.

    A question may leave the tags out (they are then put before the text) or place them itself; tags of a kind must
    then be numbered 1..n in order, n being the number of files of that kind attached to this question."""
    if _PLACEHOLDER.search(text):
        raise TagMismatchError("write media tags as <|image_N|> / <|audio_N|>, not as <|endoftext10|> / "
                               "<|endoftext11|>")
    for kind, count in (("image", num_images), ("audio", num_audios)):
        numbers = [int(n) for k, n in _TAG.findall(text) if k == kind]
        if not numbers:
            continue
        if len(numbers) != count:
            written = " ".join(f"<|{kind}_{n}|>" for n in numbers)
            noun = {"image": "image", "audio": "audio clip"}[kind]
            attached = f"no {noun} is" if count == 0 else f"1 {noun} is" if count == 1 else f"{count} {noun}s are"
            raise TagMismatchError(f"the question has {len(numbers)} {kind} tag{'s' if len(numbers) != 1 else ''} "
                                   f"({written}) but {attached} attached")
        if numbers != list(range(1, count + 1)):
            expected = " ".join(f"<|{kind}_{n}|>" for n in range(1, count + 1))
            raise TagMismatchError(f"{kind} tags must be {expected} in this order (one per attached file)")


def tagged(parts: Sequence[str | Media]) -> str:
    """The text of a question made of `parts` in order: texts (consecutive ones joined by a newline) and media, each
    image or clip tagged where it stands (``<|image_N|>``, ``<|audio_N|>``, numbered per kind) unless the texts write
    their own tags of its kind (then one per file, in order: check_tags)."""
    texts = "".join(part for part in parts if isinstance(part, str))
    written = {kind for kind, _ in _TAG.findall(texts)}
    pieces: list[str] = []
    counts = {"image": 0, "audio": 0}
    previous_text = False
    for part in parts:
        if isinstance(part, str):
            if previous_text:
                pieces.append("\n")
            pieces.append(part)
        elif part.kind not in written:
            counts[part.kind] += 1
            pieces.append(f"<|{part.kind}_{counts[part.kind]}|>")
        previous_text = isinstance(part, str)
    return "".join(pieces)


def user_content(turn: Turn, first_image: int = 1, first_audio: int = 1) -> str:
    """The user text of `turn`, its files tagged before the text unless it writes its own tags (tagged), numbered
    from `first_image` / `first_audio` (tags count across the whole conversation; the runtime takes files in order
    of appearance)."""
    text = tagged([*turn.images, *turn.audios, turn.user]) if turn.images or turn.audios else turn.user
    offsets = {"image": first_image - 1, "audio": first_audio - 1}
    return _TAG.sub(lambda m: f"<|{m[1]}_{int(m[2]) + offsets[m[1]]}|>", text)


def build_prompt(turns: Sequence[Turn | str], system: str | None = None, header: str | None = None) -> str:
    """The Phi-4 chat prompt: ``<|system|>…<|end|>`` then ``<|user|>…<|end|><|assistant|>answer<|end|>`` per turn,
    ending with ``<|assistant|>`` after the last (unanswered) question. Plain strings are questions without media.
    `header`, when given, is the rendered system message (with its tools) and replaces the one made of `system`."""
    parts = [header] if header is not None else [f"<|system|>{system}{END}"] if system else []
    images = audios = 0
    for i, turn in enumerate(turns):
        turn = Turn(turn) if isinstance(turn, str) else turn
        parts.append(user_turn(user_content(turn, images + 1, audios + 1), turn.role))
        images += len(turn.images)
        audios += len(turn.audios)
        if turn.assistant is not None:
            parts.append(f"{turn.assistant}{END}")
        elif i != len(turns) - 1:
            raise ValueError("only the last turn may be unanswered")
    return "".join(parts)


def user_turn(content: str, role: str = USER) -> str:
    """One question in the chat format, ending with the assistant's cue."""
    return f"<|{role}|>{content}{END}{ASSISTANT}"


def tool_results(results: Sequence[str]) -> str:
    """The content of a tool turn holding `results` (one ``<|tool|>…<|end|>`` each once rendered)."""
    return f"{END}<|{TOOL}|>".join(results)
