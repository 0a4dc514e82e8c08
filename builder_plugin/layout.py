"""The package layout, stated once: the components, the files a package holds, the tensors one graph hands
another, and the input modes.

Standard library only, so the app helper (`builder_plugin.runtime`, which needs nothing but onnxruntime-genai) reads
the same names as the builder, the genai_config writer, verify and the benchmarks.
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

# The runtime needs these three graphs to load a phi4mm package at all; speech is optional. A build of fewer writes
# the graphs only (no runtime configuration).
RUNNABLE_MINIMUM = frozenset({Component.VISION, Component.EMBEDDING, Component.DECODER})

# The runtime configuration files a runnable package holds.
GENAI_CONFIG_FILE = "genai_config.json"
VISION_PROCESSOR_FILE = "vision_processor.json"
SPEECH_PROCESSOR_FILE = "speech_processor.json"
MANIFEST_FILE = "manifest.json"  # also in a graphs-only package: where it came from
# The tokenizer files the runtime reads, copied from the checkpoint as they are.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES: tuple[str, ...] = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json",
                                    "added_tokens.json")
# Copied besides them: the checkpoint's sampling defaults, for an app to read (genai_config.json states them too).
GENERATION_CONFIG_FILE = "generation_config.json"

# The tensors one graph hands another, and the runtime's names for what it feeds and reads.
INPUT_IDS = "input_ids"  # token ids with the media placeholders: the embedding's input (and a routed decoder's)
IMAGE_FEATURES = "image_features"  # vision -> embedding
AUDIO_FEATURES = "audio_features"  # speech -> embedding
INPUTS_EMBEDS = "inputs_embeds"  # embedding -> decoder
LOGITS = "logits"  # the decoder's output the runtime samples from

# The input mode of a conversation, as the original model chooses its LoRA (`mode_of`). In this order manifest.json
# lists the decoder of each mode.
INPUT_MODES: tuple[str, ...] = ("text", "vision", "speech")
# The LoRA adapter the original model runs in each input mode ("none": the base weights).
MODE_LORA: dict[str, str] = {"text": "none", "vision": "vision", "speech": "speech"}

# The placeholder ids of one image-feature row / one audio-feature row in `input_ids`: onnxruntime-genai's phi4mm
# processor expands these fixed ids (<|endoftext10|>, <|endoftext11|>), and a checkpoint that states none has them.
IMAGE_TOKEN_ID = 200010
AUDIO_TOKEN_ID = 200011


def mode_of(has_image: bool, has_audio: bool) -> str:
    """The input mode of a conversation: any image -> vision (also with audio), else audio -> speech, else text."""
    return "vision" if has_image else "speech" if has_audio else "text"


# (has_image, has_audio) of a conversation in each input mode, as mode_of reads them (vision: without audio here).
MODE_MEDIA: dict[str, tuple[bool, bool]] = {"text": (False, False), "vision": (True, False), "speech": (False, True)}


# The decoder file of each input mode in a split build (--lora split): one file per mode, base weights shared.
SPLIT_DECODERS: dict[str, str] = {
    "text": "phi-4-mm-text-base.onnx",  # no LoRA
    "vision": MAIN_DECODER,  # vision LoRA: images, and images + audio
    "speech": "phi-4-mm-text-speech.onnx",  # speech LoRA: audio only
}
# The decoder of each input mode that a routed CPU int4 / int8 build writes besides its routed decoder: the routed
# decoder's I/O, the mode's adapter always applied (no If nodes), the same data file. The split build's names where
# its file answers the same (text, speech); vision has its own, the split build's being the main decoder's name.
MODE_DECODERS: dict[str, str] = {
    "text": SPLIT_DECODERS["text"],
    "vision": "phi-4-mm-text-vision.onnx",
    "speech": SPLIT_DECODERS["speech"],
}
