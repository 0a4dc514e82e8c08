"""The files of a checkpoint folder besides config.json: the weights, their index, the tokenizer; named once here.

Both the hub (which lists the weights a build must download) and the reader (which opens them) take the index from
`weight_map`, so the two never disagree on which shards a checkpoint has.
"""

from __future__ import annotations

import json
from pathlib import Path

from builder_plugin.config import read_json
from builder_plugin.errors import CheckpointError, InputError
from builder_plugin.layout import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"  # a checkpoint small enough for one file has no index
ADAPTER_CONFIG_FILE = "adapter_config.json"  # the transformers-native layout: one folder per adapter
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def weight_map(folder: Path) -> dict[str, str] | None:
    """Tensor name -> shard file, from the folder's weight index; None when it has none (one weights file)."""
    path = Path(folder) / INDEX_FILE
    if not path.is_file():
        return None
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            raise ValueError("weight_map is not an object of file names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read the weight index {path}: {exc}") from exc
    return mapping


def check_tokenizer(folder: Path) -> None:
    """The checkpoint's tokenizer loads (and its tokenizer config, when present, is JSON): InputError otherwise."""
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        raise InputError(f"tokenizer not found: {path}")
    try:
        from tokenizers import Tokenizer

        Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own exception types
        raise InputError(f"cannot read tokenizer {path}: {str(exc).splitlines()[0] if str(exc) else exc}") from exc
    if (Path(folder) / TOKENIZER_CONFIG_FILE).is_file():
        read_json(Path(folder) / TOKENIZER_CONFIG_FILE, what="tokenizer config")
