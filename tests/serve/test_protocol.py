"""builder_plugin.serve.protocol: requests parsed once, messages into turns."""

from __future__ import annotations

from builder_plugin.media import MediaDecoder
from builder_plugin.serve.app import MB
from builder_plugin.serve.media import MediaCache, MediaReader
from builder_plugin.serve.protocol import parse_messages
from tests.support.serving import (
    AUDIO,
    IMAGE,
    audio_part,
    image_part,
)


def test_messages_become_turns(media_dir):
    media = MediaReader(MediaCache(MediaDecoder(), MB))
    png = image_part(media_dir / IMAGE)
    conversation = parse_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, png, {"type": "text", "text": "and"},
                                     png]},
        {"role": "assistant", "content": [{"type": "text", "text": "Same."}]},
        {"role": "user", "content": "Why?"},
        {"role": "user", "content": [{"type": "text", "text": "Where is <|audio_1|>?"}, audio_part(media_dir / AUDIO)]},
    ], media)
    media.cache.close()
    assert conversation.system == "Be brief."
    first, = conversation.history
    assert (first.user, first.assistant) == ("Compare<|image_1|>and<|image_2|>", "Same.")
    assert first.images[0] == first.images[1]  # the same bytes: the same image
    assert [m.source for m in first.images] == ["messages[1].content[1].image_url", "messages[1].content[3].image_url"]
    assert conversation.question.user == "Why?\nWhere is <|audio_1|>?"
    assert conversation.question.audios[0].info["format"] == "WAV"
