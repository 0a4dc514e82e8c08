"""CI: run a built package with the base install and the serve extra only (`pip install ".[serve]"` in a fresh
virtual environment, no torch, no transformers): the runtime answers one question with an image and a clip, the
server serves its chat page (the package data of a non-editable install) and answers one chat request and stops
cleanly on SIGTERM, and the build command says which extra it needs.

Usage (with that environment's python): python .ci/without_torch.py DEMO_FOLDER
(`python -m builder_plugin.demo DEMO_FOLDER` in the main environment writes its checkpoint, media and package)."""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

BUILD_ONLY = ("torch", "transformers")
NEW_TOKENS = 8


def main(demo: Path) -> None:
    package, media = demo / "package", demo / "media"
    for name in BUILD_ONLY:
        assert importlib.util.find_spec(name) is None, f"{name} is installed: this environment must not have it"
    image, clip = media / "picture.jpg", media / "clip.wav"

    from builder_plugin.runtime import Chat

    chat = Chat(package)
    answer = "".join(chat.ask("Describe the image and the audio clip.", [image], [clip], max_new_tokens=NEW_TOKENS))
    assert chat.last_stats.new_tokens > 0, "the runtime generated nothing"
    print(f"runtime: {chat.last_stats.new_tokens} tokens with an image and a clip ({len(answer)} characters)")

    server = subprocess.Popen([sys.executable, "-m", "builder_plugin.serve", str(package), "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        assert line.startswith("serving "), f"the server did not start: {line!r}"
        url = line.split(" at ")[1].strip()
        check_page(url.removesuffix("v1"))
        picture = base64.b64encode(image.read_bytes()).decode()
        body = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{picture}"}},
            {"type": "text", "text": "Describe the image."}]}], "max_tokens": NEW_TOKENS}
        request = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            reply = json.load(response)
        assert reply["usage"]["completion_tokens"] > 0, reply
        print(f"server: {reply['usage']['completion_tokens']} tokens for an image request")
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, f"the server exited with {server.returncode} on SIGTERM"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()

    build = subprocess.run([sys.executable, "-m", "builder_plugin", "-i", str(demo / "checkpoint"), "-o",
                            str(demo / "never-built")], capture_output=True, text=True)
    assert build.returncode == 1 and "build extra" in build.stderr, build.stderr
    assert not (demo / "never-built").exists()
    print(f"build command: {build.stderr.strip()}")

    imported = sorted(name for name in BUILD_ONLY if name in sys.modules)
    assert not imported, f"imported {imported}"
    print("a package runs without torch and transformers")


def check_page(root: str) -> None:
    """GET / is the chat page, and every file it loads (its HTML's src/href, its modules' imports) is served."""
    with urllib.request.urlopen(root, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/html"), response.headers["Content-Type"]
        text = response.read().decode()
    files: set[str] = set()
    queue = re.findall(r'(?:src|href)="ui/([\w.-]+)"', text)
    while queue:
        name = queue.pop()
        if name not in files:
            with urllib.request.urlopen(f"{root}ui/{name}", timeout=60) as response:
                text = response.read().decode()
            assert text, name
            files.add(name)
            queue += re.findall(r'from "\./([\w.-]+)"', text)
    assert {"app.js", "markdown.js"} <= files, files
    print(f"server: the chat page and its {len(files)} files")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
