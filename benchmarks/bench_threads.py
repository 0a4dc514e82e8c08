"""Decode speed against the memory-read bound, and the first token of a one-image prompt, with the thread count
onnxruntime-genai picks itself ("as built") and with the one Chat and the server pick at load ("default").

    python -m benchmarks.bench_threads PKG [PKG ...] [--rounds 3] [--new-tokens 40] [--image] [--serve]
                                       [--lock /work/fullsize.lock] [--label NAME] [--doc docs/benchmarks.md]

Every measurement is a fresh process (the package loaded once in it), run under `flock --lock` when given; rounds
alternate the order of the two settings so background load hits both alike. Settings:
- "as built": `Chat(threads=genai_default_threads())`, the count onnxruntime-genai 0.18 gives every session of a
  package that does not set one (min(16, CPUs / 2)); it is what an app loading the package with `og.Model(path)`
  gets.
- "default": `Chat(package)`, one thread per physical core the process may use (builder_plugin.runtime.threads).
  Idle pool threads sleep at once (`session.intra_op.allow_spinning` "0").
- "default, spinning" (--spin-setting, Chat only): the same with `session.intra_op.allow_spinning` "1" (onnxruntime's
  own default) in every section the overlay sets: a pool thread with no work spins before it sleeps.
Per process: an untimed 4-token warm-up answer, then a text question answered with --new-tokens tokens through
`Chat.ask` (tokens/s = the answer's decode rate) and the same prompt through a raw og.Generator on Chat's model with
end-of-sequence masked (tokens/s = 1 / median step); with --image, a new conversation with one --image-size image,
time to its first token. With --serve, the same two settings through `python -m builder_plugin.serve --threads N`
(and without --threads): one request with max_tokens 1 (time to first token) and one with --new-tokens
(decode rate = (completion tokens - 1) / (its time - the first request's time)).

Bytes per step: the decoder's MatMul / MatMulNBits weights (runtime_bench.decoder_graph). Share of the read bound:
this machine's memory bandwidth moves by a third from minute to minute (a shared host), so each decode rate is set
against numpy read probes (common.read_probe_gb_s, every CPU) taken in the same process right before and after it:
share = bytes per step x tokens/s / the mean of those two probes. The raw generator alternates blocks of
RAW_BLOCK steps with probes and reports the median block's share.
Results: --out (merged by --label) and the "Threads" section of --doc.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    GB,
    ROOT,
    add_report_options,
    command_line,
    fmt,
    git_state,
    machine_info,
    machine_markdown,
    markdown_table,
    publish,
    read_bandwidth,
    read_probe_gb_s,
    results_out,
)
from benchmarks.runtime_bench.decoder_graph import decode_weight_bytes
from builder_plugin.layout import GENAI_CONFIG_FILE
from builder_plugin.runtime.threads import SPINNING_KEY

HEADING = "## Threads"
QUESTION = "Write a long story about a lighthouse keeper and the ships she watches."
SETTINGS = ("as built", "default")
SPIN = "default, spinning"  # --spin-setting: idle pool threads spin before they sleep (onnxruntime's own default)
RAW_BLOCK = 8  # raw decode steps between two read probes


def _threads_of(setting: str) -> int | None:
    from builder_plugin.runtime.threads import genai_default_threads

    return genai_default_threads() if setting == "as built" else None


# ---- worker processes ---------------------------------------------------------------------------------------------

def chat_worker(job: dict[str, Any]) -> dict[str, Any]:
    from builder_plugin.runtime import Chat

    started = time.perf_counter()
    chat = Chat(job["package"], max_length=job["max_length"], threads=job["threads"])
    if job.get("spin"):  # the same overlay with spinning on in every section it sets
        for section in chat.package.thread_overlay.values():
            section["session_options"][SPINNING_KEY] = "1"
    variant = chat.variant_for(has_image=False, has_audio=False)
    chat.load(variant)
    out: dict[str, Any] = {"load_s": time.perf_counter() - started}
    for _ in chat.ask("Hello", max_new_tokens=4):
        pass
    chat.clear()
    before = read_probe_gb_s()
    for _ in chat.ask(QUESTION, max_new_tokens=job["new_tokens"]):
        pass
    after = read_probe_gb_s()
    stats = chat.last_stats
    out["chat"] = {"tokens_per_s": stats.tokens_per_s, "new_tokens": stats.new_tokens,
                   "ttft_s": stats.time_to_first_token_s, "prompt_tokens": stats.prompt_tokens,
                   "read_gb_s": [before, after]}
    out["raw_steps_s"], out["raw_blocks"] = raw_steps(chat, variant, job["new_tokens"])
    if job.get("image"):
        chat.clear()
        for _ in chat.ask("Describe this picture.", images=[job["image"]], max_new_tokens=1):
            pass
        stats = chat.last_stats
        out["image"] = {"ttft_s": stats.time_to_first_token_s, "prompt_tokens": stats.prompt_tokens}
    return out


def raw_steps(chat: Any, variant: str, new_tokens: int) -> tuple[list[float], list[dict[str, Any]]]:
    """Each generate_next_token after the first of a greedy og.Generator on Chat's model, eos masked; and the blocks
    of RAW_BLOCK steps with the read probes before and after each."""
    import onnxruntime_genai as og

    model = chat.model(variant)
    tokenizer = og.Tokenizer(model)
    ids = tokenizer.encode(f"<|user|>{QUESTION}<|end|><|assistant|>")
    total = len(ids) + new_tokens
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    generator.generate_next_token()  # the prompt's
    steps: list[float] = []
    blocks: list[dict[str, Any]] = []
    while not generator.is_done():
        before = read_probe_gb_s()
        block = []
        while len(block) < RAW_BLOCK and not generator.is_done():
            start = time.perf_counter()
            generator.generate_next_token()
            block.append(time.perf_counter() - start)
        blocks.append({"steps_s": block, "read_gb_s": [before, read_probe_gb_s()]})
        steps += block
    return steps, blocks


def server_worker(job: dict[str, Any]) -> dict[str, Any]:
    import openai

    command = [sys.executable, "-m", "builder_plugin.serve", job["package"], "--port", "0",
               "--max-length", str(job["max_length"])]
    if job["threads"] is not None:
        command += ["--threads", str(job["threads"])]
    started = time.perf_counter()
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        if not line.startswith("serving "):
            raise RuntimeError(f"the server did not start: {line!r}")
        url, model = line.split(" at ")[1].strip(), line.split()[1]
        load_s = time.perf_counter() - started
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)

        def request(max_tokens: int) -> tuple[float, int]:
            start = time.perf_counter()
            response = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens)
            return time.perf_counter() - start, response.usage.completion_tokens

        request(4)  # warm-up
        first_s, _ = request(1)
        before = read_probe_gb_s()
        total_s, tokens = request(job["new_tokens"])
        after = read_probe_gb_s()
    finally:
        server.terminate()
        server.wait(timeout=60)
    decode_s = total_s - first_s
    return {"load_s": load_s, "server": {"ttft_s": first_s, "new_tokens": tokens, "read_gb_s": [before, after],
                                         "tokens_per_s": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0
                                         else 0.0}}


def run_worker(job: dict[str, Any], lock: str | None) -> dict[str, Any]:
    command = [sys.executable, "-m", __spec__.name, "--worker", json.dumps(job)]
    if lock:
        command = ["flock", lock, *command]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"worker failed ({job['package']}, {job['threads']}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the run ------------------------------------------------------------------------------------------------------

def measure(args: argparse.Namespace) -> dict[str, Any]:
    from builder_plugin.cpus import available_cpus
    from builder_plugin.runtime.threads import default_threads, genai_default_threads

    image = None
    if args.image:
        from common import make_media

        image = str(make_media(Path(args.work), tuple(args.image_size), 1.0) / "photo.png")
    settings = SETTINGS + ((SPIN,) if args.spin_setting else ())
    packages: dict[str, Any] = {}
    for package in args.packages:
        config = json.loads((Path(package) / GENAI_CONFIG_FILE).read_text())
        decoder = Path(package) / config["model"]["decoder"]["filename"]
        packages[package] = {"layers": config["model"]["decoder"]["num_hidden_layers"],
                             "bytes": decode_weight_bytes(decoder), "runs": {s: [] for s in settings}}
    bandwidth = []
    vias = ["chat"] + (["server"] if args.serve else [])
    for round_index in range(args.rounds):
        probe = read_bandwidth(threads=available_cpus()).as_dict()
        bandwidth.append(probe)
        print(f"round {round_index + 1}: read {probe['best_gb_s']:.1f} GB/s", file=sys.stderr, flush=True)
        order = settings if round_index % 2 == 0 else settings[::-1]
        for package, entry in packages.items():
            for setting in order:
                for via in vias if setting != SPIN else ["chat"]:
                    job = {"package": package, "threads": _threads_of(setting), "via": via,
                           "spin": setting == SPIN,
                           "new_tokens": args.new_tokens, "max_length": args.max_length,
                           "image": image if via == "chat" else None}
                    result = run_worker(job, args.lock)
                    result["via"] = via
                    entry["runs"][setting].append(result)
                    print(f"  {Path(package).name} {setting} {via}: {summary_line(result)}", file=sys.stderr,
                          flush=True)
    return {"packages": packages, "read_bandwidth": bandwidth, "cpus": available_cpus(),
            "default_threads": default_threads(), "genai_default_threads": genai_default_threads(),
            "new_tokens": args.new_tokens,
            "image_size": args.image_size if args.image else None, "rounds": args.rounds}


def summary_line(result: dict[str, Any]) -> str:
    parts = []
    if "chat" in result:
        steps = result["raw_steps_s"]
        parts.append(f"Chat {result['chat']['tokens_per_s']:.2f} tok/s, raw {1 / statistics.median(steps):.2f}")
    if "image" in result:
        parts.append(f"image first token {result['image']['ttft_s']:.1f} s ({result['image']['prompt_tokens']} tok)")
    if "server" in result:
        parts.append(f"server {result['server']['tokens_per_s']:.2f} tok/s")
    return ", ".join(parts)


# ---- report -------------------------------------------------------------------------------------------------------

def _best_median(values: list[float]) -> tuple[float | None, float | None]:
    return (max(values), statistics.median(values)) if values else (None, None)


def _shares(runs: list[dict[str, Any]], via: str, step_bytes: int, fallback_gb_s: float) -> list[tuple[float, float]]:
    """(tokens/s, share of the read bound) of each run through `via` ("chat", "raw", "server"): the decode's read
    rate over the mean of the probes beside it (runs recorded before the paired probes: the run's best probe)."""
    out = []
    for run in runs:
        if via == "raw":
            if "raw_steps_s" not in run:
                continue
            rate = 1 / statistics.median(run["raw_steps_s"])
            blocks = run.get("raw_blocks") or [{"steps_s": run["raw_steps_s"], "read_gb_s": [fallback_gb_s]}]
            share = statistics.median(len(b["steps_s"]) / sum(b["steps_s"]) * step_bytes
                                      / (statistics.mean(b["read_gb_s"]) * GB) for b in blocks)
        elif via in run:
            rate = run[via]["tokens_per_s"]
            share = rate * step_bytes / (statistics.mean(run[via].get("read_gb_s", [fallback_gb_s])) * GB)
        else:
            continue
        out.append((rate, share))
    return out


def _probes(runs: list[dict[str, Any]]) -> list[float]:
    values = [v for r in runs for via in ("chat", "server") if via in r for v in r[via].get("read_gb_s", [])]
    return values + [v for r in runs for b in r.get("raw_blocks", []) for v in b["read_gb_s"]]


def report(results: dict[str, Any]) -> str:
    best_probe = max(b["best_gb_s"] for b in results["read_bandwidth"])
    rows = []
    for package, entry in results["packages"].items():
        step_bytes = entry["bytes"]["total_bytes"]
        for setting, runs in entry["runs"].items():
            image = [r["image"]["ttft_s"] for r in runs if "image" in r]
            threads = (results["genai_default_threads"] if setting == "as built"
                       else results.get("default_threads", results["cpus"]))

            def cell(via: str, runs: list[dict[str, Any]] = runs, step_bytes: int = step_bytes) -> str:
                pairs = _shares(runs, via, step_bytes, best_probe)
                if not pairs:
                    return "-"
                rates, shares = [p[0] for p in pairs], [p[1] for p in pairs]
                return (f"{fmt(max(rates))} / {fmt(statistics.median(rates))} "
                        f"({100 * statistics.median(shares):.0f} %, {100 * min(shares):.0f}-{100 * max(shares):.0f})")

            probes = _probes(runs)
            probe_cell = (f"{statistics.median(probes):.1f} ({min(probes):.1f}-{max(probes):.1f})" if probes
                          else f"{best_probe:.1f} (best of the run)")
            image_cell = "-" if not image else f"{fmt(min(image), 1)} / {fmt(statistics.median(image), 1)}"
            rows.append([f"`{Path(package).name}` ({entry['layers']} layers)", f"{setting} ({threads})",
                         f"{step_bytes / GB:.2f}", probe_cell, cell("chat"), cell("raw"), cell("server"),
                         image_cell])
    headers = ["package", "setting (threads)", "GB / step", "read probes GB/s median (range)",
               "Chat tok/s best / median (share of read bound: median, range)",
               "raw generator tok/s (1 / median step) (share)", "server tok/s (share)",
               "image first token s best / median"]
    tokens = {r["image"]["prompt_tokens"] for e in results["packages"].values() for rs in e["runs"].values()
              for r in rs if "image" in r}
    return "\n".join([
        f"{HEADING}\n",
        f"`{results['command']}` at {results['git']['commit'][:10]}; {results['rounds']} rounds, each setting in a "
        f"fresh process, alternating. {results['new_tokens']} new tokens of a text question (Chat: the answer's "
        "decode rate; raw: a greedy og.Generator on Chat's model with end-of-sequence masked, 1 / median step; "
        "server: one `python -m builder_plugin.serve` request, decode rate after its first token). "
        f"Share of the read bound = the decoder's MatMul weight bytes per step x tokens/s / numpy read bandwidth "
        f"with {results['cpus']} threads, probed in the same process right before and after each decode (runs "
        "without such probes: the run's best probe). "
        + (f"Image: one {'x'.join(map(str, results['image_size']))} image ({', '.join(map(str, sorted(tokens)))} "
           "prompt tokens), time to the first token through Chat. " if results["image_size"] else "")
        + "\"as built\" = the thread count onnxruntime-genai 0.18 picks itself (min(16, CPUs / 2)); \"default\" = "
        "Chat's and the server's (one per physical core the process may use).\n",
        markdown_table(headers, rows),
        "",
        machine_markdown(results["machine"]),
    ])


def body_of(merged: dict[str, Any]) -> str:
    """Every run's report under one heading."""
    return "\n\n".join(report(run).split("\n", 2)[2] for run in merged["runs"].values())


def merge(previous: dict[str, Any], label: str, results: dict[str, Any]) -> dict[str, Any]:
    runs = dict(previous.get("runs", {}))
    runs[label] = results
    return {"runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--image", action="store_true", help="also time the first token of a one-image prompt")
    parser.add_argument("--image-size", type=int, nargs=2, default=[448, 448], metavar=("W", "H"))
    parser.add_argument("--serve", action="store_true", help="also decode through python -m builder_plugin.serve")
    parser.add_argument("--spin-setting", action="store_true",
                        help=f"also run Chat's default with {SPINNING_KEY}=1 (chat only)")
    parser.add_argument("--lock", default=None, help="flock this file around every worker process")
    parser.add_argument("--work", default="/tmp/bench_threads")
    parser.add_argument("--label", default=None, help="name of this run in --out (default: the package names)")
    add_report_options(parser, "threads.json", note=False)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(chat_worker(job) if job["via"] == "chat" else server_worker(job)))
        return 0
    if args.from_json:
        merged = json.loads(args.from_json.read_text())
        publish(merged, results_out(args), args.doc, HEADING, body_of(merged))
        return 0
    if not args.packages:
        parser.error("give at least one package folder")
    results = measure(args)
    results.update(command=command_line("bench_threads.py", argv), git=git_state(), machine=machine_info())
    label = args.label or "+".join(Path(p).name for p in args.packages)
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    merged = merge(previous, label, results)
    publish(merged, args.out, args.doc, HEADING, body_of(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
