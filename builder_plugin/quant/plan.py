"""Which MatMul is quantized how: --precision and the quantization --extra_options resolved per node, as the stock
GenAI builder resolves them (builders/base.py `make_quant_init`, `make_matmul_mixed_precision`, `to_nbits`).

The body gets the precision's bits (int4: 4, int8: 8) with the base method of `algo_config`; the mixed-precision
selectors (from `algo_config`'s alias, then `matmul_mixed_precision` on top) give named decoder MatMuls other bits;
`nodes_to_exclude` keeps MatMuls float and wins over both. The encoders use the body's scheme: the selectors name
decoder nodes only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import onnx_ir as ir

from builder_plugin.options import BuildOptions
from builder_plugin.quant.kernels import QuantScheme
from builder_plugin.quant_choices import ALGO_CONFIGS, QUANT_TYPE_BITS

# The GenAI builder's names for the lm_head MatMul and its weight [hidden, vocab]. The embedding's quantized token table
# is computed under the weight's name (the quantizer names its pieces after it), so it is the decoder's very tensors.
LM_HEAD_NODE = "/lm_head/MatMul"
LM_HEAD_WEIGHT = "lm_head.MatMul.weight"


def mixed_precision_nodes(placement: Mapping[str, str], num_layers: int) -> dict[str, int]:
    """Decoder node name -> bits for the selectors in `placement`, as `Model.make_matmul_mixed_precision` lists
    them; the first selector naming a node wins, as in `make_quant_init`."""
    nodes: dict[str, int] = {}
    for selector, quant_type in placement.items():
        bits = QUANT_TYPE_BITS[quant_type]
        names: list[str] = []
        if selector == "last_matmul":
            names = [LM_HEAD_NODE]
        elif selector == "mixed_layers":  # llama.cpp's choice: first and last eighth, and every third layer
            eighth = num_layers / 8
            for i in range(num_layers):
                if i < eighth or i >= 7 * eighth or (i - round(eighth)) % 3 == 2:
                    names += [f"/model/layers.{i}/attn/qkv_proj/MatMul", f"/model/layers.{i}/attn/v_proj/MatMul",
                              f"/model/layers.{i}/mlp/down_proj/MatMul"]
        # "linear_attn" selects linear-attention layers; Phi-4's layers are all full attention, so it selects none.
        for name in names:
            nodes.setdefault(name, bits)
    return nodes


@dataclass(frozen=True)
class QuantPlan:
    """Callable on a MatMul node: its QuantScheme, or None to keep it float."""

    body: QuantScheme
    node_bits: Mapping[str, int] = field(default_factory=dict)
    excluded: frozenset[str] = frozenset()

    @classmethod
    def for_encoders(cls, options: BuildOptions) -> QuantPlan:
        method, _ = ALGO_CONFIGS[options.algo_config]
        body = QuantScheme(QUANT_TYPE_BITS[options.precision], options.block_size, options.is_symmetric, method)
        return cls(body, excluded=options.nodes_to_exclude)

    @classmethod
    def for_decoder(cls, options: BuildOptions, num_layers: int) -> QuantPlan:
        _, placement = ALGO_CONFIGS[options.algo_config]
        placement = {**placement, **options.matmul_mixed_precision}
        plan = cls.for_encoders(options)
        node_bits = {name: bits for name, bits in mixed_precision_nodes(placement, num_layers).items()
                     if name not in plan.excluded}
        return cls(plan.body, node_bits, plan.excluded)

    def scheme(self, node_name: str) -> QuantScheme | None:
        if node_name in self.excluded:
            return None
        bits = self.node_bits.get(node_name, self.body.bits)
        return self.body if bits == self.body.bits else QuantScheme(bits, self.body.block_size, self.body.symmetric,
                                                                    self.body.method)

    def __call__(self, node: ir.Node) -> QuantScheme | None:
        return self.scheme(node.name or "")
