"""A decoding: one og.Generator with its KV cache, started from processor tensors, extended by appended ids, stepped
one token at a time, closed to free its cache.

- Generators are sized to what they will hold, not to ``max_length``: the runtime allocates (and zero-fills) the KV
  cache for the whole length up front, 256 KiB per token for the real model in fp32.
- ``extend`` prefills ids after the first `keep` ids of the sequence. The last kept id is run again with the new ids:
  after an answer it was sampled but not yet run (the runtime's own append after a generated token does not match a
  prefill of the same ids), and a question asked again needs its logits.
- LongRoPE: the first time the sequence grows past ``original_max_position_embeddings`` the whole cache is recomputed
  with the long factors, once, as the original model's generation does (the runtime does not do this for phi4mm). It
  costs one prefill of that many tokens (media encoded again); the old cache is freed first. A guided decoding is not
  recomputed midway: its grammar state cannot be carried into a new generator.
- Chunked prefill: a prompt longer than the package's prefill chunk (``package.PREFILL_CHUNK`` tokens unless the
  package is opened with another) is computed a chunk at a time (onnxruntime-genai's ``search.chunk_size``). Measured
  at full size on 2 cores, a 3,500-token prompt: first token 46.8 s against 51.9 s in one call, peak anonymous memory
  2.9 GB against 4.0 GB (chunks of 512: 48.5 s, 2.5 GB; 2048: 46.1 s, 3.5 GB). It is the original model's computation
  only where every chunk takes the same branches as the whole prompt, so a decoding chunks only a prompt whose first
  chunk holds every kind of media placeholder the prompt holds (a self-routing decoder picks a call's LoRA by the
  placeholders seen so far), and whose chunks are all on the prompt's side of the LongRoPE switch (each call picks its
  factors by the length so far): a prompt past the switch is chunked one token longer than the switch (a 5,142-token
  photo: 4,097 then 1,045). Its follow-ups are chunked alike: they bring no media, and one that would cross the switch
  restarts over a new decoding.
- ``answer`` gives an Answer: an iterator of Steps (token, text, log-probability), one decoder step per ``next``, with
  its Stats; a caller may interleave the steps of several answers, a step each (and a later batched engine may run
  the steps of several decodings as one).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime_genai as og

from builder_plugin.runtime.errors import ChatError, GuidanceError, first_line
from builder_plugin.runtime.guidance import Guidance
from builder_plugin.runtime.package import LoadedModel
from builder_plugin.runtime.tokens import TokenBytes, TokenLogprob, token_logprob

SEED_RANGE = 1 << 31  # onnxruntime-genai reads random_seed as a non-negative int (a negative one: a random seed)


def prefill_chunk(ids: Sequence[int], chunk: int | None, placeholders: frozenset[int],
                  switch: int | None) -> int | None:
    """The chunk size a decoding started from the prompt `ids` prefills with, or None for whole calls: `chunk` (past
    the switch at least one token longer than it) when every chunk computes what the whole prompt would (see the
    module's notes)."""
    if chunk is not None and switch is not None and chunk <= switch < len(ids):
        chunk = switch + 1  # smaller first chunks would take the short factors, the whole prompt the long ones
    if chunk is None or len(ids) <= chunk:
        return None
    first = placeholders.intersection(ids[:chunk])
    return chunk if first == placeholders.intersection(ids) else None


@dataclass(frozen=True)
class Sampling:
    """Search options of one answer, with the OpenAI API's meaning: the default (all None) is greedy search, and so is
    temperature 0. Setting `temperature`, `top_p` or `top_k` samples, the others taking the OpenAI defaults
    (temperature 1, top_p 1, no top-k limit); a `seed` makes the samples reproducible (any int; without one each
    answer draws its own). The package's own search options (do_sample false, the checkpoint's top_k) are not used.

    onnxruntime-genai 0.18 reads top_k 0 as no limit and top_p 1 as the whole vocabulary, but its sampler without a
    top_k ignores top_p (measured: every top_p gave the samples of top_p 1); its top-k-then-top-p sampler keeps the
    exact nucleus, so a top_p without a top_k is given with top_k = the vocabulary size."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    @property
    def samples(self) -> bool:
        return (self.temperature, self.top_p, self.top_k) != (None, None, None) and \
            (self.temperature is None or self.temperature > 0)

    @property
    def seeded(self) -> bool:
        """Sampled with a seed: its answer depends only on the ids it starts from (the generator's random stream is
        seeded when the generator is made, so such an answer needs a generator of its own)."""
        return self.samples and self.seed is not None

    def search_options(self, vocab_size: int) -> dict[str, Any]:
        if not self.samples:
            return {"do_sample": False}
        top_p = 1.0 if self.top_p is None else float(self.top_p)
        top_k = min(self.top_k or (vocab_size if top_p < 1 else 0), vocab_size)
        return {"do_sample": True, "temperature": float(1.0 if self.temperature is None else self.temperature),
                "top_p": top_p, "top_k": top_k,
                "random_seed": -1 if self.seed is None else int(self.seed) % SEED_RANGE}


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
    prefill_chunk: int | None = None  # tokens per prefill call of the decoding that answered (None: whole calls)


@dataclass(frozen=True)
class Step:
    """One generated token: its text (empty for an id that ends the answer), its log-probability and alternatives
    when asked for, and the logits it was chosen from when kept."""

    token: int
    text: str
    logprob: TokenLogprob | None = None
    logits: np.ndarray | None = None


@dataclass(frozen=True)
class Options:
    """How one answer is generated (besides its search options, fixed when the decoding starts)."""

    max_new_tokens: int
    logprobs: int | None = None  # record the log-probability of each token and this many alternatives
    keep_logits: bool = False  # keep each step's last-position logits ([vocab] float32)


class Decoding:
    """A started og.Generator of `loaded` and the processor tensors it was started from."""

    def __init__(self, loaded: LoadedModel, inputs: Any, max_length: int, sampling: Sampling,
                 guidance: Guidance | None, longrope_switch: int | None, chunk: int | None = None) -> None:
        self.loaded = loaded
        self.max_length = max_length
        self.sampling = sampling
        self.guided = guidance is not None
        self.switch = longrope_switch
        self.inputs = inputs
        self.chunk = chunk  # the package's prefill chunk setting (None: whole calls)
        self.prefill_chunk: int | None = None  # what the current generator prefills with
        self._generator: Any = None
        self._generator = self._new_generator(inputs, guidance)
        # its last step ran past the LongRoPE switch (so every cached key has the long factors)
        self.long_factors = longrope_switch is not None and self.token_count > longrope_switch
        self.recomputed = 0  # LongRoPE recomputes so far (at most one)

    @property
    def variant(self) -> str:
        return self.loaded.variant

    @property
    def alive(self) -> bool:
        return self._generator is not None

    @property
    def kv_tokens(self) -> int:
        """KV positions it holds (allocated for its whole length), 0 once closed. Reads no generator state: safe
        from any thread."""
        return self.max_length if self._generator is not None else 0

    @property
    def token_count(self) -> int:
        return int(self._generator.token_count())

    def token_ids(self) -> list[int]:
        return [int(t) for t in self._generator.get_sequence(0)]

    def close(self) -> None:
        """Free the generator and its KV cache."""
        self._generator = None

    def extend(self, keep: int, ids: list[int]) -> None:
        """Prefill `ids` after the first `keep` ids of the sequence (the last kept one runs again with them)."""
        sequence = self.token_ids()
        try:
            self._generator.rewind_to(keep - 1)
            self._generator.append_tokens(np.array([sequence[keep - 1], *ids], dtype=np.int32))
        except RuntimeError as exc:
            raise ChatError(f"the model failed on the question ({self.variant}): {first_line(exc)}") from exc

    def answer(self, options: Options, token_bytes: TokenBytes, started: float, prompt_tokens: int,
               reused_tokens: int = 0) -> Answer:
        """An answer generated from the current sequence (`started`: the time.perf_counter() the question came;
        `prompt_tokens`: the conversation before the answer, of which `reused_tokens` were already in the cache)."""
        return Answer(self, options, token_bytes, started, prompt_tokens, reused_tokens)

    def first_step(self) -> int:
        """Run an answer's first step: the prefill of what was set or appended, and its first token."""
        self._generator.generate_next_token()
        return int(self._generator.get_next_tokens()[0])

    def step(self) -> int:
        """Run one step after the first (the LongRoPE recompute first when it is due); the token it chose."""
        if self._at_switch():
            self._recompute()
        return self.first_step()

    def rewind_last(self) -> None:
        """Drop the last id of the sequence."""
        self._generator.rewind_to(self.token_count - 1)

    def last_logits(self) -> np.ndarray:
        """The last position's logits of the last step ([vocab] float32)."""
        logits = np.asarray(self._generator.get_output("logits"), np.float32)
        return logits.reshape(-1, logits.shape[-1])[-1].copy()

    @property
    def done(self) -> bool:
        return self._generator.is_done()

    def _new_generator(self, inputs: Any, guidance: Guidance | None) -> Any:
        model = self.loaded.model
        params = og.GeneratorParams(model)
        ids = np.asarray(inputs["input_ids"].as_numpy()).reshape(-1).tolist()
        self.prefill_chunk = prefill_chunk(ids, self.chunk, self.loaded.tokens.placeholders, self.switch)
        chunking = {"chunk_size": self.prefill_chunk} if self.prefill_chunk is not None else {}
        params.set_search_options(max_length=self.max_length, **chunking,
                                  **self.sampling.search_options(self.loaded.vocab_size))
        if guidance is not None:
            params.set_guidance(guidance.kind, guidance.data)
        try:
            generator = og.Generator(model, params)
        except RuntimeError as exc:
            raise GuidanceError(f"the runtime refused the guidance: {first_line(exc)}") from exc
        try:
            generator.set_inputs(inputs)
        except RuntimeError as exc:
            raise ChatError(f"the model failed on the prompt ({self.variant}): {first_line(exc)}") from exc
        return generator

    def _at_switch(self) -> bool:
        """The next step would run the first position past the LongRoPE switch on a cache of short-factor keys (the
        prompt's own positions were prefilled as they are: a step, not the prompt, crosses the switch)."""
        return self.switch is not None and not self.long_factors and not self.guided and \
            self.token_count > self.switch

    def _recompute(self) -> None:
        """Replace the generator by one prefilled with every id so far: each key gets the long factors."""
        ids = self.token_ids()
        self._generator = None  # its KV cache is freed before the new one is allocated, not held beside it
        self.inputs["input_ids"] = og.Tensor(np.array([ids], dtype=np.int32))
        self._generator = self._new_generator(self.inputs, None)
        self.long_factors = True
        self.recomputed += 1


class Answer:
    """One answer generated by a Decoding: each ``next`` runs one step and gives its Step; ``stats`` says how the
    answer went so far (final once it has ended, or been closed)."""

    def __init__(self, decoding: Decoding, options: Options, token_bytes: TokenBytes, started: float,
                 prompt_tokens: int, reused_tokens: int) -> None:
        self.decoding = decoding
        self.options = options
        self.token_bytes = token_bytes
        self.started = started
        self.prompt_tokens = prompt_tokens
        self.reused_tokens = reused_tokens
        self.count = 0
        self.finish_reason = "length"
        self._stream = decoding.loaded.tokenizer.create_stream()
        self._recomputed_before = decoding.recomputed
        self._first: float | None = None
        self._ended: float | None = None

    def __iter__(self) -> Answer:
        return self

    def __next__(self) -> Step:
        decoding, options = self.decoding, self.options
        if self._ended is not None:
            raise StopIteration
        if self.count >= options.max_new_tokens or decoding.done:
            self.close()
            raise StopIteration
        try:
            token = decoding.step() if self.count else decoding.first_step()
        except BaseException:
            self.close()
            raise
        tokens = decoding.loaded.tokens
        stop = token in tokens.stops
        logits = decoding.last_logits() if options.keep_logits or (options.logprobs is not None and not stop) \
            else None
        logprob = token_logprob(logits, token, options.logprobs, self.token_bytes) \
            if options.logprobs is not None and not stop else None
        self.count += 1
        if self._first is None:
            self._first = time.perf_counter()
        kept = logits if options.keep_logits else None
        if stop:
            if token in tokens.placeholders:
                # a placeholder fed back would ask the embedding graph for feature rows it is not given: the
                # generator is run back by that id, and the answer ends there
                decoding.rewind_last()
            self.finish_reason = "stop"
            self.close()
            return Step(token, "", None, kept)
        return Step(token, self._stream.decode(token) or tokens.marker_text(token), logprob, kept)

    @property
    def ended(self) -> bool:
        return self._ended is not None

    def close(self) -> None:
        """End the answer here (a client gone, a stop string): no more steps."""
        if self._ended is None:
            self._ended = time.perf_counter()

    @property
    def stats(self) -> Stats:
        end = self._ended if self._ended is not None else time.perf_counter()
        first = self._first
        decode_s = end - first if first is not None else 0.0
        return Stats(prompt_tokens=self.prompt_tokens, new_tokens=self.count,
                     time_to_first_token_s=(first if first is not None else end) - self.started,
                     tokens_per_s=(self.count - 1) / decode_s if self.count > 1 and decode_s > 0 else 0.0,
                     variant=self.decoding.variant, total_s=end - self.started, finish_reason=self.finish_reason,
                     prefill_tokens=self.prompt_tokens - self.reused_tokens, reused_tokens=self.reused_tokens,
                     recomputed=self.decoding.recomputed > self._recomputed_before,
                     prefill_chunk=self.decoding.prefill_chunk)
