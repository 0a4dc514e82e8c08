"""Text decoder: onnxruntime-genai's own Phi-4-multimodal builder class, fed lazily from the routed weights.

The graph is made by a subclass of the GenAI builder's ``Phi4MMModel`` (``builders/phi.py``), so it has exactly the
runtime's expectations: GroupQueryAttention with the shared KV buffer and RoPE fused into attention (no
``position_ids``), LongRoPE via the builder's ``If`` on the attention-mask length (short factors up to
``original_max_position_embeddings``, long beyond), ``inputs_embeds`` instead of an embedding, and the tied lm_head.

What the subclass changes (genai-builder-internals.md §5, §8, §12):

- Weights: the builder walks a light module tree whose projections are `LazyLinear` placeholders. Every MatMul
  weight becomes a lazy initializer read from the checkpoint only when the model is saved, one tensor (or column slab)
  at a time, and never mutated (the stock LoRA path scales ``lora_B`` in place). The same initializer objects are
  shared by every variant of one build, so a writer that deduplicates stores the base weights once.
- LoRA: per input mode instead of "vision always on". Each adapter is an extra branch ``((x·A)·(s·B))`` added to the
  base MatMul, with one A MatMul per source projection (packed qkv stays one MatMul; gate and up share A). With
  ``merge_lora`` a single adapter is folded into the base weights in fp32 instead. The default ``routed`` decoder holds
  both adapters behind ``If`` nodes and picks one per conversation from the placeholder ids (`mode_routing`); ``split``
  writes one decoder file per input mode instead.
- int4/int8: the float graph is rewritten by `builder_plugin.quantize.quantize_matmuls` (lazy, streaming) with the
  per-node schemes of `builder_plugin.quant_plan.QuantPlan`, rather than the builder's whole-graph ``to_nbits``.
- The LongRoPE cos/sin caches, which the builder puts in ``If`` branches as Constant nodes inside ``model.onnx``, are
  hoisted to main-graph initializers so they go to external data and are shared between variants.
"""

from __future__ import annotations

import contextlib
import io
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.components.base import ComponentBuilder
from builder_plugin.components.mode_routing import (
    MODE_INPUT,
    ROUTED_ADAPTERS,
    ModeState,
    add_mode_state,
    route_lora_branches,
)
from builder_plugin.config import Phi4MMConfig
from builder_plugin.dtypes import DTYPES, onnx_dtype
from builder_plugin.errors import CheckpointError, DecoderBuildError
from builder_plugin.layout import INPUT_MODES, MAIN_DECODER, SPLIT_DECODERS
from builder_plugin.options import BuildOptions
from builder_plugin.quant_plan import QuantPlan
from builder_plugin.quantize import ColumnChunkedTensor, quantize_matmuls
from builder_plugin.spec import Component, IOSpec, TensorSpec, check_io

# The LoRA of each input mode's decoder in a split build, in the order they are built and written (the main decoder,
# the one genai_config.json names, first).
SPLIT_LORAS: dict[str, str] = {"vision": "vision", "speech": "speech", "text": "none"}
_ATTN_EPS_WITH_FUSED_ROPE = ("cpu", "cuda", "webgpu")  # dml runs RotaryEmbedding on position_ids instead


# --------------------------------------------------------------------------------------------------------------
# Variants and runtime settings


@dataclass(frozen=True)
class DecoderVariant:
    """One decoder graph: which adapters run as LoRA branches, or which one is merged into the base weights."""

    filename: str
    mode: str  # "routed" | "vision" | "speech" | "none" | "vision+speech"
    adapters: tuple[str, ...] = ()
    merged: str | None = None

    @property
    def self_routing(self) -> bool:
        """One graph for every input mode, choosing its adapter from the placeholder ids (`mode_routing`)."""
        return self.mode == "routed"


def decoder_variants(config: Phi4MMConfig, options: BuildOptions) -> tuple[DecoderVariant, ...]:
    """The decoder files `options.lora` / `options.merge_lora` ask for; the first is the one genai_config names."""
    lora = options.lora
    if options.merge_lora:
        if lora not in ("vision", "speech"):
            raise DecoderBuildError(
                f"merge_lora folds exactly one adapter into the base weights: use it with lora 'vision' or 'speech', "
                f"not {lora!r}"
            )
        _require_adapters(config, (lora,))
        return (DecoderVariant(MAIN_DECODER, lora, merged=lora),)
    if lora == "routed":
        _require_adapters(config, ROUTED_ADAPTERS)
        return (DecoderVariant(MAIN_DECODER, "routed", adapters=ROUTED_ADAPTERS),)
    if lora == "split":
        _require_adapters(config, ("vision", "speech"))
        return tuple(DecoderVariant(SPLIT_DECODERS[mode], lora, adapters=() if lora == "none" else (lora,))
                     for mode, lora in SPLIT_LORAS.items())
    if lora == "none":
        return (DecoderVariant(MAIN_DECODER, "none"),)
    adapters = tuple(lora.split("+"))
    if any(a not in ("vision", "speech") for a in adapters):
        raise DecoderBuildError(f"unknown lora choice {lora!r}")
    _require_adapters(config, adapters)
    return (DecoderVariant(MAIN_DECODER, lora, adapters=adapters),)


def _require_adapters(config: Phi4MMConfig, names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in config.loras]
    if missing:
        raise DecoderBuildError(
            f"the checkpoint has no {' / '.join(missing)} LoRA adapter (has: {sorted(config.loras) or 'none'}); "
            "use --lora none"
        )


@dataclass(frozen=True)
class DecoderRuntimeSettings:
    """What genai_config.json needs from the builder for the decoder section and the search options."""

    filename: str  # the decoder genai_config.json names
    variants: dict[str, str]  # input mode -> decoder file ("routed", "vision", "speech", "none", or the mode built)
    past_present_share_buffer: bool
    provider_options: tuple[dict[str, dict[str, str]], ...]
    context_length: int
    hidden_size: int
    head_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    io_dtype: str
    attention_op: str
    has_position_ids: bool

    def decoders_by_mode(self) -> tuple[str, dict[str, str]]:
        """How the decoder files answer the runtime's input modes: (routing, {mode: file}) for the manifest."""
        if set(self.variants) == {"vision", "speech", "none"}:
            return "split", dict(SPLIT_DECODERS)
        routing = "self" if set(self.variants) == {"routed"} else "fixed"
        return routing, dict.fromkeys(INPUT_MODES, self.filename)


# --------------------------------------------------------------------------------------------------------------
# Lazy weights


@dataclass(frozen=True)
class _Rows:
    """Rows [start, stop) of a 2-D checkpoint tensor [out, in]."""

    ref: TensorRef
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start

    def sub(self, start: int, stop: int) -> _Rows:
        if not 0 <= start <= stop <= self.count:
            raise ValueError(f"rows {start}:{stop} outside {self.count}")
        return _Rows(self.ref, self.start + start, self.start + stop)

    def load(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.count if stop is None else stop
        return self.ref.load_rows(self.start + start, self.start + stop)


@dataclass(frozen=True)
class LoraBranch:
    """One adapter on one projection: y += (x·Aᵀ)·(scaling·B[rows])ᵀ. `a_owner` names the source projection whose
    A MatMul this branch shares (packed qkv / gate_up keep one A for all their row slices)."""

    adapter: str
    a: TensorRef  # [r, in]
    b: _Rows  # [out rows, r]
    scaling: float
    a_owner: str


class WeightTensors:
    """Lazy initializers for MatMul weights, one object per distinct (source, transform, dtype) of a build.

    Every tensor is a `ColumnChunkedTensor` [in, out] (the MatMul B layout), so quantization can stream it in column
    slabs. Column c of a projection is row c of the checkpoint tensor, so a slab is read with a row slice.
    """

    SHARE_MAX_BYTES = 64 << 20  # builder-made initializers (norms, DML rope caches) up to this size are shared

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self._cache: dict[tuple[Any, ...], ColumnChunkedTensor] = {}
        self._small: dict[str, ir.TensorProtocol] = {}

    def share(self, tensor: ir.TensorProtocol) -> ir.TensorProtocol:
        """The first-seen object for an initializer the GenAI builder makes itself (norm weights), when an earlier
        variant made the same name with the same bytes; so every variant references one object per weight."""
        if tensor.nbytes > self.SHARE_MAX_BYTES or not tensor.name:
            return tensor
        seen = self._small.get(tensor.name)
        if (seen is not None and seen.dtype == tensor.dtype and tuple(seen.shape) == tuple(tensor.shape)
                and seen.tobytes() == tensor.tobytes()):
            return seen
        self._small.setdefault(tensor.name, tensor)
        return tensor

    def _tensor(self, key: tuple[Any, ...], name: str, shape: tuple[int, int],
                rows: Callable[[int, int], torch.Tensor], content: tuple | None = None) -> ColumnChunkedTensor:
        key = (*key, name)
        tensor = self._cache.get(key)
        if tensor is None:
            torch_dtype = DTYPES[self.dtype].torch

            def columns(c0: int, c1: int) -> np.ndarray:
                return rows(c0, c1).to(torch_dtype).T.contiguous().numpy()

            tensor = ColumnChunkedTensor(columns, onnx_dtype(self.dtype), shape, name, key=content)
            self._cache[key] = tensor
        return tensor

    def base(self, weight: _Rows, name: str) -> ColumnChunkedTensor:
        k = weight.ref.shape[1]
        return self._tensor(("base", weight), name, (k, weight.count), weight.load,
                            content=weight.ref.columns_key(weight.start, weight.stop, self.dtype))

    def merged(self, weight: _Rows, branch: LoraBranch, name: str) -> ColumnChunkedTensor:
        k = weight.ref.shape[1]

        def rows(c0: int, c1: int) -> torch.Tensor:
            # W + s·B@A in fp32 from the stored (bf16) tensors; never rounded back to the stored dtype.
            a = branch.a.load_rows(0, branch.a.shape[0])
            return weight.load(c0, c1) + branch.scaling * (branch.b.load(c0, c1) @ a)

        return self._tensor(("merged", weight, branch), name, (k, weight.count), rows)

    def lora_a(self, branch: LoraBranch, name: str) -> ColumnChunkedTensor:
        r, k = branch.a.shape
        return self._tensor(("lora_a", branch.a), name, (k, r), lambda c0, c1: branch.a.load_rows(c0, c1))

    def lora_b(self, branch: LoraBranch, name: str) -> ColumnChunkedTensor:
        r = branch.a.shape[0]
        # scaling is folded into a fresh copy of B at load time; the checkpoint tensor is never touched
        return self._tensor(("lora_b", branch.b, branch.scaling), name, (r, branch.b.count),
                            lambda c0, c1: branch.b.load(c0, c1) * branch.scaling)


# --------------------------------------------------------------------------------------------------------------
# The light module tree the GenAI builder walks (genai-builder-internals.md §12)


class LazyLinear:
    """A projection whose weight stays in the checkpoint: rows of a [out, in] tensor, plus LoRA branches.

    Not an nn.Module: the builder assigns q/k/v and gate/up slices onto the attention and MLP modules while it walks
    the tree, and plain attributes keep that walk unchanged. `weight` is a meta tensor for the builder's shape and
    dtype checks; `bias` is None (Phi-4-multimodal has no projection biases).
    """

    bias = None

    def __init__(self, rows: _Rows, loras: tuple[LoraBranch, ...] = (), merged: LoraBranch | None = None) -> None:
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
            return LoraBranch(first.adapter, first.a, _Rows(first.b.ref, first.b.start, last.b.stop), first.scaling,
                              first.a_owner)

        loras = tuple(span([p.loras[i] for p in parts]) for i in range(len(parts[0].loras)))
        merged = span([p.merged for p in parts]) if parts[0].merged is not None else None
        return LazyLinear(_Rows(parts[0].rows.ref, parts[0].rows.start, parts[-1].rows.stop), loras, merged)


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
        rows = _Rows(ref, 0, ref.shape[0])
        owner = f"/model/layers.{layer}/{'attn' if target.startswith('self_attn') else 'mlp'}/{target.split('.')[-1]}"

        def branch(adapter: str) -> LoraBranch:
            a = _ref(weights, f"layers.{layer}.{target}.lora_A.{adapter}.weight")
            b = _ref(weights, f"layers.{layer}.{target}.lora_B.{adapter}.weight")
            if a.shape[1] != ref.shape[1] or b.shape != (ref.shape[0], a.shape[0]):
                raise CheckpointError(f"{adapter} LoRA of layers.{layer}.{target}: A {a.shape} / B {b.shape} do not "
                                      f"fit the weight {ref.shape}")
            return LoraBranch(adapter, a, _Rows(b, 0, b.shape[0]), config.loras[adapter].scaling, owner)

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
    head = LmHead(LazyLinear(_Rows(head_ref, 0, head_ref.shape[0])))
    return TextDecoderTree(TextModel(text.vocab_size, text.hidden_size, layers, norm("norm.weight")), head)


# --------------------------------------------------------------------------------------------------------------
# The GenAI builder subclass


def genai_text_config(config: Phi4MMConfig) -> Any:
    """The transformers Phi3Config the GenAI builder reads, made from our parsed config (no AutoConfig, no hub)."""
    from transformers import Phi3Config
    from transformers.utils import logging as hf_logging

    text = config.text
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "type": "longrope",  # the builder's mscale policy reads the legacy key (internals doc §11)
        "rope_theta": text.rope_theta,
        "partial_rotary_factor": text.partial_rotary_factor,
        "short_factor": list(text.short_factor),
        "long_factor": list(text.long_factor),
        "original_max_position_embeddings": text.original_max_position_embeddings,
    }
    for key in ("short_mscale", "long_mscale"):
        if getattr(text, key) is not None:
            rope[key] = float(getattr(text, key))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # Phi3Config warns about original_max_position_embeddings vs factor
    try:
        cfg = Phi3Config(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_hidden_layers=text.num_hidden_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=text.num_key_value_heads,
            hidden_act=text.hidden_act,
            max_position_embeddings=text.max_position_embeddings,
            original_max_position_embeddings=text.original_max_position_embeddings,
            rms_norm_eps=text.rms_norm_eps,
            tie_word_embeddings=text.tie_word_embeddings,
            sliding_window=None,  # 262144 in the release: wider than the context, so no effect
            bos_token_id=config.bos_token_id,
            pad_token_id=config.pad_token_id,
            eos_token_id=list(config.eos_token_ids),
            rope_parameters=rope,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    cfg.head_dim = text.head_dim
    cfg.architectures = ["Phi4MMForCausalLM"]
    return cfg


@lru_cache(maxsize=1)
def genai_builder_class() -> type:
    """`Phi4MMModel` subclass; defined on first use because importing the GenAI builder takes seconds."""
    import onnxruntime_genai.models.builder  # noqa: F401  - must come first (internals doc §1)
    from builders.base import Model
    from builders.phi import Phi4MMModel

    class Phi4MMTextBuilder(Phi4MMModel):
        def __init__(self, config: Any, io_dtype: ir.DataType, onnx_dtype: ir.DataType, ep: str, cache_dir: str,
                     extra_options: dict[str, Any], tree: TextDecoderTree | None = None,
                     tensors: WeightTensors | None = None) -> None:
            self.tree = tree
            self.tensors = tensors  # set first: the base __init__ already makes initializers (DML rope caches)
            self._lora_a_outputs: dict[tuple[str, str, str], str] = {}
            super().__init__(config, io_dtype, onnx_dtype, ep, cache_dir, extra_options)
            # Phi4MMModel turns on the stock LoRA path and unpacked q/k/v; LoRA here is our own branches.
            self.matmul_attrs["use_lora"] = False
            if self.attention_attrs["op_type"] == "GroupQueryAttention":
                self.attention_attrs["use_packed_matmul"] = self.is_packed_matmul_supported()

        def load_weights(self, input_path: str) -> TextDecoderTree:
            if self.tree is None:
                raise DecoderBuildError("no module tree given to the decoder builder")
            return self.tree

        def make_layer(self, layer_id: int, layer: Any) -> None:
            Model.make_layer(self, layer_id, layer)  # skip Phi4MMModel's "vision adapter as default" aliasing

        def make_attention_unpacked(self, layer_id: int, attention: Any, root_input: str, **kwargs: Any) -> None:
            qkv = getattr(attention, "qkv_proj", None)
            if not isinstance(qkv, LazyLinear):
                return super().make_attention_unpacked(layer_id, attention, root_input, **kwargs)
            q, kv = self.q_size, self.kv_size
            attention.q_proj = qkv.slice(0, q)
            attention.k_proj = qkv.slice(q, q + kv)
            attention.v_proj = qkv.slice(q + kv, q + 2 * kv)
            return None

        def make_mlp_unpacked(self, layer_id: int, mlp: Any, root_input: str) -> None:
            gate_up = getattr(mlp, "gate_up_proj", None)
            if not isinstance(gate_up, LazyLinear):
                return super().make_mlp_unpacked(layer_id, mlp, root_input)
            inter = self.intermediate_size
            mlp.gate_proj = gate_up.slice(0, inter)
            mlp.up_proj = gate_up.slice(inter, 2 * inter)
            return None

        def make_packed_matmul(self, q_matmul: Any, k_matmul: Any, v_matmul: Any, basename: str, root_input: str,
                               **kwargs: Any) -> str:
            parts = (q_matmul, k_matmul, v_matmul)
            if all(isinstance(p, LazyLinear) for p in parts):
                joined = LazyLinear.join(parts)
                if joined is not None:
                    return self.make_matmul(joined, basename, root_input, **kwargs)
            return super().make_packed_matmul(q_matmul, k_matmul, v_matmul, basename, root_input, **kwargs)

        def make_matmul(self, matmul: Any, basename: str, root_input: str, **kwargs: Any) -> str:
            projection = matmul.projection if isinstance(matmul, LmHead) else matmul
            if not isinstance(projection, LazyLinear):
                return super().make_matmul(matmul, basename, root_input, **kwargs)
            return self._make_lazy_matmul(projection, basename, root_input, **kwargs)

        def make_initializer(self, tensor: Any, /, name: str, **kwargs: Any) -> None:
            super().make_initializer(tensor, name, **kwargs)
            if self.tensors is not None:
                value = self.model.graph.initializers[name]
                value.const_value = self.tensors.share(value.const_value)

        # -- our MatMul + LoRA emission -------------------------------------------------------------------------

        def _initializer(self, tensor: ir.TensorProtocol) -> str:
            value = self.make_value(tensor.name, tensor.dtype, tuple(tensor.shape))
            value.const_value = tensor
            self.model.graph.register_initializer(value)
            return tensor.name

        def _matmul_node(self, name: str, root_input: str, weight: ir.TensorProtocol, output: str,
                         seq_dim: Any) -> None:
            self.make_node("MatMul", inputs=[root_input, self._initializer(weight)], outputs=[output], name=name)
            self.make_value(output, self.io_dtype,
                            shape=self.make_hidden_state_shape(seq_dim=seq_dim, last_dim=int(weight.shape[1])))

        def _make_lazy_matmul(self, proj: LazyLinear, basename: str, root_input: str, **kwargs: Any) -> str:
            seq_dim = kwargs.get("seq_dim", "sequence_length")
            weight_name = basename[1:].replace("/", ".") + ".weight"
            if proj.merged is not None:
                weight = self.tensors.merged(proj.rows, proj.merged, weight_name)
            else:
                weight = self.tensors.base(proj.rows, weight_name)
            output = "logits" if kwargs.get("logits", False) and not proj.loras else f"{basename}/output_0"
            self._matmul_node(basename, root_input, weight, output, seq_dim)
            result = basename
            prefix = basename.rsplit("/", 1)[0]
            for branch in proj.loras:
                a_out = self._lora_a(branch, root_input, seq_dim)
                b_name = f"{prefix}/lora_B.{branch.adapter}/MatMul"
                b_weight = self.tensors.lora_b(branch, b_name[1:].replace("/", ".") + ".weight")
                self._matmul_node(b_name, a_out, b_weight, f"{b_name}/output_0", seq_dim)
                add_name = f"{prefix}/lora.{branch.adapter}/Add"
                self.make_add(add_name, [f"{result}/output_0", f"{b_name}/output_0"], dtype=self.io_dtype,
                              shape=self.make_hidden_state_shape(seq_dim=seq_dim, last_dim=proj.out_features))
                result = add_name
            return result

        def _lora_a(self, branch: LoraBranch, root_input: str, seq_dim: Any) -> str:
            key = (branch.a_owner, branch.adapter, root_input)
            if key not in self._lora_a_outputs:
                name = f"{branch.a_owner}/lora_A.{branch.adapter}/MatMul"
                weight = self.tensors.lora_a(branch, name[1:].replace("/", ".") + ".weight")
                self._matmul_node(name, root_input, weight, f"{name}/output_0", seq_dim)
                self._lora_a_outputs[key] = f"{name}/output_0"
            return self._lora_a_outputs[key]

    return Phi4MMTextBuilder


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The GenAI builder prints progress for every layer; keep it off the CLI's output."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


# Set by the plugin: the graph takes inputs_embeds, is written under our file name, and computes the lm_head for the
# last position only (all that generation reads; full-prompt logits made prefill ~6x slower at full width).
_FIXED_BUILDER_OPTIONS = {"exclude_embeds": True, "prune_lm_head": True}


def _builder_extra_options(options: BuildOptions, filename: str) -> dict[str, Any]:
    """The GenAI builder's extra options. Every accepted --extra_options key is a quantization option, which
    `QuantPlan` applies to the float graph the builder makes, so none is passed on (extra_options.EXTRA_OPTIONS)."""
    return {**_FIXED_BUILDER_OPTIONS, "filename": filename}


def _check_precision(options: BuildOptions) -> None:
    if options.precision == "fp16" and options.execution_provider == "cpu":
        raise DecoderBuildError(
            "fp16 decoders are for GPU execution providers (cuda, dml, webgpu): onnxruntime's CPU GroupQueryAttention "
            "has no fp16 kernel; use -p fp32 or -p int4 for cpu"
        )


def _hoist_rope_caches(model: ir.Model, shared: dict[str, ir.TensorProtocol]) -> None:
    """Move the LongRoPE caches out of the If-branch Constant nodes into main-graph initializers.

    Initializers go to external data (deduplicated across variants) instead of bloating each .onnx file; each branch
    keeps an Identity of its outer-scope cache, so the If and the runtime behaviour are unchanged.
    """
    graph = model.graph
    for node in list(graph):
        if node.op_type != "If":
            continue
        for attr_name in ("then_branch", "else_branch"):
            branch = node.attributes[attr_name].value
            for const in list(branch):
                if const.op_type != "Constant" or "value" not in const.attributes:
                    continue
                out = const.outputs[0]
                tensor = const.attributes["value"].value
                name = f"model.rotary_emb.{out.name}"  # must differ from the branch output it feeds
                if name not in shared:
                    tensor.name = name
                    shared[name] = tensor
                elif shared[name].tobytes() != tensor.tobytes():
                    raise DecoderBuildError(f"rotary cache {name} differs between decoder variants")
                tensor = shared[name]
                outer = graph.initializers.get(name)
                if outer is None:
                    outer = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                                     const_value=tensor)
                    graph.register_initializer(outer)
                identity = ir.node("Identity", [outer], name=f"{const.name}/Identity", num_outputs=1)
                ir.convenience.replace_nodes_and_values(branch, const, [const], [identity], [out],
                                                        [identity.outputs[0]])


def _fix_declared_shapes(model: ir.Model) -> None:
    """Correct shape annotations the builder gets wrong, which strict shape inference (onnx.checker full_check)
    rejects: every `/model/constants/...` output is declared a scalar, also the 1-D ones ("[1]"); and on DML the
    LongRoPE position-id subgraph declares ReduceMax(keepdims=0) as [1]. ONNX-domain values are re-inferred exactly,
    so the wrong ones are replaced by the real shape or dropped."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "Constant" and "value" in node.attributes:
            tensor = node.attributes["value"].value
            node.outputs[0].shape = ir.Shape(tensor.shape)
            node.outputs[0].dtype = tensor.dtype
        elif (node.name or "").startswith("/model/pos_ids_reformat/") and node.domain == "":
            for out in node.outputs:
                if not out.is_graph_output():
                    out.shape = None


class DecoderBuilder(ComponentBuilder):
    component = Component.DECODER

    @classmethod
    def io_spec(cls, config: Phi4MMConfig, io_dtype: str, execution_provider: str = "cpu",
                self_routing: bool = False) -> IOSpec:
        """The graph I/O as the GenAI builder emits it (base.py input/output tables, exclude_embeds, GQA), plus the
        self-routing decoder's `input_ids` and mode KV layer."""
        text = config.text
        kv_heads = text.num_key_value_heads
        layers = range(text.num_hidden_layers)
        # The builder's input table order: attention_mask, position_ids (only without fused RoPE), inputs_embeds.
        inputs = [TensorSpec("attention_mask", "int64", ("batch_size", "total_sequence_length"))]
        if execution_provider not in _ATTN_EPS_WITH_FUSED_ROPE:
            inputs.append(TensorSpec("position_ids", "int64", ("batch_size", "sequence_length")))
        inputs.append(TensorSpec("inputs_embeds", io_dtype, ("batch_size", "sequence_length", text.hidden_size)))
        past = ("batch_size", kv_heads, "past_sequence_length", "kv_cache_dim")
        present = ("batch_size", kv_heads, "total_sequence_length", "kv_cache_dim")
        inputs += [TensorSpec(f"past_key_values.{i}.key", io_dtype, past) for i in layers]
        inputs += [TensorSpec(f"past_key_values.{i}.value", io_dtype, past) for i in layers]
        outputs = [TensorSpec("logits", io_dtype, ("batch_size", 1, text.vocab_size))]  # last position only
        outputs += [TensorSpec(f"present.{i}.key", io_dtype, present) for i in layers]
        outputs += [TensorSpec(f"present.{i}.value", io_dtype, present) for i in layers]
        if self_routing:  # after the builder's own I/O, in the order add_mode_state appends them
            state = ModeState(text.num_hidden_layers)
            inputs += [TensorSpec(MODE_INPUT, "int64", ("batch_size", "sequence_length")),
                       TensorSpec(state.past_key, io_dtype, past), TensorSpec(state.past_value, io_dtype, past)]
            outputs += [TensorSpec(state.present_key, io_dtype, present),
                        TensorSpec(state.present_value, io_dtype, present)]
        return IOSpec(tuple(inputs), tuple(outputs))

    @classmethod
    def spec_for(cls, config: Phi4MMConfig, options: BuildOptions) -> IOSpec:
        """The I/O of the decoder(s) `options` build (every variant of one build has the same I/O)."""
        self_routing = decoder_variants(config, options)[0].self_routing
        return cls.io_spec(config, options.io_dtype, options.execution_provider, self_routing=self_routing)

    @classmethod
    def runtime_settings(cls, config: Phi4MMConfig, options: BuildOptions) -> DecoderRuntimeSettings:
        """Read from a GenAI builder instance set up exactly as `build` sets it up (no graph is made)."""
        _check_precision(options)
        variants = decoder_variants(config, options)
        builder = cls._genai_builder(config, options, variants[0].filename)
        ep = options.execution_provider
        provider_options = () if ep == "cpu" else ({ep: dict(builder.ep_attrs[ep])},)
        return DecoderRuntimeSettings(
            filename=variants[0].filename,
            variants={v.mode: v.filename for v in variants},
            past_present_share_buffer=bool(builder.past_present_share_buffer),
            provider_options=provider_options,
            context_length=int(builder.context_length),
            hidden_size=int(builder.hidden_size),
            head_size=int(builder.head_size),
            num_attention_heads=int(builder.num_attn_heads),
            num_key_value_heads=int(builder.num_kv_heads),
            num_hidden_layers=int(builder.num_layers),
            vocab_size=int(builder.vocab_size),
            io_dtype=options.io_dtype,
            attention_op=str(builder.attention_attrs["op_type"]),
            has_position_ids="position_ids" in builder.input_names,
        )

    @staticmethod
    def _genai_builder(config: Phi4MMConfig, options: BuildOptions, filename: str,
                       tree: TextDecoderTree | None = None, tensors: WeightTensors | None = None) -> Any:
        io_dtype = onnx_dtype(options.io_dtype)
        with _quiet():
            builder = genai_builder_class()(
                genai_text_config(config), io_dtype, io_dtype, options.execution_provider,
                str(options.cache_dir), _builder_extra_options(options, filename), tree=tree, tensors=tensors,
            )
        if builder.attention_attrs["op_type"] != "GroupQueryAttention":
            raise DecoderBuildError(
                f"the GenAI builder has no GroupQueryAttention for {options.execution_provider} with "
                f"{options.io_dtype} I/O; phi4mm needs GQA (shared KV buffer)"
            )
        return builder

    def build(self, weights: Mapping[str, TensorRef]) -> dict[str, ir.Model]:
        config, options = self.config, self.options
        _check_precision(options)
        variants = decoder_variants(config, options)
        tensors = WeightTensors(options.io_dtype)
        rope_caches: dict[str, ir.TensorProtocol] = {}
        quant_cache = self.quant_cache
        spec = self.spec_for(config, options)
        text = config.text
        models: dict[str, ir.Model] = {}
        for variant in variants:
            tree = make_tree(weights, config, variant)
            builder = self._genai_builder(config, options, variant.filename, tree=tree, tensors=tensors)
            with _quiet():
                builder.make_model(str(options.model_dir))
            model = builder.model
            model.graph.sort()
            _hoist_rope_caches(model, rope_caches)
            _fix_declared_shapes(model)
            if options.quantize:
                plan = QuantPlan.for_decoder(options, config.text.num_hidden_layers)
                quantize_matmuls(model, plan, options.accuracy_level, cache=quant_cache)
            if variant.self_routing:
                # After quantizing: the adapters are then main-graph branches, as onnxruntime's quantizer (which
                # leaves If bodies float for rtn / k_quant) sees the split variants; routing moves the quantized
                # nodes into the Ifs unchanged.
                is_vision, is_speech = add_mode_state(model, text.num_hidden_layers, text.num_key_value_heads,
                                                      text.head_dim)
                route_lora_branches(model, is_vision, is_speech)
            builder.stamp_build_metadata(model)
            check_io(model, spec, variant.filename)
            models[variant.filename] = model
        return models
