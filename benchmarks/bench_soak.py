"""Soak test of `python -m builder_plugin.serve`: many mixed requests from several clients at once, every answer
checked against `Chat`, and the server's memory, threads, temporary folder and exit status checked at the end.

    python -m benchmarks.bench_soak                                   # 500 requests on the tiny generated package
    python -m benchmarks.bench_soak --requests 2000 --concurrency 8 --server-arg=--max-queue --server-arg=16
    python -m benchmarks.bench_soak /work/bench/pkg-int4 --requests 100 --label full-int4 --server-arg=--max-length \
        --server-arg=4096

The run is tests.support.soak.run_soak (its module says what is sent and checked). The summary is printed,
the run merged by `--label` into benchmarks/results/soak.json, and the "## Soak" section of docs/benchmarks.md
rewritten from it. The exit status is 1 when a check failed (the failures are printed and recorded).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_serve import tiny_package
from benchmarks.common import (
    add_report_options,
    command_line,
    fmt,
    git_state,
    machine_info,
    markdown_table,
    replace_markdown_section,
    write_json,
)

MiB = 1 << 20


def latency_summary(seconds: list[float]) -> dict[str, float]:
    values = np.asarray(seconds)
    return {"n": len(seconds), "p50": float(np.percentile(values, 50)), "p90": float(np.percentile(values, 90)),
            "max": float(values.max())}


def run_record(report: Any, args: argparse.Namespace, package: Path, command: str) -> dict[str, Any]:
    record = asdict(report)
    record.pop("latency_s")
    return {"package": str(package), "command": command, "seed": args.seed, "server_args": args.server_arg,
            **record, "requests_per_s": report.completed / report.duration_s if report.duration_s else None,
            "rss_growth": report.rss_growth,
            "latency_s": {kind: latency_summary(v) for kind, v in sorted(report.latency_s.items())},
            "failures": report.failures(), "machine": machine_info(), "code": git_state()}


def summary(run: dict[str, Any]) -> str:
    rss = run["rss_samples"]
    lines = [f"{run['completed']} of {run['requests']} requests from {run['concurrency']} clients in "
             f"{run['duration_s']:.1f} s ({fmt(run['requests_per_s'])} requests/s), max_tokens {run['max_tokens']}, "
             f"{run['streamed']} streamed",
             "sent: " + ", ".join(f"{kind} {n}" for kind, n in run["counts"].items()),
             f"answers checked against Chat: {run['checked_answers']}, differing: {len(run['mismatches'])}",
             f"unexpected errors: {len(run['errors'])}",
             "server RSS MiB (after N requests): " + ", ".join(f"{n}: {b / MiB:.1f}" for n, b in rss)
             + (f"; growth {run['rss_growth']:+.1%}" if run["rss_growth"] is not None else ""),
             "server threads (after N requests): " + ", ".join(f"{n}: {t}" for n, t in run["thread_samples"]),
             f"exit status on SIGTERM: {run['exit_code']}; files left in its temporary folder: "
             f"{len(run['leftover_files'])}",
             "latency s p50 / p90 / max: " + "; ".join(
                 f"{kind} {fmt(s['p50'])} / {fmt(s['p90'])} / {fmt(s['max'])}" for kind, s in run["latency_s"].items())]
    lines += [f"  error: {e}" for e in run["errors"][:10]] + [f"  mismatch: {m}" for m in run["mismatches"][:10]]
    lines += [f"FAILED: {f}" for f in run["failures"]] or ["all checks hold"]
    return "\n".join(lines)


def section(results: dict[str, Any]) -> str:
    rows = []
    for label, run in results["runs"].items():
        rss = run["rss_samples"]
        threads = run["thread_samples"]
        rows.append([label, run["completed"], run["concurrency"], run["max_tokens"], fmt(run["requests_per_s"]),
                     f"{run['checked_answers']} / {len(run['mismatches'])}", len(run["errors"]),
                     f"{rss[0][1] / MiB:.0f} -> {rss[-1][1] / MiB:.0f} ({run['rss_growth']:+.1%})" if len(rss) > 1
                     else "-", f"{threads[0][1]} -> {threads[-1][1]}" if len(threads) > 1 else "-",
                     run["exit_code"], len(run["leftover_files"]),
                     "; ".join(run["failures"])[:300] or "none", run["machine"]["load_average"][0]])
    table = markdown_table(["run", "requests", "clients", "max tokens", "req/s", "answers checked / differing",
                            "errors", "server RSS MiB", "threads", "exit", "files left", "failed checks",
                            "load average"], rows)
    commands = "\n".join(f"- {label}: `{run['command']}` at {run['code']['commit'][:7]}"
                         for label, run in results["runs"].items())
    return ("Commands:\n\n" + commands + "\n\n"
            "`python -m builder_plugin.serve` in its own process, called over HTTP by `clients` threads with the "
            "openai client: text, photograph and audio questions, streamed or not, streams closed after a chunk or "
            "two, bad requests (each must get its 4xx and OpenAI's error object), and conversations that grow by one "
            "question per request, regenerate their last answer or edit their last question, their requests "
            "interleaved between the clients (tests/support/soak.py). Every answer is compared with an "
            "independent `Chat` on the same package (greedy). The first requests, one per client sent at the same "
            "moment, are the longest prompt of the run. Server RSS and threads: after the first 50 requests and at "
            "the end, both with no request out and the server's worker-thread pool brought to its floor (10.5 s "
            "idle, then one plain question: anyio ends idle workers only when it dispatches a call); the check is "
            "growth <= 5 % and no more threads. Exit = the server's "
            "status on SIGTERM; files left = in its temporary folder (TMPDIR) after it stopped. The load average (2 "
            "cores) is the machine's at the end.\n\n" + table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", nargs="?", help="package folder (default: the tiny package, built into --work)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_soak"), help="where the tiny package goes")
    parser.add_argument("--label", help="name of this run in the results (default: tiny / the package folder)")
    parser.add_argument("--requests", type=int, default=500, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=4, help="clients sending them at once")
    parser.add_argument("--max-tokens", type=int, default=8, help="new tokens per answer")
    parser.add_argument("--seed", type=int, default=0, help="of the mix of requests")
    parser.add_argument("--warmup", type=int, default=50, help="requests before the first memory sample")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds after which no request is started")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="an argument for the server (repeat for several: --server-arg=--max-queue "
                        "--server-arg=8)")
    parser.add_argument("--logs", type=Path, default=None, help="folder to copy the server's stdout and stderr to")
    add_report_options(parser, "soak.json", note=False, replay=False)
    args = parser.parse_args(argv)

    from tests.support.soak import run_soak

    package = Path(args.package) if args.package else tiny_package(args.work)
    label = args.label or ("tiny" if not args.package else package.name)
    report = run_soak(package, requests=args.requests, concurrency=args.concurrency, seed=args.seed,
                      max_tokens=args.max_tokens, server_args=args.server_arg, timeout_s=args.timeout,
                      warmup=args.warmup, keep_logs=args.logs)
    run = run_record(report, args, package, command_line("bench_soak.py", argv))
    results = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {"runs": {}}
    results["runs"][label] = run
    write_json(args.out, results)
    if args.doc:
        replace_markdown_section(args.doc, "## Soak", section(results), before="## Build")
    print(summary(run))
    return 1 if run["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
