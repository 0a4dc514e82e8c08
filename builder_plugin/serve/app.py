"""The ASGI app: /v1/chat/completions, /v1/responses and /v1/completions (JSON or server-sent events), /v1/models,
/health, /metrics and the chat page (/), in front of one Worker that answers in the kept conversations of a
ConversationPool; with API keys, every route but /health and the page needs one; with allowed origins, browsers on
them may call it (CORS)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from builder_plugin.runtime import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Chat, Package, TokenLogprob
from builder_plugin.serve import defaults
from builder_plugin.serve.auth import OPEN, BearerAuth, check_keys
from builder_plugin.serve.completions import CompletionWriter, parse_completion
from builder_plugin.serve.cors import check_origins, cors_middleware
from builder_plugin.serve.errors import ApiError
from builder_plugin.serve.events import Collected, Event, Failed, Finished, Piece, Started, ToolCalls
from builder_plugin.serve.media import MediaCache, MediaReader
from builder_plugin.serve.metrics import CountChatResponses, Metrics
from builder_plugin.serve.page import ChatPage
from builder_plugin.serve.pool import ConversationPool, available_memory, default_kv_budget
from builder_plugin.serve.protocol import (
    ChatRequest,
    ChatWriter,
    Exchange,
    Prompt,
    Writer,
    parse_messages,
    parse_request,
)
from builder_plugin.serve.requestlog import AnswerRecord, RequestLog, answer_record
from builder_plugin.serve.responses import ResponseStore, ResponsesWriter, not_found, parse_responses
from builder_plugin.serve.worker import Job, Worker

log = logging.getLogger("builder_plugin.serve")

MB = 1 << 20


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class Server:
    """The routes and the state they share: the opened package, its conversations in the pool behind one Worker, the
    media cache and the limits. `kv_budget_bytes` None: the pool's default (pool.default_kv_budget); `ui`: serve the
    chat page; `allowed_origins`: the browser origins that may call the server (none: CORS is off; `*`: any);
    `log_requests`: a log line per request (requestlog.py); `new_chat` makes the pool's Chats (a test may hold
    them)."""

    def __init__(self, package: Package, media_cache: MediaCache, *, model_id: str | None = None,
                 max_queue: int = defaults.MAX_QUEUE, max_body_bytes: int = 32 * MB, allow_local_files: bool = False,
                 max_tokens: int | None = None, max_conversations: int = defaults.MAX_CONVERSATIONS,
                 kv_budget_bytes: int | None = None, api_keys: Sequence[str] = (), ui: bool = True,
                 allowed_origins: Sequence[str] = (), log_requests: bool = False,
                 stored_responses: int = defaults.STORED_RESPONSES, image_detail: str = defaults.IMAGE_DETAIL,
                 new_chat: Callable[[Package], Chat] = Chat) -> None:
        self.package = package
        self.model_id = model_id or package.dir.resolve().name
        self.media_cache = media_cache
        self.max_body_bytes = max_body_bytes
        self.allow_local_files = allow_local_files
        self.image_detail = image_detail  # what an image's detail "auto" (or none) means
        self.max_tokens = max_tokens  # of a request without max_tokens (None: up to the maximum length)
        budget = kv_budget_bytes or default_kv_budget(package, max_conversations, available_memory())
        self.pool = ConversationPool(package, max_conversations, budget, new_chat)
        self.worker = Worker(self.pool, max_queue)
        self.api_keys = check_keys(api_keys)  # none: every request is accepted
        self.page = ChatPage() if ui else None
        self.allowed_origins = check_origins(allowed_origins)
        self.log_requests = log_requests
        self.stored = ResponseStore(stored_responses)  # /v1/responses kept for previous_response_id
        self.metrics = Metrics(queue_depth=lambda: self.worker.waiting, active_requests=lambda: self.worker.answering,
                               live_conversations=lambda: self.pool.live_conversations,
                               kv_bytes=lambda: self.pool.kv_bytes,
                               kv_usage=lambda: min(1.0, self.pool.kv_bytes / self.pool.kv_budget_bytes),
                               model_name=self.model_id)

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            self.worker.start()
            try:
                yield
            finally:
                await run_in_threadpool(self.worker.stop)
                self.media_cache.close()  # nothing a client sent outlives the server

        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.response, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
            *(self.page.routes() if self.page is not None else ()),
        ]
        handlers = {HTTPException: _http_error, ApiError: _api_error, ClientGone: _client_gone,
                    Exception: _unexpected_error}
        # outermost: the request log (it sees every status sent), then CORS, which answers preflights (never counted
        # nor asked for a key) and adds its headers to every answer
        middleware = [Middleware(RequestLog)] if self.log_requests else []
        if self.allowed_origins:
            middleware.append(cors_middleware(self.allowed_origins))
        middleware.append(Middleware(CountChatResponses, metrics=self.metrics))  # it also counts the 401s
        if self.api_keys:
            open_paths = OPEN | (self.page.open_paths if self.page is not None else frozenset())
            middleware.append(Middleware(BearerAuth, keys=self.api_keys, open_paths=open_paths))
        return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware, lifespan=lifespan)

    # ---- routes --------------------------------------------------------------------------------------------------

    async def health(self, _: Request) -> Response:
        """Readiness: 200 while requests are taken, 503 once a stop signal drains the server."""
        draining = self.worker.stopping
        body = {"status": "draining" if draining else "ok", "model": self.model_id, "busy": self.worker.busy,
                "answering": self.worker.answering, "waiting": self.worker.waiting, "max_queue": self.worker.max_queue,
                "conversations": self.pool.live_conversations, "max_conversations": self.pool.max_conversations,
                "kv_bytes": self.pool.kv_bytes, "kv_budget_bytes": self.pool.kv_budget_bytes}
        return JSONResponse(body, status_code=503 if draining else 200)

    async def metrics_text(self, _: Request) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model_id"] != self.model_id:
            raise _unknown_model(request.path_params["model_id"])
        return JSONResponse(self._model_card())

    async def chat_completions(self, request: Request) -> Response:
        received = time.perf_counter()
        parsed = parse_request(await self._read_body(request))
        self._check_model(parsed.model)
        exchange = await self._exchange(parsed, parsed.messages)
        return await self._answer(request, parsed, exchange, received, ChatWriter(self.model_id, parsed))

    async def completions(self, request: Request) -> Response:
        received = time.perf_counter()
        parsed = parse_completion(await self._read_body(request))
        self._check_model(parsed.request.model)
        return await self._answer(request, parsed.request, parsed.prompt, received,
                                  CompletionWriter(self.model_id, parsed))

    async def responses(self, request: Request) -> Response:
        received = time.perf_counter()
        parsed = parse_responses(await self._read_body(request), self.stored)
        self._check_model(parsed.request.model)
        exchange = await self._exchange(parsed.request, parsed.request.messages, parsed.where)
        return await self._answer(request, parsed.request, exchange, received,
                                  ResponsesWriter(self.model_id, parsed, self.stored))

    async def response(self, request: Request) -> Response:
        stored = self.stored.get(request.path_params["response_id"])
        if stored is None:
            raise not_found(request.path_params["response_id"])
        return JSONResponse(stored.body)

    async def _exchange(self, parsed: ChatRequest, messages: Sequence[dict[str, Any]],
                        where: Sequence[str] | None = None) -> Exchange:
        """The conversation of `messages` (media decoded off the event loop); raises ApiError (400)."""
        if parsed.tools is not None and not await run_in_threadpool(self._has_tool_tokens):
            raise ApiError(f"tools: this model's tokenizer has no tool-call tokens ({TOOL_CALL_OPEN}, "
                           f"{TOOL_CALL_CLOSE}), so it cannot call tools", param="tools", code="tools_not_supported")
        media = MediaReader(self.media_cache, self.allow_local_files, self.package.crop_side, self.image_detail)
        exchange = await run_in_threadpool(parse_messages, messages, media, where, parsed.prompt_field)
        if exchange.has_audio and not self.package.has_speech:
            raise ApiError("this model has no speech encoder, so it cannot take audio", param=parsed.prompt_field,
                           code="audio_not_supported")
        return exchange

    async def _answer(self, request: Request, parsed: ChatRequest, exchange: Exchange | Prompt, received: float,
                      writer: Writer) -> Response:
        """Queue the answer and give it in the writer's form, as one JSON body or as server-sent events; raises
        ApiError (429, 503, or the answer's own error when it fails before it starts).
        `received`: the perf_counter time the request arrived (of the time-to-first-token metric)."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        emit = _recording(self.metrics, received, _emitter(asyncio.get_running_loop(), events),
                          answer_record(request.scope))
        job = Job(parsed, exchange, emit, max_new_tokens=parsed.max_new_tokens or self.max_tokens)
        self.worker.submit(job)
        if parsed.stream:
            first = await _until_disconnect(request, job, events.get())
            if isinstance(first, Failed):
                raise first.error
            return StreamingResponse(_stream(job, events, writer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        answer = await _until_disconnect(request, job, _collect(events))
        return JSONResponse(writer.body(answer))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise _unknown_model(model)

    # ---- helpers -------------------------------------------------------------------------------------------------

    def _has_tool_tokens(self) -> bool:
        return self.package.load(self.package.main_decoder).tokens.tool_call is not None

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.package.built_at, "owned_by": "builder_plugin",
                "max_tokens": self.max_tokens or self.package.max_length, "max_length": self.package.max_length}

    async def _read_body(self, request: Request) -> bytes:
        too_large = ApiError(f"the request body is larger than the limit of {self.max_body_bytes / MB:g} MB "
                             f"(--max-body-mb)", 413, code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Event]):
    def emit(event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone, nobody listens
            loop.call_soon_threadsafe(events.put_nowait, event)

    return emit


def _recording(metrics: Metrics, received: float, emit: Callable[[Event], None],
               record: AnswerRecord | None) -> Callable[[Event], None]:
    """`emit`, recording in `metrics` (and in the request log's `record`, when requests are logged) the answer's time
    to its first piece, and when it finishes its tokens and its time per token after the first (called on the worker
    thread, as the events are made)."""
    first_piece: float | None = None

    def recording_emit(event: Event) -> None:
        nonlocal first_piece
        if isinstance(event, Piece) and first_piece is None:
            first_piece = time.perf_counter()
            metrics.first_token(first_piece - received)
        elif isinstance(event, Finished):
            metrics.tokens(event.prompt_tokens, event.completion_tokens)
            mean = None
            if first_piece is not None and event.completion_tokens > 1:
                mean = (time.perf_counter() - first_piece) / (event.completion_tokens - 1)
                for _ in range(event.completion_tokens - 1):
                    metrics.token_interval(mean)
            if record is not None:
                record.prompt_tokens, record.completion_tokens = event.prompt_tokens, event.completion_tokens
                record.first_token_s = first_piece - received if first_piece is not None else None
                record.tokens_per_s = 1 / mean if mean else None
        emit(event)

    return recording_emit


async def _collect(events: asyncio.Queue[Event]) -> Collected:
    pieces: list[str] = []
    calls: list[dict[str, Any]] = []
    logprobs: list[TokenLogprob] = []
    while True:
        event = await events.get()
        if isinstance(event, Piece):
            pieces.append(event.text)
            logprobs.extend(event.logprobs)
        elif isinstance(event, ToolCalls):
            calls.extend(event.calls)
        elif isinstance(event, Finished):
            return Collected("".join(pieces), event, calls, logprobs)
        elif isinstance(event, Failed):
            raise event.error


async def _until_disconnect(request: Request, job: Job, awaitable: Any) -> Any:
    """Await `awaitable`; if the client disconnects first, cancel the job (its generation stops at the next token)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            job.cancel()
    if not work.done() or work.cancelled():
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(job: Job, events: asyncio.Queue[Event], writer: Writer) -> AsyncIterator[str]:
    """The answer's server-sent events in the writer's form. Starlette cancels this when the client disconnects; the
    job is then cancelled too."""
    try:
        for text in writer.opening():
            yield text
        while True:
            event = await events.get()
            if isinstance(event, Piece):
                out = writer.piece(event)
            elif isinstance(event, ToolCalls):
                out = writer.calls(event)
            elif isinstance(event, Finished):
                out = writer.finished(event)
            elif isinstance(event, Failed):
                out = writer.failed(event.error)
            elif isinstance(event, Started):
                continue
            else:
                raise TypeError(f"unexpected event {event!r}")
            for text in out:
                yield text
            if isinstance(event, Finished | Failed):
                break
        for text in writer.closing():
            yield text
    finally:
        job.cancel()


def _unknown_model(model: str) -> ApiError:
    return ApiError(f"model {model!r} is not served here (GET /v1/models lists the one that is)", 404,
                    param="model", code="model_not_found")


async def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    log.warning("%d %s", exc.status, exc.message)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse(ApiError(exc.detail, exc.status_code).body(), status_code=exc.status_code)


async def _client_gone(_: Request, __: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; the status is for the access log


async def _unexpected_error(_: Request, exc: Exception) -> Response:
    log.exception("request failed")
    error = ApiError(f"internal error: {type(exc).__name__}: {exc}", 500, type="server_error")
    return JSONResponse(error.body(), status_code=500)
