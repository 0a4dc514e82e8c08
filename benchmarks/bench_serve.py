"""Serving overhead: short text requests through `python -m builder_plugin.serve` (requests/s, latency percentiles
with several clients at once) and time to first token through the server against `Chat` directly on the same
package.

    python benchmarks/bench_serve.py                          # the tiny generated package (built into --work)
    python benchmarks/bench_serve.py /work/bench/pkg-int4 --requests 8 --concurrency 2 --ttft-runs 3 --max-length 2048

Chat runs first in this process, then it is freed and the server runs in its own process (so a full-size package is
loaded once at a time); the clients are threads of this process using the openai client. Every request is a fresh
one-question conversation with its own text, greedy, `--max-tokens` new tokens. Results are merged by `--label`
into `benchmarks/results/serve.json` and the "## Serving" section of docs/benchmarks.md is rewritten from it.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt, machine_info, markdown_table, replace_markdown_section, write_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serve.json"
DOC = ROOT / "docs" / "benchmarks.md"


def prompt(i: int) -> str:
    return f"Request {i}: name three colours and say why you like them."


def tiny_package(work: Path) -> Path:
    """The fp32 CPU package of the tiny random checkpoint the tests use (built once into `work`)."""
    from builder_plugin.build import build
    from builder_plugin.options import BuildOptions
    from builder_plugin.testing.make_checkpoint import make_checkpoint

    package = work / "tiny-package"
    if not (package / "genai_config.json").is_file():
        checkpoint = make_checkpoint(work / "tiny-checkpoint", preset="tiny", seed=0)
        build(BuildOptions(model_dir=checkpoint, output_dir=package, precision="fp32", execution_provider="cpu",
                           max_length=4096, overwrite=True), progress=False)
    return package


def percentiles(seconds: list[float]) -> dict[str, float]:
    values = np.asarray(seconds)
    return {"p50": float(np.percentile(values, 50)), "p90": float(np.percentile(values, 90)),
            "p99": float(np.percentile(values, 99)), "mean": float(values.mean()), "n": len(seconds)}


# ---- Chat directly ------------------------------------------------------------------------------------------------


def measure_chat(package: Path, args: argparse.Namespace) -> dict[str, Any]:
    from builder_plugin.runtime import Chat

    chat = Chat(package, max_length=args.max_length)
    chat.load(chat.variant_for(has_image=False, has_audio=False))

    def one(i: int) -> tuple[float, float]:
        chat.clear()
        start = time.perf_counter()
        pieces = chat.ask(prompt(i), max_new_tokens=args.max_tokens)
        first = None
        for piece in pieces:
            if first is None and piece:
                first = time.perf_counter()
        end = time.perf_counter()
        return (first or end) - start, end - start

    one(-1)  # warm-up
    ttft = [one(i)[0] for i in range(args.ttft_runs)]
    latency = [one(1000 + i)[1] for i in range(args.requests)]
    return {"ttft_s": percentiles(ttft), "latency_s": percentiles(latency), "requests_per_s": 1 / np.mean(latency)}


# ---- through the server -------------------------------------------------------------------------------------------


def measure_server(package: Path, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    command = [sys.executable, "-m", "builder_plugin.serve", str(package), "--port", "0",
               "--max-queue", str(max(args.concurrency, 1))]
    if args.max_length:
        command += ["--max-length", str(args.max_length)]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        if not line.startswith("serving "):
            raise RuntimeError(f"the server did not start: {line!r}")
        url = line.split(" at ")[1].strip()
        model = line.split()[1]

        def client() -> openai.OpenAI:
            return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

        def first_token(c: openai.OpenAI, i: int) -> float:
            start = time.perf_counter()
            stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt(i)}],
                                               max_tokens=args.max_tokens, stream=True)
            first = None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
            return (first or time.perf_counter()) - start

        caller = client()
        first_token(caller, -1)  # warm-up
        ttft = [first_token(caller, i) for i in range(args.ttft_runs)]

        latency: list[float] = []
        lock = threading.Lock()
        counter = iter(range(args.requests))

        def run_client() -> None:
            c = client()
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                start = time.perf_counter()
                c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt(1000 + i)}],
                                          max_tokens=args.max_tokens)
                with lock:
                    latency.append(time.perf_counter() - start)

        threads = [threading.Thread(target=run_client) for _ in range(args.concurrency)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {"ttft_s": percentiles(ttft), "latency_s": percentiles(latency), "requests_per_s": len(latency) / wall}


# ---- report -------------------------------------------------------------------------------------------------------


def section(results: dict[str, Any]) -> str:
    rows = []
    for label, run in results["runs"].items():
        chat, served = run["chat"], run["server"]
        rows.append([label, run["concurrency"], run["max_tokens"],
                     fmt(chat["requests_per_s"]), fmt(served["requests_per_s"]),
                     f"{fmt(served['latency_s']['p50'], 3)} / {fmt(served['latency_s']['p90'], 3)} / "
                     f"{fmt(served['latency_s']['p99'], 3)}",
                     fmt(chat["ttft_s"]["p50"] * 1000, 1), fmt(served["ttft_s"]["p50"] * 1000, 1),
                     fmt((served["ttft_s"]["p50"] - chat["ttft_s"]["p50"]) * 1000, 1)])
    table = markdown_table(["package", "clients", "new tokens", "Chat req/s", "server req/s",
                            "server latency s p50 / p90 / p99", "Chat TTFT ms p50", "server TTFT ms p50",
                            "overhead ms"], rows)
    commands = "\n".join(f"- {label}: `{run['command']}`" for label, run in results["runs"].items())
    return (f"Commands:\n\n{commands}\n\n"
            "Short text requests, each a fresh one-question conversation, greedy. `Chat` = the run-time helper called "
            "directly in one process (one request after the other: its requests/s is 1 / mean latency); server = "
            "`python -m builder_plugin.serve` in its own process, called over HTTP on 127.0.0.1 by `clients` "
            "threads with the openai client (requests are answered one at a time, the others wait in the queue). "
            "TTFT = request sent to the first non-empty content chunk (server, streamed) or first non-empty piece "
            "(Chat), one client; overhead = server TTFT - Chat TTFT (HTTP, JSON, the queue and the worker thread). "
            "Latency percentiles include the time spent waiting in the queue.\n\n" + table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", nargs="?", help="package folder (default: the tiny package, built into --work)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_serve"), help="where the tiny package goes")
    parser.add_argument("--label", help="name of this run in the results (default: tiny / the package folder)")
    parser.add_argument("--requests", type=int, default=40, help="requests of the throughput run")
    parser.add_argument("--concurrency", type=int, default=4, help="clients sending them at once")
    parser.add_argument("--max-tokens", type=int, default=8, help="new tokens per request")
    parser.add_argument("--ttft-runs", type=int, default=10, help="time-to-first-token requests (one client)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="KV cache length for Chat and the server (default: the package's; 16384 costs 4 GiB "
                             "per generator on the full-size model)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--doc", default=str(DOC), help="Markdown file to update ('' = none)")
    args = parser.parse_args(argv)

    package = Path(args.package) if args.package else tiny_package(args.work)
    label = args.label or ("tiny" if not args.package else package.name)
    command = "python benchmarks/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:])
    run = {"package": str(package), "command": command.strip(), "requests": args.requests,
           "concurrency": args.concurrency, "max_tokens": args.max_tokens,
           "chat": measure_chat(package, args)}
    gc.collect()  # the Chat's models are freed before the server loads its own
    run["server"] = measure_server(package, args)
    run["ttft_overhead_ms"] = (run["server"]["ttft_s"]["p50"] - run["chat"]["ttft_s"]["p50"]) * 1000
    run["machine"] = machine_info()

    results = {"runs": {}}
    if args.out.is_file():
        results = json.loads(args.out.read_text(encoding="utf-8"))
    results["runs"][label] = run
    write_json(args.out, results)
    if args.doc:
        replace_markdown_section(args.doc, "## Serving", section(results), before="## Build")
    print(section(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
