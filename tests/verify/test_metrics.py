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
             near_ties: int = 0, prefill_relative: float = 0.0, prefill_kl: float = 0.0) -> CaseMetrics:
    agreed = positions if agreed is None else agreed
    return CaseMetrics(case="case", mode="text", variant="decoder.onnx", prompt_tokens=4, positions=positions,
                       logit_scale=SCALE, max_abs_diff=max(relative, prefill_relative) * SCALE,
                       top1_agreement=agreed / positions, near_ties=near_ties, mean_kl=mean_kl,
                       max_kl=max(mean_kl, prefill_kl), identical_prefix=agreed,
                       prefill_abs_diff=prefill_relative * SCALE, prefill_kl=prefill_kl, prefill_top1=agreed > 0,
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


def test_the_prefill_is_held_to_the_limits_on_its_own() -> None:
    """The first position (the prompt's run through the decoder, the many-rows path of a MatMul kernel) may not hide
    among the decode positions: its KL and logit difference are judged alone too."""
    max_kl = DOC_LIMITS["int4"][2]
    # 1 prefill position at 5x the limit among 99 decode positions with none: the pooled mean is within the limit
    verdict = judge("text", [_metrics(positions=100, mean_kl=max_kl * 5 / 100, prefill_kl=max_kl * 5)],
                    THRESHOLDS["int4"])
    assert verdict.reasons == [f"prefill: mean KL {max_kl * 5:.3g} nats (limit {max_kl:g})"]
    assert verdict.decode_mean_kl == 0.0 and verdict.prefill_mean_kl == pytest.approx(max_kl * 5)
    assert judge("text", [_metrics(positions=100, prefill_kl=max_kl)], THRESHOLDS["int4"]).passed
    limit = DOC_LIMITS["fp32"][0]
    verdict = judge("text", [_metrics(prefill_relative=limit * 2)], THRESHOLDS["fp32"])
    assert f"prefill: max |Δ logits| is {limit * 2:.2g} of the logit scale (limit {limit:g})" in verdict.reasons


def test_compare_takes_the_prefill_from_the_first_position() -> None:
    reference = np.zeros((3, VOCAB))
    reference[:, 0] = 3.0
    package = reference.copy()
    package[0, 2] = 2.0  # the prompt's run differs, the decode steps do not
    metrics = compare("case", "text", "decoder.onnx", 4, [0, 0, 0], package, reference)
    assert metrics.prefill_abs_diff == 2.0 and metrics.prefill_top1
    assert metrics.prefill_kl > 0 and metrics.prefill_kl == pytest.approx(metrics.mean_kl * 3)
