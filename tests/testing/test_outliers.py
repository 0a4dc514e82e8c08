"""The "-outliers" presets (make_checkpoint/outliers.py): each planted value where the module's docstring says,
everything else as in the plain preset of the same seed, and in the model the activations real checkpoints have: a
few channels hundreds of times the rest for the delimiter tokens, and a few channels tens of times the rest for
every token, at the inputs of the decoder's MatMuls."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from builder_plugin.testing import make_checkpoint as mc
from builder_plugin.testing.make_checkpoint import outliers
from builder_plugin.testing.make_checkpoint.outliers import Outliers, channels
from builder_plugin.testing.tokenizer import ROLE_TOKENS

SEED = 5
OUTLIERS = Outliers()


@pytest.fixture(scope="module")
def plan() -> dict[str, mc.PlannedTensor]:
    original = mc.original_config("tiny")
    planned = mc.plan_tensors(original, mc.native_state_shapes(mc.native_config(original)))
    return {p.native_name: p for p in planned if p.native_name is not None}


def values(planned: mc.PlannedTensor, outliers: Outliers | None) -> torch.Tensor:
    return mc.generate_tensor(SEED, dataclasses.replace(planned, outliers=outliers), "float32")


def test_the_presets_plant_the_default_outliers():
    assert mc.PRESETS["tiny-outliers"] == {**mc.PRESETS["tiny"], "outliers": OUTLIERS}
    assert mc.PRESETS["full-outliers"] == {**mc.PRESETS["full"], "outliers": OUTLIERS}
    assert "outliers" not in mc.PRESETS["tiny"]


def test_massive_values_in_the_delimiter_tokens(plan):
    planned = plan["model.embed_tokens.weight"]
    plain, planted = values(planned, None), values(planned, OUTLIERS)
    massive = channels(OUTLIERS.massive_fractions, planned.shape[1])
    rows = [ROLE_TOKENS[t] for t in ("<|user|>", "<|end|>", "<|system|>")]
    expected = plain.clone()
    for row in rows:
        for sign, column in zip((1, -1), massive):
            expected[row, column] = sign * OUTLIERS.massive_scale
    assert torch.equal(planted, expected)
    assert planted[rows][:, massive].abs().min() > 100 * plain.abs().median()


def test_norm_weights_large_in_the_outlier_channels_and_the_final_norm_damped(plan):
    layer_norm = plan["model.layers.0.input_layernorm.weight"]
    outlier = channels(OUTLIERS.outlier_fractions, layer_norm.shape[0])
    plain, planted = values(layer_norm, None), values(layer_norm, OUTLIERS)
    expected = plain.clone()
    expected[outlier] *= OUTLIERS.norm_scale
    assert torch.equal(planted, expected)
    vision_norms = [n for n in plan if "image_embed" in n and n.endswith("layer_norm1.weight")]
    audio_norms = [n for n in plan if "audio_embed" in n and n.endswith("layer_norm.weight")]
    for name in (vision_norms[0], audio_norms[0]):
        width = plan[name].shape[0]
        ratio = values(plan[name], OUTLIERS) / values(plan[name], None)
        assert torch.allclose(ratio[channels(OUTLIERS.outlier_fractions, width)], torch.tensor(OUTLIERS.norm_scale))
        assert int((ratio != 1).sum()) == len(channels(OUTLIERS.outlier_fractions, width))
    final = plan["model.norm.weight"]
    massive = channels(OUTLIERS.massive_fractions, final.shape[0])
    ratio = values(final, OUTLIERS) / values(final, None)
    assert torch.allclose(ratio[massive], torch.tensor(1 / OUTLIERS.massive_scale))
    assert int((ratio != 1).sum()) == len(massive)


def test_a_few_large_weights_in_every_matrix(plan):
    for name in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"):
        plain, planted = values(plan[name], None), values(plan[name], OUTLIERS)
        changed = planted != plain
        expected = round(plain.numel() * OUTLIERS.weight_outlier_rate)
        assert 0 < int(changed.sum()) <= expected  # positions drawn with replacement may repeat
        ratio = planted[changed] / plain[changed]
        scale = OUTLIERS.weight_outlier_scale  # a position drawn twice is scaled twice
        assert bool(((ratio - scale).abs() < 1e-4 * scale).logical_or((ratio - scale ** 2).abs() < 1e-4 * scale ** 2)
                    .all())
    bias = next(n for n in plan if n.endswith("bias_values.weight"))
    assert torch.equal(values(plan[bias], OUTLIERS), values(plan[bias], None))  # the conformer's position bias


def test_planting_does_not_depend_on_the_block_split(plan):
    """The generator plants block by block (a full-size tensor never sits in memory whole)."""
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        planned = plan[name]
        planting = outliers.planting(SEED, name, planned.shape, planned.std, OUTLIERS)
        base = torch.arange(planned.numel, dtype=torch.float32)
        whole = base.clone()
        planting.apply(whole, 0)
        split = base.clone()
        for start in range(0, planned.numel, 4099):  # blocks ending inside planted rows
            block = split[start:start + 4099]
            planting.apply(block, start)
        assert torch.equal(split, whole) and not torch.equal(whole, base)


def test_the_model_carries_massive_and_outlier_activations(tmp_path):
    """Through transformers' own model: the inputs of the decoder's MatMuls show both kinds of outliers."""
    from transformers import Phi4MultimodalForCausalLM

    folder = mc.make_checkpoint(tmp_path / "ckpt", "tiny-outliers", seed=SEED, fmt="native")
    model = Phi4MultimodalForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    seen = {}
    layer = model.model.layers[1]
    layer.self_attn.qkv_proj.register_forward_pre_hook(lambda _, args: seen.__setitem__("qkv", args[0][0]))
    ids = [ROLE_TOKENS["<|user|>"], *range(300, 330), ROLE_TOKENS["<|end|>"], ROLE_TOKENS["<|assistant|>"]]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    x = seen["qkv"].abs()  # [tokens, hidden]
    hidden = x.shape[1]
    massive, outlier = channels(OUTLIERS.massive_fractions, hidden), channels(OUTLIERS.outlier_fractions, hidden)
    ordinary = [c for c in range(hidden) if c not in massive and c not in outlier]
    delimiters = [0, len(ids) - 2]
    for row in delimiters:
        assert x[row, massive].min() > 100 * x[row, ordinary].median()
    words = x[1:-2]
    assert words[:, outlier].median() > 10 * words[:, ordinary].median()
