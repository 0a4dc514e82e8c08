"""Tests of the samples; `built_package` gives the runtime and sample tests one tiny fp32 package per session."""

from __future__ import annotations

from pathlib import Path

import pytest

_PACKAGES: dict[Path, Path] = {}


def built_package(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Path:
    """A runnable fp32 CPU package of `checkpoint` (routed LoRA: three decoder variants), built once per session."""
    if checkpoint not in _PACKAGES:
        from builder_plugin.build import build
        from builder_plugin.options import BuildOptions

        options = BuildOptions(model_dir=checkpoint, output_dir=tmp_path_factory.mktemp("package") / "tiny-fp32",
                               precision="fp32", execution_provider="cpu", max_length=4096)
        _PACKAGES[checkpoint] = build(options, progress=False).output_dir
    return _PACKAGES[checkpoint]
