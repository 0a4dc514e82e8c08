"""Follow-up questions on the kept generator, and the LongRoPE switch, against the PyTorch reference.

A follow-up's tokens and logits must equal the reference run over the same token ids (the conversation's prompt ids,
generated ids and the question's ids), with the image/audio features of the first turn; a generation that crosses
``original_max_position_embeddings`` must equal the reference's generation loop that, like the original model,
recomputes every position once at the switch.
"""

from __future__ import annotations

import weakref

import numpy as np
import onnxruntime_genai as og
import pytest

from builder_plugin.layout import IMAGE_TOKEN_ID, INPUT_IDS
from builder_plugin.reference.model import Reference
from builder_plugin.runtime import Chat, Sampling, Turn, build_prompt, open_audio, open_image
from tests.support.greedy import LOGITS_ATOL, agreed, assert_matches

MEDIA = {"text": ((), ()), "image": (("square.png",), ()), "audio": ((), ("clip_2s.wav",))}


def _first_turn_inputs(package, media_dir, question: str, mode: str) -> tuple[dict[str, np.ndarray], list, list]:
    """The processor tensors of the conversation's first prompt, made by a separate Chat."""
    images = [media_dir / name for name in MEDIA[mode][0]]
    audios = [media_dir / name for name in MEDIA[mode][1]]
    prompt = build_prompt([Turn(question, tuple(map(open_image, images)), tuple(map(open_audio, audios)))])
    return Chat(package).generate(prompt, images, audios, max_new_tokens=1).inputs, images, audios


@pytest.mark.parametrize(("layout", "mode"), [("routed", "text"), ("routed", "image"), ("routed", "audio"),
                                              ("split", "audio")])
def test_follow_up_equals_the_reference_over_the_same_ids(layout, mode, request, media_dir, reference):
    package = request.getfixturevalue({"routed": "tiny_package", "split": "tiny_split_package"}[layout])
    question = "Describe what you get."
    first_inputs, images, audios = _first_turn_inputs(package, media_dir, question, mode)
    chat = Chat(package)
    chat.keep_logits = True
    list(chat.ask(question, images, audios, max_new_tokens=4))
    kept = chat.token_ids
    assert kept[:first_inputs[INPUT_IDS].shape[1]] == first_inputs[INPUT_IDS][0].tolist()

    for follow_up in ("And what else?", "Say it again, shorter."):
        list(chat.ask(follow_up, max_new_tokens=6))
        stats = chat.last_stats
        assert stats.reused_tokens == len(kept) - 1 and stats.prefill_tokens < 20  # not the whole conversation
        ids = chat.token_ids
        assert ids[:len(kept)] == kept  # answers are never re-tokenised
        prefix, new = ids[:stats.prompt_tokens], ids[stats.prompt_tokens:]
        assert len(new) == stats.new_tokens == 6
        inputs = {**first_inputs, INPUT_IDS: np.array([prefix], np.int64)}
        expected = reference.prefill_and_greedy(inputs, max_new_tokens=len(new))
        assert expected.lora == Reference.lora_for_mode(Reference.mode_for(bool(images), bool(audios)))
        assert_matches(chat, new, expected, f"{layout} {mode}: {follow_up}")
        kept = ids


def _text_ids_length(package, question: str) -> int:
    return Chat(package).generate(build_prompt([question]), max_new_tokens=1).inputs[INPUT_IDS].shape[1]


@pytest.mark.parametrize("mode", ["text", "audio"])
def test_generation_crossing_the_longrope_switch_recomputes_like_the_original(mode, tiny_package, tiny_config,
                                                                              media_dir, reference):
    switch = tiny_config.text.original_max_position_embeddings
    question = "Count."
    first_inputs, images, audios = _first_turn_inputs(tiny_package, media_dir, question, mode)
    prompt_tokens = first_inputs[INPUT_IDS].shape[1]
    assert prompt_tokens < switch
    new_tokens = switch - prompt_tokens + 12  # crosses the switch during generation
    chat = Chat(tiny_package)
    chat.keep_logits = True
    list(chat.ask(question, images, audios, max_new_tokens=new_tokens))
    assert chat.last_stats.recomputed
    generated = chat.token_ids[prompt_tokens:]
    expected = reference.prefill_and_greedy(first_inputs, max_new_tokens=new_tokens, recompute_at_switch=True)
    assert_matches(chat, generated, expected, f"{mode} across the switch")

    # The recompute matters: the plain incremental loop (cached short-factor keys) is measurably different after it.
    incremental = reference.prefill_and_greedy(first_inputs, max_new_tokens=new_tokens)
    after = switch - prompt_tokens + 1
    drift = max(float(np.abs(a - b).numpy().max()) for a, b in
                zip(expected.step_logits[after:], incremental.step_logits[after:]))
    assert drift > 10 * LOGITS_ATOL


def test_follow_up_crossing_the_switch_restarts_over_the_same_ids(tiny_package, tiny_config, reference):
    """A question that takes a short-factor conversation past the switch is prefilled with every id again."""
    switch = tiny_config.text.original_max_position_embeddings
    question = "Count."
    prompt_tokens = _text_ids_length(tiny_package, question)
    chat = Chat(tiny_package)
    chat.keep_logits = True
    list(chat.ask(question, max_new_tokens=switch - prompt_tokens - 4))
    kept = chat.token_ids
    assert len(kept) <= switch
    list(chat.ask("Go on, please, with a few more words.", max_new_tokens=5))
    stats = chat.last_stats
    assert stats.prompt_tokens > switch and stats.reused_tokens == 0 and not stats.recomputed
    ids = chat.token_ids
    assert ids[:len(kept)] == kept
    expected = reference.prefill_and_greedy({INPUT_IDS: np.array([ids[:stats.prompt_tokens]], np.int64)},
                                            max_new_tokens=5)
    assert_matches(chat, ids[stats.prompt_tokens:], expected, "follow-up past the switch")


def test_the_recompute_frees_the_old_cache_first(tiny_package, tiny_config, monkeypatch):
    """At the switch only one KV cache is alive: the old generator is released before the new one is prefilled
    (holding both took 13.5 GB against 8.5 GB at full size for a 4k-token conversation)."""
    switch = tiny_config.text.original_max_position_embeddings
    question = "Count."
    prompt_tokens = _text_ids_length(tiny_package, question)
    chat = Chat(tiny_package)
    generators = []  # og generators created, each with whether one made before it is still alive then
    real = og.Generator

    def tracked(model, params):
        alive = [ref() is not None for ref in generators]
        generator = real(model, params)
        generators.append(weakref.ref(generator))
        alive_at_start.append(any(alive))
        return generator

    alive_at_start: list[bool] = []
    monkeypatch.setattr(og, "Generator", tracked)
    list(chat.ask(question, max_new_tokens=switch - prompt_tokens + 4))
    assert chat.last_stats.recomputed
    assert alive_at_start == [False, False]  # the first start, and the recompute's: no other cache alive


def test_a_conversation_prompted_again_has_the_same_ids(tiny_package, media_dir, reference):
    """Kept generator, a new Chat given the turns, the same Chat after another conversation (turns restored from
    their text), and after release(): the same token ids each way (answers are never re-tokenised), and the answer
    the reference gives over them."""
    image = media_dir / "square.png"
    first_inputs, _, _ = _first_turn_inputs(tiny_package, media_dir, "Describe it.", "image")
    live = Chat(tiny_package)
    list(live.ask("Describe it.", [image], max_new_tokens=3))
    first = list(live.turns)
    list(live.ask("And then?", max_new_tokens=3))
    want = live.token_ids
    assert live.last_stats.reused_tokens > 0
    prompt = live.last_stats.prompt_tokens
    expected = reference.prefill_and_greedy({**first_inputs, INPUT_IDS: np.array([want[:prompt]], np.int64)},
                                            max_new_tokens=3)
    count = agreed(expected)
    assert want[prompt:prompt + count] == expected.tokens[:count]

    other = Chat(tiny_package)
    other.restore(first)  # turns carry their answer ids
    list(other.ask("And then?", max_new_tokens=3))
    assert other.last_stats.reused_tokens == 0 and other.token_ids == want

    live.clear()
    list(live.ask("Something else.", max_new_tokens=2))
    live.restore([Turn(t.user, t.images, t.audios, t.assistant) for t in first])  # text only, as a client sends it
    list(live.ask("And then?", max_new_tokens=3))
    assert live.last_stats.reused_tokens == 0 and live.token_ids == want

    live.release()
    list(live.ask("Why?", max_new_tokens=2))
    again = Chat(tiny_package)
    again.restore(live.turns[:-1])
    list(again.ask("Why?", max_new_tokens=2))
    assert again.token_ids == live.token_ids


@pytest.mark.parametrize("mode", ["text", "image"])
def test_a_rewound_generator_equals_the_reference(mode, tiny_package, media_dir, reference):
    """The last question edited (the first turns restored, another question asked) and an answer asked for again
    (the same question after the turns before it) rewind the kept generator to what they share: only the new
    question's ids are prefilled, and the answer equals the reference over the conversation's ids."""
    first_inputs, images, audios = _first_turn_inputs(tiny_package, media_dir, "Describe what you get.", mode)
    chat = Chat(tiny_package)
    chat.keep_logits = True
    list(chat.ask("Describe what you get.", images, audios, max_new_tokens=4))
    after_first = chat.token_ids
    first_turn = list(chat.turns)
    list(chat.ask("And what else?", max_new_tokens=5))

    chat.restore(first_turn)  # the client edited its second question
    list(chat.ask("Name one colour.", max_new_tokens=5))
    stats = chat.last_stats
    # the first answer and the <|end|> that closed it (appended with the second question when it was cut short)
    assert len(after_first) - 1 <= stats.reused_tokens <= len(after_first) and stats.prefill_tokens < 20
    ids = chat.token_ids
    assert ids[:len(after_first)] == after_first
    expected = reference.prefill_and_greedy({**first_inputs, INPUT_IDS: np.array([ids[:stats.prompt_tokens]],
                                                                                     np.int64)}, max_new_tokens=5)
    assert_matches(chat, ids[stats.prompt_tokens:], expected, f"{mode}: edited question")

    chat.restore([])  # the client asks for the first answer again, with its media
    list(chat.ask("Describe what you get.", images, audios, max_new_tokens=4))
    stats = chat.last_stats
    prompt = first_inputs[INPUT_IDS].shape[1]
    assert stats.prompt_tokens == prompt and stats.reused_tokens == prompt - 1 and stats.prefill_tokens == 1
    ids = chat.token_ids
    assert ids[:prompt] == first_inputs[INPUT_IDS][0].tolist()
    expected = reference.prefill_and_greedy(first_inputs, max_new_tokens=4)
    assert_matches(chat, ids[prompt:], expected, f"{mode}: answer asked again")


def test_a_rewind_that_would_drop_media_starts_over(tiny_package, media_dir):
    """Turns after the shared ones brought an image: the generator's tensors hold it, so a new one is started."""
    chat = Chat(tiny_package)
    list(chat.ask("Hello.", max_new_tokens=3))
    first_turn = list(chat.turns)
    list(chat.ask("Look.", [media_dir / "square.png"], max_new_tokens=3))
    chat.restore(first_turn)
    list(chat.ask("Something else.", max_new_tokens=3))
    assert chat.last_stats.reused_tokens == 0
    fresh = Chat(tiny_package)
    fresh.restore(first_turn)
    list(fresh.ask("Something else.", max_new_tokens=3))
    assert fresh.token_ids == chat.token_ids


@pytest.mark.parametrize("past", [0, 1], ids=["at-the-switch", "one-past"])
def test_a_follow_up_at_the_switch_appends_and_one_past_it_restarts(past, tiny_package, tiny_config, reference):
    """The follow-up's prompt ends exactly at original_max_position_embeddings: its ids are appended to the kept
    short-factor cache (the answer then recomputes at its first step past the switch); one id more: the whole
    conversation is prefilled again with the long factors. Either way the answer equals the reference's generation
    loop over the same ids, which recomputes when the sequence grows past the switch."""
    switch = tiny_config.text.original_max_position_embeddings
    question, follow_up = "Count.", "Go on."
    probe = Chat(tiny_package)
    list(probe.ask(question, max_new_tokens=4))
    kept = len(probe.token_ids)
    list(probe.ask(follow_up, max_new_tokens=1))
    question_ids = probe.last_stats.prompt_tokens - kept  # <|end|> of the cut answer and the follow-up's turn
    first_answer = switch + past - question_ids - _text_ids_length(tiny_package, question)

    chat = Chat(tiny_package)
    chat.keep_logits = True
    list(chat.ask(question, max_new_tokens=first_answer))
    assert chat.last_stats.new_tokens == first_answer  # no end of answer: the conversation has the length planned
    list(chat.ask(follow_up, max_new_tokens=4))
    stats = chat.last_stats
    assert stats.prompt_tokens == switch + past
    if past:
        assert stats.reused_tokens == 0 and not stats.recomputed
    else:
        assert stats.reused_tokens == switch - question_ids - 1 and stats.recomputed
    ids = chat.token_ids
    expected = reference.prefill_and_greedy({INPUT_IDS: np.array([ids[:stats.prompt_tokens]], np.int64)},
                                            max_new_tokens=4, recompute_at_switch=True)
    assert_matches(chat, ids[stats.prompt_tokens:], expected, f"follow-up ending {past} past the switch")


def test_a_follow_up_with_other_sampling_starts_a_new_generator(tiny_package):
    """The kept generator samples with the options it was made with: a question asking for others gets a new one
    over the conversation's ids, and its answer is the one a fresh conversation with those options gives."""
    sampling = Sampling(temperature=0.8, top_k=5, seed=7)
    chat = Chat(tiny_package)
    list(chat.ask("Hello.", max_new_tokens=4))
    turns = list(chat.turns)
    sampled = "".join(chat.ask("Tell me more.", max_new_tokens=6, sampling=sampling))
    assert chat.last_stats.reused_tokens == 0
    fresh = Chat(tiny_package)
    fresh.restore(turns)
    assert "".join(fresh.ask("Tell me more.", max_new_tokens=6, sampling=sampling)) == sampled
    assert fresh.token_ids == chat.token_ids
    unseeded = Sampling(temperature=0.8, top_k=5)
    list(chat.ask("And?", max_new_tokens=3, sampling=unseeded))
    list(chat.ask("So?", max_new_tokens=3, sampling=unseeded))  # the same options again: the generator is kept
    assert chat.last_stats.reused_tokens > 0


def test_a_generated_placeholder_ends_the_answer_and_is_not_fed_back(tiny_package, reference):
    """The tiny random model generates the image placeholder id after 63 tokens of this answer (the reference's
    greedy loop does too). Fed back, the embedding graph would be asked for an image feature row it is not given:
    the answer ends there instead ("stop"), the generator holds the ids before it, and a follow-up goes on from
    them as a fresh conversation restored from the turns does."""
    system, question = "You are a concise assistant.", "Translate 'good morning' into Spanish. (request 52)"
    chat = Chat(tiny_package, system=system)
    chat.keep_logits = True
    list(chat.ask(question, max_new_tokens=256))
    stats = chat.last_stats
    ids = chat.token_ids
    prompt = stats.prompt_tokens
    expected = reference.prefill_and_greedy({INPUT_IDS: np.array([ids[:prompt]], np.int64)},
                                            max_new_tokens=stats.new_tokens)
    assert expected.tokens[-1] == IMAGE_TOKEN_ID and IMAGE_TOKEN_ID not in expected.tokens[:-1]
    assert stats.finish_reason == "stop" and ids[prompt:] == expected.tokens[:-1]
    assert chat.turns[-1].answer_ids == tuple(expected.tokens[:-1])

    list(chat.ask("And again?", max_new_tokens=4))
    assert chat.last_stats.reused_tokens == len(ids) - 1
    fresh = Chat(tiny_package, system=system)
    fresh.restore(chat.turns[:1])
    list(fresh.ask("And again?", max_new_tokens=4))
    assert fresh.token_ids == chat.token_ids
