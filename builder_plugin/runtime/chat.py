"""One conversation with a built package through onnxruntime-genai: streamed answers, images, audio, follow-ups.

- One ``og.Model`` answers every input mode of a routed package: its decoder picks the LoRA adapter of the
  conversation from the prompt itself, so vision, speech, embedding and decoder sessions are loaded once. A split
  package (``--lora split``) has one decoder file per mode and gets one ``og.Model`` per mode used, each with its own
  sessions; ``manifest.json`` in the package says which file answers which mode.
- Follow-up questions: the generator that answered is kept with its KV cache. A question that brings no new image or
  audio (so the mode cannot change) only prefills its own tokens: they are appended to the conversation's token ids,
  which are the prompt's ids followed by the generated ids (answers are never re-tokenised). ``restore`` of the
  first turns of the kept conversation keeps the generator: the next question (an edited later one, or the next one
  asked again) rewinds it to the ids they share. A question with new media, other sampling options, or a
  conversation changed otherwise by ``restore``/``clear`` starts a new generator over the whole conversation, as
  the runtime requires for new media. ``sibling`` makes another conversation on the same loaded models (a server
  keeps several).
- Generators are sized to the conversation plus ``follow_up_room`` tokens, not to ``max_length``: the runtime
  allocates (and zero-fills) the KV cache for its whole length up front, 256 KiB per token for the real model in fp32.
  A follow-up that does not fit restarts from the conversation's token ids in a larger generator.
- Answers keep their token ids: a conversation prompted again from its turns (new media, ``restore``, a follow-up
  that does not fit) gets the ids the answers were generated as, not a re-tokenisation of their text, so it is the
  same token sequence whichever way it is run. ``restore`` finds them for turns that were answered here recently.
- LongRoPE: the first time the sequence grows past ``original_max_position_embeddings`` (from the package manifest)
  the whole cache is recomputed with the long factors, once per conversation, as the original model's generation
  does; the runtime does not do this for phi4mm. It costs one prefill of that many tokens (media encoded again).
  A guided answer is not recomputed midway: its grammar state cannot be carried into a new generator (the next
  question is, as every question after a guided answer starts a new generator over the conversation's ids).
- Guidance (runtime/guidance.py) constrains one answer; tools (``Chat.tools``, the JSON list the chat template puts in
  the system message) are rendered by the package's own chat template, read by the runtime from its tokenizer files.
- Media: every image and clip is decoded first by Pillow / libsndfile in a separate process, with limits and a time
  bound (builder_plugin.media); onnxruntime-genai is given the canonical PNG / WAV bytes, never the file itself (its
  bundled JPEG decoder can hang, or end the process, on a broken file).
- Threads: every session of a loaded model (decoder, embedding, vision, speech) computes with ``threads`` intra-op
  threads, by default one per physical core the process may use, set by an og.Config overlay at load
  (runtime/threads.py).
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime_genai as og

from builder_plugin.layout import GENAI_CONFIG_FILE, mode_of
from builder_plugin.media import Media, MediaDecoder
from builder_plugin.runtime.errors import (
    ChatError,
    GuidanceError,
    PackageError,
    PromptTooLongError,
    ToolsNotSupportedError,
    UnsupportedMediaError,
    first_line,
)
from builder_plugin.runtime.guidance import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Guidance, tool_call_grammar
from builder_plugin.runtime.kv_cache import kv_bytes_per_token
from builder_plugin.runtime.manifest import Manifest
from builder_plugin.runtime.media import MediaSource, og_audios, og_images, open_audio, open_image
from builder_plugin.runtime.prompt import ASSISTANT, END, PLACEHOLDERS, Turn, build_prompt, user_content, user_turn
from builder_plugin.runtime.threads import thread_overlay
from builder_plugin.runtime.tokens import MAX_TOP_LOGPROBS, TokenBytes, TokenLogprob, token_logprob

FOLLOW_UP_ROOM = 1024  # tokens of KV cache kept free for follow-up questions beyond the answer's max_new_tokens
ANSWER_MEMORY = 256  # answers whose token ids are remembered for conversations restored from text
_SYSTEM_SENTINEL, _TOOLS_SENTINEL = "system-1f0c", [918273645]  # stand-ins the chat template is rendered with


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
    prompt_tokens: int  # the conversation before the answer, after the runtime expanded image and audio placeholders
    new_tokens: int
    time_to_first_token_s: float  # question to first new token: preprocessing, encoders, prefill (not model loading)
    tokens_per_s: float  # decode speed after the first token (0 when only one token was made)
    variant: str  # decoder file that answered
    total_s: float = 0.0
    finish_reason: str = "length"  # "stop": an end-of-sequence token ended the answer; "length": the token limit
    prefill_tokens: int = 0  # tokens computed before the first new token (the question's own on a follow-up)
    reused_tokens: int = 0  # tokens of the conversation already in the kept generator's cache
    recomputed: bool = False  # the LongRoPE switch recomputed the whole cache during this answer


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
    eos: frozenset[int]
    end_id: int  # <|end|>
    assistant_id: int  # <|assistant|>
    placeholders: frozenset[int] = frozenset()  # the image and audio placeholder ids: inputs only
    _markers: dict[int, str] | None = None

    @property
    def stops(self) -> frozenset[int]:
        """Ids that end an answer and are not part of it."""
        return self.eos | self.placeholders

    def markers(self) -> dict[int, str]:
        """The tool-call marker tokens of this tokenizer (id -> text); empty when it has none."""
        if self._markers is None:
            self._markers = {}
            for marker in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
                encoded = [int(t) for t in self.tokenizer.encode(marker)]
                if len(encoded) == 1:
                    self._markers[encoded[0]] = marker
        return self._markers

    @classmethod
    def of(cls, model: Any) -> _Loaded:
        tokenizer = og.Tokenizer(model)
        (end,), (assistant,) = tokenizer.encode(END), tokenizer.encode(ASSISTANT)
        placeholders = [[int(t) for t in tokenizer.encode(text)] for text in PLACEHOLDERS]
        return cls(model, model.create_multimodal_processor(), tokenizer,
                   frozenset(int(t) for t in tokenizer.eos_token_ids), int(end), int(assistant),
                   frozenset(ids[0] for ids in placeholders if len(ids) == 1))


@dataclass
class _Live:
    """A generator and what it holds: the processor tensors it started from (media), its length, its options."""

    variant: str
    loaded: _Loaded
    generator: Any  # og.Generator
    inputs: Any  # og.NamedTensors of the prompt it was started from
    max_length: int
    sampling: Sampling
    long_factors: bool  # its last step ran past the LongRoPE switch (so every cached key has the long factors)
    turns: list[Turn] = field(default_factory=list)  # the answered turns it holds (Chat conversations)
    guided: bool = False  # it was started with guidance (its grammar state is spent: no follow-up extends it)

    def token_ids(self) -> list[int]:
        return [int(t) for t in self.generator.get_sequence(0)]


@dataclass
class _Request:
    variant: str
    loaded: _Loaded
    started: float
    sampling: Sampling
    max_length: int  # of a new generator
    prompt_tokens: int
    inputs: Any = None  # processor tensors for a new generator
    append: list[int] | None = None  # ids to append to the kept generator instead, after its first `keep` ids
    keep: int = 0
    guidance: Guidance | None = None
    logprobs: int | None = None  # record the log-probability of each token and this many alternatives


class Chat:
    """A conversation with a built package. ``ask`` streams the answer and records the turn."""

    def __init__(self, package_dir: str | Path, max_length: int | None = None,
                 execution_provider: str | None = None, system: str | None = None,
                 follow_up_room: int = FOLLOW_UP_ROOM, threads: int | None = None,
                 media: MediaDecoder | None = None) -> None:
        self.package_dir = Path(package_dir).expanduser()
        self.media = media  # decodes the files a question names (None: the process's default decoder)
        self.execution_provider = execution_provider
        self.threads = threads  # intra-op threads of every session; None: one per physical core the process may use
        self.system = system
        self.follow_up_room = follow_up_room
        self.turns: list[Turn] = []
        self.last_stats: Stats | None = None
        # Off by default: when True, the last-position logits each new token was chosen from ([vocab] float32 each)
        self.keep_logits = False
        self.last_logits: list[np.ndarray] = []
        # Set by ask(logprobs=k): each new token's log-probability and its k most likely alternatives (eos excluded)
        self.last_logprobs: list[TokenLogprob] = []
        # Tools the model may call: the JSON text the chat template puts in the system message (None: no tools)
        self.tools: str | None = None
        self.token_bytes = TokenBytes(self.package_dir)
        self._compiled: OrderedDict[Guidance, None] = OrderedDict()  # guidance known to compile
        self._models: dict[str, _Loaded] = {}
        self._live: _Live | None = None
        self._answers: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()  # (system, turns so far) -> answer ids
        # Called with a new generator's length (KV positions) before it is allocated: a server frees others first
        self.before_new_generator: Callable[[int], None] | None = None

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
            self.manifest = Manifest.read(self.package_dir, self.main_decoder)
        except (ValueError, KeyError, TypeError) as exc:
            raise PackageError(f"cannot read the package configuration in {self.package_dir}: {exc}") from exc
        self.has_speech = bool(model.get("speech", {}).get("filename"))
        try:
            self.kv_bytes_per_token = kv_bytes_per_token(self.genai_config, self.manifest.builder)
        except (ValueError, KeyError, TypeError) as exc:
            raise PackageError(f"cannot read the decoder's shape in {config_path}: {exc}") from exc
        try:
            self._thread_overlay = thread_overlay(self.genai_config, threads)
        except ValueError as exc:
            raise PackageError(str(exc)) from exc
        if max_length is not None and not 0 < max_length <= self.context_length:
            raise PackageError(f"max_length must be between 1 and the context length {self.context_length}")
        self.max_length = max_length or configured
        for name in sorted(set(self.manifest.decoders.values())):
            if not (self.package_dir / name).is_file():
                raise PackageError(f"decoder {name} is missing from {self.package_dir}")

    # ---- variants and models -------------------------------------------------------------------------------------

    @property
    def routed(self) -> bool:
        """The package answers each input mode with the LoRA of that mode (self-routing or split decoders)."""
        return self.manifest.routing in ("self", "split")

    def variant_for(self, has_image: bool, has_audio: bool) -> str:
        """The decoder file for a conversation with (or without) images and audio."""
        return self.manifest.decoders[mode_of(has_image, has_audio)]

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
                overlay: dict[str, Any] = {"search": {"max_length": self.max_length},
                                           "model": json.loads(json.dumps(self._thread_overlay))}
                if variant != self.main_decoder:
                    overlay["model"].setdefault("decoder", {})["filename"] = variant
                config.overlay(json.dumps(overlay))
                if self.execution_provider is not None:
                    config.clear_providers()
                    if self.execution_provider != "cpu":
                        config.append_provider(self.execution_provider)
                model = og.Model(config)
                self._models[variant] = _Loaded.of(model)
            except RuntimeError as exc:
                raise PackageError(f"cannot load {self.package_dir / variant}: {first_line(exc)}") from exc
        return self._models[variant]

    # ---- conversation --------------------------------------------------------------------------------------------

    @property
    def token_ids(self) -> list[int]:
        """The conversation's token ids held by the kept generator (prompt ids, then generated and appended ids);
        empty when no generator holds this conversation."""
        live = self._live
        return live.token_ids() if live is not None and live.turns == self.turns else []

    def clear(self) -> None:
        """Forget the conversation (loaded models are kept)."""
        self.turns.clear()
        self._drop_live()

    def sibling(self) -> Chat:
        """A new, empty conversation on the same package, options and loaded models (a server keeps several)."""
        other = copy.copy(self)
        other.turns, other.system, other.tools, other._live = [], None, None, None
        other.last_stats, other.last_logits, other.last_logprobs = None, [], []
        return other

    @property
    def kv_tokens(self) -> int:
        """Positions of KV cache the kept generator holds (allocated for its whole length), 0 without one. Unlike
        token_ids it does not touch the generator, so another thread may read it while this one generates."""
        live = self._live
        return live.max_length if live is not None and live.generator is not None else 0

    def release(self) -> None:
        """Free the kept generator and its KV cache; the conversation stays, and its next question is prefilled
        whole (what an app may do while a conversation is idle)."""
        self._drop_live()

    def restore(self, turns: Sequence[Turn]) -> None:
        """Make `turns` (answered questions) the conversation so far, as if they had been asked here (their media files
        are decoded as ask's are); the next question is answered after them. Restoring the conversation already held
        keeps its generator, and so does restoring its first turns: a next question that edits a later one, or asks
        the next one again, rewinds the generator to what they share (unless that drops media, or rewinds a
        LongRoPE-recomputed cache below the switch)."""
        if any(t.assistant is None for t in turns):
            raise ValueError("restored turns must all be answered")
        turns = [replace(t, images=tuple(open_image(m, self.media) for m in t.images),
                         audios=tuple(open_audio(m, self.media) for m in t.audios)) for t in turns]
        if turns == self.turns:
            return
        for i, turn in enumerate(turns):
            if turn.answer_ids is None:
                ids = self._answers.get((self.system, self.tools, tuple(turns[:i + 1])))
                turns[i] = replace(turn, answer_ids=ids) if ids is not None else turn
        live = self._live
        self.turns = turns
        if live is None or live.turns[:len(turns)] != turns:
            self._drop_live()  # else the next question may rewind the generator to the turns it shares

    def ask(self, text: str, images: Sequence[MediaSource] = (), audios: Sequence[MediaSource] = (),
            max_new_tokens: int = 256, sampling: Sampling | None = None, guidance: Guidance | None = None,
            logprobs: int | None = None, role: str = "user") -> Iterator[str]:
        """Ask the next question; returns an iterator over the answer's text pieces as they are generated.

        `guidance` constrains this answer (a JSON schema, a regex or a Lark grammar); `logprobs` (0-20) records each
        token's log-probability and that many alternatives in ``last_logprobs``; `role` "tool" makes the question
        the results of the calls in the last answer (see ``prompt.tool_results``).
        Files are checked, the prompt built, the inputs preprocessed and the grammar compiled before this returns (so
        every ChatError is raised here); the turn is recorded, with the text generated so far, when the iterator
        ends or is closed."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        turn = Turn(text, tuple(open_image(p, self.media) for p in images),
                    tuple(open_audio(p, self.media) for p in audios), role=role)
        sampling = sampling or Sampling()
        loaded = self._load(self.next_variant(images, audios))
        header = self._header(loaded)
        if guidance is not None:
            self._check_guidance(loaded, guidance)
        request = self._follow_up(turn, max_new_tokens, sampling, guidance)
        if request is None:
            conversation = [*self.turns, turn]
            prompt = build_prompt(conversation, self.system, header)
            request = self._prepare(prompt, [p for t in conversation for p in t.images],
                                    [p for t in conversation for p in t.audios], max_new_tokens, sampling,
                                    room=self.follow_up_room, turns=conversation)
        request.guidance, request.logprobs = guidance, logprobs
        return self._answer(request, max_new_tokens, turn)

    # ---- tools and guidance --------------------------------------------------------------------------------------

    def tool_call_ids(self, variant: str | None = None) -> tuple[int, int] | None:
        """The ids of the call markers (<|tool_call|>, <|/tool_call|>) in the package's tokenizer; None when it has
        no such tokens (each must be one token)."""
        return _marker_ids(self._load(variant or self.next_variant()))

    def tool_guidance(self, functions: Sequence[tuple[str, dict[str, Any]]], single: bool) -> Guidance:
        """The grammar of a call block naming only `functions` ((name, parameters schema) pairs)."""
        return tool_call_grammar(*_required_marker_ids(self._load(self.next_variant())), functions, single)

    def _header(self, loaded: _Loaded) -> str | None:
        """The system message with the tools, rendered by the package's chat template; None without tools."""
        if self.tools is None:
            return None
        _required_marker_ids(loaded)
        # The runtime's template engine parses the tools and prints them back Python-style (['a'] for ["a"]), where
        # the original template concatenates the text as given: render sentinels, then put the texts in their place.
        message = {"role": "system", "content": _SYSTEM_SENTINEL, "tools": json.dumps(_TOOLS_SENTINEL)}
        try:
            rendered = loaded.tokenizer.apply_chat_template(messages=json.dumps([message]),
                                                            add_generation_prompt=True)
        except RuntimeError as exc:
            raise ToolsNotSupportedError(f"the package's chat template cannot render tools: {first_line(exc)}") \
                from None
        tools_at = rendered.find(json.dumps(_TOOLS_SENTINEL))
        if tools_at < 0 or rendered.count(_SYSTEM_SENTINEL) != 1 or not rendered.endswith(ASSISTANT):
            raise ToolsNotSupportedError("the package's chat template has no tools in its system message")
        rendered = rendered[:-len(ASSISTANT)]
        rendered = rendered[:tools_at] + self.tools + rendered[tools_at + len(json.dumps(_TOOLS_SENTINEL)):]
        return rendered.replace(_SYSTEM_SENTINEL, self.system or "")

    def _check_guidance(self, loaded: _Loaded, guidance: Guidance) -> None:
        """Compile the grammar now (the runtime compiles it when a generator starts), so a bad one fails in ask;
        grammars that compiled recently are not compiled twice."""
        if guidance in self._compiled:
            self._compiled.move_to_end(guidance)
            return
        params = og.GeneratorParams(loaded.model)
        params.set_search_options(max_length=2)
        try:
            params.set_guidance(guidance.kind, guidance.data)
            og.Generator(loaded.model, params)
        except RuntimeError as exc:
            raise GuidanceError(f"the {guidance.kind.replace('_', ' ')} was refused: {first_line(exc)}") from None
        self._compiled[guidance] = None
        while len(self._compiled) > ANSWER_MEMORY:
            self._compiled.popitem(last=False)

    def _follow_up(self, turn: Turn, max_new_tokens: int, sampling: Sampling,
                   guidance: Guidance | None = None) -> _Request | None:
        """A request that extends the kept generator, rewound to what it shares with the conversation (or restarts
        from its token ids), or None for a new prompt."""
        live = self._live
        if live is None or live.sampling != sampling or live.turns[:len(self.turns)] != self.turns:
            return None
        started = time.perf_counter()
        ids = live.token_ids()
        shared = self._shared_ids(live, ids, turn)
        if shared is None:
            return None
        keep, asked_again = shared
        new: list[int] = []
        if not asked_again:
            prefix = "" if live.loaded.end_id == ids[keep - 1] else END  # an answer cut short gets its end
            new = [int(t) for t in live.loaded.tokenizer.encode(prefix + user_turn(user_content(turn), turn.role))]
        total = keep + len(new)
        if total >= self.max_length:
            raise PromptTooLongError(f"the conversation is {total} tokens but the maximum length is "
                                     f"{self.max_length}")
        switch = self.manifest.original_max_position_embeddings
        if switch is not None and live.long_factors and total <= switch:
            return None  # rewound below the switch: its keys have the long factors, a fresh prompt the short ones
        crosses = switch is not None and not live.long_factors and total > switch
        if total + max_new_tokens <= live.max_length and not crosses and guidance is None and not live.guided:
            return _Request(live.variant, live.loaded, started, sampling, live.max_length, total, append=new,
                            keep=keep)
        # Restart over the same ids: more room, or a prompt past the LongRoPE switch (all keys with long factors).
        inputs = _with_ids(live.inputs, ids[:keep] + new)
        return _Request(live.variant, live.loaded, started, sampling, self._size(total, max_new_tokens), total,
                        inputs=inputs)

    def _shared_ids(self, live: _Live, ids: list[int], turn: Turn) -> tuple[int, bool] | None:
        """How many of the kept generator's ids the conversation with `turn` next starts with, and whether `turn`
        asks again the question those ids end with; None when it shares too little to reuse them.

        The conversation's turns are the first of the turns the generator holds (``restore``). `turn` follows them
        after the last one's answer, or, when it asks the next held question again (an answer regenerated), right
        after that question. Media must all be in the kept ids: new media need a new generator, and so do media only
        the dropped turns had (the generator's processor tensors hold them)."""
        held = len(self.turns)
        if held == len(live.turns):
            return None if turn.images or turn.audios else (len(ids), False)
        dropped = live.turns[held:]
        again = dropped[0].asks_as(turn)
        if any(t.images or t.audios for t in dropped[1 if again else 0:]) or (not again and (turn.images or
                                                                                                turn.audios)):
            return None
        marks = _turn_marks(ids, live.loaded, len(live.turns))
        if marks is None or (not again and held == 0):
            return None
        return (marks[held][0], True) if again else (marks[held - 1][1], False)

    def _answer(self, request: _Request, max_new_tokens: int, turn: Turn) -> Iterator[str]:
        pieces: list[str] = []
        ids: list[int] = []
        try:
            for token, piece in self._run(request, max_new_tokens, keep=True):
                if token not in request.loaded.stops:
                    ids.append(token)
                pieces.append(piece)
                yield piece
        except ChatError:
            self._drop_live()
            raise  # the model failed: nothing was said
        except BaseException:
            self._record(replace(turn, assistant="".join(pieces), answer_ids=tuple(ids)))  # stopped early
            raise
        self._record(replace(turn, assistant="".join(pieces), answer_ids=tuple(ids)))

    def _record(self, turn: Turn) -> None:
        self.turns.append(turn)
        self._answers[self.system, self.tools, tuple(self.turns)] = turn.answer_ids
        while len(self._answers) > ANSWER_MEMORY:
            self._answers.popitem(last=False)
        if self._live is not None:
            self._live.turns = list(self.turns)

    def _drop_live(self) -> None:
        self._live = None  # frees the generator's KV cache

    # ---- raw generation ------------------------------------------------------------------------------------------

    def generate(self, prompt: str, images: Sequence[MediaSource] = (), audios: Sequence[MediaSource] = (),
                 max_new_tokens: int = 32, sampling: Sampling | None = None) -> Generation:
        """Run one prompt as written (no chat template, no history): the processor tensors and the new token ids."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        request = self._prepare(prompt, [open_image(p, self.media) for p in images],
                                [open_audio(p, self.media) for p in audios],
                                max_new_tokens, sampling or Sampling(), room=0)
        inputs = {}
        for name in request.inputs.keys():
            array = request.inputs[name].as_numpy()
            inputs[name] = array.astype(np.int64) if array.dtype.kind == "i" and array.dtype.itemsize == 8 else array
        tokens, pieces = [], []
        for token, piece in self._run(request, max_new_tokens, keep=False):
            tokens.append(token)
            pieces.append(piece)
        return Generation(inputs, tokens, "".join(pieces), request.variant, self.last_stats)

    def _prepare(self, prompt: str, images: Sequence[Media], audios: Sequence[Media], max_new_tokens: int,
                 sampling: Sampling, room: int, turns: Sequence[Turn] = ()) -> _Request:
        if audios and not self.has_speech:
            raise PackageError("this package has no speech model, so it cannot take audio")
        variant = self.variant_for(bool(images), bool(audios))
        loaded = self._load(variant)
        started = time.perf_counter()
        inputs = self._process(loaded, prompt, images, audios)
        if any(t.answer_ids is not None for t in turns):
            ids = _with_answer_ids(inputs["input_ids"].as_numpy()[0].tolist(), turns, loaded)
            inputs = _with_ids(inputs, ids)
        prompt_tokens = int(inputs["input_ids"].as_numpy().shape[-1])
        if prompt_tokens >= self.max_length:
            raise PromptTooLongError(f"the prompt is {prompt_tokens} tokens but the maximum length is "
                                     f"{self.max_length}")
        return _Request(variant, loaded, started, sampling, self._size(prompt_tokens, max_new_tokens, room),
                        prompt_tokens, inputs=inputs)

    def _size(self, tokens: int, max_new_tokens: int, room: int | None = None) -> int:
        room = self.follow_up_room if room is None else room
        return min(self.max_length, tokens + max_new_tokens + room)

    @staticmethod
    def _process(loaded: _Loaded, prompt: str, images: Sequence[Media], audios: Sequence[Media]) -> Any:
        def run(prompt: str, images: Sequence[Media], audios: Sequence[Media]) -> Any:
            return loaded.processor(prompt, images=og_images(images), audios=og_audios(audios))

        try:
            return run(prompt, images, audios)
        except RuntimeError as exc:
            message = first_line(exc)
        # Name the media the processor rejected by trying each alone.
        for kind, items in (("image", images), ("audio", audios)):
            for media in items:
                try:
                    run(f"<|{kind}_1|>", [media] if kind == "image" else [], [media] if kind == "audio" else [])
                except RuntimeError as exc:
                    reason = re.sub(r"^\[\w+\]:\s*", "", first_line(exc))  # "[Phi4VisionProcessor]: ..."
                    raise UnsupportedMediaError(f"cannot read {kind} {media.source}: {reason}", media.source) \
                        from None
        raise ChatError(f"the runtime rejected the prompt: {message}")

    # ---- the generation loop -------------------------------------------------------------------------------------

    def _start(self, request: _Request, inputs: Any) -> _Live:
        """A new generator prefilled with `inputs`."""
        loaded = request.loaded
        if self.before_new_generator is not None:
            self.before_new_generator(request.max_length)
        params = og.GeneratorParams(loaded.model)
        params.set_search_options(max_length=request.max_length, **request.sampling.search_options())
        if request.guidance is not None:
            params.set_guidance(request.guidance.kind, request.guidance.data)
        try:
            generator = og.Generator(loaded.model, params)
        except RuntimeError as exc:
            raise GuidanceError(f"the runtime refused the guidance: {first_line(exc)}") from exc
        try:
            generator.set_inputs(inputs)
        except RuntimeError as exc:
            raise ChatError(f"the model failed on the prompt ({request.variant}): {first_line(exc)}") from exc
        tokens = int(generator.get_sequence(0).shape[-1])
        switch = self.manifest.original_max_position_embeddings
        return _Live(request.variant, loaded, generator, inputs, request.max_length, request.sampling,
                     long_factors=switch is not None and tokens > switch, guided=request.guidance is not None)

    def _extend(self, live: _Live, keep: int, ids: list[int]) -> None:
        """Prefill `ids` after the first `keep` ids of the kept generator's sequence. The last kept id is run again
        with the new ids: after an answer it was sampled but not yet run (the runtime's own append after a generated
        token does not match a prefill of the same ids), and a question asked again needs its logits."""
        sequence = live.token_ids()
        try:
            live.generator.rewind_to(keep - 1)
            live.generator.append_tokens(np.array([sequence[keep - 1], *ids], dtype=np.int32))
        except RuntimeError as exc:
            raise ChatError(f"the model failed on the question ({live.variant}): {first_line(exc)}") from exc

    def _run(self, request: _Request, max_new_tokens: int, keep: bool) -> Iterator[tuple[int, str]]:
        reused = 0
        if request.append is not None and self._live is not None:
            live = self._live
            reused = request.keep - 1  # the last kept id runs again with the new ones
            live.turns = list(self.turns)
            self._extend(live, request.keep, request.append)
        else:
            if keep:
                self._drop_live()  # free the old cache before allocating the new one
            live = self._start(request, request.inputs)
            if keep:
                self._live = live
        tokenizer = live.loaded.tokenizer
        stream = tokenizer.create_stream()
        stops, placeholders = live.loaded.stops, live.loaded.placeholders
        markers = live.loaded.markers()
        first = None
        count = 0
        finish = "length"
        recomputed = False
        self.last_logits = []
        self.last_logprobs = []
        try:
            while count < max_new_tokens and not live.generator.is_done():
                if count and self._at_switch(live):
                    self._recompute(live)
                    recomputed = True
                live.generator.generate_next_token()
                token = int(live.generator.get_next_tokens()[0])
                if self.keep_logits or (request.logprobs is not None and token not in stops):
                    logits = np.asarray(live.generator.get_output("logits"), np.float32)
                    logits = logits.reshape(-1, logits.shape[-1])[-1].copy()
                    if self.keep_logits:
                        self.last_logits.append(logits)
                    if request.logprobs is not None and token not in stops:
                        self.last_logprobs.append(token_logprob(logits, token, request.logprobs, self.token_bytes))
                count += 1
                if first is None:
                    first = time.perf_counter()
                if token in stops:
                    if token in placeholders:
                        # a placeholder fed back would ask the embedding graph for feature rows it is not given: the
                        # generator is run back by that id, and the answer ends there
                        live.generator.rewind_to(int(live.generator.token_count()) - 1)
                    finish = "stop"
                    yield token, ""
                    break
                piece = stream.decode(token)
                # the call markers are plain added tokens in Phi-4-MM's tokenizer; one marked special would decode
                # to nothing, and the calls could not be found in the text
                yield token, piece or markers.get(token, "")
        finally:
            end = time.perf_counter()
            decode_s = end - first if first is not None else 0.0
            self.last_stats = Stats(
                prompt_tokens=request.prompt_tokens,
                new_tokens=count,
                time_to_first_token_s=(first if first is not None else end) - request.started,
                tokens_per_s=(count - 1) / decode_s if count > 1 and decode_s > 0 else 0.0,
                variant=request.variant,
                total_s=end - request.started,
                finish_reason=finish,
                prefill_tokens=request.prompt_tokens - reused,
                reused_tokens=reused,
                recomputed=recomputed,
            )

    def _at_switch(self, live: _Live) -> bool:
        """The next step would run the first position past the LongRoPE switch on a cache of short-factor keys."""
        switch = self.manifest.original_max_position_embeddings
        return (switch is not None and not live.long_factors and not live.guided
                and int(live.generator.token_count()) > switch)

    def _recompute(self, live: _Live) -> None:
        """Replace the generator by one prefilled with every id so far: each key gets the long factors."""
        ids = live.token_ids()
        request = _Request(live.variant, live.loaded, time.perf_counter(), live.sampling, live.max_length, len(ids))
        live.generator = None  # its KV cache is freed before the new one is allocated, not held beside it
        try:
            fresh = self._start(request, _with_ids(live.inputs, ids))
        except ChatError:
            if self._live is live:
                self._drop_live()  # the conversation stays; its next question is prefilled whole
            raise
        live.generator, live.inputs, live.long_factors = fresh.generator, fresh.inputs, True


def _with_answer_ids(ids: list[int], turns: Sequence[Turn], loaded: _Loaded) -> list[int]:
    """The prompt ids with each answer's span (between its turn's <|assistant|> and the next <|end|>) replaced by the
    ids it was generated as; unchanged when the prompt's <|assistant|> ids do not pair up with the turns."""
    assistant, end = loaded.assistant_id, loaded.end_id
    starts = [i + 1 for i, t in enumerate(ids) if t == assistant]
    if len(starts) != len(turns):
        return ids
    out: list[int] = []
    done = 0
    for start, turn in zip(starts, turns):
        if turn.answer_ids is None or turn.assistant is None:
            continue
        stop = ids.index(end, start) if end in ids[start:] else len(ids)
        out += ids[done:start] + list(turn.answer_ids)
        done = stop
    return out + ids[done:]


def _turn_marks(ids: list[int], loaded: _Loaded, count: int) -> list[tuple[int, int]] | None:
    """Per answered turn in `ids`, where its question ends (after <|assistant|>) and where its answer ends (after
    the <|end|> that closes it, or the end of `ids` for a last answer cut short); None unless `ids` holds exactly
    `count` questions."""
    starts = [i + 1 for i, t in enumerate(ids) if t == loaded.assistant_id]
    if len(starts) != count:
        return None
    marks = []
    for i, start in enumerate(starts):
        limit = starts[i + 1] if i + 1 < count else len(ids)
        ends = [j + 1 for j in range(start, limit) if ids[j] == loaded.end_id]
        marks.append((start, ends[0] if ends else limit))
    return marks


def _marker_ids(loaded: _Loaded) -> tuple[int, int] | None:
    """The ids of <|tool_call|> and <|/tool_call|> in `loaded`'s tokenizer, or None."""
    ids = {text: token for token, text in loaded.markers().items()}
    return (ids[TOOL_CALL_OPEN], ids[TOOL_CALL_CLOSE]) if len(ids) == 2 else None


def _required_marker_ids(loaded: _Loaded) -> tuple[int, int]:
    ids = _marker_ids(loaded)
    if ids is None:
        raise ToolsNotSupportedError("this package's tokenizer has no tool-call tokens "
                                     f"({TOOL_CALL_OPEN}, {TOOL_CALL_CLOSE}), so it cannot call tools")
    return ids


def _with_ids(inputs: Any, ids: list[int]) -> Any:
    """`inputs` with its input_ids replaced (media tensors kept: their placeholders are at the same positions)."""
    inputs["input_ids"] = og.Tensor(np.array([ids], dtype=np.int32))
    return inputs


def generate(package_dir: str | Path, prompt: str, images: Sequence[MediaSource] = (),
             audios: Sequence[MediaSource] = (), max_new_tokens: int = 32, max_length: int | None = None,
             execution_provider: str | None = None, threads: int | None = None) -> Generation:
    """One raw generation with a fresh Chat (see Chat.generate)."""
    chat = Chat(package_dir, max_length=max_length, execution_provider=execution_provider, threads=threads)
    return chat.generate(prompt, images, audios, max_new_tokens)
