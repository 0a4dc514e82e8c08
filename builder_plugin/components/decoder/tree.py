"""The light module tree the GenAI builder walks instead of a loaded transformers model.

Its class and attribute names are the ones the builder's walk looks for; projections are `LazyLinear` placeholders, so
no weight is read until the model is saved.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.components.decoder.variants import DecoderVariant
from builder_plugin.components.decoder.weights import LoraBranch, RowRange
from builder_plugin.config import Phi4MMConfig
from builder_plugin.errors import CheckpointError


class LazyLinear:
    """A projection whose weight stays in the checkpoint: rows of a [out, in] tensor, plus LoRA branches.

    Not an nn.Module: the builder assigns q/k/v and gate/up slices onto the attention and MLP modules while it walks
    the tree, and plain attributes keep that walk unchanged. `weight` is a meta tensor for the builder's shape and
    dtype checks; `bias` is None (Phi-4-multimodal has no projection biases).
    """

    bias = None

    def __init__(self, rows: RowRange, loras: tuple[LoraBranch, ...] = (), merged: LoraBranch | None = None) -> None:
        self.rows = rows
        self.loras = loras
        self.merged = merged

    @property
    def in_features(self) -> int:
        return self.rows.ref.shape[1]

    @property
    def out_features(self) -> int:
        return self.rows.count

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty((self.out_features, self.in_features), device="meta")

    def slice(self, start: int, stop: int) -> LazyLinear:
        def sub(branch: LoraBranch | None) -> LoraBranch | None:
            if branch is None:
                return None
            return LoraBranch(branch.adapter, branch.a, branch.b.sub(start, stop), branch.scaling, branch.a_owner)

        return LazyLinear(self.rows.sub(start, stop), tuple(sub(b) for b in self.loras), sub(self.merged))

    @staticmethod
    def join(parts: tuple[LazyLinear, ...]) -> LazyLinear | None:
        """The projection the consecutive slices `parts` were cut from, or None if they are not such slices."""
        for left, right in itertools.pairwise(parts):
            if (left.rows.ref != right.rows.ref or left.rows.stop != right.rows.start
                    or len(left.loras) != len(right.loras) or (left.merged is None) != (right.merged is None)):
                return None

        def span(branches: list[LoraBranch]) -> LoraBranch:
            first, last = branches[0], branches[-1]
            return LoraBranch(first.adapter, first.a, RowRange(first.b.ref, first.b.start, last.b.stop), first.scaling,
                              first.a_owner)

        loras = tuple(span([p.loras[i] for p in parts]) for i in range(len(parts[0].loras)))
        merged = span([p.merged for p in parts]) if parts[0].merged is not None else None
        return LazyLinear(RowRange(parts[0].rows.ref, parts[0].rows.start, parts[-1].rows.stop), loras, merged)


class RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


class TextAttention(torch.nn.Module):
    def __init__(self, qkv_proj: LazyLinear, o_proj: LazyLinear) -> None:
        super().__init__()
        self.qkv_proj = qkv_proj
        self.o_proj = o_proj


class TextMLP(torch.nn.Module):
    def __init__(self, gate_up_proj: LazyLinear, down_proj: LazyLinear) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj


class Phi4MMTextDecoderLayer(torch.nn.Module):  # the class name must end in "DecoderLayer" for the builder's walk
    def __init__(self, input_layernorm: RMSNorm, self_attn: TextAttention, post_attention_layernorm: RMSNorm,
                 mlp: TextMLP) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp


class TextModel(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, layers: list[Phi4MMTextDecoderLayer], norm: RMSNorm) -> None:
        super().__init__()
        # Never read (exclude_embeds), but its presence wires `inputs_embeds` into the first norm.
        self.embed_tokens = torch.nn.Embedding(vocab_size, hidden_size, device="meta")
        self.layers = torch.nn.ModuleList(layers)
        self.norm = norm


class LmHead(torch.nn.Module):
    """Found by identity (root.lm_head); not an nn.Linear, so no vocab-sized weight is ever allocated."""

    bias = None

    def __init__(self, projection: LazyLinear) -> None:
        super().__init__()
        self.projection = projection
        self.out_features = projection.out_features


class TextDecoderTree(torch.nn.Module):
    def __init__(self, model: TextModel, lm_head: LmHead) -> None:
        super().__init__()
        self.model = model
        self.lm_head = lm_head


def _ref(weights: Mapping[str, TensorRef], name: str) -> TensorRef:
    try:
        return weights[name]
    except KeyError:
        raise CheckpointError(f"decoder weight {name} is missing from the routed weights") from None


def make_tree(weights: Mapping[str, TensorRef], config: Phi4MMConfig, variant: DecoderVariant) -> TextDecoderTree:
    """A fresh tree for one variant: norms loaded (they are small), projections lazy."""
    text = config.text

    def projection(layer: int, target: str) -> LazyLinear:
        ref = _ref(weights, f"layers.{layer}.{target}.weight")
        rows = RowRange(ref, 0, ref.shape[0])
        owner = f"/model/layers.{layer}/{'attn' if target.startswith('self_attn') else 'mlp'}/{target.split('.')[-1]}"

        def branch(adapter: str) -> LoraBranch:
            a = _ref(weights, f"layers.{layer}.{target}.lora_A.{adapter}.weight")
            b = _ref(weights, f"layers.{layer}.{target}.lora_B.{adapter}.weight")
            if a.shape[1] != ref.shape[1] or b.shape != (ref.shape[0], a.shape[0]):
                raise CheckpointError(f"{adapter} LoRA of layers.{layer}.{target}: A {a.shape} / B {b.shape} do not "
                                      f"fit the weight {ref.shape}")
            return LoraBranch(adapter, a, RowRange(b, 0, b.shape[0]), config.loras[adapter].scaling, owner)

        merged = branch(variant.merged) if variant.merged else None
        return LazyLinear(rows, tuple(branch(a) for a in variant.adapters), merged)

    def norm(name: str) -> RMSNorm:
        return RMSNorm(_ref(weights, name).load(torch.float32))

    layers = [
        Phi4MMTextDecoderLayer(
            norm(f"layers.{i}.input_layernorm.weight"),
            TextAttention(projection(i, "self_attn.qkv_proj"), projection(i, "self_attn.o_proj")),
            norm(f"layers.{i}.post_attention_layernorm.weight"),
            TextMLP(projection(i, "mlp.gate_up_proj"), projection(i, "mlp.down_proj")),
        )
        for i in range(text.num_hidden_layers)
    ]
    head_ref = _ref(weights, "embed_tokens.weight" if text.tie_word_embeddings else "lm_head.weight")
    head = LmHead(LazyLinear(RowRange(head_ref, 0, head_ref.shape[0])))
    return TextDecoderTree(TextModel(text.vocab_size, text.hidden_size, layers, norm("norm.weight")), head)
