"""The MatMulNBits kernel alone against the memory-read bound: how fast onnxruntime's CPU kernel streams a decode
step's int4 weights when nothing else is in the step.

    python -m benchmarks.bench_matmulnbits [--layers 16] [--block-sizes 32,64,128] [--rounds 2] [--hugepages]
    python -m benchmarks.bench_matmulnbits --from-json benchmarks/results/matmulnbits.json   # redo the report

A graph holds the MatMulNBits of `--layers` text-decoder layers with the full-size shapes (qkv, o, gate_up, down;
random packed weights, every node its own, one input row as in a decode step), written once per block size to
`--work`. Each setting loads it in a fresh process with the run time's session settings (no spinning; the default
thread count, and one thread) and times `--steps` runs. Reported per setting: the bytes the graph stores (packed
weights and scales, what bench_threads counts per step), the resident memory the session holds after load (the
prepacked copy the kernel reads), the step time, the stored bytes per second against the numpy read bandwidth probed
in the same process before and after, and that share: the highest share of the read bound a decode step with these
weights can reach whatever the rest of the step costs. `--hugepages` adds the default threads with glibc's malloc
asking for transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1).
Results: benchmarks/results/matmulnbits.json and the "MatMulNBits alone" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    ROOT,
    add_report_options,
    fmt,
    machine_markdown,
    markdown_table,
    measure_or_replay,
    read_probe_gb_s,
    rss_split,
)
from builder_plugin.memory import proc_kib_field
from builder_plugin.runtime.threads import NO_SPINNING, SPINNING_KEY, default_threads
from builder_plugin.testing.make_checkpoint import PRESETS

HEADING = "## MatMulNBits alone"
HUGEPAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def layer_shapes(text: dict[str, int]) -> list[tuple[str, int, int]]:
    """(name, K, N) of one decoder layer's MatMuls, as the builder fuses them (qkv and gate_up one MatMul each)."""
    hidden, inner = text["hidden_size"], text["intermediate_size"]
    head = hidden // text["num_attention_heads"]
    qkv = hidden + 2 * text["num_key_value_heads"] * head
    return [("qkv", hidden, qkv), ("o", hidden, hidden), ("gate_up", hidden, 2 * inner), ("down", inner, hidden)]


def write_graph(path: Path, layers: int, block_size: int, accuracy_level: int, seed: int = 0,
                rows: int | str = 1) -> int:
    """A graph of `layers` layers' MatMulNBits, each reading the input rows of its K (`rows`: their count, or a name
    for any count); returns the stored bytes."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    shapes = layer_shapes(PRESETS["full"]["text"])
    widths = sorted({k for _, k, _ in shapes})
    nodes, initializers, outputs, stored = [], [], [], 0
    for layer in range(layers):
        for name, k, n in shapes:
            prefix = f"layers.{layer}.{name}"
            weight = rng.integers(0, 256, size=(n, k // block_size, block_size // 2), dtype=np.uint8)
            scales = rng.random(n * (k // block_size), dtype=np.float32) * np.float32(0.01)
            initializers += [numpy_helper.from_array(weight, f"{prefix}.qweight"),
                             numpy_helper.from_array(scales, f"{prefix}.scales")]
            stored += weight.nbytes + scales.nbytes
            nodes.append(helper.make_node("MatMulNBits", [f"x{k}", f"{prefix}.qweight", f"{prefix}.scales"],
                                          [f"{prefix}.out"], domain="com.microsoft", K=k, N=n, bits=4,
                                          block_size=block_size, accuracy_level=accuracy_level))
            outputs.append(helper.make_tensor_value_info(f"{prefix}.out", TensorProto.FLOAT, [rows, n]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [rows, k]) for k in widths]
    graph = helper.make_graph(nodes, "matmulnbits", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return stored


def load(path: Path, threads: int, library: Path | None = None) -> Any:
    """A session with the run time's settings (`threads`, no spinning), the operator `library` registered if given."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry(SPINNING_KEY, NO_SPINNING)
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def measure(path: Path, threads: int, steps: int, rows: int = 1, library: Path | None = None) -> dict[str, Any]:
    """In this process: load `path` (with the operator `library` registered, if given), time `steps` runs of `rows`
    input rows; bandwidth probes right before and after."""
    before = rss_split().get("RssAnon", 0)
    session = load(path, threads, library)
    gc.collect()
    held = rss_split().get("RssAnon", 0) - before
    feeds = {i.name: np.full([rows, i.shape[1]], 0.01, dtype=np.float32) for i in session.get_inputs()}
    for _ in range(3 if rows <= 64 else 1):
        session.run(None, feeds)
    probes = [read_probe_gb_s()]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    probes.append(read_probe_gb_s())
    return {"threads": threads, "session_anon_bytes": held, "step_s": times, "probes_gb_s": probes,
            "anon_huge_bytes": _anon_huge_bytes()}


def _anon_huge_bytes() -> int | None:
    try:
        return proc_kib_field("/proc/self/smaps_rollup", "AnonHugePages")
    except OSError:
        return None


def _child(path: Path, threads: int, steps: int, hugepages: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if hugepages:
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), HUGEPAGES_TUNABLE]))
    done = subprocess.run([sys.executable, "-m", __spec__.name, "--worker", json.dumps(
        {"path": str(path), "threads": threads, "steps": steps})], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"worker failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def settings(args: argparse.Namespace) -> list[dict[str, Any]]:
    chosen = default_threads()
    found = []
    for block_size in args.block_sizes:
        found.append({"block_size": block_size, "threads": chosen, "hugepages": False})
        if chosen != 1:
            found.append({"block_size": block_size, "threads": 1, "hugepages": False})
        if args.hugepages:
            found.append({"block_size": block_size, "threads": chosen, "hugepages": True})
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    todo = settings(args)
    runs: dict[str, list[dict[str, Any]]] = {_key(s): [] for s in todo}
    stored: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="matmulnbits-", dir=args.work) as work:
        paths = {}
        for block_size in args.block_sizes:
            paths[block_size] = Path(work) / f"block{block_size}.onnx"
            stored[block_size] = write_graph(paths[block_size], args.layers, block_size, args.accuracy_level)
            print(f"block {block_size}: {stored[block_size] / 1e9:.2f} GB stored", flush=True)
        for round_index in range(args.rounds):
            for setting in todo if round_index % 2 == 0 else todo[::-1]:
                found = _child(paths[setting["block_size"]], setting["threads"], args.steps, setting["hugepages"])
                runs[_key(setting)].append(found)
                print(f"{_key(setting)}: {stored[setting['block_size']] / min(found['step_s']) / 1e9:.1f} GB/s "
                      f"(probes {found['probes_gb_s']})", flush=True)
    return {"layers": args.layers, "accuracy_level": args.accuracy_level, "steps": args.steps, "rounds": args.rounds,
            "shapes": layer_shapes(PRESETS["full"]["text"]), "settings": todo,
            "stored_bytes": {str(k): v for k, v in stored.items()}, "runs": runs}


def _key(setting: dict[str, Any]) -> str:
    return (f"block {setting['block_size']}, {setting['threads']} thread{'s' * (setting['threads'] != 1)}"
            + (", huge pages" if setting["hugepages"] else ""))


def report(results: dict[str, Any]) -> str:
    rows = []
    for setting in results["settings"]:
        found = results["runs"][_key(setting)]
        stored = results["stored_bytes"][str(setting["block_size"])]
        steps = [s for run in found for s in run["step_s"]]
        shares = [stored / statistics.median(run["step_s"]) / max(run["probes_gb_s"]) / 1e9 for run in found]
        probes = [p for run in found for p in run["probes_gb_s"]]
        held = max(run["session_anon_bytes"] for run in found)
        huge = max((run.get("anon_huge_bytes") or 0) for run in found)
        rows.append([setting["block_size"], setting["threads"],
                     f"yes ({fmt(huge / 1e9, 2)} GB)" if setting["hugepages"] else "no",
                     fmt(stored / 1e9, 2), f"{fmt(held / 1e9, 2)} ({fmt(held / stored, 2)}x)",
                     f"{fmt(min(steps) * 1e3, 1)} / {fmt(statistics.median(steps) * 1e3, 1)}",
                     f"{fmt(stored / min(steps) / 1e9, 1)} / {fmt(stored / statistics.median(steps) / 1e9, 1)}",
                     f"{fmt(statistics.median(probes), 1)} ({fmt(min(probes), 1)}-{fmt(max(probes), 1)})",
                     f"{fmt(100 * statistics.median(shares), 0)} % ({fmt(100 * min(shares), 0)}-"
                     f"{fmt(100 * max(shares), 0)})"])
    shapes = ", ".join(f"{name} {k}x{n}" for name, k, n in results["shapes"])
    return "\n".join([
        *([results["note"], ""] if results.get("note") else []),
        f"`{results['command']}` at {results['git']['commit'][:10]}: {results['layers']} layers of MatMulNBits "
        f"({shapes}; 4 bits, accuracy_level {results['accuracy_level']}, random weights, every node its own), one "
        f"input row as in a decode step; each setting in a fresh process, {results['rounds']} rounds alternating, "
        f"{results['steps']} timed runs each. Stored = packed weights and scales in the graph (what a decode step's "
        "bytes count in \"Threads\"); held = the session's anonymous resident memory after load (onnxruntime's "
        "prepacked copy). Share = stored bytes / median run / the best read probe beside it: the most of the "
        "read bound a decode step with these weights can reach.", "",
        markdown_table(["block size", "threads", "huge pages", "stored GB", "held GB", "run ms best / median",
                        "stored GB/s best / median", "read probes GB/s median (range)",
                        "share of the read bound: median (range)"], rows), "",
        machine_markdown(results["machine"]), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of weights (16: 1.2 GB at block 32)")
    parser.add_argument("--block-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[32, 64, 128])
    parser.add_argument("--accuracy-level", type=int, default=4, help="4: int8 activations, the cpu build's")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hugepages", action="store_true", help=f"also run with GLIBC_TUNABLES={HUGEPAGES_TUNABLE}")
    parser.add_argument("--work", default=None, help="folder for the graphs (default: the system's temporary one)")
    add_report_options(parser, "matmulnbits.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(measure(Path(job["path"]), job["threads"], job["steps"])))
        return 0
    return measure_or_replay(args, argv, "bench_matmulnbits.py", HEADING, run, report)

if __name__ == "__main__":
    sys.exit(main())
