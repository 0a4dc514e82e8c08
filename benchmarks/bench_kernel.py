"""The project's MatMulNBits kernel (builder_plugin/kernels) against onnxruntime's own, alone, on the decoder's
full-size shapes: a few rows (decode steps, several users, speculative tokens) against the memory-read bound, and many
rows (a prompt) in GFLOP/s, beside onnxruntime's int8 GEMM (DynamicQuantizeMatMul, int8 weights as constants), the
throughput the CPU's int8 units give through onnxruntime.

    python -m benchmarks.bench_kernel [--layers 16] [--block-size 32] [--rows 1,2,4,8,512] [--duel 1] [--rounds 2]
    python -m benchmarks.bench_kernel --from-json benchmarks/results/kernel.json   # redo the report

The graph of bench_matmulnbits.py (`--layers` layers of qkv, o, gate_up and down MatMulNBits, 4 bits, random weights,
every node its own) with any number of input rows; for rows from `--gemm-from-rows` on, also a graph of
`--gemm-layers` layers of the same shapes as DynamicQuantizeMatMul (A quantized to uint8 with one scale for the whole
tensor, int8 weights, MLAS's int8 GEMM: AMX where the CPU has it). Each (kernel, rows) setting loads it in a fresh
process with the run time's session settings (the default threads, no spinning), onnxruntime's kernel or, registered
on the session, the library's, and times `--steps` runs, with numpy read probes in the same process right before and
after. `--duel` row counts are also timed with both kernels' sessions in one process taking turns (the fairest
comparison when the machine's bandwidth moves). Reported: run time, the stored bytes per second and their share of the
read bound (the best probe beside the run),
GFLOP/s (2 x rows x K x N per node), and the anonymous memory the session holds after load (onnxruntime's kernel
keeps a prepacked copy of the weights; the library reads them where the session loaded them). Where the library
registers nothing (not built, or no AVX2) onnxruntime's kernel and its int8 GEMM are measured alone;
`python -m benchmarks.cpu_class avx2 -- ...` runs the paths of a CPU with AVX2 alone.
Results: benchmarks/results/kernel.json and the "MatMulNBits kernel of the library" section of docs/benchmarks.md.
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

import numpy as np

from benchmarks.bench_matmulnbits import layer_shapes, load, measure, write_graph
from benchmarks.common import (
    ROOT,
    add_report_options,
    fmt,
    machine_markdown,
    markdown_table,
    measure_or_replay,
    per_machine_class,
    read_probe_gb_s,
)
from builder_plugin import kernels
from builder_plugin.runtime.threads import default_threads
from builder_plugin.testing.make_checkpoint import PRESETS

HEADING = per_machine_class("## MatMulNBits kernel of the library")
KERNELS = ("onnxruntime", "library")
SHARE_NAMES = {"library": "library", "onnxruntime": "onnxruntime's MatMulNBits"}
GEMM = "int8 GEMM"  # onnxruntime's DynamicQuantizeMatMul: the reference throughput of many rows


def write_gemm_graph(path: Path, layers: int, seed: int = 0) -> None:
    """`layers` layers of the decoder's MatMul shapes as DynamicQuantizeMatMul with int8 constant weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    shapes = layer_shapes(PRESETS["full"]["text"])
    nodes, initializers, outputs = [], [], []
    for layer in range(layers):
        for name, k, n in shapes:
            prefix = f"layers.{layer}.{name}"
            initializers += [numpy_helper.from_array(rng.integers(-127, 128, size=(k, n), dtype=np.int8),
                                                     f"{prefix}.weight"),
                             numpy_helper.from_array(np.full([n], 0.01, np.float32), f"{prefix}.scale")]
            nodes.append(helper.make_node("DynamicQuantizeMatMul", [f"x{k}", f"{prefix}.weight", f"{prefix}.scale"],
                                          [f"{prefix}.out"], domain="com.microsoft"))
            outputs.append(helper.make_tensor_value_info(f"{prefix}.out", TensorProto.FLOAT, ["rows", n]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["rows", k])
              for k in sorted({k for _, k, _ in shapes})]
    graph = helper.make_graph(nodes, "int8_gemm", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")


def duel(path: Path, threads: int, rows: int, rounds: int, steps: int = 3) -> dict[str, Any]:
    """Both kernels' sessions in this process, taking turns `rounds` times (`steps` runs each), a read probe before
    every turn: the fairest comparison on a machine whose bandwidth moves."""
    sessions = {kernel: load(path, threads, kernels.library_path() if kernel == "library" else None)
                for kernel in KERNELS}
    feeds = {i.name: np.full([rows, i.shape[1]], 0.01, dtype=np.float32) for i in sessions["library"].get_inputs()}
    times: dict[str, list[float]] = {kernel: [] for kernel in KERNELS}
    probes = []
    for _ in range(rounds):
        probes.append(read_probe_gb_s())
        for kernel, session in sessions.items():
            session.run(None, feeds)
            for _ in range(steps):
                start = time.perf_counter()
                session.run(None, feeds)
                times[kernel].append(time.perf_counter() - start)
    probes.append(read_probe_gb_s())
    return {"rows": rows, "step_s": times, "probes_gb_s": probes}


def _child(path: Path, kernel: str, rows: int, threads: int, steps: int) -> dict[str, Any]:
    job = {"path": str(path), "kernel": kernel, "rows": rows, "threads": threads, "steps": steps}
    done = subprocess.run([sys.executable, "-m", __spec__.name, "--worker", json.dumps(job)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(f"worker failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _duel_child(path: Path, threads: int, rows: int, rounds: int) -> dict[str, Any]:
    job = {"duel": True, "path": str(path), "threads": threads, "rows": rows, "rounds": rounds}
    done = subprocess.run([sys.executable, "-m", __spec__.name, "--worker", json.dumps(job)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(f"worker failed: {done.stderr.strip().splitlines()[-1:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"duel, {rows} rows: " + ", ".join(f"{k} {min(v) * 1e3:.1f} ms" for k, v in found["step_s"].items()),
          flush=True)
    return found


def _key(kernel: str, rows: int) -> str:
    return f"{kernel}, {rows} row{'s' * (rows != 1)}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    # where the library registers nothing (not built, or a CPU without AVX2)
    # onnxruntime's kernels are measured alone
    measured = KERNELS if kernels.level() != "none" else ("onnxruntime",)
    threads = args.threads or default_threads()
    todo = [(kernel, rows) for rows in args.rows
            for kernel in (*measured, *((GEMM,) if rows >= args.gemm_from_rows else ()))]
    runs: dict[str, list[dict[str, Any]]] = {_key(*s): [] for s in todo}
    with tempfile.TemporaryDirectory(prefix="kernel-", dir=args.work) as work:
        path, gemm_path = Path(work) / "graph.onnx", Path(work) / "gemm.onnx"
        stored = write_graph(path, args.layers, args.block_size, 4, rows="rows")
        if any(kernel == GEMM for kernel, _ in todo):
            write_gemm_graph(gemm_path, args.gemm_layers)
        duels = [_duel_child(path, threads, rows, args.duel_rounds) for rows in args.duel if len(measured) > 1]
        for round_index in range(args.rounds):
            for kernel, rows in todo if round_index % 2 == 0 else todo[::-1]:
                steps = args.steps if rows <= 64 else max(2, args.steps // 4)
                found = _child(gemm_path if kernel == GEMM else path, kernel, rows, threads, steps)
                runs[_key(kernel, rows)].append(found)
                print(f"{_key(kernel, rows)}: {min(found['step_s']) * 1e3:.1f} ms, "
                      f"{stored / min(found['step_s']) / 1e9:.1f} GB/s (probes {found['probes_gb_s']})", flush=True)
    shapes = layer_shapes(PRESETS["full"]["text"])
    return {"layers": args.layers, "gemm_layers": args.gemm_layers, "library_paths": kernels.paths(),
            "block_size": args.block_size, "threads": threads, "rows": args.rows,
            "rounds": args.rounds, "steps": args.steps, "shapes": shapes, "stored_bytes": stored,
            "flops_per_row": 2 * args.layers * sum(k * n for _, k, n in shapes), "library_level": kernels.level(),
            "kernels": list(measured), "runs": runs, "duels": duels}


def report(results: dict[str, Any]) -> str:
    rows_out = []
    stored = results["stored_bytes"]
    measured = results.get("kernels", KERNELS)  # results before the library could be absent measured both
    one_row = {kernel: statistics.median([s for run in results["runs"].get(_key(kernel, 1), []) for s in run["step_s"]]
                                         or [float("nan")]) for kernel in measured}
    shares_of_gemm = []
    for rows in results["rows"]:
        gflops = {}
        for kernel in (*measured, GEMM):
            found = results["runs"].get(_key(kernel, rows))
            if not found:
                continue
            steps = [s for run in found for s in run["step_s"]]
            held = max(run["session_anon_bytes"] for run in found)
            layers = results["gemm_layers"] if kernel == GEMM else results["layers"]
            flops = results["flops_per_row"] * rows * layers / results["layers"]
            gflops[kernel] = flops / statistics.median(steps) / 1e9
            timing = [f"{fmt(min(steps) * 1e3, 1)} / {fmt(statistics.median(steps) * 1e3, 1)}"]
            probes = [p for run in found for p in run["probes_gb_s"]]
            probe_text = f"{fmt(statistics.median(probes), 1)} ({fmt(min(probes), 1)}-{fmt(max(probes), 1)})"
            if kernel == GEMM:  # its own graph (int8 weights, `gemm_layers` layers): no read-bound columns
                bytes_columns = ["", "", probe_text, "", f"{fmt(held / 1e9, 2)}"]
            else:
                shares = [stored / statistics.median(run["step_s"]) / max(run["probes_gb_s"]) / 1e9 for run in found]
                rate = f"{fmt(stored / min(steps) / 1e9, 1)} / {fmt(stored / statistics.median(steps) / 1e9, 1)}"
                against_one_row = statistics.median(steps) / one_row[kernel]  # nan without a 1-row run
                bytes_columns = [f"{fmt(against_one_row, 2)}x" if against_one_row == against_one_row else "", rate,
                                 probe_text, f"{fmt(100 * statistics.median(shares), 0)} %",
                                 f"{fmt(held / 1e9, 2)} ({fmt(held / stored, 2)}x)"]
            rows_out.append([kernel, rows, *timing, *bytes_columns[:4],
                             f"{fmt(flops / min(steps) / 1e9, 0)} / {fmt(flops / statistics.median(steps) / 1e9, 0)}",
                             bytes_columns[4]])
        if GEMM in gflops:
            shares_of_gemm.append(f"{rows} rows: " + ", ".join(
                f"{SHARE_NAMES[kernel]} {fmt(100 * gflops[kernel] / gflops[GEMM], 0)} %"
                for kernel in measured if kernel in gflops))
    duel_rows = []
    for found in results.get("duels", []):
        best_probe = max(found["probes_gb_s"])
        for kernel in KERNELS:
            steps = found["step_s"][kernel]
            duel_rows.append([kernel, found["rows"],
                              f"{fmt(min(steps) * 1e3, 1)} / {fmt(statistics.median(steps) * 1e3, 1)}",
                              f"{fmt(stored / min(steps) / 1e9, 1)}",
                              f"{fmt(best_probe, 1)} (median {fmt(statistics.median(found['probes_gb_s']), 1)})",
                              f"{fmt(100 * stored / min(steps) / best_probe / 1e9, 0)} %"])
    duel_part = [] if not duel_rows else [
        "Duels: both kernels' sessions in one process taking turns (3 runs each per turn), a read probe before every "
        "turn; share = stored bytes / best run / best probe.", "",
        markdown_table(["kernel", "rows", "run ms best / median", "stored GB/s (best)", "read probes GB/s best",
                        "share of the best probe"], duel_rows), ""]
    shapes = ", ".join(f"{name} {k}x{n}" for name, k, n in results["shapes"])
    return "\n".join([
        *([results["note"], ""] if results.get("note") else []),
        f"`{results['command']}` at {results['git']['commit'][:10]}: {results['layers']} layers of MatMulNBits "
        f"({shapes}; 4 bits, block {results['block_size']}, accuracy_level 4, random weights, every node its own), "
        f"{results['threads']} threads, the library at level `{results['library_level']}`"
        + (f" (paths: {results['library_paths']})" if results.get("library_paths") else "")
        + (f"; {GEMM} = DynamicQuantizeMatMul on {results['gemm_layers']} layers of the same shapes (int8 weights)"
           if results.get("gemm_layers") else "") + "; each setting in a fresh "
        f"process, {results['rounds']} rounds alternating. Share = stored bytes / median run / the best read probe "
        "beside it; held = the session's anonymous memory after load (the library reads the weights where onnxruntime "
        "loaded them: memory-mapped from the data file, counted as file-backed).", "",
        markdown_table(["kernel", "rows", "run ms best / median", "median / its 1-row median",
                        "stored GB/s best / median", "read probes GB/s median (range)",
                        "share of the read bound (median)", "GFLOP/s best / median", "held GB"], rows_out), "",
        *([f"Median GFLOP/s as a share of {GEMM}'s in the same run: " + "; ".join(shares_of_gemm) + ".", ""]
          if shares_of_gemm else []),
        *duel_part, machine_markdown(results["machine"]), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8, 512])
    parser.add_argument("--threads", type=int, default=None, help="default: the run time's")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duel", type=lambda s: [int(v) for v in s.split(",") if v], default=[1],
                        help="row counts to also time with both kernels in one process, taking turns ('' = none)")
    parser.add_argument("--duel-rounds", type=int, default=8)
    parser.add_argument("--gemm-layers", type=int, default=2, help=f"layers of the {GEMM} graph (int8 weights)")
    parser.add_argument("--gemm-from-rows", type=int, default=16, help=f"row counts from which {GEMM} is timed too")
    parser.add_argument("--work", default=None, help="folder for the graph (default: the system's temporary one)")
    add_report_options(parser, "kernel.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        if job.get("duel"):
            print(json.dumps(duel(Path(job["path"]), job["threads"], job["rows"], job["rounds"])))
            return 0
        library = kernels.library_path() if job["kernel"] == "library" else None
        print(json.dumps(measure(Path(job["path"]), job["threads"], job["steps"], job["rows"], library)))
        return 0
    return measure_or_replay(args, argv, "bench_kernel.py", HEADING, run, report)

if __name__ == "__main__":
    sys.exit(main())
