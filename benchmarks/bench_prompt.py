"""Prompts as an app meets them, through builder_plugin.runtime.Chat: a 512-token text prompt, a one-image question
(448x448: the global view and one crop, about 550 tokens) and a 30-second clip, each asked in a fresh process on a
package with the project's kernel library and without it (onnxruntime's own MatMulNBits, today's default before the
library), taking turns. Not by default: a 2048x1536 photo, whole (the processor's 20 crops and the global view) and
at low detail (open_image's fit to one crop, the server's detail "low").

    python -m benchmarks.bench_prompt PKG [--rounds 2] [--asks 2] [--new-tokens 16] [--prompts text-512,image,audio-30s]
                                          [--kernels library,library-vnni,onnxruntime]
    python -m benchmarks.bench_prompt PKG --prompts photo-low,photo --kernels library --rounds 1
    python -m benchmarks.bench_prompt PKG --prompts text-3000,phone --kernels library --prefill-chunks 1024,0
    python -m benchmarks.bench_prompt --from-json benchmarks/results/prompt.json   # redo the report

Reported per prompt and kernel, best / median over the rounds: time to the first token (question asked to first
piece of the answer: processor, encoders, embedding and the decoder's prefill; the first question of the process and
the next one, a new conversation, apart), prefill tokens/s (prompt tokens / that time), decode tokens/s (the answer's
later tokens), the process' resident memory after the package loaded and at its peak, and the load time. Every row
notes the machine's load average (other jobs share the cores: background load only ever slows a run down).
Results: benchmarks/results/prompt.json and the "Prompts through Chat" section of docs/benchmarks.md; the photo's
(asked alone) in prompt_photo.json and "A large photo through Chat, whole and at low detail"; a 3,000-token text
prompt and a 4032 x 3024 phone photo (asked apart, with --prefill-chunks) in prompt_chunks.json and "A long prompt
through Chat, prefilled in chunks and in one call".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    ROOT,
    add_report_options,
    current_rss_bytes,
    fmt,
    machine_markdown,
    make_media,
    markdown_table,
    measure_or_replay,
    names_from,
    peak_rss_bytes,
    per_machine_class,
)
from builder_plugin.kernels import level as library_level
from builder_plugin.runtime.package import PREFILL_CHUNK
from builder_plugin.testing.media import make_image

HEADINGS = {"prompts": per_machine_class("## Prompts through Chat"),
            "photo": per_machine_class("## A large photo through Chat, whole and at low detail"),
            "chunks": per_machine_class("## A long prompt through Chat, prefilled in chunks and in one call")}
# measured apart, each in its own section and results file
APART = {"photo": ("photo", "photo-low"), "chunks": ("text-3000", "phone")}
# What each kernel setting sets: the run time's default (the library where it helps), the library with the paths of a
# CPU with AVX-512 VNNI and BF16 but no AMX, the library held to its in-place int8 path for every row count,
# onnxruntime's own kernels.
KERNELS = {"library": {"BUILDER_PLUGIN_KERNELS": "1"},
           "library-vnni": {"BUILDER_PLUGIN_KERNELS": "1", "BUILDER_PLUGIN_OPS_PATH": "vnni"},
           "library-avx512": {"BUILDER_PLUGIN_KERNELS": "1", "BUILDER_PLUGIN_OPS_PATH": "avx512"},
           "onnxruntime": {"BUILDER_PLUGIN_KERNELS": "0"}}
IMAGE_SIZE = (448, 448)
PHOTO_SIZE = (2048, 1536)
PHONE_SIZE = (4032, 3024)  # a phone camera's photo: 12 crops, about 3,400 prompt tokens (within the LongRoPE switch)
AUDIO_SECONDS = 30.0
TEXT_TOKENS = {"text-512": 512, "text-3000": 3000}  # the text prompts' lengths
STORY = ("The lighthouse keeper counted the ships that passed in the storm and wrote each name she could read into "
         "a small blue book, with the hour, the wind and the colour of the sea. ")
# name -> (question, image file, audio file, image fit to one crop)
PROMPTS = {
    "text-512": ("Summarise the notes above in three sentences.", None, None, False),
    "text-3000": ("Summarise the notes above in three sentences.", None, None, False),
    "image": ("Describe the picture in detail.", "photo.png", None, False),
    "audio-30s": ("Transcribe the audio clip.", None, "clip.wav", False),
    "photo": ("Describe the picture in detail.", "photo-2048.png", None, False),
    "photo-low": ("Describe the picture in detail.", "photo-2048.png", None, True),
    "phone": ("Describe the picture in detail.", "photo-4032.jpg", None, False),
}
DEFAULT_PROMPTS = ["text-512", "image", "audio-30s"]


def text_prompt(chat: Any, question: str, tokens: int) -> str:
    """`question` after enough of STORY that the whole prompt is about `tokens` tokens."""
    loaded = chat.package.load(chat.main_decoder)
    ids = loaded.encode(STORY * (tokens // 8))
    overhead = len(loaded.encode(f"<|user|>\n{question}<|end|><|assistant|>"))
    return loaded.tokenizer.decode(ids[:max(tokens - overhead, 1)]) + "\n" + question


def worker(package: str, prompt: str, media: str, asks: int, new_tokens: int, chunk: int) -> dict[str, Any]:
    from builder_plugin.runtime import Chat, Package, Sampling, open_image

    started = time.perf_counter()
    chat = Chat(Package(package, prefill_chunk=chunk or None))
    question, image, audio, low_detail = PROMPTS[prompt]
    images = [Path(media) / image] if image else []
    audios = [Path(media) / audio] if audio else []
    chat.package.load(chat.next_variant(images, audios))
    load_s = time.perf_counter() - started
    rss_after_load = current_rss_bytes()
    if prompt.startswith("text"):
        question = text_prompt(chat, question, TEXT_TOKENS[prompt])
    runs = []
    for _ in range(asks):
        chat.clear()
        fitting = time.perf_counter()  # the fit is part of the wait (Chat decodes the files of a whole photo itself)
        asked = [open_image(path, fit=chat.package.crop_side) for path in images] if low_detail else images
        fitting = time.perf_counter() - fitting if low_detail else 0.0
        for _ in chat.ask(question, asked, audios, max_new_tokens=new_tokens, sampling=Sampling()):
            pass
        stats = chat.last_stats
        runs.append({"prompt_tokens": stats.prompt_tokens, "ttft_s": fitting + stats.time_to_first_token_s,
                     "decode_tokens_per_s": stats.tokens_per_s, "new_tokens": stats.new_tokens})
    return {"load_s": load_s, "rss_after_load_bytes": rss_after_load, "peak_rss_bytes": peak_rss_bytes(),
            "runs": runs, "load_average": os.getloadavg()[0]}


def ask_in_process(package: Path, prompt: str, kernels: str, chunk: int, media: Path, asks: int,
                   new_tokens: int) -> dict[str, Any]:
    """`worker` in a fresh process with a kernel setting (KERNELS); also what bench_peers measures a package with."""
    job = {"package": str(package), "prompt": prompt, "media": str(media), "asks": asks, "new_tokens": new_tokens,
           "chunk": chunk}
    env = {**os.environ, "PYTHONPATH": str(ROOT), **KERNELS[kernels]}
    done = subprocess.run([sys.executable, "-m", __spec__.name, "--worker", json.dumps(job)], capture_output=True,
                          text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{prompt} with {kernels} failed: {done.stderr.strip()[-1500:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{prompt}, {kernels}, prefill chunk {chunk or 'off'}: first token " +
          ", ".join(f"{r['ttft_s']:.2f}" for r in found["runs"]) +
          f" s, load average {found['load_average']:.2f}", file=sys.stderr, flush=True)
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prompt-") as folder:
        media = make_media(Path(folder), IMAGE_SIZE, AUDIO_SECONDS)
        if set(APART["photo"]) & set(args.prompts):
            make_image(media / "photo-2048.png", *PHOTO_SIZE, seed=5)
        if "phone" in args.prompts:
            make_image(media / "photo-4032.jpg", *PHONE_SIZE, seed=6)
        for round_index in range(args.rounds):
            order = args.kernels if round_index % 2 == 0 else args.kernels[::-1]
            for prompt in args.prompts:
                for kernels in order:
                    for chunk in args.prefill_chunks:
                        results.setdefault(f"{prompt}|{kernels}|{chunk}", []).append(
                            ask_in_process(args.package, prompt, kernels, chunk, media, args.asks,
                                           args.new_tokens))
    return {"package": str(args.package), "library_level": library_level(), "rounds": args.rounds, "asks": args.asks,
            "new_tokens": args.new_tokens,
            "prompts": args.prompts, "results": results}


def section(prompts: list[str]) -> str:
    """Where the results of `prompts` go: a section measured apart (APART) or the main one."""
    return next((name for name, apart in APART.items() if set(prompts) <= set(apart)), "prompts")


def _best_median(values: list[float], digits: int = 2) -> str:
    return f"{fmt(min(values), digits)} / {fmt(statistics.median(values), digits)}" if values else ""


def report(results: dict[str, Any]) -> str:
    rows = []
    for key, processes in results["results"].items():
        prompt, kernels, *chunk = key.split("|")  # results before the prefill chunk setting have none
        firsts = [p["runs"][0]["ttft_s"] for p in processes]
        later = [r["ttft_s"] for p in processes for r in p["runs"][1:]]
        tokens = processes[0]["runs"][0]["prompt_tokens"]
        prefill = [r["prompt_tokens"] / r["ttft_s"] for p in processes for r in p["runs"]]
        decode = [r["decode_tokens_per_s"] for p in processes for r in p["runs"] if r["new_tokens"] > 1]
        loads = [p["load_average"] for p in processes]
        chunk_text = ("off" if chunk[0] == "0" else chunk[0]) if chunk else ""
        rows.append([prompt, kernels, chunk_text, tokens, _best_median(firsts), _best_median(later),
                     f"{fmt(max(prefill), 1)} / {fmt(statistics.median(prefill), 1)}",
                     f"{fmt(max(decode), 2)} / {fmt(statistics.median(decode), 2)}" if decode else "",
                     fmt(min(p["rss_after_load_bytes"] for p in processes) / 1e9, 2),
                     fmt(max(p["peak_rss_bytes"] for p in processes) / 1e9, 2),
                     _best_median([p["load_s"] for p in processes], 1),
                     f"{fmt(min(loads), 2)}-{fmt(max(loads), 2)}"])
    return "\n".join([
        *([results["note"], ""] if results.get("note") else []),
        f"`{results['command']}` at {results['git']['commit'][:10]}: `{Path(results['package']).name}`, each "
        f"(prompt, kernel) in a fresh process, {results['rounds']} rounds taking turns, {results['asks']} questions "
        f"per process (each a new conversation), {results['new_tokens']} new tokens, greedy. library = the run time's "
        "default (builder_plugin's kernels where this CPU has a fast path); library-vnni = "
        "BUILDER_PLUGIN_OPS_PATH=vnni (the paths of a CPU with AVX-512 VNNI and BF16 but no AMX: int8 in place for few "
        "rows, int8 panels for many, the attention on AVX-512 BF16); library-avx512 = BUILDER_PLUGIN_OPS_PATH=avx512 "
        "(the in-place int8 path for every row count, onnxruntime's attention); onnxruntime = "
        "BUILDER_PLUGIN_KERNELS=0. Prefill chunk: tokens per prefill call of a longer prompt (the Package's "
        "prefill_chunk; off: one call). Times best / median; decode and "
        "prefill tokens/s best / median.", "",
        markdown_table(["prompt", "kernel", "prefill chunk", "prompt tokens", "first token s, first question",
                        "first token s, later", "prefill tok/s", "decode tok/s", "RSS after load GB", "peak RSS GB",
                        "load s", "load average"], rows), "",
        machine_markdown(results["machine"]), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--asks", type=int, default=2, help="questions per process (the first pays warm-up)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=names_from(list(PROMPTS), "prompt"), default=DEFAULT_PROMPTS,
                        help=f"from: {', '.join(PROMPTS)} (default: {','.join(DEFAULT_PROMPTS)})")
    parser.add_argument("--kernels", type=names_from(list(KERNELS), "kernel setting"),
                        default=["library", "onnxruntime"], help=f"from: {', '.join(KERNELS)}")
    parser.add_argument("--prefill-chunks", type=lambda text: [int(c) for c in text.split(",")],
                        default=[PREFILL_CHUNK], help=f"prefill chunk sizes, 0: off (default: {PREFILL_CHUNK})")
    add_report_options(parser, "prompt.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out == parser.get_default("out") and section(args.prompts) != "prompts":  # measured apart: a file each
        args.out = args.out.with_name(f"prompt_{section(args.prompts)}.json")
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(worker(job["package"], job["prompt"], job["media"], job["asks"], job["new_tokens"],
                                job["chunk"])))
        return 0
    if not args.from_json and args.package is None:
        parser.error("give the package folder (or --from-json)")
    heading = lambda results: HEADINGS[section(results["prompts"])](results)  # noqa: E731
    return measure_or_replay(args, argv, "bench_prompt.py", heading, run, report)


if __name__ == "__main__":
    sys.exit(main())
