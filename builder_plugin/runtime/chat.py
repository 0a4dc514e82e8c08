"""One conversation with a built package through onnxruntime-genai: streamed answers, images, audio, follow-ups.

`Chat` is a small facade over three parts: the opened package and its loaded models (runtime/package.py, shared by
every conversation on it), the conversation itself (runtime/conversation.py: system prompt, tools, turns, answer ids,
what a kept generation can be reused for) and the decoding that answers (runtime/decoding.py: one og.Generator with its
KV cache, the LongRoPE recompute, one step per token).

- Follow-up questions: the decoding that answered is kept with its KV cache. A question that brings no new image or
  audio (so the mode cannot change) only prefills its own tokens, appended to the conversation's token ids (the
  prompt's ids followed by the generated ids: answers are never re-tokenised). ``restore`` of the first turns of the
  kept conversation keeps it: the next question (an edited later one, or the next one asked again) rewinds it to the
  ids they share. A question with new media, other sampling options, a guided answer, or a conversation changed
  otherwise starts a new decoding over the whole conversation, as the runtime requires for new media; so does a
  seeded answer (``Sampling.seed``), over the kept ids, so that a seed gives the same answer however the
  conversation got there.
- Decodings are sized to the conversation plus ``follow_up_room`` tokens, not to ``max_length``; a follow-up that
  does not fit, or that would take a short-factor cache past the LongRoPE switch, restarts from the same ids.
- Media: every image and clip is decoded first by Pillow / libsndfile in a separate process, with limits and a time
  bound (builder_plugin.media); onnxruntime-genai is given the canonical PNG / WAV bytes, never the file itself (its
  bundled JPEG decoder can hang, or end the process, on a broken file).
- Guidance (runtime/guidance.py) constrains one answer; tools (``Chat.tools``, the JSON list the chat template puts in
  the system message) are rendered by the package's own chat template, read by the runtime from its tokenizer files.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime_genai as og

from builder_plugin.media import MediaDecoder
from builder_plugin.runtime.conversation import Conversation, Held
from builder_plugin.runtime.decoding import Answer, Decoding, Options, Sampling, Stats, Step
from builder_plugin.runtime.errors import ChatError, PackageError, PromptTooLongError
from builder_plugin.runtime.guidance import Guidance, tool_call_grammar
from builder_plugin.runtime.media import MediaSource, open_audio, open_image
from builder_plugin.runtime.package import LoadedModel, Package
from builder_plugin.runtime.prompt import END, USER, Turn, user_content, user_turn
from builder_plugin.runtime.tokens import MAX_TOP_LOGPROBS, TokenLogprob

FOLLOW_UP_ROOM = 1024  # tokens of KV cache kept free for follow-up questions beyond the answer's max_new_tokens


@dataclass
class Generation:
    """One raw generation, for tests: what the processor fed the graphs and the ids the generator produced."""

    inputs: dict[str, np.ndarray]  # processor tensors (int64 ones as np.int64)
    tokens: list[int]  # new token ids, in order (the final eos included when one was produced)
    text: str
    variant: str
    stats: Stats | None = None


@dataclass
class _Kept:
    """The decoding kept for follow-ups and the conversation its ids hold."""

    decoding: Decoding
    system: str | None
    tools: str | None
    turns: tuple[Turn, ...]
    raw: bool = False  # a raw prompt's (Chat.prepare_prompt): it holds no conversation, and is freed when it ends

    def held(self) -> Held:
        return Held(self.system, self.tools, self.turns, tuple(self.decoding.token_ids()))


@dataclass(frozen=True)
class _Plan:
    """How a question is answered: by extending the kept decoding (`append` after its first `keep` ids), or by a
    new decoding of `max_length` positions started from `inputs`."""

    loaded: LoadedModel
    prompt_tokens: int
    max_length: int = 0
    inputs: Any = None
    append: list[int] | None = None
    keep: int = 0


class Answering:
    """A question asked in a Chat and its answer in progress: ``kv_tokens`` is the KV cache its decoding will allocate
    before the first step (0 when it extends the kept one); each ``next`` runs one step and gives its Step. When the
    answer ends, or is closed, the turn is recorded in the conversation with what was generated (a model failure
    records nothing). ``stats`` says how it went. A raw prompt's answer (`question` None: Chat.prepare_prompt)
    records nothing, and its decoding is freed when it ends."""

    def __init__(self, chat: Chat, question: Turn | None, plan: _Plan, sampling: Sampling, guidance: Guidance | None,
                 options: Options, started: float) -> None:
        self.chat = chat
        self.question = question
        self.plan = plan
        self.sampling = sampling
        self.guidance = guidance
        self.options = options
        self.started = started
        self.texts: list[str] = []
        self.ids: list[int] = []  # the answer's token ids (ids that end it excluded)
        self._answer: Answer | None = None
        self._recorded = False

    @property
    def kv_tokens(self) -> int:
        return 0 if self.plan.append is not None else self.plan.max_length

    @property
    def variant(self) -> str:
        return self.plan.loaded.variant

    @property
    def stats(self) -> Stats | None:
        return self._answer.stats if self._answer is not None else None

    def __iter__(self) -> Answering:
        return self

    def __next__(self) -> Step:
        if self._recorded:
            raise StopIteration
        try:
            if self._answer is None:
                self.plan, self._answer = self.chat._begin(self)
            step = next(self._answer)
        except StopIteration:
            self.close()
            raise
        except ChatError:
            self.chat._forget()
            self._recorded = True  # the model failed: nothing was said
            raise
        except BaseException:
            self.close()
            raise
        if step.token not in self.plan.loaded.tokens.stops:
            self.ids.append(step.token)
        self.texts.append(step.text)
        return step

    def close(self) -> None:
        """End the answer here; the turn is recorded with what was generated so far."""
        if self._recorded:
            return
        self._recorded = True
        if self._answer is not None:
            self._answer.close()
        if self.question is None:
            self.chat._end_raw(self.stats)
            return
        self.chat._record(replace(self.question, assistant="".join(self.texts), answer_ids=tuple(self.ids)),
                          self.stats)


class Chat:
    """A conversation with a built package. ``ask`` streams the answer and records the turn.

    `package_dir` may be an opened Package, shared with other Chats (a server keeps several conversations on one
    package); the package options (`max_length`, `execution_provider`, `threads`) then come from it."""

    def __init__(self, package_dir: str | Path | Package, max_length: int | None = None,
                 execution_provider: str | None = None, system: str | None = None,
                 follow_up_room: int = FOLLOW_UP_ROOM, threads: int | None = None,
                 media: MediaDecoder | None = None) -> None:
        if isinstance(package_dir, Package):
            if (max_length, execution_provider, threads) != (None, None, None):
                raise ValueError("max_length, execution_provider and threads are the opened package's")
            self.package = package_dir
        else:
            self.package = Package(package_dir, max_length, execution_provider, threads)
        self.conversation = Conversation(system, memory=self.package.answers)
        self.follow_up_room = follow_up_room
        self.media = media  # decodes the files a question names (None: the process's default decoder)
        self.last_stats: Stats | None = None
        # Off by default: when True, the last-position logits each new token was chosen from ([vocab] float32 each)
        self.keep_logits = False
        self.last_logits: list[np.ndarray] = []
        # Set by ask(logprobs=k): each new token's log-probability and its k most likely alternatives (eos excluded)
        self.last_logprobs: list[TokenLogprob] = []
        self._kept: _Kept | None = None

    # ---- the package ---------------------------------------------------------------------------------------------

    @property
    def package_dir(self) -> Path:
        return self.package.dir

    @property
    def main_decoder(self) -> str:
        return self.package.main_decoder

    @property
    def max_length(self) -> int:
        return self.package.max_length

    @property
    def context_length(self) -> int:
        return self.package.context_length

    @property
    def manifest(self):
        return self.package.manifest

    @property
    def genai_config(self) -> dict[str, Any]:
        return self.package.genai_config

    @property
    def has_speech(self) -> bool:
        return self.package.has_speech

    @property
    def kv_bytes_per_token(self) -> int:
        return self.package.kv_bytes_per_token

    @property
    def token_bytes(self):
        return self.package.token_bytes

    @property
    def routed(self) -> bool:
        return self.package.routed

    def variant_for(self, has_image: bool, has_audio: bool) -> str:
        return self.package.variant_for(has_image, has_audio)

    def is_loaded(self, variant: str) -> bool:
        return self.package.is_loaded(variant)

    def load(self, variant: str) -> None:
        """Load a decoder variant now (it is otherwise loaded on its first question)."""
        self.package.load(variant)

    def model(self, variant: str) -> Any:
        """The og.Model of a decoder variant (loaded on first use and kept)."""
        return self.package.load(variant).model

    def next_variant(self, images: Sequence[object] = (), audios: Sequence[object] = ()) -> str:
        """The variant that will answer the next question if it comes with these files."""
        return self.variant_for(bool(images) or any(t.images for t in self.turns),
                                bool(audios) or any(t.audios for t in self.turns))

    # ---- the conversation ----------------------------------------------------------------------------------------

    @property
    def system(self) -> str | None:
        return self.conversation.system

    @system.setter
    def system(self, system: str | None) -> None:
        self.conversation.system = system

    @property
    def tools(self) -> str | None:
        """Tools the model may call: the JSON text the chat template puts in the system message (None: no tools)."""
        return self.conversation.tools

    @tools.setter
    def tools(self, tools: str | None) -> None:
        self.conversation.tools = tools

    @property
    def turns(self) -> list[Turn]:
        return self.conversation.turns

    @property
    def token_ids(self) -> list[int]:
        """The conversation's token ids held by the kept decoding (prompt ids, then generated and appended ids);
        empty when no decoding holds this conversation."""
        kept = self._kept
        if kept is None or kept.raw or not kept.decoding.alive or (kept.system, kept.tools, kept.turns) != \
                (self.system, self.tools, tuple(self.turns)):
            return []
        return kept.decoding.token_ids()

    @property
    def kv_tokens(self) -> int:
        """Positions of KV cache the kept decoding holds (allocated for its whole length), 0 without one. Unlike
        token_ids it does not touch the generator, so another thread may read it while this one generates."""
        kept = self._kept
        return kept.decoding.kv_tokens if kept is not None else 0

    def clear(self) -> None:
        """Forget the conversation (loaded models are kept)."""
        self.conversation.clear()
        self._forget()

    def release(self) -> None:
        """Free the kept decoding and its KV cache; the conversation stays, and its next question is prefilled whole
        (what an app may do while a conversation is idle)."""
        self._forget()

    def sibling(self) -> Chat:
        """A new, empty conversation on the same package (a server keeps several)."""
        return Chat(self.package, follow_up_room=self.follow_up_room, media=self.media)

    def resume(self, system: str | None, tools: str | None, turns: Sequence[Turn]) -> None:
        """Make `system`, `tools` and the answered `turns` the conversation so far (a server's stateless request): with
        another system prompt or other tools it starts over, else as ``restore``."""
        if (system, tools) != (self.system, self.tools):
            self.conversation.system, self.conversation.tools = system, tools
            self.clear()
        self.restore(turns)

    def restore(self, turns: Sequence[Turn]) -> None:
        """Make `turns` (answered questions) the conversation so far, as if they had been asked here (their media files
        are decoded as ask's are); the next question is answered after them. Restoring the conversation already held
        keeps its decoding, and so does restoring its first turns: a next question that edits a later one, or asks
        the next one again, rewinds it to what they share (unless that drops media, or rewinds a
        LongRoPE-recomputed cache below the switch)."""
        if any(t.assistant is None for t in turns):
            raise ValueError("restored turns must all be answered")
        self.conversation.restore([replace(t, images=tuple(open_image(m, self.media) for m in t.images),
                                           audios=tuple(open_audio(m, self.media) for m in t.audios)) for t in turns])
        kept = self._kept
        if kept is not None and not self.conversation.holds(Held(kept.system, kept.tools, kept.turns, ())):
            self._forget()  # else the next question may rewind it to the turns it shares

    # ---- questions -----------------------------------------------------------------------------------------------

    def ask(self, text: str, images: Sequence[MediaSource] = (), audios: Sequence[MediaSource] = (),
            max_new_tokens: int = 256, sampling: Sampling | None = None, guidance: Guidance | None = None,
            logprobs: int | None = None, role: str = USER) -> Iterator[str]:
        """Ask the next question; returns an iterator over the answer's text pieces as they are generated.

        `guidance` constrains this answer (a JSON schema, a regex or a Lark grammar); `logprobs` (0-20) records each
        token's log-probability and that many alternatives in ``last_logprobs``; `role` "tool" makes the question
        the results of the calls in the last answer (see ``prompt.tool_results``).
        Files are checked, the prompt built, the inputs preprocessed and the grammar compiled before this returns (so
        every ChatError is raised here); the turn is recorded, with the text generated so far, when the iterator
        ends or is closed."""
        question = Turn(text, tuple(open_image(p, self.media) for p in images),
                        tuple(open_audio(p, self.media) for p in audios), role=role)
        return self._pieces(self.prepare(question, max_new_tokens, sampling, guidance, logprobs))

    def prepare(self, question: Turn, max_new_tokens: int = 256, sampling: Sampling | None = None,
                guidance: Guidance | None = None, logprobs: int | None = None) -> Answering:
        """The answer to `question` (its media decoded: runtime.open_image), prepared (prompt built, inputs processed,
        grammar compiled: every ChatError is raised here) and not yet begun."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        sampling = sampling or Sampling()
        has_image, has_audio = self.conversation.has_media(question)
        if has_audio and not self.has_speech:
            raise PackageError("this package has no speech model, so it cannot take audio")
        loaded = self.package.load(self.variant_for(has_image, has_audio))
        started = time.perf_counter()  # the time to the first token counts from here: loading a model is not in it
        if guidance is not None:
            loaded.check_guidance(guidance)
        plan = self._plan(loaded, question, max_new_tokens, sampling, guidance)
        return Answering(self, question, plan, sampling, guidance, Options(max_new_tokens, logprobs, self.keep_logits),
                         started)

    def _plan(self, loaded: LoadedModel, question: Turn, max_new_tokens: int, sampling: Sampling,
              guidance: Guidance | None) -> _Plan:
        plan = self._follow_up(loaded, question, max_new_tokens, sampling, guidance)
        if plan is not None:
            return plan
        header = loaded.tool_header(self.system, self.tools) if self.tools is not None else None
        inputs = loaded.process(self.conversation.prompt(question, header), *self.conversation.media(question))
        ids = inputs["input_ids"].as_numpy()[0].tolist()
        with_answers = self.conversation.answer_ids_in(ids, question, loaded.tokens)
        if with_answers != ids:
            inputs = _with_ids(inputs, with_answers)
        return self._fresh(loaded, inputs, len(with_answers), max_new_tokens, self.follow_up_room)

    def _fresh(self, loaded: LoadedModel, inputs: Any, prompt_tokens: int, max_new_tokens: int, room: int) -> _Plan:
        if prompt_tokens >= self.max_length:
            raise PromptTooLongError(f"the prompt is {prompt_tokens} tokens but the maximum length is "
                                     f"{self.max_length}")
        size = min(self.max_length, prompt_tokens + max_new_tokens + room)
        return _Plan(loaded, prompt_tokens, size, inputs=inputs)

    def _follow_up(self, loaded: LoadedModel, question: Turn, max_new_tokens: int, sampling: Sampling,
                   guidance: Guidance | None) -> _Plan | None:
        """A plan that extends the kept decoding, rewound to what it shares with the conversation (or restarts from
        its token ids), or None for a new prompt."""
        kept = self._kept
        if kept is None or kept.raw or not kept.decoding.alive or kept.decoding.sampling != sampling or \
                kept.decoding.loaded is not loaded:
            return None
        held = kept.held()
        reuse = self.conversation.reuse(held, question, loaded.tokens)
        if reuse is None:
            return None
        ids = list(held.ids)
        new: list[int] = []
        if not reuse.asked_again:
            prefix = "" if loaded.tokens.end_id == ids[reuse.keep - 1] else END  # an answer cut short gets its end
            new = loaded.encode(prefix + user_turn(user_content(question), question.role))
        total = reuse.keep + len(new)
        if total >= self.max_length:
            raise PromptTooLongError(f"the conversation is {total} tokens but the maximum length is "
                                     f"{self.max_length}")
        decoding, switch = kept.decoding, self.package.longrope_switch
        if switch is not None and decoding.long_factors and total <= switch:
            return None  # rewound below the switch: its keys have the long factors, a fresh prompt the short ones
        crosses = switch is not None and not decoding.long_factors and total > switch
        if total + max_new_tokens <= decoding.max_length and not crosses and guidance is None and \
                not decoding.guided and not sampling.seeded:
            return _Plan(loaded, total, decoding.max_length, append=new, keep=reuse.keep)
        # Restart over the same ids: more room, a prompt past the LongRoPE switch (all keys with long factors), or a
        # seeded answer (the generator's random stream is seeded when it is made and cannot be reseeded: a kept one
        # has drawn for the answers before, so the same seed would not give the answer a fresh conversation gets).
        return self._fresh(loaded, _with_ids(decoding.inputs, ids[:reuse.keep] + new), total, max_new_tokens,
                           self.follow_up_room)

    def _pieces(self, answering: Answering) -> Iterator[str]:
        self.last_logits, self.last_logprobs = [], []
        try:
            for step in answering:
                if step.logits is not None:
                    self.last_logits.append(step.logits)
                if step.logprob is not None:
                    self.last_logprobs.append(step.logprob)
                yield step.text
        finally:
            answering.close()

    # ---- what an Answering calls back ----------------------------------------------------------------------------

    def _begin(self, answering: Answering) -> tuple[_Plan, Answer]:
        """The plan that runs and the answer of its decoding: the kept one extended, or a new one (the old one freed
        first)."""
        plan = answering.plan
        if answering.question is None:
            self._forget()
            decoding = Decoding(plan.loaded, plan.inputs, plan.max_length, answering.sampling, None,
                                self.package.longrope_switch, self.package.prefill_chunk)
            self._kept = _Kept(decoding, None, None, (), raw=True)  # held while it answers: its cache is counted
            return plan, decoding.answer(answering.options, self.token_bytes, answering.started, plan.prompt_tokens)
        if plan.append is not None and (self._kept is None or not self._kept.decoding.alive):
            # released since the answer was prepared: the whole conversation is prefilled instead
            plan = self._plan(plan.loaded, answering.question, answering.options.max_new_tokens, answering.sampling,
                              answering.guidance)
        reused = 0
        if plan.append is not None and self._kept is not None:
            decoding = self._kept.decoding
            self._kept.turns = tuple(self.turns)
            reused = plan.keep - 1  # the last kept id runs again with the new ones
            decoding.extend(plan.keep, plan.append)
        else:
            self._forget()  # the old cache is freed before the new one is allocated
            decoding = Decoding(plan.loaded, plan.inputs, plan.max_length, answering.sampling, answering.guidance,
                                self.package.longrope_switch, self.package.prefill_chunk)
            self._kept = _Kept(decoding, self.system, self.tools, tuple(self.turns))
        return plan, decoding.answer(answering.options, self.token_bytes, answering.started, plan.prompt_tokens,
                                     reused)

    def _record(self, turn: Turn, stats: Stats | None) -> None:
        self.conversation.record(turn)
        self.last_stats = stats
        if self._kept is not None:
            self._kept.turns = tuple(self.turns)

    def _end_raw(self, stats: Stats | None) -> None:
        self.last_stats = stats
        self._forget()

    def _forget(self) -> None:
        if self._kept is not None:
            self._kept.decoding.close()
        self._kept = None

    # ---- tools ---------------------------------------------------------------------------------------------------

    def tool_call_ids(self, variant: str | None = None) -> tuple[int, int] | None:
        """The ids of the call markers (<|tool_call|>, <|/tool_call|>) in the package's tokenizer; None when it has
        no such tokens (each must be one token)."""
        return self.package.load(variant or self.next_variant()).tokens.tool_call

    def tool_guidance(self, functions: Sequence[tuple[str, dict[str, Any]]], single: bool) -> Guidance:
        """The grammar of a call block naming only `functions` ((name, parameters schema) pairs)."""
        return tool_call_grammar(*self.package.load(self.next_variant()).require_tool_calls(), functions, single)

    # ---- raw generation ------------------------------------------------------------------------------------------

    def prepare_prompt(self, prompt: str, images: Sequence[MediaSource] = (), audios: Sequence[MediaSource] = (),
                       max_new_tokens: int = 32, sampling: Sampling | None = None,
                       logprobs: int | None = None) -> Answering:
        """The answer to one prompt as written (no chat template, no history, nothing recorded), prepared as
        ``prepare``'s; its decoding replaces the kept one (freed first) and is freed when it ends."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        started = time.perf_counter()
        images = [open_image(p, self.media) for p in images]
        audios = [open_audio(p, self.media) for p in audios]
        if audios and not self.has_speech:
            raise PackageError("this package has no speech model, so it cannot take audio")
        loaded = self.package.load(self.variant_for(bool(images), bool(audios)))
        inputs = loaded.process(prompt, images, audios)
        plan = self._fresh(loaded, inputs, int(inputs["input_ids"].shape()[-1]), max_new_tokens, room=0)
        return Answering(self, None, plan, sampling or Sampling(), None,
                         Options(max_new_tokens, logprobs, self.keep_logits), started)

    def generate(self, prompt: str, images: Sequence[MediaSource] = (), audios: Sequence[MediaSource] = (),
                 max_new_tokens: int = 32, sampling: Sampling | None = None) -> Generation:
        """Run one prompt as written (no chat template, no history): the processor tensors and the new token ids.
        Like prepare_prompt, it frees the kept decoding first (the next question is prefilled whole)."""
        answering = self.prepare_prompt(prompt, images, audios, max_new_tokens, sampling)
        inputs = answering.plan.inputs
        arrays = {}
        for name in inputs.keys():
            array = inputs[name].as_numpy()
            arrays[name] = array.astype(np.int64) if array.dtype.kind == "i" and array.dtype.itemsize == 8 else array
        steps = list(answering)
        return Generation(arrays, [s.token for s in steps], "".join(s.text for s in steps), answering.variant,
                          self.last_stats)


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
