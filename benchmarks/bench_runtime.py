"""Run-time speed of built phi4mm packages on CPU: onnxruntime-genai fp32 and int4 against transformers' native
Phi4MultimodalForCausalLM in PyTorch (eager, fp32), same weights, same prompts, same number of tokens.

    python benchmarks/bench_runtime.py [--checkpoint DIR] [--text-layers 8] [--scaling-layers 2] [--rounds 3]
                                       [--full-depth-package DIR]
                                       [--new-tokens 16] [--repeats 3] [--budget 30] [--threads 2]
                                       [--out benchmarks/results/runtime.json] [--doc docs/benchmarks.md]
    python benchmarks/bench_runtime.py --from-json benchmarks/results/runtime.json   # re-analyse, re-publish

Model: a FULL-WIDTH generated checkpoint (real Phi-4-multimodal widths and vocabulary, random weights) with
--text-layers decoder layers (the real model has 32), 4 SigLIP layers (27) and 4 conformer blocks (24), unless
--checkpoint is given. A second checkpoint that differs only in having --scaling-layers decoder layers splits the text
prompt's times into a fixed and a per-decoder-layer part (see "32-layer estimate"). Checkpoints and the fp32 and int4
CPU packages (``lora="split"``: one decoder file per input mode, each timed on its own) are built once into --work
and reused while their recipe and the builder's sources are unchanged (``--keep-packages``: whatever the sources);
building is not part of the measured run (``--setup-only`` does just that part).

Prompts (through onnxruntime-genai's real MultiModalProcessor; the PyTorch side gets the processor's tensors):
``text`` (~100 tokens, base decoder), ``image-1crop`` (448x448: global view + 1 crop, vision-LoRA decoder),
``image-4crops`` (896x896: global + 4 crops) and ``audio-10s`` (10 s clip, speech-LoRA decoder). Greedy; the
end-of-sequence tokens are masked (``min_length``) so every run makes the requested number of tokens. Each engine
runs in its own subprocess (its own memory and peak RSS); each decoder variant gets an untimed warm-up on a short
text prompt after loading.

What is timed:
- prefill: processor tensors -> first new token (vision/speech encoders, embedding, decoder over the prompt, greedy
  pick); the processor itself (image/audio decoding, features) is kept separately in the JSON. Up to --repeats runs
  per prompt, fewer once the prompt's prefills took --budget seconds; best and median reported.
- decode: in the first run, each later ``generate_next_token`` (embedding + decoder step + pick) is timed on its own:
  tokens/s = 1 / median step ("median") and 1 / fastest step ("best"); the mean rate is in the JSON.
- PyTorch: ``Reference`` (builder_plugin.testing.reference) with the input mode's LoRA merged into the weights (done
  before timing, like loading a decoder variant); prefill = image/audio features + embeddings + a KV-cached forward
  computing the last position's logits only; decode = one-token cached steps.
- ``*-lastlogits``: when the built decoders emit logits for every prompt position ([B, S, vocab]), the same
  packages with the decoder graph changed to emit the last position's only ([B, 1, vocab], which onnxruntime-genai
  accepts), prefill only, for --last-logits-prompts. Skipped when the built decoders are pruned already.
- encoders alone for --encoder-prompts: the vision / speech ONNX graph of the fp32 and the int4 package (plain
  onnxruntime sessions) and the PyTorch feature code, on the same processor tensors, run in turn in one process.

Memory-bandwidth bound for decode: bytes of the weights every decode step reads (initializers of every MatMul /
MatMulNBits of the decoder variant: all layers, LoRA branches, lm_head; int4 = packed weights + scales + zero points)
against the copy bandwidth of a ~1 GB numpy array (best of several, 1 and --threads threads) -> tokens/s bound.

32-layer estimate: time(L) = fixed + L x per_layer, solved from the text prompt at --text-layers and
--scaling-layers: from the fastest step and prefill at each depth ("best"), and from each depth's lowest per-round
median step and prefill ("median"; background load only adds time). The text prompt runs in --rounds rounds, each
engine at both depths back to back. A per-layer decode time that implies more than PLAUSIBLE_BANDWIDTH_FACTOR x the
read bandwidth is noise and not used. Every prompt's measured time then gets (32 - L) x per_layer added, scaled by its
prompt length (prefill) and by its decoder variant's per-layer weight bytes relative to the base decoder (LoRA
branches). The encoders are not scaled (see bench_vision.py / bench_speech.py). The bytes-per-step bound is
extrapolated from the graph: fixed bytes + 32 x the bytes of one layer.

--full-depth-package: the text prompt also runs on a package of the real depth (an int4 build of the `full`
checkpoint fits; PyTorch fp32 at 32 layers does not), measured against the estimate and the bandwidth bound.

Results: --out (JSON), a Markdown table on stdout and the "Machine" and "Run time" sections of --doc.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import (  # noqa: E402
    GB,
    cpu_session,
    fmt,
    machine_info,
    machine_markdown,
    markdown_table,
    memcpy_bandwidth,
    peak_rss_bytes,
    read_bandwidth,
    replace_markdown_section,
    reset_peak_rss,
    summarize,
    time_in_turn,
    write_json,
)

RESULTS = ROOT / "benchmarks" / "results" / "runtime.json"
DOC = ROOT / "docs" / "benchmarks.md"
DEFAULT_WORK = Path("/tmp/bench_runtime")
REAL_TEXT_LAYERS = 32
# A per-layer decode time implying more than this multiple of the numpy read bandwidth is taken as noise: onnxruntime's
# fp32 single-row MatMul has been seen reading up to ~1.3x as fast as the numpy probe, and a faster implied layer means
# the run at the smaller depth was slowed down by background load.
PLAUSIBLE_BANDWIDTH_FACTOR = 1.5
VISION_LAYERS = 4
AUDIO_BLOCKS = 4
TEXT_PROMPT_TOKENS = 100
BACKENDS = ("ort-fp32", "ort-int4", "torch-fp32")
PROMPT_NAMES = ("text", "image-1crop", "image-4crops", "audio-10s")
PRECISIONS = ("fp32", "int4")
# Decoder files of a split package (builder_plugin.runtime.manifest.SPLIT_DECODERS) by input mode.
VARIANT_FILES = {
    "text": "phi-4-mm-text-base.onnx",
    "vision": "phi-4-mm-text.onnx",
    "speech": "phi-4-mm-text-speech.onnx",
}
LAST_LOGITS_SUFFIX = "-lastlogits"

FILLER = ("The quick brown fox jumps over the lazy dog while seven wizards quietly box with jumping frogs near "
          "the old river bank, and every morning the baker counts loaves of warm bread before the market opens. ")


@dataclass(frozen=True)
class Prompt:
    name: str
    mode: str  # text | vision | speech: which decoder variant (LoRA) answers
    text: str
    images: tuple[str, ...] = ()
    audios: tuple[str, ...] = ()


# ---- setup: checkpoints, packages, media, prompts -----------------------------------------------------------------


def _recipe_file(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.recipe.json"


def _cached(folder: Path, recipe: dict[str, Any]) -> bool:
    marker = _recipe_file(folder)
    return folder.is_dir() and marker.is_file() and json.loads(marker.read_text()) == recipe


def _mark(folder: Path, recipe: dict[str, Any]) -> None:
    _recipe_file(folder).write_text(json.dumps(recipe))


def prepare_checkpoint(work: Path, text_layers: int) -> Path:
    from builder_plugin.testing.make_checkpoint import make_checkpoint

    folder = work / f"checkpoint-full-text{text_layers}"
    recipe = {"preset": "full", "seed": 0, "text_layers": text_layers, "vision_layers": VISION_LAYERS,
              "audio_blocks": AUDIO_BLOCKS}
    if not _cached(folder, recipe):
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        make_checkpoint(folder, preset="full", seed=0, text_layers=text_layers, vision_layers=VISION_LAYERS,
                        audio_blocks=AUDIO_BLOCKS)
        _mark(folder, recipe)
        print(f"checkpoint ({text_layers} text layers) written in {time.perf_counter() - start:.0f} s: {folder}",
              flush=True)
    return folder


def builder_fingerprint() -> str:
    """Hash of the builder's sources (builder_plugin without testing/, genai_config): packages built by other code
    are rebuilt."""
    digest = hashlib.sha256()
    files = [p for p in (ROOT / "builder_plugin").rglob("*.py") if "testing" not in p.parts]
    files += list((ROOT / "genai_config").rglob("*.py"))
    for path in sorted(files):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def prepare_package(work: Path, checkpoint: Path, precision: str, fingerprint: str | None
                    ) -> tuple[Path, dict[str, Any]]:
    """Build (in a subprocess, so its memory is returned) or reuse the routed CPU package of `checkpoint`; with a
    `fingerprint` of None an existing package is reused whatever code built it."""
    folder = work / f"package-{checkpoint.name}-{precision}"
    stat = (checkpoint / "config.json").stat()
    recipe = {"checkpoint": str(checkpoint.resolve()), "config_mtime": stat.st_mtime, "precision": precision,
              "lora": "split", "execution_provider": "cpu", "builder": fingerprint}
    marker = _recipe_file(folder)
    if fingerprint is None and folder.is_dir() and marker.is_file():
        recipe["builder"] = json.loads(marker.read_text()).get("builder")
    if _cached(folder, recipe):
        return folder, json.loads((folder.parent / f".{folder.name}.build.json").read_text())
    shutil.rmtree(folder, ignore_errors=True)
    info_file = folder.parent / f".{folder.name}.build.json"
    command = [sys.executable, __file__, "--build-worker", str(checkpoint), str(folder), precision, str(info_file)]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    _mark(folder, recipe)
    info = json.loads(info_file.read_text())
    print(f"{precision} package of {checkpoint.name} built in {time.perf_counter() - start:.0f} s "
          f"(peak RSS {info['peak_rss_bytes'] / GB:.1f} GB)", flush=True)
    return folder, info


def _build_worker(checkpoint: str, output: str, precision: str, info_file: str) -> int:
    from builder_plugin.build import build
    from builder_plugin.options import BuildOptions

    result = build(BuildOptions(model_dir=Path(checkpoint), output_dir=Path(output), precision=precision,
                                lora="split", execution_provider="cpu", overwrite=True), progress=False)
    write_json(info_file, {"seconds": result.seconds, "peak_rss_bytes": peak_rss_bytes(),
                           "total_bytes": result.total_bytes, "files": dict(result.files)})
    return 0


def text_prompt(checkpoint: Path, tokens: int) -> str:
    """A chat prompt of about `tokens` tokens (counted with the checkpoint's tokenizer)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    words = (FILLER * 20).split()
    prompt = ""
    for count in range(1, len(words) + 1):
        prompt = f"<|user|>{' '.join(words[:count])}<|end|><|assistant|>"
        if len(tokenizer.encode(prompt, add_special_tokens=False).ids) >= tokens:
            break
    return prompt


def make_prompts(work: Path, checkpoint: Path, names: list[str]) -> list[Prompt]:
    from builder_plugin.testing.media import make_image, make_wav

    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    image_question = "<|user|><|image_1|>Describe this picture in detail.<|end|><|assistant|>"
    available = {
        "text": lambda: Prompt("text", "text", text_prompt(checkpoint, TEXT_PROMPT_TOKENS)),
        "image-1crop": lambda: Prompt("image-1crop", "vision", image_question,
                                      images=(str(make_image(media / "448x448.png", 448, 448, seed=1)),)),
        "image-4crops": lambda: Prompt("image-4crops", "vision", image_question,
                                       images=(str(make_image(media / "896x896.png", 896, 896, seed=2)),)),
        "audio-10s": lambda: Prompt("audio-10s", "speech",
                                    "<|user|><|audio_1|>Transcribe the audio clip.<|end|><|assistant|>",
                                    audios=(str(make_wav(media / "10s.wav", 10.0, seed=3)),)),
    }
    return [available[name]() for name in names]


# ---- decoder graph analysis and the last-position-logits variant ---------------------------------------------------


_ITEMSIZE = {1: 4, 10: 2, 16: 2, 2: 1, 3: 1, 6: 4, 7: 8, 11: 8}  # onnx TensorProto data types -> bytes


def _tensor_bytes(tensor: Any) -> int:
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    count = 1
    for dim in tensor.dims:
        count *= int(dim)
    if tensor.data_type in (21, 22):  # UINT4 / INT4 are packed two per byte
        return (count + 1) // 2
    return count * _ITEMSIZE.get(tensor.data_type, 4)


def decode_weight_bytes(decoder_path: Path) -> dict[str, Any]:
    """Bytes one decode step reads from MatMul / MatMulNBits / Gemm weights (each initializer counted once), split
    into lm_head, LoRA branches and per-layer totals; "quantized" when any of them is MatMulNBits."""
    import onnx

    model = onnx.load(str(decoder_path), load_external_data=False)
    initializers = {t.name: t for t in model.graph.initializer}
    seen: set[str] = set()
    totals = {"lm_head": 0, "lora": 0, "layers": 0, "other": 0}
    per_layer: dict[int, int] = {}
    quantized = False
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "MatMulNBits", "Gemm"):
            continue
        quantized = quantized or node.op_type == "MatMulNBits"
        for name in node.input[1:]:
            if name not in initializers or name in seen:
                continue
            seen.add(name)
            size = _tensor_bytes(initializers[name])
            if "lm_head" in node.name:
                totals["lm_head"] += size
                continue
            if "lora" in node.name.lower() or "lora" in name.lower():
                totals["lora"] += size
            if "/layers." in node.name:
                layer = int(node.name.split("/layers.")[1].split("/")[0])
                per_layer[layer] = per_layer.get(layer, 0) + size
                if "lora" not in node.name.lower() and "lora" not in name.lower():
                    totals["layers"] += size
            elif "lora" not in node.name.lower() and "lora" not in name.lower():
                totals["other"] += size
    total = totals["lm_head"] + totals["lora"] + totals["layers"] + totals["other"]
    layers = len(per_layer)
    per_layer_mean = sum(per_layer.values()) / layers if layers else 0.0
    fixed = total - sum(per_layer.values())
    return {
        "total_bytes": total,
        **{f"{key}_bytes": value for key, value in totals.items()},
        "layers": layers,
        "quantized": quantized,
        "per_layer_bytes": per_layer_mean,
        "fixed_bytes": fixed,
        f"estimated_total_bytes_{REAL_TEXT_LAYERS}_layers": fixed + REAL_TEXT_LAYERS * per_layer_mean,
    }


def logits_positions(decoder_path: Path) -> int | str:
    """The sequence dimension of the decoder's logits output: 1 when it emits the last position only."""
    import onnx

    model = onnx.load(str(decoder_path), load_external_data=False)
    for output in model.graph.output:
        if output.name == "logits":
            dim = output.type.tensor_type.shape.dim[1]
            return dim.dim_value if dim.HasField("dim_value") else dim.dim_param
    raise ValueError(f"{decoder_path.name} has no logits output")


def write_last_logits_decoder(package: Path, filename: str) -> str:
    """Copy decoder `filename` as ``<stem>-lastlogits.onnx`` whose lm_head reads only the last position (a Slice
    in front of it; logits become [B, 1, vocab]). Same external data file, so nothing large is written."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    target = filename.replace(".onnx", f"{LAST_LOGITS_SUFFIX}.onnx")
    if (package / target).is_file():
        return target
    model = onnx.load(str(package / filename), load_external_data=False)
    graph = model.graph
    if logits_positions(package / filename) == 1:
        raise ValueError(f"{filename} already emits the last position's logits only")
    producer = {out: node for node in graph.node for out in node.output}
    node = producer["logits"]
    while "lm_head" not in node.name:  # walk back from the graph output to the lm_head MatMul(NBits)
        node = producer[node.input[0]]
    hidden = node.input[0]
    last = f"{hidden}/last_position"
    graph.initializer.extend([
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "/bench/last_position/starts"),
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], dtype=np.int64), "/bench/last_position/ends"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "/bench/last_position/axes"),
    ])
    index = list(graph.node).index(node)
    graph.node.insert(index, helper.make_node(
        "Slice", [hidden, "/bench/last_position/starts", "/bench/last_position/ends", "/bench/last_position/axes"],
        [last], name="/bench/last_position/Slice"))
    node.input[0] = last
    for output in graph.output:
        if output.name == "logits":
            dim = output.type.tensor_type.shape.dim[1]
            dim.Clear()
            dim.dim_value = 1
    for info in list(graph.value_info):  # shapes of the lm_head chain are no longer [B, S, ...]
        if "lm_head" in info.name:
            graph.value_info.remove(info)
    onnx.save(model, str(package / target))
    return target


# ---- workers ------------------------------------------------------------------------------------------------------


def _eos_ids(package_or_checkpoint: Path) -> list[int]:
    config = package_or_checkpoint / "genai_config.json"
    if config.is_file():
        ids = json.loads(config.read_text())["model"]["eos_token_id"]
    else:
        ids = json.loads((package_or_checkpoint / "generation_config.json").read_text())["eos_token_id"]
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def _decode_stats(steps: list[float]) -> dict[str, Any]:
    if not steps:
        return {"steps": 0}
    return {
        "steps": len(steps),
        "median_step_s": statistics.median(steps),
        "best_step_s": min(steps),
        "tokens_per_s_median": 1.0 / statistics.median(steps),
        "tokens_per_s_best": 1.0 / min(steps),
        "tokens_per_s_mean": len(steps) / sum(steps),
        "step_s": [round(step, 5) for step in steps],
    }


def _repeat(case: dict[str, Any], run: Any, prefill_times: list[float]) -> None:
    """Call run(first) up to case["repeats"] times: always once, again while the prefills so far took < budget s."""
    for index in range(case["repeats"]):
        if index and sum(prefill_times) >= case["budget_s"]:
            break
        run(index == 0)


WARM_UP_PROMPT = "<|user|>Hello there.<|end|><|assistant|>"


def _ort_worker(job: dict[str, Any]) -> dict[str, Any]:
    import onnxruntime_genai as og

    package = Path(job["package"])
    threads = int(job["threads"])
    eos = _eos_ids(package)
    results: dict[str, Any] = {}
    groups: list[tuple[str, list[dict[str, Any]]]] = []  # consecutive cases with the same decoder share one load
    for case in job["cases"]:
        if not groups or groups[-1][0] != case["decoder"]:
            groups.append((case["decoder"], []))
        groups[-1][1].append(case)
    for decoder, cases in groups:
        gc.collect()
        reset_peak_rss()
        start = time.perf_counter()
        config = og.Config(str(package))
        config.overlay(json.dumps({"model": {"decoder": {
            "filename": decoder,
            "session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        model = og.Model(config)
        processor = model.create_multimodal_processor()
        load_s = time.perf_counter() - start
        # Untimed: page the decoder weights in and size the arenas before the first timed prompt.
        warm_inputs = processor(WARM_UP_PROMPT, images=None, audios=None)
        warm_length = int(warm_inputs["input_ids"].as_numpy().shape[-1]) + 2
        warm_params = og.GeneratorParams(model)
        warm_params.set_search_options(max_length=warm_length, min_length=warm_length, do_sample=False)
        warm_generator = og.Generator(model, warm_params)
        warm_generator.set_inputs(warm_inputs)
        while not warm_generator.is_done():
            warm_generator.generate_next_token()
        del warm_generator, warm_params, warm_inputs
        for case in cases:
            results[case["key"]] = _ort_case(og, model, processor, case, eos, load_s, decoder)
            _progress(job["label"], case["key"], results[case["key"]])
        for case in cases:
            results[case["key"]]["peak_rss_bytes"] = peak_rss_bytes()  # of the whole variant group
        del processor, model, config
    return results


def _ort_case(og: Any, model: Any, processor: Any, case: dict[str, Any], eos: list[int], load_s: float,
              decoder: str) -> dict[str, Any]:
    """One prompt through onnxruntime-genai: up to case["repeats"] prefills, the first run also decoding."""
    images = og.Images.open(*case["images"]) if case["images"] else None
    audios = og.Audios.open(*case["audios"]) if case["audios"] else None
    record: dict[str, Any] = {"preprocess": [], "prefill": [], "steps": [], "tokens": [], "prompt_tokens": 0}

    def run(first: bool) -> None:
        t0 = time.perf_counter()
        inputs = processor(case["text"], images=images, audios=audios)
        t1 = time.perf_counter()
        prompt_tokens = int(inputs["input_ids"].as_numpy().shape[-1])
        total = prompt_tokens + (case["new_tokens"] if first else 1)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        generator = og.Generator(model, params)
        generator.set_inputs(inputs)
        generator.generate_next_token()
        t2 = time.perf_counter()
        while not generator.is_done():
            s = time.perf_counter()
            generator.generate_next_token()
            record["steps"].append(time.perf_counter() - s)
        if first:
            record["tokens"] = [int(t) for t in generator.get_sequence(0)[prompt_tokens:]]
        del generator, params, inputs  # GeneratorParams keeps the model alive
        record["preprocess"].append(t1 - t0)
        record["prefill"].append(t2 - t1)
        record["prompt_tokens"] = prompt_tokens

    _repeat(case, run, record["prefill"])
    return {
        "decoder": decoder,
        "prompt_tokens": record["prompt_tokens"],
        "new_tokens": len(record["tokens"]),
        "tokens": record["tokens"],
        "eos_masked": eos,
        "preprocess_s": summarize(record["preprocess"]),
        "prefill_s": summarize(record["prefill"]),
        "decode": _decode_stats(record["steps"]),
        "model_load_s": load_s,
    }


def _progress(label: str, name: str, result: dict[str, Any]) -> None:
    rate = result["decode"].get("tokens_per_s_median")
    print(f"  {label} {name}: {result['prompt_tokens']} prompt tokens, "
          f"prefill best {result['prefill_s']['best']:.2f} s "
          f"({len(result['prefill_s']['runs'])} runs)" + (f", decode {rate:.2f} tok/s" if rate else ""), flush=True)


def _encoder_ab(case: dict[str, Any], inputs: dict[str, Any], torch_features: Any, threads: int
                ) -> dict[str, Any]:
    """The vision or speech graph of each package (plain onnxruntime sessions) and the PyTorch feature code on the
    same processor tensors, in turn, so background load hits them alike: one untimed warm-up each, then
    case["repeats"] rounds."""
    import numpy as np

    filename = "phi-4-mm-vision.onnx" if case["images"] else "phi-4-mm-speech.onnx"
    runners = {}
    for engine, package in case["encoder_packages"].items():
        session = cpu_session(Path(package) / filename, threads)
        feed = {spec.name: np.asarray(inputs[spec.name]) for spec in session.get_inputs()}
        runners[engine] = lambda session=session, feed=feed: session.run(None, feed)
    runners["torch-fp32"] = torch_features
    times, _ = time_in_turn(runners, case["repeats"])
    return {"graph": filename, **{engine: summarize(values) for engine, values in times.items()}}


def _torch_worker(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    from transformers.cache_utils import DynamicCache

    from builder_plugin.testing.processor import processor_inputs
    from builder_plugin.testing.reference import Reference

    torch.set_num_threads(int(job["threads"]))
    checkpoint = Path(job["checkpoint"])
    eos = _eos_ids(Path(job["package"]))
    reset_peak_rss()
    start = time.perf_counter()
    reference = Reference.load(checkpoint)
    load_s = time.perf_counter() - start
    model = reference.model
    embed_tokens = model.model.embed_tokens
    results: dict[str, Any] = {}

    def step(embeds: torch.Tensor, cache: DynamicCache) -> int:
        logits = model(inputs_embeds=embeds, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        logits[eos] = -float("inf")  # what min_length does on the onnxruntime-genai side
        return int(torch.argmax(logits))

    with torch.inference_mode():  # untimed warm-up, as on the onnxruntime-genai side
        warm_ids = processor_inputs(checkpoint, WARM_UP_PROMPT)["input_ids"]
        warm_cache = DynamicCache(config=reference.config)
        token = step(reference.embeddings(torch.from_numpy(np.asarray(warm_ids, dtype=np.int64))), warm_cache)
        step(embed_tokens(torch.tensor([[token]])), warm_cache)
        del warm_cache

    for case in job["cases"]:
        results[case["key"]] = _torch_case(reference, step, case, checkpoint, int(job["threads"]), eos, load_s)
        _progress(job["label"], case["key"], results[case["key"]])
    for value in results.values():
        value["peak_rss_bytes"] = peak_rss_bytes()
    return results


def _torch_case(reference: Any, step: Any, case: dict[str, Any], checkpoint: Path, threads: int, eos: list[int],
                load_s: float) -> dict[str, Any]:
    """One prompt through the PyTorch reference: up to case["repeats"] prefills, the first run also decoding."""
    import numpy as np
    import torch
    from transformers.cache_utils import DynamicCache

    from builder_plugin.testing.processor import processor_inputs

    embed_tokens = reference.model.model.embed_tokens
    inputs = processor_inputs(checkpoint, case["text"], images=case["images"], audios=case["audios"])
    has_image, has_audio = bool(case["images"]), bool(case["audios"])
    reference.set_lora(reference.lora_for_mode(reference.mode_for(has_image, has_audio)))  # = loading a variant
    ids = torch.from_numpy(np.asarray(inputs["input_ids"], dtype=np.int64))
    record: dict[str, Any] = {"prefill": [], "encoder": [], "steps": [], "tokens": []}

    @torch.inference_mode()
    def features() -> tuple[Any, Any]:
        image_features = audio_features = None
        if has_image:
            image_features = reference.image_features(
                inputs["pixel_values"], inputs["image_attention_mask"], inputs["image_sizes"])
        if has_audio:
            audio_features = reference.audio_features(
                inputs["audio_embeds"], inputs.get("audio_attention_mask"), inputs["audio_sizes"],
                projection="vision" if has_image else "speech")
        return image_features, audio_features

    @torch.inference_mode()
    def run(first: bool) -> None:
        t0 = time.perf_counter()
        image_features, audio_features = features()
        t_features = time.perf_counter()
        embeds = reference.embeddings(ids, image_features, audio_features)
        cache = DynamicCache(config=reference.config)
        token = step(embeds, cache)
        t1 = time.perf_counter()
        tokens = [token]
        for _ in range(case["new_tokens"] - 1 if first else 0):
            s = time.perf_counter()
            token = step(embed_tokens(torch.tensor([[token]])), cache)
            record["steps"].append(time.perf_counter() - s)
            tokens.append(token)
        if first:
            record["tokens"] = tokens
        record["prefill"].append(t1 - t0)
        if has_image or has_audio:
            record["encoder"].append(t_features - t0)

    _repeat(case, run, record["prefill"])
    encoder_ab = _encoder_ab(case, inputs, features, threads) if case["encoders"] else None
    return {
        "encoder_ab": encoder_ab,
        "lora": reference.active_lora,
        "prompt_tokens": int(ids.shape[-1]),
        "new_tokens": len(record["tokens"]),
        "tokens": record["tokens"],
        "eos_masked": eos,
        "prefill_s": summarize(record["prefill"]),
        "decode": _decode_stats(record["steps"]),
        "encoder_s": summarize(record["encoder"]) if record["encoder"] else None,
        "model_load_s": load_s,
    }


def run_worker(job: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run one backend's cases in a fresh process (own memory, own peak RSS)."""
    job_file = work / f"job-{job['label']}.json"
    result_file = work / f"result-{job['label']}.json"
    result_file.unlink(missing_ok=True)
    write_json(job_file, job)
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--worker", str(job_file), str(result_file)], check=True)
    result = json.loads(result_file.read_text())
    print(f"  [{job['label']}: {time.perf_counter() - start:.0f} s]", flush=True)
    return result


def merge_runs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several worker runs of the same prompt (rounds): all prefill runs and decode steps pooled."""
    merged = dict(parts[0])
    for key in ("prefill_s", "preprocess_s", "encoder_s"):
        runs = [run for part in parts if part.get(key) for run in part[key]["runs"]]
        if runs:
            merged[key] = dict(parts[0][key] or {}, **summarize(runs))
    merged["decode"] = _decode_stats([step for part in parts for step in part["decode"].get("step_s", [])])
    merged["per_round"] = [{
        "prefill_best_s": part["prefill_s"]["best"], "prefill_median_s": part["prefill_s"]["median"],
        "step_best_s": part["decode"].get("best_step_s"), "step_median_s": part["decode"].get("median_step_s"),
    } for part in parts]
    merged["peak_rss_bytes"] = max(part.get("peak_rss_bytes") or 0 for part in parts)
    merged["model_load_s"] = [part.get("model_load_s") for part in parts]
    merged["rounds"] = len(parts)
    return merged


def _worker_main(job_file: str, result_file: str) -> int:
    job = json.loads(Path(job_file).read_text())
    result = _torch_worker(job) if job["backend"] == "torch" else _ort_worker(job)
    write_json(result_file, result)
    return 0


# ---- analysis -----------------------------------------------------------------------------------------------------


def _bandwidths(bandwidth: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(read probe, copy probe) of a result's bandwidth entry (results without a read probe use the copy for both)."""
    copy = bandwidth.get("copy", bandwidth)
    return bandwidth.get("read", copy), copy


def _linear_fit(large: float, small: float, large_layers: int, small_layers: int) -> dict[str, float]:
    per_layer = (large - small) / (large_layers - small_layers)
    return {"fixed_s": large - large_layers * per_layer, "per_layer_s": per_layer}


def _target(name: str, scope: str, stat: str, prompt: str, number: float, threshold: float, unit: str,
            strict: bool = False) -> dict[str, Any]:
    """One row of the targets table: `number` against `threshold` (> when strict, else >=)."""
    return {"target": name, "scope": scope, "statistic": stat, "prompt": prompt, "value": number,
            "threshold": threshold, "unit": unit, "comparison": ">" if strict else ">=",
            "met": number > threshold if strict else number >= threshold}


def layer_fits(text_large: dict[str, Any], text_small: dict[str, Any], large_layers: int, small_layers: int
               ) -> dict[str, dict[str, dict[str, float]]]:
    """time(L) = fixed + L x per_layer for the decode step and the prefill of the text prompt, two ways:
    "best" from the fastest step / prefill at each depth (all rounds pooled), "median" from each depth's lowest
    per-round median (background load only ever adds time, so the lowest median is the least disturbed one)."""
    fits: dict[str, dict[str, dict[str, float]]] = {"best": {}, "median": {}}
    fits["best"]["decode"] = _linear_fit(text_large["decode"]["best_step_s"], text_small["decode"]["best_step_s"],
                                         large_layers, small_layers)
    fits["best"]["prefill"] = _linear_fit(text_large["prefill_s"]["best"], text_small["prefill_s"]["best"],
                                          large_layers, small_layers)

    def lowest(rounds: list[dict[str, Any]], key: str) -> float:
        return min(r[key] for r in rounds if r.get(key) is not None)

    large, small = text_large["per_round"], text_small["per_round"]
    fits["median"]["decode"] = _linear_fit(lowest(large, "step_median_s"), lowest(small, "step_median_s"),
                                           large_layers, small_layers)
    fits["median"]["prefill"] = _linear_fit(lowest(large, "prefill_median_s"), lowest(small, "prefill_median_s"),
                                            large_layers, small_layers)
    return fits


def analyse(runs: dict[int, dict[str, dict[str, Any]]], weights: dict[str, dict[str, Any]],
            bandwidth: dict[str, Any], main_layers: int, scaling_layers: int | None, vocab_size: int
            ) -> dict[str, Any]:
    """Per engine and prompt: the measured numbers, the bandwidth bounds, the 32-layer estimate; then the targets."""
    main = runs[main_layers]
    read, copy = _bandwidths(bandwidth)
    rows: dict[str, dict[str, Any]] = {}
    fits: dict[str, Any] = {}
    for backend, cases in main.items():
        if backend.endswith(LAST_LOGITS_SUFFIX):
            continue
        precision = backend.split("-")[1] if backend.startswith("ort-") else None
        small_text = runs.get(scaling_layers, {}).get(backend, {}).get("text") if scaling_layers else None
        if small_text and "text" in cases and cases["text"].get("per_round") and small_text.get("per_round"):
            fits[backend] = layer_fits(cases["text"], small_text, main_layers, scaling_layers)
            # The bandwidth a decode layer's weights imply (PyTorch reads the fp32 base weights, its LoRA merged). A
            # per-layer time <= 0, or one implying far more than the measured read bandwidth, is noise from
            # background load; that estimate is not used.
            layer_bytes = weights[f"{precision or 'fp32'}/{VARIANT_FILES['text']}"]["per_layer_bytes"]
            for stat in ("best", "median"):
                fit = fits[backend][stat]["decode"]
                positive = fit["per_layer_s"] > 0
                fit["layer_gb_s"] = layer_bytes / fit["per_layer_s"] / GB if positive else None
                fit["plausible"] = positive and fit["layer_gb_s"] <= PLAUSIBLE_BANDWIDTH_FACTOR * read["best_gb_s"]
        for prompt, result in cases.items():
            decode = result["decode"]
            row: dict[str, Any] = {
                "backend": backend, "prompt": prompt, "prompt_tokens": result["prompt_tokens"],
                "prefill_s_best": result["prefill_s"]["best"], "prefill_s_median": result["prefill_s"]["median"],
                "prefill_runs": len(result["prefill_s"]["runs"]),
                "decode_tokens_per_s_median": decode.get("tokens_per_s_median"),
                "decode_tokens_per_s_best": decode.get("tokens_per_s_best"),
                "decode_steps": decode.get("steps"),
                "peak_rss_bytes": result.get("peak_rss_bytes"),
            }
            encoder_ab = (main.get("torch-fp32", {}).get(prompt) or {}).get("encoder_ab")
            encoder = (encoder_ab or {}).get(backend) or result.get("encoder_s")
            if encoder:
                row["encoder_s_best"] = encoder["best"]
                row["encoder_s_median"] = encoder["median"]
            last = main.get(f"{backend}{LAST_LOGITS_SUFFIX}", {}).get(prompt)
            if last:
                row["prefill_s_best_last_logits_only"] = last["prefill_s"]["best"]
                row["prefill_s_median_last_logits_only"] = last["prefill_s"]["median"]
                row["prefill_saving_last_logits_only_pct"] = 100 * (
                    1 - last["prefill_s"]["best"] / row["prefill_s_best"])
            graph = weights.get(f"{precision}/{result['decoder']}") if precision else None
            layer_ratio = 1.0  # per-layer cost of this prompt's decoder variant relative to the base (text) decoder
            if graph:
                base = weights[f"{precision}/{VARIANT_FILES['text']}"]
                layer_ratio = graph["per_layer_bytes"] / base["per_layer_bytes"]
                row["bytes_per_token"] = graph["total_bytes"]
                row["bound_tokens_per_s"] = read["best_gb_s"] * GB / graph["total_bytes"]
                row["bound_tokens_per_s_memcpy"] = copy["best_gb_s"] * GB / graph["total_bytes"]
                if decode.get("tokens_per_s_best"):
                    row["pct_of_bound_best"] = 100 * decode["tokens_per_s_best"] / row["bound_tokens_per_s"]
                    row["pct_of_bound_median"] = 100 * decode["tokens_per_s_median"] / (
                        read["median_gb_s"] * GB / graph["total_bytes"])
                    row["pct_of_memcpy_bound_best"] = (100 * decode["tokens_per_s_best"]
                                                       / row["bound_tokens_per_s_memcpy"])
            if backend in fits and decode.get("median_step_s"):
                extra = REAL_TEXT_LAYERS - main_layers
                length = result["prompt_tokens"] / cases["text"]["prompt_tokens"]
                estimate: dict[str, Any] = {"layer_ratio": layer_ratio, "length_ratio": length}
                for stat, step, prefill in (("best", decode["best_step_s"], row["prefill_s_best"]),
                                            ("median", decode["median_step_s"], row["prefill_s_median"])):
                    fit = fits[backend][stat]
                    step_32 = step + extra * fit["decode"]["per_layer_s"] * layer_ratio
                    plausible = fit["decode"]["plausible"] and step_32 > 0
                    estimate[f"decode_tokens_per_s_{stat}"] = 1 / step_32 if plausible else None
                    estimate[f"prefill_s_{stat}"] = (prefill
                                                     + extra * fit["prefill"]["per_layer_s"] * layer_ratio * length)
                if graph:
                    bytes_32 = graph[f"estimated_total_bytes_{REAL_TEXT_LAYERS}_layers"]
                    estimate["bytes_per_token"] = bytes_32
                    estimate["bound_tokens_per_s"] = read["best_gb_s"] * GB / bytes_32
                    for stat, bw in (("best", read["best_gb_s"]), ("median", read["median_gb_s"])):
                        rate = estimate[f"decode_tokens_per_s_{stat}"]
                        estimate[f"pct_of_bound_{stat}"] = 100 * rate / (bw * GB / bytes_32) if rate else None
                if last:
                    saving = row["prefill_s_median"] - last["prefill_s"]["median"]
                    estimate["prefill_s_median_last_logits_only"] = estimate["prefill_s_median"] - saving
                    estimate["last_logits_saving_pct"] = 100 * saving / estimate["prefill_s_median"]
                row[f"estimate_{REAL_TEXT_LAYERS}_layers"] = estimate
            rows[f"{backend}/{prompt}"] = row

    prompts = list(dict.fromkeys(row["prompt"] for row in rows.values()))
    targets: list[dict[str, Any]] = []

    def value(backend: str, prompt: str, key: str, estimate: bool) -> float | None:
        row = rows.get(f"{backend}/{prompt}", {})
        return (row.get(f"estimate_{REAL_TEXT_LAYERS}_layers", {}) if estimate else row).get(key)

    def add(name: str, scope: str, stat: str, prompt: str, number: float | None, threshold: float, unit: str,
            strict: bool = False) -> None:
        if number is not None:
            targets.append(_target(name, scope, stat, prompt, number, threshold, unit, strict))

    for estimate in (False, True):
        scope = f"{REAL_TEXT_LAYERS}-layer estimate" if estimate else f"measured, {main_layers} layers"
        for stat in ("median", "best"):
            key = f"decode_tokens_per_s_{stat}"
            for prompt in prompts:
                torch_rate = value("torch-fp32", prompt, key, estimate)
                int4_rate = value("ort-int4", prompt, key, estimate)
                fp32_rate = value("ort-fp32", prompt, key, estimate)
                if torch_rate:
                    add("int4 decode vs PyTorch fp32 decode", scope, stat, prompt,
                        int4_rate / torch_rate if int4_rate else None, 5.0, "x")
                    add("ORT fp32 decode vs PyTorch fp32 decode", scope, stat, prompt,
                        fp32_rate / torch_rate if fp32_rate else None, 1.0, "x", strict=True)
                add("int4 decode, % of the read-bandwidth bound", scope, stat, prompt,
                    value("ort-int4", prompt, f"pct_of_bound_{stat}", estimate), 60.0, "%")
        for prompt in prompts:
            add("int4 decode, % of the memcpy bound", scope, "best", prompt,
                value("ort-int4", prompt, "pct_of_memcpy_bound_best", False) if not estimate else None, 60.0, "%")
    for prompt in prompts:
        encoder_ab = (main.get("torch-fp32", {}).get(prompt) or {}).get("encoder_ab")
        if encoder_ab and "ort-fp32" in encoder_ab:
            name = f"{'vision' if 'image' in prompt else 'speech'} encoder, ORT fp32 vs PyTorch fp32"
            for stat in ("median", "best"):
                add(name, f"measured, {encoder_ab['graph']}", stat, prompt,
                    encoder_ab["torch-fp32"][stat] / encoder_ab["ort-fp32"][stat], 1.5, "x")

    findings = []
    for prompt in prompts:
        for precision in PRECISIONS:
            row = rows.get(f"ort-{precision}/{prompt}", {})
            if "prefill_s_best_last_logits_only" not in row:
                continue
            logits_gb = row["prompt_tokens"] * vocab_size * 4 / GB
            text = (f"{prompt}, ORT {precision}: the decoder computes logits for all {row['prompt_tokens']} prompt "
                    f"positions ({logits_gb:.2f} GB of fp32 output); emitting only the last position takes the prefill "
                    f"from {row['prefill_s_best']:.1f} to {row['prefill_s_best_last_logits_only']:.1f} s "
                    f"(-{row['prefill_saving_last_logits_only_pct']:.0f}%) at {main_layers} layers")
            estimate = row.get(f"estimate_{REAL_TEXT_LAYERS}_layers", {})
            if "last_logits_saving_pct" in estimate:
                text += (f", estimated -{estimate['last_logits_saving_pct']:.0f}% at {REAL_TEXT_LAYERS} layers "
                         f"({estimate['prefill_s_median']:.0f} -> "
                         f"{estimate['prefill_s_median_last_logits_only']:.0f} s)")
            findings.append(text)
    for prompt in prompts:
        fp32 = rows.get(f"ort-fp32/{prompt}", {}).get("prefill_s_best")
        int4 = rows.get(f"ort-int4/{prompt}", {}).get("prefill_s_best")
        if fp32 and int4:
            findings.append(f"{prompt}: ORT int4 prefill takes {int4 / fp32:.2f}x the fp32 time "
                            f"({int4:.2f} vs {fp32:.2f} s, best)")
    for prompt in prompts:
        encoder_ab = (main.get("torch-fp32", {}).get(prompt) or {}).get("encoder_ab")
        if encoder_ab and "ort-int4" in encoder_ab and "ort-fp32" in encoder_ab:
            findings.append(f"{prompt}: the int4 package's {encoder_ab['graph']} takes "
                            f"{encoder_ab['ort-int4']['median'] / encoder_ab['ort-fp32']['median']:.2f}x the fp32 "
                            f"one's time ({encoder_ab['ort-int4']['median']:.2f} vs "
                            f"{encoder_ab['ort-fp32']['median']:.2f} s, medians)")
    return {"rows": rows, "fits": fits, "targets": targets, "findings": findings,
            "cited_encoder_speedups": _cited_encoder_speedups()}


def analyse_full_depth(full: dict[str, Any], rows: dict[str, dict[str, Any]], bandwidth: dict[str, Any]
                       ) -> dict[str, Any]:
    """The full-depth package's text prompt against its bandwidth bound, the estimate extrapolated for the same
    engine, and PyTorch's estimate at that depth (targets scoped "measured at full depth")."""
    read, copy = _bandwidths(bandwidth)
    backend, text = full["backend"], full["text"]
    decode = text["decode"]
    total_bytes = full["weights"]["total_bytes"]
    bound = read["best_gb_s"] * GB / total_bytes
    estimated = rows.get(f"{backend}/text", {}).get(f"estimate_{REAL_TEXT_LAYERS}_layers", {})
    torch_estimate = rows.get("torch-fp32/text", {}).get(f"estimate_{REAL_TEXT_LAYERS}_layers", {})
    out: dict[str, Any] = {
        "backend": backend, "layers": full["layers"], "prompt_tokens": text["prompt_tokens"],
        "weights_bytes_per_step": total_bytes, "bound_tokens_per_s": bound,
        "bound_tokens_per_s_memcpy": copy["best_gb_s"] * GB / total_bytes,
        "prefill_s_best": text["prefill_s"]["best"], "prefill_s_median": text["prefill_s"]["median"],
        "peak_rss_bytes": text.get("peak_rss_bytes"), "targets": [],
    }
    scope = f"measured, {full['layers']} layers"
    versus_scope = f"{scope}; PyTorch: {REAL_TEXT_LAYERS}-layer estimate"
    for stat in ("median", "best"):
        rate = decode.get(f"tokens_per_s_{stat}")
        out[f"decode_tokens_per_s_{stat}"] = rate
        out[f"estimated_decode_tokens_per_s_{stat}"] = estimated.get(f"decode_tokens_per_s_{stat}")
        out[f"pct_of_bound_{stat}"] = 100 * rate / (read[f"{stat}_gb_s"] * GB / total_bytes) if rate else None
        torch_rate = torch_estimate.get(f"decode_tokens_per_s_{stat}") if full["layers"] == REAL_TEXT_LAYERS else None
        if rate and torch_rate:
            label = "int4" if backend == "ort-int4" else "ORT fp32"
            threshold, strict = (5.0, False) if backend == "ort-int4" else (1.0, True)
            out["targets"].append(_target(f"{label} decode vs PyTorch fp32 decode", versus_scope, stat, "text",
                                          rate / torch_rate, threshold, "x", strict))
        if rate and backend == "ort-int4":
            out["targets"].append(_target("int4 decode, % of the read-bandwidth bound", scope, stat, "text",
                                          out[f"pct_of_bound_{stat}"], 60.0, "%"))
    for stat in ("best", "median"):
        out[f"estimated_prefill_s_{stat}"] = estimated.get(f"prefill_s_{stat}")
    return out


def _cited_encoder_speedups() -> list[dict[str, Any]]:
    """Encoder speed-ups from bench_vision.py / bench_speech.py results, when those files exist."""
    cited = []
    vision = ROOT / "benchmarks" / "results" / "vision.json"
    if vision.is_file():
        data = json.loads(vision.read_text())
        for name, case in data.get("cases", {}).items():
            cited.append({"source": "benchmarks/results/vision.json", "case": name,
                          "speedup": case.get("speedup_fused_vs_torch"), "statistic": "median"})
    speech = ROOT / "benchmarks" / "results" / "speech.json"
    if speech.is_file():
        data = json.loads(speech.read_text())
        cited.append({"source": "benchmarks/results/speech.json", "case": f"{data.get('clip_seconds')} s clip",
                      "speedup": data.get("torch_over_ort"), "statistic": "median"})
    return cited


# ---- report -------------------------------------------------------------------------------------------------------


def _gb(value: float | None) -> str:
    return "" if value is None else f"{value / GB:.2f}"


def _pair(first: float | None, second: float | None, digits: int = 2) -> str:
    return f"{fmt(first, digits)} / {fmt(second, digits)}"


def report_markdown(result: dict[str, Any]) -> str:
    analysis = result["analysis"]
    rows = analysis["rows"]
    setup = result["setup"]
    read, copy = _bandwidths(result["bandwidth"])
    machine = result["machine"]
    est = f"estimate_{REAL_TEXT_LAYERS}_layers"
    with_last = any("prefill_s_best_last_logits_only" in row for row in rows.values())
    lines = [
        f"Command: `{result['command']}` ({setup['measure_s'] / 60:.1f} min of measurement; checkpoints and packages "
        f"are built once into the work folder, {setup['setup_s'] / 60:.1f} min this time). Machine: "
        f"{machine['cpu_model']}, {machine['logical_cores']} cores, {machine['ram_bytes'] / GB:.0f} GB RAM, load "
        f"average {machine['load_average'][0]} at the end (the benchmark's own threads included).",
        "",
        f"Model: full-width random checkpoint (hidden {setup['hidden_size']}, intermediate "
        f"{setup['intermediate_size']}, vocab {setup['vocab_size']}) with {setup['text_layers']} decoder layers "
        f"(real: {REAL_TEXT_LAYERS}), {setup['vision_layers']} SigLIP layers (27) and {setup['audio_blocks']} "
        f"conformer blocks (24); routed CPU packages (fp32; int4 = MatMulNBits block 32, accuracy level 4, encoders "
        f"int4 too). {setup['threads']} threads for every engine. Greedy, end-of-sequence masked, "
        f"{setup['new_tokens']} new tokens. PyTorch = transformers' native Phi4MultimodalForCausalLM, eager, fp32, "
        "same weights, the prompt's LoRA merged, KV cache, last-position logits only.",
        "",
        "Each engine runs in its own process, one after the other. The text prompt is run in "
        f"{setup.get('rounds', 1)} rounds (every engine at both depths once per round, so background load is shared); "
        "the media prompts once per engine, the engines in turn per decoder variant (image prompts, then audio). "
        "Prefill = processor tensors -> first token (encoders + embedding + decoder over the prompt): best / median "
        f"of up to {setup['repeats']} runs per process (fewer once a prompt's prefills took {setup['budget_s']:.0f} "
        "s; counts in the JSON). Decode = the tokens after the first, each step timed: 1 / median step and 1 / "
        "fastest step. Encoder = the vision / speech graph alone: the fp32 and int4 packages' graphs and the PyTorch "
        "code in turn in one process.",
        "",
        f"Memory bandwidth (1 GB numpy arrays, fastest of the probes before and after the measurements): read "
        f"(max() over the array) best {read['best_gb_s']:.1f} GB/s, median {read['median_gb_s']:.1f} GB/s "
        f"({read['threads']} threads); copy best {copy['best_gb_s']:.1f} GB/s of bytes copied ({copy['threads']} "
        "threads). Bound = read bandwidth / bytes of decoder MatMul weights read per step (every layer, the variant's "
        "LoRA branches, lm_head; int4 = packed weights + scales + zero points); the memcpy bound (copy bandwidth "
        "instead) is lower than what fp32 decoding reaches, so it is shown but not used.",
        "",
    ]
    table = []
    for row in rows.values():
        last = row.get("prefill_s_best_last_logits_only")
        table.append([
            row["backend"], row["prompt"], row["prompt_tokens"],
            _pair(row["prefill_s_best"], row["prefill_s_median"]),
            *([f"{fmt(last)} (-{fmt(row['prefill_saving_last_logits_only_pct'], 0)}%)" if last else ""]
              if with_last else []),
            _pair(row.get("encoder_s_best"), row.get("encoder_s_median")) if row.get("encoder_s_best") else "",
            _pair(row["decode_tokens_per_s_median"], row["decode_tokens_per_s_best"]),
            _gb(row.get("bytes_per_token")),
            f"{fmt(row['bound_tokens_per_s'], 1)} ({fmt(row['pct_of_bound_median'], 0)}% / "
            f"{fmt(row['pct_of_bound_best'], 0)}%)" if row.get("pct_of_bound_best") else "",
            f"{fmt(row['pct_of_memcpy_bound_best'], 0)}%" if row.get("pct_of_memcpy_bound_best") else "",
            _gb(row.get("peak_rss_bytes")),
        ])
    headers = ["engine", "prompt", "tokens", "prefill s best / median",
               *(["prefill s, last-position logits only"] if with_last else []),
               "encoder s best / median", "decode tok/s median / best", "weights GB/step",
               "bound tok/s (median / best as %)", "best as % of memcpy bound", "peak RSS GB"]
    lines.append(markdown_table(headers, table, "ll" + "r" * (len(headers) - 2)))

    fits = analysis.get("fits", {})
    if fits:
        lines += [
            "",
            f"Estimate for the real {REAL_TEXT_LAYERS}-layer decoder. From the text prompt at "
            f"{setup['scaling_layers']} and {setup['text_layers']} decoder layers: time(L) = fixed + L x per-layer, "
            "\"best\" from the fastest decode step / prefill at each depth, \"median\" from each depth's lowest "
            "per-round median (background load only adds time). A per-layer decode time implying more than "
            f"{PLAUSIBLE_BANDWIDTH_FACTOR}x the read bandwidth is marked as noise and not used. Each prompt's measured "
            "time then gets "
            f"({REAL_TEXT_LAYERS} - {setup['text_layers']}) x per-layer added, scaled by its prompt length (prefill) "
            "and by its decoder variant's per-layer weight bytes relative to the base decoder (LoRA branches; 1 for "
            "PyTorch, whose LoRA is merged). The encoders stay at their reduced depth. Bytes per step at "
            f"{REAL_TEXT_LAYERS} layers = fixed (lm_head) + {REAL_TEXT_LAYERS} x one layer, from the graph.",
            "",
        ]
        table = []

        def decode_fit(fit: dict[str, Any]) -> str:
            text = f"{1000 * fit['fixed_s']:.0f} + {1000 * fit['per_layer_s']:.1f} L"
            if not fit.get("plausible", True):
                return text + " (noise, not used)"
            return text + (f" ({fit['layer_gb_s']:.1f} GB/s per layer)" if fit.get("layer_gb_s") else "")

        for backend, fit in fits.items():
            table.append([
                backend, decode_fit(fit["best"]["decode"]), decode_fit(fit["median"]["decode"]),
                f"{fit['best']['prefill']['fixed_s']:.2f} + {fit['best']['prefill']['per_layer_s']:.3f} L",
                f"{fit['median']['prefill']['fixed_s']:.2f} + {fit['median']['prefill']['per_layer_s']:.3f} L",
            ])
        lines.append(markdown_table(["engine", "text decode step ms (best)", "(median)", "text prefill s (best)",
                                     "(median)"], table, "lllll"))
        layer_rates = [(fit[stat]["decode"]["layer_gb_s"], backend) for backend, fit in fits.items()
                       for stat in ("best", "median") if fit[stat]["decode"].get("plausible")]
        fastest, fastest_backend = max(layer_rates) if layer_rates else (None, None)
        int4_layer = (fits.get("ort-int4", {}).get("median", {}).get("decode") or {}).get("layer_gb_s")
        if fastest and fastest > read["best_gb_s"]:
            text = (f"The numpy read probe ({read['best_gb_s']:.1f} GB/s) is not a strict ceiling: {fastest_backend}'s "
                    f"decode layers read their weights at up to {fastest:.1f} GB/s.")
            if int4_layer:
                text += (f" Against that figure the int4 layers' {int4_layer:.1f} GB/s (median fit) is "
                         f"{100 * int4_layer / fastest:.0f}% of the bandwidth bound.")
            lines += ["", text]
        lines.append("")
        table = []
        for row in rows.values():
            e = row.get(est)
            if not e:
                continue
            table.append([
                row["backend"], row["prompt"],
                _pair(e["decode_tokens_per_s_median"], e["decode_tokens_per_s_best"]),
                f"{fmt(e['bound_tokens_per_s'])} ({fmt(e['pct_of_bound_median'], 0)}% / "
                f"{fmt(e['pct_of_bound_best'], 0)}%)" if e.get("bound_tokens_per_s") else "",
                _pair(e["prefill_s_best"], e["prefill_s_median"], 1),
                *([f"{fmt(e['prefill_s_median_last_logits_only'], 1)} (-{fmt(e['last_logits_saving_pct'], 0)}%)"
                   if "last_logits_saving_pct" in e else ""] if with_last else []),
            ])
        headers = ["engine", "prompt", f"decode tok/s @{REAL_TEXT_LAYERS} median / best",
                   f"bound tok/s @{REAL_TEXT_LAYERS} (median / best as %)",
                   f"prefill s @{REAL_TEXT_LAYERS} best / median",
                   *([f"prefill s @{REAL_TEXT_LAYERS}, last-position logits only (median)"] if with_last else [])]
        lines.append(markdown_table(headers, table, "ll" + "r" * (len(headers) - 2)))

    full = analysis.get("full_depth")
    if full:
        lines += [
            "",
            f"Check at full depth: the text prompt on a {full['layers']}-layer {full['backend']} package "
            f"(`{result['full_depth']['package']}`, built from `make_checkpoint --preset full`), "
            f"{result['full_depth']['text'].get('rounds', 1)} round(s) of the same measurement, against the "
            "estimate above. PyTorch fp32 at this depth needs ~22 GB for its weights alone and is not run.",
            "",
            markdown_table(
                ["engine", "layers", "decode tok/s median / best", "estimated", "bound tok/s (median / best as %)",
                 "prefill s best / median", "estimated", "peak RSS GB"],
                [[full["backend"], full["layers"],
                  _pair(full["decode_tokens_per_s_median"], full["decode_tokens_per_s_best"]),
                  _pair(full["estimated_decode_tokens_per_s_median"], full["estimated_decode_tokens_per_s_best"]),
                  f"{fmt(full['bound_tokens_per_s'])} ({fmt(full['pct_of_bound_median'], 0)}% / "
                  f"{fmt(full['pct_of_bound_best'], 0)}%)",
                  _pair(full["prefill_s_best"], full["prefill_s_median"], 1),
                  _pair(full["estimated_prefill_s_best"], full["estimated_prefill_s_median"], 1),
                  _gb(full["peak_rss_bytes"])]],
                "llrrrrrr"),
        ]

    prompts = list(dict.fromkeys(t["prompt"] for t in analysis["targets"]))
    grouped: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for t in analysis["targets"]:
        grouped.setdefault((t["target"], t["scope"], t["statistic"]), {})[t["prompt"]] = t
    table = []
    for (name, scope, stat), by_prompt in grouped.items():
        first = next(iter(by_prompt.values()))
        met = sum(t["met"] for t in by_prompt.values())
        table.append([name, scope, stat,
                      *[(fmt(by_prompt[p]["value"], 1 if first["unit"] == "%" else 2) + first["unit"]
                         + ("" if by_prompt[p]["met"] else " **x**")) if p in by_prompt else "" for p in prompts],
                      f"{first['comparison']} {fmt(first['threshold'], 1)}{first['unit']}",
                      "all" if met == len(by_prompt) else "none" if met == 0 else f"{met} of {len(by_prompt)}"])
    lines += ["", "Targets (**x** = not met):", ""]
    lines.append(markdown_table(["target", "scope", "statistic", *prompts, "needed", "met"], table,
                                "lll" + "r" * (len(prompts) + 1) + "l"))
    cited = analysis.get("cited_encoder_speedups") or []
    if cited:
        lines += ["", "Encoder speed-ups of ORT fp32 over PyTorch fp32 from the encoder benchmarks: " + "; ".join(
            f"{c['case']} {fmt(c['speedup'])}x ({c['source']}, {c['statistic']})" for c in cited) + "."]
    if analysis.get("findings"):
        lines += ["", "Findings:", ""] + [f"- {text}" for text in analysis["findings"]]
    if result.get("notes"):
        lines += ["", "Checks:", ""] + [f"- {note}" for note in result["notes"]]
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="use this full-width checkpoint instead of generating one "
                        "(no 32-layer estimate unless --scaling-checkpoint is given too)")
    parser.add_argument("--scaling-checkpoint", type=Path, help="the same model with fewer decoder layers")
    parser.add_argument("--text-layers", type=int, default=8, help="decoder layers of the generated checkpoint")
    parser.add_argument("--scaling-layers", type=int, default=2,
                        help="decoder layers of the second generated checkpoint (0: no 32-layer estimate)")
    parser.add_argument("--prompts", default=",".join(PROMPT_NAMES))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--last-logits-prompts", default="text,image-1crop",
                        help="prompts whose prefill is also run with last-position-logits decoders ('' = none)")
    parser.add_argument("--encoder-prompts", default="image-1crop,audio-10s",
                        help="prompts whose vision/speech graphs (fp32, int4) and PyTorch encoder are also timed "
                        "alone, in turn ('' = none)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the text prompt: every engine (and layer "
                        "count) once per round, so background load hits them alike")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="prefill runs per prompt (at most)")
    parser.add_argument("--budget", type=float, default=30.0,
                        help="no further prefill run of a prompt once its prefills took this many seconds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full-depth-package", type=Path,
                        help="a CPU package built from a checkpoint with the real decoder depth (make_checkpoint "
                        "--preset full, then -p int4): the text prompt also runs on it, a direct check of the "
                        f"{REAL_TEXT_LAYERS}-layer estimate (PyTorch fp32 at full depth does not fit in 24 GB)")
    parser.add_argument("--setup-only", action="store_true", help="make the checkpoints and packages, then stop")
    parser.add_argument("--keep-packages", action="store_true",
                        help="reuse packages in --work even if the builder's code changed since they were built")
    parser.add_argument("--from-json", type=Path,
                        help="measure nothing: redo the analysis and the report of an earlier --out file")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="checkpoints and packages (kept, reused)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC,
                        help="Markdown file whose 'Machine' and 'Run time' sections are rewritten ('' to skip)")
    args = parser.parse_args(argv)
    if args.from_json:
        return publish(json.loads(args.from_json.read_text()), args.out, args.doc)
    command = " ".join(["python benchmarks/bench_runtime.py", *(sys.argv[1:] if argv is None else argv)])
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    prompt_names = [p for p in args.prompts.split(",") if p]
    backends = [b for b in args.backends.split(",") if b]
    unknown = [p for p in prompt_names if p not in PROMPT_NAMES] + [b for b in backends if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown prompt or backend: {', '.join(unknown)}")
    last_logits_prompts = [p for p in args.last_logits_prompts.split(",") if p in prompt_names]
    encoder_prompts = [p for p in args.encoder_prompts.split(",") if p in prompt_names]

    from builder_plugin.config import Phi4MMConfig

    setup_start = time.perf_counter()
    checkpoints: dict[int, Path] = {}
    if args.checkpoint:
        checkpoints[Phi4MMConfig.from_dir(args.checkpoint).text.num_hidden_layers] = args.checkpoint.resolve()
        if args.scaling_checkpoint:
            layers = Phi4MMConfig.from_dir(args.scaling_checkpoint).text.num_hidden_layers
            checkpoints[layers] = args.scaling_checkpoint.resolve()
    else:
        checkpoints[args.text_layers] = prepare_checkpoint(work, args.text_layers)
        if args.scaling_layers and args.scaling_layers != args.text_layers:
            checkpoints[args.scaling_layers] = prepare_checkpoint(work, args.scaling_layers)
    main_layers = max(checkpoints)
    scaling_layers = min(checkpoints) if len(checkpoints) > 1 else None
    packages: dict[tuple[int, str], Path] = {}
    builds: dict[str, Any] = {}
    fingerprint = None if args.keep_packages else builder_fingerprint()
    for layers, checkpoint in checkpoints.items():
        for precision in PRECISIONS:
            packages[layers, precision], builds[f"{layers}/{precision}"] = prepare_package(
                work, checkpoint, precision, fingerprint)
    setup_s = time.perf_counter() - setup_start
    if args.setup_only:
        print(f"setup done in {setup_s / 60:.1f} min: {work}")
        return 0

    config = Phi4MMConfig.from_dir(checkpoints[main_layers])
    prompts = make_prompts(work, checkpoints[main_layers], prompt_names)
    weights = {f"{precision}/{filename}": decode_weight_bytes(packages[main_layers, precision] / filename)
               for precision in PRECISIONS for filename in VARIANT_FILES.values()}
    notes = []
    logits_dims = {f"{precision}/{filename}": logits_positions(packages[main_layers, precision] / filename)
                   for precision in PRECISIONS for filename in VARIANT_FILES.values()}
    if last_logits_prompts and all(dim == 1 for dim in logits_dims.values()):
        notes.append("The built decoders already emit the last position's logits only ([B, 1, vocab], the GenAI "
                     "builder's prune_lm_head), so there are no last-position-logits comparison runs.")
        last_logits_prompts = []
    last_logits_files = {(precision, filename): write_last_logits_decoder(packages[main_layers, precision], filename)
                         for precision in PRECISIONS for filename in VARIANT_FILES.values()} \
        if last_logits_prompts else {}

    def probe_bandwidth(when: str) -> list[dict[str, Any]]:
        found = [dict(probe(threads=t).as_dict(), when=when)
                 for probe in (memcpy_bandwidth, read_bandwidth) for t in sorted({1, args.threads})]
        print(f"memory bandwidth ({when}): " + ", ".join(
            f"{p['kind']} {p['threads']} thread(s) best {p['best_gb_s']:.1f} / median {p['median_gb_s']:.1f} GB/s"
            for p in found), flush=True)
        return found

    probes = probe_bandwidth("start")

    def job(backend: str, layers: int, selected: list[Prompt], label: str) -> dict[str, Any]:
        """A worker job for `selected` prompts; ORT jobs at the main depth also get the last-position-logits runs
        of the --last-logits-prompts among them, right after the built decoder's."""
        label = f"{backend}-text{layers}-{label}"
        if backend == "torch-fp32":
            cases = [make_case(p, "", args.new_tokens, args,
                               encoders=layers == main_layers and p.name in encoder_prompts)
                     for p in selected]
            encoder_packages = {f"ort-{precision}": str(packages[layers, precision]) for precision in PRECISIONS}
            for c in cases:
                c["encoder_packages"] = encoder_packages
            return {"backend": "torch", "label": label, "checkpoint": str(checkpoints[layers]),
                    "package": str(packages[layers, "fp32"]), "threads": args.threads, "cases": cases}
        precision = backend.split("-")[1]
        cases = []
        for p in selected:
            cases.append(make_case(p, VARIANT_FILES[p.mode], args.new_tokens, args))
            if layers == main_layers and p.name in last_logits_prompts:
                cases.append(make_case(p, last_logits_files[precision, VARIANT_FILES[p.mode]], 1, args, last=True))
        return {"backend": "ort", "label": label, "package": str(packages[layers, precision]),
                "threads": args.threads, "cases": cases}

    collected: dict[int, dict[str, dict[str, list[dict[str, Any]]]]] = {layers: {} for layers in checkpoints}

    def collect(layers: int, backend: str, result: dict[str, Any]) -> None:
        for key, value in result.items():
            name = key.split("@")[0]
            target = backend + (LAST_LOGITS_SUFFIX if "@" in key else "")
            collected[layers].setdefault(target, {}).setdefault(name, []).append(value)

    measure_start = time.perf_counter()
    text = [p for p in prompts if p.name == "text"]
    media = [p for p in prompts if p.name != "text"]
    layer_counts = sorted(checkpoints, reverse=True)
    for index in range(args.rounds if text else 0):
        for backend in backends:  # the depths of one engine back to back: their difference is the per-layer part
            for layers in layer_counts:
                collect(layers, backend, run_worker(job(backend, layers, text, f"round{index + 1}"), work))
    for mode in dict.fromkeys(p.mode for p in media):  # per decoder variant, every engine in turn
        for backend in backends:
            group = [p for p in media if p.mode == mode]
            collect(main_layers, backend, run_worker(job(backend, main_layers, group, f"media-{mode}"), work))
    runs = {layers: {backend: {name: merge_runs(parts) for name, parts in by_prompt.items()}
                     for backend, by_prompt in by_backend.items()}
            for layers, by_backend in collected.items()}
    full_depth = measure_full_depth(args.full_depth_package, text, args, work) if args.full_depth_package else None
    measure_s = time.perf_counter() - measure_start
    # Background load only ever makes a probe slower, so the fastest one (start or end) is the machine's figure.
    probes += probe_bandwidth("end")
    bandwidth = {kind: max((p for p in probes if p["kind"] == kind), key=lambda p: p["best_gb_s"])
                 for kind in ("read", "copy")}
    bandwidth["probes"] = probes

    for prompt in prompt_names:
        ort_tokens = runs[main_layers].get("ort-fp32", {}).get(prompt, {}).get("tokens")
        torch_tokens = runs[main_layers].get("torch-fp32", {}).get(prompt, {}).get("tokens")
        if ort_tokens and torch_tokens:
            same = next((i for i, (a, b) in enumerate(zip(ort_tokens, torch_tokens)) if a != b), len(ort_tokens))
            notes.append(f"{prompt}: ORT fp32 and PyTorch agree on the first {same} of {len(ort_tokens)} greedy "
                         "tokens (random weights make near-ties common; a sanity check only)")
        for precision in PRECISIONS:
            full = runs[main_layers].get(f"ort-{precision}", {}).get(prompt, {}).get("tokens")
            last = runs[main_layers].get(f"ort-{precision}{LAST_LOGITS_SUFFIX}", {}).get(prompt, {}).get("tokens")
            if full and last:
                notes.append(f"{prompt}: ORT {precision} last-position-logits decoder gives the same first token as "
                             f"the built decoder: {'yes' if full[0] == last[0] else 'NO'}")
    result: dict[str, Any] = {
        "benchmark": "run time, onnxruntime-genai CPU (fp32, int4) vs PyTorch fp32 eager",
        "command": command,
        "machine": machine_info(),
        "setup": {
            "text_layers": main_layers, "scaling_layers": scaling_layers,
            "vision_layers": config.vision.num_hidden_layers, "audio_blocks": config.audio.num_blocks,
            "hidden_size": config.text.hidden_size, "intermediate_size": config.text.intermediate_size,
            "vocab_size": config.text.vocab_size, "threads": args.threads, "new_tokens": args.new_tokens,
            "repeats": args.repeats, "budget_s": args.budget, "rounds": args.rounds,
            "prompts": {p.name: {"mode": p.mode, "text": p.text, "images": list(p.images), "audios": list(p.audios)}
                        for p in prompts},
            "checkpoints": {str(k): str(v) for k, v in checkpoints.items()},
            "builds": builds, "setup_s": setup_s, "measure_s": measure_s, "builder_fingerprint": fingerprint,
            "logits_positions": logits_dims, "git": _git_state(),
        },
        "bandwidth": bandwidth,
        "decoder_weight_bytes": weights,
        "runs": {str(k): v for k, v in runs.items()},
        "full_depth": full_depth,
        "notes": notes,
    }
    return publish(result, args.out, args.doc)


def make_case(prompt: Prompt, decoder: str, new_tokens: int, args: argparse.Namespace, encoders: bool = False,
              last: bool = False) -> dict[str, Any]:
    """A worker's description of one prompt run (decoder file; `last`: the last-position-logits copy)."""
    return {"name": prompt.name, "key": prompt.name + ("@" + LAST_LOGITS_SUFFIX[1:] if last else ""),
            "text": prompt.text, "images": list(prompt.images), "audios": list(prompt.audios),
            "decoder": decoder, "repeats": args.repeats, "budget_s": args.budget, "new_tokens": new_tokens,
            "encoders": encoders and bool(prompt.images or prompt.audios)}


def measure_full_depth(package: Path, text: list[Prompt], args: argparse.Namespace, work: Path
                       ) -> dict[str, Any] | None:
    """The text prompt on a package of the real depth (one ORT worker, --rounds runs): measured, not extrapolated."""
    if not text:
        return None
    package = package.resolve()
    decoder = VARIANT_FILES["text"]
    config = json.loads((package / "genai_config.json").read_text(encoding="utf-8"))
    graph = decode_weight_bytes(package / decoder)
    precision = "int4" if graph["quantized"] else "fp32"
    prompt = text[0]
    parts = []
    for index in range(args.rounds):
        job = {"backend": "ort", "label": f"ort-{precision}-full-depth-round{index + 1}", "package": str(package),
               "threads": args.threads, "cases": [make_case(prompt, decoder, args.new_tokens, args)]}
        parts.append(run_worker(job, work)[prompt.name])
    return {"package": str(package), "backend": f"ort-{precision}",
            "layers": int(config["model"]["decoder"]["num_hidden_layers"]), "weights": graph,
            "text": merge_runs(parts)}


def _git_state() -> dict[str, Any]:
    def git(*arguments: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *arguments], capture_output=True, text=True)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "modified_files": git("status", "--porcelain").splitlines()}


def publish(result: dict[str, Any], out: Path, doc: Path) -> int:
    """Analyse the measurements of `result`, write the JSON, print the Markdown and put it into `doc`."""
    runs = {int(layers): value for layers, value in result["runs"].items()}
    setup = result["setup"]
    result["analysis"] = analyse(runs, result["decoder_weight_bytes"], result["bandwidth"], setup["text_layers"],
                                 setup["scaling_layers"], setup["vocab_size"])
    if result.get("full_depth"):
        full = analyse_full_depth(result["full_depth"], result["analysis"]["rows"], result["bandwidth"])
        result["analysis"]["full_depth"] = full
        result["analysis"]["targets"] += full["targets"]
    write_json(out, result)
    markdown = report_markdown(result)
    print("\n" + markdown + "\n")
    print(f"results written to {out} (measurement {setup['measure_s'] / 60:.1f} min, setup "
          f"{setup['setup_s'] / 60:.1f} min)")
    if str(doc) not in ("", "."):
        replace_markdown_section(doc, "## Machine", machine_markdown(result["machine"]))
        replace_markdown_section(doc, "## Run time", markdown)
        print(f"'Machine' and 'Run time' sections of {doc} rewritten")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        raise SystemExit(_worker_main(sys.argv[2], sys.argv[3]))
    if len(sys.argv) > 1 and sys.argv[1] == "--build-worker":
        raise SystemExit(_build_worker(*sys.argv[2:6]))
    raise SystemExit(main())
