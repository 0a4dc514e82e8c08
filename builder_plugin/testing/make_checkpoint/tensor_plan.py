"""Which tensors a checkpoint holds: transformers' native module's state dict, renamed to the original keys by one
table, plus the LoRA pairs of every adapted decoder projection."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import torch

from builder_plugin.testing.make_checkpoint.tensors import LORA_RELATIVE_DELTA, PlannedTensor, distribution

if TYPE_CHECKING:
    from transformers import Phi4MultimodalConfig


# native name pattern -> original name template; first match wins, and every native name must match one row.
_IMAGE_EMBED = r"model\.embed_tokens_extend\.image_embed"
_AUDIO_EMBED = r"model\.embed_tokens_extend\.audio_embed"
NATIVE_TO_ORIGINAL: tuple[tuple[str, str | None], ...] = (
    (r"lm_head\.weight", None),  # tied to model.embed_tokens.weight, absent from the checkpoint
    (r"model\.layers\.(\d+)\.(self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj))\.weight",
     r"model.layers.\1.\2.base_layer.weight"),
    (r"model\.(embed_tokens\.weight|norm\.weight|layers\.\d+\.(?:input|post_attention)_layernorm\.weight)",
     r"model.\1"),
    (_IMAGE_EMBED + r"\.global_img_feature_extensor", r"model.embed_tokens_extend.image_embed.glb_GN"),
    (_IMAGE_EMBED + r"\.sub_img_feature_extensor", r"model.embed_tokens_extend.image_embed.sub_GN"),
    (_IMAGE_EMBED + r"\.img_projection_up\.(weight|bias)",
     r"model.embed_tokens_extend.image_embed.img_projection.0.\1"),
    (_IMAGE_EMBED + r"\.img_projection_down\.(weight|bias)",
     r"model.embed_tokens_extend.image_embed.img_projection.2.\1"),
    (_IMAGE_EMBED + r"\.img_processor\.("
     r"embeddings\.(?:patch_embedding\.(?:weight|bias)|position_embedding\.weight)"
     r"|encoder\.layers\.\d+\.(?:layer_norm[12]|mlp\.fc[12]|self_attn\.(?:q|k|v|out)_proj)\.(?:weight|bias)"
     r"|post_layernorm\.(?:weight|bias)"
     r"|head\.(?:probe|attention\.in_proj_(?:weight|bias)|attention\.out_proj\.(?:weight|bias)"
     r"|layernorm\.(?:weight|bias)|mlp\.fc[12]\.(?:weight|bias)))",
     r"model.embed_tokens_extend.image_embed.img_processor.\1"),
    (_AUDIO_EMBED + r"\.up_proj_for_speech\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.audio_projection.speech.0.\1"),
    (_AUDIO_EMBED + r"\.down_proj_for_speech\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.audio_projection.speech.2.\1"),
    (_AUDIO_EMBED + r"\.up_proj_for_vision_speech\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.audio_projection.vision.0.\1"),
    (_AUDIO_EMBED + r"\.down_proj_for_vision_speech\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.audio_projection.vision.2.\1"),
    (_AUDIO_EMBED + r"\.encoder\.encoders\.(\d+)\.(feed_forward_(?:in|out))\.gate_up_proj\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.encoder.encoders.\1.\2.net.0.linear.\3"),
    (_AUDIO_EMBED + r"\.encoder\.encoders\.(\d+)\.(feed_forward_(?:in|out))\.down_proj\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.encoder.encoders.\1.\2.net.2.\3"),
    (_AUDIO_EMBED + r"\.encoder\.encoders\.(\d+)\.self_attn\.(q|k|v)_proj\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.encoder.encoders.\1.self_attn.linear_\2.\3"),
    (_AUDIO_EMBED + r"\.encoder\.encoders\.(\d+)\.self_attn\.o_proj\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.encoder.encoders.\1.self_attn.linear_out.\2"),
    (_AUDIO_EMBED + r"\.encoder\.(encoders\.\d+\.(?:"
     r"feed_forward_(?:in|out)\.layer_norm\.(?:weight|bias)"
     r"|conv\.(?:layer_norm|glu\.ext_pw_conv_1d|dw_sep_conv_1d\.dw_conv|dw_sep_conv_1d\.pw_conv|ext_pw_conv_1d)"
     r"\.(?:weight|bias)"
     r"|conv\.glu\.b[12]"
     r"|(?:layer_norm_att|layer_norm)\.(?:weight|bias)))",
     r"model.embed_tokens_extend.audio_embed.encoder.\1"),
    (_AUDIO_EMBED + r"\.encoder\.(embed\.(?:conv\.\d+|out)\.(?:weight|bias)"
     r"|encoder_embedding\.global_(?:mean|invstd)"
     r"|relative_attention_bias_layer\.bias_values\.weight)",
     r"model.embed_tokens_extend.audio_embed.encoder.\1"),
)  # fmt: skip
_NATIVE_TO_ORIGINAL_COMPILED = tuple((re.compile(pattern), target) for pattern, target in NATIVE_TO_ORIGINAL)
_LORA_TARGET = re.compile(r"model\.layers\.\d+\.(?:self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj))")



class UncoveredTensorError(KeyError):
    """A native tensor name that the rename table does not cover (the native module changed)."""


def original_name(native_name: str) -> str | None:
    """Original checkpoint key of a native key; None for the tied lm_head."""
    for pattern, target in _NATIVE_TO_ORIGINAL_COMPILED:
        match = pattern.fullmatch(native_name)
        if match:
            return None if target is None else match.expand(target)
    raise UncoveredTensorError(f"native tensor {native_name!r} is not covered by NATIVE_TO_ORIGINAL")


def native_state_shapes(config: Phi4MultimodalConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict entry of Phi4MultimodalForCausalLM (parameters and persistent buffers) with its shape."""
    from transformers import Phi4MultimodalForCausalLM

    with torch.device("meta"):
        model = Phi4MultimodalForCausalLM(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def plan_tensors(original: dict[str, Any], native_shapes: dict[str, tuple[int, ...]]) -> list[PlannedTensor]:
    hidden = original["hidden_size"]
    loras = {name: original[f"{name}_lora"] for name in ("vision", "speech")}
    plan = []
    for native_name, shape in native_shapes.items():
        name = original_name(native_name)
        if name is None:
            if not original["tie_word_embeddings"]:
                raise AssertionError("lm_head.weight is only dropped for tied embeddings")
            continue
        mean, std, log_normal = distribution(native_name, shape, hidden)
        plan.append(PlannedTensor(name, native_name, None, None, shape, mean, std, log_normal))
        module = native_name.removesuffix(".weight")
        if _LORA_TARGET.fullmatch(module):
            out_features, in_features = shape
            for adapter, lora in loras.items():
                r, scaling = int(lora["r"]), lora["lora_alpha"] / lora["r"]
                b_std = LORA_RELATIVE_DELTA / (scaling * math.sqrt(r))
                for part, part_shape, part_std in (
                    ("lora_A", (r, in_features), 1.0 / math.sqrt(in_features)),
                    ("lora_B", (out_features, r), b_std),
                ):
                    plan.append(
                        PlannedTensor(
                            original_name=f"{module}.{part}.{adapter}.weight",
                            native_name=None,
                            adapter=adapter,
                            peft_name=f"base_model.model.{module}.{part}.weight",
                            shape=part_shape,
                            mean=0.0,
                            std=part_std,
                        )
                    )
    return plan
