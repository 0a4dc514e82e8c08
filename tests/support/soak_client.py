"""One client thread of a soak run: sends a Step with the official openai client (raw HTTP only for a malformed body)
and checks the shape of what comes back; anything unexpected raises Unexpected."""

from __future__ import annotations

import contextlib
import json

import httpx
import openai

from tests.support.soak_traffic import CANCEL_MAX_TOKENS, Answer, BadCase, Step

ERROR_FIELDS = {"message", "type", "param", "code"}


class Unexpected(Exception):
    """The server's reply was not what the request must get."""


class SoakClient:
    def __init__(self, url: str, model_id: str, max_tokens: int) -> None:
        self.url = url
        self.model_id = model_id
        self.max_tokens = max_tokens
        self.openai = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        self.http = httpx.Client()

    def close(self) -> None:
        self.openai.close()
        self.http.close()

    def send(self, step: Step, timeout: float) -> Answer | None:
        """The answer of a checked step; None for a cancelled or refused one (raises Unexpected when it went
        wrong)."""
        client = self.openai.with_options(timeout=timeout)
        if step.kind == "bad":
            assert step.bad is not None
            self._refused(client, step.bad, step.stream, timeout)
            return None
        if step.kind == "cancelled":
            self._cancel(client, step)
            return None
        if step.stream:
            return self._streamed(client, step)
        response = client.chat.completions.create(model=self.model_id, messages=step.messages,
                                                  max_tokens=self.max_tokens)
        choice = response.choices[0]
        usage = response.usage
        if response.object != "chat.completion" or choice.message.role != "assistant" or usage is None \
                or usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
            raise Unexpected(f"a malformed completion: {response.model_dump_json()[:300]}")
        return Answer(choice.message.content or "", choice.finish_reason, usage.prompt_tokens,
                      usage.completion_tokens)

    def _streamed(self, client: openai.OpenAI, step: Step) -> Answer:
        chunks = list(client.chat.completions.create(model=self.model_id, messages=step.messages, stream=True,
                                                     stream_options={"include_usage": True},
                                                     max_tokens=self.max_tokens))
        if len(chunks) < 3:
            raise Unexpected(f"a stream of {len(chunks)} chunks")
        *content, final, usage_chunk = chunks
        shape = [
            all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks),
            bool(content[0].choices) and content[0].choices[0].delta.role == "assistant",
            all(c.choices and c.choices[0].finish_reason is None for c in content),
            bool(final.choices) and final.choices[0].finish_reason is not None,
            usage_chunk.choices == [] and usage_chunk.usage is not None,
        ]
        if not all(shape):
            raise Unexpected(f"a malformed stream (checks {shape}): "
                             f"{[c.model_dump(exclude_none=True) for c in chunks][:4]}")
        text = "".join(c.choices[0].delta.content or "" for c in content)
        usage = usage_chunk.usage
        return Answer(text, final.choices[0].finish_reason, usage.prompt_tokens, usage.completion_tokens)

    def _cancel(self, client: openai.OpenAI, step: Step) -> None:
        """Open a stream, read a chunk or two, and close it (the server must stop generating)."""
        stream = client.chat.completions.create(model=self.model_id, messages=step.messages, stream=True,
                                                max_tokens=CANCEL_MAX_TOKENS)
        with contextlib.closing(stream):
            read = 0
            for _ in stream:
                read += 1
                if read >= step.chunks_before_cancel:
                    break
        if read == 0:
            raise Unexpected("the stream to cancel sent no chunk")

    def _refused(self, client: openai.OpenAI, case: BadCase, stream: bool, timeout: float) -> None:
        if case.raw is not None:
            response = self.http.post(f"{self.url}/chat/completions", content=case.raw, timeout=timeout,
                                      headers={"content-type": "application/json"})
            status, body = response.status_code, response.content
        else:
            fields = {"model": self.model_id, "max_tokens": self.max_tokens, **case.fields}
            try:
                answer = client.chat.completions.create(**fields, stream=stream)
            except openai.APIStatusError as exc:
                status, body = exc.status_code, exc.response.content
            else:
                if stream:
                    answer.close()
                raise Unexpected(f"{case.name}: answered instead of refused")
        check_error(case, status, body)


def check_error(case: BadCase, status: int, body: bytes) -> None:
    """The status, and OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        raise Unexpected(f"{case.name}: {status} with a body that is not an OpenAI error: {body[:200]!r}") from None
    if status != case.status or error.get("code") != case.code:
        raise Unexpected(f"{case.name}: {status} {error.get('code')!r}, expected {case.status} {case.code!r}: "
                         f"{error.get('message')!r}")
    message = error.get("message")
    if set(error) != ERROR_FIELDS or not isinstance(message, str) or "\n" in message \
            or not isinstance(error.get("type"), str) or case.fragment not in message:
        raise Unexpected(f"{case.name}: a malformed error {error!r}")
