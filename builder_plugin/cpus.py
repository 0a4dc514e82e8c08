"""The CPUs this process may run on (stdlib only: the run-time helper reads it too)."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """CPUs in this process's affinity mask (taskset, cgroup cpusets count), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return max(1, os.cpu_count() or 1)
