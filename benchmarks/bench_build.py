"""Whole-package build benchmark: wall time and peak RSS of `python -m builder_plugin`, each build in its own process.

    python -m benchmarks.bench_build [--work DIR] [--full-checkpoint DIR] [--skip-full] [--precisions int4,fp16]

- ``tiny``: the tiny generated checkpoint, fp32 and int4 cpu, all four models (fp32 is what tests and the demo
  build).
- ``full``: the full-size generated checkpoint (real Phi-4-MM shapes, random weights: 5.6 B parameters, 11 GB bf16),
  int4 cpu and fp16 cuda, all four models, ``--lora routed`` (three decoders sharing their base weights).

Peak RSS is the build process's ru_maxrss (imports included), read through /usr/bin/time -v when present. The 2-layer
decoder comparison with the stock GenAI builder path is benchmarks/bench_decoder_build.py. Results go to
benchmarks/results/build.json and are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import GB, RESULTS_DIR, ROOT, machine_info, markdown_table, write_json

RESULTS = RESULTS_DIR / "build.json"


def timed_build(checkpoint: Path, output: Path, *args: str) -> dict[str, Any]:
    shutil.rmtree(output, ignore_errors=True)
    command = [sys.executable, "-m", "builder_plugin", "-i", str(checkpoint), "-o", str(output), "--no-progress", *args]
    timer = ["/usr/bin/time", "-v"] if Path("/usr/bin/time").exists() else []
    start = time.perf_counter()
    proc = subprocess.run(timer + command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"build failed: {' '.join(command)}\n{proc.stdout}\n{proc.stderr}")
    peak = None
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    if match:
        peak = int(match.group(1)) * 1024
    reported = re.search(r"built .* in ([\d.]+) s(?: \(quantization ([\d.]+) s on \d+ threads\))?, peak memory "
                         r"([\d.]+) (MB|GB)", proc.stdout)
    files = {p.name: p.stat().st_size for p in output.iterdir() if p.is_file()}
    return {
        "args": list(args),
        "wall_s": round(wall, 1),
        "build_s": float(reported.group(1)) if reported else None,
        "quantize_s": float(reported.group(2)) if reported and reported.group(2) else None,
        "peak_rss_bytes": peak,
        "package_bytes": sum(files.values()),
        "files": files,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench_build")
    parser.add_argument("--full-checkpoint", type=Path, default=None,
                        help="an existing full-size checkpoint (default: generate one in --work)")
    parser.add_argument("--skip-full", action="store_true")
    parser.add_argument("--precisions", default="int4,fp16", help="full-size builds to run (int4 = cpu, fp16 = cuda)")
    args = parser.parse_args(argv)

    from builder_plugin.testing.make_checkpoint import make_checkpoint

    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": machine_info(), "builds": {}}
    tiny = args.work / "tiny"
    if not (tiny / "config.json").is_file():
        make_checkpoint(tiny, preset="tiny", seed=0)
    for precision in ("fp32", "int4"):
        results["builds"][f"tiny {precision} cpu"] = timed_build(tiny, args.work / f"tiny-{precision}", "-p", precision)

    if not args.skip_full:
        full = args.full_checkpoint or args.work / "full"
        if not (full / "config.json").is_file():
            make_checkpoint(full, preset="full", seed=0)
        for precision in args.precisions.split(","):
            provider = "cpu" if precision in ("int4", "fp32") else "cuda"
            name = f"full {precision} {provider}"
            results["builds"][name] = timed_build(full, args.work / f"full-{precision}", "-p", precision,
                                                  "-e", provider)
            shutil.rmtree(args.work / f"full-{precision}", ignore_errors=True)

    write_json(RESULTS, results)
    rows = [[name, f"{r['wall_s']:.1f} s", f"{r['build_s']:.1f} s" if r["build_s"] else "?",
             f"{r['peak_rss_bytes'] / GB:.2f} GB" if r["peak_rss_bytes"] else "?", f"{r['package_bytes'] / GB:.2f} GB"]
            for name, r in results["builds"].items()]
    print(markdown_table(["build", "process wall", "build (after imports)", "peak RSS", "package"], rows))
    print(f"results written to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
