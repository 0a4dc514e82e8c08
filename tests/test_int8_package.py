"""-p int8 end to end: the CLI builds an all-int8 package (MatMulNBits bits 8, the embedding's GatherBlockQuantized
reading the 8-bit lm_head), onnxruntime-genai loads it and generates, close to the fp32 package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime_genai as og

from builder_plugin import cli
from builder_plugin.layout import GRAPH_FILES, MAIN_DECODER, Component

PROMPT = "<|user|>Describe what you get, in detail.<|end|><|assistant|>"
NEW_TOKENS = 8


def _first_logits_and_tokens(package: Path) -> tuple[np.ndarray, list[int]]:
    model = og.Model(str(package))  # the routed decoder: a text prompt runs without LoRA
    ids = og.Tokenizer(model).encode(PROMPT)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + NEW_TOKENS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    logits = np.array(generator.get_output("logits"), dtype=np.float32).reshape(-1)
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return logits, tokens


def test_int8_package_loads_and_generates(tmp_path: Path, tiny_checkpoint: Path, tiny_package: Path) -> None:
    out = tmp_path / "int8"
    assert cli.main(["-i", str(tiny_checkpoint), "-o", str(out), "-p", "int8", "--no-progress"]) == 0
    for name in (MAIN_DECODER, GRAPH_FILES[Component.VISION], GRAPH_FILES[Component.SPEECH]):
        nodes = [n for n in onnx.load(str(out / name), load_external_data=False).graph.node
                 if n.op_type == "MatMulNBits"]
        assert nodes and {a.i for n in nodes for a in n.attribute if a.name == "bits"} == {8}, name
    lookup = [n for n in onnx.load(str(out / GRAPH_FILES[Component.EMBEDDING])).graph.node
              if n.op_type == "GatherBlockQuantized"]
    assert [a.i for a in lookup[0].attribute if a.name == "bits"] == [8]

    logits, tokens = _first_logits_and_tokens(out)
    want, _ = _first_logits_and_tokens(tiny_package)
    assert len(tokens) == NEW_TOKENS and logits.shape == want.shape
    cosine = float(logits @ want / np.linalg.norm(logits) / np.linalg.norm(want))
    print(f"int8 vs fp32 first-step logits cosine {cosine:.5f}")
    assert cosine > 0.99  # 8-bit blocks on random weights; a wiring error gives ~0
