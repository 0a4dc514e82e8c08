"""Every field of an OpenAI request, per endpoint, and what this server does with it: a field that would change the
answer is either honoured or refused with a 400 naming it; informational fields are accepted. One table per endpoint
(chat completions, completions, responses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from builder_plugin.serve.errors import ApiError

Neutral = dict[str, tuple[tuple[Any, ...], str]]  # field -> (the values allowed, why no other)


@dataclass(frozen=True)
class Fields:
    endpoint: str
    honoured: tuple[str, ...]  # read by the endpoint's request model and honoured
    informational: tuple[str, ...]  # accepted and not used: they do not change the answer
    neutral: Neutral  # accepted only with a value that leaves the answer as this server makes it

    def check(self, data: dict[str, Any]) -> None:
        """Raise ApiError (400) for an unknown field or a field set to a value this server cannot honour."""
        for name, value in data.items():
            if name in self.honoured or name in self.informational:
                continue
            if name in self.neutral:
                allowed, why = self.neutral[name]
                if value not in allowed:
                    raise ApiError(f"{name}: not supported ({why})", param=name, code="unsupported_parameter")
                continue
            raise ApiError(f"{name}: unknown field of {self.endpoint}", param=name, code="unsupported_parameter")

    @property
    def names(self) -> set[str]:
        return set(self.honoured) | set(self.informational) | set(self.neutral)


NO_PENALTIES: Neutral = {
    "frequency_penalty": ((None, 0, 0.0), "the runtime has no frequency penalty"),
    "presence_penalty": ((None, 0, 0.0), "the runtime has no presence penalty"),
    "logit_bias": ((None, {}), "the runtime cannot bias logits"),
}

CHAT = Fields(
    "/v1/chat/completions",
    honoured=("messages", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
              "top_p", "top_k", "seed", "stop", "n", "response_format", "tools", "tool_choice",
              "parallel_tool_calls", "logprobs", "top_logprobs"),
    informational=("user", "metadata", "store", "safety_identifier", "service_tier", "prompt_cache_key",
                   "prompt_cache_options", "prompt_cache_retention"),
    neutral={
        **NO_PENALTIES,
        "modalities": ((None, ["text"]), "this model answers in text only"),
        "audio": ((None,), "this model answers in text only"),
        "reasoning_effort": ((None,), "this model has no reasoning mode"),
        "verbosity": ((None,), "this model has no verbosity setting"),
        "prediction": ((None,), "predicted outputs are not supported"),
        "web_search_options": ((None,), "web search is not supported"),
        "moderation": ((None,), "this server does not moderate answers"),
        "functions": ((None,), "deprecated: use tools"),
        "function_call": ((None,), "deprecated: use tool_choice"),
    })

COMPLETIONS = Fields(
    "/v1/completions",
    honoured=("prompt", "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed",
              "stop", "n", "echo", "logprobs"),
    informational=("user",),
    neutral={
        **NO_PENALTIES,
        "best_of": ((None, 1), "one answer per request"),
        "suffix": ((None, ""), "the model does not fill in the middle"),
    })

RESPONSES = Fields(
    "/v1/responses",
    honoured=("input", "model", "instructions", "stream", "max_output_tokens", "temperature", "top_p", "top_k",
              "seed", "tools", "tool_choice", "parallel_tool_calls", "text", "store", "previous_response_id"),
    informational=("user", "metadata", "safety_identifier", "service_tier", "prompt_cache_key",
                   "prompt_cache_options", "prompt_cache_retention", "stream_options", "access_programs"),
    neutral={
        "background_options": ((None,), "answers are given while the request waits"),
        "image": ((None,), "this model answers in text only"),
        "moderation": ((None,), "this server does not moderate answers"),
        "truncation": ((None, "disabled"), "a conversation longer than the model's context is refused, not cut"),
        "include": ((None, []), "no extra output data is kept"),
        "top_logprobs": ((None, 0), "log-probabilities are given by /v1/chat/completions and /v1/completions"),
        "background": ((None, False), "answers are given while the request waits"),
        "conversation": ((None,), "conversations are continued with previous_response_id"),
        "max_tool_calls": ((None,), "the number of calls is not limited"),
        "prompt": ((None,), "stored prompt templates are not supported"),
        "reasoning": ((None, {}), "this model has no reasoning mode"),
        "context_management": ((None,), "the conversation is not compacted"),
    })
