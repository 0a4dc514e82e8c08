"""Run by test_cpu_without_avx512 (natively, and under `qemu-x86_64 -cpu Haswell`): a package loaded as the run-time
helper loads it (og_model: the kernel library where this CPU has a fast path), a text prompt of 30-odd tokens (the
prefill: a kernel's many-rows path) and then one-row steps on fixed tokens; prints a JSON line with the library's
level and each position's logits."""

from __future__ import annotations

import json
import sys

import numpy as np

PROMPT = "<|user|>Write a short story about a lighthouse keeper and a storm at sea.<|end|><|assistant|>"
FORCED = (300, 301, 302, 303)  # the decode steps' tokens: the same in every run, whatever its logits


def main(package: str) -> None:
    import onnxruntime_genai as og

    from builder_plugin import kernels
    from builder_plugin.layout import LOGITS
    from builder_plugin.runtime import og_model

    model = og_model(package)
    ids = np.array(og.Tokenizer(model).encode(PROMPT), dtype=np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + len(FORCED) + 1, do_sample=False)
    generator = og.Generator(model, params)
    logits = []
    for tokens in (ids, *([t] for t in FORCED)):
        generator.append_tokens(np.array(tokens, dtype=np.int32))
        logits.append(np.array(generator.get_output(LOGITS), dtype=np.float32).reshape(-1).tolist())
    print(json.dumps({"level": kernels.level(), "prompt_tokens": len(ids), "logits": logits}))


if __name__ == "__main__":
    main(sys.argv[1])
