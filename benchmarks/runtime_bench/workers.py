"""The timed runs of the run-time benchmark. Each engine's cases run in a subprocess of their own (bench_runtime.py
--worker JOB RESULT), so every engine has its own memory and peak RSS: onnxruntime-genai (one model load per decoder
variant) or the PyTorch reference (the input mode's LoRA merged), plus the encoders alone, in turn."""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_session, peak_rss_bytes, reset_peak_rss, summarize, time_in_turn, write_json
from benchmarks.runtime_bench import MODULE
from benchmarks.runtime_bench.prepare import Prompt
from builder_plugin.layout import GENAI_CONFIG_FILE, GRAPH_FILES, Component
from builder_plugin.runtime.threads import thread_overlay

WARM_UP_PROMPT = "<|user|>Hello there.<|end|><|assistant|>"


def make_case(prompt: Prompt, decoder: str, new_tokens: int, repeats: int, budget_s: float,
              encoders: bool = False) -> dict[str, Any]:
    """A worker's description of one prompt run (`decoder`: the decoder file, "" for PyTorch)."""
    return {"name": prompt.name, "text": prompt.text, "images": list(prompt.images), "audios": list(prompt.audios),
            "decoder": decoder, "repeats": repeats, "budget_s": budget_s, "new_tokens": new_tokens,
            "encoders": encoders and bool(prompt.images or prompt.audios)}


def _eos_ids(package_or_checkpoint: Path) -> list[int]:
    config = package_or_checkpoint / GENAI_CONFIG_FILE
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
        overlay = thread_overlay(json.loads((package / GENAI_CONFIG_FILE).read_text(encoding="utf-8")), threads)
        overlay["decoder"]["filename"] = decoder  # every session gets the threads, as Chat gives them
        config.overlay(json.dumps({"model": overlay}))
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
            results[case["name"]] = _ort_case(og, model, processor, case, eos, load_s, decoder)
            _progress(job["label"], case["name"], results[case["name"]])
        for case in cases:
            results[case["name"]]["peak_rss_bytes"] = peak_rss_bytes()  # of the whole variant group
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

    filename = GRAPH_FILES[Component.VISION if case["images"] else Component.SPEECH]
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

    from builder_plugin.reference.model import Reference
    from tests.support.processor import processor_inputs

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
        results[case["name"]] = _torch_case(reference, step, case, checkpoint, int(job["threads"]), eos, load_s)
        _progress(job["label"], case["name"], results[case["name"]])
    for value in results.values():
        value["peak_rss_bytes"] = peak_rss_bytes()
    return results


def _torch_case(reference: Any, step: Any, case: dict[str, Any], checkpoint: Path, threads: int, eos: list[int],
                load_s: float) -> dict[str, Any]:
    """One prompt through the PyTorch reference: up to case["repeats"] prefills, the first run also decoding."""
    import numpy as np
    import torch
    from transformers.cache_utils import DynamicCache

    from tests.support.processor import processor_inputs

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
    subprocess.run([sys.executable, "-m", MODULE, "--worker", str(job_file), str(result_file)], check=True)
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


def worker_main(job_file: str, result_file: str) -> int:
    """The --worker subprocess: the cases of one job file, results written to `result_file`."""
    job = json.loads(Path(job_file).read_text())
    result = _torch_worker(job) if job["backend"] == "torch" else _ort_worker(job)
    write_json(result_file, result)
    return 0

