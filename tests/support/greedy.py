"""A Chat's greedy answer against the reference's (tests/runtime): the same tokens up to the first near-tie, and the
same logits at each of those steps."""

from __future__ import annotations

import numpy as np

from builder_plugin.reference.model import GreedyResult
from builder_plugin.runtime import Chat

NEAR_TIE = 1e-3  # top-1 minus top-2 reference logit below which fp32 rounding may flip the argmax
LOGITS_ATOL = 1e-3


def agreed(expected: GreedyResult) -> int:
    """Tokens compared: up to the first reference near-tie (after which fp32 rounding may legitimately diverge)."""
    return next((i + 1 for i, gap in enumerate(expected.top2_gap) if gap < NEAR_TIE), len(expected.tokens))


def assert_matches(chat: Chat, new_tokens: list[int], expected: GreedyResult, what: str) -> None:
    """`new_tokens`, the chat's last answer (asked with keep_logits), equal the reference's greedy answer."""
    count = agreed(expected)
    assert new_tokens[:count] == expected.tokens[:count], what
    assert len(chat.last_logits) == len(new_tokens)
    worst = max(float(np.abs(got - want.numpy()).max())
                for got, want in zip(chat.last_logits[:count], expected.step_logits[:count]))
    assert worst <= LOGITS_ATOL, f"{what}: logits differ by up to {worst:.2e}"
