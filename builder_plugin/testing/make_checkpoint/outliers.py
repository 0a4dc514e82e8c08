"""Planted outliers: what makes a random checkpoint look like a real one to an int8 or bf16 kernel.

Real Phi and LLaMA checkpoints carry "massive activations": a few hidden channels of the residual stream hundreds of
times larger than the rest, for a few tokens (the first and delimiter tokens), and a few channels tens of times larger
than the rest for every token at the inputs of the MatMuls (norm weights large in those channels); and a few weights
much larger than their neighbours. A random checkpoint has none of it, so a kernel quantizing activations with one
scale for many values looks fine on it and fails on a real one. With a preset's ``outliers`` set, the generator plants:

- ``model.embed_tokens.weight``: the rows of ``massive_tokens`` (chat delimiters every prompt holds) get
  +-``massive_scale`` in the massive channels (the generator keeps activations about 1 in size), which the residual
  stream then carries through every layer; the final norm's weight in those channels is divided by
  ``massive_scale`` so the logits stay about as they were (real models damp them late too). The LM head is tied to
  the embedding: those few tokens' logits move by about 1.
- every norm weight but the final one (text RMSNorms, SigLIP and conformer LayerNorms): the outlier channels times
  ``norm_scale``;
- the vision position embedding: positions 0 and the middle one get +-``massive_scale`` in the massive channels (the
  high-norm tokens of vision transformers);
- every 2-D weight of the base model: ``weight_outlier_rate`` of its values times ``weight_outlier_scale``.

Channels are fractions of each tensor's width, so one setting fits every preset. Positions are drawn from a generator
seeded by (seed, tensor name), like the values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from builder_plugin.testing.tokenizer import ROLE_TOKENS


@dataclass(frozen=True)
class Outliers:
    massive_fractions: tuple[float, ...] = (0.13, 0.62)
    outlier_fractions: tuple[float, ...] = (0.07, 0.41, 0.88)
    massive_tokens: tuple[int, ...] = (ROLE_TOKENS["<|user|>"], ROLE_TOKENS["<|end|>"], ROLE_TOKENS["<|system|>"])
    massive_scale: float = 1000.0
    norm_scale: float = 30.0
    weight_outlier_rate: float = 1e-4
    weight_outlier_scale: float = 20.0


@dataclass(frozen=True)
class Planting:
    """One tensor's planted values, by flat index: some set to a value, some multiplied by a factor."""

    set_at: torch.Tensor  # int64
    set_to: torch.Tensor  # float32
    scale_at: torch.Tensor  # int64
    scale_by: torch.Tensor  # float32

    def apply(self, block: torch.Tensor, offset: int) -> None:
        """Plant into `block`, the flat values [offset, offset + len(block)) of the tensor, in place."""
        end = offset + block.numel()
        inside = (self.scale_at >= offset) & (self.scale_at < end)
        block[self.scale_at[inside] - offset] *= self.scale_by[inside]
        inside = (self.set_at >= offset) & (self.set_at < end)
        block[self.set_at[inside] - offset] = self.set_to[inside]


FINAL_NORM = "model.norm.weight"
EMBEDDING = "model.embed_tokens.weight"
POSITION_EMBEDDING = "position_embedding.weight"


def channels(fractions: tuple[float, ...], width: int) -> list[int]:
    return sorted({min(width - 1, int(f * width)) for f in fractions})


def is_norm_weight(native_name: str, shape: tuple[int, ...]) -> bool:
    module, _, leaf = native_name.rpartition(".")
    return len(shape) == 1 and leaf == "weight" and "norm" in module.rpartition(".")[2]


def planting(seed: int, native_name: str | None, shape: tuple[int, ...], std: float,
             outliers: Outliers) -> Planting | None:
    """What `outliers` plants into one tensor of the base model (`native_name`; None: a LoRA tensor, left alone)."""
    if native_name is None:
        return None
    empty_i, empty_f = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
    width = shape[-1]
    massive = channels(outliers.massive_fractions, width)
    signs = [1.0 if i % 2 == 0 else -1.0 for i in range(len(massive))]
    if native_name == EMBEDDING or native_name.endswith(POSITION_EMBEDDING):
        rows = outliers.massive_tokens if native_name == EMBEDDING else (0, shape[0] // 2)
        at = [r * width + c for r in rows if r < shape[0] for c in massive]
        to = [s * outliers.massive_scale for r in rows if r < shape[0] for s in signs]
        return Planting(torch.tensor(at, dtype=torch.int64), torch.tensor(to, dtype=torch.float32), empty_i, empty_f)
    if native_name == FINAL_NORM:
        return Planting(empty_i, empty_f, torch.tensor(massive, dtype=torch.int64),
                        torch.full((len(massive),), 1.0 / outliers.massive_scale))
    if is_norm_weight(native_name, shape):
        at = channels(outliers.outlier_fractions, width)
        return Planting(empty_i, empty_f, torch.tensor(at, dtype=torch.int64),
                        torch.full((len(at),), outliers.norm_scale))
    if len(shape) == 2 and not native_name.endswith("bias_values.weight"):  # not the conformer's position bias
        numel = shape[0] * shape[1]
        count = max(1, round(numel * outliers.weight_outlier_rate))
        digest = hashlib.sha256(f"{seed}/{native_name}/outliers".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        at = torch.randint(numel, (count,), generator=generator)
        return Planting(empty_i, empty_f, at, torch.full((count,), outliers.weight_outlier_scale))
    return None
