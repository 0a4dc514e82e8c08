"""The verify report: Markdown for people, JSON for scripts, from the same data."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from builder_plugin.verify.metrics import CaseMetrics, ModeVerdict, Threshold


@dataclass
class Report:
    package: str
    checkpoint: str
    checkpoint_format: str
    precision: str
    graph_precisions: dict[str, str]
    threshold: Threshold
    max_new_tokens: int
    verdicts: list[ModeVerdict]
    cases: list[CaseMetrics]
    matmul_kernel: str = ""  # which MatMulNBits kernel the package ran on here (engine.matmul_kernel)
    timings_s: dict[str, float] = field(default_factory=dict)
    peak_rss_gb: dict[str, float] = field(default_factory=dict)  # package side, reference (sampled), overall
    peak_private_gb: dict[str, float] = field(default_factory=dict)  # sampled, file-mapped pages left out

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)

    @property
    def failed_modes(self) -> list[str]:
        return [v.mode for v in self.verdicts if not v.passed]

    def as_dict(self) -> dict[str, object]:
        return {
            "package": self.package, "checkpoint": self.checkpoint, "checkpoint_format": self.checkpoint_format,
            "precision": self.precision, "graph_precisions": self.graph_precisions,
            "threshold": asdict(self.threshold), "max_new_tokens": self.max_new_tokens, "passed": self.passed,
            "failed_modes": self.failed_modes, "modes": [asdict(v) for v in self.verdicts],
            "cases": [c.as_dict() for c in self.cases], "matmul_kernel": self.matmul_kernel,
            "timings_s": self.timings_s,
            "peak_rss_gb": self.peak_rss_gb, "peak_private_gb": self.peak_private_gb,
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n", encoding="utf-8")

    def markdown(self) -> str:
        lines = [
            "# Package verification",
            "",
            f"- package: `{self.package}` ({self.precision}; graphs: "
            + ", ".join(f"{name} {p}" for name, p in self.graph_precisions.items()) + ")",
            f"- checkpoint: `{self.checkpoint}` ({self.checkpoint_format} layout)",
            f"- threshold for {self.precision}: {self.threshold.describe()}",
            f"- up to {self.max_new_tokens} greedy tokens per case; the reference is teacher-forced on the package's "
            "tokens, so every position compares the same context",
            "- the first position's logits come from the prompt's run (prefill: all the prompt's rows at once), the "
            "others from one-row decode steps; the prefill is also judged alone"
            + (f"; MatMulNBits ran on {self.matmul_kernel}" if self.matmul_kernel else ""),
            f"- result: **{'PASS' if self.passed else 'FAIL: ' + ', '.join(self.failed_modes)}**",
            "",
            "| mode | verdict | cases | positions | max \\|Δ logits\\| | relative | top-1 | mean KL | "
            "identical prefix | prefill relative | prefill top-1 | prefill mean KL | decode mean KL |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in self.verdicts:
            verdict = "pass" if v.passed else "**FAIL**: " + "; ".join(v.reasons)
            ties = f" ({v.near_ties} near-tie)" if v.near_ties else ""
            lines.append(f"| {v.mode} | {verdict} | {v.cases} | {v.positions} | {v.max_abs_diff:.3g} | "
                         f"{v.max_relative_diff:.2g} | {v.top1_agreement:.1%}{ties} | {v.mean_kl:.3g} | "
                         f"{v.shortest_identical_prefix} | {v.prefill_max_relative_diff:.2g} | {v.prefill_top1:.0%} | "
                         f"{v.prefill_mean_kl:.3g} | {v.decode_mean_kl:.3g} |")
        lines += [
            "",
            "## Cases",
            "",
            "| case | decoder | prompt tokens | positions | logit scale | max \\|Δ\\| | top-1 | mean KL | max KL | "
            "identical prefix | prefill max \\|Δ\\| | prefill KL |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {c.case} | {c.variant} | {c.prompt_tokens} | {c.positions} | {c.logit_scale:.3g} | "
            f"{c.max_abs_diff:.3g} | {c.top1_agreement:.1%} | {c.mean_kl:.3g} | {c.max_kl:.3g} | "
            f"{c.identical_prefix} | {c.prefill_abs_diff:.3g} | {c.prefill_kl:.3g} |"
            for c in self.cases
        ]
        if self.timings_s:
            lines += ["", "Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.timings_s.items())]
        if self.peak_rss_gb:
            lines += ["", "Peak RSS: " + ", ".join(f"{k} {v:.2f} GB" for k, v in self.peak_rss_gb.items())]
        if self.peak_private_gb:
            private = ", ".join(f"{k} {v:.2f} GB" for k, v in self.peak_private_gb.items())
            lines += ["", "Peak private memory (the resident set less pages mapped from files, such as the weights of "
                      f"an unpacked float graph): {private}"]
        return "\n".join(lines) + "\n"


def summary_lines(report: Report) -> Sequence[str]:
    """The lines the command prints."""
    out = []
    for v in report.verdicts:
        status = "ok  " if v.passed else "FAIL"
        out.append(f"{status} {v.mode:<12} max|Δ| {v.max_abs_diff:.3g} ({v.max_relative_diff:.2g} of scale), "
                   f"top-1 {v.top1_agreement:.1%}, mean KL {v.mean_kl:.3g}, identical prefix "
                   f"{v.shortest_identical_prefix}/{v.positions // max(v.cases, 1)}; prefill "
                   f"{v.prefill_max_relative_diff:.2g} of scale, KL {v.prefill_mean_kl:.3g}"
                   + ("" if v.passed else "  <- " + "; ".join(v.reasons)))
    return out
