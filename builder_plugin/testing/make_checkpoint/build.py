"""Writing a checkpoint folder atomically: plan the tensors, write one layout into a staging folder, swap it in."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder_plugin.testing.make_checkpoint.native_layout import native_config, write_native
from builder_plugin.testing.make_checkpoint.original_layout import original_config, write_original
from builder_plugin.testing.make_checkpoint.presets import PRESETS
from builder_plugin.testing.make_checkpoint.tensor_plan import native_state_shapes, plan_tensors
from builder_plugin.testing.make_checkpoint.tensors import DTYPES
from builder_plugin.testing.tokenizer import AUDIO_TOKEN, IMAGE_TOKEN, write_tokenizer


@dataclass(frozen=True)
class BuildSummary:
    path: Path
    fmt: str
    preset: str
    seed: int
    num_tensors: int
    num_shards: int
    total_bytes: int
    seconds: float


def make_checkpoint(out_dir: str | Path, preset: str = "tiny", **options: Any) -> Path:
    """Write a random checkpoint to `out_dir` (atomically) and return its path; `options` are build_checkpoint's
    (seed, fmt, text_layers, vision_layers, audio_blocks, num_shards, dtype, overwrite)."""
    return build_checkpoint(out_dir, preset, **options).path


def build_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    fmt: str = "original",
    text_layers: int | None = None,
    vision_layers: int | None = None,
    audio_blocks: int | None = None,
    num_shards: int | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
) -> BuildSummary:
    """make_checkpoint, returning what was written."""
    start = time.perf_counter()
    if fmt not in ("original", "native"):
        raise ValueError(f"unknown format {fmt!r}; choose 'original' or 'native'")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    if seed < 0:
        raise ValueError("seed must be >= 0")
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and not overwrite and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True / --overwrite)")

    original = original_config(preset, text_layers, vision_layers, audio_blocks)
    if dtype != "bfloat16":
        original["torch_dtype"] = dtype
    native = native_config(original)
    plan = plan_tensors(original, native_state_shapes(native))
    outliers = PRESETS[preset].get("outliers")
    if outliers is not None:
        plan = [dataclasses.replace(planned, outliers=outliers) for planned in plan]
    if num_shards is None:
        num_shards = PRESETS[preset]["num_shards"]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        if fmt == "original":
            shards, total_bytes, num_tensors = write_original(staging, original, plan, seed, dtype, num_shards)
        else:
            shards, total_bytes, num_tensors = write_native(staging, original, native, plan, seed, dtype, num_shards)
        max_length = original["max_position_embeddings"]
        extra_tokens = {"image_token": IMAGE_TOKEN, "audio_token": AUDIO_TOKEN} if fmt == "native" else None
        write_tokenizer(staging, model_max_length=max_length, extra_special_tokens=extra_tokens)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return BuildSummary(out_dir, fmt, preset, seed, num_tensors, shards, total_bytes, time.perf_counter() - start)


def _replace_dir(staging: Path, out_dir: Path) -> None:
    if out_dir.exists():
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        else:
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
            staging.rename(out_dir)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
            return
    staging.rename(out_dir)
