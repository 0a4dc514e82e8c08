"""python -m builder_plugin.verify PACKAGE --checkpoint CKPT: compare a built package with the checkpoint it was built
from, per input mode. Exit 0: every mode within the threshold of the package's precision; 3: a mode is not (named);
1: bad input; 2: bad usage."""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from builder_plugin import __version__
from builder_plugin.verify.modes import VERIFY_MODES, parse_modes

if TYPE_CHECKING:
    from builder_plugin.verify.report import Report

EXIT_MISMATCH = 3


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m builder_plugin.verify",
                                description="Check that a built package matches its original checkpoint: built-in "
                                "prompts per input mode run through onnxruntime-genai and through a PyTorch reference "
                                "with the LoRA and audio projection of that mode.")
    p.add_argument("--version", action="version", version=f"builder_plugin {__version__}")
    p.add_argument("package", type=Path, help="the built package folder")
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="the checkpoint folder it was built from (original or transformers-native layout)")
    p.add_argument("--modes", type=_modes, help=f"comma-separated subset of {','.join(VERIFY_MODES)} (default: all the "
                   "package supports)")
    # One value per option, repeated for several: a list option would swallow the package folder after it.
    p.add_argument("--image", action="append", type=Path, default=[], metavar="FILE",
                   help="an image to use instead of the built-in one (repeat the option for several)")
    p.add_argument("--audio", action="append", type=Path, default=[], metavar="FILE",
                   help="an audio clip to use instead of the built-in one (repeat the option for several)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="an extra question, asked in every mode (repeat the option for several)")
    p.add_argument("--max-new-tokens", type=_positive, default=16, help="greedy tokens per case (default %(default)s)")
    p.add_argument("--report", type=Path, help="write the Markdown report here")
    p.add_argument("--json", type=Path, help="write the JSON report here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    return p


def _modes(text: str) -> tuple[str, ...]:
    try:
        return parse_modes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def verify(args: argparse.Namespace) -> Report:
    from tqdm import tqdm

    from builder_plugin.errors import BuildError
    from builder_plugin.layout import GENAI_CONFIG_FILE
    from builder_plugin.memory import MemorySampler
    from builder_plugin.precisions import lowest
    from builder_plugin.reference.streaming import StreamingReference, TeacherForced
    from builder_plugin.runtime import ChatError
    from builder_plugin.verify.engine import assignments, matmul_kernel, run_package
    from builder_plugin.verify.metrics import THRESHOLDS, compare, judge
    from builder_plugin.verify.package_info import check_architecture, has_speech, package_precisions
    from builder_plugin.verify.prompts import build_cases
    from builder_plugin.verify.report import Report

    bars_off = True if args.no_progress else None  # None: bars on a terminal only, no \r-lines in a log

    def progress(items, desc):
        return tqdm(items, desc=desc, leave=False, disable=bars_off)

    timings: dict[str, float] = {}
    package = args.package.expanduser()
    if not (package / GENAI_CONFIG_FILE).is_file():
        raise ChatError(f"not a model package (no {GENAI_CONFIG_FILE}): {package}")
    if not (args.checkpoint / "config.json").is_file():
        raise BuildError(f"not a checkpoint folder (no config.json): {args.checkpoint}")
    # The reference reads the checkpoint's headers first (cheap), so a broken one fails before any model runs.
    reference = StreamingReference(args.checkpoint)
    check_architecture(package, reference.config)
    graphs = package_precisions(package)
    precision = lowest(list(graphs.values()))
    modes = args.modes or VERIFY_MODES
    if not has_speech(package):
        if args.modes and any("audio" in m for m in args.modes):
            raise ChatError("the package has no speech model, so it cannot take audio; choose --modes text,image")
        modes = tuple(m for m in modes if "audio" not in m)
    with tempfile.TemporaryDirectory(prefix="verify-media-") as media:
        cases = build_cases(modes, Path(media), args.prompt, args.image, args.audio)
        started = time.perf_counter()
        assigned = assignments(str(package), cases)
        steps = sum(map(len, assigned.values())) * args.max_new_tokens
        with MemorySampler() as package_memory, tqdm(total=steps, desc="package: onnxruntime-genai", leave=False,
                                                      disable=bars_off) as bar:
            runs = run_package(str(package), cases, args.max_new_tokens, on_step=bar.update, assigned=assigned)
        timings["package"] = time.perf_counter() - started
    peak_gb = {"package": _peak_rss_gb()}
    private_gb = {"package": package_memory.peak_private / 1e9}
    gc.collect()  # the og models are gone before the reference loads anything: peak memory is the larger side

    started = time.perf_counter()
    with MemorySampler() as reference_memory:
        reference_logits = reference.logits([TeacherForced(r.inputs, r.tokens) for r in runs], progress)
    timings["reference"] = time.perf_counter() - started
    peak_gb["reference"] = reference_memory.peak_rss / 1e9
    private_gb["reference"] = reference_memory.peak_private / 1e9
    peak_gb["overall"] = _peak_rss_gb()
    metrics = [compare(r.case.name, r.case.mode, r.variant, r.prompt_length, r.tokens, r.logits, want)
               for r, want in zip(runs, reference_logits)]
    threshold = THRESHOLDS[precision]
    verdicts = [judge(mode, [m for m in metrics if m.mode == mode], threshold) for mode in modes]
    return Report(str(package), str(args.checkpoint), reference.checkpoint.source_format, precision, graphs, threshold,
                  args.max_new_tokens, verdicts, metrics, matmul_kernel(str(package)), timings, peak_gb, private_gb)


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def user_errors() -> tuple[type[Exception], ...]:
    """The errors reported in one line (torch and onnxruntime-genai are imported only once the arguments parse)."""
    from builder_plugin.errors import BuildError
    from builder_plugin.reference.errors import ReferenceModelError
    from builder_plugin.runtime import ChatError
    from builder_plugin.verify.engine import EngineError
    from builder_plugin.verify.package_info import ArchitectureMismatchError

    return BuildError, ChatError, ReferenceModelError, ArchitectureMismatchError, EngineError


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    errors = user_errors()
    try:
        report = verify(args)
    except errors as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        if args.report:
            args.report.write_text(report.markdown(), encoding="utf-8")
        if args.json:
            report.write_json(args.json)
    except OSError as exc:
        print(f"error: cannot write the report: {exc}", file=sys.stderr)
        return 1
    from builder_plugin.verify.report import summary_lines

    print("\n".join(summary_lines(report)))
    if not report.passed:
        print(f"verify: FAILED for {', '.join(report.failed_modes)} ({report.precision} package)")
        return EXIT_MISMATCH
    print(f"verify: package matches the checkpoint in every mode ({report.precision})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
