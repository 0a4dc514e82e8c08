"""The parts of benchmarks.bench_runtime: prepare (checkpoints, packages, prompts), workers (the timed runs, one
subprocess per engine), decoder_graph (weight bytes read per decode step), analysis (bandwidth bound, 32-layer
estimate, targets) and report (Markdown, JSON, docs section).
"""

from __future__ import annotations

from builder_plugin.layout import SPLIT_DECODERS

# The CLI is also the entry point of the build and measurement subprocesses (--build-worker, --worker).
MODULE = "benchmarks.bench_runtime"
REAL_TEXT_LAYERS = 32
BACKENDS = ("ort-fp32", "ort-int4", "torch-fp32")
PROMPT_NAMES = ("text", "image-1crop", "image-4crops", "audio-10s")
PRECISIONS = ("fp32", "int4")
# Decoder files of a split package by input mode.
VARIANT_FILES = SPLIT_DECODERS
