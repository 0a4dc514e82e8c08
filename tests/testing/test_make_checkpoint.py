"""The generated tiny checkpoints, checked against transformers' native Phi-4-multimodal model, PEFT and the docs."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from builder_plugin.layout import GENAI_CONFIG_FILE, INPUT_IDS
from builder_plugin.testing import make_checkpoint as mc
from tests.conftest import TINY_SEED as SEED  # the seed of the session checkpoints used below

TEXT_PROJECTIONS = re.compile(
    r"(model\.layers\.\d+\.(?:self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj)))"
)
PROMPT = "<|user|>hello world<|end|><|assistant|>"

# Original <- native renames (remote-code module names <- transformers' native ones), written out independently of
# make_checkpoint's table; the conformer renames only apply inside the encoder blocks.
RENAMES = (
    (".image_embed.global_img_feature_extensor", ".image_embed.glb_GN"),
    (".image_embed.sub_img_feature_extensor", ".image_embed.sub_GN"),
    (".image_embed.img_projection_up.", ".image_embed.img_projection.0."),
    (".image_embed.img_projection_down.", ".image_embed.img_projection.2."),
    (".audio_embed.up_proj_for_speech.", ".audio_embed.audio_projection.speech.0."),
    (".audio_embed.down_proj_for_speech.", ".audio_embed.audio_projection.speech.2."),
    (".audio_embed.up_proj_for_vision_speech.", ".audio_embed.audio_projection.vision.0."),
    (".audio_embed.down_proj_for_vision_speech.", ".audio_embed.audio_projection.vision.2."),
)
CONFORMER_RENAMES = (
    (".gate_up_proj.", ".net.0.linear."),
    (".down_proj.", ".net.2."),
    (".self_attn.q_proj.", ".self_attn.linear_q."),
    (".self_attn.k_proj.", ".self_attn.linear_k."),
    (".self_attn.v_proj.", ".self_attn.linear_v."),
    (".self_attn.o_proj.", ".self_attn.linear_out."),
)


def expected_original_key(native_key: str) -> str:
    for old, new in RENAMES:
        native_key = native_key.replace(old, new)
    if ".audio_embed.encoder.encoders." in native_key:
        for old, new in CONFORMER_RENAMES:
            native_key = native_key.replace(old, new)
    match = TEXT_PROJECTIONS.fullmatch(native_key.removesuffix(".weight"))
    if match:
        return f"{match.group(1)}.base_layer.weight"
    return native_key


@pytest.fixture(scope="module")
def original_dir(tiny_checkpoint: Path) -> Path:
    """The session's tiny original-layout checkpoint (tests/conftest.py: make_checkpoint, preset tiny, seed 0)."""
    return tiny_checkpoint


@pytest.fixture(scope="module")
def native_dir(tiny_native_checkpoint: Path) -> Path:
    return tiny_native_checkpoint


def read_sharded(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for filename in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(folder / filename))
    return tensors


def native_model(native_dir: Path):
    """Phi4MultimodalForCausalLM loaded the ordinary way, in float32 with eager attention; returns (model, info)."""
    from transformers import Phi4MultimodalForCausalLM

    return Phi4MultimodalForCausalLM.from_pretrained(
        native_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )


def greedy(model, input_ids: torch.Tensor, steps: int = 16) -> list[int]:
    tokens = []
    with torch.no_grad():
        output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        for _ in range(steps):
            next_id = int(output.logits[0, -1].argmax())
            tokens.append(next_id)
            output = model(input_ids=torch.tensor([[next_id]]), cache=output.cache, use_cache=True)
    return tokens


@pytest.mark.parametrize("fmt", ["original", "native"])
def test_shards_and_index_are_consistent(fmt, original_dir, native_dir):
    folder = original_dir if fmt == "original" else native_dir
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard_files = sorted(p.name for p in folder.glob("model-*.safetensors"))
    count = len(shard_files)
    assert count == mc.PRESETS["tiny"]["num_shards"]
    assert shard_files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert set(index["weight_map"].values()) == set(shard_files)

    seen, total = set(), 0
    for name in shard_files:
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == name
                tensor = f.get_tensor(key)
                assert tensor.dtype == torch.bfloat16, key
                total += tensor.numel() * tensor.element_size()
                seen.add(key)
    assert seen == set(index["weight_map"])
    assert index["metadata"]["total_size"] == total
    assert "lm_head.weight" not in seen  # tied


def test_original_config_fields(original_dir):
    config = json.loads((original_dir / "config.json").read_text())
    assert config["model_type"] == "phi4mm"
    assert config["architectures"] == ["Phi4MMForCausalLM"]
    assert config["auto_map"]["AutoConfig"] == "configuration_phi4mm.Phi4MMConfig"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_phi4mm.Phi4MMForCausalLM"
    assert not list(original_dir.glob("*.py"))
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert head_dim == 64  # the smallest head that ORT GQA's fused rotary accepts with partial_rotary_factor 0.75
    rope = config["rope_scaling"]
    assert rope["type"] == "longrope"
    assert len(rope["short_factor"]) == len(rope["long_factor"]) == int(head_dim * config["partial_rotary_factor"]) // 2
    assert rope["long_factor"] == sorted(rope["long_factor"]) and rope["long_factor"][-1] > 10
    assert config["vocab_size"] == 200064 and config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (199999, 199999, 199999)
    audio = config["audio_processor"]["config"]
    assert config["audio_processor"]["name"] == "cascades"
    assert audio["relative_attention_bias_args"] == {"type": "t5", "t5_bias_max_distance": 500}
    assert audio["ext_pw_out_channel"] == audio["depthwise_seperable_out_channel"] == audio["attention_dim"]
    assert isinstance(config["img_processor"], dict)
    assert config["embd_layer"]["image_embd_layer"]["hd_transform_order"] == "sub_glb"
    vision_lora, speech_lora = config["vision_lora"], config["speech_lora"]
    assert vision_lora["lora_alpha"] / vision_lora["r"] != speech_lora["lora_alpha"] / speech_lora["r"]
    generation = json.loads((original_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [200020, 199999]
    preprocessor = json.loads((original_dir / "preprocessor_config.json").read_text())
    assert preprocessor["processor_class"] == "Phi4MMProcessor" and preprocessor["sampling_rate"] == 16000


def test_original_keys_and_values_match_native_after_renaming(original_dir, native_dir):
    original = read_sharded(original_dir)
    native = read_sharded(native_dir)
    config = json.loads((original_dir / "config.json").read_text())
    lora_keys = set()
    for native_key, tensor in native.items():
        key = expected_original_key(native_key)
        assert key in original, f"{native_key} -> {key} missing from the original checkpoint"
        assert torch.equal(original[key], tensor), key
        if key.endswith(".base_layer.weight"):
            out_features, in_features = tensor.shape
            module = key.removesuffix(".base_layer.weight")
            for adapter in ("vision", "speech"):
                r = config[f"{adapter}_lora"]["r"]
                assert original[f"{module}.lora_A.{adapter}.weight"].shape == (r, in_features)
                assert original[f"{module}.lora_B.{adapter}.weight"].shape == (out_features, r)
                lora_keys |= {f"{module}.lora_{part}.{adapter}.weight" for part in "AB"}
    assert set(original) == {expected_original_key(k) for k in native} | lora_keys
    assert len(lora_keys) == 4 * 2 * 2 * config["num_hidden_layers"]


def test_native_format_loads_into_transformers(native_dir, original_dir):
    model, info = native_model(native_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    stored = read_sharded(native_dir)
    assert set(state) - set(stored) == {"lm_head.weight"}  # tied, not stored
    assert all(torch.equal(state[key], tensor.float()) for key, tensor in stored.items())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # A strict load of the stored tensors into a fresh model: only the tied head is absent.
    from transformers import Phi4MultimodalForCausalLM

    fresh = Phi4MultimodalForCausalLM(model.config)
    result = fresh.load_state_dict({key: tensor.float() for key, tensor in stored.items()}, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["lm_head.weight"], [])
    config = model.config
    original = json.loads((original_dir / "config.json").read_text())
    assert config.model_type == "phi4_multimodal" and config.architectures == ["Phi4MultimodalForCausalLM"]
    assert config.num_attention_heads == original["num_attention_heads"]
    assert config.num_key_value_heads == original["num_key_value_heads"]
    max_distance = original["audio_processor"]["config"]["relative_attention_bias_args"]["t5_bias_max_distance"]
    assert config.audio_config.bias_max_distance == max_distance == 500  # the native default (1000) is wrong here
    bias_table = model.model.embed_tokens_extend.audio_embed.encoder.relative_attention_bias_layer.bias_values
    assert bias_table.num_embeddings == 2 * max_distance  # rows for relative distances -500 .. 499
    assert config.rope_parameters["long_factor"] == original["rope_scaling"]["long_factor"]
    assert config.vision_config.num_hidden_layers == original["img_processor"]["num_hidden_layers"]
    invstd = model.model.embed_tokens_extend.audio_embed.encoder.encoder_embedding.global_invstd
    assert bool((invstd > 0).all())


def test_lora_adapters_load_with_peft_and_change_the_logits(native_dir, original_dir):
    from peft import PeftModel
    from transformers import PreTrainedTokenizerFast

    model, _ = native_model(native_dir)
    input_ids = PreTrainedTokenizerFast.from_pretrained(native_dir)(PROMPT, return_tensors="pt").input_ids
    tokens = greedy(model, input_ids)
    assert len(set(tokens)) >= 4, tokens

    peft_model = PeftModel.from_pretrained(model, str(native_dir / "vision-lora"), adapter_name="vision")
    peft_model.load_adapter(str(native_dir / "speech-lora"), adapter_name="speech")
    original = read_sharded(original_dir)
    config = json.loads((original_dir / "config.json").read_text())
    injected = [k for k in peft_model.state_dict() if ".lora_" in k]
    assert injected and all(k.startswith("base_model.model.model.layers.") for k in injected)
    for key in injected:
        loaded = peft_model.state_dict()[key].to(torch.bfloat16)
        assert torch.equal(loaded, original[key.removeprefix("base_model.model.")]), key
    qkv = peft_model.base_model.model.model.layers[0].self_attn.qkv_proj
    for adapter in ("vision", "speech"):
        assert qkv.scaling[adapter] == config[f"{adapter}_lora"]["lora_alpha"] / config[f"{adapter}_lora"]["r"]

    with torch.no_grad():
        with peft_model.disable_adapter():
            base = peft_model(input_ids=input_ids).logits[0, -1]
        logits = {}
        for adapter in ("vision", "speech"):
            peft_model.set_adapter(adapter)
            logits[adapter] = peft_model(input_ids=input_ids).logits[0, -1]

    def relative(a, b):
        return float((a - b).norm() / b.norm())

    assert relative(logits["vision"], base) > 0.05
    assert relative(logits["speech"], base) > 0.05
    assert relative(logits["vision"], logits["speech"]) > 0.05
    assert all(bool(torch.isfinite(x).all()) for x in (base, *logits.values()))

    # The original layout's LoRA tensors, merged as W + (alpha / r) B A into the base weights, give PEFT's logits.
    scaling = config["vision_lora"]["lora_alpha"] / config["vision_lora"]["r"]
    with torch.no_grad(), peft_model.disable_adapter():
        for name, weight in peft_model.base_model.model.named_parameters():
            match = TEXT_PROJECTIONS.fullmatch(name.removesuffix(".base_layer.weight"))
            if match and name.endswith(".base_layer.weight"):
                a = original[f"{match.group(1)}.lora_A.vision.weight"].float()
                b = original[f"{match.group(1)}.lora_B.vision.weight"].float()
                weight += scaling * b @ a
        merged = peft_model(input_ids=input_ids).logits[0, -1]
    torch.testing.assert_close(merged, logits["vision"], rtol=1e-4, atol=1e-4)


def test_native_adapter_config(native_dir):
    from peft import LoraConfig

    for _adapter, folder in (("vision", "vision-lora"), ("speech", "speech-lora")):
        lora = LoraConfig.from_pretrained(str(native_dir / folder))
        assert lora.peft_type == "LORA"
        assert re.fullmatch(lora.target_modules, "model.layers.1.mlp.gate_up_proj")
        assert not re.fullmatch(
            lora.target_modules, "model.embed_tokens_extend.audio_embed.encoder.encoders.0.self_attn.o_proj"
        )


def test_same_seed_same_bytes_and_overwrite(original_dir, tmp_path):
    out = tmp_path / "again"
    out.mkdir()
    (out / "stale.txt").write_text("left over")
    with pytest.raises(FileExistsError):
        mc.make_checkpoint(out, preset="tiny", seed=SEED)
    mc.make_checkpoint(out, preset="tiny", seed=SEED, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in original_dir.iterdir())
    for path in original_dir.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_different_seed_gives_different_tensors(original_dir, tmp_path):
    other = read_sharded(mc.make_checkpoint(tmp_path / "seed1", preset="tiny", seed=SEED + 1, num_shards=1))
    assert len(list((tmp_path / "seed1").glob("model-*.safetensors"))) == 1
    reference = read_sharded(original_dir)
    assert set(other) == set(reference)
    assert all(not torch.equal(other[k], reference[k]) for k in reference)


def test_cli_refuses_a_non_empty_folder(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert mc.main([str(tmp_path), "--preset", "tiny"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").exists()


def test_float32_values_round_to_the_bfloat16_ones():
    config = mc.original_config("tiny")
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    shapes = {"model.norm.weight": (hidden,), "model.layers.0.mlp.down_proj.weight": (hidden, intermediate)}
    plan = mc.plan_tensors(config, shapes)
    for planned in plan:
        as_float = mc.generate_tensor(SEED, planned, "float32")
        assert as_float.dtype == torch.float32
        assert torch.equal(as_float.to(torch.bfloat16), mc.generate_tensor(SEED, planned, "bfloat16"))


def test_rename_table_rejects_an_unknown_native_tensor():
    with pytest.raises(mc.UncoveredTensorError):
        mc.original_name("model.embed_tokens_extend.audio_embed.encoder.encoders.0.new_gate.weight")


def test_shards_split_contiguously_without_empty_shards():
    config = mc.original_config("tiny")
    plan = mc.plan_tensors(config, mc.native_state_shapes(mc.native_config(config)))
    entries = [(p.original_name, p) for p in plan]
    for count in (1, 3, 7):
        shards = mc.split_shards(entries, 2, count)
        assert len(shards) == count and all(shards)
        assert [e for shard in shards for e in shard] == entries


def test_full_preset_matches_the_published_parameter_count():
    """The published model's counts: 4.744 B base parameters, 369.1 M vision LoRA, 461.4 M speech LoRA."""
    config = mc.original_config("full")
    assert config["img_processor"] is None  # SigLIP-so400m hard-coded by the remote code
    assert len(config["rope_scaling"]["long_factor"]) == 48
    plan = mc.plan_tensors(config, mc.native_state_shapes(mc.native_config(config)))
    counts = {"base": 0, "vision": 0, "speech": 0}
    for planned in plan:
        counts[planned.adapter or "base"] += planned.numel
    assert math.isclose(counts["base"], 4.744e9, rel_tol=1e-3)
    assert math.isclose(counts["vision"], 369.1e6, rel_tol=1e-3)
    assert math.isclose(counts["speech"], 461.4e6, rel_tol=1e-3)
    truncated = mc.original_config("full", text_layers=2, vision_layers=2, audio_blocks=2)
    assert truncated["img_processor"]["num_hidden_layers"] == 2
    assert truncated["img_processor"]["hidden_size"] == 1152
    assert truncated["num_hidden_layers"] == 2 and truncated["audio_processor"]["config"]["num_blocks"] == 2


def test_tokenizer_special_ids_and_chat_template(original_dir):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(original_dir)
    assert len(tokenizer) == 200064
    expected = {"<|endoftext|>": 199999, "<|endoftext10|>": 200010, "<|endoftext11|>": 200011,
                "<|assistant|>": 200019, "<|end|>": 200020, "<|user|>": 200021, "<|system|>": 200022}  # fmt: skip
    assert tokenizer.convert_tokens_to_ids(list(expected)) == list(expected.values())
    assert tokenizer.convert_tokens_to_ids(["<|endoftext0|>", "<|endoftext18|>", "<|dummy_0|>", "<|dummy_34|>"]) == [
        200000, 200018, 200029, 200063,
    ]  # fmt: skip
    # the original's tool tokens; the call markers are not special, so decoding keeps them in the text
    tools = {"<|tool|>": 200023, "<|/tool|>": 200024, "<|tool_call|>": 200025, "<|/tool_call|>": 200026,
             "<|tool_response|>": 200027, "<|tag|>": 200028}  # fmt: skip
    assert tokenizer.convert_tokens_to_ids(list(tools)) == list(tools.values())
    call = '<|tool_call|>[{"name": "f", "arguments": {}}]<|/tool_call|>'
    assert tokenizer.decode(tokenizer(call).input_ids, skip_special_tokens=True) == call
    assert tokenizer("<|tool|>").input_ids == [200023] and tokenizer.decode([200023], skip_special_tokens=True) == ""
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.pad_token_id == 199999
    ids = tokenizer(PROMPT).input_ids
    assert ids[0] == 200021 and ids[-2:] == [200020, 200019] and len(ids) <= 6
    assert tokenizer.decode(ids) == PROMPT
    text = "Héllo wörld, 日本語! Describe the image."
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>"
    messages[0]["tools"] = '[{"name": "f"}]'
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == '<|system|>Be brief.<|tool|>[{"name": "f"}]<|/tool|><|end|><|user|>hi<|end|><|assistant|>'


def test_tokenizer_loads_in_onnxruntime_genai(original_dir, tmp_path):
    import onnxruntime_genai as og
    from transformers import PreTrainedTokenizerFast

    # og builds a Tokenizer from a model folder: the tokenizer files plus a genai_config.json (no graph is loaded).
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(original_dir / name, tmp_path / name)
    genai_config = {
        "model": {
            "bos_token_id": 199999, "eos_token_id": [200020, 199999], "pad_token_id": 199999, "type": "phi3",
            "vocab_size": 200064, "context_length": 4096,
            "decoder": {
                "filename": "absent.onnx", "head_size": 64, "hidden_size": 256, "num_attention_heads": 4,
                "num_hidden_layers": 2, "num_key_value_heads": 2,
                "inputs": {INPUT_IDS: "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"max_length": 64},
    }  # fmt: skip
    (tmp_path / GENAI_CONFIG_FILE).write_text(json.dumps(genai_config))
    tokenizer = og.Tokenizer(str(tmp_path))
    reference = PreTrainedTokenizerFast.from_pretrained(original_dir)
    for text in (PROMPT, "<|system|>sys<|end|><|user|><|endoftext10|><|endoftext11|>Describe the image.<|end|>"):
        ids = tokenizer.encode(text)
        assert ids.tolist() == reference(text).input_ids
    tokenizer.update_options(skip_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode(PROMPT)) == PROMPT
    messages = json.dumps([{"role": "user", "content": "hi"}])
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == "<|user|>hi<|end|><|assistant|>"
