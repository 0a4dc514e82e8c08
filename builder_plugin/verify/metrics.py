"""Agreement between the package's logits and the reference's at every generated position, and the verdict per input
mode against the thresholds of the package's precision. The first position's logits come from the prompt's run (the
prefill: every prompt row through the decoder at once, the path of many rows in a MatMul kernel), the others from
one-row decode steps: both are reported, and the prefill is held to the mean-KL and relative-difference limits on its
own as well."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Threshold:
    max_relative_diff: float | None  # max |Δ logits| / logit scale; None: not judged (low precision)
    min_top1: float  # share of positions where the reference's argmax is the package's token
    max_mean_kl: float | None  # mean KL(reference ‖ package) in nats; None: not judged

    def describe(self) -> str:
        parts = []
        if self.max_relative_diff is not None:
            parts.append(f"max |Δ logits| ≤ {self.max_relative_diff:g} of the logit scale")
        parts.append(f"top-1 ≥ {self.min_top1:.0%}" + (" (near-ties excused)" if self.min_top1 == 1 else ""))
        if self.max_mean_kl is not None:
            parts.append(f"mean KL ≤ {self.max_mean_kl:g} nats")
        return ", ".join(parts)


# Why these numbers: docs/verify.md.
THRESHOLDS: dict[str, Threshold] = {
    "fp32": Threshold(max_relative_diff=1e-3, min_top1=1.0, max_mean_kl=None),
    "fp16": Threshold(max_relative_diff=None, min_top1=0.97, max_mean_kl=5e-3),
    "int8": Threshold(max_relative_diff=None, min_top1=0.93, max_mean_kl=2e-2),
    "int4": Threshold(max_relative_diff=None, min_top1=0.80, max_mean_kl=0.1),
}


@dataclass
class CaseMetrics:
    case: str
    mode: str
    variant: str
    prompt_tokens: int
    positions: int
    logit_scale: float  # max |reference logit| over the positions
    max_abs_diff: float
    top1_agreement: float
    near_ties: int  # disagreeing positions whose reference top-1/top-2 gap is within the fp32 tolerance
    mean_kl: float
    max_kl: float
    identical_prefix: int  # leading positions where the reference's argmax is the package's token
    prefill_abs_diff: float  # the first position (the prompt's run): max |Δ logits|
    prefill_kl: float
    prefill_top1: bool
    tokens: list[int]
    reference_argmax: list[int]

    @property
    def max_relative_diff(self) -> float:
        return self.max_abs_diff / max(self.logit_scale, 1e-12)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "max_relative_diff": self.max_relative_diff}


def compare(case: str, mode: str, variant: str, prompt_tokens: int, tokens: Sequence[int],
            package_logits: np.ndarray, reference_logits: np.ndarray) -> CaseMetrics:
    """`*_logits` [positions, vocab]: the distributions each generated token was chosen from."""
    if package_logits.shape != reference_logits.shape or package_logits.shape[0] != len(tokens):
        raise ValueError(f"{case}: logits {package_logits.shape} vs {reference_logits.shape} for {len(tokens)} tokens")
    ref = reference_logits.astype(np.float64)
    got = package_logits.astype(np.float64)
    scale = float(np.abs(ref).max())
    diff = float(np.abs(got - ref).max())
    argmax = ref.argmax(axis=-1)
    agree = argmax == np.asarray(tokens)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    tie = (top2[:, 1] - top2[:, 0]) <= 2 * THRESHOLDS["fp32"].max_relative_diff * scale
    ref_log = _log_softmax(ref)
    kl = (np.exp(ref_log) * (ref_log - _log_softmax(got))).sum(axis=-1)
    prefix = int(np.argmin(agree)) if not agree.all() else len(tokens)
    return CaseMetrics(
        case=case, mode=mode, variant=variant, prompt_tokens=prompt_tokens, positions=len(tokens),
        logit_scale=scale, max_abs_diff=diff, top1_agreement=float(agree.mean()),
        near_ties=int((~agree & tie).sum()), mean_kl=float(kl.mean()), max_kl=float(kl.max()),
        identical_prefix=prefix, prefill_abs_diff=float(np.abs(got[0] - ref[0]).max()), prefill_kl=float(kl[0]),
        prefill_top1=bool(agree[0]), tokens=[int(t) for t in tokens], reference_argmax=[int(t) for t in argmax],
    )


@dataclass
class ModeVerdict:
    mode: str
    cases: int
    positions: int
    max_abs_diff: float
    max_relative_diff: float
    top1_agreement: float
    near_ties: int
    mean_kl: float
    shortest_identical_prefix: int
    prefill_max_relative_diff: float  # over the cases' first positions
    prefill_mean_kl: float
    prefill_top1: float  # share of cases
    decode_mean_kl: float  # over the other positions (nan without any)
    passed: bool
    reasons: list[str]


def judge(mode: str, metrics: Sequence[CaseMetrics], threshold: Threshold) -> ModeVerdict:
    """Pool the positions of a mode's cases and hold them to `threshold`."""
    positions = sum(m.positions for m in metrics)
    agreed = sum(round(m.top1_agreement * m.positions) for m in metrics)
    ties = sum(m.near_ties for m in metrics)
    top1 = agreed / positions
    mean_kl = sum(m.mean_kl * m.positions for m in metrics) / positions
    relative = max(m.max_relative_diff for m in metrics)
    reasons = []
    if threshold.max_relative_diff is not None and relative > threshold.max_relative_diff:
        reasons.append(f"max |Δ logits| is {relative:.2g} of the logit scale (limit {threshold.max_relative_diff:g})")
    # fp32 demands every position, but a flip between two logits closer than its own tolerance is rounding
    top1_judged = (agreed + ties) / positions if threshold.min_top1 == 1 else top1
    if top1_judged < threshold.min_top1:
        reasons.append(f"top-1 agreement {top1:.1%} (limit {threshold.min_top1:.0%})")
    if threshold.max_mean_kl is not None and mean_kl > threshold.max_mean_kl:
        reasons.append(f"mean KL {mean_kl:.3g} nats (limit {threshold.max_mean_kl:g})")
    prefill_relative = max(m.prefill_abs_diff / max(m.logit_scale, 1e-12) for m in metrics)
    prefill_kl = sum(m.prefill_kl for m in metrics) / len(metrics)
    decode_positions = positions - len(metrics)
    decode_kl = (sum(m.mean_kl * m.positions - m.prefill_kl for m in metrics) / decode_positions
                 if decode_positions else float("nan"))
    if threshold.max_relative_diff is not None and prefill_relative > threshold.max_relative_diff:
        reasons.append(f"prefill: max |Δ logits| is {prefill_relative:.2g} of the logit scale "
                       f"(limit {threshold.max_relative_diff:g})")
    if threshold.max_mean_kl is not None and prefill_kl > threshold.max_mean_kl:
        reasons.append(f"prefill: mean KL {prefill_kl:.3g} nats (limit {threshold.max_mean_kl:g})")
    return ModeVerdict(
        mode=mode, cases=len(metrics), positions=positions, max_abs_diff=max(m.max_abs_diff for m in metrics),
        max_relative_diff=relative, top1_agreement=top1, near_ties=ties, mean_kl=mean_kl,
        shortest_identical_prefix=min(m.identical_prefix for m in metrics), prefill_max_relative_diff=prefill_relative,
        prefill_mean_kl=prefill_kl, prefill_top1=sum(m.prefill_top1 for m in metrics) / len(metrics),
        decode_mean_kl=decode_kl, passed=not reasons, reasons=reasons,
    )


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
