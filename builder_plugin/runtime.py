"""Run a built phi4mm package with onnxruntime-genai: one chat conversation, streamed answers, images and audio.

App-facing and light: it needs only onnxruntime-genai, numpy and the standard library (no torch, no builder code).

- Decoder variant per input mode. A routed package (``--lora routed``) has one text decoder per mode, because the
  runtime cannot switch LoRA adapters for phi4mm (contract §6.2): text only -> ``phi-4-mm-text-base.onnx`` (no LoRA),
  any image -> ``phi-4-mm-text.onnx`` (vision LoRA), audio only -> ``phi-4-mm-text-speech.onnx`` (speech LoRA). Other
  packages have the single decoder named in genai_config.json, used for everything. One ``og.Model`` is loaded per
  variant on first use and kept (each holds its own vision, speech and embedding sessions).
- Conversations: every question re-sends the whole history (text, and every image and audio clip so far) in a new
  ``og.Generator``, as the runtime requires for new media (contract §5); the mode, hence the variant, is that of the
  whole conversation. ``Chat.clear()`` starts over.
- Media are checked before the runtime sees them: the image decoder of onnxruntime-extensions reads PNG and JPEG only,
  and any other image content ends the process from inside its JPEG fallback, so image files are recognised by their
  signature first.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime_genai as og

GENAI_CONFIG_FILE = "genai_config.json"

# Decoder file per input mode in a routed package (the names builder_plugin.components.decoder writes).
VARIANT_FILES: dict[str, str] = {
    "text": "phi-4-mm-text-base.onnx",
    "vision": "phi-4-mm-text.onnx",
    "speech": "phi-4-mm-text-speech.onnx",
}

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
AUDIO_SUFFIXES = (".wav", ".mp3", ".flac")
_IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")

# Clearer wording for decoder messages of onnxruntime-extensions.
_DECODER_HINTS = {
    "only down-sampling supported": "sample rates below 8000 Hz are not supported",
    "Cannot detect audio stream format": "not a WAV, MP3 or FLAC file",
}

_TAG = re.compile(r"<\|(image|audio)_(\d+)\|>")
_PLACEHOLDER = re.compile(r"<\|endoftext1[01]\|>")


class ChatError(RuntimeError):
    """A problem the user can fix, with a one-line message."""


class PackageError(ChatError):
    """The package folder cannot be loaded."""


class MediaNotFoundError(ChatError):
    """An image or audio file does not exist."""


class UnsupportedMediaError(ChatError):
    """An image or audio file is not in a format the runtime reads."""


class TagMismatchError(ChatError):
    """The ``<|image_N|>`` / ``<|audio_N|>`` tags of a question do not match its attached files."""


class PromptTooLongError(ChatError):
    """The conversation does not fit in the maximum length."""


# ---- media --------------------------------------------------------------------------------------------------------


def check_image(path: str | Path) -> Path:
    """`path` as a Path if it is an existing PNG or JPEG file; raises MediaNotFoundError / UnsupportedMediaError."""
    path = _existing(path, "image")
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise UnsupportedMediaError(f"unsupported image format {path.suffix or '(no extension)'!r}: {path} "
                                    f"(use {', '.join(IMAGE_SUFFIXES)})")
    with open(path, "rb") as f:
        head = f.read(8)
    if not any(head.startswith(signature) for signature in _IMAGE_SIGNATURES):
        raise UnsupportedMediaError(f"not a PNG or JPEG image: {path}")
    return path


def check_audio(path: str | Path) -> Path:
    """`path` as a Path if it is an existing file with an audio extension the runtime decodes (its content is checked
    when the question is processed)."""
    path = _existing(path, "audio")
    if path.suffix.lower() not in AUDIO_SUFFIXES:
        raise UnsupportedMediaError(f"unsupported audio format {path.suffix or '(no extension)'!r}: {path} "
                                    f"(use {', '.join(AUDIO_SUFFIXES)})")
    return path


def _existing(path: str | Path, what: str) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise MediaNotFoundError(f"{what} file not found: {path}")
    if not path.is_file():
        raise MediaNotFoundError(f"{what} path is not a file: {path}")
    return path


# ---- prompts ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One question with its attached files and, once answered, the answer."""

    user: str
    images: tuple[Path, ...] = ()
    audios: tuple[Path, ...] = ()
    assistant: str | None = None


def check_tags(text: str, num_images: int, num_audios: int) -> None:
    """Raise TagMismatchError unless the tags written in `text` fit the attached files.

    A question may leave the tags out (they are then put before the text) or place them itself; tags of a kind must
    then be numbered 1..n in order, n being the number of files of that kind attached to this question."""
    if _PLACEHOLDER.search(text):
        raise TagMismatchError("write media tags as <|image_N|> / <|audio_N|>, not as <|endoftext10|> / "
                               "<|endoftext11|>")
    for kind, count in (("image", num_images), ("audio", num_audios)):
        numbers = [int(n) for k, n in _TAG.findall(text) if k == kind]
        if not numbers:
            continue
        if len(numbers) != count:
            written = " ".join(f"<|{kind}_{n}|>" for n in numbers)
            noun = {"image": "image", "audio": "audio clip"}[kind]
            attached = f"no {noun} is" if count == 0 else f"1 {noun} is" if count == 1 else f"{count} {noun}s are"
            raise TagMismatchError(f"the question has {len(numbers)} {kind} tag{'s' if len(numbers) != 1 else ''} "
                                   f"({written}) but {attached} attached")
        if numbers != list(range(1, count + 1)):
            expected = " ".join(f"<|{kind}_{n}|>" for n in range(1, count + 1))
            raise TagMismatchError(f"{kind} tags must be {expected} in this order (one per attached file)")


def user_content(turn: Turn, first_image: int = 1, first_audio: int = 1) -> str:
    """The user text of `turn` with its media tags numbered from `first_image` / `first_audio` (tags count across the
    whole conversation; the runtime takes files in order of appearance)."""
    check_tags(turn.user, len(turn.images), len(turn.audios))
    text = turn.user
    offsets = {"image": first_image - 1, "audio": first_audio - 1}
    text = _TAG.sub(lambda m: f"<|{m[1]}_{int(m[2]) + offsets[m[1]]}|>", text)
    written = {kind for kind, _ in _TAG.findall(turn.user)}
    prefix = ""
    if "image" not in written:
        prefix += "".join(f"<|image_{first_image + i}|>" for i in range(len(turn.images)))
    if "audio" not in written:
        prefix += "".join(f"<|audio_{first_audio + i}|>" for i in range(len(turn.audios)))
    return prefix + text


def build_prompt(turns: Sequence[Turn | str], system: str | None = None) -> str:
    """The Phi-4 chat prompt: ``<|system|>…<|end|>`` then ``<|user|>…<|end|><|assistant|>answer<|end|>`` per turn,
    ending with ``<|assistant|>`` after the last (unanswered) question. Plain strings are questions without media."""
    parts = [f"<|system|>{system}<|end|>"] if system else []
    images = audios = 0
    for i, turn in enumerate(turns):
        turn = Turn(turn) if isinstance(turn, str) else turn
        parts.append(f"<|user|>{user_content(turn, images + 1, audios + 1)}<|end|><|assistant|>")
        images += len(turn.images)
        audios += len(turn.audios)
        if turn.assistant is not None:
            parts.append(f"{turn.assistant}<|end|>")
        elif i != len(turns) - 1:
            raise ValueError("only the last turn may be unanswered")
    return "".join(parts)


# ---- generation ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """Search options of one answer; the default (all None) is greedy search."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    def search_options(self) -> dict[str, Any]:
        if self.temperature is None and self.top_p is None and self.top_k is None:
            return {"do_sample": False}
        if self.temperature is not None and self.temperature <= 0:
            return {"do_sample": False}  # temperature 0 means greedy, as in the OpenAI API
        options: dict[str, Any] = {"do_sample": True}
        if self.temperature is not None:
            options["temperature"] = float(self.temperature)
        if self.top_p is not None:
            options["top_p"] = float(self.top_p)
        if self.top_k is not None:
            options["top_k"] = int(self.top_k)
        if self.seed is not None:
            options["random_seed"] = int(self.seed)
        return options


@dataclass(frozen=True)
class Stats:
    prompt_tokens: int  # after the runtime expanded the image and audio placeholders
    new_tokens: int
    time_to_first_token_s: float  # question to first new token: preprocessing, encoders, prefill (not model loading)
    tokens_per_s: float  # decode speed after the first token (0 when only one token was made)
    variant: str  # decoder file that answered
    total_s: float = 0.0
    finish_reason: str = "length"  # "stop": an end-of-sequence token ended the answer; "length": the token limit


@dataclass
class Generation:
    """One raw generation, for tests: what the processor fed the graphs and the ids the generator produced."""

    inputs: dict[str, np.ndarray]  # processor tensors (int64 ones as np.int64)
    tokens: list[int]  # new token ids, in order (the final eos included when one was produced)
    text: str
    variant: str
    stats: Stats | None = None


@dataclass
class _Loaded:
    model: Any  # og.Model
    processor: Any  # og.MultiModalProcessor
    tokenizer: Any  # og.Tokenizer


@dataclass
class _Request:
    variant: str
    loaded: _Loaded
    inputs: Any  # og.NamedTensors
    prompt_tokens: int
    max_length: int
    started: float


class Chat:
    """A conversation with a built package. ``ask`` streams the answer and records the turn."""

    def __init__(self, package_dir: str | Path, max_length: int | None = None,
                 execution_provider: str | None = None, system: str | None = None) -> None:
        self.package_dir = Path(package_dir).expanduser()
        self.execution_provider = execution_provider
        self.system = system
        self.turns: list[Turn] = []
        self.last_stats: Stats | None = None
        self._models: dict[str, _Loaded] = {}

        config_path = self.package_dir / GENAI_CONFIG_FILE
        if not self.package_dir.is_dir():
            raise PackageError(f"package folder not found: {self.package_dir}")
        if not config_path.is_file():
            raise PackageError(f"not a model package (no {GENAI_CONFIG_FILE}): {self.package_dir}")
        try:
            self.genai_config = json.loads(config_path.read_text(encoding="utf-8"))
            model = self.genai_config["model"]
            self.main_decoder: str = model["decoder"]["filename"]
            self.context_length = int(model["context_length"])
            configured = int(self.genai_config.get("search", {}).get("max_length") or self.context_length)
        except (ValueError, KeyError, TypeError) as exc:
            raise PackageError(f"cannot read {config_path}: {exc}") from exc
        self.has_speech = bool(model.get("speech", {}).get("filename"))
        if max_length is not None and not 0 < max_length <= self.context_length:
            raise PackageError(f"max_length must be between 1 and the context length {self.context_length}")
        self.max_length = max_length or configured
        self.routed = all((self.package_dir / name).is_file() for name in VARIANT_FILES.values())
        if not (self.package_dir / self.main_decoder).is_file():
            raise PackageError(f"decoder {self.main_decoder} is missing from {self.package_dir}")

    # ---- variants and models -------------------------------------------------------------------------------------

    def variant_for(self, has_image: bool, has_audio: bool) -> str:
        """The decoder file for a conversation with (or without) images and audio."""
        if not self.routed:
            return self.main_decoder
        mode = "vision" if has_image else "speech" if has_audio else "text"
        return VARIANT_FILES[mode]

    def is_loaded(self, variant: str) -> bool:
        return variant in self._models

    def load(self, variant: str) -> None:
        """Load a decoder variant now (it is otherwise loaded on its first question)."""
        self._load(variant)

    def next_variant(self, images: Sequence[object] = (), audios: Sequence[object] = ()) -> str:
        """The variant that will answer the next question if it comes with these files."""
        return self.variant_for(bool(images) or any(t.images for t in self.turns),
                                bool(audios) or any(t.audios for t in self.turns))

    def model(self, variant: str) -> Any:
        """The og.Model of a decoder variant (loaded on first use and kept)."""
        return self._load(variant).model

    def _load(self, variant: str) -> _Loaded:
        if variant not in self._models:
            try:
                config = og.Config(str(self.package_dir))
                config.overlay(json.dumps({"model": {"decoder": {"filename": variant}},
                                           "search": {"max_length": self.max_length}}))
                if self.execution_provider is not None:
                    config.clear_providers()
                    if self.execution_provider != "cpu":
                        config.append_provider(self.execution_provider)
                model = og.Model(config)
                self._models[variant] = _Loaded(model, model.create_multimodal_processor(), og.Tokenizer(model))
            except RuntimeError as exc:
                raise PackageError(f"cannot load {self.package_dir / variant}: {_first_line(exc)}") from exc
        return self._models[variant]

    # ---- conversation --------------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget the conversation (loaded models are kept)."""
        self.turns.clear()

    def restore(self, turns: Sequence[Turn]) -> None:
        """Make `turns` (answered questions) the conversation so far, as if they had been asked here; the next
        question is answered after them. Restoring the conversation already held changes nothing."""
        turns = list(turns)
        if any(t.assistant is None for t in turns):
            raise ValueError("restored turns must all be answered")
        if turns == self.turns:
            return
        self.turns = turns

    def ask(self, text: str, images: Sequence[str | Path] = (), audios: Sequence[str | Path] = (),
            max_new_tokens: int = 256, sampling: Sampling | None = None) -> Iterator[str]:
        """Ask the next question; returns an iterator over the answer's text pieces as they are generated.

        Files are checked, the prompt built and the inputs preprocessed before this returns (so every ChatError is
        raised here); the turn is recorded, with the text generated so far, when the iterator ends or is closed."""
        turn = Turn(text, tuple(check_image(p) for p in images), tuple(check_audio(p) for p in audios))
        conversation = [*self.turns, turn]
        prompt = build_prompt(conversation, self.system)
        request = self._prepare(prompt, [p for t in conversation for p in t.images],
                                [p for t in conversation for p in t.audios])
        return self._answer(request, max_new_tokens, turn, sampling)

    def _answer(self, request: _Request, max_new_tokens: int, turn: Turn,
                sampling: Sampling | None) -> Iterator[str]:
        pieces: list[str] = []
        try:
            for _, piece in self._generate(request, max_new_tokens, sampling):
                pieces.append(piece)
                yield piece
        except ChatError:
            raise  # the model failed: nothing was said
        except BaseException:
            self.turns.append(replace(turn, assistant="".join(pieces)))  # stopped early: keep what was said
            raise
        self.turns.append(replace(turn, assistant="".join(pieces)))

    # ---- raw generation ------------------------------------------------------------------------------------------

    def generate(self, prompt: str, images: Sequence[str | Path] = (), audios: Sequence[str | Path] = (),
                 max_new_tokens: int = 32) -> Generation:
        """Run one prompt as written (no chat template, no history): the processor tensors and the new token ids."""
        request = self._prepare(prompt, [check_image(p) for p in images], [check_audio(p) for p in audios])
        inputs = {}
        for name in request.inputs.keys():
            array = request.inputs[name].as_numpy()
            inputs[name] = array.astype(np.int64) if array.dtype.kind == "i" and array.dtype.itemsize == 8 else array
        tokens, pieces = [], []
        for token, piece in self._generate(request, max_new_tokens):
            tokens.append(token)
            pieces.append(piece)
        return Generation(inputs, tokens, "".join(pieces), request.variant, self.last_stats)

    def _prepare(self, prompt: str, images: Sequence[Path], audios: Sequence[Path]) -> _Request:
        if audios and not self.has_speech:
            raise PackageError("this package has no speech model, so it cannot take audio")
        variant = self.variant_for(bool(images), bool(audios))
        loaded = self._load(variant)
        started = time.perf_counter()
        inputs = self._process(loaded, prompt, images, audios)
        prompt_tokens = int(inputs["input_ids"].as_numpy().shape[-1])
        if prompt_tokens >= self.max_length:
            raise PromptTooLongError(f"the prompt is {prompt_tokens} tokens but the maximum length is "
                                     f"{self.max_length}; start over (clear) or raise max_length")
        return _Request(variant, loaded, inputs, prompt_tokens, self.max_length, started)

    @staticmethod
    def _process(loaded: _Loaded, prompt: str, images: Sequence[Path], audios: Sequence[Path]) -> Any:
        def run(prompt: str, images: Sequence[Path], audios: Sequence[Path]) -> Any:
            return loaded.processor(
                prompt,
                images=og.Images.open(*map(str, images)) if images else None,
                audios=og.Audios.open(*map(str, audios)) if audios else None,
            )

        try:
            return run(prompt, images, audios)
        except RuntimeError as exc:
            message = _first_line(exc)
        # Name the file the decoders rejected by trying each alone.
        for kind, files in (("image", images), ("audio", audios)):
            for path in files:
                try:
                    run(f"<|{kind}_1|>", [path] if kind == "image" else [], [path] if kind == "audio" else [])
                except RuntimeError as exc:
                    reason = _strip_tag(_first_line(exc))
                    raise UnsupportedMediaError(f"cannot read {kind} {path}: {_DECODER_HINTS.get(reason, reason)}") \
                        from None
        raise ChatError(f"the runtime rejected the prompt: {message}")

    def _generate(self, request: _Request, max_new_tokens: int,
                  sampling: Sampling | None = None) -> Iterator[tuple[int, str]]:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        loaded = request.loaded
        params = og.GeneratorParams(loaded.model)
        params.set_search_options(max_length=min(request.max_length, request.prompt_tokens + max_new_tokens),
                                  **(sampling or Sampling()).search_options())
        generator = og.Generator(loaded.model, params)
        stream = loaded.tokenizer.create_stream()
        eos = {int(t) for t in loaded.tokenizer.eos_token_ids}
        first = None
        count = 0
        finish = "length"
        try:
            try:
                generator.set_inputs(request.inputs)
            except RuntimeError as exc:
                raise ChatError(f"the model failed on the prompt ({request.variant}): {_first_line(exc)}") from exc
            while not generator.is_done():
                generator.generate_next_token()
                token = int(generator.get_next_tokens()[0])
                count += 1
                if first is None:
                    first = time.perf_counter()
                if token in eos:
                    finish = "stop"
                yield token, ("" if token in eos else stream.decode(token))
        finally:
            end = time.perf_counter()
            del generator
            decode_s = end - first if first is not None else 0.0
            self.last_stats = Stats(
                prompt_tokens=request.prompt_tokens,
                new_tokens=count,
                time_to_first_token_s=(first if first is not None else end) - request.started,
                tokens_per_s=(count - 1) / decode_s if count > 1 and decode_s > 0 else 0.0,
                variant=request.variant,
                total_s=end - request.started,
                finish_reason=finish,
            )


def generate(package_dir: str | Path, prompt: str, images: Sequence[str | Path] = (),
             audios: Sequence[str | Path] = (), max_new_tokens: int = 32, max_length: int | None = None,
             execution_provider: str | None = None) -> Generation:
    """One raw generation with a fresh Chat (see Chat.generate)."""
    chat = Chat(package_dir, max_length=max_length, execution_provider=execution_provider)
    return chat.generate(prompt, images, audios, max_new_tokens)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _strip_tag(message: str) -> str:
    """'[AudioDecoder]: only down-sampling supported.' -> 'only down-sampling supported'"""
    return re.sub(r"^\[\w+\]:\s*", "", message).rstrip(".")
