"""builder_plugin.runtime.kernel_library: which packages run on the project's MatMulNBits kernel, and a package run
with it answers as with onnxruntime's own kernel (the same greedy tokens, logits within the int8 activations' error),
with the package folder untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from builder_plugin import kernels
from builder_plugin.layout import MAIN_DECODER, MODE_DECODERS
from builder_plugin.runtime import Chat, Package
from builder_plugin.runtime.kernel_library import SWITCH, for_package

CPU_INT4 = {"options": {"precision": "int4", "execution_provider": "cpu", "extra_options": {}}}
NEEDS_LIBRARY = pytest.mark.skipif(kernels.level() == "none", reason="the library has no fast path on this CPU")


def _with(**options) -> dict:
    return {"options": {**CPU_INT4["options"], **options}}


def test_which_packages_run_on_the_library(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    expected = kernels.library_path() if kernels.level() != "none" else None
    assert for_package(CPU_INT4, None) == expected
    assert for_package(_with(precision="int8"), None) == expected
    assert for_package(_with(extra_options={"accuracy_level": "4"}), "cpu") == expected  # recorded as given
    assert for_package(_with(extra_options={"block_size": "64"}), None) == expected
    small_blocks = _with(extra_options={"block_size": "16"})
    assert for_package(small_blocks, None) == (None if kernels.level() == "avx2" else expected)
    refused = [_with(precision="fp32"), _with(precision="fp16", execution_provider="cuda"),
               _with(extra_options={"accuracy_level": "1"}), _with(extra_options={"accuracy_level": "9"}),
               _with(execution_provider="webgpu"), None, {}]
    assert [for_package(builder, None) for builder in refused] == [None] * len(refused)
    assert for_package(CPU_INT4, "cuda") is None  # run on another provider than it was built for
    assert for_package(CPU_INT4, None, wanted=False) is None
    if kernels.library_path() is not None:  # with AVX2 alone a decode step of blocks of 16 would unpack all of B
        monkeypatch.setattr(kernels, "level", lambda: "avx2")
        assert for_package(small_blocks, None) is None
        assert for_package(CPU_INT4, None) == kernels.library_path()
    monkeypatch.setenv(SWITCH, "0")
    assert for_package(CPU_INT4, None) is None


@NEEDS_LIBRARY
def test_a_package_answers_as_with_onnxruntimes_kernel(tiny_int4_package, tiny_package, media_dir):
    """The logits are as far from the float package's (the unquantized yardstick) as onnxruntime's own: for text, the
    attention sums in another order (the library's float path for a short prompt), which moves an int8-quantized
    activation by a step here and there; for an image also the encoder's many-row products, rounded on other paths."""
    files = {p.name: p.read_bytes() for p in tiny_int4_package.iterdir()}
    before = os.getcwd()
    logits: dict[tuple, list[np.ndarray]] = {}
    for package, wanted in ((tiny_int4_package, True), (tiny_int4_package, False), (tiny_package, None)):
        chat = Chat(Package(package, kernels=wanted))
        assert (chat.package.kernel_library is not None) == bool(wanted)
        chat.keep_logits = True
        for mode, images in (("text", []), ("image", [media_dir / "square.png"])):
            chat.clear()
            list(chat.ask("Describe what you get.", images, max_new_tokens=1))
            logits[wanted, mode] = chat.last_logits[0]
    for mode in ("text", "image"):
        library, onnxruntime = (float(np.abs(logits[w, mode] - logits[None, mode]).mean()) for w in (True, False))
        assert library < 1.1 * onnxruntime, mode
    assert os.getcwd() == before  # the model was created in the library's folder, and the directory given back
    assert {p.name: p.read_bytes() for p in tiny_int4_package.iterdir()} == files  # nothing written to the package
    assert "custom_ops_library" not in json.loads((tiny_int4_package / "genai_config.json").read_text())["model"][
        "decoder"]["session_options"]


@NEEDS_LIBRARY
def test_each_mode_is_answered_by_its_decoder_where_the_library_runs(tiny_int4_package, media_dir):
    """A routed CPU int4 package's decoder for each input mode (no If nodes) answers where the library reads the
    weights in place: text without LoRA, images (with audio or not) with the vision adapter, audio with the speech
    one; a conversation that gains an image moves to the vision decoder. Without the library (whose absence makes
    onnxruntime prepack a copy of the weights per session) the routed decoder answers every mode."""
    modes = ((False, False), (True, False), (False, True), (True, True))
    package = Package(tiny_int4_package)
    assert [package.variant_for(*mode) for mode in modes] == [MODE_DECODERS["text"], MODE_DECODERS["vision"],
                                                              MODE_DECODERS["speech"], MODE_DECODERS["vision"]]
    assert {Package(tiny_int4_package, kernels=False).variant_for(*mode) for mode in modes} == {MAIN_DECODER}
    chat = Chat(package)
    list(chat.ask("Say something.", max_new_tokens=2))
    assert package.is_loaded(MODE_DECODERS["text"]) and not package.is_loaded(MAIN_DECODER)
    assert chat.next_variant() == MODE_DECODERS["text"]
    assert chat.next_variant([media_dir / "square.png"]) == MODE_DECODERS["vision"]
    list(chat.ask("And this?", [media_dir / "square.png"], max_new_tokens=2))
    assert package.is_loaded(MODE_DECODERS["vision"]) and chat.next_variant() == MODE_DECODERS["vision"]
    assert not package.is_loaded(MAIN_DECODER)
    served = Package(tiny_int4_package)
    served.preload()  # what the server loads before its first request
    assert [v for v in (MAIN_DECODER, *MODE_DECODERS.values()) if served.is_loaded(v)] == list(MODE_DECODERS.values())
    without_speech = Package(tiny_int4_package)
    without_speech.has_speech = False  # as a package built without its speech model reads
    without_speech.preload()  # takes no audio: no decoder for it
    assert [v for v in MODE_DECODERS.values() if without_speech.is_loaded(v)] == [MODE_DECODERS["text"],
                                                                                  MODE_DECODERS["vision"]]


TEXT_TURNS = [("Tell me a story about a lighthouse keeper and the ships she counted in the storm.", [], []),
              ("And then what happened next, in more detail please?", [], []),
              ("Continue the story for a while longer, with the colour of the sea.", [], [])]


@NEEDS_LIBRARY
@pytest.mark.parametrize("media", ["image", "audio", "both"])
def test_a_conversation_on_the_mode_decoders_answers_as_on_the_routed_one(tiny_int4_package, media_dir, media):
    """Text turns kept and followed up past the LongRoPE switch, then media (which moves the conversation to its
    mode's decoder; an image after a clip from the speech decoder to the vision one), then text again: the same
    tokens and logits as the routed decoder answering every turn (which verify checks against the checkpoint)."""
    image, clip = [media_dir / "square.png"], [media_dir / "clip_2s.wav"]
    if media == "both":
        more = [("What do you hear?", [], clip), ("And what is in this picture?", image, []), ("Say more.", [], [])]
        modes = ["text"] * 3 + ["speech", "vision", "vision"]
    else:
        files = (image, []) if media == "image" else ([], clip)
        more = [("What is in this?", *files), ("Say more about it.", [], [])]
        modes = ["text"] * 3 + [{"image": "vision", "audio": "speech"}[media]] * 2
    answers = {}
    for routed in (False, True):
        package = Package(tiny_int4_package)
        if routed:
            package.variant_for = lambda has_image, has_audio, p=package: p.main_decoder
        chat = Chat(package)
        chat.keep_logits = True
        answers[routed] = []
        for text, images, audios in TEXT_TURNS + more:
            answer = "".join(chat.ask(text, images, audios, max_new_tokens=40))
            answers[routed].append((chat.last_stats.variant, answer, np.stack(chat.last_logits),
                                    chat.last_stats.recomputed))
    assert [a[0] for a in answers[False]] == [MODE_DECODERS[mode] for mode in modes]
    assert any(a[3] for a in answers[False][:3])  # the text decoder crossed the LongRoPE switch
    for (_, text, logits, _), (_, want_text, want, _) in zip(answers[False], answers[True]):
        assert text == want_text
        np.testing.assert_array_equal(logits, want)


@NEEDS_LIBRARY
def test_a_package_named_by_a_relative_path_loads(tiny_int4_package, monkeypatch):
    """The model is created with the library's folder as the current directory (kernel_library.loading): a package
    named relative to the caller's folder loads all the same."""
    monkeypatch.chdir(tiny_int4_package.parent)
    package = Package(tiny_int4_package.name)
    assert package.kernel_library is not None
    assert package.load(package.main_decoder).model is not None


@NEEDS_LIBRARY
def test_every_matmul_nbits_runs_on_the_library(tiny_int4_package):
    """A fresh process loads the package through Chat; the library names each MatMulNBits kernel it makes."""
    script = f"from builder_plugin.runtime import Chat; Chat({str(tiny_int4_package)!r}).load('phi-4-mm-text.onnx')"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "BUILDER_PLUGIN_OPS_TRACE": "1"})
    assert result.returncode == 0, result.stderr
    made = [line for line in result.stderr.splitlines() if line.startswith("builder_plugin ops: MatMulNBits")]
    assert len(made) > 10 and all("accuracy_level=4" in line for line in made)


@pytest.mark.skipif(kernels.attention() == "",
                    reason="the prompt's attention runs on the library where the CPU has bf16")
def test_a_prompts_attention_runs_on_the_tiles(tiny_int4_package):
    """A fresh process asks through Chat: each decoder layer's first prompt (past 16 tokens) runs on the library's
    tiles, not silently through onnxruntime's kernel (the decoder's rotary covers 3/4 of each head)."""
    script = (f"from builder_plugin.runtime import Chat, Sampling\n"
              f"chat = Chat({str(tiny_int4_package)!r})\n"
              f"for _ in chat.ask('one two three four five six seven eight nine ten eleven twelve', [], [], "
              f"max_new_tokens=2, sampling=Sampling()):\n    pass\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "BUILDER_PLUGIN_OPS_TRACE": "1"})
    assert result.returncode == 0, result.stderr
    told = [line for line in result.stderr.splitlines() if "a prompt of" in line]
    layers = [line for line in told if "/attn/GroupQueryAttention" in line]
    assert len(layers) == 2 and all(f"on the {kernels.attention()} path" in line for line in layers), told
