"""Stop strings in a streamed answer: text is let through as soon as it cannot be the start of a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopScanner:
    """Feed the answer piece by piece; each call returns the text that is safe to send and whether a stop string was
    found (the text is then cut before it). Text that could begin a stop string is held back until it cannot."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self._held + piece
        found = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self._held = ""
            return text[:min(found)], True
        keep = max((k for stop in self.stops for k in range(1, min(len(stop), len(text) + 1))
                    if text.endswith(stop[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of the answer."""
        held, self._held = self._held, ""
        return held
