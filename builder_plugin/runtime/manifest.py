"""``manifest.json``: what the build knows and an app needs to run the package right, recorded in the package.

- ``decoders``: the decoder file that answers each input mode (``text``, ``vision`` for any image, ``speech`` for
  audio without images). A routed package names one self-routing decoder for all three; a split one three files.
- ``routing``: ``self`` (one decoder picks its LoRA from the prompt), ``split`` (one decoder file per mode) or
  ``fixed`` (one decoder, one LoRA choice for every mode).
- ``original_max_position_embeddings``: where LongRoPE switches from the short to the long factors. The original model
  recomputes the whole cache once when a generation grows past it; the runtime does not do so for phi4mm, so
  `builder_plugin.runtime.Chat` does.
- ``source``: where the checkpoint came from: ``repository``, ``revision`` and the ``commit`` downloaded (and the hub
  ``endpoint``), or ``local_folder``. ``builder``: the builder's ``name``, ``version`` and ``options`` (the run time
  reads the precision and provider from them: the KV cache's dtype). A graphs-only package (no runnable decoder) has
  a manifest with just these two.

Packages without the file (older builds) are read from their files: the split layout by its decoder names, anything
else as one fixed decoder, and no LongRoPE recompute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder_plugin.layout import INPUT_MODES, MANIFEST_FILE, SPLIT_DECODERS

FORMAT_VERSION = 1
ROUTINGS = ("self", "split", "fixed")


@dataclass(frozen=True)
class Manifest:
    decoders: dict[str, str]  # input mode -> decoder file
    routing: str
    original_max_position_embeddings: int | None = None
    source: dict[str, Any] | None = None
    builder: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        data = {"format": FORMAT_VERSION, "routing": self.routing, "decoders": dict(self.decoders),
                "original_max_position_embeddings": self.original_max_position_embeddings}
        return {**data, **provenance_json(self.source, self.builder)}

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_FILE
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def read(cls, folder: Path, main_decoder: str) -> Manifest:
        """The package's manifest, or one inferred from its files; ValueError for a malformed file."""
        path = Path(folder) / MANIFEST_FILE
        if not path.is_file():
            if all((Path(folder) / name).is_file() for name in SPLIT_DECODERS.values()):
                return cls(dict(SPLIT_DECODERS), "split")
            return cls(dict.fromkeys(INPUT_MODES, main_decoder), "fixed")
        data = json.loads(path.read_text(encoding="utf-8"))
        decoders = data.get("decoders")
        if not isinstance(decoders, dict) or set(decoders) != set(INPUT_MODES):
            raise ValueError(f"{MANIFEST_FILE}: 'decoders' must name a file for each of {', '.join(INPUT_MODES)}")
        if data.get("routing") not in ROUTINGS:
            raise ValueError(f"{MANIFEST_FILE}: 'routing' must be one of {', '.join(ROUTINGS)}")
        switch = data.get("original_max_position_embeddings")
        builder = data.get("builder") if isinstance(data.get("builder"), dict) else None
        return cls({m: str(decoders[m]) for m in INPUT_MODES}, data["routing"], int(switch) if switch else None,
                   builder=builder)


def provenance_json(source: dict[str, Any] | None, builder: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (("source", source), ("builder", builder)) if v is not None}
