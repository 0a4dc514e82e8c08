"""Where a decode step's time goes: onnxruntime's own profiler over the text decoder, per operator type, with the
thread count Chat and the server choose (one per physical core this process may use, no spinning).

    python -m benchmarks.profile_decode PKG [--steps 30] [--lock /work/fullsize.lock] [--label NAME]
                                        [--doc docs/benchmarks.md]

One process: the package loaded with Chat's thread overlay plus `enable_profiling` on the decoder session, a text
prompt, then --steps greedy steps. Per step (the prompt's run left out): each operator type's kernel time, how often
it ran, and for MatMul / MatMulNBits the weight bytes they read over their time (their own read rate). Numpy read
probes right before and after the steps give the read bandwidth they ran beside; profiling itself adds a few
percent to every step. The profile files are written to a temporary folder and deleted.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    GB,
    ROOT,
    add_report_options,
    command_line,
    git_state,
    machine_info,
    machine_markdown,
    markdown_table,
    publish,
    read_probe_gb_s,
)
from benchmarks.runtime_bench.decoder_graph import decode_weight_bytes
from builder_plugin.layout import GENAI_CONFIG_FILE

HEADING = "## Decode profile"
PROMPT = "<|user|>Write a long story about a lighthouse keeper and the ships she watches.<|end|><|assistant|>"
MATMULS = ("MatMul", "MatMulNBits")


def profile(package: Path, steps: int) -> dict[str, Any]:
    import onnxruntime_genai as og

    from builder_plugin.runtime.threads import default_threads, thread_overlay

    config = json.loads((package / GENAI_CONFIG_FILE).read_text())
    overlay = thread_overlay(config)
    with tempfile.TemporaryDirectory(prefix="profile_decode_") as folder:
        overlay["decoder"]["session_options"]["enable_profiling"] = str(Path(folder) / "decoder")
        og_config = og.Config(str(package))
        og_config.overlay(json.dumps({"model": overlay}))
        model = og.Model(og_config)
        ids = og.Tokenizer(model).encode(PROMPT)
        params = og.GeneratorParams(model)
        total = len(ids) + steps + 1
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        generator.generate_next_token()
        before = read_probe_gb_s()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            generator.generate_next_token()
            times.append(time.perf_counter() - start)
        after = read_probe_gb_s()
        del generator, params, model  # the session writes its profile when it ends
        files = sorted(Path(folder).glob("decoder*.json"), key=lambda p: p.stat().st_size)
        events = json.loads(files[-1].read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    decode_runs = runs[1:]  # the first is the prompt's
    start_ts = decode_runs[0]["ts"]
    kernel_us: dict[str, float] = collections.Counter()
    calls: dict[str, int] = collections.Counter()
    for event in events:
        if event.get("cat") != "Node" or event["ts"] < start_ts or not event["name"].endswith("_kernel_time"):
            continue
        op = event["args"].get("op_name", "?")
        kernel_us[op] += event["dur"]
        calls[op] += 1
    count = len(decode_runs)
    return {"threads": default_threads(), "steps_s": times, "read_gb_s": [before, after],
            "run_ms": statistics.mean(r["dur"] for r in decode_runs) / 1e3,
            "ops": {op: {"ms": us / count / 1e3, "calls": calls[op] / count} for op, us in kernel_us.items()}}


def report(results: dict[str, Any]) -> str:
    sections = []
    for package, entry in results["packages"].items():
        step_bytes = entry["bytes"]["total_bytes"]
        ops = sorted(entry["ops"].items(), key=lambda kv: -kv[1]["ms"])
        run_ms = entry["run_ms"]
        probe = statistics.mean(entry["read_gb_s"])
        matmul_ms = sum(v["ms"] for op, v in entry["ops"].items() if op in MATMULS)
        matmul_rate = step_bytes / GB / (matmul_ms / 1e3)
        rows = []
        for op, v in ops[:10]:
            rate = f"{matmul_rate:.1f}" if op in MATMULS else ""
            rows.append([op, f"{v['ms']:.2f}", f"{100 * v['ms'] / run_ms:.1f} %", f"{v['calls']:.0f}", rate])
        rest = sum(v["ms"] for _, v in ops[10:])
        rows.append(["(the other types)", f"{rest:.2f}", f"{100 * rest / run_ms:.1f} %", "", ""])
        median_step = statistics.median(entry["steps_s"])
        sections.append("\n".join([
            f"`{Path(package).name}` ({entry['layers']} layers, {step_bytes / GB:.2f} GB of MatMul weights per step), "
            f"{entry['threads']} threads: median step {1e3 * median_step:.1f} ms ({1 / median_step:.2f} tokens/s, "
            f"profiled), session run {run_ms:.1f} ms; read probes beside it {entry['read_gb_s'][0]:.1f} and "
            f"{entry['read_gb_s'][1]:.1f} GB/s. The MatMuls read their weights at {matmul_rate:.1f} GB/s "
            f"({100 * matmul_rate / probe:.0f} % of the probes); the whole step at "
            f"{step_bytes / GB / median_step:.1f} GB/s ({100 * step_bytes / GB / median_step / probe:.0f} %).\n",
            markdown_table(["operator", "ms / step", "share of the run", "calls / step", "weights GB/s"], rows),
        ]))
    return "\n".join([
        f"{HEADING}\n",
        f"`{results['command']}` at {results['git']['commit'][:10]}: onnxruntime's profiler over the decoder session, "
        "per operator type, averaged over the decode steps (the prompt's run left out). An `If` row includes the "
        "branch it ran (in text mode: the Identity nodes of the LoRA-skipping branches).\n",
        "\n\n".join(sections),
        "",
        machine_markdown(results["machine"]),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lock", default=None, help="flock this file around each package's process")
    parser.add_argument("--label", default=None)
    add_report_options(parser, "decode_profile.json", note=False, replay=False)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(profile(Path(args.worker), args.steps)))
        return 0
    if not args.packages:
        parser.error("give at least one package folder")
    packages = {}
    for package in args.packages:
        command = [sys.executable, "-m", __spec__.name, "--worker", package, "--steps", str(args.steps)]
        if args.lock:
            command = ["flock", args.lock, *command]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"profiling {package} failed: {done.stderr.strip()[-2000:]}")
        entry = json.loads(done.stdout.strip().splitlines()[-1])
        config = json.loads((Path(package) / GENAI_CONFIG_FILE).read_text())
        decoder = Path(package) / config["model"]["decoder"]["filename"]
        entry.update(layers=config["model"]["decoder"]["num_hidden_layers"], bytes=decode_weight_bytes(decoder))
        packages[package] = entry
    results = {"packages": packages, "command": command_line("profile_decode.py", argv), "git": git_state(),
               "machine": machine_info()}
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    label = args.label or "+".join(Path(p).name for p in args.packages)
    merged = {"runs": {**previous.get("runs", {}), label: results}}
    publish(merged, args.out, args.doc, HEADING,
            "\n\n".join(report(run).split("\n", 2)[2] for run in merged["runs"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
