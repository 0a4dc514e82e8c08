"""Resolving -m/-i to a local checkpoint folder, downloading from the Hugging Face hub only the files a build needs."""

from __future__ import annotations

import json
from pathlib import Path

from builder_plugin.config import NATIVE_ADAPTER_DIRS, NATIVE_MODEL_TYPE
from builder_plugin.errors import InputError

METADATA_PATTERNS = [
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "model.safetensors.index.json",
]
WEIGHT_PATTERNS = ["model.safetensors", "model-*.safetensors"]


def resolve_model_dir(model_name: str | None, input_dir: str | None, cache_dir: Path) -> Path:
    """The local folder to build from: -i wins over -m; -m may also name a local folder."""
    if input_dir:
        path = Path(input_dir).expanduser()
        if not path.is_dir():
            raise InputError(f"input folder not found: {path}")
        return path
    if not model_name:
        raise InputError("give a model: -m <hugging face id> or -i <local folder>")
    local = Path(model_name).expanduser()
    if local.is_dir():
        return local
    return download(model_name, cache_dir)


def download(repo_id: str, cache_dir: Path) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError as exc:  # pragma: no cover - huggingface_hub is a dependency
        raise InputError("downloading needs huggingface_hub (pip install huggingface_hub)") from exc
    try:
        folder = Path(snapshot_download(repo_id, cache_dir=str(cache_dir), allow_patterns=["config.json"]))
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
        patterns = METADATA_PATTERNS + WEIGHT_PATTERNS
        if model_type == NATIVE_MODEL_TYPE:  # the original layout has its LoRA inline; the native one needs adapters
            patterns += [f"{d}/*" for d in NATIVE_ADAPTER_DIRS.values()]
        return Path(snapshot_download(repo_id, cache_dir=str(cache_dir), allow_patterns=patterns))
    except RepositoryNotFoundError as exc:
        raise InputError(f"no such model on the Hugging Face hub: {repo_id}") from exc
    except LocalEntryNotFoundError as exc:
        raise InputError(f"cannot download {repo_id}: the hub is unreachable and it is not in {cache_dir}") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"cannot download {repo_id}: {first}") from exc
