"""Run-time speed of built phi4mm packages on CPU: onnxruntime-genai fp32 and int4 against transformers' native
Phi4MultimodalForCausalLM in PyTorch (eager, fp32), same weights, same prompts, same number of tokens.

    python -m benchmarks.bench_runtime [--checkpoint DIR] [--text-layers 8] [--scaling-layers 2] [--rounds 3]
                                       [--full-depth-package DIR]
                                       [--new-tokens 16] [--repeats 3] [--budget 30] [--threads N]
                                       [--out benchmarks/results/runtime.json] [--doc docs/benchmarks.md]
    python -m benchmarks.bench_runtime --from-json benchmarks/results/runtime.json   # re-analyse, re-publish

Model: a FULL-WIDTH generated checkpoint (real Phi-4-multimodal widths and vocabulary, random weights) with
--text-layers decoder layers (the real model has 32), 4 SigLIP layers (27) and 4 conformer blocks (24), unless
--checkpoint is given. A second checkpoint that differs only in having --scaling-layers decoder layers splits the text
prompt's times into a fixed and a per-decoder-layer part (see "32-layer estimate"). Checkpoints and the fp32 and int4
CPU packages (``lora="split"``: one decoder file per input mode, each timed on its own) are built once into --work
and reused while their recipe and the builder's sources are unchanged (``--keep-packages``: whatever the sources);
building is not part of the measured run (``--setup-only`` does just that part).

Prompts (through onnxruntime-genai's real MultiModalProcessor; the PyTorch side gets the processor's tensors):
``text`` (~100 tokens, base decoder), ``image-1crop`` (448x448: global view + 1 crop, vision-LoRA decoder),
``image-4crops`` (896x896: global + 4 crops) and ``audio-10s`` (10 s clip, speech-LoRA decoder). Greedy; the
end-of-sequence tokens are masked (``min_length``) so every run makes the requested number of tokens. Each engine
runs in its own subprocess (its own memory and peak RSS); each decoder variant gets an untimed warm-up on a short
text prompt after loading.

What is timed:
- prefill: processor tensors -> first new token (vision/speech encoders, embedding, decoder over the prompt, greedy
  pick); the processor itself (image/audio decoding, features) is kept separately in the JSON. Up to --repeats runs
  per prompt, fewer once the prompt's prefills took --budget seconds; best and median reported.
- decode: in the first run, each later ``generate_next_token`` (embedding + decoder step + pick) is timed on its own:
  tokens/s = 1 / median step ("median") and 1 / fastest step ("best"); the mean rate is in the JSON.
- PyTorch: ``Reference`` (builder_plugin.reference) with the input mode's LoRA merged into the weights (done
  before timing, like loading a decoder variant); prefill = image/audio features + embeddings + a KV-cached forward
  computing the last position's logits only; decode = one-token cached steps.
- encoders alone for --encoder-prompts: the vision / speech ONNX graph of the fp32 and the int4 package (plain
  onnxruntime sessions) and the PyTorch feature code, on the same processor tensors, run in turn in one process.

Memory-bandwidth bound for decode: bytes of the weights every decode step reads (initializers of every MatMul /
MatMulNBits of the decoder variant: all layers, LoRA branches, lm_head; int4 = packed weights + scales + zero points)
against the copy bandwidth of a ~1 GB numpy array (best of several, 1 and --threads threads) -> tokens/s bound.

32-layer estimate: time(L) = fixed + L x per_layer, solved from the text prompt at --text-layers and
--scaling-layers: from the fastest step and prefill at each depth ("best"), and from each depth's lowest per-round
median step and prefill ("median"; background load only adds time). The text prompt runs in --rounds rounds, each
engine at both depths back to back. A per-layer decode time that implies more than PLAUSIBLE_BANDWIDTH_FACTOR x the
read bandwidth is noise and not used. Every prompt's measured time then gets (32 - L) x per_layer added, scaled by its
prompt length (prefill) and by its decoder variant's per-layer weight bytes relative to the base decoder (LoRA
branches). The encoders are not scaled (see bench_vision.py / bench_speech.py). The bytes-per-step bound is
extrapolated from the graph: fixed bytes + 32 x the bytes of one layer.

--full-depth-package: the text prompt also runs on a package of the real depth (an int4 build of the `full`
checkpoint fits; PyTorch fp32 at 32 layers does not), measured against the estimate and the bandwidth bound.

Results: --out (JSON), a Markdown table on stdout and the "Machine" and "Run time" sections of --doc.

This file is the command line and the order of the runs (and the entry point of the build and measurement
subprocesses); the parts are in benchmarks/runtime_bench/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_report_options,
    git_state,
    machine_info,
    memcpy_bandwidth,
    read_bandwidth,
    results_out,
)
from benchmarks.runtime_bench import BACKENDS, PRECISIONS, PROMPT_NAMES, REAL_TEXT_LAYERS, VARIANT_FILES
from benchmarks.runtime_bench.decoder_graph import decode_weight_bytes, logits_positions
from benchmarks.runtime_bench.prepare import (
    Prompt,
    build_worker,
    builder_fingerprint,
    make_prompts,
    prepare_checkpoints,
    prepare_packages,
)
from benchmarks.runtime_bench.report import publish
from benchmarks.runtime_bench.workers import make_case, merge_runs, run_worker, worker_main
from builder_plugin.layout import GENAI_CONFIG_FILE

DEFAULT_WORK = Path("/tmp/bench_runtime")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="use this full-width checkpoint instead of generating one "
                        "(no 32-layer estimate unless --scaling-checkpoint is given too)")
    parser.add_argument("--scaling-checkpoint", type=Path, help="the same model with fewer decoder layers")
    parser.add_argument("--text-layers", type=int, default=8, help="decoder layers of the generated checkpoint")
    parser.add_argument("--scaling-layers", type=int, default=2,
                        help="decoder layers of the second generated checkpoint (0: no 32-layer estimate)")
    parser.add_argument("--prompts", default=",".join(PROMPT_NAMES))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--encoder-prompts", default="image-1crop,audio-10s",
                        help="prompts whose vision/speech graphs (fp32, int4) and PyTorch encoder are also timed "
                        "alone, in turn ('' = none)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the text prompt: every engine (and layer "
                        "count) once per round, so background load hits them alike")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="prefill runs per prompt (at most)")
    parser.add_argument("--budget", type=float, default=30.0,
                        help="no further prefill run of a prompt once its prefills took this many seconds")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of every session and of PyTorch (default: one per physical core the "
                        "process may use, what Chat and the server give the packages)")
    parser.add_argument("--full-depth-package", type=Path,
                        help="a CPU package built from a checkpoint with the real decoder depth (make_checkpoint "
                        "--preset full, then -p int4): the text prompt also runs on it, a direct check of the "
                        f"{REAL_TEXT_LAYERS}-layer estimate (PyTorch fp32 at full depth does not fit in 24 GB)")
    parser.add_argument("--setup-only", action="store_true", help="make the checkpoints and packages, then stop")
    parser.add_argument("--keep-packages", action="store_true",
                        help="reuse packages in --work even if the builder's code changed since they were built")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="checkpoints and packages (kept, reused)")
    add_report_options(parser, "runtime.json", note=False)
    args = parser.parse_args(argv)
    if args.threads is None:
        from builder_plugin.runtime.threads import default_threads

        args.threads = default_threads()
    if args.from_json:
        return publish(json.loads(args.from_json.read_text()), results_out(args), args.doc)
    command = " ".join(["python -m benchmarks.bench_runtime", *(sys.argv[1:] if argv is None else argv)])
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    prompt_names = [p for p in args.prompts.split(",") if p]
    backends = [b for b in args.backends.split(",") if b]
    unknown = [p for p in prompt_names if p not in PROMPT_NAMES] + [b for b in backends if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown prompt or backend: {', '.join(unknown)}")
    encoder_prompts = [p for p in args.encoder_prompts.split(",") if p in prompt_names]

    from builder_plugin.config import Phi4MMConfig

    setup_start = time.perf_counter()
    checkpoints = prepare_checkpoints(work, args.text_layers, args.scaling_layers, args.checkpoint,
                                      args.scaling_checkpoint)
    main_layers = max(checkpoints)
    scaling_layers = min(checkpoints) if len(checkpoints) > 1 else None
    fingerprint = None if args.keep_packages else builder_fingerprint()
    packages, builds = prepare_packages(work, checkpoints, fingerprint)
    setup_s = time.perf_counter() - setup_start
    if args.setup_only:
        print(f"setup done in {setup_s / 60:.1f} min: {work}")
        return 0

    config = Phi4MMConfig.from_dir(checkpoints[main_layers])
    prompts = make_prompts(work, checkpoints[main_layers], prompt_names)
    weights = {f"{precision}/{filename}": decode_weight_bytes(packages[main_layers, precision] / filename)
               for precision in PRECISIONS for filename in VARIANT_FILES.values()}
    logits_dims = {f"{precision}/{filename}": logits_positions(packages[main_layers, precision] / filename)
                   for precision in PRECISIONS for filename in VARIANT_FILES.values()}

    def probe_bandwidth(when: str) -> list[dict[str, Any]]:
        found = [dict(probe(threads=t).as_dict(), when=when)
                 for probe in (memcpy_bandwidth, read_bandwidth) for t in sorted({1, args.threads})]
        print(f"memory bandwidth ({when}): " + ", ".join(
            f"{p['kind']} {p['threads']} thread(s) best {p['best_gb_s']:.1f} / median {p['median_gb_s']:.1f} GB/s"
            for p in found), flush=True)
        return found

    probes = probe_bandwidth("start")

    def job(backend: str, layers: int, selected: list[Prompt], label: str) -> dict[str, Any]:
        label = f"{backend}-text{layers}-{label}"
        if backend == "torch-fp32":
            cases = [make_case(p, "", args.new_tokens, args.repeats, args.budget,
                               encoders=layers == main_layers and p.name in encoder_prompts)
                     for p in selected]
            encoder_packages = {f"ort-{precision}": str(packages[layers, precision]) for precision in PRECISIONS}
            for c in cases:
                c["encoder_packages"] = encoder_packages
            return {"backend": "torch", "label": label, "checkpoint": str(checkpoints[layers]),
                    "package": str(packages[layers, "fp32"]), "threads": args.threads, "cases": cases}
        precision = backend.split("-")[1]
        cases = [make_case(p, VARIANT_FILES[p.mode], args.new_tokens, args.repeats, args.budget) for p in selected]
        return {"backend": "ort", "label": label, "package": str(packages[layers, precision]),
                "threads": args.threads, "cases": cases}

    collected: dict[int, dict[str, dict[str, list[dict[str, Any]]]]] = {layers: {} for layers in checkpoints}

    def collect(layers: int, backend: str, result: dict[str, Any]) -> None:
        for name, value in result.items():
            collected[layers].setdefault(backend, {}).setdefault(name, []).append(value)

    measure_start = time.perf_counter()
    text = [p for p in prompts if p.name == "text"]
    media = [p for p in prompts if p.name != "text"]
    layer_counts = sorted(checkpoints, reverse=True)
    for index in range(args.rounds if text else 0):
        for backend in backends:  # the depths of one engine back to back: their difference is the per-layer part
            for layers in layer_counts:
                collect(layers, backend, run_worker(job(backend, layers, text, f"round{index + 1}"), work))
    for mode in dict.fromkeys(p.mode for p in media):  # per decoder variant, every engine in turn
        for backend in backends:
            group = [p for p in media if p.mode == mode]
            collect(main_layers, backend, run_worker(job(backend, main_layers, group, f"media-{mode}"), work))
    runs = {layers: {backend: {name: merge_runs(parts) for name, parts in by_prompt.items()}
                     for backend, by_prompt in by_backend.items()}
            for layers, by_backend in collected.items()}
    full_depth = measure_full_depth(args.full_depth_package, text, args, work) if args.full_depth_package else None
    measure_s = time.perf_counter() - measure_start
    # Background load only ever makes a probe slower, so the fastest one (start or end) is the machine's figure.
    probes += probe_bandwidth("end")
    bandwidth = {kind: max((p for p in probes if p["kind"] == kind), key=lambda p: p["best_gb_s"])
                 for kind in ("read", "copy")}
    bandwidth["probes"] = probes

    notes = []
    for prompt in prompt_names:
        ort_tokens = runs[main_layers].get("ort-fp32", {}).get(prompt, {}).get("tokens")
        torch_tokens = runs[main_layers].get("torch-fp32", {}).get(prompt, {}).get("tokens")
        if ort_tokens and torch_tokens:
            same = next((i for i, (a, b) in enumerate(zip(ort_tokens, torch_tokens)) if a != b), len(ort_tokens))
            notes.append(f"{prompt}: ORT fp32 and PyTorch agree on the first {same} of {len(ort_tokens)} greedy "
                         "tokens (random weights make near-ties common; a sanity check only)")
    result: dict[str, Any] = {
        "benchmark": "run time, onnxruntime-genai CPU (fp32, int4) vs PyTorch fp32 eager",
        "command": command,
        "machine": machine_info(),
        "setup": {
            "text_layers": main_layers, "scaling_layers": scaling_layers,
            "vision_layers": config.vision.num_hidden_layers, "audio_blocks": config.audio.num_blocks,
            "hidden_size": config.text.hidden_size, "intermediate_size": config.text.intermediate_size,
            "vocab_size": config.text.vocab_size, "threads": args.threads, "new_tokens": args.new_tokens,
            "repeats": args.repeats, "budget_s": args.budget, "rounds": args.rounds,
            "prompts": {p.name: {"mode": p.mode, "text": p.text, "images": list(p.images), "audios": list(p.audios)}
                        for p in prompts},
            "checkpoints": {str(k): str(v) for k, v in checkpoints.items()},
            "builds": builds, "setup_s": setup_s, "measure_s": measure_s, "builder_fingerprint": fingerprint,
            "logits_positions": logits_dims, "git": git_state(),
        },
        "bandwidth": bandwidth,
        "decoder_weight_bytes": weights,
        "runs": {str(k): v for k, v in runs.items()},
        "full_depth": full_depth,
        "notes": notes,
    }
    return publish(result, args.out, args.doc)


def measure_full_depth(package: Path, text: list[Prompt], args: argparse.Namespace, work: Path
                       ) -> dict[str, Any] | None:
    """The text prompt on a package of the real depth (one ORT worker, --rounds runs): measured, not extrapolated."""
    if not text:
        return None
    package = package.resolve()
    decoder = VARIANT_FILES["text"]
    config = json.loads((package / GENAI_CONFIG_FILE).read_text(encoding="utf-8"))
    graph = decode_weight_bytes(package / decoder)
    precision = "int4" if graph["quantized"] else "fp32"
    prompt = text[0]
    case = make_case(prompt, decoder, args.new_tokens, args.repeats, args.budget)
    parts = []
    for index in range(args.rounds):
        job = {"backend": "ort", "label": f"ort-{precision}-full-depth-round{index + 1}", "package": str(package),
               "threads": args.threads, "cases": [case]}
        parts.append(run_worker(job, work)[prompt.name])
    return {"package": str(package), "backend": f"ort-{precision}",
            "layers": int(config["model"]["decoder"]["num_hidden_layers"]), "weights": graph,
            "text": merge_runs(parts)}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        raise SystemExit(worker_main(sys.argv[2], sys.argv[3]))
    if len(sys.argv) > 1 and sys.argv[1] == "--build-worker":
        raise SystemExit(build_worker(*sys.argv[2:6]))
    raise SystemExit(main())
