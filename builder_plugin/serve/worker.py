"""One thread owns the Chats and answers the requests, time-sliced: the runtime runs phi4mm with batch size 1, so the
answers in progress take turns on it, a prefill or one token each, so a request that arrives while a long answer
streams waits for about one token of each answer in progress before its own prefill, and its tokens then alternate
with theirs (decode is memory-bound: two answers at once make about as many tokens per second in all as one).

Each request is a Job; the worker reports to it through `emit` (called on the worker thread) with Started, Piece,
Finished or Failed events, so no request ever sees another's tokens. Each answer in progress has a conversation of
its own in the ConversationPool (its generator), up to the pool's size; more requests wait in the queue."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from builder_plugin import runtime
from builder_plugin.runtime import Answering
from builder_plugin.serve.errors import ApiError, queue_full, server_error, shutting_down
from builder_plugin.serve.events import Event, Failed, Finished, Piece, Started, ToolCalls
from builder_plugin.serve.pool import ConversationPool, Slot
from builder_plugin.serve.protocol import ChatRequest, Exchange, Prompt
from builder_plugin.serve.stop import StopScanner
from builder_plugin.serve.tools import CallScanner

log = logging.getLogger("builder_plugin.serve")

DRAIN_MARGIN_S = 5.0  # past the drain deadline: the last token step of each answer, and its final events


@dataclass
class Job:
    request: ChatRequest
    exchange: Exchange | Prompt  # the request's messages, their media decoded; or a raw prompt
    emit: Callable[[Event], None]
    max_new_tokens: int | None = None  # None: up to the maximum length
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop answering (client gone): skipped if still queued, stopped at its next turn if running."""
        self.cancelled.set()


@dataclass
class _Running:
    """An answer in progress: its job, the conversation it runs in, and what its stream has seen so far."""

    job: Job
    slot: Slot
    answer: Answering
    stops: StopScanner
    calls: CallScanner | None


class Worker:
    def __init__(self, pool: ConversationPool, max_queue: int) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.pool = pool
        self.max_queue = max_queue
        self._waiting: deque[Job] = deque()
        self._running: list[_Running] = []
        self._beginning = 0  # requests whose prompt is being prepared (not yet running)
        self._lock = threading.Condition()  # guards the three above and the stop state
        self._stopping = False
        self._drain_deadline: float | None = None  # answers in progress after it end with finish_reason "length"
        self._thread = threading.Thread(target=self._run, name="chat-worker", daemon=True)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def answering(self) -> int:
        """Requests being answered (their prompt prepared, prefilled or generated)."""
        with self._lock:
            return len(self._running) + self._beginning

    @property
    def busy(self) -> bool:
        return self.answering > 0

    @property
    def stopping(self) -> bool:
        """Draining or stopped: new requests get 503."""
        with self._lock:
            return self._stopping

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; raises ApiError 429 when `max_queue` requests are already waiting, 503 when stopping."""
        with self._lock:
            if self._stopping:
                raise shutting_down()
            if len(self._waiting) >= self.max_queue:
                raise queue_full(self.max_queue)
            self._waiting.append(job)
            self._lock.notify()

    def drain(self, grace_s: float, wait: bool = False) -> None:
        """Take no more requests, fail the waiting ones (503), and let the answers in progress go on for up to
        `grace_s` seconds; those still running then end as if cut by their token limit (finish_reason "length").
        With `wait`, return once they have ended."""
        with self._lock:
            self._stopping = True
            deadline = time.monotonic() + grace_s
            self._drain_deadline = min(deadline, self._drain_deadline or deadline)
            waiting, self._waiting = list(self._waiting), deque()
            self._lock.notify()
        for job in waiting:
            job.emit(Failed(shutting_down()))
        if wait and self._thread.is_alive():
            self._thread.join(timeout=grace_s + DRAIN_MARGIN_S)

    def stop(self) -> None:
        """End every answer now (see drain) and the thread, and free the kept conversations."""
        self.drain(0)
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.pool.close()

    # ---- the scheduling loop -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._running and not self._waiting and not self._stopping:
                    self._lock.wait()
                if self._stopping and not self._running and not self._waiting:
                    return
            self._admit()
            with self._lock:
                running = list(self._running)
            for run in running:
                try:
                    done = self._turn(run)
                except Exception as exc:  # a bug here must not stop the worker: the other requests are served
                    log.exception("request failed")
                    run.job.emit(Failed(server_error(f"internal error: {type(exc).__name__}: {exc}")))
                    done = True
                if done:
                    self._end(run)

    def _admit(self) -> None:
        """Start the waiting requests that have a conversation to run in (and room in the KV budget)."""
        while True:
            with self._lock:
                while self._waiting and self._waiting[0].cancelled.is_set():
                    self._waiting.popleft()
                if not self._waiting:
                    return
                if self._running and self.pool.busy_kv_bytes >= self.pool.kv_budget_bytes:
                    return  # the answers in progress fill the budget: the next one waits for one to end
                job = self._waiting[0]
                exchange = job.exchange
                slot = self.pool.acquire(exchange.system, job.request.tools_text, exchange.history,
                                         exchange.question)
                if slot is None:
                    return
                self._waiting.popleft()
                self._beginning += 1
            run = None
            try:
                run = self._begin(job, slot)
            except Exception as exc:
                log.exception("request failed")
                job.emit(Failed(server_error(f"internal error: {type(exc).__name__}: {exc}")))
            with self._lock:
                self._beginning -= 1
                if run is not None:  # first in the round: its prefill does not wait for the others' turns
                    self._running.insert(0, run)
            if run is None:
                self.pool.release(slot)

    def _begin(self, job: Job, slot: Slot) -> _Running | None:
        """The slot's Chat set to the request's conversation, its answer prepared (and the KV budget reserved for it):
        prefilled on its first turn. None when the request failed (reported to it)."""
        chat, request, exchange = slot.chat, job.request, job.exchange
        guidance, guided_by = request.guidance, request.format_field
        max_new_tokens = job.max_new_tokens or chat.max_length
        try:
            if isinstance(exchange, Prompt):
                answer = chat.prepare_prompt(exchange.text, max_new_tokens=max_new_tokens, sampling=request.sampling,
                                             logprobs=request.logprobs)
                return self._started(job, slot, answer)
            chat.resume(exchange.system, request.tools_text, exchange.history)
            if request.tools is not None and request.tools.constrained:
                tools = request.tools
                guidance, guided_by = chat.tool_guidance(tools.grammar_functions(), tools.single_call), "tools"
            answer = chat.prepare(exchange.question, max_new_tokens=max_new_tokens, sampling=request.sampling,
                                  guidance=guidance, logprobs=request.logprobs)
        except runtime.ChatError as exc:
            job.emit(Failed(chat_error(exc, guided_by, request.prompt_field)))
            return None
        return self._started(job, slot, answer)

    def _started(self, job: Job, slot: Slot, answer: Answering) -> _Running:
        request = job.request
        self.pool.reserve(slot, answer.kv_tokens)
        job.emit(Started())
        return _Running(job, slot, answer, StopScanner(request.stops),
                        CallScanner() if request.tools is not None else None)

    def _turn(self, run: _Running) -> bool:
        """Run the answer for one token (its first turn: the prefill and the first token); True when it ended."""
        job = run.job
        if job.cancelled.is_set():
            return True
        deadline = self._drain_deadline
        if deadline is not None and time.monotonic() >= deadline:
            self._finish(run, stopped=False, reason="length")
            return True
        try:
            step = next(run.answer)
        except StopIteration:
            self._finish(run, stopped=False)
            return True
        except runtime.ChatError as exc:
            job.emit(Failed(chat_error(exc, job.request.format_field, job.request.prompt_field)))
            return True
        text, stopped = run.stops.feed(step.text)
        if run.calls is not None:
            text = run.calls.feed(text)
        logprobs = (step.logprob,) if step.logprob is not None else ()
        if text or logprobs:
            job.emit(Piece(text, logprobs))
        if stopped:
            self._finish(run, stopped=True)
            return True
        return False

    def _finish(self, run: _Running, stopped: bool, reason: str | None = None) -> None:
        """The end of an answer: what the scanners held back, the tool calls found, and the Finished event."""
        job, tools, calls = run.job, run.job.request.tools, run.calls
        run.answer.close()  # stops generation; the answer so far is recorded in the conversation
        stats = run.answer.stats
        cut = reason == "length" or (reason is None and not stopped and stats.finish_reason == "length")
        tail = "" if stopped else run.stops.flush()
        found: list[dict] = []
        if calls is not None and tools is not None:
            tail = calls.feed(tail)
            more, found = calls.finish(tools.names(), tools.single_call, cut)
            tail += more
        if tail:
            job.emit(Piece(tail))
        if found:
            job.emit(ToolCalls(found))
        reason = reason or ("tool_calls" if found else "stop" if stopped else stats.finish_reason)
        job.emit(Finished(reason, stats.prompt_tokens, stats.new_tokens))

    def _end(self, run: _Running) -> None:
        run.answer.close()
        with self._lock:
            self._running.remove(run)
        self.pool.release(run.slot)
        if run.job.cancelled.is_set() and self.stopping:
            run.job.emit(Failed(shutting_down()))


def chat_error(exc: runtime.ChatError, guided_by: str = "response_format", prompt: str = "messages") -> ApiError:
    """The API error for a runtime error (`guided_by`: the field whose grammar a GuidanceError is about; `prompt`:
    the field of the conversation)."""
    message = str(exc)
    if isinstance(exc, runtime.GuidanceError):
        return ApiError(f"{guided_by}: {message}", param=guided_by, code="invalid_schema")
    if isinstance(exc, runtime.ToolsNotSupportedError):
        return ApiError(f"tools: {message}", param="tools", code="tools_not_supported")
    if isinstance(exc, runtime.PromptTooLongError):  # the advice names the server's option, not the Python API's
        return ApiError(f"{exc.summary}; send a shorter conversation, or start the server with a larger --max-length",
                        param=prompt, code="context_length_exceeded")
    if isinstance(exc, runtime.TagMismatchError):
        return ApiError(message, param=prompt, code="invalid_media_tags")
    if isinstance(exc, runtime.UnsupportedMediaError | runtime.MediaNotFoundError):
        return ApiError(message, param=getattr(exc, "source", None) or prompt, code="invalid_media")
    if isinstance(exc, runtime.PackageError):
        return server_error(message)
    return ApiError(message)
