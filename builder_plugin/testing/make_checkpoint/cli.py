"""python -m builder_plugin.testing.make_checkpoint: the command line of build_checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from builder_plugin.testing.make_checkpoint.build import build_checkpoint
from builder_plugin.testing.make_checkpoint.presets import PRESETS
from builder_plugin.testing.make_checkpoint.tensors import DTYPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m builder_plugin.testing.make_checkpoint",
        description="Write a random Phi-4-multimodal checkpoint (original phi4mm layout or transformers-native).",
    )
    parser.add_argument("out", type=Path, help="output folder (created atomically)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", dest="fmt", choices=("original", "native"), default="original")
    parser.add_argument("--text-layers", type=int, help="override the number of decoder layers")
    parser.add_argument("--vision-layers", type=int, help="override the number of SigLIP layers")
    parser.add_argument("--audio-blocks", type=int, help="override the number of conformer blocks")
    parser.add_argument("--shards", type=int, help="shard count (default: the preset's, else <= 1.5 GiB each)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    # The native config warns that longrope prefers 'factor' over original_max_position_embeddings: noise here.
    transformers_logging.set_verbosity_error()
    try:
        summary = build_checkpoint(
            args.out, args.preset, args.seed, args.fmt, args.text_layers, args.vision_layers, args.audio_blocks,
            args.shards, args.dtype, args.overwrite,
        )  # fmt: skip
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {summary.path} ({summary.fmt}, preset {summary.preset}, seed {summary.seed}): "
        f"{summary.num_tensors} tensors, {summary.total_bytes / 1e6:.1f} MB in {summary.num_shards} shard(s), "
        f"{summary.seconds:.1f} s"
    )
    return 0

