"""The package layout, stated once: the components, the file each one is written to, and the input modes.

Standard library only, so the app helper (`builder_plugin.runtime`, which needs nothing but onnxruntime-genai) reads
the same names as the builder, the genai_config writer and the benchmarks.
"""

from __future__ import annotations

import enum


class Component(str, enum.Enum):
    VISION = "vision"
    SPEECH = "speech"
    EMBEDDING = "embedding"
    DECODER = "decoder"

    def __str__(self) -> str:
        return self.value


# The graph file of each component; for the decoder, the one genai_config.json names.
GRAPH_FILES: dict[Component, str] = {
    Component.VISION: "phi-4-mm-vision.onnx",
    Component.SPEECH: "phi-4-mm-speech.onnx",
    Component.EMBEDDING: "phi-4-mm-embedding.onnx",
    Component.DECODER: "phi-4-mm-text.onnx",
}

# The external data file of each component. The embedding and every decoder file share one, so the tensors they have
# in common (the token table, the base weights of a split build) are stored once.
DATA_FILES: dict[Component, str] = {
    Component.VISION: "phi-4-mm-vision.onnx.data",
    Component.SPEECH: "phi-4-mm-speech.onnx.data",
    Component.EMBEDDING: "phi-4-mm-text.onnx.data",
    Component.DECODER: "phi-4-mm-text.onnx.data",
}

MAIN_DECODER = GRAPH_FILES[Component.DECODER]

# The input mode of a conversation, as the original model chooses its LoRA: any image -> "vision" (also with audio),
# else audio -> "speech", else "text". In this order manifest.json lists the decoder of each mode.
INPUT_MODES: tuple[str, ...] = ("text", "vision", "speech")

# The decoder file of each input mode in a split build (--lora split): one file per mode, base weights shared.
SPLIT_DECODERS: dict[str, str] = {
    "text": "phi-4-mm-text-base.onnx",  # no LoRA
    "vision": MAIN_DECODER,  # vision LoRA: images, and images + audio
    "speech": "phi-4-mm-text-speech.onnx",  # speech LoRA: audio only
}
