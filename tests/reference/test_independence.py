"""The reference is the yardstick of the builder's graphs, so it must not run the builder's code."""

from __future__ import annotations

import json
import subprocess
import sys

ALLOWED = ("builder_plugin", "builder_plugin.layout", "builder_plugin.reference")


def test_the_reference_imports_no_builder_code() -> None:
    code = ("import json, sys; import builder_plugin.reference.model, builder_plugin.reference.checkpoint; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('builder_plugin'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert "builder_plugin.reference.model" in loaded
    assert [m for m in loaded if not (m in ALLOWED or m.startswith("builder_plugin.reference."))] == []
