"""Run a built phi4mm package with onnxruntime-genai: one chat conversation, streamed answers, images and audio.

App-facing and light: it needs only onnxruntime-genai, numpy and the standard library (no torch, no builder code).
`Chat` is the entry point; see its module for how input modes, follow-up questions and long conversations are run.
"""

from builder_plugin.runtime.chat import (
    FOLLOW_UP_ROOM,
    GENAI_CONFIG_FILE,
    Chat,
    Generation,
    Sampling,
    Stats,
    generate,
)
from builder_plugin.runtime.errors import (
    ChatError,
    MediaNotFoundError,
    PackageError,
    PromptTooLongError,
    TagMismatchError,
    UnsupportedMediaError,
)
from builder_plugin.runtime.manifest import MANIFEST_FILE, MODES, Manifest, mode_of
from builder_plugin.runtime.media import AUDIO_SUFFIXES, IMAGE_SUFFIXES, check_audio, check_image
from builder_plugin.runtime.prompt import Turn, build_prompt, check_tags, user_content

__all__ = [
    "AUDIO_SUFFIXES",
    "FOLLOW_UP_ROOM",
    "GENAI_CONFIG_FILE",
    "IMAGE_SUFFIXES",
    "MANIFEST_FILE",
    "MODES",
    "Chat",
    "ChatError",
    "Generation",
    "Manifest",
    "MediaNotFoundError",
    "PackageError",
    "PromptTooLongError",
    "Sampling",
    "Stats",
    "TagMismatchError",
    "Turn",
    "UnsupportedMediaError",
    "build_prompt",
    "check_audio",
    "check_image",
    "check_tags",
    "generate",
    "mode_of",
    "user_content",
]
