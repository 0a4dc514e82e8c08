"""The encoders and the placeholder scatter on the native modules, from the tensors onnxruntime-genai's
MultiModalProcessor produces (used by `Reference` and by verify's streaming reference).

- Audio projection: the ``*_vision_speech`` pair iff an image is present, else the ``*_for_speech`` pair.
- Audio clips are encoded one at a time, trimmed to their valid frames and without a mask, as the original does for a
  single clip (the native batched path leaks padding: a clip batched with longer ones gets other features).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from transformers import Phi4MultimodalConfig, Phi4MultimodalVisionConfig

from builder_plugin.layout import INPUT_IDS
from builder_plugin.reference.errors import ReferenceModelError


def as_tensor(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(np.asarray(value)))
    return tensor.to(dtype) if dtype is not None else tensor


def count_image_tokens(vision: Phi4MultimodalVisionConfig, image_attention_mask: Any, image_sizes: Any) -> list[int]:
    """Feature rows per image, from the HD canvas size and the crop masks: the useful sub-crop grid (uh rows of uw + 1,
    the last a separator), one global separator, the global crop (G rows of G + 1), G the 2x2-pooled side."""
    mask = as_tensor(image_attention_mask, torch.float32)
    sizes = as_tensor(image_sizes, torch.int64).view(-1, 2)
    patches = vision.image_size // vision.patch_size
    grid = (patches + 1) // 2  # side of the 2x2-pooled grid (the native pads odd sides by reflection)
    counts = []
    for index in range(sizes.shape[0]):
        h, w = (int(v) // vision.crop_size for v in sizes[index])
        sub = (
            mask[index, 1 : 1 + h * w, 0::2, 0::2]
            .reshape(h, w, grid, grid)
            .transpose(1, 2)
            .reshape(h * grid, w * grid)
        )
        useful_h, useful_w = int(sub[:, 0].sum()), int(sub[0, :].sum())
        counts.append(grid * (grid + 1) + 1 + useful_h * (useful_w + 1))
    return counts


@torch.no_grad()
def encode_images(image_embed: torch.nn.Module, config: Phi4MultimodalConfig, pixel_values: Any,
                  image_attention_mask: Any, image_sizes: Any) -> torch.Tensor:
    """[sum of image tokens, hidden] fp32 from a native Phi4MultimodalImageEmbedding, images in order."""
    pixels = as_tensor(pixel_values, torch.float32)
    mask = as_tensor(image_attention_mask, torch.float32)
    sizes = as_tensor(image_sizes, torch.int64)
    if pixels.dim() != 5 or mask.dim() != 4 or pixels.shape[:2] != mask.shape[:2]:
        raise ReferenceModelError(
            f"expected pixel_values [images, crops, C, H, W] and image_attention_mask [images, crops, h, w], got "
            f"{tuple(pixels.shape)} and {tuple(mask.shape)}"
        )
    total = sum(count_image_tokens(config.vision_config, mask, sizes))
    # The native ImageEmbedding runs SigLIP, the HD assembly and the projection, then scatters into the
    # placeholder positions; with placeholders only, its output is the feature matrix itself.
    ids = torch.full((1, total), config.vision_config.image_token_id, dtype=torch.long)
    canvas = torch.zeros(1, total, config.hidden_size, dtype=torch.float32)
    try:
        out = image_embed(ids, canvas, image_pixel_values=pixels, image_sizes=sizes, image_attention_mask=mask)
    except RuntimeError as exc:
        raise ReferenceModelError(f"native image embedding disagrees with the expected {total} rows: {exc}") from exc
    return out[0]


@torch.no_grad()
def encode_audio(audio_embed: torch.nn.Module, config: Phi4MultimodalConfig, audio_embeds: Any,
                 audio_attention_mask: Any, audio_sizes: Any, projection: str) -> torch.Tensor:
    """[sum(audio_sizes), hidden] fp32 from a native Phi4MultimodalAudioEmbedding; each clip encoded alone on its
    valid frames, then projected by the ``projection`` pair ("speech" or "vision")."""
    if projection not in ("speech", "vision"):
        raise ReferenceModelError(f"projection must be 'speech' or 'vision', got {projection!r}")
    features = as_tensor(audio_embeds, torch.float32)
    sizes = [int(s) for s in as_tensor(audio_sizes, torch.int64).reshape(-1)]
    if features.dim() != 3 or features.shape[0] != len(sizes):
        raise ReferenceModelError(
            f"expected audio_embeds [clips, frames, mel] with one audio_size per clip, got "
            f"{tuple(features.shape)} and {len(sizes)} sizes"
        )
    if audio_attention_mask is None:
        valid_frames = [features.shape[1]] * len(sizes)
    else:
        mask = as_tensor(audio_attention_mask).to(torch.bool)
        valid_frames = [int(n) for n in mask.sum(dim=1)]
        for clip, n in enumerate(valid_frames):
            if not bool(mask[clip, :n].all()):
                raise ReferenceModelError(f"audio_attention_mask of clip {clip} is not a prefix of valid frames")
    if projection == "speech":
        up, down = audio_embed.up_proj_for_speech, audio_embed.down_proj_for_speech
    else:
        up, down = audio_embed.up_proj_for_vision_speech, audio_embed.down_proj_for_vision_speech
    rows = []
    for clip, (frames, size) in enumerate(zip(valid_frames, sizes)):
        # One clip, no mask: what the original passes for a single clip (batched native audio leaks padding).
        hidden = audio_embed.encoder(features[clip : clip + 1, :frames], None)
        if size > hidden.shape[1]:
            raise ReferenceModelError(
                f"audio clip {clip}: audio_sizes asks for {size} rows but {frames} frames give {hidden.shape[1]}"
            )
        # project all rows, then keep the first `size`, in the native order of operations
        rows.append(down(torch.nn.functional.gelu(up(hidden)))[0, :size])
    if not rows:
        return torch.zeros(0, config.hidden_size)
    return torch.cat(rows, dim=0)


def scatter_features(config: Phi4MultimodalConfig, ids: torch.Tensor, embeds: torch.Tensor,
                     image_features: torch.Tensor | None, audio_features: torch.Tensor | None) -> torch.Tensor:
    """`embeds` [B, S, hidden] of `ids` with image rows over the image placeholders and audio rows over the audio
    ones; the placeholder counts must equal the feature rows."""
    for token_id, features, what in (
        (config.vision_config.image_token_id, image_features, "image"),
        (config.audio_config.audio_token_id, audio_features, "audio"),
    ):
        positions = torch.nonzero(ids == token_id, as_tuple=True)
        rows = 0 if features is None else int(features.shape[0])
        if positions[0].numel() != rows:
            raise ReferenceModelError(
                f"input_ids has {positions[0].numel()} {what} placeholders ({token_id}) but {rows} {what} "
                "feature rows were given"
            )
        if rows:
            embeds = embeds.index_put(positions, features.to(embeds.dtype), accumulate=False)
    return embeds


def encode_inputs(
    image_embed: torch.nn.Module, audio_embed: torch.nn.Module, config: Phi4MultimodalConfig, inputs: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, str | None]:
    """The processor tensors of onnxruntime-genai's MultiModalProcessor -> (input_ids [1, S], image features or None,
    audio features or None, audio projection used or None), checked for consistency. The audio projection follows
    the input mode as in the original model: the vision pair iff an image is present."""
    ids = as_tensor(inputs[INPUT_IDS], torch.long)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ReferenceModelError(f"input_ids must be [1, S] (batch 1, as ORT GenAI), got {tuple(ids.shape)}")
    has_image = "pixel_values" in inputs and np.asarray(inputs["pixel_values"]).shape[0] > 0
    has_audio = "audio_embeds" in inputs and np.asarray(inputs["audio_embeds"]).shape[0] > 0
    if "audio_projection_mode" in inputs:
        given = int(np.asarray(inputs["audio_projection_mode"]).reshape(-1)[0])
        expected = (2 if has_audio else 0) + (1 if has_image else 0)
        if given != expected:
            raise ReferenceModelError(
                f"audio_projection_mode {given} does not match the inputs (image: {has_image}, audio: {has_audio})"
            )

    image_features = None
    if has_image:
        counts = count_image_tokens(config.vision_config, inputs["image_attention_mask"], inputs["image_sizes"])
        if "num_image_tokens" in inputs:
            given_counts = [int(n) for n in np.asarray(inputs["num_image_tokens"]).reshape(-1)]
            if given_counts != counts:
                raise ReferenceModelError(f"num_image_tokens {given_counts} != image token counts {counts}")
        image_features = encode_images(
            image_embed, config, inputs["pixel_values"], inputs["image_attention_mask"], inputs["image_sizes"]
        )
    projection = None
    audio_features = None
    if has_audio:
        projection = "vision" if has_image else "speech"
        audio_features = encode_audio(
            audio_embed, config, inputs["audio_embeds"], inputs.get("audio_attention_mask"), inputs["audio_sizes"],
            projection,
        )
    return ids, image_features, audio_features, projection
