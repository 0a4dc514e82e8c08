"""One planned tensor and its numbers: the distribution each weight is drawn from, and the seeded random stream."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from builder_plugin.testing.make_checkpoint.outliers import Outliers, planting

BLOCK_ELEMENTS = 1 << 22  # random numbers are drawn in blocks of this many elements, whatever the tensor size
DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float32": (torch.float32, "F32")}

# Initialisation scales (see distribution).
LOGIT_STD = 3.0  # std of the logits over the vocabulary for a unit-RMS final hidden state
LORA_RELATIVE_DELTA = 0.3  # RMS of scaling * B @ A @ x relative to W @ x for unit-RMS inputs
# Decoder q/k/v weights are drawn this much wider than 1/sqrt(fan_in): sharper, position-dependent attention makes
# the next token depend on the context, not only on the last token, so greedy decoding does not settle on a
# repeated token (measured: 16 distinct tokens out of 16 for 9 seed/prompt pairs, against 2-12 without it).
ATTENTION_GAIN = 2.0
NORM_WEIGHT_NOISE = 0.05
BIAS_STD = 0.02

_TEXT_QKV = re.compile(r"model\.layers\.\d+\.self_attn\.qkv_proj\.weight")


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor: its key in each layout, shape, and the normal distribution it is drawn from."""

    original_name: str  # also the identity the random stream is seeded with
    native_name: str | None  # key in the native model shards; None for LoRA tensors
    adapter: str | None  # "vision" / "speech" for LoRA tensors
    peft_name: str | None  # key inside the native adapter_model.safetensors
    shape: tuple[int, ...]
    mean: float
    std: float
    log_normal: bool = False  # exp(mean + std * z): strictly positive
    outliers: Outliers | None = None  # planted outliers (outliers.py), or none

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def distribution(native_name: str, shape: tuple[int, ...], text_hidden: int) -> tuple[float, float, bool]:
    """(mean, std, log_normal) chosen so activations stay O(1) and every tensor has a visible effect."""
    leaf = native_name.rsplit(".", 1)[-1]
    module = native_name.rsplit(".", 2)[-2] if native_name.count(".") >= 1 else ""
    if native_name == "model.embed_tokens.weight":
        return 0.0, LOGIT_STD / math.sqrt(text_hidden), False  # tied: logits = norm(h) @ E.T
    if leaf == "global_invstd":
        return 0.0, 0.1, True
    if leaf == "global_mean":
        return 0.0, 0.5, False  # small next to log-mel values (about 5..30), but a missing subtraction shows
    if native_name.endswith("relative_attention_bias_layer.bias_values.weight"):
        return 0.0, 0.1, False
    if leaf in ("global_img_feature_extensor", "sub_img_feature_extensor", "probe"):
        return 0.0, 0.5, False
    if native_name.endswith("position_embedding.weight"):
        return 0.0, 0.2, False
    if leaf in ("b1", "b2"):
        return 0.0, BIAS_STD, False
    if len(shape) == 1:
        if "norm" in module and leaf == "weight":
            return 1.0, NORM_WEIGHT_NOISE, False
        return 0.0, BIAS_STD, False
    fan_in = math.prod(shape[1:])  # Linear [out, in]; Conv [out, in/groups, *kernel]
    gain = ATTENTION_GAIN if _TEXT_QKV.fullmatch(native_name) else 1.0
    return 0.0, gain / math.sqrt(fan_in), False


def tensor_blocks(seed: int, planned: PlannedTensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The tensor's values, flattened, in blocks of BLOCK_ELEMENTS; depends only on (seed, original name) and the
    planted outliers."""
    digest = hashlib.sha256(f"{seed}/{planned.original_name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    planted = planting(seed, planned.native_name, planned.shape, planned.std, planned.outliers) \
        if planned.outliers is not None else None
    remaining = planned.numel
    while remaining:
        count = min(remaining, BLOCK_ELEMENTS)
        block = torch.randn(count, generator=generator, dtype=torch.float32)
        block.mul_(planned.std).add_(planned.mean)
        if planned.log_normal:
            block.exp_()
        if planted is not None:
            planted.apply(block, planned.numel - remaining)
        yield block.to(dtype)
        remaining -= count


def generate_tensor(seed: int, planned: PlannedTensor, dtype: str = "bfloat16") -> torch.Tensor:
    """The whole tensor in memory (tests, small tensors)."""
    torch_dtype = DTYPES[dtype][0]
    return torch.cat(list(tensor_blocks(seed, planned, torch_dtype))).reshape(planned.shape)
