"""Decode speed with the kernel library against onnxruntime's own kernels, in pairs: one process loads the package
twice (`og_model(kernels=True)` and `og_model(kernels=False)`, each as Chat loads it), prefills the same prompt into a
generator of each, then decodes in blocks that take turns (the order swapped every round), so that the machine's
memory bandwidth, which moves from minute to minute on a shared host, moves under both alike. Per mode: a text
prompt (no LoRA), and a question about a generated 448x448 photo (the vision LoRA in every step). `--against copy`
(or `huge-pages`) pairs the library as it loads by default with itself reading a copy of its weights
(BUILDER_PLUGIN_OPS_WEIGHTS) instead of with onnxruntime's kernels. `--against split --split-package SPLIT` pairs the
package's self-routing decoder with the decoder a `--lora split` build of the same checkpoint has for the mode (no `If`
nodes: the cost of routing), both with the library as it loads by default. `--against routed` pairs the decoder Chat
answers the mode with (a routed CPU package's decoder for that mode, without the routing's `If` nodes) with the
package's routed decoder, which a plain onnxruntime-genai app runs, both with the library.

    python -m benchmarks.bench_decode_pairs PKG [--modes text,image] [--rounds 64] [--steps 4] [--prompt-tokens 512]
    python -m benchmarks.bench_decode_pairs PKG --against split --split-package SPLIT_PKG
    python -m benchmarks.bench_decode_pairs PKG --against routed
    python -m benchmarks.bench_decode_pairs --from-json benchmarks/results/decode_pairs.json   # redo the report

Reported per mode: each setting's tokens/s over the blocks (best / median), and the ratio library / the other of every
round's two blocks: the median, its quartiles, and a 95 % interval of the median (bootstrap over the rounds,
seeded), which is what "within 3 %" is read from. Greedy, min_length holding off the end of the answer,
so every block decodes its full count. Results: benchmarks/results/decode_pairs.json and the "Decode in pairs"
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_report_options,
    fmt,
    machine_markdown,
    make_media,
    markdown_table,
    measure_or_replay,
    names_from,
    per_machine_class,
)
from builder_plugin.kernels import level as library_level

HEADING = "## Decode in pairs"
BOOTSTRAP = 2000  # resamples of the rounds for the interval of the median ratio
IMAGE_SIZE = (448, 448)  # the global view and one crop
ROUTED = "routed"
# what the library is paired with: name -> (the library registered, BUILDER_PLUGIN_OPS_WEIGHTS while it loads); split
# reads the decoders of --split-package, ROUTED the package's routed decoder
AGAINST = {"onnxruntime": (False, None), "copy": (True, "copy"), "huge-pages": (True, "huge-pages"),
           "split": (True, None), ROUTED: (True, None)}
LIBRARY = (True, None)  # as it loads by default
WEIGHTS = "BUILDER_PLUGIN_OPS_WEIGHTS"
MODES = ("text", "image")
IMAGE_PROMPT = "<|user|><|image_1|>Describe the picture in detail.<|end|><|assistant|>"
STORY = ("The lighthouse keeper counted the ships that passed in the storm and wrote each name she could read into "
         "a small blue book, with the hour, the wind and the colour of the sea. ")


class Decoding:
    """One setting's model (the package's decoder for the mode, as Chat loads it) and generator, prefilled, decoding
    in timed blocks."""

    def __init__(self, package: Path, setting: tuple[bool, str | None], mode: str, prompt_tokens: int, steps: int,
                 photo: Path, routed: bool = False) -> None:
        import onnxruntime_genai as og

        from builder_plugin.runtime.package import Package

        kernels, weights = setting
        before = os.environ.get(WEIGHTS)
        if weights is not None:
            os.environ[WEIGHTS] = weights  # read by the library's kernels as the sessions make them
        try:
            loader = Package(package, kernels=kernels)
            self.decoder = loader.main_decoder if routed else loader.variant_for(mode == "image", False)
            self.model = loader.load(self.decoder).model
        finally:
            os.environ.pop(WEIGHTS, None)
            if before is not None:
                os.environ[WEIGHTS] = before
        params = og.GeneratorParams(self.model)
        if mode == "image":  # the project's own generated PNG: no client bytes reach og's decoder
            inputs = self.model.create_multimodal_processor()(IMAGE_PROMPT, images=og.Images.open(str(photo)))
            self.prompt_tokens = int(inputs["input_ids"].as_numpy().shape[-1])
        else:
            tokenizer = og.Tokenizer(self.model)
            ids = list(tokenizer.encode(STORY * (prompt_tokens // 8)))[:prompt_tokens - 8]
            ids = list(tokenizer.encode("<|user|>\n")) + ids + list(tokenizer.encode("<|end|><|assistant|>"))
            self.prompt_tokens = len(ids)
        total = self.prompt_tokens + steps + 1
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        self.generator = og.Generator(self.model, params)
        started = time.perf_counter()
        if mode == "image":
            self.generator.set_inputs(inputs)
        else:
            self.generator.append_tokens(ids)
        self.generator.generate_next_token()
        self.prefill_s = time.perf_counter() - started

    def block(self, steps: int) -> float:
        """Tokens per second over `steps` decode steps."""
        started = time.perf_counter()
        for _ in range(steps):
            self.generator.generate_next_token()
        return steps / (time.perf_counter() - started)


def pairs(args: argparse.Namespace, mode: str, photo: Path) -> dict[str, Any]:
    """One mode: both settings' decodings, then the blocks in turn."""
    total_steps = (args.rounds + 1) * args.steps
    settings = {"library": LIBRARY, args.against: AGAINST[args.against]}
    packages = {"library": args.package, args.against: args.split_package or args.package}
    decodings = {}
    for name, setting in settings.items():
        decodings[name] = Decoding(packages[name], setting, mode, args.prompt_tokens, total_steps, photo,
                                   routed=name == ROUTED)
        print(f"{mode}, {name} ({decodings[name].decoder}): loaded and prefilled {decodings[name].prompt_tokens} "
              f"tokens in {decodings[name].prefill_s:.1f} s", file=sys.stderr, flush=True)
    for decoding in decodings.values():  # one untimed block each: first-step allocations
        decoding.block(args.steps)
    blocks: dict[str, list[float]] = {name: [] for name in settings}
    for round_index in range(args.rounds):
        order = list(settings) if round_index % 2 == 0 else list(settings)[::-1]
        for name in order:
            blocks[name].append(decodings[name].block(args.steps))
        print(f"{mode}, round {round_index + 1}: " + ", ".join(f"{n} {blocks[n][-1]:.2f}" for n in settings) +
              " tok/s", file=sys.stderr, flush=True)
    return {"prompt_tokens": decodings["library"].prompt_tokens, "tokens_per_s": blocks,
            "decoders": {name: decoding.decoder for name, decoding in decodings.items()}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-decode-pairs-") as folder:
        photo = make_media(Path(folder), IMAGE_SIZE, 1.0) / "photo.png"
        modes = {mode: pairs(args, mode, photo) for mode in args.modes}
    return {"package": str(args.package), "split_package": str(args.split_package or ""),
            "library_level": library_level(), "against": args.against,
            "rounds": args.rounds, "steps": args.steps, "modes": modes}


def _ratios(blocks: dict[str, list[float]], against: str) -> str:
    """The per-round ratio library / `against`: median, bootstrap interval of the median, quartiles, range."""
    ratios = [lib / other for lib, other in zip(blocks["library"], blocks[against])]
    low, median, high = statistics.quantiles(ratios, n=4)
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP))
    interval = (medians[int(0.025 * BOOTSTRAP)], medians[int(0.975 * BOOTSTRAP) - 1])
    return (f"median **{median:.3f}**, 95 % interval of the median {interval[0]:.3f}-{interval[1]:.3f} (bootstrap "
            f"over the rounds); quartiles {low:.3f}-{high:.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")


def report(results: dict[str, Any]) -> str:
    against = results.get("against", "onnxruntime")
    split = Path(results.get("split_package") or "").name
    pair = {"onnxruntime": "loaded twice in one process (the kernel library; onnxruntime's own kernels)",
            "split": f"and `{split}` (a `--lora split` build: its decoder for the mode, no If nodes) loaded in one "
                     "process, both with the kernel library as it loads by default",
            ROUTED: "loaded twice in one process, both with the kernel library as it loads by default: the decoder "
                    "Chat answers the mode with (its decoder for that mode, without the routing's `If` nodes) and the "
                    "routed decoder genai_config.json names"}.get(
        against, f"loaded twice in one process (the kernel library as it loads by default; the library with "
                 f"{WEIGHTS}={against})")
    first = {"split": "Routed", ROUTED: "Chat's decoder"}.get(against, "Library")
    rows = []
    for mode, found in results["modes"].items():
        for name, values in found["tokens_per_s"].items():
            decoder = found.get("decoders", {}).get(name)
            label = {"split": "routed" if name == "library" else name,
                     ROUTED: f"`{decoder}`" if decoder else name}.get(against, name)
            rows.append([mode, found["prompt_tokens"], label,
                         f"{fmt(max(values), 2)} / {fmt(statistics.median(values), 2)}",
                         f"{fmt(min(values), 2)}-{fmt(max(values), 2)}"])
    return "\n".join([
        *([results["note"], ""] if results.get("note") else []),
        f"`{results['command']}` at {results['git']['commit'][:10]}: `{Path(results['package']).name}` {pair}, per "
        "mode the same prompt prefilled into "
        f"each (text: the story; image: a 448x448 photo and a question), then {results['rounds']} rounds of "
        f"{results['steps']} greedy decode steps per setting, taking turns (the order swapped every round).", "",
        markdown_table(["mode", "prompt tokens", "decoder" if against in ("split", ROUTED) else "kernels",
                        "decode tok/s, best / median", "range"], rows), "",
        *(f"{first} / {against} per round, {mode}: {_ratios(found['tokens_per_s'], against)}.\n"
          for mode, found in results["modes"].items()),
        machine_markdown(results["machine"]), ""])


def heading(results: dict[str, Any]) -> str:
    """The section: one per machine class and per setting the library is paired with."""
    against = results.get("against", "onnxruntime")
    name = {"onnxruntime": HEADING, "split": f"{HEADING}, routed against split",
            ROUTED: f"{HEADING}, Chat's decoders against the routed one"}.get(
        against, f"{HEADING}, the library against {against}")
    return per_machine_class(name)(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", type=Path)
    parser.add_argument("--modes", type=names_from(MODES, "mode"), default=list(MODES),
                        help=f"from: {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4,
                        help="decode steps per block (short blocks: both of a pair see the same bandwidth)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--against", choices=list(AGAINST), default="onnxruntime",
                        help="what the library, as it loads by default, is paired with")
    parser.add_argument("--split-package", type=Path, help="with --against split: a --lora split build")
    add_report_options(parser, "decode_pairs.json")
    args = parser.parse_args(argv)
    if args.out == parser.get_default("out") and args.against != "onnxruntime":  # each pairing has a file of its own
        args.out = args.out.with_name(f"decode_pairs_{args.against}.json")
    if not args.from_json and args.package is None:
        parser.error("give the package folder (or --from-json)")
    if not args.from_json and (args.against == "split") != (args.split_package is not None):
        parser.error("--against split and --split-package go together")
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    return measure_or_replay(args, argv, "bench_decode_pairs.py", heading, run, report)



if __name__ == "__main__":
    sys.exit(main())
