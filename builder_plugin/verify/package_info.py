"""What a built package is, read from the package itself: the precision of its graphs (MatMulNBits' bits
attribute, else the dtype of the float initializers; the verdict uses the lowest of them) and the decoder shape
genai_config.json declares, which must be the checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from transformers import Phi4MultimodalConfig

from builder_plugin.layout import GENAI_CONFIG_FILE, MAIN_DECODER, MODE_DECODERS, SPLIT_DECODERS

_FLOAT_TYPES = {onnx.TensorProto.FLOAT: "fp32", onnx.TensorProto.FLOAT16: "fp16", onnx.TensorProto.BFLOAT16: "fp16"}
_INT8_OPS = {"MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul", "MatMulIntegerToFloat"}


def graph_precision(path: Path) -> str:
    """int4 / int8 / fp16 / fp32 of one graph (structure only: the external weights are not read)."""
    model = onnx.load(str(path), load_external_data=False)
    nodes = list(model.graph.node)
    bits = {attr.i for n in nodes if n.op_type == "MatMulNBits" for attr in n.attribute if attr.name == "bits"}
    if any(n.op_type == "MatMulNBits" for n in nodes):
        bits = bits or {4}  # the attribute defaults to 4
        return "int4" if min(bits) <= 4 else "int8"
    if any(n.op_type in _INT8_OPS for n in nodes):
        return "int8"
    floats = {_FLOAT_TYPES[t.data_type] for t in model.graph.initializer if t.data_type in _FLOAT_TYPES}
    return "fp16" if "fp16" in floats else "fp32"


def package_precisions(package: Path) -> dict[str, str]:
    """{graph file: precision} for the graphs genai_config.json names and the decoder variants beside them."""
    config = json.loads((package / GENAI_CONFIG_FILE).read_text(encoding="utf-8"))["model"]
    names = {section["filename"] for section in config.values()
             if isinstance(section, dict) and section.get("filename")}
    names |= {MAIN_DECODER, *SPLIT_DECODERS.values(), *MODE_DECODERS.values()}
    return {name: graph_precision(package / name) for name in sorted(names) if (package / name).is_file()}


def has_speech(package: Path) -> bool:
    """Whether the package has a speech model (a `--components vision,text` build has none)."""
    config = json.loads((package / GENAI_CONFIG_FILE).read_text(encoding="utf-8"))["model"]
    return bool((config.get("speech") or {}).get("filename"))


class ArchitectureMismatchError(ValueError):
    """The package was not built from a checkpoint of this architecture."""


def check_architecture(package: Path, config: Phi4MultimodalConfig) -> None:
    """The decoder shape genai_config.json declares is the checkpoint's (its native config, as the reference reads
    it)."""
    model = json.loads((package / GENAI_CONFIG_FILE).read_text(encoding="utf-8"))["model"]
    decoder = model.get("decoder", {})
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = {
        "vocab_size": (model.get("vocab_size"), config.vocab_size),
        "hidden_size": (decoder.get("hidden_size"), config.hidden_size),
        "num_hidden_layers": (decoder.get("num_hidden_layers"), config.num_hidden_layers),
        "num_attention_heads": (decoder.get("num_attention_heads"), config.num_attention_heads),
        "num_key_value_heads": (decoder.get("num_key_value_heads"), config.num_key_value_heads),
        "head_size": (decoder.get("head_size"), head_size),
    }
    wrong = [f"{key} {got} vs {want}" for key, (got, want) in expected.items() if got != want]
    if wrong:
        raise ArchitectureMismatchError(f"the package does not match the checkpoint ({'; '.join(wrong)})")
