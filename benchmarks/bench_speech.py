"""Speech graph CPU speed at full conformer width: ONNX Runtime (fp32) vs the PyTorch reference, same clip, same run.

    python -m benchmarks.bench_speech [--seconds 10] [--audio-blocks 4] [--repeats 5] [--threads N] [--checkpoint DIR]

A random full-size checkpoint is generated (real Phi-4-multimodal audio and text widths; 1 text layer, 1 SigLIP layer
and --audio-blocks conformer blocks instead of 24, to keep the files small) unless --checkpoint points at one. The
clip is a synthetic wav run through onnxruntime-genai's real processor. Both sides compute the same thing: the
conformer encoder plus the speech projection, for one clip. The real-time factor (RTF) is latency / clip length.
Results go to benchmarks/results/speech.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from benchmarks.common import RESULTS_DIR, cpu_session, machine_info, time_in_turn, write_json
from builder_plugin.checkpoint.reader import CheckpointReader
from builder_plugin.checkpoint.routing import route_weights
from builder_plugin.components.speech import SPEECH_FILENAME, SpeechBuilder
from builder_plugin.config import Phi4MMConfig
from builder_plugin.options import BuildOptions
from builder_plugin.reference.model import Reference
from builder_plugin.spec import Component
from builder_plugin.testing.make_checkpoint import make_checkpoint
from builder_plugin.testing.media import make_wav
from tests.support.processor import processor_inputs

RESULTS = RESULTS_DIR / "speech.json"
SPEECH_MODE = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="clip length (default 10 s)")
    parser.add_argument("--audio-blocks", type=int, default=4, help="conformer blocks (the real model has 24)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both ORT and torch (default: one per physical core the process may use)")
    parser.add_argument("--checkpoint", type=Path, help="existing (or to-be-created, kept) full-width checkpoint")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads is None:
        from builder_plugin.runtime.threads import default_threads

        args.threads = default_threads()

    work = Path(tempfile.mkdtemp(prefix="bench-speech-"))
    try:
        checkpoint = args.checkpoint or work / "checkpoint"
        if not (checkpoint / "config.json").is_file():
            start = time.perf_counter()
            make_checkpoint(checkpoint, preset="full", text_layers=1, vision_layers=1, audio_blocks=args.audio_blocks)
            print(f"checkpoint written in {time.perf_counter() - start:.1f} s: {checkpoint}")
        config = Phi4MMConfig.from_dir(checkpoint)
        audio = config.audio

        wav = make_wav(work / "clip.wav", args.seconds, sample_rate=16000, seed=0)
        inputs = processor_inputs(checkpoint, "<|user|><|audio_1|>Transcribe.<|end|><|assistant|>", audios=[wav])
        feed = {name: inputs[name] for name in ("audio_embeds", "audio_attention_mask", "audio_sizes")}
        feed["audio_projection_mode"] = np.array([SPEECH_MODE], dtype=np.int64)

        start = time.perf_counter()
        weights = route_weights(CheckpointReader(checkpoint, config.source_format), config)[Component.SPEECH]
        options = BuildOptions(model_dir=checkpoint, output_dir=work, precision="fp32")
        model = SpeechBuilder(config, options).build(weights)[SPEECH_FILENAME]
        graph_path = work / SPEECH_FILENAME
        ir.save(model, graph_path, external_data=graph_path.name + ".data")
        build_seconds = time.perf_counter() - start

        start = time.perf_counter()
        session = cpu_session(graph_path, args.threads)
        session_seconds = time.perf_counter() - start

        torch.set_num_threads(args.threads)
        reference = Reference.load(checkpoint)
        times, outputs = time_in_turn(
            {
                "ort": lambda: session.run(["audio_features"], feed)[0],
                "torch": lambda: reference.audio_features(feed["audio_embeds"], feed["audio_attention_mask"],
                                                          feed["audio_sizes"], projection="speech"),
            },
            args.repeats,
        )
        ort_times, torch_times = times["ort"], times["torch"]
        ort_median, torch_median = statistics.median(ort_times), statistics.median(torch_times)
        ort_out, torch_out = outputs["ort"], outputs["torch"]
        max_abs_diff = float(np.abs(ort_out - torch_out.numpy()).max())

        result = {
            "clip_seconds": args.seconds,
            "frames": int(feed["audio_attention_mask"].sum()),
            "audio_tokens": int(feed["audio_sizes"].sum()),
            "config": {
                "attention_dim": audio.attention_dim, "attention_heads": audio.attention_heads,
                "linear_units": audio.linear_units, "nemo_conv_channels": audio.nemo_conv_channels,
                "num_blocks": audio.num_blocks, "num_blocks_real_model": 24,
                "text_hidden_size": config.text.hidden_size,
            },
            "threads": args.threads,
            "machine": machine_info(),
            "build_seconds": round(build_seconds, 3),
            "ort_session_seconds": round(session_seconds, 3),
            "ort_fp32_seconds": round(ort_median, 4),
            "torch_fp32_eager_seconds": round(torch_median, 4),
            "ort_rtf": round(ort_median / args.seconds, 4),
            "torch_rtf": round(torch_median / args.seconds, 4),
            "torch_over_ort": round(torch_median / ort_median, 3),
            "ort_fp32_min_seconds": round(min(ort_times), 4),
            "torch_fp32_eager_min_seconds": round(min(torch_times), 4),
            "torch_over_ort_min": round(min(torch_times) / min(ort_times), 3),
            "ort_times": [round(t, 4) for t in ort_times],
            "torch_times": [round(t, 4) for t in torch_times],
            "max_abs_diff_ort_vs_torch": max_abs_diff,
        }
        write_json(args.out, result)
        print(f"{args.seconds:g} s clip, {audio.num_blocks} of 24 conformer blocks at width {audio.attention_dim}, "
              f"{args.threads} threads")
        for label, med, best in (("ONNX Runtime fp32 ", ort_median, min(ort_times)),
                                 ("PyTorch eager fp32", torch_median, min(torch_times))):
            print(f"  {label}: median {med:.3f} s (RTF {med / args.seconds:.3f}), best {best:.3f} s "
                  f"(RTF {best / args.seconds:.3f})")
        print(f"  torch / ORT       : {torch_median / ort_median:.2f}x median, "
              f"{min(torch_times) / min(ort_times):.2f}x best;  max |ORT - torch| {max_abs_diff:.2e}")
        print(f"  1-min load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (other processes skew timings)")
        print(f"  written to {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
