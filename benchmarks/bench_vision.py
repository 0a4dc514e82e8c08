"""Vision graph CPU speed at full SigLIP width: ONNX Runtime (fp32) vs the PyTorch reference, same inputs, same run.

    python -m benchmarks.bench_vision [--vision-layers 4] [--repeats 3] [--threads N] [--checkpoint DIR]

A random full-size checkpoint is generated (real SigLIP-so400m and projection widths; 1 text layer, 1 conformer block
and --vision-layers SigLIP layers instead of 27, to keep the files small) unless --checkpoint points at one. Two
synthetic images go through onnxruntime-genai's real processor: 448x448 (1 sub-crop + the global view = 2 crops) and
896x896 (4 sub-crops + global = 5 crops).

What each side computes: the ONNX graph runs the layers that feed the features (feature layer -2, so
vision_layers - 1), the pooling, the HD assembly and the projection. The native PyTorch module (eager, fp32) runs all
vision_layers layers plus the post-layernorm and the pooling head it then discards; that is how the original model
works, so it is what the speed-up is measured against. The fused (LayerNormalization / Gelu / MultiHeadAttention)
and primitive-op graphs are timed side by side. Results go to benchmarks/results/vision.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from benchmarks.common import RESULTS_DIR, cpu_session, machine_info, time_in_turn, write_json
from builder_plugin.checkpoint.reader import CheckpointReader
from builder_plugin.checkpoint.routing import route_weights
from builder_plugin.components.vision import VISION_FILENAME, VisionBuilder
from builder_plugin.config import Phi4MMConfig
from builder_plugin.options import BuildOptions
from builder_plugin.reference.model import Reference
from builder_plugin.spec import Component
from builder_plugin.testing.make_checkpoint import make_checkpoint
from builder_plugin.testing.media import make_image
from tests.support.processor import processor_inputs

RESULTS = RESULTS_DIR / "vision.json"
GRAPH_INPUTS = ("pixel_values", "image_attention_mask", "image_sizes")
IMAGES = {"448x448": (448, 448), "896x896": (896, 896)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vision-layers", type=int, default=4, help="SigLIP layers (the real model has 27)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both ORT and torch (default: one per physical core the process may use)")
    parser.add_argument("--checkpoint", type=Path, help="existing (or to-be-created, kept) full-width checkpoint")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads is None:
        from builder_plugin.runtime.threads import default_threads

        args.threads = default_threads()
    torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    try:
        checkpoint = args.checkpoint or work / "checkpoint"
        if not (checkpoint / "config.json").is_file():
            start = time.perf_counter()
            make_checkpoint(checkpoint, preset="full", text_layers=1, vision_layers=args.vision_layers,
                            audio_blocks=1)
            print(f"checkpoint written in {time.perf_counter() - start:.1f} s: {checkpoint}")
        config = Phi4MMConfig.from_dir(checkpoint)
        weights = route_weights(CheckpointReader(checkpoint, config.source_format), config)[Component.VISION]
        options = BuildOptions(model_dir=checkpoint, output_dir=work, precision="fp32")

        sessions = {}
        for label, fused in (("onnx_fused", True), ("onnx_primitive_ops", False)):
            folder = work / label
            folder.mkdir()
            start = time.perf_counter()
            model = VisionBuilder(config, options, fused_ops=fused).build(weights)[VISION_FILENAME]
            ir.save(model, folder / VISION_FILENAME, external_data=VISION_FILENAME + ".data")
            print(f"{label}: built and saved in {time.perf_counter() - start:.1f} s")
            sessions[label] = cpu_session(folder / VISION_FILENAME, args.threads)
        reference = Reference.load(checkpoint)

        cases = {}
        for name, (width, height) in IMAGES.items():
            image = make_image(work / f"{name}.png", width, height, seed=1)
            inputs = processor_inputs(checkpoint, "<|user|><|image_1|>Describe.<|end|><|assistant|>", images=[image])
            feed = {key: inputs[key] for key in GRAPH_INPUTS}
            crops = int(inputs["pixel_values"].shape[1])
            runners: dict[str, Callable[[], np.ndarray]] = {
                label: (lambda s=session, f=feed: s.run(None, f)[0]) for label, session in sessions.items()
            }
            runners["torch_eager"] = lambda f=feed: reference.image_features(**f).numpy()
            times, outputs = time_in_turn(runners, args.repeats)
            median = {label: statistics.median(t) for label, t in times.items()}
            torch_out = outputs["torch_eager"]
            case = {
                "crops_incl_global": crops,
                "image_tokens": int(inputs["num_image_tokens"].sum()),
                "median_s": median,
                "all_s": times,
                "speedup_fused_vs_torch": median["torch_eager"] / median["onnx_fused"],
                "speedup_fused_vs_primitive_ops": median["onnx_primitive_ops"] / median["onnx_fused"],
                "max_abs_diff_fused_vs_torch": float(np.abs(outputs["onnx_fused"] - torch_out).max()),
                "max_abs_diff_fused_vs_primitive_ops": float(
                    np.abs(outputs["onnx_fused"] - outputs["onnx_primitive_ops"]).max()),
                "max_abs_torch_output": float(np.abs(torch_out).max()),
            }
            cases[name] = case
            print(f"{name} ({crops} crops, {case['image_tokens']} tokens): "
                  + ", ".join(f"{label} {1000 * t:.0f} ms" for label, t in median.items())
                  + f" | torch/fused {case['speedup_fused_vs_torch']:.2f}x,"
                  f" primitive/fused {case['speedup_fused_vs_primitive_ops']:.2f}x,"
                  f" max|fused - torch| {case['max_abs_diff_fused_vs_torch']:.2e}"
                  f" (output max {case['max_abs_torch_output']:.1f}),"
                  f" max|fused - primitive| {case['max_abs_diff_fused_vs_primitive_ops']:.2e}")

        result = {
            "benchmark": "vision graph, fp32, CPU",
            "vision": {
                "hidden_size": config.vision.hidden_size,
                "intermediate_size": config.vision.intermediate_size,
                "heads": config.vision.num_attention_heads,
                "layers_in_checkpoint": config.vision.num_hidden_layers,
                "layers_run_by_onnx": config.vision.num_layers_used,
                "layers_run_by_torch": config.vision.num_hidden_layers,
                "real_model_layers": 27,
            },
            "projection": [config.vision.hidden_size, config.text.hidden_size],
            "threads": args.threads,
            "repeats": args.repeats,
            "machine": machine_info(),
            "cases": cases,
        }
        write_json(args.out, result)
        print(f"results written to {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
