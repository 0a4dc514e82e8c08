"""How far the int4 package's logits move from the fp32 package's, per input mode, at the prefill (the first generated
position: the prompt's rows through the decoder at once, the many-rows path of the MatMul kernel) and at the decode
steps (one row each): onnxruntime's own MatMulNBits (today's default), the project's kernel library, and that library
with its int8 path (or its bf16 path) for every row count, side by side.

    python -m benchmarks.prompt_quality --fp32 FP32_PKG --int4 INT4_PKG [--new-tokens 8] [--label NAME]
    python -m benchmarks.prompt_quality --from-json benchmarks/results/prompt_quality.json

Build both packages from one checkpoint, preferably one with the outliers of real checkpoints planted (a random one
has none, and hides what int8 activations cost on a real one):

    python -m builder_plugin.testing.make_checkpoint ckpt --preset full-outliers --text-layers 4 --vision-layers 4 \
        --audio-blocks 4
    python -m builder_plugin -i ckpt -o pkg-fp32 -p fp32 && python -m builder_plugin -i ckpt -o pkg-int4

Every configuration runs verify's built-in cases (builder_plugin.verify.prompts) in its own process: the fp32
package greedily, the others teacher-forced on the fp32 package's tokens, so every position compares the same
context. A fourth configuration isolates the kernels' arithmetic from the int4 weights' own error: the int4 package
with every MatMulNBits computing in float (accuracy_level 0, onnxruntime's kernel; a copy of the graphs, the weights
linked), against which each int4 configuration is also compared. Reported per mode: max |Δ logits| relative to the
reference's logit scale and mean KL(reference ‖ configuration) in nats, prefill and decode apart.
Results: benchmarks/results/prompt_quality.json and the "Prompt path quality" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import ROOT, add_report_options, fmt, markdown_table, measure_or_replay, per_machine_class
from builder_plugin.kernels import level as library_level

HEADING = per_machine_class("## Prompt path quality")
MODES = ("text", "image", "audio", "image+audio")
# name -> (package, environment): what each configuration changes
CONFIGS = {
    "fp32": ("fp32", {}),
    "int4, float compute": ("float", {"BUILDER_PLUGIN_KERNELS": "0"}),
    "int4, onnxruntime (today's default)": ("int4", {"BUILDER_PLUGIN_KERNELS": "0"}),
    "int4, library": ("int4", {}),
    "int4, library int8 only": ("int4", {"BUILDER_PLUGIN_OPS_PATH": "avx512"}),
    "int4, library bf16 only": ("int4", {"BUILDER_PLUGIN_OPS_PATH": "bf16"}),
}
REFERENCES = ("fp32", "int4, float compute")


def float_copy(package: Path, folder: Path) -> Path:
    """`package` with every MatMulNBits at accuracy_level 0 (float compute): the graphs rewritten, everything else
    linked (hard links: onnxruntime-genai resolves symbolic ones)."""
    import onnx

    folder.mkdir(parents=True)
    for item in package.iterdir():
        if item.suffix == ".onnx":
            model = onnx.load(str(item), load_external_data=False)
            for graph in _graphs(model.graph):
                for node in graph.node:
                    if node.op_type == "MatMulNBits":
                        for attribute in node.attribute:
                            if attribute.name == "accuracy_level":
                                attribute.i = 0
            onnx.save(model, str(folder / item.name))
        elif item.is_file():
            try:
                os.link(item, folder / item.name)
            except OSError:
                shutil.copy2(item, folder / item.name)
    return folder


def _graphs(graph: Any) -> list[Any]:
    found = [graph]
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.g is not None and attribute.g.node:
                found += _graphs(attribute.g)
    return found


def worker(package: str, media: str, new_tokens: int, forced: dict[str, list[int]] | None, out: str) -> None:
    """Every case on `package` (greedy, or teacher-forced on `forced` tokens), logits to `out` (npz), tokens on
    stdout."""
    import onnxruntime_genai as og

    from builder_plugin.layout import LOGITS
    from builder_plugin.runtime import Chat, og_audios, og_images
    from builder_plugin.verify.prompts import build_cases

    chat = Chat(package)
    logits, tokens = {}, {}
    for case in build_cases(MODES, Path(media)):
        model = chat.model(chat.variant_for(bool(case.images), bool(case.audios)))
        inputs = model.create_multimodal_processor()(case.prompt, images=og_images(case.images),
                                                     audios=og_audios(case.audios))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=int(inputs["input_ids"].as_numpy().shape[-1]) + new_tokens + 1,
                                  do_sample=False)
        generator = og.Generator(model, params)
        generator.set_inputs(inputs)
        generator.generate_next_token()  # the prefill: the prompt's rows at once
        steps = [np.array(generator.get_output(LOGITS), dtype=np.float32).reshape(-1)]
        chosen = [int(generator.get_next_tokens()[0])]
        if forced is not None:  # the reference's tokens from here on: drop the one chosen, append theirs
            generator.rewind_to(len(generator.get_sequence(0)) - 1)
            chosen = forced[case.name]
        for step in range(1, new_tokens):
            if forced is not None:
                generator.append_tokens(np.array([chosen[step - 1]], dtype=np.int32))
            else:
                generator.generate_next_token()
                chosen.append(int(generator.get_next_tokens()[0]))
            steps.append(np.array(generator.get_output(LOGITS), dtype=np.float32).reshape(-1))
        logits[case.name] = np.stack(steps)
        tokens[case.name] = chosen[:new_tokens]
        del generator
    np.savez(out, **logits)
    print(json.dumps(tokens))


def _run_config(name: str, package: Path, env: dict[str, str], media: Path, new_tokens: int,
                forced: dict[str, list[int]] | None, work: Path) -> tuple[dict[str, np.ndarray], dict[str, list[int]]]:
    out = work / f"{len(list(work.glob('*.npz')))}.npz"
    job = {"package": str(package), "media": str(media), "new_tokens": new_tokens, "forced": forced, "out": str(out)}
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-m", __spec__.name, "--worker", json.dumps(job)], capture_output=True,
                          text=True, env=environment)
    if done.returncode:
        raise SystemExit(f"{name} failed: {done.stderr.strip()[-1500:]}")
    print(f"{name}: done", file=sys.stderr, flush=True)
    with np.load(out) as data:
        return {key: data[key] for key in data.files}, json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    from builder_plugin.verify.metrics import compare

    packages = {"fp32": args.fp32, "int4": args.int4}
    with tempfile.TemporaryDirectory(prefix="prompt-quality-", dir=args.work) as folder:
        work = Path(folder)
        packages["float"] = float_copy(args.int4, work / "int4-float")
        (work / "media").mkdir()
        logits, tokens = {}, None
        for name, (package, env) in CONFIGS.items():
            logits[name], produced = _run_config(name, packages[package], env, work / "media", args.new_tokens,
                                                 tokens, work)
            tokens = tokens or produced
    comparisons = {}
    for reference in REFERENCES:
        for name in CONFIGS:
            if name == reference or name in REFERENCES[:REFERENCES.index(reference) + 1]:
                continue
            by_mode = {}
            for case, want in logits[reference].items():
                got = logits[name][case]  # top-1: the configuration's argmax is the reference's
                metrics = compare(case, case, "", 0, [int(t) for t in got.argmax(axis=-1)], got, want)
                decode = (metrics.mean_kl * metrics.positions - metrics.prefill_kl) / max(metrics.positions - 1, 1)
                by_mode[case] = {"prefill_relative": metrics.prefill_abs_diff / metrics.logit_scale,
                                 "prefill_kl": metrics.prefill_kl, "decode_relative": metrics.max_relative_diff,
                                 "decode_kl": decode, "top1": metrics.top1_agreement}
            comparisons[f"{name} vs {reference}"] = by_mode
    return {"fp32": str(args.fp32), "int4": str(args.int4), "new_tokens": args.new_tokens, "label": args.label,
            "library_level": library_level(), "comparisons": comparisons}


def report(results: dict[str, Any]) -> str:
    rows = []
    for pair, by_mode in results["comparisons"].items():
        for mode, m in by_mode.items():
            rows.append([pair, mode, fmt(m["prefill_relative"], 4), fmt(m["prefill_kl"], 4),
                         fmt(m["decode_relative"], 4), fmt(m["decode_kl"], 4), f"{100 * m['top1']:.0f} %"])
    return "\n".join([
        *([results["note"], ""] if results.get("note") else []),
        f"`{results['command']}` at {results['git']['commit'][:10]} ({results.get('label') or results['int4']}): "
        f"{results['new_tokens']} positions per case, the first from the prefill; relative = max |Δ logits| / the "
        "reference's largest |logit|; KL(reference ‖ configuration) in nats; decode = the positions after the first "
        "(relative over all positions); top-1 = the share of positions whose argmax is the reference's.", "",
        markdown_table(["configuration vs reference", "mode", "prefill relative", "prefill KL", "relative (all)",
                        "decode KL", "top-1"], rows), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp32", type=Path)
    parser.add_argument("--int4", type=Path)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--label", default=None)
    parser.add_argument("--work", default=None, help="folder for the float copy and the logits (default: temporary)")
    add_report_options(parser, "prompt_quality.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        worker(job["package"], job["media"], job["new_tokens"], job["forced"], job["out"])
        return 0
    if not args.from_json and (args.fp32 is None or args.int4 is None):
        parser.error("--fp32 and --int4 are required (or --from-json)")
    return measure_or_replay(args, argv, "prompt_quality.py", HEADING, run, report)


if __name__ == "__main__":
    sys.exit(main())
