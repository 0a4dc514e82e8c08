"""Key renaming: the original (remote-code) checkpoint's tensor names as the native model's, and the LoRA key forms of
both layouts."""

from __future__ import annotations

import re

# Text-decoder Linear layers that carry LoRA; a module path relative to Phi4MultimodalForCausalLM.
LORA_TARGET = re.compile(r"model\.layers\.\d+\.(?:self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj))")
ORIGINAL_LORA_KEY = re.compile(rf"^({LORA_TARGET.pattern})\.lora_([AB])\.([A-Za-z0-9_]+)\.weight$")
PEFT_LORA_KEY = re.compile(rf"({LORA_TARGET.pattern})\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")

_IMAGE_EMBED = r"model\.embed_tokens_extend\.image_embed"
_AUDIO_EMBED = r"model\.embed_tokens_extend\.audio_embed"
# Original (remote-code) key -> native key. First match wins; keys matching no rule keep their name and are then
# caught by the strict load (unexpected key), so a stale table cannot pass silently.
ORIGINAL_TO_NATIVE_KEYS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (rf"^({LORA_TARGET.pattern})\.base_layer\.weight$", r"\1.weight"),
        (rf"^({_IMAGE_EMBED})\.glb_GN$", r"\1.global_img_feature_extensor"),
        (rf"^({_IMAGE_EMBED})\.sub_GN$", r"\1.sub_img_feature_extensor"),
        (rf"^({_IMAGE_EMBED})\.img_projection\.0\.(weight|bias)$", r"\1.img_projection_up.\2"),
        (rf"^({_IMAGE_EMBED})\.img_projection\.2\.(weight|bias)$", r"\1.img_projection_down.\2"),
        (rf"^({_AUDIO_EMBED})\.audio_projection\.speech\.0\.(weight|bias)$", r"\1.up_proj_for_speech.\2"),
        (rf"^({_AUDIO_EMBED})\.audio_projection\.speech\.2\.(weight|bias)$", r"\1.down_proj_for_speech.\2"),
        (rf"^({_AUDIO_EMBED})\.audio_projection\.vision\.0\.(weight|bias)$", r"\1.up_proj_for_vision_speech.\2"),
        (rf"^({_AUDIO_EMBED})\.audio_projection\.vision\.2\.(weight|bias)$", r"\1.down_proj_for_vision_speech.\2"),
        (rf"^({_AUDIO_EMBED}\.encoder\.encoders\.\d+\.feed_forward_(?:in|out))\.net\.0\.linear\.(weight|bias)$",
         r"\1.gate_up_proj.\2"),
        (rf"^({_AUDIO_EMBED}\.encoder\.encoders\.\d+\.feed_forward_(?:in|out))\.net\.2\.(weight|bias)$",
         r"\1.down_proj.\2"),
        (rf"^({_AUDIO_EMBED}\.encoder\.encoders\.\d+\.self_attn)\.linear_([qkv])\.(weight|bias)$", r"\1.\2_proj.\3"),
        (rf"^({_AUDIO_EMBED}\.encoder\.encoders\.\d+\.self_attn)\.linear_out\.(weight|bias)$", r"\1.o_proj.\2"),
    )
)


def rename_original_key(key: str) -> str:
    """Original checkpoint key -> native key (LoRA keys are handled separately)."""
    key = key.replace("._checkpoint_wrapped_module.", ".")
    for pattern, replacement in ORIGINAL_TO_NATIVE_KEYS:
        if pattern.match(key):
            return pattern.sub(replacement, key)
    return key
