"""The input modes verify checks, and the --modes parser (standard library only: the command line parses without
loading torch)."""

from __future__ import annotations

MODES = ("text", "image", "audio", "image+audio")


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(MODES)}")
    return modes
