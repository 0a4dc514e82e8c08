"""Size, build cost and decode speed of each quantization choice on the full-size checkpoint, one build at a time.

    python -m benchmarks.bench_quant_choices --checkpoint full [--choices int4-rtn_last,int4-k_quant] [--work DIR]
        [--jobs N] [--no-decode]
    python -m benchmarks.bench_quant_choices --checkpoint full --layer [--jobs-list 1,2] [--repeats 2]

Each choice (`CHOICES`: `-p` and `--extra_options` of `python -m builder_plugin`) is built in its own process (wall
time and peak RSS from the operating system's accounting of that process), its data files are measured, then a fresh
process loads it with onnxruntime-genai and answers one greedy text question (load, prefill, median decode step, peak
RSS), and the package is deleted unless `--keep`. Results accumulate in the JSON by choice (and `--jobs`, when given),
so choices can be run on different days; each keeps the commit and the machine load it was measured at.
Results: benchmarks/results/quant_choices.json and the "Quantization choices at full size" section of
docs/benchmarks.md.

`--layer`: k-quant alone on one full-width weight (layer 0's down_proj, [8192, 3072] as the MatMul reads it, through
the project's checkpoint reader), at 4 and 8 bits: onnxruntime's own `MatMulNBitsQuantizer` with
`KQuantWeightOnlyQuantConfig` on a one-MatMul model (the reference's routine `quant_tensor_k_quant_cpu` timed alone
too) against the builder's quantizer with each of its k-quant kernels (numba's and the numpy one it falls back to) at
each of `--jobs-list`, best of `--repeats`, whose bytes must equal the reference's; and the numba kernel's first call
in a fresh process, compiling and then from its cache. Results: benchmarks/results/k_quant_layer.json and the
"k-quant on one full-width layer" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    RESULTS_DIR,
    ROOT,
    add_report_options,
    command_line,
    fmt,
    git_state,
    greedy_text_answer,
    machine_info,
    machine_markdown,
    peak_rss_bytes,
    publish,
)
from builder_plugin.layout import DATA_FILES, Component
from builder_plugin.quant_choices import DEFAULT_ALGO_CONFIG

# name -> (precision, --extra_options); the names are what --choices takes
CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "int4": ("int4", ()),  # the default
    "int4-default": ("int4", ("algo_config=default",)),
    "int4-rtn": ("int4", ("algo_config=rtn",)),
    "int4-rtn_last": ("int4", ("algo_config=rtn_last",)),
    "int4-k_quant": ("int4", ("algo_config=k_quant",)),
    "int4-k_quant_last": ("int4", ("algo_config=k_quant_last",)),
    "int4-k_quant_linear": ("int4", ("algo_config=k_quant_linear",)),
    "int4-default-block128": ("int4", ("algo_config=default", "block_size=128")),
    "int4-default-asymmetric": ("int4", ("algo_config=default", "is_symmetric=false")),
    "int4-default-int8-mixed": ("int4", ("algo_config=default",
                                         "matmul_mixed_precision=last_matmul:int8,mixed_layers:int8")),
    "int8": ("int8", ()),
}
QUESTION = "Explain how lasers work, step by step, for a curious teenager."


LAYER_WEIGHT = "model.layers.0.mlp.down_proj.base_layer.weight"
# The builder's k-quant kernels (builder_plugin.quant.k_quant.KERNEL) -> how the layer report names them
KERNELS = {"numpy": "numpy kernel (k_quant.py)", "numba": "numba kernel (k_quant_numba.py)"}


def build_choice(name: str, checkpoint: Path, output: Path, jobs: int | None = None) -> dict:
    precision, extra = CHOICES[name]
    command = [sys.executable, "-m", "builder_plugin", "-i", str(checkpoint), "-o", str(output), "-p", precision,
               "--no-progress", "--overwrite", *(("--extra_options", *extra) if extra else ()),
               *(("--jobs", str(jobs)) if jobs else ())]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{name}: the build failed: {process.stderr.read().strip().splitlines()[-1:]}")
    summary = re.search(r"\(quantization ([\d.]+) s on (\d+) threads\)", process.stdout.read())
    data = {component.value: (output / DATA_FILES[component]).stat().st_size for component in
            (Component.DECODER, Component.VISION, Component.SPEECH) if (output / DATA_FILES[component]).is_file()}
    return {"build_s": wall, "build_cpu_s": usage.ru_utime + usage.ru_stime,
            "build_peak_rss_bytes": usage.ru_maxrss * 1024, "extra_options": list(extra), "precision": precision,
            "package_bytes": sum(p.stat().st_size for p in output.iterdir() if p.is_file()), "data_bytes": data,
            "quantize_s": float(summary.group(1)) if summary else None,
            "jobs": int(summary.group(2)) if summary else None}


def decode(package: Path, new_tokens: int) -> dict:
    """One greedy answer in this process, as an app makes it."""
    answer = greedy_text_answer(package, QUESTION, new_tokens)
    return {"load_s": answer["load_s"], "prompt_tokens": answer["prompt_tokens"], "prefill_s": answer["prefill_s"],
            "decode_tokens_per_s_median": 1 / statistics.median(answer["step_s"]),
            "decode_tokens_per_s_best": 1 / min(answer["step_s"]), "decode_peak_rss_bytes": peak_rss_bytes()}


def _commit() -> str:
    """The short commit, marked when the builder's sources differ from it."""
    state = git_state("builder_plugin", "genai_config")
    return state["commit"][:7] + ("+changes" if state["modified_files"] else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="the full-size checkpoint (make_checkpoint --preset full)")
    parser.add_argument("--choices", default=",".join(CHOICES), help=f"comma-separated, of: {', '.join(CHOICES)}")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_quant_choices"), help="where packages go")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--keep", action="store_true", help="keep the packages")
    add_report_options(parser, "quant_choices.json", replay=False)
    parser.add_argument("--jobs", type=int, help="the builds' --jobs (default: theirs, every core)")
    parser.add_argument("--no-decode", action="store_true", help="build only (the decode columns stay empty)")
    parser.add_argument("--layer", action="store_true", help="k-quant on one full-width weight against onnxruntime's")
    parser.add_argument("--jobs-list", default="1,2", help="--layer: the thread counts to time")
    parser.add_argument("--repeats", type=int, default=2, help="--layer: runs of each kernel and thread count")
    parser.add_argument("--decode", type=Path, help=argparse.SUPPRESS)  # child: one answer, JSON on stdout
    args = parser.parse_args(argv)
    if args.decode:
        print(json.dumps(decode(args.decode, args.new_tokens)))
        return 0
    choices = [c for c in args.choices.split(",") if c]
    unknown = [c for c in choices if c not in CHOICES]
    if unknown or not args.checkpoint:
        parser.error(f"unknown choices: {', '.join(unknown)}" if unknown else "--checkpoint is required")
    if args.layer:
        layer = layer_benchmark(args.checkpoint, [int(j) for j in args.jobs_list.split(",")], args.note, args.repeats)
        layer.update(command=command_line("bench_quant_choices.py", argv), machine=machine_info())
        publish(layer, RESULTS_DIR / "k_quant_layer.json", args.doc,
                "## k-quant on one full-width layer", layer_report(layer))
        return 0

    results = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {"choices": {}}
    for name in choices:
        key = name if args.jobs is None else f"{name} --jobs {args.jobs}"
        package = args.work / f"quant-{name}"
        print(f"{key}: building", file=sys.stderr, flush=True)
        entry = {"commit": _commit(), "load_average_before": os.getloadavg()[0], "note": args.note,
                 **build_choice(name, args.checkpoint, package, args.jobs)}
        if not args.no_decode:
            print(f"{key}: decoding", file=sys.stderr, flush=True)
            child = subprocess.run([sys.executable, "-m", __spec__.name, "--decode", str(package), "--new-tokens",
                                    str(args.new_tokens)], capture_output=True, text=True,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
            if child.returncode:
                raise SystemExit(f"{name}: decoding failed: {child.stderr.strip().splitlines()[-1:]}")
            entry.update(json.loads(child.stdout.strip().splitlines()[-1]))
        entry["load_average_after"] = os.getloadavg()[0]
        if not args.keep:
            shutil.rmtree(package)
        results["choices"][key] = entry
        results.update(command=command_line("bench_quant_choices.py", argv), machine=machine_info(),
                       checkpoint=str(args.checkpoint))
        publish(results, args.out, args.doc, "## Quantization choices at full size", report(results))
    return 0


def report(results: dict) -> str:
    gb = 1e9
    rows = []
    for key in sorted(results["choices"], key=_table_order):  # table order, whatever order they were measured in
        run = results["choices"][key]
        options = " ".join(run["extra_options"]) or f"(none: algo_config={DEFAULT_ALGO_CONFIG[run['precision']]})"
        data = run["data_bytes"]
        quantize = f", quantization {fmt(run['quantize_s'] / 60, 1)} min" if run.get("quantize_s") else ""
        decoded = "prefill_s" in run
        rows.append(
            f"| {key} | `-p {run['precision']}` {options} | {run['commit']} | {fmt(run['build_s'] / 60, 1)} min "
            f"({fmt(run['build_cpu_s'] / 60, 1)} CPU{quantize}) | **{fmt(run['build_peak_rss_bytes'] / gb, 2)} GB** | "
            f"{fmt(run['package_bytes'] / gb, 2)} GB | {fmt(data.get('decoder', 0) / gb, 2)} / "
            f"{fmt(data.get('vision', 0) / gb, 3)} / {fmt(data.get('speech', 0) / gb, 3)} GB | "
            + (f"{fmt(run['prefill_s'], 2)} s | {fmt(run['decode_tokens_per_s_median'], 2)} / "
               f"{fmt(run['decode_tokens_per_s_best'], 2)} | {fmt(run['decode_peak_rss_bytes'] / gb, 2)} GB | "
               if decoded else "not run | not run | not run | ")
            + f"{fmt(run['load_average_before'], 1)} |")
    return "\n".join([
        f"Command: `{results['command']}` (the last run; each row names the commit it was measured at)", "",
        machine_markdown(results["machine"]), "",
        "Full-size checkpoint (real shapes, random weights), all four models, the default routed decoder, cpu. Build: "
        "wall time and peak RSS of the build process, and the quantization time the build reports (rows named "
        "`--jobs N` were built with that many quantizing threads, the others with the default, every core). "
        "Decode: a fresh process loads the package with onnxruntime-genai and answers one greedy text question "
        "(prefill of the prompt, then the median and best decode step).", "",
        "| choice | options | commit | build | build peak RSS | package | text / vision / speech data | prefill | "
        "decode tok/s median / best | decode peak RSS | load avg |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows, ""])


def _table_order(key: str) -> tuple[int, str]:
    name = key.split(" ")[0]
    return (list(CHOICES).index(name) if name in CHOICES else len(CHOICES), key)


def layer_benchmark(checkpoint: Path, jobs_list: list[int], note: str, repeats: int = 2) -> dict:
    """onnxruntime's k-quant against the builder's (each kernel, each thread count, best of `repeats`) on one
    full-width weight: times and byte identity; and the numba kernel's compile time."""
    import numpy as np
    import onnx
    import onnx_ir as ir
    from onnx import helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import KQuantWeightOnlyQuantConfig, MatMulNBitsQuantizer
    from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

    from builder_plugin.checkpoint.reader import CheckpointReader
    from builder_plugin.config import Phi4MMConfig
    from builder_plugin.quant import k_quant
    from builder_plugin.quant.kernels import QuantScheme
    from builder_plugin.quant.weights import QuantizedWeight, QuantStats

    if k_quant.KERNEL != "numba":
        raise SystemExit("numba is not importable: the layer benchmark compares its kernel with numpy's")

    config = Phi4MMConfig.from_dir(checkpoint)
    weight = np.ascontiguousarray(
        CheckpointReader(checkpoint, config.source_format)[LAYER_WEIGHT].load().numpy().T)  # [K, N], as MatMul's B
    k, n = weight.shape
    results: dict = {"weight": LAYER_WEIGHT, "shape": [k, n], "commit": _commit(), "note": note,
                     "load_average_before": os.getloadavg()[0], "repeats": repeats, "bits": {},
                     "numba_first_call": _numba_first_call()}
    for bits in (4, 8):
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"], name="w/MatMul")], "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", k])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", n])],
            [numpy_helper.from_array(weight, "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        started, cpu = time.perf_counter(), _cpu_seconds()
        quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=32, is_symmetric=True, accuracy_level=4,
                                         algo_config=KQuantWeightOnlyQuantConfig(
                                             customized_weight_config={"w/MatMul": {"bits": bits}}))
        quantizer.process()
        quantizer_s, quantizer_cpu_s = time.perf_counter() - started, _cpu_seconds() - cpu
        reference = {t.name: numpy_helper.to_array(t) for t in quantizer.model.model.graph.initializer}
        started, cpu = time.perf_counter(), _cpu_seconds()
        quant_tensor_k_quant_cpu(weight.T, bits, 32)
        routine_s, routine_cpu_s = time.perf_counter() - started, _cpu_seconds() - cpu
        entry = {"onnxruntime_quantizer_s": quantizer_s, "onnxruntime_quantizer_cpu_s": quantizer_cpu_s,
                 "onnxruntime_routine_s": routine_s, "onnxruntime_routine_cpu_s": routine_cpu_s, "ours": {}}
        scheme = QuantScheme(bits, 32, True, "k_quant")
        for kernel in KERNELS:
            entry["ours"][kernel] = {}
            for jobs in jobs_list:
                runs = []
                for _ in range(repeats):
                    quantized = QuantizedWeight(ir.tensor(weight, name="w"), scheme, QuantStats(jobs))
                    k_quant.KERNEL, default = kernel, k_quant.KERNEL
                    try:
                        started, cpu = time.perf_counter(), _cpu_seconds()
                        pieces = {name: quantized.piece(piece) for piece, name in scheme.names("w").items()}
                        seconds, cpu_seconds = time.perf_counter() - started, _cpu_seconds() - cpu
                    finally:
                        k_quant.KERNEL = default
                    identical = sorted(pieces) == sorted(reference) and all(
                        pieces[name].dtype == reference[name].dtype and pieces[name].shape == reference[name].shape
                        and pieces[name].tobytes() == reference[name].tobytes() for name in pieces)
                    runs.append({"seconds": seconds, "cpu_s": cpu_seconds, "byte_identical": identical})
                    print(f"k-quant {bits} bits, {kernel} kernel, {jobs} jobs: {seconds:.2f} s ({cpu_seconds:.2f} s "
                          f"CPU; onnxruntime's routine {routine_s:.1f} s), identical: {identical}", file=sys.stderr,
                          flush=True)
                    if not identical:
                        raise SystemExit(f"{bits}-bit k-quant, {kernel} kernel, {jobs} jobs, differs from "
                                         "onnxruntime's quantizer")
                best = min(runs, key=lambda run: run["seconds"])
                entry["ours"][kernel][str(jobs)] = {**best, "runs_s": [run["seconds"] for run in runs]}
        results["bits"][str(bits)] = entry
    results["load_average_after"] = os.getloadavg()[0]
    return results


def _numba_first_call() -> dict:
    """The numba kernel's first call in a fresh process: compiling it (an empty numba cache), then loading it from the
    cache that compile wrote, each the time of a 1000-block 4-bit chunk beside the process's startup and imports."""
    import tempfile

    code = ("import time; import numpy as np; from builder_plugin.quant import k_quant; "
            "x = np.random.default_rng(0).standard_normal((1000, 32)).astype(np.float32); "
            "started = time.perf_counter(); k_quant.k_quant_chunk(x, 4); print(time.perf_counter() - started)")
    times = {}
    with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
        for name in ("compile_s", "cached_s"):
            child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                   env={**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": cache})
            times[name] = float(child.stdout.strip().splitlines()[-1])
    return times


def _cpu_seconds() -> float:
    """CPU time of this process, all threads (on a loaded machine wall time says more about the neighbours)."""
    times = os.times()
    return times.user + times.system


def layer_report(results: dict) -> str:
    k, n = results["shape"]
    rows = []
    for bits, entry in results["bits"].items():
        routine = entry["onnxruntime_routine_s"]
        rows.append(f"| {bits} | onnxruntime's `MatMulNBitsQuantizer` | 1 | "
                    f"{fmt(entry['onnxruntime_quantizer_s'], 1)} s ({_cpu(entry, 'onnxruntime_quantizer_cpu_s')}) | "
                    "- | - | reference |")
        rows.append(f"| {bits} | onnxruntime's `quant_tensor_k_quant_cpu` alone | 1 | {fmt(routine, 1)} s "
                    f"({_cpu(entry, 'onnxruntime_routine_cpu_s')}) | 1.0x | - | - |")
        for kernel, by_jobs in entry["ours"].items():
            for jobs, ours in by_jobs.items():
                numpy_s = entry["ours"].get("numpy", {}).get(jobs, {}).get("seconds")
                rows.append(f"| {bits} | builder, {KERNELS[kernel]} | {jobs} | **{fmt(ours['seconds'], 2)} s** "
                            f"({_cpu(ours, 'cpu_s')}) | {fmt(routine / ours['seconds'], 1)}x | "
                            f"{fmt(numpy_s / ours['seconds'], 1) + 'x' if numpy_s else '-'} | "
                            f"{'yes' if ours['byte_identical'] else 'NO'} |")
    first = results.get("numba_first_call", {})
    return "\n".join([
        f"Command: `{results['command']}` (commit {results['commit']}; load average "
        f"{fmt(results['load_average_before'], 1)} before, {fmt(results['load_average_after'], 1)} after: "
        f"{results['note'] or 'see the machine notes'})", "",
        machine_markdown(results["machine"]), "",
        f"`{results['weight']}` of the full-size checkpoint, [{k}, {n}] as the MatMul reads it ({k * n / 1e6:.1f} M "
        "values), block 32, symmetric flag as the builder passes it (k-quant always has zero points). onnxruntime: "
        "its `MatMulNBitsQuantizer` with `KQuantWeightOnlyQuantConfig` on a one-MatMul model (whose initializers are "
        "the reference), and its routine `quant_tensor_k_quant_cpu` alone on the same weight (one thread: numpy). "
        "The builder: its whole quantizer (search, packing, scales, zero points) at that many threads (`--jobs`), with "
        f"each k-quant kernel, best of {results.get('repeats', 1)} runs; byte-identical = packed weights, scales and "
        "zero points equal the reference's byte for byte.", "",
        "| bits | quantizer | jobs | wall (CPU) | speed-up vs routine | vs numpy kernel | byte-identical |",
        "|---:|---|---:|---:|---:|---:|---|",
        *rows, "",
        f"The numba kernel's first call in a fresh process (a 1000-block chunk): {fmt(first.get('compile_s'), 1)} s "
        f"with an empty numba cache (compiling), {fmt(first.get('cached_s'), 2)} s once the cache holds it.", ""])


def _cpu(entry: dict, key: str) -> str:
    return f"{fmt(entry[key], 1)} s CPU" if key in entry else "CPU not recorded"


if __name__ == "__main__":
    sys.exit(main())
