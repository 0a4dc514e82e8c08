"""A synthetic byte-level BPE tokenizer with the Phi-4-multimodal vocabulary size and special-token ids.

The real tokenizer cannot be downloaded here. This one has the same shape where it matters: exactly 200064 ids,
``<|endoftext|>`` = 199999, ``<|endoftextN|>`` = 200000 + N (200010 image, 200011 audio placeholder), the chat role
tokens at their real ids, a GPT-2 style byte-level BPE so that any text round-trips, and a few hundred merges learned
from a small built-in English text so common words become few tokens. Ids between the merges and 199999 are filler
entries (a space plus three letters or digits) that no text ever produces but that decode to readable text, so a
random model's output can be printed.
"""

from __future__ import annotations

import itertools
import json
import string
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

from builder_plugin.runtime.tokens import BYTE_TO_CHAR

VOCAB_SIZE = 200064
ENDOFTEXT_ID = 199999
NUM_ENDOFTEXT_VARIANTS = 19  # <|endoftext0|> .. <|endoftext18|> at 200000 .. 200018
ROLE_TOKENS = {"<|assistant|>": 200019, "<|end|>": 200020, "<|user|>": 200021, "<|system|>": 200022}
# The original's tool tokens at their ids, with its `special` flags: the call markers are plain added tokens, so they
# stay in decoded text where a runtime can find the calls.
TOOL_TOKENS = {"<|tool|>": (200023, True), "<|/tool|>": (200024, True), "<|tool_call|>": (200025, False),
               "<|/tool_call|>": (200026, False), "<|tool_response|>": (200027, False), "<|tag|>": (200028, True)}
FIRST_DUMMY_ID = 200029
IMAGE_TOKEN = "<|endoftext10|>"
AUDIO_TOKEN = "<|endoftext11|>"
ENDOFTEXT = "<|endoftext|>"
MAX_MERGES = 2000

# The original's chat template: <|system|>...<|tool|>[tools]<|/tool|><|end|><|user|>...<|end|><|assistant|>
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

# Text the merges are learned from; it covers the words the tests and samples prompt with.
_MERGE_CORPUS = """
hello world. Hello World! Describe the image in detail. What is shown in this picture? Transcribe the audio clip.
What do you hear in the audio? Summarize the speech and describe the image. Please answer the question.
You are a helpful assistant. The user asks a question and the assistant gives a short answer.
There is a red circle, a blue square and a green triangle on a white background with some noise.
The sound is a tone that rises and falls, with a little noise. It lasts two seconds.
Tell me a story about a cat and a dog who live in a small house near the river. Once upon a time there was a
little girl who loved to read books. She would sit under the tree in the garden and read for hours every day.
What is the capital of France? The capital of France is Paris. How many people live in the city?
Translate the following sentence into French. Write a poem about the sea. Explain how the model works.
This is a test of the tokenizer with numbers 0 1 2 3 4 5 6 7 8 9 10 100 2024 and punctuation: , . ; : ! ? ( ) [ ]
the of and to in is that for it as with was on be by this are or from at an which have not has but were all
can will one there their more also other what when who how where why would could should about into than then
them these some time only new first after use two over like just any most very good well because through
image audio speech video text picture photo sound music voice question answer model user system assistant
"""


def special_tokens() -> dict[str, int]:
    """Every added token with its id, from 199999 to the end of the vocabulary."""
    tokens = {ENDOFTEXT: ENDOFTEXT_ID}
    for n in range(NUM_ENDOFTEXT_VARIANTS):
        tokens[f"<|endoftext{n}|>"] = ENDOFTEXT_ID + 1 + n
    tokens.update(ROLE_TOKENS)
    tokens.update({content: token_id for content, (token_id, _) in TOOL_TOKENS.items()})
    for token_id in range(FIRST_DUMMY_ID, VOCAB_SIZE):
        tokens[f"<|dummy_{token_id - FIRST_DUMMY_ID}|>"] = token_id
    if len(set(tokens.values())) != len(tokens) or sorted(tokens.values()) != list(range(ENDOFTEXT_ID, VOCAB_SIZE)):
        raise AssertionError("special-token ids overlap or leave a gap")
    return tokens


def is_special(content: str) -> bool:
    return TOOL_TOKENS[content][1] if content in TOOL_TOKENS else True


def _pretokenize(text: str) -> list[str]:
    from tokenizers import pre_tokenizers

    splitter = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return [piece for piece, _ in splitter.pre_tokenize_str(text)]


def _learn_merges(text: str, max_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training; ties are broken by the pair itself so the result never depends on dict order."""
    word_counts = Counter(_pretokenize(text))
    words = [(list(word), count) for word, count in sorted(word_counts.items())]
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pair_counts: Counter[tuple[str, str]] = Counter()
        for symbols, count in words:
            for pair in itertools.pairwise(symbols):
                pair_counts[pair] += count
        if not pair_counts:
            break
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        merges.append(best)
        joined = best[0] + best[1]
        for symbols, _ in words:
            i = 0
            while i < len(symbols) - 1:
                if symbols[i] == best[0] and symbols[i + 1] == best[1]:
                    symbols[i : i + 2] = [joined]
                i += 1
    return merges


def _filler_tokens(taken: set[str], count: int) -> list[str]:
    """`count` distinct ' xyz'-style entries (byte-level space + three letters/digits) not already in the vocab."""
    space = BYTE_TO_CHAR[ord(" ")]
    alphabet = string.ascii_lowercase + string.digits + string.ascii_uppercase
    fillers = []
    for chars in itertools.product(alphabet, repeat=3):
        token = space + "".join(chars)
        if token not in taken:
            fillers.append(token)
            if len(fillers) == count:
                return fillers
    raise AssertionError("ran out of filler tokens")


@lru_cache(maxsize=1)
def _tokenizer_json_text() -> str:
    vocab: dict[str, int] = {}
    for b in range(256):
        vocab[BYTE_TO_CHAR[b]] = b
    merges = _learn_merges(_MERGE_CORPUS, MAX_MERGES)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for token in _filler_tokens(set(vocab), ENDOFTEXT_ID - len(vocab)):
        vocab[token] = len(vocab)
    if len(vocab) != ENDOFTEXT_ID or sorted(vocab.values()) != list(range(ENDOFTEXT_ID)):
        raise AssertionError("base vocabulary does not fill ids 0..199998 exactly")

    added = [
        {
            "id": token_id,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": is_special(content),
        }
        for content, token_id in special_tokens().items()
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{left} {right}" for left, right in merges],
        },
    }
    return json.dumps(tokenizer, ensure_ascii=False, indent=None)


def tokenizer_config(model_max_length: int, extra_special_tokens: dict[str, str] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": is_special(content),
            }
            for content, token_id in special_tokens().items()
        },
        "bos_token": ENDOFTEXT,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": ENDOFTEXT,
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": ENDOFTEXT,
    }
    if extra_special_tokens:
        config["extra_special_tokens"] = dict(extra_special_tokens)
    return config


def write_tokenizer(
    out_dir: str | Path, model_max_length: int, extra_special_tokens: dict[str, str] | None = None
) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and added_tokens.json into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    special = {"content": ENDOFTEXT, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    files = {
        "tokenizer.json": _tokenizer_json_text(),
        "tokenizer_config.json": _dumps(tokenizer_config(model_max_length, extra_special_tokens)),
        "special_tokens_map.json": _dumps(dict.fromkeys(("bos_token", "eos_token", "pad_token", "unk_token"), special)),
        "added_tokens.json": _dumps(dict(special_tokens())),
    }
    written = []
    for name, text in files.items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def _dumps(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
