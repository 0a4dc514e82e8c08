"""Per-node quantization choices against the stock GenAI builder's own resolution of the same --extra_options
(QuantConfig.from_extra_options + Model.make_quant_init, run on a bare builder object)."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder_plugin.options import BuildOptions
from builder_plugin.quant.plan import QuantPlan
from builder_plugin.quant_choices import ALGO_CONFIGS, MIXED_SELECTORS
from tests.support.stock_quantizer import stock_builder


def _stock(extra_options: dict[str, str], precision: str, num_layers: int):
    """(base method, {node: bits}, excluded nodes) as the stock builder resolves them for a `num_layers` model."""
    model = stock_builder(extra_options, precision, num_layers)
    nodes = {name: config["bits"] for name, config in model.int4_customized_weight_config.items()}
    return model.quantization_algo, nodes, set(model.quant_attrs["nodes_to_exclude"])


CASES = [
    ("int4", {}),
    ("int4", {"algo_config": "default"}),
    ("int4", {"algo_config": "rtn_last"}),
    ("int4", {"algo_config": "k_quant_linear"}),
    ("int4", {"algo_config": "k_quant", "matmul_mixed_precision": "mixed_layers:int8"}),
    ("int4", {"algo_config": "k_quant_mixed", "matmul_mixed_precision": "last_matmul:int4"}),
    ("int4", {"algo_config": "k_quant_mixed",
              "nodes_to_exclude": "/lm_head/MatMul,/model/layers.3/mlp/down_proj/MatMul"}),
    ("int8", {}),
    ("int8", {"algo_config": "rtn", "matmul_mixed_precision": "last_matmul:int4"}),
]


@pytest.mark.parametrize("num_layers", [32, 9, 2])
@pytest.mark.parametrize(("precision", "extra"), CASES)
def test_plan_matches_the_stock_builders_resolution(precision, extra, num_layers) -> None:
    options = BuildOptions(model_dir=Path("unused"), output_dir=Path("unused"), precision=precision,
                           extra_options=extra)
    plan = QuantPlan.for_decoder(options, num_layers)
    stock_extra = dict(extra)
    stock_extra.setdefault("algo_config", options.algo_config)  # our default, spelled out for the stock builder
    method, nodes, excluded = _stock(stock_extra, precision, num_layers)
    body = 4 if precision == "int4" else 8
    assert plan.body.method == method and plan.body.bits == body
    assert {name: bits for name, bits in plan.node_bits.items() if bits != body} == {
        name: bits for name, bits in nodes.items() if bits != body}
    assert set(plan.excluded) == excluded
    assert all(plan.scheme(name) is None for name in excluded)


def test_default_int4_choice_is_k_quant_mixed_and_upgrades_the_sensitive_layers() -> None:
    options = BuildOptions(model_dir=Path("unused"), output_dir=Path("unused"))
    plan = QuantPlan.for_decoder(options, 32)
    assert plan.body.method == "k_quant" and plan.scheme("/lm_head/MatMul").bits == 8
    upgraded = sorted({int(name.split(".")[1].split("/")[0]) for name in plan.node_bits if "layers." in name})
    assert upgraded == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert plan.scheme("/model/layers.5/attn/qkv_proj/MatMul").bits == 4
    assert plan.scheme("/model/layers.6/mlp/down_proj/MatMul").bits == 8
    assert plan.scheme("/model/layers.6/attn/o_proj/MatMul").bits == 4


def test_tables_match_the_stock_builder() -> None:
    import onnxruntime_genai.models.builder  # noqa: F401
    from quantization.quant_config import _LEGACY_ALGO_ALIASES, MATCH_PRESETS, WeightsConfig

    assert {k: v for k, v in ALGO_CONFIGS.items() if v[1]} == _LEGACY_ALGO_ALIASES
    assert {k for k, v in ALGO_CONFIGS.items() if not v[1]} == set(WeightsConfig.METHODS)
    assert MIXED_SELECTORS == MATCH_PRESETS
