"""/v1/completions: a plain prompt given to the model as written (no chat template, no history), answered through the
worker like a chat request (runtime.Chat.prepare_prompt); the text_completion bodies and chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from builder_plugin.runtime import MAX_TOP_LOGPROBS, TokenLogprob
from builder_plugin.serve.errors import ApiError
from builder_plugin.serve.events import Collected, Finished, Piece, sse
from builder_plugin.serve.fields import COMPLETIONS
from builder_plugin.serve.protocol import (
    ChatRequest,
    Prompt,
    RequestFields,
    StreamOptions,
    Writer,
    read_request,
    stop_strings,
    usage,
)

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's (and vLLM's) for a completion without max_tokens


class CompletionRequestFields(RequestFields):
    prompt: str | list[Any]
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1)
    stop: str | list[str] | None = None
    n: int = 1
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


@dataclass(frozen=True)
class CompletionRequest:
    request: ChatRequest  # what the worker reads (no messages, tools or guidance)
    prompt: Prompt
    echo: bool


def parse_completion(body: bytes) -> CompletionRequest:
    """The request in `body`; raises ApiError (400) naming the first problem."""
    fields = read_request(body, COMPLETIONS, CompletionRequestFields)
    prompt = fields.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise ApiError("prompt: a string, or a list of one string (a batch of prompts, or token ids, is not "
                           "supported)", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError("prompt: must not be empty", param="prompt")
    if fields.echo and fields.logprobs is not None:
        raise ApiError("logprobs: not with echo (the prompt's log-probabilities are not computed: the decoder gives "
                       "the last position's logits only)", param="logprobs")
    request = ChatRequest(
        model=fields.model, messages=(), stream=fields.stream,
        include_usage=fields.stream_options is not None and fields.stream_options.include_usage,
        max_new_tokens=fields.max_tokens,
        sampling=fields.sampling, stops=stop_strings(fields.stop),
        tools=None, guidance=None, logprobs=fields.logprobs, prompt_field="prompt")
    return CompletionRequest(request, Prompt(prompt), fields.echo)


class CompletionWriter(Writer):
    """A text completion, or its chunks (text, then a finish chunk, a usage chunk when asked, then [DONE]); with
    `echo` the prompt comes first."""

    def __init__(self, model: str, completion: CompletionRequest) -> None:
        self.model = model
        self.completion = completion
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offset = len(completion.prompt.text) if completion.echo else 0  # of the next token's text

    @property
    def _logprobs(self) -> bool:
        return self.completion.request.logprobs is not None

    def body(self, answer: Collected) -> dict[str, Any]:
        text = (self.completion.prompt.text if self.completion.echo else "") + answer.text
        finished = answer.finished
        return {**self._head(), "choices": [self._choice(text, finished.finish_reason, answer.logprobs)],
                "usage": usage(finished.prompt_tokens, finished.completion_tokens)}

    def opening(self) -> list[str]:
        return [sse({**self._head(), "choices": [self._choice(self.completion.prompt.text, None, [])]})] \
            if self.completion.echo else []

    def piece(self, piece: Piece) -> list[str]:
        return [sse({**self._head(), "choices": [self._choice(piece.text, None, list(piece.logprobs))]})]

    def finished(self, finished: Finished) -> list[str]:
        chunks = [sse({**self._head(), "choices": [self._choice("", finished.finish_reason, [])]})]
        if self.completion.request.include_usage:
            chunks.append(sse({**self._head(), "choices": [],
                               "usage": usage(finished.prompt_tokens, finished.completion_tokens)}))
        return chunks

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def _choice(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs_body(logprobs) if self._logprobs else None,
                "finish_reason": finish_reason}

    def _logprobs_body(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        """The completions API's log-probabilities: per token its text, log-probability, the most likely
        alternatives and where its text starts in the choice's text (counted over the whole answer)."""
        offsets = []
        for entry in logprobs:
            offsets.append(self._offset)
            self._offset += len(entry.chosen.token)
        return {"tokens": [e.chosen.token for e in logprobs], "token_logprobs": [e.chosen.logprob for e in logprobs],
                "top_logprobs": [{a.token: a.logprob for a in e.top} for e in logprobs], "text_offset": offsets}
