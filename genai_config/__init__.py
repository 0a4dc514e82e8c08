"""Writers for the runtime configuration files of a phi4mm package (genai_config.json, processor configs)."""

from genai_config.processors import speech_processor_config, vision_processor_config
from genai_config.writer import default_max_length, make_genai_config, write_json

__all__ = [
    "default_max_length",
    "make_genai_config",
    "speech_processor_config",
    "vision_processor_config",
    "write_json",
]
