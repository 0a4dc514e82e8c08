"""Every field of an OpenAI chat-completions request and what this server does with it: a field that would change
the answer is either honoured or refused with a 400 naming it; informational fields are accepted."""

from __future__ import annotations

from typing import Any

from builder_plugin.serve.errors import ApiError

# Read by the request model (protocol.ChatCompletionRequest) and honoured.
HONOURED = ("messages", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
            "top_p", "top_k", "seed", "stop", "n", "response_format", "tools", "tool_choice", "parallel_tool_calls",
            "logprobs", "top_logprobs")
# Accepted and not used: they do not change the answer.
INFORMATIONAL = ("user", "metadata", "store", "safety_identifier", "service_tier", "prompt_cache_key",
                 "prompt_cache_options", "prompt_cache_retention")
# Accepted only with the value that leaves the answer as this server makes it (field -> allowed values, why not).
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "frequency_penalty": ((None, 0, 0.0), "the runtime has no frequency penalty"),
    "presence_penalty": ((None, 0, 0.0), "the runtime has no presence penalty"),
    "logit_bias": ((None, {}), "the runtime cannot bias logits"),
    "modalities": ((None, ["text"]), "this model answers in text only"),
    "audio": ((None,), "this model answers in text only"),
    "reasoning_effort": ((None,), "this model has no reasoning mode"),
    "verbosity": ((None,), "this model has no verbosity setting"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "moderation": ((None,), "this server does not moderate answers"),
    "functions": ((None,), "deprecated: use tools"),
    "function_call": ((None,), "deprecated: use tool_choice"),
}


def check_fields(data: dict[str, Any]) -> None:
    """Raise ApiError (400) for an unknown field or a field set to a value this server cannot honour."""
    for name, value in data.items():
        if name in HONOURED or name in INFORMATIONAL:
            continue
        if name in NEUTRAL:
            allowed, why = NEUTRAL[name]
            if value not in allowed:
                raise ApiError(f"{name}: not supported ({why})", param=name, code="unsupported_parameter")
            continue
        raise ApiError(f"{name}: unknown field", param=name, code="unsupported_parameter")
