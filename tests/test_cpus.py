"""available_cores: SMT siblings count once, and without a readable topology every CPU counts."""

from __future__ import annotations

import os

import pytest

from builder_plugin import cpus


def _topology(root, siblings: dict[int, str], name: str = "core_cpus_list"):
    for cpu, listed in siblings.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / name).write_text(listed + "\n")
    return root


@pytest.fixture
def affinity(monkeypatch):
    def use(cpu_ids):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpu_ids))
    return use


def test_hardware_threads_of_one_core_count_once(tmp_path, affinity):
    affinity([0, 1, 2, 3, 4, 5])  # 3 cores with 2 hardware threads each, numbered as Linux does on x86
    sysfs = _topology(tmp_path, {0: "0,3", 1: "1,4", 2: "2,5", 3: "0,3", 4: "1,4", 5: "2,5"})
    assert cpus.available_cpus() == 6
    assert cpus.available_cores(sysfs) == 3


def test_only_the_cores_of_the_allowed_cpus(tmp_path, affinity):
    affinity([0, 3, 1])  # taskset: both threads of core 0, one of core 1
    sysfs = _topology(tmp_path, {0: "0,3", 1: "1,4", 3: "0,3"})
    assert cpus.available_cores(sysfs) == 2


def test_older_kernels_name_the_file_thread_siblings_list(tmp_path, affinity):
    affinity([0, 1, 2, 3])
    sysfs = _topology(tmp_path, {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}, name="thread_siblings_list")
    assert cpus.available_cores(sysfs) == 2


def test_no_topology_counts_every_cpu(tmp_path, affinity):
    affinity([0, 1, 2])
    assert cpus.available_cores(tmp_path) == 3


def test_no_affinity_api_counts_the_cpus(monkeypatch, tmp_path):
    def missing(pid):
        raise AttributeError("sched_getaffinity")
    monkeypatch.setattr(os, "sched_getaffinity", missing)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpus.available_cpus() == 8
    assert cpus.available_cores(tmp_path) == 8
