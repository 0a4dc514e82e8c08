"""The project's operator library (builder_plugin.kernels: MatMulNBits on AVX2, AVX-512 VNNI and AMX) in a package's
sessions, where it is faster than onnxruntime's own kernel: decided per package and machine when the package is
opened, registered through the sessions' ``custom_ops_library``, the package itself left untouched.

- It runs a package whose every MatMulNBits it computes fast: a CPU int4 or int8 package (float32 inputs: its kernel
  is float32 only, and registered it replaces onnxruntime's for every MatMulNBits of the session) with
  ``accuracy_level`` 4 (the CPU default: int8 activations per block; the library keeps that for decode steps and
  runs prompts in bf16 where the CPU has AMX); another package, another provider, an older
  package without a build record, ``BUILDER_PLUGIN_KERNELS=0``, a CPU without AVX2 (where the library registers
  nothing), or on a CPU with AVX2 but no AVX-512 VNNI a package with blocks smaller than 32 keep onnxruntime's
  kernel.
- onnxruntime-genai 0.18 takes a ``custom_ops_library`` only from inside the package folder, an execution provider's
  library folder or the current directory (links resolved): the model is created with the library's own folder as
  the current directory (``loading``), so a read-only package works and nothing is copied.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from builder_plugin import kernels
from builder_plugin.precisions import DEFAULT_BLOCK_SIZE, QUANTIZED_PRECISIONS, default_accuracy_level

log = logging.getLogger("builder_plugin.runtime")

SWITCH = "BUILDER_PLUGIN_KERNELS"  # "0": never register the library
FAST_ACCURACY_LEVEL = 4


def for_package(builder: Mapping[str, Any] | None, execution_provider: str | None,
                wanted: bool | None = None) -> Path | None:
    """The library to register for a package built with `builder` (the manifest's record) and run on
    `execution_provider` (None: the one it was built for), or None. `wanted` False: never; None: where it helps
    (and BUILDER_PLUGIN_KERNELS is not "0")."""
    if wanted is False or (wanted is None and os.environ.get(SWITCH, "1") == "0"):
        return None
    options = (builder or {}).get("options") or {}
    built_for = options.get("execution_provider")
    provider = execution_provider or built_for
    extra = options.get("extra_options") or {}
    accuracy = _recorded_int(extra, "accuracy_level")
    block_size = _recorded_int(extra, "block_size") or DEFAULT_BLOCK_SIZE
    if accuracy is None and built_for is not None:
        accuracy = default_accuracy_level(built_for)
    if provider != "cpu" or built_for != "cpu" or options.get("precision") not in QUANTIZED_PRECISIONS or \
            accuracy != FAST_ACCURACY_LEVEL:
        return None
    notice = kernels.missing_notice()
    if notice is not None:
        log.warning(notice)
        return None
    level = kernels.level()
    if level == "none":
        return None
    if block_size < kernels.MIN_BLOCK_SIZE.get(level, 0):
        log.info("builder_plugin: block_size %d is below the library's %d on this CPU (%s); onnxruntime's "
                 "MatMulNBits runs", block_size, kernels.MIN_BLOCK_SIZE[level], level)
        return None
    return kernels.library_path()


def _recorded_int(extra: Mapping[str, Any], key: str) -> int | None:
    """An --extra_options value as the build record keeps it (as given: a string), or None where absent or not an
    integer."""
    try:
        return int(extra[key]) if key in extra else None
    except (TypeError, ValueError):
        return None


def session_options(library: Path | None) -> dict[str, str]:
    """What every session's options get for `library` (nothing without one)."""
    return {"custom_ops_library": str(library)} if library is not None else {}


@contextlib.contextmanager
def loading(library: Path | None) -> Iterator[None]:
    """While an og.Model is created with `library` in its sessions' options: the library's folder is the current
    directory (one of the folders onnxruntime-genai takes a library from)."""
    if library is None:
        yield
        return
    previous = os.getcwd()
    os.chdir(library.parent)
    try:
        yield
    finally:
        os.chdir(previous)
