"""builder_plugin.runtime.Chat on built tiny packages: decoder per input mode (self-routing and split packages),
generation compared with the PyTorch reference (transformers' native model with the LoRA of the input mode),
conversations, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from builder_plugin.layout import GENAI_CONFIG_FILE, INPUT_IDS, MAIN_DECODER, SPLIT_DECODERS
from builder_plugin.runtime import (
    MANIFEST_FILE,
    TOOL,
    Chat,
    Guidance,
    GuidanceError,
    MediaNotFoundError,
    PackageError,
    PromptTooLongError,
    TagMismatchError,
    Turn,
    UnsupportedMediaError,
    build_prompt,
    open_audio,
    open_image,
    tool_results,
)
from builder_plugin.testing.media import make_wav

IMAGE = "square.png"
AUDIO = "clip_2s.wav"
NEAR_TIE = 1e-3  # top-1 minus top-2 reference logit below which fp32 rounding may flip the argmax


@pytest.fixture(scope="module")
def package(tiny_package) -> Path:
    return tiny_package


@pytest.fixture(scope="module")
def chat(package) -> Chat:
    return Chat(package)


@pytest.fixture(scope="module")
def split_chat(tiny_split_package) -> Chat:
    return Chat(tiny_split_package)


@pytest.fixture
def conversation(chat) -> Chat:
    """The module's Chat (its models stay loaded) with an empty conversation."""
    chat.clear()
    chat.system = None
    yield chat
    chat.clear()
    chat.system = None


@pytest.fixture
def conversation_with_tools(conversation) -> Chat:
    yield conversation
    conversation.tools = None


def _copy_package(package: Path, folder: Path, drop: tuple[str, ...] = ()) -> Path:
    """A package folder of links to `package`'s files, without `drop`."""
    folder.mkdir()
    for path in package.iterdir():
        if path.name not in drop:
            (folder / path.name).symlink_to(path)
    return folder


def test_not_a_package(tmp_path):
    with pytest.raises(PackageError, match="package folder not found"):
        Chat(tmp_path / "nowhere")
    with pytest.raises(PackageError, match="no genai_config.json"):
        Chat(tmp_path)


def test_split_decoder_names():
    """The file names apps and older packages know, pinned here once (the other tests use `layout`'s)."""
    assert SPLIT_DECODERS == {"text": "phi-4-mm-text-base.onnx", "vision": "phi-4-mm-text.onnx",
                              "speech": "phi-4-mm-text-speech.onnx"}


# ---- with the built package -----------------------------------------------------------------------------------------


def test_routed_package_answers_every_mode_with_one_decoder(chat, package):
    assert chat.routed and chat.manifest.routing == "self"
    assert json.loads((package / MANIFEST_FILE).read_text())["routing"] == "self"
    assert sorted(p.name for p in package.glob("phi-4-mm-text*.onnx")) == [MAIN_DECODER]
    for has_image in (False, True):
        for has_audio in (False, True):
            assert chat.variant_for(has_image, has_audio) == MAIN_DECODER


def test_split_package_has_a_decoder_per_mode(split_chat):
    assert split_chat.routed and split_chat.manifest.routing == "split"
    assert split_chat.variant_for(has_image=False, has_audio=False) == SPLIT_DECODERS["text"]
    assert split_chat.variant_for(has_image=True, has_audio=False) == SPLIT_DECODERS["vision"]
    assert split_chat.variant_for(has_image=True, has_audio=True) == SPLIT_DECODERS["vision"]
    assert split_chat.variant_for(has_image=False, has_audio=True) == SPLIT_DECODERS["speech"]


def test_package_without_manifest_is_read_from_its_files(tiny_split_package, tmp_path):
    legacy = _copy_package(tiny_split_package, tmp_path / "legacy", drop=(MANIFEST_FILE,))
    assert Chat(legacy).manifest.decoders == SPLIT_DECODERS
    single = _copy_package(tiny_split_package, tmp_path / "single",
                           drop=(MANIFEST_FILE, SPLIT_DECODERS["text"], SPLIT_DECODERS["speech"]))
    chat = Chat(single)
    assert not chat.routed and chat.manifest.original_max_position_embeddings is None
    for has_image in (False, True):
        for has_audio in (False, True):
            assert chat.variant_for(has_image, has_audio) == MAIN_DECODER


@pytest.mark.parametrize("layout", ["routed", "split"])
@pytest.mark.parametrize(("mode", "images", "audios"), [
    ("text", [], []), ("vision", [IMAGE], []), ("speech", [], [AUDIO]), ("vision", [IMAGE], [AUDIO]),
])
def test_generation_matches_reference(layout, chat, split_chat, reference, media_dir, mode, images, audios):
    """The generator's tokens are the reference's greedy tokens with the LoRA of the input mode — and not those of
    another LoRA, so a wrong variant (or a wrong route inside the self-routing decoder) would fail."""
    chat = {"routed": chat, "split": split_chat}[layout]
    images = [media_dir / name for name in images]
    audios = [media_dir / name for name in audios]
    prompt = build_prompt([Turn("Describe what you get.", tuple(map(open_image, images)),
                                tuple(map(open_audio, audios)))])
    generation = chat.generate(prompt, images, audios, max_new_tokens=5)

    assert generation.variant == (SPLIT_DECODERS[mode] if layout == "split" else MAIN_DECODER)
    assert generation.inputs[INPUT_IDS].shape[0] == 1
    assert ("pixel_values" in generation.inputs) == bool(images)
    assert ("audio_embeds" in generation.inputs) == bool(audios)
    expected = reference.prefill_and_greedy(generation.inputs, max_new_tokens=len(generation.tokens))
    assert expected.lora == reference.lora_for_mode(mode)
    compared = next((i + 1 for i, gap in enumerate(expected.top2_gap) if gap < NEAR_TIE), len(expected.tokens))
    assert generation.tokens[:compared] == expected.tokens[:compared]
    # Greedy choices of the other adapters on the same prefix (the prompt embeddings are reused).
    others = [[int(step.argmax()) for step in reference.decode_logits(expected.inputs_embeds, expected.tokens[:-1],
                                                                      lora)]
              for lora in ("none", "vision", "speech") if lora != expected.lora]
    assert any(tokens != generation.tokens for tokens in others)
    assert generation.stats.new_tokens == len(generation.tokens) == 5
    assert generation.stats.prompt_tokens == generation.inputs[INPUT_IDS].shape[1]


def test_multi_turn_conversation(conversation, media_dir):
    chat = conversation
    chat.system = "You are a tester."
    pieces = list(chat.ask("Hello!", max_new_tokens=3))
    first = chat.last_stats
    assert first.new_tokens == 3 and first.reused_tokens == 0 and first.prefill_tokens == first.prompt_tokens
    assert first.time_to_first_token_s > 0 and first.tokens_per_s > 0
    assert chat.turns == [Turn("Hello!", assistant="".join(pieces))]
    assert len(chat.token_ids) == first.prompt_tokens + first.new_tokens

    # New media: a new generator over the whole conversation (the history is part of the prompt).
    answer = "".join(chat.ask("What is in this picture?", images=[media_dir / IMAGE], max_new_tokens=4))
    second = chat.last_stats
    picture = open_image(media_dir / IMAGE)
    assert chat.turns[-1] == Turn("What is in this picture?", images=(picture,), assistant=answer)
    assert second.prompt_tokens > first.prompt_tokens + first.new_tokens and second.reused_tokens == 0

    # A text follow-up keeps the generator: only the question's own tokens are prefilled after the kept ids.
    kept = chat.token_ids
    list(chat.ask("Tell me more.", max_new_tokens=2))
    third = chat.last_stats
    assert third.reused_tokens == len(kept) - 1  # the last answer token is run with the question
    assert third.prefill_tokens == third.prompt_tokens - third.reused_tokens < 16
    assert chat.token_ids[:len(kept)] == kept
    assert build_prompt(chat.turns, chat.system).startswith("<|system|>You are a tester.<|end|><|user|>Hello!<|end|>")

    chat.clear()
    assert chat.token_ids == []
    list(chat.ask("Hello!", max_new_tokens=3))
    assert chat.last_stats.prompt_tokens == first.prompt_tokens and chat.last_stats.reused_tokens == 0


def test_restore_keeps_the_generator_only_for_the_same_conversation(conversation):
    chat = conversation
    list(chat.ask("Hello!", max_new_tokens=3))
    held = list(chat.turns)
    chat.restore(held)
    list(chat.ask("Again.", max_new_tokens=2))
    assert chat.last_stats.reused_tokens > 0
    chat.restore([Turn("Hello!", assistant="something else")])
    list(chat.ask("Again.", max_new_tokens=2))
    assert chat.last_stats.reused_tokens == 0
    with pytest.raises(ValueError, match="answered"):
        chat.restore([Turn("unanswered")])


def test_stopping_early_keeps_the_partial_answer(conversation):
    chat = conversation
    stream = chat.ask("Count to ten.", max_new_tokens=50)
    first_piece = next(stream)
    stream.close()
    assert chat.turns == [Turn("Count to ten.", assistant=first_piece)]
    assert chat.last_stats.new_tokens == 1
    kept = chat.token_ids
    list(chat.ask("Go on.", max_new_tokens=2))  # the stopped answer is closed with <|end|> and the cache kept
    assert chat.last_stats.reused_tokens == len(kept) - 1 and chat.token_ids[:len(kept)] == kept


def test_errors_with_a_package(package, conversation, media_dir, tmp_path):
    chat = conversation
    low_rate = make_wav(tmp_path / "low.wav", 1.0, sample_rate=6000)
    with pytest.raises(UnsupportedMediaError, match=r"cannot read audio .*low.wav: unsupported sample rate 6000 Hz"):
        chat.ask("Listen.", audios=[low_rate])
    fake = tmp_path / "fake.wav"
    shutil.copy(media_dir / IMAGE, fake)
    with pytest.raises(UnsupportedMediaError, match=r"cannot read audio .*fake.wav: not a readable audio clip"):
        chat.ask("Listen.", audios=[media_dir / AUDIO, fake])
    with pytest.raises(TagMismatchError):
        chat.ask("<|image_1|><|image_2|> compare", images=[media_dir / IMAGE])
    with pytest.raises(MediaNotFoundError):
        chat.ask("Look.", images=[tmp_path / "nothing.jpg"])
    assert chat.turns == []  # failed questions are not part of the conversation

    with pytest.raises(PromptTooLongError, match="the prompt is .* tokens but the maximum length is 16"):
        Chat(package, max_length=16).ask("Tell me about " + "this and that, " * 10)
    with pytest.raises(PackageError, match="max_length must be between 1 and the context length"):
        Chat(package, max_length=10**9)


def test_package_without_speech_refuses_audio(package, media_dir, tmp_path):
    folder = _copy_package(package, tmp_path / "no-speech", drop=(GENAI_CONFIG_FILE,))
    config = json.loads((package / GENAI_CONFIG_FILE).read_text())
    config["model"]["speech"] = {"config_filename": ""}
    (folder / GENAI_CONFIG_FILE).write_text(json.dumps(config))
    chat = Chat(folder)
    with pytest.raises(PackageError, match="no speech model"):
        chat.ask("Listen.", audios=[media_dir / AUDIO])
    text_answer = "".join(chat.ask("Hi", max_new_tokens=3))  # text still works, as in the full package
    full = Chat(package)
    assert text_answer == "".join(full.ask("Hi", max_new_tokens=3))


def test_missing_decoder_file(package, tmp_path):
    folder = _copy_package(package, tmp_path / "broken", drop=(MAIN_DECODER,))
    with pytest.raises(PackageError, match=f"decoder {MAIN_DECODER} is missing"):
        Chat(folder)


# ---- guidance and tools ---------------------------------------------------------------------------------------------

SHAPES = {"type": "object", "properties": {"kind": {"enum": ["circle", "square"]}, "count": {
    "type": "integer", "minimum": 0, "maximum": 99}, "filled": {"type": "boolean"}},
    "required": ["kind", "count", "filled"], "additionalProperties": False}


def test_guided_answers_and_the_question_after(package, conversation):
    import re

    import jsonschema

    chat = conversation
    text = "".join(chat.ask("Describe a shape.", max_new_tokens=60, guidance=Guidance.json_schema(SHAPES)))
    jsonschema.validate(json.loads(text), SHAPES)
    assert chat.last_stats.finish_reason == "stop"
    assert text == json.dumps(json.loads(text))  # the layout is fixed: no blanks left to the model
    code = "".join(chat.ask("A code?", max_new_tokens=20, guidance=Guidance.regex(r"[A-Z]{2}-[0-9]{3}")))
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", code)
    grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/'
    answer = "".join(chat.ask("Well?", max_new_tokens=20, guidance=Guidance.lark(grammar)))
    assert re.fullmatch(r"yes|no|maybe [0-9]{1,3}", answer)
    cut = "".join(chat.ask("Describe a shape.", max_new_tokens=2, guidance=Guidance.json_schema(SHAPES)))
    assert chat.last_stats.finish_reason == "length" and chat.last_stats.new_tokens == 2 and cut
    # The question after guided answers is free, and answered as in a Chat that was handed the same conversation.
    free = "".join(chat.ask("Now freely.", max_new_tokens=6))
    other = Chat(package)
    other.restore(chat.turns[:-1])
    assert "".join(other.ask("Now freely.", max_new_tokens=6)) == free
    # A schema the compiler refuses fails in ask, and the conversation is unchanged.
    turns = list(chat.turns)
    with pytest.raises(GuidanceError, match="Invalid type: objectx"):
        chat.ask("Again.", guidance=Guidance.json_schema({"type": "objectx"}))
    with pytest.raises(GuidanceError, match="lark"):
        chat.ask("Again.", guidance=Guidance.lark("start: undefined_rule"))
    assert chat.turns == turns


def test_tools_are_rendered_by_the_package_template(package, conversation_with_tools):
    """A call -> result -> answer conversation is the prompt the checkpoint's own chat template makes of it
    (transformers renders the template from the package's tokenizer files)."""
    from transformers import PreTrainedTokenizerFast

    chat = conversation_with_tools
    chat.system = "You may call tools."
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
                  "additionalProperties": False}
    chat.tools = json.dumps([{"name": "get_weather", "description": "The weather", "parameters": parameters}])
    call = "".join(chat.ask("Weather in Paris?", max_new_tokens=60,
                            guidance=chat.tool_guidance([("get_weather", parameters)], single=True)))
    assert call.startswith("<|tool_call|>[{") and call.endswith("}]<|/tool_call|>")
    assert json.loads(call[len("<|tool_call|>"):-len("<|/tool_call|>")])[0]["name"] == "get_weather"
    answer = "".join(chat.ask(tool_results(['{"temperature": 21}', '{"sky": "clear"}']), max_new_tokens=4,
                              role=TOOL))
    hf = PreTrainedTokenizerFast.from_pretrained(package)
    messages = [{"role": "system", "content": chat.system, "tools": chat.tools},
                {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": call},
                {"role": "tool", "content": '{"temperature": 21}'}, {"role": "tool", "content": '{"sky": "clear"}'}]
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert hf.decode(chat.token_ids) == prompt + answer
    header = chat.package.load(chat.next_variant()).tool_header(chat.system, chat.tools)
    assert build_prompt(chat.turns, chat.system, header) == prompt + answer + "<|end|>"  # the turns rebuild the prompt
