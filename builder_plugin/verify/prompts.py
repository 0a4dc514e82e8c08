"""The cases verify runs: a built-in prompt per input mode, built-in media generated in-process, and the user's own
prompts and media."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from builder_plugin.testing.media import make_image, make_wav
from builder_plugin.verify.modes import MODES  # noqa: F401  - re-exported: a Case is in one of MODES

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

_IMAGE_FORMATS = {"PNG", "JPEG"}  # what onnxruntime-extensions decodes; other content ends the process inside it
_AUDIO_SUFFIXES = (".wav", ".mp3", ".flac")


class MediaError(ValueError):
    """A user's image or audio file cannot be used."""


@dataclass(frozen=True)
class Case:
    name: str
    mode: str  # one of MODES
    question: str
    images: tuple[Path, ...] = ()
    audios: tuple[Path, ...] = ()

    @property
    def prompt(self) -> str:
        """One user turn in the Phi-4-multimodal chat format, a placeholder tag per image and clip."""
        tags = "".join(f"<|image_{i}|>" for i in range(1, len(self.images) + 1))
        tags += "".join(f"<|audio_{i}|>" for i in range(1, len(self.audios) + 1))
        return f"<|user|>{tags}{self.question}<|end|><|assistant|>"


def check_image(path: Path) -> Path:
    if not path.is_file():
        raise MediaError(f"image not found: {path}")
    try:
        with Image.open(path) as image:
            kind = image.format
            image.verify()
    except (OSError, UnidentifiedImageError) as exc:
        raise MediaError(f"cannot read image {path}: {exc}") from None
    if kind not in _IMAGE_FORMATS:
        raise MediaError(f"cannot read image {path}: {kind} is not supported by the runtime (use PNG or JPEG)")
    return path


def check_audio(path: Path) -> Path:
    if not path.is_file():
        raise MediaError(f"audio file not found: {path}")
    if path.suffix.lower() not in _AUDIO_SUFFIXES:
        raise MediaError(f"cannot read audio {path}: the runtime reads {', '.join(_AUDIO_SUFFIXES)} files")
    return path


def builtin_media(folder: Path) -> tuple[Path, Path]:
    """(image, audio clip) written into `folder`."""
    name, width, height = BUILTIN_IMAGE
    image = make_image(folder / name, width, height, seed=2)
    name, seconds, rate = BUILTIN_AUDIO
    return image, make_wav(folder / name, seconds, sample_rate=rate, seed=3)


def build_cases(modes: Sequence[str], media_folder: Path, prompts: Sequence[str] = (),
                images: Sequence[Path] = (), audios: Sequence[Path] = ()) -> list[Case]:
    """The built-in prompt of each mode, then each of the user's `prompts`, in every mode. The user's images and
    clips, if any, replace the built-in ones (all of them go into every case of a mode that takes them)."""
    images = tuple(check_image(Path(p)) for p in images)
    audios = tuple(check_audio(Path(p)) for p in audios)
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
