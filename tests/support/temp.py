"""Files that others write in a temporary folder: not ours, so not counted as left behind."""

from __future__ import annotations

from pathlib import Path

# onnxruntime's telemetry session id, torch's compile cache, libpulse's runtime folder (espeak-ng makes one even when it
# only writes a WAV file).
FOREIGN_TEMP_PREFIXES = (".ses", "torchinductor_", "pulse-")


def our_files(folder: Path) -> list[str]:
    """The names in `folder` (recursively) that are not someone else's."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.name.startswith(FOREIGN_TEMP_PREFIXES))
