"""Run time of a package as an app meets it: resident memory after each input mode, time to first token for first
questions and follow-ups, decode speed — through builder_plugin.runtime.Chat.

    python -m benchmarks.bench_chat --package PKG [--split-package SPLIT] [--new-tokens 32]

PKG is a routed package (the default build: one self-routing decoder); SPLIT, optional, is a ``--lora split``
package of the same checkpoint (one decoder file per input mode, one og.Model each), run the way the run-time helper
ran packages before follow-ups were kept: every question re-prefilled in a generator sized to the prompt and answer
(``follow_up_room=0``). For the real model's shapes, build both from the full-size random checkpoint:

    python -m builder_plugin.testing.make_checkpoint full --preset full
    python -m builder_plugin -i full -o pkg-int4 -p int4
    python -m builder_plugin -i full -o pkg-int4-split -p int4 --lora split

Scenarios, each in its own process (so each peak RSS is its own), one after the other:
- ``all modes``: two text questions (the first also pays the session's one-time warm-up), then an audio question,
  then an image question (each a new conversation), then a
  text follow-up in the image conversation (kept generator), then the same kind of follow-up after ``release()``
  (the whole conversation prefilled again, as every follow-up was before);
- ``text only`` / ``image only`` (split package): one question of that mode, the memory of one mode as before.

Media: a 451x300 image and a 5 s clip, generated (random content, real sizes). Results: benchmarks/results/chat.json
and the "Chat run time" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_report_options,
    command_line,
    current_rss_bytes,
    fmt,
    machine_info,
    machine_markdown,
    make_media,
    markdown_table,
    peak_rss_bytes,
    publish,
    rss_split,
)

GB = 1e9
IMAGE_SIZE = (451, 300)
AUDIO_SECONDS = 5.0
QUESTIONS = {
    "text": "Tell me a short story about a lighthouse keeper and a storm.",
    "text again": "Explain how tides work, in simple words.",
    "audio": "Transcribe the audio clip.",
    "image": "Describe the picture in detail.",
    "follow-up": "What colours stand out most?",
    "re-prefill": "What shapes stand out most?",
}
EXPLANATION = ("\"routed\" runs `builder_plugin.runtime.Chat` on the default package (one self-routing decoder) as "
               "it is; \"split\" runs a `--lora split` package with one `og.Model` per mode and every question "
               "re-prefilled in a generator sized to it (`follow_up_room=0`), as the run-time helper ran packages "
               "before. The first text question of a process includes the session's one-time warm-up.")
MEMORY_TARGET = 1.3  # all modes in one process, against one mode's peak
FOLLOW_UP_TARGET = 0.05  # follow-up time to first token, against a re-prefill of the conversation
SPEED_TARGET = 0.10  # decode and prefill within 10 % of the split package's


# ---- worker (one scenario in its own process) -------------------------------------------------------------------


def _step(chat: Any, name: str, question: str, images: list[Path], audios: list[Path], new_tokens: int,
          new_conversation: bool) -> dict[str, Any]:
    from builder_plugin.runtime import Sampling

    if new_conversation:
        chat.clear()
    started = time.perf_counter()
    for _ in chat.ask(question, images, audios, max_new_tokens=new_tokens, sampling=Sampling()):
        pass
    wall = time.perf_counter() - started
    stats = chat.last_stats
    return {"step": name, "prompt_tokens": stats.prompt_tokens, "prefill_tokens": stats.prefill_tokens,
            "reused_tokens": stats.reused_tokens, "new_tokens": stats.new_tokens,
            "time_to_first_token_s": round(stats.time_to_first_token_s, 3),
            "decode_tokens_per_s": round(stats.tokens_per_s, 2), "wall_s": round(wall, 2),
            "rss_bytes": current_rss_bytes(), "peak_rss_bytes": peak_rss_bytes(), **rss_split()}


def worker(scenario: str, package: Path, media: Path, new_tokens: int, follow_up_room: int | None) -> dict:
    from builder_plugin.runtime import FOLLOW_UP_ROOM, Chat

    image, audio = [media / "photo.png"], [media / "clip.wav"]
    started = time.perf_counter()
    chat = Chat(package, follow_up_room=FOLLOW_UP_ROOM if follow_up_room is None else follow_up_room)
    steps = []
    plan = {
        "all modes": [("text", [], [], True), ("text again", [], [], True), ("audio", [], audio, True),
                      ("image", image, [], True),
                      ("follow-up", [], [], False), ("re-prefill", [], [], False)],
        "text only": [("text", [], [], True)],
        "image only": [("image", image, [], True)],
    }[scenario]
    for name, images, audios, new in plan:
        if name == "re-prefill":
            chat.release()  # the conversation stays; its next question is prefilled whole
        first_load = not chat.is_loaded(chat.next_variant(images, audios))
        step = _step(chat, name, QUESTIONS[name], images, audios, new_tokens, new)
        step["loaded_a_model"] = first_load
        steps.append(step)
        print(json.dumps(step), file=sys.stderr, flush=True)
    return {"scenario": scenario, "package": str(package), "routing": chat.manifest.routing,
            "follow_up_room": chat.follow_up_room, "steps": steps, "peak_rss_bytes": peak_rss_bytes(),
            "seconds": round(time.perf_counter() - started, 1)}


def run_worker(scenario: str, package: Path, media: Path, args: argparse.Namespace,
               follow_up_room: int | None) -> dict:
    command = [sys.executable, "-m", __spec__.name, "--worker", scenario, "--package", str(package), "--media",
               str(media), "--new-tokens", str(args.new_tokens)]
    if follow_up_room is not None:
        command += ["--follow-up-room", str(follow_up_room)]
    print(f"{scenario}: {package}", file=sys.stderr, flush=True)
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)  # its steps show on stderr
    if result.returncode != 0:
        raise SystemExit(f"worker {scenario} on {package} failed (exit {result.returncode})")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- report -----------------------------------------------------------------------------------------------------


def _gb(value: float | None) -> str:
    return fmt(None if value is None else value / GB, 2)


def report(results: dict[str, Any]) -> str:
    runs = results["runs"]
    rows = []
    for label, run in runs.items():
        for step in run["steps"]:
            rows.append([label, step["step"], step["prompt_tokens"], step["prefill_tokens"],
                         fmt(step["time_to_first_token_s"], 2), fmt(step["decode_tokens_per_s"], 2),
                         _gb(step["rss_bytes"]), _gb(step["peak_rss_bytes"])])
    table = markdown_table(["package", "step", "prompt tokens", "prefilled", "first token (s)", "decode tok/s",
                            "RSS after (GB)", "peak RSS (GB)"], rows)
    lines = [EXPLANATION, "", f"Command: `{results['command']}`", "", machine_markdown(results["machine"]), "",
             table, ""]
    checks = results.get("checks", {})
    for name, check in checks.items():
        lines.append(f"- {name}: {check['text']} ({'met' if check['met'] else 'not met'})")
    return "\n".join(lines) + "\n"


def checks(runs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    routed = runs.get("routed: all modes")
    if routed is None:
        return out
    steps = {s["step"]: s for s in routed["steps"]}
    follow, again = steps["follow-up"], steps["re-prefill"]
    ratio = follow["time_to_first_token_s"] / again["time_to_first_token_s"]
    out["follow-up"] = {"ratio": ratio, "met": ratio <= FOLLOW_UP_TARGET,
                        "text": f"follow-up first token {follow['time_to_first_token_s']:.2f} s = {100 * ratio:.1f} % "
                                f"of a re-prefill ({again['time_to_first_token_s']:.2f} s, {again['prompt_tokens']} "
                                f"tokens); target <= {100 * FOLLOW_UP_TARGET:.0f} %"}
    singles = {k: v for k, v in runs.items() if k.startswith("split: ") and k.endswith(" only")}
    if singles:
        one = max(v["peak_rss_bytes"] for v in singles.values())
        ratio = routed["peak_rss_bytes"] / one
        each = " / ".join(f"{name[len('split: '):]} {run['peak_rss_bytes'] / GB:.2f}" for name, run in singles.items())
        out["memory"] = {"ratio": ratio, "met": ratio <= MEMORY_TARGET,
                         "text": f"all three modes in one process peak at {routed['peak_rss_bytes'] / GB:.2f} GB = "
                                 f"{ratio:.2f}x the largest one-mode peak ({one / GB:.2f} GB: {each}); "
                                 f"target <= {MEMORY_TARGET}x"}
    split = runs.get("split: all modes")
    if split is not None:
        base = {s["step"]: s for s in split["steps"]}
        worst = 0.0
        parts = []
        for name in ("text again", "audio", "image"):  # "text" also holds the process' one-time warm-up
            ours, theirs = steps[name], base[name]
            decode = ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"] - 1
            prefill = theirs["time_to_first_token_s"] / ours["time_to_first_token_s"] - 1
            worst = min(worst, decode, prefill)
            parts.append(f"{name}: decode {100 * decode:+.0f} %, first token {100 * prefill:+.0f} %")
        out["speed"] = {"worst": worst, "met": worst >= -SPEED_TARGET,
                        "text": "routed against split, higher is faster: " + "; ".join(parts)
                                + f"; target: no worse than -{100 * SPEED_TARGET:.0f} %"}
        out["memory before"] = {"met": True, "ratio": split["peak_rss_bytes"] / GB,
                                "text": f"the split package through the same steps peaks at "
                                        f"{split['peak_rss_bytes'] / GB:.2f} GB (one og.Model per mode)"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, required=True, help="routed package (the default build)")
    parser.add_argument("--split-package", type=Path, help="--lora split package of the same checkpoint")
    parser.add_argument("--new-tokens", type=int, default=32)
    add_report_options(parser, "chat.json", note=False, replay=False)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--media", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--follow-up-room", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args.worker, args.package, args.media, args.new_tokens, args.follow_up_room)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        media = make_media(Path(tmp) / "media", IMAGE_SIZE, AUDIO_SECONDS)
        runs: dict[str, Any] = {}
        runs["routed: all modes"] = run_worker("all modes", args.package, media, args, None)
        if args.split_package:
            for scenario in ("all modes", "text only", "image only"):
                runs[f"split: {scenario}"] = run_worker(scenario, args.split_package, media, args, 0)
    results = {"command": command_line("bench_chat.py", argv), "machine": machine_info(),
               "new_tokens": args.new_tokens, "runs": runs}
    results["checks"] = checks(runs)
    publish(results, args.out, args.doc, "## Chat run time", report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
