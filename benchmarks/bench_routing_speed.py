"""Speed of the self-routing decoder against the split decoders, per input mode, in alternated processes.

    python -m benchmarks.bench_routing_speed --package PKG --split-package SPLIT [--rounds 3] [--repeats 2]

PKG is a routed package (the default build), SPLIT a ``--lora split`` package of the same checkpoint. Each round runs,
for every input mode, one process per package (their order alternates from round to round, so a slow spell of a
shared machine does not land on one package only). A process loads the package with ``builder_plugin.runtime.Chat``,
asks one untimed warm-up question of its mode, then ``--repeats`` timed questions of that mode, each a new
conversation: time to first token (processor, encoders and prefill) and decode tokens/s after the first token. The
figure per package and mode is the median over every timed question of every round.

Results: benchmarks/results/routing_speed.json and the "Routed against split decoders" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_report_options,
    command_line,
    fmt,
    machine_info,
    machine_markdown,
    make_media,
    markdown_table,
    publish,
)

IMAGE_SIZE = (448, 448)  # one crop and the global view
AUDIO_SECONDS = 3.0
QUESTIONS = {
    "text": ("Tell me a short story about a lighthouse keeper and a storm.",
             "Explain how tides work, in simple words."),
    "image": ("Describe the picture in detail.", "What colours stand out most in the picture?"),
    "audio": ("Transcribe the audio clip.", "What language is spoken in the clip?"),
}
SPEED_TARGET = 0.10  # routed no more than 10 % slower than split


def worker(package: Path, mode: str, media: Path, repeats: int, new_tokens: int) -> dict[str, Any]:
    from builder_plugin.runtime import Chat, Sampling

    images = [media / "photo.png"] if mode == "image" else []
    audios = [media / "clip.wav"] if mode == "audio" else []
    chat = Chat(package)
    timed = []
    for index in range(repeats + 1):
        chat.clear()
        question = QUESTIONS[mode][index % len(QUESTIONS[mode])]
        for _ in chat.ask(question, images, audios, max_new_tokens=new_tokens, sampling=Sampling()):
            pass
        stats = chat.last_stats
        if index:  # the first question holds the session's one-time warm-up
            timed.append({"prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens,
                          "time_to_first_token_s": stats.time_to_first_token_s,
                          "decode_tokens_per_s": stats.tokens_per_s, "variant": stats.variant})
    return {"package": str(package), "mode": mode, "routing": chat.manifest.routing, "questions": timed}


def run_worker(package: Path, mode: str, media: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, "-m", __spec__.name, "--worker", mode, "--package", str(package), "--media", str(media),
               "--repeats", str(args.repeats), "--new-tokens", str(args.new_tokens)]
    print(f"{mode}: {package}", file=sys.stderr, flush=True)
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"worker {mode} on {package} failed (exit {result.returncode})")
    run = json.loads(result.stdout.strip().splitlines()[-1])
    for q in run["questions"]:
        print(f"  first token {q['time_to_first_token_s']:.2f} s, decode {q['decode_tokens_per_s']:.2f} tok/s "
              f"({q['prompt_tokens']} prompt tokens, {q['variant']})", file=sys.stderr, flush=True)
    return run


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{mode: {routing: medians}, plus the routed/split comparison}."""
    out: dict[str, dict[str, Any]] = {}
    for mode in QUESTIONS:
        per: dict[str, Any] = {}
        for routing in ("self", "split"):
            questions = [q for r in runs if r["mode"] == mode and r["routing"] == routing for q in r["questions"]]
            if questions:
                per[routing] = {
                    "questions": len(questions),
                    "prompt_tokens": questions[0]["prompt_tokens"],
                    "time_to_first_token_s": statistics.median(q["time_to_first_token_s"] for q in questions),
                    "decode_tokens_per_s": statistics.median(q["decode_tokens_per_s"] for q in questions),
                    "decode_spread": [min(q["decode_tokens_per_s"] for q in questions),
                                      max(q["decode_tokens_per_s"] for q in questions)],
                }
        if len(per) == 2:
            ours, theirs = per["self"], per["split"]
            per["decode_change"] = ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"] - 1
            per["first_token_change"] = theirs["time_to_first_token_s"] / ours["time_to_first_token_s"] - 1
            per["met"] = min(per["decode_change"], per["first_token_change"]) >= -SPEED_TARGET
        out[mode] = per
    return out


def report(results: dict[str, Any]) -> str:
    rows = []
    for mode, per in results["summary"].items():
        if "met" not in per:
            continue
        ours, theirs = per["self"], per["split"]
        rows.append([mode, ours["prompt_tokens"], fmt(ours["time_to_first_token_s"], 2),
                     fmt(theirs["time_to_first_token_s"], 2), f"{100 * per['first_token_change']:+.1f} %",
                     fmt(ours["decode_tokens_per_s"], 2), fmt(theirs["decode_tokens_per_s"], 2),
                     f"{100 * per['decode_change']:+.1f} %", "met" if per["met"] else "not met"])
    table = markdown_table(["mode", "prompt tokens", "first token routed (s)", "split (s)", "change",
                            "decode routed (tok/s)", "split (tok/s)", "change", f"within {100 * SPEED_TARGET:.0f} %"],
                           rows)
    media = (f"Each process asks its mode's questions through `Chat` (image: {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}; audio: a "
             f"{AUDIO_SECONDS:g} s clip).")
    return "\n".join([
        " ".join(filter(None, (results.get("note"), media))), "",
        f"Command: `{results['command']}`", "",
        f"{results['rounds']} rounds x {results['repeats']} timed questions per package and mode, medians; "
        "changes are routed against split, positive = routed faster.", "",
        machine_markdown(results["machine"]), "", table, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, required=True, help="routed package (the default build)")
    parser.add_argument("--split-package", type=Path, help="--lora split package of the same checkpoint")
    parser.add_argument("--modes", default="text,image,audio")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timed questions per process")
    parser.add_argument("--new-tokens", type=int, default=32)
    add_report_options(parser, "routing_speed.json", replay=False)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--media", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args.package, args.worker, args.media, args.repeats, args.new_tokens)))
        return 0
    if args.split_package is None:
        parser.error("--split-package is required")
    packages = [args.package, args.split_package]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        media = make_media(Path(tmp) / "media", IMAGE_SIZE, AUDIO_SECONDS)
        for round_index in range(args.rounds):
            for mode in args.modes.split(","):
                for package in packages if round_index % 2 == 0 else packages[::-1]:
                    runs.append(run_worker(package, mode, media, args))
    results = {"command": command_line("bench_routing_speed.py", argv), "note": args.note,
               "machine": machine_info(), "rounds": args.rounds, "repeats": args.repeats,
               "new_tokens": args.new_tokens, "runs": runs}
    results["summary"] = summary(runs)
    publish(results, args.out, args.doc, "## Routed against split decoders", report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
