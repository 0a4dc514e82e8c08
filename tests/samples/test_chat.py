"""samples/chat.py run as a user would: --prompt in a subprocess, and the interactive chat in a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder_plugin.layout import INPUT_IDS, MAIN_DECODER
from builder_plugin.runtime import Turn, build_prompt, generate, open_audio, open_image

CHAT = Path(__file__).resolve().parents[2] / "samples" / "chat.py"
TIMEOUT_S = 300
STATS = re.compile(r"\[(\d+) tokens, [\d.]+ tokens/s, first token after [\d.]+ s, prompt (\d+) tokens"
                   r"(?: \((\d+) kept from the conversation\))?, (\S+\.onnx)\]")


@pytest.fixture(scope="module")
def package(tiny_package) -> Path:
    return tiny_package


def run_chat(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHAT), *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=CHAT.parent)


def test_prompt_mode_with_image_and_audio(package, media_dir, reference):
    image, audio = media_dir / "square.png", media_dir / "clip_2s.wav"
    result = run_chat(package, "--prompt", "What do you see and hear?", "--image", image, "--audio", audio,
                      "--max-new-tokens", 6)
    assert result.returncode == 0, result.stderr
    stats = STATS.search(result.stderr)
    assert stats, result.stderr
    assert int(stats[1]) == 6 and stats[4] == MAIN_DECODER

    # The printed answer is the reference model's greedy answer (vision LoRA, vision audio projection).
    prompt = build_prompt([Turn("What do you see and hear?", (open_image(image),), (open_audio(audio),))])
    expected = generate(package, prompt, [image], [audio], max_new_tokens=6)
    assert int(stats[2]) == expected.inputs[INPUT_IDS].shape[1]
    greedy = reference.prefill_and_greedy(expected.inputs, max_new_tokens=6)
    compared = next((i + 1 for i, gap in enumerate(greedy.top2_gap) if gap < 1e-3), len(greedy.tokens))
    assert expected.tokens[:compared] == greedy.tokens[:compared]
    assert result.stdout == expected.text + "\n"


def test_low_detail_reads_an_image_as_one_crop(package, tiny_checkpoint, tmp_path):
    import json

    from PIL import Image
    from skimage import data as photographs

    photo = tmp_path / "photo.png"
    Image.fromarray(photographs.astronaut()).resize((1000, 700)).save(photo)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    fitted = open_image(photo, fit=config["embd_layer"]["image_embd_layer"]["crop_size"])
    prompt = build_prompt([Turn("What is this?", (fitted,), ())])
    expected = generate(package, prompt, [fitted], [], max_new_tokens=4)
    low = run_chat(package, "--prompt", "What is this?", "--image", photo, "--low-detail", "--max-new-tokens", 4)
    assert low.returncode == 0, low.stderr
    assert int(STATS.search(low.stderr)[2]) == expected.inputs[INPUT_IDS].shape[1]
    assert low.stdout == expected.text + "\n"
    whole = run_chat(package, "--prompt", "What is this?", "--image", photo, "--max-new-tokens", 4)
    assert int(STATS.search(whole.stderr)[2]) > 2 * expected.inputs[INPUT_IDS].shape[1]


@pytest.mark.parametrize(("args", "message"), [
    (["--image", "{tmp}/missing.png"], r"error: image file not found: .*missing\.png"),
    (["--audio", "{tmp}/missing.wav"], r"error: audio file not found: .*missing\.wav"),
    (["--image", "{media}/clip_2s.wav"], r"error: cannot read image .*clip_2s\.wav: not a readable image \(not a "),
    (["--audio", "{tmp}/fake.wav"], r"error: cannot read audio .*fake\.wav: not a readable audio clip"),
    (["--image", "{media}/square.png", "--prompt", "Compare <|image_1|> with <|image_2|>."],
     r"error: the question has 2 image tags \(<\|image_1\|> <\|image_2\|>\) but 1 image is attached"),
    (["--max-length", "64", "--prompt", "word " * 100],  # the advice names this program's option and command
     r"error: the prompt is \d+ tokens but the maximum length is 64; start over with /clear, or run with a larger "
     r"--max-length$"),
])
def test_clear_one_line_errors(package, media_dir, tmp_path, args, message):
    (tmp_path / "fake.wav").write_bytes(b"definitely not audio" * 10)
    args = [a.format(tmp=tmp_path, media=media_dir) for a in args]
    if "--prompt" not in args:
        args += ["--prompt", "Hello"]
    result = run_chat(package, *args)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(message + ".*", errors[0]), result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_not_a_package(tmp_path):
    result = run_chat(tmp_path, "--prompt", "Hello")
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: not a model package (no genai_config.json): {tmp_path}"


class Terminal:
    """A child process on a pseudo-terminal: type lines, wait for text."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = pty.openpty()
        self.process = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                                        cwd=CHAT.parent)
        os.close(slave)
        self.master = master
        self.output = ""
        self.seen = 0

    def expect(self, pattern: str, timeout: float = TIMEOUT_S) -> re.Match:
        """Wait for `pattern` in the output after the previous match."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.compile(pattern).search(self.output, self.seen)
            if found:
                self.seen = found.end()
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; output so far:\n{self.output}")
            ready, _, _ = select.select([self.master], [], [], remaining)
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"the chat ended while waiting for {pattern!r}; output:\n{self.output}")
                self.output += chunk.decode("utf-8", errors="replace").replace("\r\n", "\n")

    def send(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")

    def close(self, timeout: float = 60) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            os.close(self.master)


def test_interactive_chat(package, media_dir):
    terminal = Terminal([sys.executable, str(CHAT), str(package), "--max-new-tokens", "4"])
    try:
        terminal.expect(r"Type a question, or /help\.")
        terminal.expect(r"> ")
        terminal.send("Hello, who are you?")
        stats = terminal.expect(STATS.pattern)
        assert int(stats[1]) == 4 and stats[4] == MAIN_DECODER

        terminal.expect(r"> ")
        terminal.send(f"/image {media_dir / 'square.png'}")
        terminal.expect(r"\(attached to the next question: image .*square\.png\)")
        terminal.expect(r"> ")
        terminal.send("/image nowhere.png")
        terminal.expect(r"error: image file not found: nowhere\.png")
        terminal.expect(r"> ")
        terminal.send("What is in the picture?")
        stats = terminal.expect(STATS.pattern)
        assert stats[4] == MAIN_DECODER and stats[3] is None

        terminal.expect(r"> ")
        terminal.send("And the colours?")  # a follow-up without media: the conversation's cache is kept
        stats = terminal.expect(STATS.pattern)
        assert int(stats[3]) > int(stats[2]) // 2

        terminal.expect(r"> ")
        terminal.send("/help")
        terminal.expect(r"/audio PATH")
        terminal.expect(r"> ")
        terminal.send("/quit")
        assert terminal.close() == 0
    finally:
        if terminal.process.poll() is None:
            terminal.process.kill()
            terminal.process.wait()
