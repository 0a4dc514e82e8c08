"""verify's limits themselves: `judge` and the near-tie rule of `compare` at their boundaries, against the limits the
docs/verify.md states, written out here on their own."""

from __future__ import annotations

import numpy as np
import pytest

from builder_plugin.verify.metrics import THRESHOLDS, CaseMetrics, compare, judge

# docs/verify.md's table: precision -> (max |Δ logits| of the logit scale, min top-1, max mean KL in nats).
DOC_LIMITS = {
    "fp32": (1e-3, 1.0, None),
    "fp16": (None, 0.97, 5e-3),
    "int8": (None, 0.93, 2e-2),
    "int4": (None, 0.80, 0.1),
}
NEAR_TIE = 2 * DOC_LIMITS["fp32"][0]  # a flip between reference logits this close (of the scale) is excused
SCALE = 1000.0  # the largest |reference logit| in the cases below
VOCAB = 8


def _metrics(positions: int = 10, agreed: int | None = None, relative: float = 0.0, mean_kl: float = 0.0,
             near_ties: int = 0) -> CaseMetrics:
    agreed = positions if agreed is None else agreed
    return CaseMetrics(case="case", mode="text", variant="decoder.onnx", prompt_tokens=4, positions=positions,
                       logit_scale=SCALE, max_abs_diff=relative * SCALE, top1_agreement=agreed / positions,
                       near_ties=near_ties, mean_kl=mean_kl, max_kl=mean_kl, identical_prefix=agreed,
                       tokens=[0] * positions, reference_argmax=[0] * positions)


def _verdict(precision: str, **metrics) -> bool:
    return judge("text", [_metrics(**metrics)], THRESHOLDS[precision]).passed


def test_the_thresholds_are_the_docs() -> None:
    assert {p: (t.max_relative_diff, t.min_top1, t.max_mean_kl) for p, t in THRESHOLDS.items()} == DOC_LIMITS


def test_fp32_logits_may_differ_by_the_limit_and_no_more() -> None:
    limit = DOC_LIMITS["fp32"][0]
    assert _verdict("fp32", relative=limit)
    assert not _verdict("fp32", relative=limit * 1.001)
    assert not _verdict("fp32", relative=10 * limit)
    verdict = judge("text", [_metrics(relative=limit * 1.001)], THRESHOLDS["fp32"])
    assert verdict.reasons == [f"max |Δ logits| is {limit * 1.001:.2g} of the logit scale (limit {limit:g})"]


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_top1_and_kl_at_their_limits(precision: str) -> None:
    _, min_top1, max_kl = DOC_LIMITS[precision]
    positions = 100
    at_limit = round(min_top1 * positions)
    assert _verdict(precision, positions=positions, agreed=at_limit, mean_kl=max_kl)
    assert not _verdict(precision, positions=positions, agreed=at_limit - 1, mean_kl=max_kl)
    assert not _verdict(precision, positions=positions, agreed=positions, mean_kl=max_kl * 1.001)
    # the logit difference is not judged below fp32: a quantized package may move every logit
    assert _verdict(precision, positions=positions, relative=1.0)


def test_fp32_demands_every_position_but_excuses_near_ties() -> None:
    assert not _verdict("fp32", positions=10, agreed=9)
    assert _verdict("fp32", positions=10, agreed=9, near_ties=1)
    assert not _verdict("fp16", positions=100, agreed=96, near_ties=4)  # lower precisions excuse nothing


def _flip(gap: float) -> CaseMetrics:
    """One position whose reference top-2 logits are `gap` (of the scale) apart; the package chose the second."""
    reference = np.zeros((1, VOCAB))
    reference[0, 0] = SCALE
    reference[0, 1] = SCALE - gap * SCALE
    return compare("case", "text", "decoder.onnx", 4, [1], reference.copy(), reference)


def test_the_near_tie_rule_at_its_boundary() -> None:
    at = _flip(NEAR_TIE)
    beyond = _flip(NEAR_TIE * 1.01)
    assert (at.near_ties, beyond.near_ties) == (1, 0)
    assert (at.top1_agreement, beyond.top1_agreement) == (0.0, 0.0)
    assert judge("text", [at], THRESHOLDS["fp32"]).passed
    verdict = judge("text", [beyond], THRESHOLDS["fp32"])
    assert not verdict.passed and verdict.reasons == ["top-1 agreement 0.0% (limit 100%)"]
