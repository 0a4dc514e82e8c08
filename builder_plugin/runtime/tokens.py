"""Log-probabilities of generated tokens, with each token's text and bytes read from the package's tokenizer.json.

The log-probabilities are the log-softmax of the logits the generator chose the token from (the runtime's
``logits`` output at the last position). With guidance on, the runtime has already masked the tokens the grammar
forbids, so they are the constrained distribution; a masked token reports ``MIN_LOGPROB``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from builder_plugin.layout import TOKENIZER_FILE

MAX_TOP_LOGPROBS = 20
MIN_LOGPROB = -9999.0  # what the OpenAI API reports for a token it considers impossible (and JSON has no -inf)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the 'byte-level alphabet')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


@dataclass(frozen=True)
class Alternative:
    token_id: int
    token: str  # its text (bytes that are not whole UTF-8 characters show as U+FFFD)
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its own log-probability and the `top` most likely tokens of the same step."""

    chosen: Alternative
    top: tuple[Alternative, ...]


class TokenBytes:
    """The bytes of every token id of a package's tokenizer (byte-level BPE, as the Phi-4 tokenizer is)."""

    def __init__(self, package_dir: str | Path) -> None:
        self.path = Path(package_dir) / TOKENIZER_FILE

    @cached_property
    def _table(self) -> dict[int, bytes]:
        data = json.loads(self.path.read_text(encoding="utf-8"))
        table = {}
        for piece, token_id in data["model"]["vocab"].items():
            table[int(token_id)] = bytes(CHAR_TO_BYTE[c] for c in piece) if all(c in CHAR_TO_BYTE for c in piece) \
                else piece.encode("utf-8")
        for added in data.get("added_tokens", []):
            table[int(added["id"])] = added["content"].encode("utf-8")
        return table

    def of(self, token_id: int) -> bytes:
        return self._table.get(int(token_id), b"")

    def alternative(self, token_id: int, logprob: float) -> Alternative:
        raw = self.of(token_id)
        return Alternative(int(token_id), raw.decode("utf-8", errors="replace"), raw, logprob)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    values = np.asarray(logits, dtype=np.float64).reshape(-1)
    finite = np.where(np.isfinite(values), values, -np.inf)
    shifted = finite - finite.max()
    return shifted - np.log(np.exp(shifted).sum())


def token_logprob(logits: np.ndarray, token_id: int, top: int, table: TokenBytes) -> TokenLogprob:
    """The log-probability of `token_id` under `logits` ([vocab]) and the `top` most likely tokens."""
    logprobs = log_softmax(logits)

    def value(i: int) -> float:
        v = float(logprobs[i])
        return v if v > MIN_LOGPROB else MIN_LOGPROB

    best: list[int] = []
    if top > 0:
        part = np.argpartition(-logprobs, top - 1)[:top]
        best = sorted((int(i) for i in part), key=lambda i: (-logprobs[i], i))
    return TokenLogprob(table.alternative(token_id, value(token_id)),
                        tuple(table.alternative(i, value(i)) for i in best))
