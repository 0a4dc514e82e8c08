"""Errors a user can fix, each with a one-line message."""

from __future__ import annotations


class ChatError(RuntimeError):
    """A problem the user can fix, with a one-line message."""


class PackageError(ChatError):
    """The package folder cannot be loaded."""


class MediaNotFoundError(ChatError):
    """An image or audio file does not exist."""


class UnsupportedMediaError(ChatError):
    """An image or audio file cannot be read (`source` names it: a path, or a request's part)."""

    def __init__(self, message: str, source: str | None = None) -> None:
        super().__init__(message)
        self.source = source


class TagMismatchError(ChatError):
    """The ``<|image_N|>`` / ``<|audio_N|>`` tags of a question do not match its attached files."""


class PromptTooLongError(ChatError):
    """The conversation does not fit in the maximum length. `summary` says by how much; the message adds what to do
    through the Python API (a command line says its own option instead)."""

    ADVICE = "start over (clear) or raise max_length"

    def __init__(self, summary: str) -> None:
        super().__init__(f"{summary}; {self.ADVICE}")
        self.summary = summary


class GuidanceError(ChatError):
    """The runtime's grammar compiler refused a schema, pattern or grammar."""


class ToolsNotSupportedError(ChatError):
    """The package's tokenizer has no tool tokens, or its chat template no tools branch."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
