"""What checking hub downloads against their sha256 costs (builder_plugin.digests), at full size.

    python -m benchmarks.bench_hub_verify --checkpoint /work/bench/full [--work DIR] [--rounds 2]

A local hub (tests.support.hub_server.LocalHub, in a process of its own) serves the checkpoint over loopback.
Measured, on the checkpoint's weight files:

- ``hashlib``: one sha256 pass over the files, one thread, 16 MB reads, twice: the first as the page cache holds them
  (the share it holds is recorded: usually little, so the disk is read), the second right after (the cache then holds
  what fits); and sha256 of 1 GB in memory (the CPU alone).
- ``download``: every weight file into an empty cache through ``ModelSource.fetch()`` (each file hashed as it is
  written, then compared with the hub's sha256) against the same transfers through huggingface_hub's ``http_get``
  into plain files (nothing checked), in turn, ``--rounds`` times each. The cache is removed after each.
- ``cached``: ``ModelSource.fetch()`` of a second build, every weight already in the cache: the check reads each
  file once (on every core).

Results: benchmarks/results/hub_verify.json and the "Hub download checks" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCHMARKS_DOC,
    GB,
    RESULTS_DIR,
    command_line,
    fmt,
    machine_info,
    markdown_table,
    publish,
    summarize,
)

REPO_ID = "bench/full"
RESULTS = RESULTS_DIR / "hub_verify.json"
DOC = BENCHMARKS_DOC
HEADING = "## Hub download checks"


def serve(checkpoint: Path) -> None:
    """The hub process: publish the checkpoint, print the endpoint, serve until stdin closes."""
    from tests.support.hub_server import LocalHub

    with LocalHub() as hub:
        hub.add_commit(REPO_ID, checkpoint)
        print(hub.endpoint, flush=True)
        sys.stdin.read()


def weight_files(checkpoint: Path) -> list[str]:
    from builder_plugin.hub import weight_files as names

    return names(checkpoint, lambda p: (checkpoint / p).is_file())


def resident_share(paths: list[Path]) -> float | None:
    """The share of the files' bytes in the page cache (util-linux fincore), None without it."""
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *map(str, paths)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return None
    pairs = [tuple(map(int, line.split())) for line in done.stdout.splitlines() if line.strip()]
    return sum(r for r, _ in pairs) / max(sum(s for _, s in pairs), 1)


def hash_pass(paths: list[Path]) -> float:
    from builder_plugin.digests import SHA256, Digest

    start = time.perf_counter()
    for path in paths:
        Digest(SHA256, "").of_file(path)
    return time.perf_counter() - start


def hash_rate_in_memory(repeats: int = 3) -> float:
    """GB/s of hashlib's sha256 over 1 GB already in memory, best of `repeats`."""
    import hashlib

    data = os.urandom(1 << 28)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        digest = hashlib.sha256()
        for _ in range(4):
            digest.update(data)
        best = min(best, time.perf_counter() - start)
    return 4 * len(data) / best / GB


def fetch_checked(cache: Path) -> float:
    from builder_plugin.hub import open_source

    source = open_source(REPO_ID, None, cache)  # config, metadata: not timed
    start = time.perf_counter()
    source.fetch()
    return time.perf_counter() - start


def fetch_unchecked(endpoint: str, names: list[str], cache: Path) -> float:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get

    cache.mkdir(parents=True)
    start = time.perf_counter()
    for name in names:
        meta = get_hf_file_metadata(hf_hub_url(REPO_ID, name, endpoint=endpoint), endpoint=endpoint)
        with open(cache / name, "wb") as out:
            http_get(meta.location, out, expected_size=meta.size, displayed_filename=name)
    return time.perf_counter() - start


def report(results: dict[str, Any], command: str) -> str:
    total = results["weight_bytes"]
    rows = []
    for label, key in ((f"sha256 pass, hashlib, one thread, {results['hashlib_resident'][0]:.0%} in the page cache",
                        "hashlib_first"),
                       (f"the same again, {results['hashlib_resident'][1]:.0%} in the page cache", "hashlib_again"),
                       ("download, checked (hashed as written)", "download_checked"),
                       ("download, not checked (`http_get` alone)", "download_unchecked"),
                       ("check of the cached files (second build)", "cached_check")):
        timing = results[key]
        rows.append([label, fmt(timing["best"], 1), fmt(timing["median"], 1),
                     fmt(total / timing["best"] / GB, 2), ", ".join(f"{r:.1f}" for r in timing["runs"])])
    checked, unchecked = results["download_checked"]["median"], results["download_unchecked"]["median"]
    return "\n".join([
        f"`{command}` ({results['files']} weight files, {total / GB:.1f} GB; a LocalHub in its own process serving "
        "them over loopback; the machine shared with other jobs).",
        "",
        markdown_table(["what", "best s", "median s", "GB/s (best)", "runs s"], rows),
        "",
        f"Checking while downloading adds {checked - unchecked:+.1f} s to the median download "
        f"({(checked / unchecked - 1) * 100:+.0f} %). sha256 in memory (the CPU alone): "
        f"{results['sha256_in_memory_gb_s']:.2f} GB/s on one thread. Load averages at the start: "
        f"{', '.join(str(v) for v in results['machine'].get('load_average', []))}.",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint folder (e.g. the full-size one)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench_hub_verify")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--doc", default=str(DOC), help="Markdown file to update ('' for none)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.checkpoint)
        return 0

    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    names = weight_files(args.checkpoint)
    paths = [args.checkpoint / n for n in names]
    results: dict[str, Any] = {"machine": machine_info(), "command": command_line("bench_hub_verify.py", argv),
                               "files": len(names), "weight_bytes": sum(p.stat().st_size for p in paths)}
    resident, hashed = [], []
    for _ in range(2):  # before the hub reads the files
        resident.append(resident_share(paths))
        hashed.append(hash_pass(paths))
    in_memory = hash_rate_in_memory()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    hub = subprocess.Popen([sys.executable, "-m", __spec__.name, "--serve", "--checkpoint", str(args.checkpoint)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        endpoint = hub.stdout.readline().strip()
        if not endpoint:
            raise SystemExit("the hub process did not start")
        os.environ["HF_ENDPOINT"] = endpoint
        checked, unchecked, cached = [], [], []
        for _ in range(args.rounds):
            cache = args.work / "cache"
            checked.append(fetch_checked(cache))
            cached.append(fetch_checked(cache))
            shutil.rmtree(cache)
            unchecked.append(fetch_unchecked(endpoint, names, cache))
            shutil.rmtree(cache)
    finally:
        hub.stdin.close()
        hub.wait(timeout=60)
        shutil.rmtree(args.work, ignore_errors=True)
    results.update(hashlib_first=summarize(hashed[:1]), hashlib_again=summarize(hashed[1:]), hashlib_resident=resident,
                   sha256_in_memory_gb_s=in_memory, download_checked=summarize(checked),
                   download_unchecked=summarize(unchecked), cached_check=summarize(cached))
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=2))
    publish(results, RESULTS, args.doc, HEADING, report(results, results["command"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
