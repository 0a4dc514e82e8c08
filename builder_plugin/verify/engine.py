"""The package side: each case run through onnxruntime-genai as an app runs it (the decoder variant the run-time
helper picks for the mode, and on a self-routing package the routed decoder too; the model's own multimodal
processor, greedy og.Generator), keeping the processor tensors, the generated tokens and the last-position logits of
every step."""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime_genai as og

from builder_plugin import kernels
from builder_plugin.layout import INPUT_IDS, LOGITS
from builder_plugin.runtime import Chat, Package, og_audios, og_images
from builder_plugin.runtime.errors import first_line
from builder_plugin.verify.prompts import Case


class EngineError(RuntimeError):
    """The package failed on a case."""


@dataclass
class PackageRun:
    case: Case
    variant: str  # decoder file that answered
    inputs: dict[str, np.ndarray]  # processor tensors, as the reference must see them
    tokens: list[int]  # generated ids, eos included when one was produced
    logits: np.ndarray  # [len(tokens), vocab] fp32: the logits each token was chosen from

    @property
    def prompt_length(self) -> int:
        return int(self.inputs[INPUT_IDS].shape[-1])


def matmul_kernel(package: str) -> str:
    """The MatMulNBits kernel the package's sessions run on in this process, as the run-time helper chooses it for any
    app (builder_plugin.runtime.kernel_library): the library with its paths (few rows / many rows), or onnxruntime's."""
    if Package(package).kernel_library is None:
        return "onnxruntime's own kernel"
    return f"the builder_plugin library ({kernels.paths()})"


def assignments(package: str, cases: Sequence[Case]) -> dict[str, list[int]]:
    """{decoder file: the indices of the cases it runs}: each case on the variant the run-time helper picks for its
    mode, and on a self-routing package also on the routed decoder, which a plain onnxruntime-genai app runs for every
    mode (where the helper answers a mode with that mode's decoder, both are checked)."""
    opened = Package(package)
    by_variant: dict[str, list[int]] = {}
    for index, case in enumerate(cases):
        for variant in opened.decoders_for(bool(case.images), bool(case.audios)):
            by_variant.setdefault(variant, []).append(index)
    return by_variant


def run_package(package: str, cases: Sequence[Case], max_new_tokens: int,
                on_step: Callable[[], None] = lambda: None,
                assigned: Mapping[str, Sequence[int]] | None = None) -> list[PackageRun]:
    """Run every case on the decoders `assigned` (default: `assignments`) gives it; one og.Model is loaded per
    decoder variant and released before the next variant loads (each model holds its own encoder sessions, so
    keeping several would add up)."""
    runs: list[tuple[int, PackageRun]] = []
    for variant, indices in (assigned or assignments(package, cases)).items():
        chat = Chat(package)
        model = chat.model(variant)
        processor = model.create_multimodal_processor()
        eos = {int(t) for t in og.Tokenizer(model).eos_token_ids}
        for index in indices:
            runs.append((index, _generate(model, processor, eos, cases[index], variant, max_new_tokens, on_step)))
        del processor, model, chat
        gc.collect()
    return [run for _, run in sorted(runs, key=lambda item: item[0])]  # in the cases' order


def _generate(model, processor, eos: set[int], case: Case, variant: str, max_new_tokens: int,
              on_step: Callable[[], None]) -> PackageRun:
    try:
        inputs = processor(case.prompt, images=og_images(case.images), audios=og_audios(case.audios))
    except RuntimeError as exc:
        files = ", ".join(media.source for media in (*case.images, *case.audios))
        raise EngineError(f"{case.name} ({files or 'no media'}): the package's processor rejected the inputs: "
                          f"{first_line(exc)}") from exc
    arrays = {name: np.array(inputs[name].as_numpy()) for name in inputs.keys()}
    prompt_length = int(arrays[INPUT_IDS].shape[-1])
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt_length + max_new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    tokens, logits = [], []
    try:
        generator.set_inputs(inputs)
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            # [1, 1, vocab]: the decoder's lm_head covers the last position only
            logits.append(np.array(generator.get_output(LOGITS), dtype=np.float32).reshape(-1))
            on_step()
            if tokens[-1] in eos:
                break
    except RuntimeError as exc:
        raise EngineError(f"{case.name}: the package failed ({variant}): {first_line(exc)}") from exc
    finally:
        del generator
    return PackageRun(case, variant, arrays, tokens, np.stack(logits))
