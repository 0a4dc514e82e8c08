"""Images and audio from outside (files an app names, bytes a client sends), decoded safely before onnxruntime-genai
sees them: Pillow and libsndfile in a separate process with limits and a time bound, handing back canonical PNG and
16-bit PCM WAV bytes (limits.py says which formats and limits). Used by the runtime, the server and verify."""

from builder_plugin.media.decoder import Media, MediaDecoder, MediaError, MediaNotFoundError
from builder_plugin.media.limits import AUDIO_FORMATS, CANONICAL, IMAGE_FORMATS, MIN_SAMPLE_RATE, MediaLimits

__all__ = [
    "AUDIO_FORMATS",
    "CANONICAL",
    "IMAGE_FORMATS",
    "MIN_SAMPLE_RATE",
    "Media",
    "MediaDecoder",
    "MediaError",
    "MediaLimits",
    "MediaNotFoundError",
]
