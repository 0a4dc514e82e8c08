"""Chunked prefill (runtime/decoding.py): which prompts a decoding chunks, and that a chunked prompt and its follow-ups
answer as the PyTorch reference does over the same ids."""

from __future__ import annotations

import numpy as np
import pytest

from builder_plugin.layout import INPUT_IDS
from builder_plugin.runtime import Chat, Package, PackageError, Turn, build_prompt, open_audio, open_image
from builder_plugin.runtime.decoding import prefill_chunk
from tests.support.greedy import assert_matches

IMAGE, AUDIO = 7, 8  # placeholder ids of the rule's cases
PLACEHOLDERS = frozenset({IMAGE, AUDIO})


@pytest.mark.parametrize(("ids", "chunk", "switch", "expected"), [
    ([1] * 10, 4, 100, 4),  # text within the switch
    ([1] * 10, 10, 100, None),  # one chunk: one call
    ([1] * 10, None, 100, None),  # chunking off
    ([1] * 10, 4, None, 4),  # no LongRoPE
    ([1] * 10, 4, 8, 9),  # past the switch: chunks one token longer than it, every call past it like the prompt
    ([1] * 9, 4, 8, None),  # ... which is the whole prompt here
    ([1] * 10, 9, 8, 9),  # chunks longer than the switch already
    ([1] * 10, 4, 3, 4),  # a switch shorter than the chunk
    ([1, IMAGE, IMAGE, 1, IMAGE, IMAGE, 1, 1, 1, 1], 4, 100, 4),  # media from the first chunk on
    ([1, 1, 1, 1, 1, IMAGE, IMAGE, 1, 1, 1], 4, 100, None),  # media after a first chunk without it
    ([1, IMAGE, 1, 1, 1, 1, AUDIO, 1, 1, 1], 4, 100, None),  # audio only in a later chunk
    ([1, IMAGE, AUDIO, 1, 1, 1, AUDIO, 1, 1, 1], 4, 100, 4),  # both kinds in the first chunk
])
def test_a_decoding_chunks_only_where_every_chunk_computes_what_the_prompt_does(ids, chunk, switch, expected):
    assert prefill_chunk(ids, chunk, PLACEHOLDERS, switch) == expected


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_a_bad_prefill_chunk_is_refused(chunk, tiny_package):
    with pytest.raises(PackageError, match="prefill_chunk"):
        Package(tiny_package, prefill_chunk=chunk)


# (images, audios, question, chunk): the tiny checkpoint switches to the long factors past 128 tokens, and an image
# prompt is longer than that, so its chunks are longer than the switch too
CASES = {
    "text": ((), (), "Describe what you get, in many words, and then say it all again. " * 3, 16),
    "audio": ((), ("clip_2s.wav",), "Describe what you get.", 16),
    "image": (("square.png",), (), "Describe what you get.", 200),
}


@pytest.mark.parametrize("mode", sorted(CASES))
def test_a_chunked_prompt_and_its_follow_up_equal_the_reference(mode, tiny_package, media_dir, reference):
    image_names, audio_names, question, chunk = CASES[mode]
    images = [media_dir / name for name in image_names]
    audios = [media_dir / name for name in audio_names]
    prompt = build_prompt([Turn(question, tuple(map(open_image, images)), tuple(map(open_audio, audios)))])
    inputs = Chat(tiny_package).generate(prompt, images, audios, max_new_tokens=1).inputs
    assert inputs[INPUT_IDS].shape[1] > 2 * chunk  # the placeholders run over several chunks

    chat = Chat(Package(tiny_package, prefill_chunk=chunk))
    chat.keep_logits = True
    list(chat.ask(question, images, audios, max_new_tokens=4))
    stats = chat.last_stats
    assert stats.prefill_chunk == chunk
    ids = chat.token_ids
    expected = reference.prefill_and_greedy(inputs, max_new_tokens=4)
    assert_matches(chat, ids[stats.prompt_tokens:], expected, f"{mode}, chunks of {chunk}")

    follow_up = "And now tell me once more what you got, and then what you would do with it next. " * (chunk // 16)
    list(chat.ask(follow_up, max_new_tokens=4))
    stats = chat.last_stats
    assert stats.prefill_tokens > chunk and stats.reused_tokens > 0 and stats.prefill_chunk == chunk
    ids = chat.token_ids
    expected = reference.prefill_and_greedy({**inputs, INPUT_IDS: np.array([ids[:stats.prompt_tokens]], np.int64)},
                                            max_new_tokens=4)
    assert_matches(chat, ids[stats.prompt_tokens:], expected, f"{mode} follow-up, chunks of {chunk}")


def test_media_after_the_first_chunk_is_prefilled_whole(tiny_package, media_dir, reference):
    """A conversation whose first turn is text and whose second brings audio: the new decoding's first chunk holds no
    placeholder, so it prefills in one call, with the speech LoRA for every position."""
    chat = Chat(Package(tiny_package, prefill_chunk=16))
    chat.keep_logits = True
    list(chat.ask("Say something about the sea, the ships and the storm, in a few words.", max_new_tokens=3))
    clip = media_dir / "clip_2s.wav"
    list(chat.ask("And this?", audios=[clip], max_new_tokens=4))
    stats = chat.last_stats
    assert stats.reused_tokens == 0 and stats.prefill_chunk is None
    ids = chat.token_ids
    features = Chat(tiny_package).generate(build_prompt([Turn("And this?", (), (open_audio(clip),))]), [], [clip],
                                           max_new_tokens=1).inputs  # the clip's tensors (the ids are the chat's)
    expected = reference.prefill_and_greedy({**features, INPUT_IDS: np.array([ids[:stats.prompt_tokens]], np.int64)},
                                            max_new_tokens=4)
    assert_matches(chat, ids[stats.prompt_tokens:], expected, "audio after a text turn")


def test_onnxruntime_genai_prefills_in_the_chunks_it_is_given(tiny_package, tiny_config):
    """The chunk size reaches the runtime (not read past): chunks that start below the LongRoPE switch give a prompt
    past it other logits (short factors for the first chunks) than one call does; the rule above refuses that case."""
    import onnxruntime_genai as og

    model = og.Model(str(tiny_package))
    ids = og.Tokenizer(model).encode("The ships passed in the storm. " * 40)
    assert len(ids) > tiny_config.text.original_max_position_embeddings

    def logits(chunk: int | None) -> np.ndarray:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 8, **({"chunk_size": chunk} if chunk else {}))
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        return np.array(generator.get_logits())

    whole = logits(None)
    assert np.abs(logits(32) - whole).max() > 1.0


def test_a_prompt_past_the_switch_is_chunked_past_it(tiny_package, tiny_config, reference):
    """Chunks of 16 would start below the LongRoPE switch: a longer prompt takes chunks one token longer than the
    switch, every call then past it as the whole prompt is, and answers as the reference does."""
    switch = tiny_config.text.original_max_position_embeddings
    chat = Chat(Package(tiny_package, prefill_chunk=16))
    chat.keep_logits = True
    list(chat.ask("The ships passed in the storm and the keeper counted every one of them. " * 18, max_new_tokens=4))
    stats = chat.last_stats
    assert stats.prompt_tokens > switch + 1 and stats.prefill_chunk == switch + 1
    ids = chat.token_ids
    expected = reference.prefill_and_greedy({INPUT_IDS: np.array([ids[:stats.prompt_tokens]], np.int64)},
                                            max_new_tokens=4)
    assert_matches(chat, ids[stats.prompt_tokens:], expected, "past the switch, chunks of the switch + 1")
