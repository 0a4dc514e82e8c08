import json
from pathlib import Path

import pytest
import torch

from builder_plugin.checkpoint.reader import CheckpointReader, TensorRef
from builder_plugin.checkpoint.routing import WEIGHT_ROUTES, expanded_routes, route_weights
from builder_plugin.config import Phi4MMConfig
from builder_plugin.errors import CheckpointError, RoutingError
from builder_plugin.spec import Component
from builder_plugin.testing.make_checkpoint import native_config, native_state_shapes, original_config, original_name


def test_every_tensor_of_the_original_checkpoint_is_routed_or_ignored(tiny_checkpoint: Path, tiny_config) -> None:
    reader = CheckpointReader(tiny_checkpoint)
    routed = route_weights(reader, tiny_config)
    routed_refs = {ref.name for weights in routed.values() for ref in weights.values()}
    unused = set(reader) - routed_refs
    # Only the SigLIP layer after the feature layer, its post-layernorm and pooling head are left out.
    last = tiny_config.vision.num_hidden_layers - 1
    assert unused and all(
        f"img_processor.encoder.layers.{last}." in n or ".post_layernorm." in n or ".img_processor.head." in n
        for n in unused
    )
    assert routed[Component.EMBEDDING]["embed_tokens.weight"] is routed[Component.DECODER]["embed_tokens.weight"]
    layers = tiny_config.text.num_hidden_layers
    assert sum(".lora_A." in k for k in routed[Component.DECODER]) == 4 * layers * len(tiny_config.loras)


def test_native_layout_routes_to_the_same_local_names_and_values(tiny_checkpoint, tiny_native_checkpoint) -> None:
    original = route_weights(CheckpointReader(tiny_checkpoint), Phi4MMConfig.from_dir(tiny_checkpoint))
    native_cfg = Phi4MMConfig.from_dir(tiny_native_checkpoint)
    native = route_weights(CheckpointReader(tiny_native_checkpoint, "native"), native_cfg)
    for component in Component:
        assert set(native[component]) == set(original[component]), component
        for local in ("layers.1.mlp.down_proj.lora_B.speech.weight", "global_img_feature_extensor",
                      "encoder.encoders.0.feed_forward_in.gate_up_proj.weight", "up_proj_for_vision_speech.bias"):
            if local in original[component]:
                assert torch.equal(native[component][local].load(), original[component][local].load())


def test_routes_match_the_real_model_shapes(tmp_path: Path) -> None:
    """The expanded table for the full-size config equals transformers' native module shapes, tensor for tensor."""
    raw = original_config("full")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = Phi4MMConfig.from_dir(tmp_path)
    native_shapes = native_state_shapes(native_config(raw))
    expected = {original_name(n): s for n, s in native_shapes.items() if original_name(n) is not None}
    routed = {source: shape for source, _, _, shape in expanded_routes(cfg)}
    for source, shape in routed.items():
        if ".lora_" not in source:
            assert expected[source] == shape, source
    missing = set(expected) - set(routed)
    assert all("post_layernorm" in n or ".head." in n or "layers.26." in n for n in missing), sorted(missing)[:5]
    lora = [s for s in routed if ".lora_A.vision." in s]
    assert len(lora) == 4 * 32 and routed[lora[0]][0] == 256


def test_every_route_is_used_by_the_tiny_model(tiny_config) -> None:
    used = {id(route) for _, route, _, _ in expanded_routes(tiny_config)}
    stale = [r.original for r in WEIGHT_ROUTES if id(r) not in used and r.original != "lm_head.weight"]
    assert not stale


def test_unknown_missing_and_misshapen_tensors_are_named(tiny_checkpoint: Path, tiny_config) -> None:
    reader = CheckpointReader(tiny_checkpoint)
    some = reader["model.norm.weight"]
    extra = {"model.layers.0.self_attn.mystery.weight": some}
    with pytest.raises(RoutingError, match="mystery"):
        route_weights({**reader, **extra}, tiny_config)
    gone = "model.layers.1.mlp.down_proj.lora_B.speech.weight"
    with pytest.raises(RoutingError, match="lora_B.speech"):
        route_weights({k: v for k, v in reader.items() if k != gone}, tiny_config)
    wrong = TensorRef(name=some.name, file=some.file, shape=(some.shape[0] + 1,), dtype=some.dtype)
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        route_weights({**reader, "model.norm.weight": wrong}, tiny_config)
