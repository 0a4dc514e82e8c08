"""builder_plugin.runtime: prompts, media checks, decoder variants, and generation on a built tiny package compared
with the PyTorch reference (transformers' native model with the LoRA of the input mode)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from builder_plugin import runtime
from builder_plugin.runtime import (
    Chat,
    MediaNotFoundError,
    PackageError,
    PromptTooLongError,
    TagMismatchError,
    Turn,
    UnsupportedMediaError,
    build_prompt,
    check_audio,
    check_image,
    check_tags,
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


@pytest.fixture
def conversation(chat) -> Chat:
    """The module's Chat (its models stay loaded) with an empty conversation."""
    chat.clear()
    chat.system = None
    yield chat
    chat.clear()
    chat.system = None


def _copy_package(package: Path, folder: Path, drop: tuple[str, ...] = ()) -> Path:
    """A package folder of links to `package`'s files, without `drop`."""
    folder.mkdir()
    for path in package.iterdir():
        if path.name not in drop:
            (folder / path.name).symlink_to(path)
    return folder


# ---- prompts (no package needed) ------------------------------------------------------------------------------------


def test_single_turn_prompt():
    assert build_prompt(["What is 2+2?"]) == "<|user|>What is 2+2?<|end|><|assistant|>"
    assert build_prompt([Turn("Hi")], system="Be brief.") == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"


def test_media_tags_go_first_and_count_across_turns():
    turns = [
        Turn("Compare them.", images=(Path("a.png"), Path("b.png")), assistant="They differ."),
        Turn("And this?", images=(Path("c.png"),), audios=(Path("q.wav"),)),
    ]
    assert build_prompt(turns) == (
        "<|user|><|image_1|><|image_2|>Compare them.<|end|><|assistant|>They differ.<|end|>"
        "<|user|><|image_3|><|audio_1|>And this?<|end|><|assistant|>"
    )


def test_written_tags_are_kept_in_place_and_renumbered():
    turns = [
        Turn("first", images=(Path("a.png"),), assistant="ok"),
        Turn("Between <|image_1|> and <|image_2|>, which one matches <|audio_1|>?",
             images=(Path("b.png"), Path("c.png")), audios=(Path("q.wav"),)),
    ]
    assert build_prompt(turns).endswith(
        "<|user|>Between <|image_2|> and <|image_3|>, which one matches <|audio_1|>?<|end|><|assistant|>"
    )


def test_only_the_last_turn_may_be_unanswered():
    with pytest.raises(ValueError):
        build_prompt([Turn("a"), Turn("b")])


@pytest.mark.parametrize(
    ("text", "images", "audios", "message"),
    [
        ("<|image_1|> what?", 0, 0, "1 image tag (<|image_1|>) but no image is attached"),
        ("<|image_1|> what?", 2, 0, "1 image tag (<|image_1|>) but 2 images are attached"),
        ("<|audio_1|><|audio_2|> what?", 0, 1, "2 audio tags (<|audio_1|> <|audio_2|>) but 1 audio clip is attached"),
        ("<|image_2|> what?", 1, 0, "image tags must be <|image_1|> in this order"),
        ("<|image_2|><|image_1|> what?", 2, 0, "image tags must be <|image_1|> <|image_2|> in this order"),
        ("<|endoftext10|> what?", 1, 0, "not as <|endoftext10|>"),
    ],
)
def test_mismatched_tags(text, images, audios, message):
    with pytest.raises(TagMismatchError, match=message.replace("|", r"\|").replace("(", r"\(").replace(")", r"\)")):
        check_tags(text, images, audios)
    with pytest.raises(TagMismatchError):
        build_prompt([Turn(text, images=(Path("x.png"),) * images, audios=(Path("x.wav"),) * audios)])


def test_matching_tags_pass():
    check_tags("<|image_1|><|image_2|> and <|audio_1|>", 2, 1)
    check_tags("no tags at all", 3, 2)


# ---- media checks ---------------------------------------------------------------------------------------------------


def test_media_checks(media_dir, tmp_path):
    assert check_image(media_dir / IMAGE) == media_dir / IMAGE
    assert check_image(media_dir / "wide.jpg") == media_dir / "wide.jpg"
    assert check_audio(media_dir / AUDIO) == media_dir / AUDIO

    with pytest.raises(MediaNotFoundError, match="image file not found: .*missing.png"):
        check_image(tmp_path / "missing.png")
    with pytest.raises(MediaNotFoundError, match="audio path is not a file"):
        check_audio(tmp_path)
    bmp = tmp_path / "picture.bmp"
    bmp.write_bytes(b"BM" + bytes(100))
    with pytest.raises(UnsupportedMediaError, match=r"unsupported image format '.bmp'"):
        check_image(bmp)
    # A wav renamed .png would end the process inside the runtime's JPEG fallback: it must be caught first.
    disguised = tmp_path / "sound.png"
    shutil.copy(media_dir / AUDIO, disguised)
    with pytest.raises(UnsupportedMediaError, match="not a PNG or JPEG image"):
        check_image(disguised)
    with pytest.raises(UnsupportedMediaError, match=r"unsupported audio format '.png'"):
        check_audio(media_dir / IMAGE)


def test_not_a_package(tmp_path):
    with pytest.raises(PackageError, match="package folder not found"):
        Chat(tmp_path / "nowhere")
    with pytest.raises(PackageError, match="no genai_config.json"):
        Chat(tmp_path)


def test_variant_names_match_the_decoder_builder():
    from builder_plugin.components.decoder import ROUTED_FILENAMES

    lora_for_mode = {"text": "none", "vision": "vision", "speech": "speech"}
    assert {mode: ROUTED_FILENAMES[lora] for mode, lora in lora_for_mode.items()} == runtime.VARIANT_FILES


# ---- with the built package -----------------------------------------------------------------------------------------


def test_variant_for(chat):
    assert chat.routed
    assert chat.variant_for(has_image=False, has_audio=False) == "phi-4-mm-text-base.onnx"
    assert chat.variant_for(has_image=True, has_audio=False) == "phi-4-mm-text.onnx"
    assert chat.variant_for(has_image=True, has_audio=True) == "phi-4-mm-text.onnx"
    assert chat.variant_for(has_image=False, has_audio=True) == "phi-4-mm-text-speech.onnx"


def test_single_decoder_package_always_uses_it(package, tmp_path):
    single = _copy_package(package, tmp_path / "single", drop=("phi-4-mm-text-base.onnx", "phi-4-mm-text-speech.onnx"))
    chat = Chat(single)
    assert not chat.routed
    for has_image in (False, True):
        for has_audio in (False, True):
            assert chat.variant_for(has_image, has_audio) == "phi-4-mm-text.onnx"


@pytest.mark.parametrize(("mode", "images", "audios"), [
    ("text", [], []), ("vision", [IMAGE], []), ("speech", [], [AUDIO]), ("vision", [IMAGE], [AUDIO]),
])
def test_generation_matches_reference(chat, reference, media_dir, mode, images, audios):
    """The generator's tokens are the reference's greedy tokens with the LoRA of the input mode — and not those of
    another LoRA, so a wrong variant would fail."""
    images = [media_dir / name for name in images]
    audios = [media_dir / name for name in audios]
    prompt = build_prompt([Turn("Describe what you get.", tuple(images), tuple(audios))])
    generation = chat.generate(prompt, images, audios, max_new_tokens=5)

    assert generation.variant == runtime.VARIANT_FILES[mode]
    assert generation.inputs["input_ids"].shape[0] == 1
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
    assert generation.stats.prompt_tokens == generation.inputs["input_ids"].shape[1]


def test_multi_turn_conversation(conversation, media_dir):
    chat = conversation
    chat.system = "You are a tester."
    pieces = list(chat.ask("Hello!", max_new_tokens=3))
    first = chat.last_stats
    assert first.variant == "phi-4-mm-text-base.onnx" and first.new_tokens == 3
    assert first.time_to_first_token_s > 0 and first.tokens_per_s > 0
    assert chat.turns == [Turn("Hello!", assistant="".join(pieces))]

    answer = "".join(chat.ask("What is in this picture?", images=[media_dir / IMAGE], max_new_tokens=4))
    second = chat.last_stats
    assert second.variant == "phi-4-mm-text.onnx"
    assert chat.turns[-1] == Turn("What is in this picture?", images=(media_dir / IMAGE,), assistant=answer)
    # The history (first turn and its answer) is part of the second prompt.
    assert second.prompt_tokens > first.prompt_tokens + first.new_tokens

    # A text follow-up keeps the image in the conversation, so the vision decoder answers again, on a longer prompt.
    list(chat.ask("Tell me more.", max_new_tokens=2))
    assert chat.last_stats.variant == "phi-4-mm-text.onnx"
    assert chat.last_stats.prompt_tokens > second.prompt_tokens + second.new_tokens
    assert build_prompt(chat.turns, chat.system).startswith("<|system|>You are a tester.<|end|><|user|>Hello!<|end|>")

    chat.clear()
    list(chat.ask("Hello!", max_new_tokens=3))
    assert chat.last_stats.variant == "phi-4-mm-text-base.onnx"
    assert chat.last_stats.prompt_tokens == first.prompt_tokens


def test_stopping_early_keeps_the_partial_answer(conversation):
    chat = conversation
    stream = chat.ask("Count to ten.", max_new_tokens=50)
    first_piece = next(stream)
    stream.close()
    assert chat.turns == [Turn("Count to ten.", assistant=first_piece)]
    assert chat.last_stats.new_tokens == 1


def test_errors_with_a_package(package, conversation, media_dir, tmp_path):
    chat = conversation
    low_rate = make_wav(tmp_path / "low.wav", 1.0, sample_rate=6000)
    with pytest.raises(UnsupportedMediaError, match=r"cannot read audio .*low.wav: sample rates below 8000 Hz"):
        chat.ask("Listen.", audios=[low_rate])
    fake = tmp_path / "fake.wav"
    shutil.copy(media_dir / IMAGE, fake)
    with pytest.raises(UnsupportedMediaError, match=r"cannot read audio .*fake.wav: not a WAV, MP3 or FLAC file"):
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
    folder = _copy_package(package, tmp_path / "no-speech", drop=("genai_config.json",))
    config = json.loads((package / "genai_config.json").read_text())
    config["model"]["speech"] = {"config_filename": ""}
    (folder / "genai_config.json").write_text(json.dumps(config))
    chat = Chat(folder)
    with pytest.raises(PackageError, match="no speech model"):
        chat.ask("Listen.", audios=[media_dir / AUDIO])
    assert list(chat.ask("Hi", max_new_tokens=1))  # text still works


def test_missing_decoder_file(package, tmp_path):
    folder = _copy_package(package, tmp_path / "broken", drop=("phi-4-mm-text.onnx",))
    with pytest.raises(PackageError, match="decoder phi-4-mm-text.onnx is missing"):
        Chat(folder)
