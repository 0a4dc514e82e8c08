"""The CPUs and cores this process may run on (stdlib only: the run-time helper reads it too)."""

from __future__ import annotations

import os
from pathlib import Path

SYSFS_CPUS = Path("/sys/devices/system/cpu")
# The CPUs that share one physical core with a given CPU, as Linux lists them (the second name: kernels before 5.x).
_SIBLING_FILES = ("core_cpus_list", "thread_siblings_list")


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return None


def available_cpus() -> int:
    """CPUs in this process's affinity mask (taskset, cgroup cpusets count), at least 1."""
    cpus = _affinity()
    return max(1, len(cpus)) if cpus is not None else max(1, os.cpu_count() or 1)


def available_cores(sysfs: Path = SYSFS_CPUS) -> int:
    """Physical cores among the CPUs this process may use: hardware threads of one core (SMT siblings) count once.
    Where the topology cannot be read (not Linux, no sysfs), the CPU count of `available_cpus`."""
    cpus = _affinity()
    if cpus is None:
        return available_cpus()
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        siblings = None
        for name in _SIBLING_FILES:
            try:
                siblings = (topology / name).read_text().strip()
                break
            except OSError:
                continue
        if not siblings:
            return max(1, len(cpus))
        cores.add(siblings)
    return max(1, len(cores))
