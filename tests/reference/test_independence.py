"""The reference is the yardstick of the builder's graphs (in the tests and in verify), so it must not run the
builder's code: a mistake there would show on both sides of the comparison and pass."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import builder_plugin.verify

# What the reference may import of the project: the package's shared names, and itself.
REFERENCE_ALLOWED = ("builder_plugin", "builder_plugin.layout", "builder_plugin.reference")
# What verify may import besides: small shared modules, the run-time helper that runs the package as an app does (with
# the kernel library it registers), and the media it decodes and generates.
VERIFY_ALLOWED = (*REFERENCE_ALLOWED, "builder_plugin.cpus", "builder_plugin.errors", "builder_plugin.memory",
                  "builder_plugin.precisions", "builder_plugin.media", "builder_plugin.runtime",
                  "builder_plugin.kernels", "builder_plugin.testing", "builder_plugin.testing.media",
                  "builder_plugin.verify")
# Subpackages whose every module is allowed (the reference is checked on its own above).
VERIFY_ALLOWED_PACKAGES = ("builder_plugin.reference", "builder_plugin.verify", "builder_plugin.runtime",
                           "builder_plugin.media")


def loaded_project_modules(*modules: str) -> list[str]:
    """The project's modules a fresh interpreter holds after importing `modules`."""
    code = (f"import json, sys; import {', '.join(modules)}; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('builder_plugin', 'genai_config'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def imported_by(folder: Path) -> set[str]:
    """Every project module the source files in `folder` import, at the top or inside a function."""
    names = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
    return {name for name in names if name.split(".")[0] == "builder_plugin"}


def test_the_reference_imports_no_builder_code() -> None:
    loaded = loaded_project_modules("builder_plugin.reference.model", "builder_plugin.reference.streaming")
    assert {"builder_plugin.reference.model", "builder_plugin.reference.streaming"} <= set(loaded)
    assert [m for m in loaded if not (m in REFERENCE_ALLOWED or m.startswith("builder_plugin.reference."))] == []


def test_verify_imports_no_builder_code() -> None:
    """Every module verify imports (those its command line imports only once it runs, too), and what they bring in:
    no checkpoint reader, routing table, config parser, component or quantizer of the builder among them."""
    modules = imported_by(Path(builder_plugin.verify.__file__).parent)
    assert "builder_plugin.reference.streaming" in modules
    loaded = loaded_project_modules(*sorted(modules))
    assert [m for m in loaded if not (m in VERIFY_ALLOWED
                                      or m.startswith(tuple(f"{p}." for p in VERIFY_ALLOWED_PACKAGES)))] == []
