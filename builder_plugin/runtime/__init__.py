"""Run a built phi4mm package with onnxruntime-genai: one chat conversation, streamed answers, images and audio.

App-facing and light: it needs only onnxruntime-genai, numpy, Pillow, soundfile and the standard library (no torch, no
builder code).
`Chat` is the entry point; see its module for how input modes, follow-up questions and long conversations are run.
"""

from builder_plugin.layout import GENAI_CONFIG_FILE, MANIFEST_FILE, mode_of
from builder_plugin.layout import INPUT_MODES as MODES
from builder_plugin.media import Media, MediaDecoder, MediaLimits
from builder_plugin.runtime.chat import FOLLOW_UP_ROOM, Answering, Chat, Generation, generate
from builder_plugin.runtime.conversation import Conversation
from builder_plugin.runtime.decoding import Sampling, Stats, Step
from builder_plugin.runtime.errors import (
    ChatError,
    GuidanceError,
    MediaNotFoundError,
    PackageError,
    PromptTooLongError,
    TagMismatchError,
    ToolsNotSupportedError,
    UnsupportedMediaError,
)
from builder_plugin.runtime.guidance import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Guidance
from builder_plugin.runtime.manifest import Manifest
from builder_plugin.runtime.media import default_decoder, og_audios, og_images, open_audio, open_image
from builder_plugin.runtime.package import Package, og_model
from builder_plugin.runtime.prompt import TOOL, USER, Turn, build_prompt, check_tags, tool_results, user_content
from builder_plugin.runtime.tokens import MAX_TOP_LOGPROBS, Alternative, TokenLogprob

__all__ = [
    "FOLLOW_UP_ROOM",
    "GENAI_CONFIG_FILE",
    "MANIFEST_FILE",
    "MAX_TOP_LOGPROBS",
    "MODES",
    "TOOL",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "USER",
    "Alternative",
    "Answering",
    "Chat",
    "ChatError",
    "Conversation",
    "Generation",
    "Guidance",
    "GuidanceError",
    "Manifest",
    "Media",
    "MediaDecoder",
    "MediaLimits",
    "MediaNotFoundError",
    "Package",
    "PackageError",
    "PromptTooLongError",
    "Sampling",
    "Stats",
    "Step",
    "TagMismatchError",
    "TokenLogprob",
    "ToolsNotSupportedError",
    "Turn",
    "UnsupportedMediaError",
    "build_prompt",
    "check_tags",
    "default_decoder",
    "generate",
    "mode_of",
    "og_audios",
    "og_images",
    "og_model",
    "open_audio",
    "open_image",
    "tool_results",
    "user_content",
]
