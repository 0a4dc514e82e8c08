"""The cases verify runs: a built-in prompt per input mode, built-in media generated in-process, and the user's own
prompts and media."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from builder_plugin.media import Media
from builder_plugin.runtime.media import open_audio, open_image
from builder_plugin.testing.media import make_image, make_wav

BUILTIN_PROMPTS: dict[str, str] = {
    "text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "image": "Describe this image in detail.",
    "audio": "Transcribe the audio clip.",
    "image+audio": "Does the audio describe the image? Answer, then explain.",
}

# Generated, not downloaded and not spoken by an external tool, so verify runs anywhere: a 448x448 picture (one HD
# crop plus the global view) and a 2 s clip of tones.
BUILTIN_IMAGE = ("builtin-image-448x448.png", 448, 448)
BUILTIN_AUDIO = ("builtin-tones-2s-16k.wav", 2.0, 16000)

@dataclass(frozen=True)
class Case:
    name: str
    mode: str  # one of verify.modes.VERIFY_MODES
    question: str
    images: tuple[Media, ...] = ()  # decoded safely (runtime.open_image): the package is given canonical bytes
    audios: tuple[Media, ...] = ()

    @property
    def prompt(self) -> str:
        """One user turn in the Phi-4-multimodal chat format, a placeholder tag per image and clip."""
        tags = "".join(f"<|image_{i}|>" for i in range(1, len(self.images) + 1))
        tags += "".join(f"<|audio_{i}|>" for i in range(1, len(self.audios) + 1))
        return f"<|user|>{tags}{self.question}<|end|><|assistant|>"


def builtin_media(folder: Path) -> tuple[Media, Media]:
    """(image, audio clip) written into `folder`, decoded."""
    name, width, height = BUILTIN_IMAGE
    image = make_image(folder / name, width, height, seed=2)
    name, seconds, rate = BUILTIN_AUDIO
    return open_image(image), open_audio(make_wav(folder / name, seconds, sample_rate=rate, seed=3))


def build_cases(modes: Sequence[str], media_folder: Path, prompts: Sequence[str] = (),
                images: Sequence[Path] = (), audios: Sequence[Path] = ()) -> list[Case]:
    """The built-in prompt of each mode, then each of the user's `prompts`, in every mode. The user's images and
    clips, if any, replace the built-in ones (all of them go into every case of a mode that takes them)."""
    images = tuple(open_image(p) for p in images)
    audios = tuple(open_audio(p) for p in audios)
    if not images or not audios:
        builtin_image, builtin_audio = builtin_media(media_folder)
        images = images or (builtin_image,)
        audios = audios or (builtin_audio,)
    cases = []
    for mode in modes:
        with_images = images if "image" in mode else ()
        with_audios = audios if "audio" in mode else ()
        for index, question in enumerate((BUILTIN_PROMPTS[mode], *prompts)):
            name = mode if index == 0 else f"{mode} #{index + 1}"
            cases.append(Case(name, mode, question, with_images, with_audios))
    return cases
