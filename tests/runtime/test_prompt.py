"""builder_plugin.runtime.prompt: the chat format, media tags and their numbering."""

from __future__ import annotations

import pytest

from builder_plugin.media import Media
from builder_plugin.runtime import TagMismatchError, Turn, build_prompt, check_tags
from builder_plugin.runtime.prompt import tagged


def image(name: str) -> Media:
    return Media("image", name.encode(), f"{name}.png")  # the prompt reads only how many there are


def clip(name: str) -> Media:
    return Media("audio", name.encode(), f"{name}.wav")


def test_single_turn_prompt():
    assert build_prompt(["What is 2+2?"]) == "<|user|>What is 2+2?<|end|><|assistant|>"
    assert build_prompt([Turn("Hi")], system="Be brief.") == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"


def test_media_tags_go_first_and_count_across_turns():
    turns = [
        Turn("Compare them.", images=(image("a"), image("b")), assistant="They differ."),
        Turn("And this?", images=(image("c"),), audios=(clip("q"),)),
    ]
    assert build_prompt(turns) == (
        "<|user|><|image_1|><|image_2|>Compare them.<|end|><|assistant|>They differ.<|end|>"
        "<|user|><|image_3|><|audio_1|>And this?<|end|><|assistant|>"
    )


def test_written_tags_are_kept_in_place_and_renumbered():
    turns = [
        Turn("first", images=(image("a"),), assistant="ok"),
        Turn("Between <|image_1|> and <|image_2|>, which one matches <|audio_1|>?",
             images=(image("b"), image("c")), audios=(clip("q"),)),
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
        build_prompt([Turn(text, images=(image("x"),) * images, audios=(clip("x"),) * audios)])


def test_matching_tags_pass():
    check_tags("<|image_1|><|image_2|> and <|audio_1|>", 2, 1)
    check_tags("no tags at all", 3, 2)


def test_parts_are_tagged_where_the_media_stand_unless_the_text_writes_tags():
    assert tagged(["Compare", image("a"), "and", image("b")]) == "Compare<|image_1|>and<|image_2|>"
    assert tagged(["Why?", "Where is <|audio_1|>?", clip("q"), image("a")]) == "Why?\nWhere is <|audio_1|>?<|image_1|>"
    assert tagged([image("a"), clip("q"), "Both?"]) == "<|image_1|><|audio_1|>Both?"
    with pytest.raises(TagMismatchError, match="2 image tags"):
        Turn(tagged(["<|image_1|> or <|image_2|>?", image("a")]), images=(image("a"),))
