"""onnxruntime-genai's Phi-4-MM builder class, subclassed to walk the lazy module tree and emit our MatMul + LoRA nodes.

Also the transformers config it reads, made from the parsed config, and the options every build passes it.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import onnx_ir as ir

from builder_plugin.components.decoder.lora_names import lora_node, weight_name
from builder_plugin.components.decoder.tree import LazyLinear, LmHead, TextDecoderTree
from builder_plugin.components.decoder.weights import LoraBranch, WeightTensors
from builder_plugin.config import Phi4MMConfig
from builder_plugin.dtypes import onnx_dtype
from builder_plugin.errors import DecoderBuildError
from builder_plugin.layout import LOGITS
from builder_plugin.options import BuildOptions


def genai_text_config(config: Phi4MMConfig) -> Any:
    """The transformers Phi3Config the GenAI builder reads, made from our parsed config (no AutoConfig, no hub)."""
    from transformers import Phi3Config
    from transformers.utils import logging as hf_logging

    text = config.text
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "type": "longrope",  # the builder's mscale policy reads the legacy key
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
    import onnxruntime_genai.models.builder  # noqa: F401  - first: it puts the top-level `builders` package on sys.path
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
            if proj.merged is not None:
                weight = self.tensors.merged(proj.rows, proj.merged, weight_name(basename))
            else:
                weight = self.tensors.base(proj.rows, weight_name(basename))
            output = LOGITS if kwargs.get("logits", False) and not proj.loras else f"{basename}/output_0"
            self._matmul_node(basename, root_input, weight, output, seq_dim)
            result = basename
            prefix = basename.rsplit("/", 1)[0]
            for branch in proj.loras:
                a_out = self._lora_a(branch, root_input, seq_dim)
                b_name = lora_node(prefix, branch.adapter, "B")
                b_weight = self.tensors.lora_b(branch, weight_name(b_name))
                self._matmul_node(b_name, a_out, b_weight, f"{b_name}/output_0", seq_dim)
                add_name = lora_node(prefix, branch.adapter, "Add")
                self.make_add(add_name, [f"{result}/output_0", f"{b_name}/output_0"], dtype=self.io_dtype,
                              shape=self.make_hidden_state_shape(seq_dim=seq_dim, last_dim=proj.out_features))
                result = add_name
            return result

        def _lora_a(self, branch: LoraBranch, root_input: str, seq_dim: Any) -> str:
            key = (branch.a_owner, branch.adapter, root_input)
            if key not in self._lora_a_outputs:
                name = lora_node(branch.a_owner, branch.adapter, "A")
                weight = self.tensors.lora_a(branch, weight_name(name))
                self._matmul_node(name, root_input, weight, f"{name}/output_0", seq_dim)
                self._lora_a_outputs[key] = f"{name}/output_0"
            return self._lora_a_outputs[key]

    return Phi4MMTextBuilder


@contextlib.contextmanager
def quiet() -> Iterator[None]:
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


def make_genai_builder(config: Phi4MMConfig, options: BuildOptions, filename: str, tree: TextDecoderTree,
                       tensors: WeightTensors) -> Any:
    """The GenAI builder for one decoder file of a build with `options`, walking `tree` with `tensors`."""
    io_dtype = onnx_dtype(options.io_dtype)
    with quiet():
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
