"""What verify checks, and the --modes parser (standard library only: the command line parses without loading torch).

A verify mode is the media one prompt carries. Each is answered in the input mode `layout.mode_of` gives it (the
LoRA that runs, `layout.INPUT_MODES`); "image" and "image+audio" share the vision mode but not the audio projection,
so both are checked.
"""

from __future__ import annotations

VERIFY_MODES = ("text", "image", "audio", "image+audio")


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [m for m in modes if m not in VERIFY_MODES]
    if unknown or not modes:
        raise ValueError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(VERIFY_MODES)}")
    return modes
