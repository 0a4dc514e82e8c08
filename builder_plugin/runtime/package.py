"""A built package opened for running: its configuration, read once, and its models, loaded on first use.

One ``og.Model`` answers every input mode of a routed package: its decoder picks the LoRA adapter of the conversation
from the prompt itself, so vision, speech, embedding and decoder sessions are loaded once. Where the kernel library
runs it, a routed CPU package's decoder for each input mode (no ``If`` nodes) answers that mode's conversations, each
in an ``og.Model`` of its own loaded on the first of them (variant_for). A split package
(``--lora split``) has one decoder file per mode and gets one ``og.Model`` per mode used, each with its own sessions;
``manifest.json`` says which file answers which mode. Every session computes with ``threads`` intra-op threads, by
default one per physical core the process may use, set by an og.Config overlay at load (runtime/threads.py).

A Package is shared by every conversation on it (a server keeps several): what it holds does not change once read,
and loading a model, rendering a tool header, compiling a grammar and remembering an answer's ids are safe from any
thread.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime_genai as og

from builder_plugin.layout import GENAI_CONFIG_FILE, MODE_MEDIA, Component, mode_of
from builder_plugin.media import Media
from builder_plugin.runtime import kernel_library
from builder_plugin.runtime.conversation import AnswerMemory, Markers
from builder_plugin.runtime.errors import (
    ChatError,
    GuidanceError,
    PackageError,
    ToolsNotSupportedError,
    UnsupportedMediaError,
    first_line,
)
from builder_plugin.runtime.guidance import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Guidance
from builder_plugin.runtime.kv_cache import kv_bytes_per_token
from builder_plugin.runtime.manifest import Manifest
from builder_plugin.runtime.media import og_audios, og_images
from builder_plugin.runtime.prompt import ASSISTANT, END, PLACEHOLDERS
from builder_plugin.runtime.threads import thread_overlay
from builder_plugin.runtime.tokens import TokenBytes

COMPILED_MEMORY = 256  # grammars remembered as compiling, per model
PREFILL_CHUNK = 1024  # tokens per prefill call of a long prompt (measured: runtime/decoding.py's notes)
_SYSTEM_SENTINEL, _TOOLS_SENTINEL = "system-1f0c", [918273645]  # stand-ins the chat template is rendered with


@dataclass(frozen=True)
class Tokens(Markers):
    """The special token ids of a package's tokenizer that generation and the conversation are read from."""

    eos: frozenset[int] = frozenset()
    placeholders: frozenset[int] = frozenset()  # the image and audio placeholder ids: inputs only
    tool_call: tuple[int, int] | None = None  # <|tool_call|>, <|/tool_call|>: one token each, or None

    @property
    def stops(self) -> frozenset[int]:
        """Ids that end an answer and are not part of it."""
        return self.eos | self.placeholders

    def marker_text(self, token: int) -> str:
        """The text of a tool-call marker id ("" for any other id): the markers are plain added tokens in
        Phi-4-MM's tokenizer, but one marked special would decode to nothing and the calls could not be found."""
        if self.tool_call is None or token not in self.tool_call:
            return ""
        return TOOL_CALL_OPEN if token == self.tool_call[0] else TOOL_CALL_CLOSE


class LoadedModel:
    """One decoder file's og.Model with its processor and tokenizer."""

    def __init__(self, variant: str, model: Any, vocab_size: int) -> None:
        self.variant = variant
        self.model = model
        self.vocab_size = vocab_size
        self.processor = model.create_multimodal_processor()
        self.tokenizer = og.Tokenizer(model)
        (end,), (assistant,) = self.tokenizer.encode(END), self.tokenizer.encode(ASSISTANT)
        placeholders = [self.encode(text) for text in PLACEHOLDERS]
        calls = [self.encode(marker) for marker in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)]
        self.tokens = Tokens(int(assistant), int(end), frozenset(int(t) for t in self.tokenizer.eos_token_ids),
                             frozenset(ids[0] for ids in placeholders if len(ids) == 1),
                             (calls[0][0], calls[1][0]) if all(len(ids) == 1 for ids in calls) else None)
        self._lock = threading.Lock()
        self._headers: dict[tuple[str | None, str], str] = {}
        self._compiled: OrderedDict[Guidance, None] = OrderedDict()

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def process(self, prompt: str, images: Sequence[Media], audios: Sequence[Media]) -> Any:
        """The processor's tensors (og.NamedTensors) for `prompt` and its media; a medium the processor refuses is
        named in an UnsupportedMediaError."""
        try:
            return self.processor(prompt, images=og_images(images), audios=og_audios(audios))
        except RuntimeError as exc:
            message = first_line(exc)
        for kind, items in (("image", images), ("audio", audios)):  # which one: each alone
            for media in items:
                try:
                    self.processor(f"<|{kind}_1|>", images=og_images([media] if kind == "image" else []),
                                   audios=og_audios([media] if kind == "audio" else []))
                except RuntimeError as exc:
                    reason = re.sub(r"^\[\w+\]:\s*", "", first_line(exc))  # "[Phi4VisionProcessor]: ..."
                    raise UnsupportedMediaError(f"cannot read {kind} {media.source}: {reason}", media.source) \
                        from None
        raise ChatError(f"the runtime rejected the prompt: {message}")

    def require_tool_calls(self) -> tuple[int, int]:
        if self.tokens.tool_call is None:
            raise ToolsNotSupportedError("this package's tokenizer has no tool-call tokens "
                                         f"({TOOL_CALL_OPEN}, {TOOL_CALL_CLOSE}), so it cannot call tools")
        return self.tokens.tool_call

    def tool_header(self, system: str | None, tools: str) -> str:
        """The system message with `tools`, rendered by the package's chat template."""
        self.require_tool_calls()
        key = (system, tools)
        with self._lock:
            header = self._headers.get(key)
        if header is not None:
            return header
        # The runtime's template engine parses the tools and prints them back Python-style (['a'] for ["a"]), where
        # the original template concatenates the text as given: render sentinels, then put the texts in their place.
        message = {"role": "system", "content": _SYSTEM_SENTINEL, "tools": json.dumps(_TOOLS_SENTINEL)}
        try:
            rendered = self.tokenizer.apply_chat_template(messages=json.dumps([message]), add_generation_prompt=True)
        except RuntimeError as exc:
            raise ToolsNotSupportedError(f"the package's chat template cannot render tools: {first_line(exc)}") \
                from None
        sentinel = json.dumps(_TOOLS_SENTINEL)
        tools_at = rendered.find(sentinel)
        if tools_at < 0 or rendered.count(_SYSTEM_SENTINEL) != 1 or not rendered.endswith(ASSISTANT):
            raise ToolsNotSupportedError("the package's chat template has no tools in its system message")
        rendered = rendered[:-len(ASSISTANT)]
        header = (rendered[:tools_at] + tools + rendered[tools_at + len(sentinel):]).replace(_SYSTEM_SENTINEL,
                                                                                             system or "")
        with self._lock:
            if len(self._headers) >= COMPILED_MEMORY:
                self._headers.clear()
            self._headers[key] = header
        return header

    def check_guidance(self, guidance: Guidance) -> None:
        """Compile the grammar now (the runtime compiles it when a generator starts), so a bad one fails before an
        answer starts; grammars that compiled recently are not compiled twice."""
        with self._lock:
            if guidance in self._compiled:
                self._compiled.move_to_end(guidance)
                return
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=2)
        try:
            params.set_guidance(guidance.kind, guidance.data)
            og.Generator(self.model, params)
        except RuntimeError as exc:
            raise GuidanceError(f"the {guidance.kind.replace('_', ' ')} was refused: {first_line(exc)}") from None
        with self._lock:
            self._compiled[guidance] = None
            while len(self._compiled) > COMPILED_MEMORY:
                self._compiled.popitem(last=False)


# The sessions a text-only decoder's og.Model loads and never runs
MEDIA_SECTIONS = (Component.VISION.value, Component.SPEECH.value)


class Package:
    """A package folder opened for running (raises PackageError for what cannot be run)."""

    def __init__(self, package_dir: str | Path, max_length: int | None = None, execution_provider: str | None = None,
                 threads: int | None = None, kernels: bool | None = None,
                 prefill_chunk: int | None = PREFILL_CHUNK) -> None:
        self.dir = Path(package_dir).expanduser()
        self.execution_provider = execution_provider
        self.threads = threads  # intra-op threads of every session; None: one per physical core the process may use
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or
                                          prefill_chunk < 1):
            raise PackageError(f"prefill_chunk must be a positive number of tokens or None, not {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk  # tokens per prefill call of a long prompt (decoding.py); None: whole
        config_path = self.dir / GENAI_CONFIG_FILE
        if not self.dir.is_dir():
            raise PackageError(f"package folder not found: {self.dir}")
        if not config_path.is_file():
            raise PackageError(f"not a model package (no {GENAI_CONFIG_FILE}): {self.dir}")
        try:
            self.built_at = int(config_path.stat().st_mtime)  # when the package was written (Unix seconds)
            self.genai_config = json.loads(config_path.read_text(encoding="utf-8"))
            model = self.genai_config["model"]
            self.main_decoder: str = model["decoder"]["filename"]
            self.context_length = int(model["context_length"])
            self.vocab_size = int(model["vocab_size"])
            configured = int(self.genai_config.get("search", {}).get("max_length") or self.context_length)
            self.manifest = Manifest.read(self.dir, self.main_decoder)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PackageError(f"cannot read the package configuration in {self.dir}: {exc}") from exc
        self.has_speech = bool(model.get("speech", {}).get("filename"))
        self.crop_side = crop_side(self.dir, model)
        try:
            self.kv_bytes_per_token = kv_bytes_per_token(self.genai_config, self.manifest.builder)
        except (ValueError, KeyError, TypeError) as exc:
            raise PackageError(f"cannot read the decoder's shape in {config_path}: {exc}") from exc
        # the project's MatMulNBits kernel, where it helps (runtime/kernel_library.py; kernels False: never)
        self.kernel_library = kernel_library.for_package(self.manifest.builder, execution_provider, kernels)
        self._session_options = kernel_library.session_options(self.kernel_library)
        try:
            self.thread_overlay = thread_overlay(self.genai_config, threads, self._session_options)
        except ValueError as exc:
            raise PackageError(str(exc)) from exc
        if max_length is not None and not 0 < max_length <= self.context_length:
            raise PackageError(f"max_length must be between 1 and the context length {self.context_length}")
        self.max_length = max_length or configured
        for name in sorted(set(self.manifest.decoders.values())):
            if not (self.dir / name).is_file():
                raise PackageError(f"decoder {name} is missing from {self.dir}")
        self.token_bytes = TokenBytes(self.dir)
        self.answers = AnswerMemory()  # the ids of the answers given on this package, by conversation
        self._models: dict[str, LoadedModel] = {}
        self._loading = threading.Lock()

    @property
    def routed(self) -> bool:
        """The package answers each input mode with the LoRA of that mode (self-routing or split decoders)."""
        return self.manifest.routing in ("self", "split")

    @property
    def longrope_switch(self) -> int | None:
        return self.manifest.original_max_position_embeddings

    def variant_for(self, has_image: bool, has_audio: bool) -> str:
        """The decoder file for a conversation with (or without) images and audio.

        A self-routing package's own decoder for a mode (no If nodes: text without LoRA, images with the vision
        adapter, audio with the speech one) answers only where the kernel library runs the package: the library
        reads the weights in place from the shared data file, where onnxruntime's kernel prepacks a copy per session,
        which would hold the weights once more for every decoder a process loads. Elsewhere the routed decoder
        answers every mode."""
        name = self.manifest.decoders[mode_of(has_image, has_audio)]
        if self.manifest.routing == "self" and self.kernel_library is None:
            return self.main_decoder
        return name

    def is_loaded(self, variant: str) -> bool:
        return variant in self._models

    def decoders_for(self, has_image: bool, has_audio: bool) -> tuple[str, ...]:
        """The decoder files that may answer a conversation with (or without) images and audio: the one `variant_for`
        picks, and on a self-routing package the routed one too, which a plain onnxruntime-genai app runs for every
        mode (one file where they are the same: without the kernel library the run time runs it too)."""
        chosen = self.variant_for(has_image, has_audio)
        return tuple(dict.fromkeys((chosen, self.main_decoder) if self.manifest.routing == "self" else (chosen,)))

    def preload(self) -> None:
        """Load the decoders a server's first requests would otherwise wait for: each input mode's (audio's where the
        package has a speech model)."""
        modes = [media for media in MODE_MEDIA.values() if self.has_speech or not media[1]]
        for variant in dict.fromkeys(self.variant_for(*media) for media in modes):
            self.load(variant)

    def load(self, variant: str) -> LoadedModel:
        """The loaded model of a decoder file (loaded on first use and kept)."""
        with self._loading:
            if variant not in self._models:
                self._models[variant] = self._load(variant)
            return self._models[variant]

    def _load(self, variant: str) -> LoadedModel:
        text_only = variant == self.variant_for(False, False) and variant != self.main_decoder
        sections = thread_overlay(self.genai_config, self.threads, self._session_options, unused=MEDIA_SECTIONS) \
            if text_only else self.thread_overlay
        try:
            config = og.Config(str(self.dir.absolute()))  # the library loads with its own folder as the cwd
            overlay: dict[str, Any] = {"search": {"max_length": self.max_length},
                                       "model": json.loads(json.dumps(sections))}
            if variant != self.main_decoder:
                overlay["model"].setdefault("decoder", {})["filename"] = variant
            config.overlay(json.dumps(overlay))
            if self.execution_provider is not None:
                config.clear_providers()
                if self.execution_provider != "cpu":
                    config.append_provider(self.execution_provider)
            with kernel_library.loading(self.kernel_library):
                model = og.Model(config)
            return LoadedModel(variant, model, self.vocab_size)
        except RuntimeError as exc:
            raise PackageError(f"cannot load {self.dir / variant}: {first_line(exc)}") from exc


def crop_side(package_dir: Path, model: dict[str, Any]) -> int | None:
    """The pixels a side of one crop of the package's vision processor (its dynamic HD transform tiles an image with
    such crops, and an image that fits one is read as that crop and the global view); None without a vision model,
    or where its processor does not say (a package of another builder: onnxruntime-genai reads it, not this)."""
    name = model.get("vision", {}).get("config_filename")
    if not name:
        return None
    try:
        transforms = json.loads((package_dir / name).read_text(encoding="utf-8"))["processor"]["transforms"]
        sides = [int(t["operation"]["attrs"]["dyhd_base_resolution"]) for t in transforms
                 if t["operation"]["type"] == "Phi4VisionDynamicPreprocess"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return sides[0] if sides and sides[0] > 0 else None


def og_model(package_dir: str | Path, threads: int | None = None, kernels: bool | None = None) -> Any:
    """The og.Model of a package's main decoder as Chat loads it (one thread per physical core, the project's
    MatMulNBits kernel where it helps), for an app that runs onnxruntime-genai itself."""
    package = Package(package_dir, threads=threads, kernels=kernels)
    return package.load(package.main_decoder).model
