"""Several users on one server (`python -m builder_plugin.serve`, its defaults unless stated): answers taking turns and
kept conversations.

    python -m benchmarks.bench_serve_users                                   # the tiny generated package
    python -m benchmarks.bench_serve_users /work/bench/pkg-int4-plain --label full-int4-plain --max-length 4096

- interleave: the time to first token (TTFT) of a short text request on an idle server, against the same while one
  `--long-tokens` answer streams (the short requests sent one after the other while it runs); decode tokens/s of one
  stream alone against two at once (total of both).
- turns: `--users` users, each with a one-image conversation, asking in turns (user 1, 2, ..., then user 1 again):
  the first token of each text follow-up on the default server (conversations kept) against the same script on a
  server with `--max-conversations 1`, where every turn of another user releases the kept conversation, so each
  follow-up prefills its whole conversation again (image included). The server's peak RSS (VmHWM) is reported with
  the KV budget it printed.

Greedy, every request over HTTP with the openai client from this process. Results go to
`benchmarks/results/serve_users.json` by `--label`; the "## Serving several users" section of docs/benchmarks.md is
rewritten from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_serve import tiny_package
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
from builder_plugin.memory import proc_kib_field

HEADING = "## Serving several users"


@contextlib.contextmanager
def served(package: Path, args: argparse.Namespace, *extra: str) -> Iterator[tuple[Any, str, int, list[str]]]:
    """A server process on a free port: (openai client, model id, pid, the lines it printed at start)."""
    import openai

    command = [sys.executable, "-m", "builder_plugin.serve", str(package), "--port", "0", *extra]
    if args.max_length:
        command += ["--max-length", str(args.max_length)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = [process.stdout.readline() for _ in range(3)]
        if not lines[0].startswith("serving "):
            raise RuntimeError(f"the server did not start: {lines!r}")
        client = openai.OpenAI(base_url=lines[0].split(" at ")[1].strip(), api_key="unused", max_retries=0,
                               timeout=1200)
        yield client, lines[0].split()[1], process.pid, [line.strip() for line in lines[1:]]
    finally:
        process.terminate()
        process.wait(timeout=120)


def stream(client: Any, model: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed answer: TTFT, total time, the text and the tokens it counted."""
    start = time.perf_counter()
    first, pieces, tokens = None, [], 0
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"ttft_s": (first or end) - start, "total_s": end - start, "text": "".join(pieces), "tokens": tokens,
            "decode_tok_s": (tokens - 1) / (end - first) if first and tokens > 1 and end > first else 0.0}


def peak_rss(pid: int) -> int:
    return proc_kib_field(f"/proc/{pid}/status", "VmHWM") or 0


def short_question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: name a colour."}]


# ---- interleave ---------------------------------------------------------------------------------------------------


def measure_interleave(package: Path, args: argparse.Namespace) -> dict[str, Any]:
    with served(package, args) as (client, model, _, _):
        stream(client, model, short_question(-1), args.short_tokens)  # warm-up
        idle = [stream(client, model, short_question(i), args.short_tokens)["ttft_s"] for i in range(args.runs)]

        # The long answer's client is a process of its own, as another user's would be (its chunks parsed in this
        # process would take turns with the short requests' client for the interpreter).
        script = ("import sys, openai; c = openai.OpenAI(base_url=sys.argv[1], api_key='unused', max_retries=0, "
                  "timeout=1200); s = c.chat.completions.create(model=sys.argv[2], max_tokens=int(sys.argv[3]), "
                  "stream=True, messages=[{'role': 'user', 'content': 'Tell me a very long story about the sea.'}])\n"
                  "for k in s:\n    if k.choices and k.choices[0].delta.content: print('streaming', flush=True)")
        started = time.perf_counter()
        long = subprocess.Popen([sys.executable, "-c", script, str(client.base_url), model, str(args.long_tokens)],
                                stdout=subprocess.PIPE, text=True)
        long.stdout.readline()  # the first piece
        threading.Thread(target=long.stdout.read, daemon=True).start()
        busy = []
        for i in range(args.runs):
            if long.poll() is not None:
                break
            busy.append(stream(client, model, short_question(100 + i), args.short_tokens)["ttft_s"])
        long.wait()
        long_total = time.perf_counter() - started

        one = stream(client, model, [{"role": "user", "content": "Tell me about rivers."}], args.throughput_tokens)
        both: list[dict[str, Any]] = [{}, {}]

        def run(k: int) -> None:
            both[k] = stream(client, model, [{"role": "user", "content": f"Tell me about rivers, {k}."}],
                             args.throughput_tokens)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    return {"idle_ttft_s": idle, "busy_ttft_s": busy, "long_total_s": long_total,
            "one_stream_tok_s": one["tokens"] / one["total_s"],
            "two_streams_tok_s": sum(b["tokens"] for b in both) / wall,
            "one_stream_tokens": one["tokens"], "two_streams_tokens": [b["tokens"] for b in both]}


# ---- turns --------------------------------------------------------------------------------------------------------


def run_turns(package: Path, args: argparse.Namespace, images: list[Path], *extra: str) -> dict[str, Any]:
    import base64

    def image_part(path: Path) -> dict:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}

    follow_ups = ["Tell me more about it.", "What colours do you see?", "Summarise it in one line."]
    with served(package, args, *extra) as (client, model, pid, printed):
        conversations = [[{"role": "user", "content": [image_part(image), {"type": "text",
                                                                          "text": "What is in this picture?"}]}]
                         for image in images]
        first, later, texts = [], [], []
        for turn in range(1 + args.follow_ups):
            for messages in conversations:
                if turn:
                    messages.append({"role": "user", "content": follow_ups[(turn - 1) % len(follow_ups)]})
                answer = stream(client, model, messages, args.short_tokens)
                (later if turn else first).append(answer["ttft_s"])
                texts.append(answer["text"])
                messages.append({"role": "assistant", "content": answer["text"]})
        rss = peak_rss(pid)
    return {"first_ttft_s": first, "follow_up_ttft_s": later, "peak_rss_bytes": rss, "server_said": printed,
            "answers": texts}


def measure_turns(package: Path, args: argparse.Namespace) -> dict[str, Any]:
    from builder_plugin.testing.media import make_image

    media = args.work / "media"
    media.mkdir(parents=True, exist_ok=True)
    images = [make_image(media / f"user{user}.png", args.image_size, args.image_size, seed=10 + user)
              for user in range(args.users)]  # a different picture per user
    kept = run_turns(package, args, images)
    again = run_turns(package, args, images, "--max-conversations", "1")
    return {"kept": kept, "re_prefilled": again, "same_answers": kept["answers"] == again["answers"]}


# ---- report -------------------------------------------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def section(results: dict[str, Any]) -> str:
    rows_i, rows_t = [], []
    for label, run in results.items():
        i, t = run.get("interleave"), run.get("turns")
        if i:
            idle, busy = median(i["idle_ttft_s"]), median(i["busy_ttft_s"])
            rows_i.append([label, run["long_tokens"], fmt(idle * 1000, 0), fmt(busy * 1000 if busy else None, 0),
                           fmt(busy / idle if busy else None), fmt(i["one_stream_tok_s"]), fmt(i["two_streams_tok_s"]),
                           fmt(i["two_streams_tok_s"] / i["one_stream_tok_s"]), run["machine"]["load_average"][0]])
        if t:
            kept, again = median(t["kept"]["follow_up_ttft_s"]), median(t["re_prefilled"]["follow_up_ttft_s"])
            rows_t.append([label, run["users"], run["image_size"], fmt(median(t["kept"]["first_ttft_s"]), 2),
                           fmt(kept, 3), fmt(again, 2), f"{kept / again * 100:.1f} %",
                           fmt(t["kept"]["peak_rss_bytes"] / 2**30), fmt(t["re_prefilled"]["peak_rss_bytes"] / 2**30),
                           t["kept"]["server_said"][1].split(" under ")[-1], "yes" if t["same_answers"] else "NO",
                           run["machine"]["load_average"][0]])
    commands = "\n".join(f"- {label}: `{run['command']}`" for label, run in results.items())
    return (f"Commands:\n\n{commands}\n\n"
            "Answers taking turns: TTFT of a short text request (streamed, to the first content) on an idle server, "
            "and while one long answer streams to a client in another process (medians); decode throughput of one "
            "stream alone and of two at once "
            "(tokens of both / wall time).\n\n"
            + markdown_table(["package", "long answer tokens", "idle TTFT ms", "TTFT beside a stream ms", "ratio",
                              "1 stream tok/s", "2 streams tok/s", "ratio", "load average"], rows_i)
            + "\n\nKept conversations: users with a one-image conversation each, asking in turns; median first token "
            "of the text follow-ups with the default pool against a server keeping one conversation "
            "(`--max-conversations 1`: each follow-up prefills its conversation again). Peak RSS = the server "
            "process's VmHWM.\n\n"
            + markdown_table(["package", "users", "image px", "first question TTFT s", "follow-up TTFT s (kept)",
                              "follow-up TTFT s (re-prefilled)", "kept / re-prefilled", "peak RSS GB (kept)",
                              "peak RSS GB (one kept)", "KV budget", "same answers", "load average"], rows_t))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", nargs="?", help="package folder (default: the tiny package, built into --work)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_serve"), help="where the tiny package goes")
    parser.add_argument("--label", help="name of this run (default: tiny / the package folder)")
    parser.add_argument("--only", choices=("interleave", "turns"), help="one scenario only")
    parser.add_argument("--runs", type=int, default=5, help="short requests idle and beside the long answer")
    parser.add_argument("--short-tokens", type=int, default=8, help="new tokens of a short request")
    parser.add_argument("--long-tokens", type=int, default=512, help="new tokens of the long answer")
    parser.add_argument("--throughput-tokens", type=int, default=128, help="new tokens per stream, throughput run")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--follow-ups", type=int, default=2, help="text follow-ups per user")
    parser.add_argument("--image-size", type=int, default=448, help="side of each user's square picture")
    parser.add_argument("--max-length", type=int, default=None, help="the servers' --max-length")
    add_report_options(parser, "serve_users.json", note=False, replay=False)
    args = parser.parse_args(argv)

    package = Path(args.package) if args.package else tiny_package(args.work)
    label = args.label or ("tiny" if not args.package else package.name)
    results = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    run: dict[str, Any] = {"package": str(package), "long_tokens": args.long_tokens, "users": args.users,
                           "image_size": args.image_size,
                           "command": ("python -m benchmarks.bench_serve_users "
                                       + " ".join(argv if argv is not None else sys.argv[1:])).strip()}
    if args.only != "turns":
        run["interleave"] = measure_interleave(package, args)
    if args.only != "interleave":
        run["turns"] = measure_turns(package, args)
    run["machine"], run["code"] = machine_info(), git_state()
    results[label] = {**results.get(label, {}), **run}
    write_json(args.out, results)
    if args.doc:
        replace_markdown_section(args.doc, HEADING, section(results), before="## Build")
    print(section(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
