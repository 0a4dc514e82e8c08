"""Serving overhead: short text requests through `python -m builder_plugin.serve` (requests/s, latency percentiles
with several clients at once) and time to first token through the server against `Chat` directly on the same
package.

    python -m benchmarks.bench_serve                          # the tiny generated package (built into --work)
    python -m benchmarks.bench_serve /work/bench/pkg-int4 --requests 8 --concurrency 2 --ttft-runs 3 --max-length 2048
    python -m benchmarks.bench_serve /work/bench/pkg-int4-plain --guidance --max-tokens 64 --max-length 2048

The server runs in its own process, Chat and the clients (threads, with the openai client) in this one; both have
the package loaded at once, and the time-to-first-token requests alternate between them. Every request is a fresh
one-question conversation with its own text, greedy, `--max-tokens` new tokens. Results are merged by `--label`
into `benchmarks/results/serve.json` and the "## Serving" section of docs/benchmarks.md is rewritten from it.

`--guidance` measures the cost of constrained answers instead: decode tokens/s of `Chat` (the runtime's og.Generator,
as the server's worker runs it) free and with JSON schemas, the same question, `--max-tokens` new tokens each, the
runs of each kind taking turns. Random weights make the guided answers noise that fits the schema: the schemas keep
the answer going (an unbounded string, or a long array of small objects) so every run makes all its tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    ROOT,
    add_report_options,
    fmt,
    git_state,
    machine_info,
    markdown_table,
    replace_markdown_section,
    write_json,
)


def prompt(i: int) -> str:
    return f"Request {i}: name three colours and say why you like them."


def tiny_package(work: Path) -> Path:
    """The fp32 CPU package of the tiny random checkpoint the tests use (built once into `work`)."""
    from builder_plugin.build import build
    from builder_plugin.layout import GENAI_CONFIG_FILE
    from builder_plugin.options import BuildOptions
    from builder_plugin.testing.make_checkpoint import make_checkpoint

    package = work / "tiny-package"
    if not (package / GENAI_CONFIG_FILE).is_file():
        checkpoint = make_checkpoint(work / "tiny-checkpoint", preset="tiny", seed=0)
        build(BuildOptions(model_dir=checkpoint, output_dir=package, precision="fp32", execution_provider="cpu",
                           max_length=4096, overwrite=True), progress=False)
    return package


def percentiles(seconds: list[float]) -> dict[str, float]:
    values = np.asarray(seconds)
    return {"p50": float(np.percentile(values, 50)), "p90": float(np.percentile(values, 90)),
            "p99": float(np.percentile(values, 99)), "mean": float(values.mean()), "n": len(seconds)}


# ---- one request, either way --------------------------------------------------------------------------------------


def ask_chat(chat: Any, i: int, max_tokens: int) -> tuple[float, float]:
    """(time to the first non-empty piece, total time) of a fresh one-question conversation with `chat`."""
    chat.clear()
    start = time.perf_counter()
    first = None
    for piece in chat.ask(prompt(i), max_new_tokens=max_tokens):
        if first is None and piece:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start


def ask_server(client: Any, model: str, i: int, max_tokens: int, stream: bool) -> tuple[float, float]:
    """The same through the server: (time to the first non-empty content chunk, total time)."""
    start = time.perf_counter()
    messages = [{"role": "user", "content": prompt(i)}]
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=stream)
    first = None
    for chunk in response if stream else ():
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start


@contextlib.contextmanager
def served(package: Path, args: argparse.Namespace) -> Iterator[tuple[str, str, int]]:
    """`python -m builder_plugin.serve` on a free port: (base URL, model id, process id); stopped on exit."""
    command = [sys.executable, "-m", "builder_plugin.serve", str(package), "--port", "0",
               "--max-queue", str(max(args.concurrency, 1))]
    if args.max_length:
        command += ["--max-length", str(args.max_length)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        if not line.startswith("serving "):
            raise RuntimeError(f"the server did not start: {line!r}")
        yield line.split(" at ")[1].strip(), line.split()[1], server.pid
    finally:
        server.terminate()
        server.wait(timeout=60)


def faults_and_system_s(pid: int) -> tuple[int, float]:
    """A process's minor page faults and system CPU seconds so far (Linux /proc; 0, 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
    except OSError:
        return 0, 0.0
    return int(fields[7]), int(fields[12]) / os.sysconf("SC_CLK_TCK")


# ---- measurements -------------------------------------------------------------------------------------------------


def measure(package: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Both loaded at once; the time-to-first-token requests alternate between Chat and the server, so background
    load hits both alike, first while the server's pool still has empty conversations (each new one allocates its
    KV cache: fresh pages), then once it is full (a new conversation reuses the pages of the one it releases, as a
    Chat asking one question after another does); then the throughput runs, Chat's (one after the other) and the
    server's (concurrent)."""
    import openai

    from builder_plugin.runtime import Chat
    from builder_plugin.serve.defaults import MAX_CONVERSATIONS

    def client(url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    with served(package, args) as (url, model, pid):
        chat = Chat(package, max_length=args.max_length, threads=args.threads)
        chat.load(chat.variant_for(has_image=False, has_audio=False))
        caller = client(url)
        ask_chat(chat, -1, args.max_tokens)  # warm-up, both (the server's takes one of its empty conversations)
        ask_server(caller, model, -1, args.max_tokens, stream=True)
        ttft: dict[str, list[float]] = {"chat": [], "server": [], "server_filling": []}
        paging: dict[str, list[tuple[int, float]]] = {"server": [], "server_filling": []}
        filling = MAX_CONVERSATIONS - 1
        for i in range(filling + args.ttft_runs):
            kind = "server_filling" if i < filling else "server"
            seconds = ask_chat(chat, i, args.max_tokens)[0]
            if kind == "server":
                ttft["chat"].append(seconds)
            before = faults_and_system_s(pid)
            ttft[kind].append(ask_server(caller, model, i, args.max_tokens, stream=True)[0])
            after = faults_and_system_s(pid)
            paging[kind].append((after[0] - before[0], after[1] - before[1]))

        latency = [ask_chat(chat, 1000 + i, args.max_tokens)[1] for i in range(args.requests)]
        direct = {"ttft_s": percentiles(ttft["chat"]), "latency_s": percentiles(latency),
                  "requests_per_s": 1 / float(np.mean(latency))}
        del chat

        served_latency: list[float] = []
        lock = threading.Lock()
        numbers = iter(range(args.requests))

        def run_client() -> None:
            c = client(url)
            while True:
                with lock:
                    i = next(numbers, None)
                if i is None:
                    return
                seconds = ask_server(c, model, 1000 + i, args.max_tokens, stream=False)[1]
                with lock:
                    served_latency.append(seconds)

        threads = [threading.Thread(target=run_client) for _ in range(args.concurrency)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
    server = {"ttft_s": percentiles(ttft["server"]), "ttft_filling_s": percentiles(ttft["server_filling"]),
              "latency_s": percentiles(served_latency), "requests_per_s": len(served_latency) / wall,
              "page_faults_per_request": {k: float(np.median([f for f, _ in v])) for k, v in paging.items()},
              "system_s_per_request": {k: float(np.median([t for _, t in v])) for k, v in paging.items()}}
    return {"chat": direct, "server": server}


# ---- the cost of guidance ------------------------------------------------------------------------------------------

# Schemas that keep a random model going: one long string; many small objects (keys, enums, numbers: the grammar
# changes state every few tokens).
SCHEMAS = {
    "json-string": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                    "additionalProperties": False},
    "json-objects": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"kind": {"enum": ["circle", "square", "triangle"]},
                                         "size": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "tag": {"type": "string", "maxLength": 6}},
        "required": ["kind", "size", "tag"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False},
}


def measure_guidance(package: Path, args: argparse.Namespace) -> dict[str, Any]:
    from builder_plugin.runtime import Chat, Guidance

    chat = Chat(package, max_length=args.max_length)
    kinds = {"free": None, **{name: Guidance.json_schema(schema) for name, schema in SCHEMAS.items()}}
    speeds: dict[str, list[float]] = {kind: [] for kind in kinds}
    tokens: dict[str, list[int]] = {kind: [] for kind in kinds}
    question = "Describe three shapes as JSON."
    for guidance in kinds.values():  # warm-up (and the grammar compiled once)
        chat.clear()
        "".join(chat.ask(question, max_new_tokens=4, guidance=guidance))
    for _ in range(args.guidance_runs):
        for kind, guidance in kinds.items():
            chat.clear()
            "".join(chat.ask(question, max_new_tokens=args.max_tokens, guidance=guidance))
            speeds[kind].append(chat.last_stats.tokens_per_s)
            tokens[kind].append(chat.last_stats.new_tokens)
    free = float(np.median(speeds["free"]))
    out = {}
    for kind in kinds:
        median = float(np.median(speeds[kind]))
        out[kind] = {"tokens_per_s": speeds[kind], "median_tokens_per_s": median, "new_tokens": tokens[kind],
                     "ms_per_token_over_free": (1000 / median - 1000 / free) if median > 0 and free > 0 else None}
    return out


def _threads(run: dict[str, Any]) -> str:
    """The intra-op threads per session a run had; runs recorded before the count was stored had onnxruntime-genai's
    own, min(16, CPUs / 2): 1 on the 2-CPU machines of this document."""
    return str(run["threads"]) if "threads" in run else "1 (genai's own)"


def guidance_section(results: dict[str, Any]) -> str:
    rows = []
    for label, run in results.get("guidance", {}).items():
        for kind, measured in run["kinds"].items():
            rows.append([label, _threads(run), kind, run["max_tokens"], min(measured["new_tokens"]),
                         fmt(measured["median_tokens_per_s"]),
                         fmt(measured["ms_per_token_over_free"], 1) if kind != "free" else "",
                         run["machine"]["load_average"][0]])
    if not rows:
        return ""
    commands = "\n".join(f"- {label}: `{run['command']}`" for label, run in results["guidance"].items())
    table = markdown_table(["package", "threads", "answer", "max tokens", "min new tokens", "decode tok/s median",
                            "ms/token over free", "load average"], rows)
    return ("\n\n### Cost of guidance per token\n\nCommands:\n\n" + commands + "\n\n"
            "Decode tokens/s after the first token of `Chat.ask` (og.Generator, as the server's worker runs it), the "
            "same question free and with a JSON schema (response_format json_schema goes through exactly this): "
            "json-string = one unbounded string field, json-objects = an array of small objects with an enum, a "
            "bounded integer and a short string. The runs of each kind take turns; medians of the runs. The "
            "difference is the runtime's per-token mask computation (llguidance) and its bookkeeping. On a shared "
            "machine the runs of one kind spread by up to ~10% (every run is in results/serve.json): a difference "
            "smaller than that is within the noise.\n\n" + table)


# ---- report -------------------------------------------------------------------------------------------------------


def _filling(served: dict[str, Any]) -> str:
    """The server's TTFT while its pool fills, with the page faults and system time of such a request; blank for runs
    recorded before the two were told apart (their TTFT runs all fell while the pool filled)."""
    if "ttft_filling_s" not in served:
        return ""
    faults = served["page_faults_per_request"]["server_filling"]
    return (f"{fmt(served['ttft_filling_s']['p50'] * 1000, 1)} ({faults / 1000:.0f}k, "
            f"{fmt(served['system_s_per_request']['server_filling'])})")


def section(results: dict[str, Any]) -> str:
    rows = []
    for label, run in results["runs"].items():
        chat, served = run["chat"], run["server"]
        rows.append([label, _threads(run), run["concurrency"], run["max_tokens"],
                     fmt(chat["requests_per_s"]), fmt(served["requests_per_s"]),
                     f"{fmt(served['latency_s']['p50'], 3)} / {fmt(served['latency_s']['p90'], 3)} / "
                     f"{fmt(served['latency_s']['p99'], 3)}",
                     fmt(chat["ttft_s"]["p50"] * 1000, 1), _filling(served), fmt(served["ttft_s"]["p50"] * 1000, 1),
                     fmt((served["ttft_s"]["p50"] - chat["ttft_s"]["p50"]) * 1000, 1),
                     run["machine"]["load_average"][0]])
    table = markdown_table(["package", "threads", "clients", "new tokens", "Chat req/s", "server req/s",
                            "server latency s p50 / p90 / p99", "Chat TTFT ms p50",
                            "server TTFT ms p50, pool filling (page faults, system s)", "server TTFT ms p50, pool full",
                            "overhead ms", "load average"], rows)
    commands = "\n".join(f"- {label}: `{run['command']}`" for label, run in results["runs"].items())
    return (f"Commands:\n\n{commands}\n\n"
            "Short text requests, each a fresh one-question conversation, greedy. `Chat` = the run-time helper called "
            "directly in one process (one request after the other: its requests/s is 1 / mean latency); server = "
            "`python -m builder_plugin.serve` in its own process, called over HTTP on 127.0.0.1 by `clients` "
            "threads with the openai client; the server interleaves up to --max-conversations answers (\"Serving "
            "several users\"; a row whose threads say \"genai's own\" was measured when it answered one request at a "
            "time, with onnxruntime-genai's own thread count). Threads = intra-op threads of every session, Chat's "
            "and the server's default unless the command sets --threads. "
            "TTFT = request sent to the first non-empty content chunk (server, streamed) or first non-empty piece "
            "(Chat), one client, the Chat and server requests in turn (both packages loaded at once, so background "
            "load hits them alike). A fresh server first fills its pool: each new conversation takes an empty one "
            "and allocates its generator's KV cache, which the runtime touches whole (prompt + new tokens + 1024 "
            "positions of follow-up room: 275 MB, about 70k pages, at full size with 8 new tokens), so its first "
            "token waits for the kernel to fault those pages in. Once every conversation is held, a new one releases "
            "the least recently used and its cache reuses those pages, as `Chat` asking one question after another "
            "does. \"Pool filling\" = the server's requests after its warm-up until every conversation is held (7 "
            "with the default --max-conversations 8), with the median page faults and system CPU time of the "
            "server process per request; \"pool full\" = "
            "the --ttft-runs after them; overhead = pool-full TTFT - Chat TTFT (HTTP, JSON, the queue and the "
            "worker thread). Rows without a pool-filling figure were measured before the two were told apart: all "
            "their server requests fell while the pool filled. "
            "Latency percentiles include the time spent waiting in the queue. Load average = the machine's 1-minute "
            "load at the end of the run (2 cores, shared with other jobs when above ~1.5).\n\n" + table
            + guidance_section(results))


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
    parser.add_argument("--guidance", action="store_true",
                        help="measure decode tokens/s free and with JSON schemas instead of the serving overhead")
    parser.add_argument("--guidance-runs", type=int, default=3, help="runs of each kind with --guidance")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of every session, for the server and Chat alike (default: theirs, "
                        "one per physical core the process may use)")
    add_report_options(parser, "serve.json", note=False, replay=False)
    args = parser.parse_args(argv)

    package = Path(args.package) if args.package else tiny_package(args.work)
    label = args.label or ("tiny" if not args.package else package.name)
    command = "python -m benchmarks.bench_serve " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {"runs": {}}
    if args.out.is_file():
        results = json.loads(args.out.read_text(encoding="utf-8"))
    from builder_plugin.runtime.threads import default_threads

    threads = args.threads or default_threads()  # what Chat and the server ran with
    if args.guidance:
        results.setdefault("guidance", {})[label] = {
            "package": str(package), "command": command.strip(), "max_tokens": args.max_tokens, "threads": threads,
            "kinds": measure_guidance(package, args), "machine": machine_info(), "code": git_state()}
        write_json(args.out, results)
        if args.doc:
            replace_markdown_section(args.doc, "## Serving", section(results), before="## Build")
        print(guidance_section(results))
        return 0
    run = {"package": str(package), "command": command.strip(), "requests": args.requests,
           "concurrency": args.concurrency, "max_tokens": args.max_tokens, "threads": threads,
           **measure(package, args)}
    run["ttft_overhead_ms"] = (run["server"]["ttft_s"]["p50"] - run["chat"]["ttft_s"]["p50"]) * 1000
    run["machine"] = machine_info()
    results["runs"][label] = run
    write_json(args.out, results)
    if args.doc:
        replace_markdown_section(args.doc, "## Serving", section(results), before="## Build")
    print(section(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
