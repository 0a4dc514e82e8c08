"""Sampling with the OpenAI API's meaning: greedy by default and at temperature 0; a temperature, top_p or top_k samples
from the whole vocabulary unless top_k / top_p narrow it (the package's search options, do_sample false and top_k 50,
are never used); a seed gives one answer, whether the conversation's decoding was kept or not.

Each answer is checked against the logits it was sampled from (Chat.keep_logits): the rank of every chosen token."""

from __future__ import annotations

import json

import numpy as np
import pytest

from builder_plugin.layout import GENAI_CONFIG_FILE
from builder_plugin.runtime import Chat, Sampling

QUESTION = "Tell me a story about a lighthouse."
TOKENS = 12


@pytest.fixture(scope="module")
def chat(tiny_package) -> Chat:
    chat = Chat(tiny_package)
    chat.keep_logits = True
    return chat


def _answer(chat: Chat, sampling: Sampling | None, question: str = QUESTION) -> tuple[list[int], list[np.ndarray]]:
    """The ids of a fresh conversation's answer and the logits each was chosen from."""
    chat.clear()
    list(chat.ask(question, max_new_tokens=TOKENS, sampling=sampling))
    return list(chat.turns[-1].answer_ids), list(chat.last_logits)


def _ranks(ids: list[int], logits: list[np.ndarray]) -> list[int]:
    """Each chosen id's rank among its step's logits (0: the most likely)."""
    return [int((row > row[token]).sum()) for token, row in zip(ids, logits)]


def test_the_package_default_is_greedy_and_does_not_limit_sampling(tiny_package, chat):
    search = json.loads((tiny_package / GENAI_CONFIG_FILE).read_text())["search"]
    assert search["do_sample"] is False and search["top_k"] != 1  # an app's do_sample alone is not greedy
    ids, logits = _answer(chat, None)
    assert _ranks(ids, logits) == [0] * len(ids)


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=0.0, top_p=0.5, seed=3),
                                      Sampling(temperature=1.5, top_k=1, seed=3), Sampling(seed=3)])
def test_greedy_settings(chat, sampling):
    """Temperature 0 is greedy whatever else is set (OpenAI), top_k 1 is, and a seed alone asks for no sampling."""
    ids, logits = _answer(chat, sampling)
    assert _ranks(ids, logits) == [0] * len(ids)
    assert ids == _answer(chat, None)[0]


def test_temperature_samples_the_whole_vocabulary(chat):
    """No top-k limit unless asked: the tiny random model's logits are flat, so unlimited samples land far down the
    ranking, while top_k=k keeps every token within the k most likely."""
    ids, logits = _answer(chat, Sampling(temperature=1.0, seed=1))
    assert max(_ranks(ids, logits)) > 50  # past the package's top_k
    for k in (3, 20):
        ids, logits = _answer(chat, Sampling(temperature=1.0, top_k=k, seed=1))
        ranks = _ranks(ids, logits)
        assert max(ranks) < k and len(set(ranks)) > 1


@pytest.mark.parametrize("temperature, p, top_k", [(1.0, 0.3, None), (0.5, 0.5, None), (1.0, 0.6, 400)])
def test_top_p_keeps_the_nucleus(chat, temperature, p, top_k):
    """top_p: every token is within the smallest set of most likely tokens (of the top_k, when set) whose probability
    at the sampling temperature reaches p."""
    ids, logits = _answer(chat, Sampling(temperature=temperature, top_p=p, top_k=top_k, seed=2))
    assert len(set(_ranks(ids, logits))) > 1
    for token, row in zip(ids, logits):
        if top_k is not None:
            row = np.where(row >= np.sort(row)[-top_k], row, -np.inf)
        probs = np.exp((row - row.max()) / temperature)
        probs /= probs.sum()
        order = np.argsort(-probs)
        nucleus = order[:int(np.searchsorted(np.cumsum(probs[order]), p)) + 1]
        assert token in nucleus


def test_seeds(chat):
    """The same seed gives the same answer, other seeds other answers; without a seed each answer draws anew."""
    seeded = [_answer(chat, Sampling(temperature=0.8, seed=seed))[0] for seed in (11, 12, 13, 11)]
    assert seeded[0] == seeded[3]
    assert len({tuple(ids) for ids in seeded[:3]}) == 3
    greedy = _answer(chat, None)[0]
    assert all(ids != greedy for ids in seeded)
    unseeded = [tuple(_answer(chat, Sampling(temperature=0.8))[0]) for _ in range(3)]
    assert len(set(unseeded)) == 3


def test_a_seed_gives_one_answer_whether_the_decoding_was_kept_or_not(tiny_package, chat):
    """A follow-up sampled with a seed gets a decoding of its own over the kept ids (a generator's random stream is
    seeded when it is made), so it is the answer a conversation restored from the same turns gets, and the same when
    asked again after other sampled answers."""
    sampling = Sampling(temperature=0.9, top_p=0.95, seed=5)
    chat.clear()
    list(chat.ask(QUESTION, max_new_tokens=6, sampling=sampling))
    turns = list(chat.turns)
    kept = "".join(chat.ask("And then?", max_new_tokens=8, sampling=sampling))
    assert chat.last_stats.reused_tokens == 0
    fresh = Chat(tiny_package)
    fresh.restore(turns)
    assert "".join(fresh.ask("And then?", max_new_tokens=8, sampling=sampling)) == kept
    assert fresh.token_ids == chat.token_ids
    chat.restore(turns)  # the same question again, on the decoding that has drawn for it already
    assert "".join(chat.ask("And then?", max_new_tokens=8, sampling=sampling)) == kept
    unseeded = Sampling(temperature=0.9)
    list(chat.ask("More.", max_new_tokens=3, sampling=unseeded))
    list(chat.ask("Go on.", max_new_tokens=3, sampling=unseeded))  # unseeded, the same options: the kept decoding
    assert chat.last_stats.reused_tokens > 0


def test_search_options():
    vocab = 1000
    assert Sampling().search_options(vocab) == {"do_sample": False}
    assert Sampling(temperature=0, top_k=5).search_options(vocab) == {"do_sample": False}
    assert Sampling(temperature=0.5).search_options(vocab) == {"do_sample": True, "temperature": 0.5, "top_p": 1.0,
                                                               "top_k": 0, "random_seed": -1}  # -1: draw a seed
    # a nucleus over the whole vocabulary (onnxruntime-genai 0.18 applies top_p only after a top_k)
    assert Sampling(top_p=0.5, seed=-1).search_options(vocab) == {"do_sample": True, "temperature": 1.0,
                                                                  "top_p": 0.5, "top_k": vocab,
                                                                  "random_seed": (1 << 31) - 1}
    assert Sampling(top_k=5000, top_p=0.5).search_options(vocab)["top_k"] == vocab
