"""The package end to end: a tiny generated checkpoint built by the command line (fp32, cpu), run by
onnxruntime-genai's og.Generator for every input mode, against the PyTorch reference (transformers' native model with
the LoRA and audio projection of the mode), fed the very same processor tensors.

For each mode: the decoder the runtime picks (the one self-routing decoder), the first-step logits (prefill, last
position) and >= 16 greedy tokens. A token may differ only where the reference's top-2 logits are a near-tie; the
sequences may then legitimately diverge, so the comparison stops there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
import pytest

from builder_plugin.layout import INPUT_IDS, MAIN_DECODER
from builder_plugin.reference.model import GreedyResult, Reference
from builder_plugin.runtime import Chat, Generation, Turn, build_prompt, open_audio, open_image

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 16
NEAR_TIE = 1e-3  # top-1 minus top-2 reference logit below which fp32 rounding may flip the argmax
LOGITS_ATOL = 1e-3
QUESTION = "Describe what you get, in detail."

# case -> (images, audios), files of the `media_dir` fixture
CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "text": ((), ()),
    "one_image": (("wide.jpg",), ()),
    "two_images": (("square.png", "tall.png"), ()),
    "audio_16k": ((), ("clip_2s.wav",)),
    "audio_8k": ((), ("clip_2s_8k.wav",)),
    "audio_45s": ((), ("clip_45s.wav",)),
    "image_audio": (("square.png",), ("clip_2s.wav",)),
}
NATIVE_CASES = ("text", "one_image", "audio_16k", "image_audio")


def build_with_cli(checkpoint: Path, output: Path) -> Path:
    """`python -m builder_plugin -i CHECKPOINT -o OUTPUT -p fp32 -e cpu`, as a user runs it."""
    result = subprocess.run(
        [sys.executable, "-m", "builder_plugin", "-i", str(checkpoint), "-o", str(output), "-p", "fp32",
         "-e", "cpu", "--no-progress"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr
    assert f"package ready: {output}" in result.stdout, result.stdout
    return output


@pytest.fixture(scope="module")
def original_chat(tmp_path_factory, tiny_checkpoint) -> Chat:
    """A Chat on the CLI-built package: one og.Model answers every input mode."""
    return Chat(build_with_cli(tiny_checkpoint, tmp_path_factory.mktemp("e2e") / "tiny-fp32-cpu"))


@pytest.fixture(scope="module")
def native_chat(tmp_path_factory, tiny_native_checkpoint) -> Chat:
    return Chat(build_with_cli(tiny_native_checkpoint, tmp_path_factory.mktemp("e2e") / "tiny-native-fp32-cpu"))


REFERENCE_FIXTURE = {"original": "reference", "native": "native_reference"}


def first_step_logits(chat: Chat, generation: Generation) -> np.ndarray:
    """The og decoder's prefill logits at the last prompt position, from the Chat's own og.Model of the variant and
    the processor tensors of `generation`."""
    model = chat.model(generation.variant)  # the Chat caches one og.Model per variant; reuse it
    inputs = og.NamedTensors()
    for name, array in generation.inputs.items():
        inputs[name] = og.Tensor(np.ascontiguousarray(array))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=generation.inputs[INPUT_IDS].shape[-1] + 1)
    generator = og.Generator(model, params)
    try:
        generator.set_inputs(inputs)  # runs the encoders, the embedding and the decoder prefill
        logits = generator.get_logits()  # [1, 1, vocab]: the last position
    finally:
        del generator
    assert logits.shape[:2] == (1, 1), logits.shape
    return logits[0, -1].astype(np.float32)


def compared_prefix(got: list[int], expected: GreedyResult) -> int:
    """How many tokens agree before the first near-tie divergence; fails on a divergence that is not a near-tie."""
    for step, (token, want) in enumerate(zip(got, expected.tokens)):
        if token != want:
            gap = expected.top2_gap[step]
            assert gap < NEAR_TIE, (
                f"step {step}: og.Generator chose {token}, the reference {want} (top-2 gap {gap:.2e}, not a tie); "
                f"og {got}, reference {expected.tokens}"
            )
            return step
    return min(len(got), len(expected.tokens))


@pytest.mark.parametrize(
    ("layout", "case"),
    [("original", case) for case in CASES] + [("native", case) for case in NATIVE_CASES],
)
def test_generator_matches_reference(request, media_dir, layout, case):
    chat: Chat = request.getfixturevalue(f"{layout}_chat")
    reference: Reference = request.getfixturevalue(REFERENCE_FIXTURE[layout])
    images = [media_dir / name for name in CASES[case][0]]
    audios = [media_dir / name for name in CASES[case][1]]
    prompt = build_prompt([Turn(QUESTION, tuple(map(open_image, images)), tuple(map(open_audio, audios)))])
    generation = chat.generate(prompt, images, audios, max_new_tokens=NEW_TOKENS)

    # The processor saw every file, and the one decoder answered (its LoRA follows the mode: checked below).
    inputs = generation.inputs
    assert inputs[INPUT_IDS].shape[0] == 1
    assert (inputs["pixel_values"].shape[0] if "pixel_values" in inputs else 0) == len(images)
    assert (inputs["audio_embeds"].shape[0] if "audio_embeds" in inputs else 0) == len(audios)
    mode = Reference.mode_for(bool(images), bool(audios))
    assert generation.variant == MAIN_DECODER and chat.manifest.routing == "self"
    assert len(generation.tokens) == NEW_TOKENS

    expected = reference.prefill_and_greedy(inputs, max_new_tokens=NEW_TOKENS)
    assert expected.lora == Reference.lora_for_mode(mode)
    assert expected.projection == (("vision" if images else "speech") if audios else None)

    got_logits = first_step_logits(chat, generation)
    want_logits = expected.step_logits[0].numpy()
    assert got_logits.shape == want_logits.shape
    worst = float(np.abs(got_logits - want_logits).max())
    scale = float(np.abs(want_logits).max())
    assert worst <= LOGITS_ATOL, f"first-step logits differ by up to {worst:.2e} (largest logit {scale:.2f})"

    agreed = compared_prefix(generation.tokens, expected)
    assert generation.tokens[:agreed] == expected.tokens[:agreed]
