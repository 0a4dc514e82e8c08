"""What a decoder ONNX graph reads per decode step (the bytes behind the memory-bandwidth bound) and how many
positions its logits output has, from the graph alone (external data not loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.runtime_bench import REAL_TEXT_LAYERS

_ITEMSIZE = {1: 4, 10: 2, 16: 2, 2: 1, 3: 1, 6: 4, 7: 8, 11: 8}  # onnx TensorProto data types -> bytes


def _tensor_bytes(tensor: Any) -> int:
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    count = 1
    for dim in tensor.dims:
        count *= int(dim)
    if tensor.data_type in (21, 22):  # UINT4 / INT4 are packed two per byte
        return (count + 1) // 2
    return count * _ITEMSIZE.get(tensor.data_type, 4)


def decode_weight_bytes(decoder_path: Path) -> dict[str, Any]:
    """Bytes one decode step reads from MatMul / MatMulNBits / Gemm weights (each initializer counted once), split
    into lm_head, LoRA branches and per-layer totals; "quantized" when any of them is MatMulNBits."""
    import onnx

    model = onnx.load(str(decoder_path), load_external_data=False)
    initializers = {t.name: t for t in model.graph.initializer}
    seen: set[str] = set()
    totals = {"lm_head": 0, "lora": 0, "layers": 0, "other": 0}
    per_layer: dict[int, int] = {}
    quantized = False
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "MatMulNBits", "Gemm"):
            continue
        quantized = quantized or node.op_type == "MatMulNBits"
        for name in node.input[1:]:
            if name not in initializers or name in seen:
                continue
            seen.add(name)
            size = _tensor_bytes(initializers[name])
            if "lm_head" in node.name:
                totals["lm_head"] += size
                continue
            if "lora" in node.name.lower() or "lora" in name.lower():
                totals["lora"] += size
            if "/layers." in node.name:
                layer = int(node.name.split("/layers.")[1].split("/")[0])
                per_layer[layer] = per_layer.get(layer, 0) + size
                if "lora" not in node.name.lower() and "lora" not in name.lower():
                    totals["layers"] += size
            elif "lora" not in node.name.lower() and "lora" not in name.lower():
                totals["other"] += size
    total = totals["lm_head"] + totals["lora"] + totals["layers"] + totals["other"]
    layers = len(per_layer)
    per_layer_mean = sum(per_layer.values()) / layers if layers else 0.0
    fixed = total - sum(per_layer.values())
    return {
        "total_bytes": total,
        **{f"{key}_bytes": value for key, value in totals.items()},
        "layers": layers,
        "quantized": quantized,
        "per_layer_bytes": per_layer_mean,
        "fixed_bytes": fixed,
        f"estimated_total_bytes_{REAL_TEXT_LAYERS}_layers": fixed + REAL_TEXT_LAYERS * per_layer_mean,
    }


def logits_positions(decoder_path: Path) -> int | str:
    """The sequence dimension of the decoder's logits output: 1 when it emits the last position only."""
    import onnx

    model = onnx.load(str(decoder_path), load_external_data=False)
    for output in model.graph.output:
        if output.name == "logits":
            dim = output.type.tensor_type.shape.dim[1]
            return dim.dim_value if dim.HasField("dim_value") else dim.dim_param
    raise ValueError(f"{decoder_path.name} has no logits output")
