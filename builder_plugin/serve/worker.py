"""One thread owns the Chat and answers queued requests one at a time (the runtime runs phi4mm with batch size 1).

Each request is a Job; the worker reports to it through `emit` (called on the worker thread) with Started, Piece,
Finished or Failed events, so no request ever sees another's tokens."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from builder_plugin import runtime
from builder_plugin.runtime import Chat, Guidance, Sampling, TokenLogprob
from builder_plugin.serve.errors import ApiError, queue_full, server_error, shutting_down
from builder_plugin.serve.protocol import Conversation
from builder_plugin.serve.stop import StopScanner
from builder_plugin.serve.tools import CallScanner, Tools

log = logging.getLogger("builder_plugin.serve")


@dataclass(frozen=True)
class Started:
    """The question was accepted by the runtime; pieces follow."""


@dataclass(frozen=True)
class Piece:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens generated since the last piece


@dataclass(frozen=True)
class ToolCalls:
    calls: list[dict]  # OpenAI tool_calls, complete


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (end of answer or a stop string), "length" or "tool_calls"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Started | Piece | ToolCalls | Finished | Failed


@dataclass
class Job:
    conversation: Conversation
    emit: Callable[[Event], None]
    max_new_tokens: int | None = None  # None: up to the maximum length
    sampling: Sampling = field(default_factory=Sampling)
    stops: tuple[str, ...] = ()
    labels: dict[Path, str] = field(default_factory=dict)  # media file -> its place in the request
    guidance: Guidance | None = None  # response_format
    tools: Tools | None = None
    logprobs: int | None = None  # alternatives per token when log-probabilities are asked for
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop answering (client gone): skipped if still queued, stopped at the next token if running."""
        self.cancelled.set()


class Worker:
    def __init__(self, chat: Chat, max_queue: int) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.chat = chat
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._current: Job | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chat-worker", daemon=True)

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; raises ApiError 429 when `max_queue` requests are already waiting."""
        if self._stopping.is_set():
            raise shutting_down()
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise queue_full(self.max_queue) from None

    def stop(self) -> None:
        """Fail the waiting jobs, stop the running one at its next token, and end the thread."""
        self._stopping.set()
        if self._current is not None:
            self._current.cancel()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit(Failed(shutting_down()))
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            self._current = job
            try:
                self._answer(job)
            except Exception as exc:  # a bug here must not stop the worker: the next request is served
                log.exception("request failed")
                job.emit(Failed(server_error(f"internal error: {type(exc).__name__}: {exc}")))
            finally:
                self._current = None

    def _answer(self, job: Job) -> None:
        chat = self.chat
        conversation = job.conversation
        question = conversation.question
        tools = job.tools if job.tools is not None and job.tools.offered else None
        guidance, guided_by = job.guidance, "response_format"
        try:
            tools_text = tools.template_text() if tools is not None else None
            if chat.system != conversation.system or chat.tools != tools_text:
                chat.system, chat.tools = conversation.system, tools_text
                chat.clear()
            if tools is not None and tools.constrained:
                guidance, guided_by = chat.tool_guidance(tools.grammar_functions(), tools.single_call), "tools"
            chat.restore(conversation.history)
            pieces = chat.ask(question.user, question.images, question.audios,
                              max_new_tokens=job.max_new_tokens or chat.max_length, sampling=job.sampling,
                              guidance=guidance, logprobs=job.logprobs, role=question.role)
        except runtime.ChatError as exc:
            job.emit(Failed(chat_error(exc, job.labels, guided_by)))
            return
        job.emit(Started())
        scanner = StopScanner(job.stops)
        calls = CallScanner() if tools is not None else None
        stopped = False
        sent = 0  # log-probabilities sent so far
        found: list[dict] = []
        try:
            for piece in pieces:
                if job.cancelled.is_set():
                    if self._stopping.is_set():
                        job.emit(Failed(shutting_down()))
                    return
                text, stopped = scanner.feed(piece)
                if calls is not None:
                    text = calls.feed(text)
                logprobs = tuple(chat.last_logprobs[sent:]) if job.logprobs is not None else ()
                sent += len(logprobs)
                if text or logprobs:
                    job.emit(Piece(text, logprobs))
                if stopped:
                    break
            tail = "" if stopped else scanner.flush()
            if calls is not None:
                tail = calls.feed(tail)
                more, found = calls.finish(tools.names(), tools.single_call)
                tail += more
            if tail:
                job.emit(Piece(tail))
            if found:
                job.emit(ToolCalls(found))
        except runtime.ChatError as exc:
            job.emit(Failed(chat_error(exc, job.labels)))
            return
        finally:
            pieces.close()  # stops generation; the answer so far is recorded in chat.turns
        stats = chat.last_stats
        reason = "tool_calls" if found else "stop" if stopped else stats.finish_reason
        job.emit(Finished(reason, stats.prompt_tokens, stats.new_tokens))


def chat_error(exc: runtime.ChatError, labels: dict[Path, str], guided_by: str = "response_format") -> ApiError:
    """The API error for a runtime error; cache paths in its message are replaced by their place in the request
    (`guided_by`: the field whose grammar a GuidanceError is about)."""
    message = str(exc)
    param = None
    for path, label in labels.items():
        if str(path) in message:
            message = message.replace(str(path), label)
            param = param or label
    if isinstance(exc, runtime.GuidanceError):
        return ApiError(f"{guided_by}: {message}", param=guided_by, code="invalid_schema")
    if isinstance(exc, runtime.ToolsNotSupportedError):
        return ApiError(f"tools: {message}", param="tools", code="tools_not_supported")
    if isinstance(exc, runtime.PromptTooLongError):  # the advice names the server's option, not the Python API's
        return ApiError(f"{exc.summary}; send a shorter conversation, or start the server with a larger --max-length",
                        param="messages", code="context_length_exceeded")
    if isinstance(exc, runtime.TagMismatchError):
        return ApiError(message, param="messages", code="invalid_media_tags")
    if isinstance(exc, runtime.UnsupportedMediaError | runtime.MediaNotFoundError):
        return ApiError(message, param=param, code="invalid_media")
    if isinstance(exc, runtime.PackageError):
        return server_error(message)
    return ApiError(message)
