"""The same full-size text decoder through llama.cpp, OpenVINO GenAI and this project's packages, taking turns: the
first token of a 512-token prompt (prefill rate) and the decode rate, each run set against numpy read probes taken
right before and after it.

    python -m benchmarks.bench_peers --package PKG [--package PKG ...] [--llama LLAMA_BENCH GGUF ...]
                                     [--openvino PYTHON OV_MODEL_DIR] [--rounds 3] [--new-tokens 64] [--note TEXT]
    python -m benchmarks.bench_peers --from-json benchmarks/results/peers.json      # redo the report

The peers need the checkpoint's text decoder in their formats (base weights, the LoRAs and encoders dropped): a GGUF
from llama.cpp's convert_hf_to_gguf.py and llama-quantize, an OpenVINO IR from optimum-cli; the note of a run says how
its files were made. Per engine and round, one fresh process:
- a package: Chat's text route (bench_prompt's text-512 prompt and worker: two questions, the second one's first
  token; decode = the answer's --new-tokens, greedy);
- llama.cpp: `llama-bench -p 512 -n NEW_TOKENS -r 1` (its own warm-up run first; the prompt is 512 tokens of one id
  and the decode starts from an empty cache);
- OpenVINO GenAI: an LLMPipeline (prefix caching off) given 512 token ids after a warm-up answer; its perf metrics'
  time to first token and time per output token, end of sequence ignored.
Threads: every engine gets the count the run time picks for a package (one per physical core the process may use).
Bytes per step: the package decoder's MatMul / MatMulNBits weights without LoRA (runtime_bench.decoder_graph); a
GGUF's tensors (tied embeddings: the output layer reads the whole table; read with the `gguf` package, pip install
gguf); the OpenVINO model's .bin file.
Results: benchmarks/results/peers.json and the "Peers on the same weights" section of docs/benchmarks.md (one per
machine class).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    ROOT,
    add_report_options,
    fmt,
    machine_markdown,
    markdown_table,
    measure_or_replay,
    per_machine_class,
)

PROMPT_TOKENS = 512
HEADING = per_machine_class("## Peers on the same weights")


def _threads() -> int:
    from builder_plugin.runtime.threads import default_threads

    return default_threads()


def _output(command: list[str], env: dict[str, str] | None = None) -> str:
    """What `command` printed; a failure stops the benchmark with the command's own words."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{Path(command[0]).name} failed: {done.stderr.strip()[-1500:]}")
    return done.stdout


def _last_line_json(command: list[str], env: dict[str, str]) -> Any:
    return json.loads(_output(command, env).strip().splitlines()[-1])


def run_package(package: str, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.bench_prompt import ask_in_process
    from builder_plugin.runtime.package import PREFILL_CHUNK

    found = ask_in_process(Path(package), "text-512", "library", PREFILL_CHUNK, Path(), 2, args.new_tokens)
    later = found["runs"][-1]
    return {"prefill_tok_s": later["prompt_tokens"] / later["ttft_s"], "decode_tok_s": later["decode_tokens_per_s"],
            "prompt_tokens": later["prompt_tokens"], "load_s": found["load_s"]}


def run_llama(binary: str, gguf: str, args: argparse.Namespace) -> dict[str, Any]:
    tests = json.loads(_output([binary, "-m", gguf, "-t", str(_threads()), "-r", "1", "-p", str(PROMPT_TOKENS),
                                "-n", str(args.new_tokens), "-o", "json"]))
    prompt = next(t for t in tests if t["n_prompt"] and not t["n_gen"])
    gen = next(t for t in tests if t["n_gen"] and not t["n_prompt"])
    return {"prefill_tok_s": prompt["avg_ts"], "decode_tok_s": gen["avg_ts"], "prompt_tokens": PROMPT_TOKENS,
            "build": f"{gen.get('model_type')}, llama.cpp build {gen.get('build_commit')}"}


def run_openvino(python: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    job = {"model": model, "threads": _threads(), "new_tokens": args.new_tokens}
    return _last_line_json([python, "-m", "benchmarks.bench_peers", "--openvino-worker", json.dumps(job)],
                           {**os.environ, "PYTHONPATH": str(ROOT)})


def openvino_worker(model: str, threads: int, new_tokens: int) -> dict[str, Any]:
    """Runs in OpenVINO's own environment (openvino, openvino_genai and numpy; nothing of this project)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    started = time.perf_counter()
    scheduler = ov_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False  # each answer prefills its whole prompt
    pipe = ov_genai.LLMPipeline(model, "CPU", scheduler_config=scheduler, INFERENCE_NUM_THREADS=threads)
    load_s = time.perf_counter() - started
    tokenizer = pipe.get_tokenizer()
    text = "The lighthouse keeper counted the ships that passed in the storm. " * PROMPT_TOKENS
    ids = np.asarray(tokenizer.encode(text).input_ids.data, dtype=np.int64)[:, :PROMPT_TOKENS]

    def answer(prompt: Any, tokens: int) -> Any:
        config = ov_genai.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = tokens
        config.ignore_eos, config.do_sample = True, False
        return pipe.generate(ov_genai.TokenizedInputs(ov.Tensor(prompt), ov.Tensor(np.ones_like(prompt))), config)

    answer(ids[:, :16].copy(), 4)
    metrics = answer(ids, new_tokens).perf_metrics
    ttft_s = metrics.get_ttft().mean / 1e3
    return {"prefill_tok_s": PROMPT_TOKENS / ttft_s, "decode_tok_s": 1e3 / metrics.get_tpot().mean,
            "prompt_tokens": PROMPT_TOKENS, "load_s": load_s,
            "build": f"openvino {ov.get_version()}, openvino_genai {ov_genai.__version__}, inference precision "
                     f"{ov.Core().get_property('CPU', 'INFERENCE_PRECISION_HINT')}"}


def _engines(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """name -> what runs it and the bytes it reads per decode step."""
    from benchmarks.runtime_bench.decoder_graph import decode_weight_bytes
    from builder_plugin.layout import GENAI_CONFIG_FILE

    engines = {}
    for package in args.package:
        config = json.loads((Path(package) / GENAI_CONFIG_FILE).read_text(encoding="utf-8"))
        graph = decode_weight_bytes(Path(package) / config["model"]["decoder"]["filename"])
        engines[f"builder_plugin {Path(package).name}"] = {
            "kind": "package", "target": [package], "bytes_per_step": graph["total_bytes"] - graph["lora_bytes"]}
    for binary, gguf in args.llama:
        engines[f"llama.cpp {Path(gguf).name} ({Path(binary).parent.parent.name})"] = {
            "kind": "llama", "target": [binary, gguf], "bytes_per_step": _gguf_tensor_bytes(gguf)}
    if args.openvino:
        python, model = args.openvino
        engines[f"OpenVINO {Path(model).name}"] = {
            "kind": "openvino", "target": [python, model],
            "bytes_per_step": sum(p.stat().st_size for p in Path(model).glob("openvino_model*.bin"))}
    return engines


def _gguf_tensor_bytes(path: str) -> int:
    """The bytes of a GGUF file's tensors."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise SystemExit("--llama needs the gguf package to read the model's tensors: pip install gguf") from None
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


RUNNERS = {"package": lambda target, args: run_package(target[0], args),
           "llama": lambda target, args: run_llama(target[0], target[1], args),
           "openvino": lambda target, args: run_openvino(target[0], target[1], args)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common import read_probe_gb_s
    from builder_plugin.kernels import level as library_level

    engines = _engines(args)
    names = list(engines)
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            engine = engines[name]
            before = read_probe_gb_s()
            found = RUNNERS[engine["kind"]](engine["target"], args)
            found.update(read_probe_gb_s=[before, read_probe_gb_s()], load_average=os.getloadavg()[0])
            engine.setdefault("runs", []).append(found)
            print(f"{name}: prefill {found['prefill_tok_s']:.1f} tok/s, decode {found['decode_tok_s']:.2f} tok/s, "
                  f"read probes {before:.1f}-{found['read_probe_gb_s'][1]:.1f} GB/s, load average "
                  f"{found['load_average']:.2f}", file=sys.stderr, flush=True)
    return {"library_level": library_level(), "rounds": args.rounds, "threads": _threads(),
            "new_tokens": args.new_tokens, "engines": engines}


def _best_median(values: list[float], digits: int) -> str:
    return f"{fmt(max(values), digits)} / {fmt(statistics.median(values), digits)}"


def report(results: dict[str, Any]) -> str:
    rows = []
    for name, engine in results["engines"].items():
        runs = engine["runs"]
        probes = [statistics.mean(r["read_probe_gb_s"]) for r in runs]
        read = [engine["bytes_per_step"] * r["decode_tok_s"] / 1e9 for r in runs]
        shares = [gb_s / probe for gb_s, probe in zip(read, probes, strict=True)]
        loads = [r["load_average"] for r in runs]
        rows.append([name, fmt(engine["bytes_per_step"] / 1e9, 2),
                     _best_median([r["prefill_tok_s"] for r in runs], 1),
                     _best_median([r["decode_tok_s"] for r in runs], 2), fmt(statistics.median(read), 1),
                     fmt(statistics.median(probes), 1), f"{statistics.median(shares) * 100:.0f} %",
                     f"{fmt(min(loads), 2)}-{fmt(max(loads), 2)}"])
    builds = sorted({f"{name}: {r['build']}" for name, e in results["engines"].items() for r in e["runs"][:1]
                     if r.get("build")})
    return "\n".join([
        *([results["note"], ""] if results.get("note") else []),
        f"`{results['command']}` at {results['git']['commit'][:10]}: {results['rounds']} round(s) taking turns (the "
        f"order reversed every other round), each engine in a fresh process, {results['threads']} threads, "
        f"{PROMPT_TOKENS}-token prompt, {results['new_tokens']} new tokens, greedy. Prefill = prompt tokens / time to "
        "the first token; weights read = bytes per step x decode tokens/s, against the mean of the numpy read probes "
        "taken right before and after the run (a 1 GB max() on every core). Rates best / median.", "",
        markdown_table(["engine", "bytes per step GB", "prefill tok/s", "decode tok/s", "weights read GB/s (median)",
                        "read probe GB/s (median)", "share of the probe", "load average"], rows), "",
        *[f"- {line}" for line in builds], *([""] if builds else []),
        machine_markdown(results["machine"]), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", action="append", default=[], help="a package folder (repeatable)")
    parser.add_argument("--llama", nargs=2, action="append", default=[], metavar=("LLAMA_BENCH", "GGUF"),
                        help="llama.cpp's llama-bench binary and a GGUF (repeatable)")
    parser.add_argument("--openvino", nargs=2, metavar=("PYTHON", "MODEL_DIR"),
                        help="a Python with openvino_genai and an exported OpenVINO model folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    add_report_options(parser, "peers.json")
    parser.add_argument("--openvino-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.openvino_worker:
        job = json.loads(args.openvino_worker)
        print(json.dumps(openvino_worker(job["model"], job["threads"], job["new_tokens"])))
        return 0
    if not args.from_json and not (args.package or args.llama or args.openvino):
        parser.error("give at least one engine (--package, --llama, --openvino) or --from-json")
    return measure_or_replay(args, argv, "bench_peers.py", HEADING, run, report)


if __name__ == "__main__":
    sys.exit(main())
