"""Shared fixtures: one tiny generated checkpoint per test session (original and native layouts), its config, routed
weights, reference, media, and built fp32 CPU packages: the default (one self-routing decoder) of each layout and a
split one (a decoder file per input mode)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from builder_plugin.checkpoint.reader import CheckpointReader
from builder_plugin.checkpoint.routing import route_weights
from builder_plugin.config import Phi4MMConfig
from tests.support.temp import FOREIGN_TEMP_PREFIXES  # removed with the session's folder

# What the code under test (and every subprocess a test starts) writes to the system temp folder goes to a folder of
# this session's, which must be empty again at the end (pytest_sessionfinish); pytest's own base temp folder stays in
# the system temp folder, removed by pytest after a passing session (tmp_path_retention_policy in pyproject.toml).
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
SESSION_TEMP = Path(tempfile.mkdtemp(prefix="builder-plugin-tests-"))
os.environ["TMPDIR"] = str(SESSION_TEMP)
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

TINY_SEED = 0
# search.max_length of the shared packages: a short KV cache keeps every generator cheap.
TINY_PACKAGE_MAX_LENGTH = 4096

_BUILT_PACKAGES: dict[tuple[Path, str, str], Path] = {}


def build_tiny_package(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path, lora: str = "routed",
                       precision: str = "fp32") -> Path:
    """The CPU package of `checkpoint` (default: fp32, --lora routed: one self-routing decoder), built once per
    session."""
    key = (checkpoint, lora, precision)
    if key not in _BUILT_PACKAGES:
        from builder_plugin.build import build
        from builder_plugin.options import BuildOptions

        output = tmp_path_factory.mktemp("package") / f"{checkpoint.name}-{lora}-{precision}"
        options = BuildOptions(model_dir=checkpoint, output_dir=output, precision=precision, execution_provider="cpu",
                               max_length=TINY_PACKAGE_MAX_LENGTH, lora=lora)
        _BUILT_PACKAGES[key] = build(options, progress=False).output_dir
    return _BUILT_PACKAGES[key]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from builder_plugin.testing.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_native_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from builder_plugin.testing.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-native", preset="tiny", seed=TINY_SEED, fmt="native")


@pytest.fixture(scope="session")
def tiny_config(tiny_checkpoint: Path) -> Phi4MMConfig:
    return Phi4MMConfig.from_dir(tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_weights(tiny_checkpoint: Path, tiny_config: Phi4MMConfig):
    return route_weights(CheckpointReader(tiny_checkpoint, tiny_config.source_format), tiny_config)


@pytest.fixture(scope="session")
def reference(tiny_checkpoint: Path):
    from builder_plugin.reference.model import Reference

    return Reference.load(tiny_checkpoint)


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from builder_plugin.testing.media import make_image, make_wav

    folder = tmp_path_factory.mktemp("media")
    for name, (w, h) in {"square.png": (448, 448), "wide.jpg": (640, 360), "tall.png": (300, 900),
                         "tiny.png": (50, 50), "strip.jpg": (2000, 200), "photo.jpg": (4000, 3000)}.items():
        make_image(folder / name, w, h, seed=len(name))
    for name, (seconds, rate) in {"clip_0_5s.wav": (0.5, 16000), "clip_2s.wav": (2.0, 16000),
                                  "clip_12s.wav": (12.0, 16000), "clip_2s_8k.wav": (2.0, 8000),
                                  "clip_3s_48k.wav": (3.0, 48000), "clip_45s.wav": (45.0, 16000)}.items():
        make_wav(folder / name, seconds, sample_rate=rate, seed=len(name))
    return folder


@pytest.fixture(scope="session")
def native_reference(tiny_native_checkpoint: Path):
    from builder_plugin.reference.model import Reference

    return Reference.load(tiny_native_checkpoint)


@pytest.fixture(scope="session")
def tiny_package(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """fp32 CPU package of `tiny_checkpoint` (routed LoRA)."""
    return build_tiny_package(tmp_path_factory, tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_int4_package(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """int4 CPU package of `tiny_checkpoint` (the default quantization, routed LoRA)."""
    return build_tiny_package(tmp_path_factory, tiny_checkpoint, precision="int4")


@pytest.fixture(scope="session")
def tiny_split_package(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """fp32 CPU package of `tiny_checkpoint` with one decoder file per input mode (--lora split)."""
    return build_tiny_package(tmp_path_factory, tiny_checkpoint, lora="split")


@pytest.fixture(scope="session")
def tiny_native_package(tmp_path_factory: pytest.TempPathFactory, tiny_native_checkpoint: Path) -> Path:
    """fp32 CPU package of `tiny_native_checkpoint` (routed LoRA)."""
    return build_tiny_package(tmp_path_factory, tiny_native_checkpoint)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session if anything of ours is left in the temp folder; remove the session's temp folder."""
    processor = sys.modules.get("tests.support.processor")
    if processor is not None:  # its stubs are kept for the whole session
        processor.remove_stubs()
    left = sorted(p.name for p in SESSION_TEMP.iterdir() if not p.name.startswith(FOREIGN_TEMP_PREFIXES))
    shutil.rmtree(SESSION_TEMP, ignore_errors=True)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"error: the tests left {', '.join(left)} in the temp folder", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
