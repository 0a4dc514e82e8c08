"""onnxruntime-extensions processor configs for the phi4mm runtime (vision_processor.json, speech_processor.json).

Both carry the output aligner the runtime needs (without it images get a garbage mask and audio is silently dropped),
and the speech config sets ``max_samples: 0`` so audio longer than 30 s is not silently truncated.
"""

from __future__ import annotations

from typing import Any

from builder_plugin.config import DEFAULT_DYNAMIC_HD


def vision_processor_config(crop_size: int, dynamic_hd: int = DEFAULT_DYNAMIC_HD) -> dict[str, Any]:
    def op(name: str, kind: str, attrs: dict[str, Any] | None = None, inputs: list[str] | None = None) -> dict:
        body: dict[str, Any] = {"name": name, "type": kind}
        if inputs:
            body["inputs"] = inputs
        if attrs:
            body["attrs"] = attrs
        return {"operation": body}

    return {
        "processor": {
            "name": "phi_4_vision_processor",
            "transforms": [
                op("decode_image", "DecodeImage", {"color_space": "RGB"}),
                op("phi4_vision_dynamic_preprocess", "Phi4VisionDynamicPreprocess",
                   {"dynamic_hd": dynamic_hd, "dyhd_base_resolution": crop_size}),
                op("rescale", "Rescale", inputs=[":0"]),
                op("normalize", "Normalize", {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}),
                op("phi4_vision_processor", "Phi4VisionProcessor",
                   {"dyhd_base_resolution": crop_size, "interpolation": "CUBIC"},
                   inputs=[":0", "phi4_vision_dynamic_preprocess:1"]),
            ],
            "output_aligner": "phi4-vision-aligner",
        }
    }


def speech_processor_config(compression_rate: int, num_mel_bins: int = 80) -> dict[str, Any]:
    def stft(n_fft: int, frame: int, hop: int) -> dict[str, Any]:
        return {"n_fft": n_fft, "frame_length": frame, "hop_length": hop, "win_fn": "hamming"}

    def logmel(hop: int) -> dict[str, Any]:
        return {"chunk_size": 30, "hop_length": hop, "n_fft": 512, "n_mel": num_mel_bins, "feature_first": 0,
                "no_padding": 1}

    attrs: dict[str, Any] = {"audio_compression_rate": compression_rate}
    for prefix, values in (("stft_normal", stft(512, 400, 160)), ("logmel", logmel(160)),
                           ("stft_normal_8k", stft(256, 200, 80)), ("logmel_8k", logmel(80))):
        attrs.update({f"{prefix}/{k}": v for k, v in values.items()})
    return {
        "feature_extraction": {
            "sequence": [
                {"operation": {"name": "audio_decoder", "type": "AudioDecoderEx",
                               "attrs": {"target_sample_rates": [8000, 16000], "max_samples": 0}}},
                {"operation": {"name": "phi_4_audio_embed", "type": "Phi4AudioEmbed", "attrs": attrs}},
            ],
            "output_aligner": "phi4-audio-aligner",
        }
    }
