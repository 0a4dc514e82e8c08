"""The README's examples, and docs/serving.md's, run as written against the demo's package served as the README says.

The folder they run in is laid out as the demo leaves it (demo/package: the tiny package; demo/media: the demo's own
picture and clip, written by its write_media); the server is started by the README's own command, with one change:
--port 0, and the port it picked put in the examples' URLs in place of 8000 (another server may hold 8000). Every
shell block must exit 0 and answer without an error object; each file's Python blocks run in one interpreter, in
order (they continue one another), and must exit 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder_plugin.demo import write_media
from tests.support.server_process import server_process

ROOT = Path(__file__).resolve().parents[2]
README, SERVING = ROOT / "README.md", ROOT / "docs" / "serving.md"
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```$", re.M | re.S)
DEFAULT_URL = "http://127.0.0.1:8000"
ERROR = re.compile(r'"error":\s*\{|^event: error$', re.M)  # an error object (a response's "error": null is none)


def _blocks(path: Path, sections: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """The sh and python blocks of `path` (of its `sections` only, when given), in order."""
    text = path.read_text(encoding="utf-8")
    if sections is not None:
        parts = re.split(r"^## ", text, flags=re.M)
        text = "".join(part for part in parts if part.split("\n", 1)[0] in sections)
    return [(kind, code) for kind, code in BLOCK.findall(text)]


def _serve_command() -> list[str]:
    """The README's command that serves the demo's package."""
    for kind, code in _blocks(README, ("Serve",)):
        for line in code.splitlines():
            if kind == "sh" and line.startswith("python -m builder_plugin.serve"):
                return line.split("#")[0].split()
    raise AssertionError("the README's Serve section has no serve command")


@pytest.fixture(scope="module")
def demo(tiny_package, tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """The folder the examples run in, and the URL of the server the README's command started there."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "demo").mkdir()
    (folder / "demo" / "package").symlink_to(tiny_package)
    write_media(folder / "demo")
    command = _serve_command()
    assert command[:4] == ["python", "-m", "builder_plugin.serve", "demo/package"]
    with server_process(command[3], folder / "server", *command[4:], cwd=folder) as server:
        assert server.model_id == "phi4mm"
        yield folder, server.base_url
        assert server.stop(30) == 0


def _run(args: list[str], folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.mark.parametrize(("path", "sections"), [(README, ("Run", "Serve")), (SERVING, None)],
                         ids=["README", "serving.md"])
def test_examples_run_as_written(demo, path, sections):
    folder, url = demo
    blocks = [(kind, code.replace(DEFAULT_URL, url)) for kind, code in _blocks(path, sections)
              if "python -m builder_plugin.serve" not in code]
    shell = [code for kind, code in blocks if kind == "sh"]
    python = "\n".join(code for kind, code in blocks if kind == "python")
    assert shell and python
    for code in shell:
        done = _run(["bash", "-e", "-o", "pipefail", "-c", code], folder)
        assert done.returncode == 0 and done.stdout.strip(), (code, done.stdout, done.stderr)
        assert not ERROR.search(done.stdout), (code, done.stdout)
    done = _run([sys.executable, "-c", python], folder)
    assert done.returncode == 0, done.stderr
