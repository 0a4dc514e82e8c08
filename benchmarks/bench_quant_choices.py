"""Size, build cost and decode speed of each quantization choice on the full-size checkpoint, one build at a time.

    python benchmarks/bench_quant_choices.py --checkpoint full [--choices int4-rtn_last,int4-k_quant] [--work DIR]

Each choice (`CHOICES`: `-p` and `--extra_options` of `python -m builder_plugin`) is built in its own process (wall
time and peak RSS from the operating system's accounting of that process), its data files are measured, then a fresh
process loads it with onnxruntime-genai and answers one greedy text question (load, prefill, median decode step, peak
RSS), and the package is deleted unless `--keep`. Results accumulate in the JSON by choice, so choices can be run on
different days; each keeps the commit and the machine load it was measured at.
Results: benchmarks/results/quant_choices.json and the "Quantization choices at full size" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import (  # noqa: E402
    command_line,
    fmt,
    git_state,
    greedy_text_answer,
    machine_info,
    machine_markdown,
    peak_rss_bytes,
    publish,
)

from builder_plugin.extra_options import DEFAULT_ALGO_CONFIG  # noqa: E402
from builder_plugin.layout import DATA_FILES, Component  # noqa: E402

# name -> (precision, --extra_options); the names are what --choices takes
CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "int4": ("int4", ()),  # the default
    "int4-default": ("int4", ("algo_config=default",)),
    "int4-rtn": ("int4", ("algo_config=rtn",)),
    "int4-rtn_last": ("int4", ("algo_config=rtn_last",)),
    "int4-k_quant": ("int4", ("algo_config=k_quant",)),
    "int4-k_quant_last": ("int4", ("algo_config=k_quant_last",)),
    "int4-k_quant_linear": ("int4", ("algo_config=k_quant_linear",)),
    "int4-default-asymmetric": ("int4", ("algo_config=default", "is_symmetric=false")),
    "int4-default-int8-mixed": ("int4", ("algo_config=default",
                                         "matmul_mixed_precision=last_matmul:int8,mixed_layers:int8")),
    "int8": ("int8", ()),
}
QUESTION = "Explain how lasers work, step by step, for a curious teenager."


def build_choice(name: str, checkpoint: Path, output: Path) -> dict:
    precision, extra = CHOICES[name]
    command = [sys.executable, "-m", "builder_plugin", "-i", str(checkpoint), "-o", str(output), "-p", precision,
               "--no-progress", "--overwrite", *(("--extra_options", *extra) if extra else ())]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{name}: the build failed: {process.stderr.read().strip().splitlines()[-1:]}")
    data = {component.value: (output / DATA_FILES[component]).stat().st_size for component in
            (Component.DECODER, Component.VISION, Component.SPEECH) if (output / DATA_FILES[component]).is_file()}
    return {"build_s": wall, "build_cpu_s": usage.ru_utime + usage.ru_stime,
            "build_peak_rss_bytes": usage.ru_maxrss * 1024, "extra_options": list(extra), "precision": precision,
            "package_bytes": sum(p.stat().st_size for p in output.iterdir() if p.is_file()), "data_bytes": data}


def decode(package: Path, new_tokens: int) -> dict:
    """One greedy answer in this process, as an app makes it."""
    answer = greedy_text_answer(package, QUESTION, new_tokens)
    return {"load_s": answer["load_s"], "prompt_tokens": answer["prompt_tokens"], "prefill_s": answer["prefill_s"],
            "decode_tokens_per_s_median": 1 / statistics.median(answer["step_s"]),
            "decode_tokens_per_s_best": 1 / min(answer["step_s"]), "decode_peak_rss_bytes": peak_rss_bytes()}


def _commit() -> str:
    """The short commit, marked when the builder's sources differ from it."""
    state = git_state("builder_plugin", "genai_config")
    return state["commit"][:7] + ("+changes" if state["modified_files"] else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="the full-size checkpoint (make_checkpoint --preset full)")
    parser.add_argument("--choices", default=",".join(CHOICES), help=f"comma-separated, of: {', '.join(CHOICES)}")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_quant_choices"), help="where packages go")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--keep", action="store_true", help="keep the packages")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant_choices.json")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="'' leaves the docs alone")
    parser.add_argument("--note", default="", help="the machine's state (for the report)")
    parser.add_argument("--decode", type=Path, help=argparse.SUPPRESS)  # child: one answer, JSON on stdout
    args = parser.parse_args(argv)
    if args.decode:
        print(json.dumps(decode(args.decode, args.new_tokens)))
        return 0
    choices = [c for c in args.choices.split(",") if c]
    unknown = [c for c in choices if c not in CHOICES]
    if unknown or not args.checkpoint:
        parser.error(f"unknown choices: {', '.join(unknown)}" if unknown else "--checkpoint is required")

    results = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {"choices": {}}
    for name in choices:
        package = args.work / f"quant-{name}"
        print(f"{name}: building", file=sys.stderr, flush=True)
        entry = {"commit": _commit(), "load_average_before": os.getloadavg()[0], "note": args.note,
                 **build_choice(name, args.checkpoint, package)}
        print(f"{name}: decoding", file=sys.stderr, flush=True)
        child = subprocess.run([sys.executable, __file__, "--decode", str(package), "--new-tokens",
                                str(args.new_tokens)], capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        if child.returncode:
            raise SystemExit(f"{name}: decoding failed: {child.stderr.strip().splitlines()[-1:]}")
        entry.update(json.loads(child.stdout.strip().splitlines()[-1]), load_average_after=os.getloadavg()[0])
        if not args.keep:
            shutil.rmtree(package)
        results["choices"][name] = entry
        results.update(command=command_line("bench_quant_choices.py", argv), machine=machine_info(),
                       checkpoint=str(args.checkpoint))
        publish(results, args.out, args.doc, "## Quantization choices at full size", report(results))
    return 0


def report(results: dict) -> str:
    gb = 1e9
    rows = []
    for name in CHOICES:  # table order, whatever order they were measured in
        run = results["choices"].get(name)
        if run is None:
            continue
        options = " ".join(run["extra_options"]) or f"(none: algo_config={DEFAULT_ALGO_CONFIG[run['precision']]})"
        data = run["data_bytes"]
        rows.append(
            f"| {name} | `-p {run['precision']}` {options} | {run['commit']} | {fmt(run['build_s'] / 60, 1)} min "
            f"({fmt(run['build_cpu_s'] / 60, 1)} CPU) | **{fmt(run['build_peak_rss_bytes'] / gb, 2)} GB** | "
            f"{fmt(run['package_bytes'] / gb, 2)} GB | {fmt(data.get('decoder', 0) / gb, 2)} / "
            f"{fmt(data.get('vision', 0) / gb, 3)} / {fmt(data.get('speech', 0) / gb, 3)} GB | "
            f"{fmt(run['prefill_s'], 2)} s | {fmt(run['decode_tokens_per_s_median'], 2)} / "
            f"{fmt(run['decode_tokens_per_s_best'], 2)} | {fmt(run['decode_peak_rss_bytes'] / gb, 2)} GB | "
            f"{fmt(run['load_average_before'], 1)} |")
    return "\n".join([
        f"Command: `{results['command']}` (the last run; each row names the commit it was measured at)", "",
        machine_markdown(results["machine"]), "",
        "Full-size checkpoint (real shapes, random weights), all four models, the default routed decoder, cpu. Build: "
        "wall time and peak RSS of the build process. Decode: a fresh process loads the package with "
        "onnxruntime-genai and answers one greedy text question (prefill of the prompt, then the median and best "
        "decode step).", "",
        "| choice | options | commit | build | build peak RSS | package | text / vision / speech data | prefill | "
        "decode tok/s median / best | decode peak RSS | load avg |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows, ""])


if __name__ == "__main__":
    sys.exit(main())
