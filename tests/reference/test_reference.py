"""Tests of the PyTorch reference (builder_plugin.reference) on tiny random checkpoints.

The reference is the yardstick of every parity test, so it is checked against independent paths: PEFT-injected
adapters instead of merged weights, the native end-to-end forward instead of the feature/embedding decomposition, the
native-format checkpoint instead of the original one, and a full-sequence forward instead of the KV-cached decode.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from builder_plugin.reference.checkpoint import open_checkpoint
from builder_plugin.reference.errors import ReferenceModelError
from builder_plugin.reference.model import Reference
from builder_plugin.reference.native_config import native_config_from_original
from builder_plugin.testing.make_checkpoint import make_checkpoint

SEED = 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_ckpt")
    original = make_checkpoint(root / "original", preset="tiny", seed=SEED, fmt="original")
    native = make_checkpoint(root / "native", preset="tiny", seed=SEED, fmt="native")
    return original, native


@pytest.fixture(scope="module")
def ref(checkpoints):
    return Reference.load(checkpoints[0])


@pytest.fixture(scope="module")
def native_ref(checkpoints):
    return Reference.load(checkpoints[1])


# ---- inputs in the onnxruntime-genai MultiModalProcessor layout ---------------------------------------------------


def text_ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1000, 199_000, size=n)]


def expected_image_tokens(ref: Reference, rows: int, cols: int) -> int:
    """Token count from the valid patch rows/cols of the HD canvas: global crop, separator, useful sub-crop grid."""
    patches = ref.config.vision_config.image_size // ref.config.vision_config.patch_size
    grid = math.ceil(patches / 2)
    useful_h, useful_w = math.ceil(rows / 2), math.ceil(cols / 2)
    return grid * (grid + 1) + 1 + useful_h * (useful_w + 1)


def image_inputs(ref: Reference, rng: np.random.Generator, images: list[tuple[int, int, int, int]]):
    """Images as (h_crops, w_crops, pad_rows, pad_cols): an h x w grid of crops on the HD canvas whose last
    pad_rows / pad_cols patch rows / columns are white padding. Batched like the processor does: crop 0 is the
    global view, and images with fewer crops are padded with zero pixels and all-ones masks."""
    vision = ref.config.vision_config
    size, patch = vision.image_size, vision.patch_size
    patches = size // patch
    max_crops = max(1 + h * w for h, w, _, _ in images)
    pixels = np.zeros((len(images), max_crops, 3, size, size), dtype=np.float32)
    mask = np.ones((len(images), max_crops, patches, patches), dtype=np.float32)
    sizes, tokens = [], []
    for index, (h, w, pad_rows, pad_cols) in enumerate(images):
        canvas = rng.uniform(-1.0, 1.0, (3, h * size, w * size)).astype(np.float32)
        canvas_mask = np.ones((h * patches, w * patches), dtype=np.float32)
        if pad_rows:
            canvas_mask[-pad_rows:, :] = 0.0
            canvas[:, -pad_rows * patch :, :] = 1.0
        if pad_cols:
            canvas_mask[:, -pad_cols:] = 0.0
            canvas[:, :, -pad_cols * patch :] = 1.0
        pixels[index, 0] = rng.uniform(-1.0, 1.0, (3, size, size))
        for crop in range(h * w):
            r, c = divmod(crop, w)
            pixels[index, 1 + crop] = canvas[:, r * size : (r + 1) * size, c * size : (c + 1) * size]
            mask[index, 1 + crop] = canvas_mask[r * patches : (r + 1) * patches, c * patches : (c + 1) * patches]
        sizes.append([h * size, w * size])
        tokens.append([expected_image_tokens(ref, h * patches - pad_rows, w * patches - pad_cols)])
    return {
        "pixel_values": pixels,
        "image_attention_mask": mask,
        "image_sizes": np.array(sizes, dtype=np.int64),
        "num_image_tokens": np.array(tokens, dtype=np.int64),
    }


def audio_inputs(ref: Reference, rng: np.random.Generator, frames: list[int]):
    mel = ref.config.audio_config.input_size
    reduction = ref.config.audio_config.time_reduction
    longest = max(frames)
    embeds = np.zeros((len(frames), longest, mel), dtype=np.float32)
    mask = np.zeros((len(frames), longest), dtype=bool)
    for clip, n in enumerate(frames):
        embeds[clip, :n] = rng.normal(2.0, 3.0, (n, mel))
        mask[clip, :n] = True
    return {
        "audio_embeds": embeds,
        "audio_attention_mask": mask,
        "audio_sizes": np.array([math.ceil(n / reduction) for n in frames], dtype=np.int64),
    }


def prompt(ref: Reference, rng: np.random.Generator, image=None, audio=None) -> dict[str, np.ndarray]:
    ids = [199999, *text_ids(rng, 5)]
    if image is not None:
        ids += [ref.config.vision_config.image_token_id] * int(image["num_image_tokens"].sum())
    if audio is not None:
        ids += [ref.config.audio_config.audio_token_id] * int(audio["audio_sizes"].sum())
    ids += text_ids(rng, 6)
    inputs = {"input_ids": np.array([ids], dtype=np.int32)}
    mode = (1 if image is not None else 0) + (2 if audio is not None else 0)
    inputs["audio_projection_mode"] = np.array([mode], dtype=np.int64)
    for extra in (image, audio):
        if extra is not None:
            inputs.update(extra)
    return inputs


def random_embeds(ref: Reference, seed: int, length: int = 24) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return ref.embeddings(np.array([text_ids(rng, length)], dtype=np.int64))


def scale_of(logits: torch.Tensor) -> float:
    return float(logits.abs().max())


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    diff = float((actual - expected).abs().max())
    assert diff <= rel * scale_of(expected), f"max |diff| {diff:.3g} vs logit scale {scale_of(expected):.3g}"


# ---- config and loading -------------------------------------------------------------------------------------


def test_config_conversion_reads_every_size_from_the_checkpoint(checkpoints, ref):
    raw = json.loads((checkpoints[0] / "config.json").read_text())
    config = ref.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                "original_max_position_embeddings", "tie_word_embeddings"):
        assert getattr(config, key) == raw[key], key
    rope = config.rope_parameters
    assert rope["rope_type"] == "longrope"
    assert rope["short_factor"] == raw["rope_scaling"]["short_factor"]
    assert rope["long_factor"] == raw["rope_scaling"]["long_factor"]
    assert rope["partial_rotary_factor"] == raw["partial_rotary_factor"]
    assert rope["rope_theta"] == raw["rope_theta"]
    assert rope["original_max_position_embeddings"] == raw["original_max_position_embeddings"]
    assert ref.model.lm_head.weight is ref.model.model.embed_tokens.weight

    audio_raw = raw["audio_processor"]["config"]
    audio = config.audio_config
    assert audio.hidden_size == audio_raw["attention_dim"]
    assert audio.intermediate_size == audio_raw["linear_units"]
    assert audio.num_blocks == audio_raw["num_blocks"]
    assert audio.num_attention_heads == audio_raw["attention_heads"]
    assert audio.nemo_conv_channels == audio_raw["nemo_conv_settings"]["conv_channels"]
    assert audio.ext_pw_out_channel == audio_raw["ext_pw_out_channel"]
    assert audio.depthwise_separable_out_channel == audio_raw["depthwise_seperable_out_channel"]
    max_distance = audio_raw["relative_attention_bias_args"]["t5_bias_max_distance"]
    assert audio.bias_max_distance == max_distance
    bias_table = ref.model.model.embed_tokens_extend.audio_embed.encoder.relative_attention_bias_layer.bias_values
    assert bias_table.num_embeddings == 2 * max_distance

    vision = config.vision_config
    img = raw["img_processor"] or {}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                "patch_size", "layer_norm_eps", "hidden_act"):
        if key in img:
            assert getattr(vision, key) == img[key], key
    assert vision.crop_size == raw["embd_layer"]["image_embd_layer"]["crop_size"]
    assert config._attn_implementation == "eager" and vision._attn_implementation == "eager"
    assert audio._attn_implementation == "eager"

    assert ref.adapters.keys() == {"vision", "speech"}
    for name in ("vision", "speech"):
        lora = raw[f"{name}_lora"]
        assert ref.adapters[name].r == lora["r"]
        assert ref.adapters[name].scaling == lora["lora_alpha"] / lora["r"]
        assert len(ref.adapters[name].weights) == 4 * raw["num_hidden_layers"]


def test_null_img_processor_means_siglip_so400m_and_release_values_override_native_defaults(checkpoints):
    raw = json.loads((checkpoints[0] / "config.json").read_text())
    raw["img_processor"] = None
    raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"] = 24 * 64, 24, 8
    raw["audio_processor"]["config"]["relative_attention_bias_args"]["t5_bias_max_distance"] = 500
    config = native_config_from_original(raw)
    vision = config.vision_config
    assert (vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers, vision.num_attention_heads,
            vision.patch_size, vision.image_size, vision.layer_norm_eps, vision.hidden_act) == (
        1152, 4304, 27, 16, 14, 448, 1e-6, "gelu_pytorch_tanh")
    assert vision.feature_layer == -2
    assert (config.num_attention_heads, config.num_key_value_heads) == (24, 8)  # native default: 32 heads
    assert config.audio_config.bias_max_distance == 500  # native default: 1000
    assert config.tie_word_embeddings is True  # native default: False


def test_strict_load_reports_missing_and_unexpected_keys(checkpoints, ref):
    state = {name: tensor.load() for name, tensor in open_checkpoint(checkpoints[0]).tensors.items()}
    missing = dict(state)
    del missing[next(key for key in missing if key.endswith("sub_img_feature_extensor"))]
    with pytest.raises(ReferenceModelError, match="missing"):
        Reference._build_model(copy.deepcopy(ref.config), missing)
    extra = dict(state)
    extra["model.embed_tokens_extend.image_embed.not_a_weight"] = torch.zeros(1)
    with pytest.raises(ReferenceModelError, match="unexpected"):
        Reference._build_model(copy.deepcopy(ref.config), extra)


# ---- LoRA -----------------------------------------------------------------------------------------------------

# Anchored on the text decoder: a suffix list would also hit the conformer's o_proj / gate_up_proj / down_proj.
PEFT_TARGETS = r"model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))"


def peft_model(ref: Reference) -> torch.nn.Module:
    """A copy of the base model with both adapters injected by PEFT, as the original model does, instead of merged."""
    from peft import LoraConfig, inject_adapter_in_model

    ref.set_lora("none")
    model = copy.deepcopy(ref.model)
    for name, adapter in ref.adapters.items():
        config = LoraConfig(r=adapter.r, lora_alpha=adapter.lora_alpha, lora_dropout=0.0, target_modules=PEFT_TARGETS)
        inject_adapter_in_model(config, model, adapter_name=name)
        with torch.no_grad():
            for module_path, (a, b) in adapter.weights.items():
                module = model.get_submodule(module_path)
                module.lora_A[name].weight.copy_(a.float())
                module.lora_B[name].weight.copy_(b.float())
    return model.eval()


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")
def test_merged_lora_matches_peft_adapters(ref):
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import set_adapter

    model = peft_model(ref)
    wrapped = [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    assert len(wrapped) == 4 * ref.config.num_hidden_layers
    assert all(name.startswith("model.layers.") for name in wrapped)  # nothing in SigLIP or the conformer

    embeds = random_embeds(ref, seed=1)
    with torch.no_grad():
        for name in ("vision", "speech"):
            set_adapter(model, name)
            assert_logits_close(ref.logits(embeds, name), model(inputs_embeds=embeds).logits)
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.enable_adapters(False)
        assert_logits_close(ref.logits(embeds, "none"), model(inputs_embeds=embeds).logits)


def test_lora_modes_give_clearly_different_logits(ref):
    embeds = random_embeds(ref, seed=2)
    logits = {mode: ref.logits(embeds, mode) for mode in ("none", "vision", "speech")}
    scale = scale_of(logits["none"])
    for first, second in (("none", "vision"), ("none", "speech"), ("vision", "speech")):
        diff = float((logits[first] - logits[second]).abs().max())
        assert diff > 0.05 * scale, f"{first} vs {second}: {diff:.3g} (scale {scale:.3g})"
    # every switch rebuilds from the pristine base weights; merges never accumulate
    ref.set_lora("vision")
    ref.set_lora("speech")
    assert torch.equal(ref.logits(embeds, "vision"), logits["vision"])
    assert torch.equal(ref.logits(embeds, "none"), logits["none"])


def test_mode_selection_follows_the_original_model(ref):
    assert ref.mode_for(has_image=False, has_audio=False) == "text"
    assert ref.mode_for(has_image=True, has_audio=False) == "vision"
    assert ref.mode_for(has_image=False, has_audio=True) == "speech"
    assert ref.mode_for(has_image=True, has_audio=True) == "vision"


# ---- formats, features, native embedding ------------------------------------------------------------------------


def test_original_and_native_formats_agree(ref, native_ref):
    rng = np.random.default_rng(3)
    image = image_inputs(ref, rng, [(1, 1, 0, 5)])
    audio = audio_inputs(ref, rng, [90])
    image_args = (image["pixel_values"], image["image_attention_mask"], image["image_sizes"])
    assert torch.equal(ref.image_features(*image_args), native_ref.image_features(*image_args))
    audio_args = (audio["audio_embeds"], audio["audio_attention_mask"], audio["audio_sizes"])
    for projection in ("speech", "vision"):
        assert torch.equal(ref.audio_features(*audio_args, projection),
                           native_ref.audio_features(*audio_args, projection))
    embeds = random_embeds(ref, seed=4)
    for mode in ("none", "vision", "speech"):
        assert torch.equal(ref.logits(embeds, mode), native_ref.logits(embeds, mode))


@pytest.mark.parametrize(
    "images",
    [[(1, 1, 0, 0)], [(1, 2, 0, 9)], [(2, 1, 13, 0)], [(1, 1, 3, 4), (1, 2, 0, 0)]],
    ids=["448x448", "cols-padded", "rows-padded", "two-images"],
)
def test_image_features_match_the_native_embedding(ref, images):
    rng = np.random.default_rng(5)
    image = image_inputs(ref, rng, images)
    inputs = prompt(ref, rng, image=image)
    features = ref.image_features(image["pixel_values"], image["image_attention_mask"], image["image_sizes"])
    assert ref.num_image_tokens(image["image_attention_mask"], image["image_sizes"]) == [
        int(n) for n in image["num_image_tokens"].reshape(-1)]
    assert features.shape == (int(image["num_image_tokens"].sum()), ref.config.hidden_size)
    ids = torch.from_numpy(inputs["input_ids"]).long()
    with torch.no_grad():
        native = ref.model.model.embed_tokens_extend(
            ids,
            ref.model.model.embed_tokens(ids),
            image_pixel_values=torch.from_numpy(image["pixel_values"]),
            image_sizes=torch.from_numpy(image["image_sizes"]),
            image_attention_mask=torch.from_numpy(image["image_attention_mask"]),
        )
    assert torch.equal(ref.embeddings(inputs["input_ids"], image_features=features), native)


@pytest.mark.parametrize("with_image", [False, True], ids=["audio", "image+audio"])
def test_single_clip_audio_matches_the_native_embedding(ref, with_image):
    rng = np.random.default_rng(6)
    audio = audio_inputs(ref, rng, [157])
    image = image_inputs(ref, rng, [(1, 1, 0, 0)]) if with_image else None
    inputs = prompt(ref, rng, image=image, audio=audio)
    projection = "vision" if with_image else "speech"
    audio_features = ref.audio_features(audio["audio_embeds"], None, audio["audio_sizes"], projection)
    image_features, image_kwargs = None, {}
    if with_image:
        image_features = ref.image_features(image["pixel_values"], image["image_attention_mask"], image["image_sizes"])
        image_kwargs = dict(image_pixel_values=torch.from_numpy(image["pixel_values"]),
                            image_sizes=torch.from_numpy(image["image_sizes"]),
                            image_attention_mask=torch.from_numpy(image["image_attention_mask"]))
    ids = torch.from_numpy(inputs["input_ids"]).long()
    with torch.no_grad():
        # one clip and no mask, as the original passes it; the native code picks the projection pair itself
        native = ref.model.model.embed_tokens_extend(
            ids,
            ref.model.model.embed_tokens(ids),
            audio_input_features=torch.from_numpy(audio["audio_embeds"]),
            audio_embed_sizes=torch.from_numpy(audio["audio_sizes"]),
            **image_kwargs,
        )
    assert torch.equal(ref.embeddings(inputs["input_ids"], image_features, audio_features), native)


def test_audio_clips_are_encoded_alone_and_projections_differ(ref):
    rng = np.random.default_rng(7)
    frames = [75, 203]
    audio = audio_inputs(ref, rng, frames)
    args = (audio["audio_embeds"], audio["audio_attention_mask"], audio["audio_sizes"])
    batched = ref.audio_features(*args, "speech")
    assert batched.shape == (int(audio["audio_sizes"].sum()), ref.config.hidden_size)
    alone = [
        ref.audio_features(audio["audio_embeds"][i : i + 1, :n], None, audio["audio_sizes"][i : i + 1], "speech")
        for i, n in enumerate(frames)
    ]
    assert torch.equal(batched, torch.cat(alone))
    vision = ref.audio_features(*args, "vision")
    assert float((vision - batched).abs().max()) > 1e-2 * float(batched.abs().max())


def test_long_audio_goes_through_the_chunked_encoder(ref):
    rng = np.random.default_rng(8)
    reduction = ref.config.audio_config.time_reduction
    frames = 501 * reduction + 3  # more than 500 subsampled frames: the native encoder folds 500-frame chunks
    audio = audio_inputs(ref, rng, [frames])
    features = ref.audio_features(audio["audio_embeds"], audio["audio_attention_mask"], audio["audio_sizes"], "speech")
    assert features.shape == (math.ceil(frames / reduction), ref.config.hidden_size)
    assert torch.isfinite(features).all()


def test_embedding_scatter_places_rows_in_order_and_validates_counts(ref):
    rng = np.random.default_rng(9)
    image_id = ref.config.vision_config.image_token_id
    audio_id = ref.config.audio_config.audio_token_id
    ids = np.array([[5, image_id, image_id, audio_id, 7, image_id]], dtype=np.int32)
    hidden = ref.config.hidden_size
    image = torch.from_numpy(rng.normal(size=(3, hidden)).astype(np.float32))
    audio = torch.from_numpy(rng.normal(size=(1, hidden)).astype(np.float32))
    out = ref.embeddings(ids, image, audio)
    assert torch.equal(out[0, [1, 2, 5]], image)
    assert torch.equal(out[0, 3], audio[0])
    assert torch.equal(out[0, [0, 4]], ref.model.model.embed_tokens.weight[[5, 7]])
    with pytest.raises(ReferenceModelError, match="3 image placeholders"):
        ref.embeddings(ids, image[:2], audio)
    with pytest.raises(ReferenceModelError, match="1 audio placeholders"):
        ref.embeddings(ids, image, None)


# ---- greedy decoding --------------------------------------------------------------------------------------------


def check_incremental_equals_full(ref: Reference, result) -> None:
    """KV-cached steps == one full-sequence forward over prompt + generated tokens.

    Only valid when decoding does not cross the LongRoPE switch (see the crossing test below).
    """
    switch = ref.config.rope_parameters["original_max_position_embeddings"]
    total = result.prompt_length + len(result.tokens) - 1
    assert (result.prompt_length > switch) == (total > switch), "decoding crosses the LongRoPE switch"
    new = ref.model.model.embed_tokens(torch.tensor([result.tokens[:-1]], dtype=torch.long))
    full = ref.logits(torch.cat([result.inputs_embeds, new], dim=1), result.lora, last_n=len(result.tokens))[0]
    assert_logits_close(torch.stack(result.step_logits), full)
    assert [int(t) for t in full.argmax(-1)] == result.tokens


def test_greedy_text_is_not_degenerate_and_matches_full_forward(ref):
    for seed in (0, 1, 2):
        inputs = prompt(ref, np.random.default_rng(seed))
        result = ref.prefill_and_greedy(inputs, max_new_tokens=16)
        assert result.lora == "none" and result.projection is None
        assert len(result.tokens) == len(result.step_logits) == len(result.top2_gap) == 16
        assert len(set(result.tokens)) >= 4, result.tokens
        assert all(gap >= 0 for gap in result.top2_gap)
    check_incremental_equals_full(ref, result)
    # decode_logits feeds given tokens through the same cache path
    steps = ref.decode_logits(result.inputs_embeds, result.tokens[:-1], "none")
    assert len(steps) == len(result.step_logits)
    assert all(torch.equal(a, b) for a, b in zip(steps, result.step_logits))


@pytest.mark.parametrize(
    ("images", "clips", "lora", "projection"),
    [([(1, 1, 0, 7)], [], "vision", None), ([], [120], "speech", "speech"),
     ([(1, 1, 0, 0)], [96, 40], "vision", "vision")],
    ids=["image", "audio", "image+2audio"],
)
def test_prefill_and_greedy_on_processor_layout_inputs(ref, images, clips, lora, projection):
    rng = np.random.default_rng(11)
    image = image_inputs(ref, rng, images) if images else None
    audio = audio_inputs(ref, rng, clips) if clips else None
    inputs = prompt(ref, rng, image=image, audio=audio)
    ids = inputs["input_ids"][0]
    if image is not None:
        assert (ids == ref.config.vision_config.image_token_id).sum() == image["num_image_tokens"].sum()
    if audio is not None:
        assert (ids == ref.config.audio_config.audio_token_id).sum() == audio["audio_sizes"].sum()
    result = ref.prefill_and_greedy(inputs, max_new_tokens=6)
    assert result.lora == lora and result.projection == projection
    assert result.prompt_length == len(ids) and len(result.tokens) == 6
    check_incremental_equals_full(ref, result)


@pytest.mark.parametrize(
    ("text", "media", "lora", "projection"),
    [("hello there", (), "none", None), ("<|audio_1|>transcribe", ("audio",), "speech", "speech"),
     ("<|image_1|><|audio_1|>describe both", ("image", "audio"), "vision", "vision")],
    ids=["text", "audio", "image+audio"],
)
def test_prefill_and_greedy_on_the_real_genai_processor(checkpoints, ref, tmp_path, text, media, lora, projection):
    import soundfile
    from PIL import Image

    from tests.support.processor import processor_inputs

    rng = np.random.default_rng(16)
    images, audios = [], []
    if "image" in media:
        images.append(tmp_path / "image.png")
        Image.fromarray(rng.integers(0, 256, (300, 420, 3), dtype=np.uint8)).save(images[-1])  # 1x1 grid
    if "audio" in media:
        audios.append(tmp_path / "audio.wav")
        soundfile.write(audios[-1], rng.normal(0.0, 0.1, 32000).astype(np.float32), 16000)
    inputs = processor_inputs(checkpoints[0], f"<|user|>{text}<|end|><|assistant|>", images=images, audios=audios)
    ids = inputs["input_ids"][0]
    if images:
        counts = ref.num_image_tokens(inputs["image_attention_mask"], inputs["image_sizes"])
        assert counts == [int(n) for n in inputs["num_image_tokens"].reshape(-1)]
        assert (ids == ref.config.vision_config.image_token_id).sum() == sum(counts)
    if audios:
        assert (ids == ref.config.audio_config.audio_token_id).sum() == inputs["audio_sizes"].sum()
    result = ref.prefill_and_greedy(inputs, max_new_tokens=4)
    assert (result.lora, result.projection) == (lora, projection)
    assert result.prompt_length == len(ids) and len(result.tokens) == 4
    check_incremental_equals_full(ref, result)


def test_kv_cache_keeps_short_factor_keys_across_the_longrope_switch(ref):
    """Past the switch the new tokens use the long factors while cached keys keep the short ones (no re-prefill):
    what onnxruntime-genai does for phi4mm, and what generate() does not."""
    rope = ref.config.rope_parameters
    switch = rope["original_max_position_embeddings"]
    assert rope["short_factor"] != rope["long_factor"]
    rng = np.random.default_rng(15)
    prompt_length = switch - 3
    inputs = {"input_ids": np.array([text_ids(rng, prompt_length)], dtype=np.int32)}
    result = ref.prefill_and_greedy(inputs, max_new_tokens=6)
    new = ref.model.model.embed_tokens(torch.tensor([result.tokens[:-1]], dtype=torch.long))
    sequence = torch.cat([result.inputs_embeds, new], dim=1)
    for step, cached in enumerate(result.step_logits):
        length = prompt_length + step
        full = ref.logits(sequence[:, :length], "none", last_n=1)[0, -1]
        if length <= switch:
            assert_logits_close(cached, full)
        else:
            diff = float((cached - full).abs().max())
            assert diff > 1e-3 * scale_of(full), f"step {step}: cache was recomputed? diff {diff:.3g}"


def test_prefill_and_greedy_rejects_inconsistent_inputs(ref):
    rng = np.random.default_rng(12)
    inputs = prompt(ref, rng, audio=audio_inputs(ref, rng, [64]))
    inputs["audio_projection_mode"] = np.array([3], dtype=np.int64)
    with pytest.raises(ReferenceModelError, match="audio_projection_mode"):
        ref.prefill_and_greedy(inputs, max_new_tokens=1)
    inputs = prompt(ref, rng, image=image_inputs(ref, rng, [(1, 1, 0, 0)]))
    inputs["num_image_tokens"] = inputs["num_image_tokens"] + 1
    with pytest.raises(ReferenceModelError, match="num_image_tokens"):
        ref.prefill_and_greedy(inputs, max_new_tokens=1)


def test_eos_stops_greedy(ref):
    inputs = prompt(ref, np.random.default_rng(13))
    first = ref.prefill_and_greedy(inputs, max_new_tokens=3)
    stopped = ref.prefill_and_greedy(inputs, max_new_tokens=3, eos_token_ids=[first.tokens[0]])
    assert stopped.tokens == first.tokens[:1] and len(stopped.step_logits) == 1


def test_reference_configs_state_the_longrope_factor_transformers_would_derive(tiny_checkpoint, caplog) -> None:
    """The reference's configs (from the original and the native config.json) state rope `factor`: transformers
    then warns no more about original_max_position_embeddings, and computes the same frequencies and attention
    factor as from the config without it."""
    import logging

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from builder_plugin.reference.native_config import native_config_from_dict, native_config_from_original
    from builder_plugin.testing.make_checkpoint.native_layout import native_config

    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process: let it warn again
    library = logging.getLogger("transformers")  # it does not propagate to the root logger caplog listens on
    library.addHandler(caplog.handler)
    try:
        configs = [native_config_from_original(raw), native_config(raw)]
        configs.append(native_config_from_dict(configs[1].to_dict()))
    finally:
        library.removeHandler(caplog.handler)
    assert "original_max_position_embeddings" not in caplog.text
    for config in configs:
        assert config.rope_parameters["factor"] > 1  # the tiny checkpoint's context is 128x its original one
        unstated = copy.deepcopy(config)
        del unstated.rope_parameters["factor"]
        for seq_len in (None, config.rope_parameters["original_max_position_embeddings"] + 1):  # short, long factors
            want, got = (ROPE_INIT_FUNCTIONS["longrope"](c, "cpu", seq_len=seq_len) for c in (unstated, config))
            assert torch.equal(want[0], got[0]) and want[1] == got[1]
