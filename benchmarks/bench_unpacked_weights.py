"""What running float weights unpacked saves: one greedy text answer through onnxruntime-genai, in a fresh process per
setting, with the package's genai_config as built and with onnxruntime's CPU prepacking on for every session.

    python -m benchmarks.bench_unpacked_weights --package PKG [--new-tokens 32] [--rounds 3] [--note TEXT]

A cpu build gives every graph whose MatMul weights are all float `session.disable_prepacking` (genai_config.json):
onnxruntime then computes on the weights it mapped from the .data files, which stay page cache, instead of a packed
private copy of each. The report gives load time, first token, decode speed, the peak resident set and its private
and file-mapped parts, for both settings, and whether they answered the same tokens.
Results: benchmarks/results/unpacked_weights.json and the "Unpacked float weights" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (
    ROOT,
    add_report_options,
    command_line,
    fmt,
    greedy_text_answer,
    machine_info,
    machine_markdown,
    peak_rss_bytes,
    publish,
)
from builder_plugin.layout import GENAI_CONFIG_FILE
from builder_plugin.memory import MemorySampler
from genai_config.writer import UNPACKED_WEIGHTS_ENTRIES

QUESTION = "Tell me a story about a lighthouse keeper and the ships he counted."
SETTINGS = ("as built", "prepacking everywhere")


def packed_copy(package: Path, folder: Path) -> Path:
    """`package` (its files linked) with every session's UNPACKED_WEIGHTS_ENTRIES taken out of genai_config.json."""
    for item in package.iterdir():
        if item.name != GENAI_CONFIG_FILE:
            (folder / item.name).symlink_to(item.resolve())
    config = json.loads((package / GENAI_CONFIG_FILE).read_text(encoding="utf-8"))
    for section in config["model"].values():
        options = section.get("session_options") if isinstance(section, dict) else None
        for key in UNPACKED_WEIGHTS_ENTRIES:
            if options is not None:
                options.pop(key, None)
    (folder / GENAI_CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def unpacked_sessions(package: Path) -> list[str]:
    config = json.loads((package / GENAI_CONFIG_FILE).read_text(encoding="utf-8"))["model"]
    return [name for name, section in config.items() if isinstance(section, dict)
            and UNPACKED_WEIGHTS_ENTRIES.items() <= section.get("session_options", {}).items()]


def measure(package: Path, new_tokens: int) -> dict:
    """One answer in this process: load, prefill, `new_tokens` greedy steps, with the memory sampled throughout."""
    with MemorySampler(interval_s=0.05) as memory:
        answer = greedy_text_answer(package, QUESTION, new_tokens)
    return {"load_s": answer["load_s"], "first_token_s": answer["prefill_s"], "prompt_tokens": answer["prompt_tokens"],
            "decode_tokens_per_s": new_tokens / sum(answer["step_s"]), "peak_rss_bytes": peak_rss_bytes(),
            "peak_private_bytes": memory.peak_private, "peak_file_bytes": memory.peak_file,
            "tokens": answer["tokens"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, required=True)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="measurements per setting, alternating (median)")
    add_report_options(parser, "unpacked_weights.json", replay=False)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measurement, JSON on stdout
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.package, args.new_tokens)))
        return 0

    unpacked = unpacked_sessions(args.package)
    if not unpacked:
        raise SystemExit(f"{args.package}: no session runs unpacked (a cpu package with float weights has them)")
    measured: dict[str, list[dict]] = {setting: [] for setting in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="packed-") as folder:
        packages = {SETTINGS[0]: args.package, SETTINGS[1]: packed_copy(args.package, Path(folder))}
        for round_index in range(args.rounds):
            order = SETTINGS if round_index % 2 == 0 else SETTINGS[::-1]  # a slow spell does not land on one only
            for setting in order:
                measured[setting].append(_measure_in_child(setting, packages[setting], args.new_tokens))
    runs = {setting: _summary(found) for setting, found in measured.items()}
    results = {"command": command_line("bench_unpacked_weights.py", argv), "note": args.note,
               "machine": machine_info(), "package": str(args.package), "unpacked_sessions": unpacked,
               "new_tokens": args.new_tokens, "rounds": args.rounds, "runs": runs, "measurements": measured,
               "same_tokens": runs[SETTINGS[0]].get("tokens") == runs[SETTINGS[1]].get("tokens")}
    publish(results, args.out, args.doc, "## Unpacked float weights", report(results))
    return 0


def _measure_in_child(setting: str, package: Path, new_tokens: int) -> dict:
    child = subprocess.run([sys.executable, "-m", __spec__.name, "--child", "--package", str(package),
                            "--new-tokens", str(new_tokens)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    if child.returncode == -signal.SIGKILL:  # what the kernel's out-of-memory killer sends
        return {"killed": True}
    if child.returncode:
        raise SystemExit(f"{setting}: the measurement failed: {child.stderr.strip().splitlines()[-1:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def _summary(found: list[dict]) -> dict:
    """Median time of the rounds, largest memory; killed if any round was."""
    if any(run.get("killed") for run in found):
        return {"killed": True}
    summary = {key: statistics.median(run[key] for run in found)
               for key in ("load_s", "first_token_s", "decode_tokens_per_s")}
    summary.update({key: max(run[key] for run in found)
                    for key in ("peak_rss_bytes", "peak_private_bytes", "peak_file_bytes")})
    summary.update(prompt_tokens=found[0]["prompt_tokens"], tokens=found[0]["tokens"],
                   same_tokens_every_round=all(run["tokens"] == found[0]["tokens"] for run in found))
    return summary


def report(results: dict) -> str:
    rows = [
        f"| {setting} | killed by the kernel (SIGKILL: out of memory) | | | | | |" if run.get("killed") else
        f"| {setting} | {fmt(run['load_s'], 1)} s | {fmt(run['first_token_s'], 2)} s | "
        f"{fmt(run['decode_tokens_per_s'], 2)} | {fmt(run['peak_rss_bytes'] / 1e9, 2)} GB | "
        f"{fmt(run['peak_private_bytes'] / 1e9, 2)} GB | {fmt(run['peak_file_bytes'] / 1e9, 2)} GB |"
        for setting, run in results["runs"].items()
    ]
    prompt = results["runs"][SETTINGS[0]].get("prompt_tokens", "?")
    killed = any(run.get("killed") for run in results["runs"].values())
    return "\n".join([
        *([results["note"], ""] if results.get("note") else []),
        f"Command: `{results['command']}`", "", machine_markdown(results["machine"]), "",
        f"Sessions that run unpacked as built: {', '.join(results['unpacked_sessions'])}. One greedy text answer "
        f"({prompt}-token prompt, {results['new_tokens']} new tokens), a fresh process per setting and round, "
        f"{results['rounds']} rounds alternating: median times, largest memory. Load is `og.Model`; the first token "
        "includes the first reads of the mapped weights.", "",
        "| genai_config | load | first token | decode tok/s | peak RSS | private (peak) | mapped from files (peak) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows, "",
        "" if killed else f"Same tokens in both settings: {'yes' if results['same_tokens'] else 'no'}.", ""])


if __name__ == "__main__":
    sys.exit(main())
