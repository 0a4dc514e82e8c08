"""The layer-by-layer reference (verify's yardstick) against the whole-model `Reference`: teacher-forced over the
tokens a package generated, the same logits at every position, in both checkpoint layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builder_plugin.reference.features import encode_inputs
from builder_plugin.reference.model import Reference
from builder_plugin.reference.streaming import StreamingReference, TeacherForced
from builder_plugin.verify.engine import run_package
from builder_plugin.verify.modes import VERIFY_MODES
from builder_plugin.verify.prompts import build_cases

NEW_TOKENS = 8
STREAMING_RTOL = 1e-5  # of the logit scale; measured ~3e-6 (teacher-forced vs KV-cached summation order)


@pytest.mark.parametrize("layout", ["original", "native"])
def test_streaming_reference_equals_whole_model_reference(request, tmp_path, layout):
    """Teacher-forced over the tokens the package generated, the layer-by-layer reference gives the logits of the
    KV-cached whole-model Reference (same LoRA and projection per mode) at every position."""
    suffix = "" if layout == "original" else "_native"
    package = request.getfixturevalue(f"tiny{suffix}_package")
    checkpoint = request.getfixturevalue(f"tiny{suffix}_checkpoint")
    whole: Reference = request.getfixturevalue("reference" if layout == "original" else "native_reference")
    runs = run_package(str(package), build_cases(VERIFY_MODES, tmp_path), NEW_TOKENS)
    sequences = [TeacherForced(run.inputs, run.tokens) for run in runs]
    streamed = StreamingReference(checkpoint).logits(sequences)
    extend = whole.model.model.embed_tokens_extend
    for run, sequence, got in zip(runs, sequences, streamed):
        ids, image, audio, projection = encode_inputs(extend.image_embed, extend.audio_embed, whole.config, run.inputs)
        assert projection == sequence.projection
        lora = Reference.lora_for_mode(Reference.mode_for(image is not None, audio is not None))
        assert lora == sequence.lora
        want = torch.stack(whole.decode_logits(whole.embeddings(ids, image, audio), run.tokens[:-1], lora)).numpy()
        assert got.shape == want.shape == (len(run.tokens), whole.config.vocab_size)
        worst, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
        assert worst <= STREAMING_RTOL * scale, f"{run.case.name}: {worst:.2e} (logit scale {scale:.1f})"
