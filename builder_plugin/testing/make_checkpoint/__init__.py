"""Write a random Phi-4-multimodal checkpoint in the original Hugging Face layout or the transformers-native one.

    python -m builder_plugin.testing.make_checkpoint OUT [--preset tiny|full|tiny-outliers|full-outliers] [--seed N]
        [--format original|native] [--text-layers N] [--vision-layers N] [--audio-blocks N] [--shards N]
        [--dtype bfloat16|float32] [--overwrite]

The tensor list comes from transformers' native ``Phi4MultimodalForCausalLM`` built on the meta device, renamed to
the original ``phi4mm`` keys with one table (``NATIVE_TO_ORIGINAL``); a native name the table does not cover is an
error. Every tensor is drawn from a generator seeded by (seed, original tensor name) and written straight to its
safetensors shard in fixed-size blocks, so the full-size model never sits in memory and both formats carry the
same numbers for the same seed.

Modules, foundations first: presets (sizes), tensors (a planned tensor and its random numbers), tensor_plan (which
tensors, under which names), safetensors_writer, original_layout and native_layout (config.json, side files and the
folder of each layout), build (the atomic folder write) and cli.
"""

from builder_plugin.testing.make_checkpoint.build import BuildSummary, build_checkpoint, make_checkpoint
from builder_plugin.testing.make_checkpoint.cli import main
from builder_plugin.testing.make_checkpoint.native_layout import native_config
from builder_plugin.testing.make_checkpoint.original_layout import original_config
from builder_plugin.testing.make_checkpoint.presets import PRESETS
from builder_plugin.testing.make_checkpoint.safetensors_writer import split_shards
from builder_plugin.testing.make_checkpoint.tensor_plan import (
    NATIVE_TO_ORIGINAL,
    UncoveredTensorError,
    native_state_shapes,
    original_name,
    plan_tensors,
)
from builder_plugin.testing.make_checkpoint.tensors import PlannedTensor, generate_tensor, tensor_blocks

__all__ = [
    "NATIVE_TO_ORIGINAL",
    "PRESETS",
    "BuildSummary",
    "PlannedTensor",
    "UncoveredTensorError",
    "build_checkpoint",
    "generate_tensor",
    "main",
    "make_checkpoint",
    "native_config",
    "native_state_shapes",
    "original_config",
    "original_name",
    "plan_tensors",
    "split_shards",
    "tensor_blocks",
]
