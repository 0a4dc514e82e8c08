"""A process's memory: one field of the kernel's /proc reports, and sampling while a block of work runs."""

from __future__ import annotations

import threading
from pathlib import Path


def proc_kib_field(path: str | Path, field: str) -> int | None:
    """The value of a ``Field:   N kB`` line of a /proc report (``/proc/meminfo``, ``/proc/PID/status``,
    ``/proc/self/smaps_rollup``) in bytes; None when the report has no such field. OSError when it cannot be read."""
    prefix = field + ":"
    with open(path, encoding="ascii") as report:
        for line in report:
            if line.startswith(prefix):
                return int(line.split()[1]) * 1024
    return None


class MemorySampler:
    """The largest resident set seen while the block runs, and the largest private and file-mapped parts of it.

    Private is the resident set less the pages mapped from files; for a package whose float weights run unpacked,
    those pages are its weights, read from the page cache (shared, and dropped and read again under pressure)."""

    def __init__(self, interval_s: float = 0.1) -> None:
        import psutil  # the build extra's; proc_kib_field runs without it

        self._process = psutil.Process()
        self.peak_rss = 0
        self.peak_private = 0
        self.peak_file = 0
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            memory = self._process.memory_info()
            mapped = getattr(memory, "shared", 0)  # Linux: file-backed and shared-memory pages
            self.peak_rss = max(self.peak_rss, memory.rss)
            self.peak_private = max(self.peak_private, memory.rss - mapped)
            self.peak_file = max(self.peak_file, mapped)
            self._stop.wait(self._interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
