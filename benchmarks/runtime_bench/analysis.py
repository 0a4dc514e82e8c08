"""Analysis of the run-time measurements: the memory-bandwidth bound of decode, the fit time(L) = fixed + L x
per_layer behind the 32-layer estimate, the full-depth check and the target rows."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.common import GB, RESULTS_DIR
from benchmarks.runtime_bench import REAL_TEXT_LAYERS, VARIANT_FILES

# A per-layer decode time implying more than this multiple of the numpy read bandwidth is taken as noise: onnxruntime's
# fp32 single-row MatMul has been seen reading up to ~1.3x as fast as the numpy probe, and a faster implied layer means
# the run at the smaller depth was slowed down by background load.
PLAUSIBLE_BANDWIDTH_FACTOR = 1.5


def read_and_copy(bandwidth: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
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
            bandwidth: dict[str, Any], main_layers: int, scaling_layers: int | None) -> dict[str, Any]:
    """Per engine and prompt: the measured numbers, the bandwidth bounds, the 32-layer estimate; then the targets."""
    main = runs[main_layers]
    read, copy = read_and_copy(bandwidth)
    rows: dict[str, dict[str, Any]] = {}
    fits: dict[str, Any] = {}
    for backend, cases in main.items():
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
    read, copy = read_and_copy(bandwidth)
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
    vision = RESULTS_DIR / "vision.json"
    if vision.is_file():
        data = json.loads(vision.read_text())
        for name, case in data.get("cases", {}).items():
            cited.append({"source": "benchmarks/results/vision.json", "case": name,
                          "speedup": case.get("speedup_fused_vs_torch"), "statistic": "median"})
    speech = RESULTS_DIR / "speech.json"
    if speech.is_file():
        data = json.loads(speech.read_text())
        cited.append({"source": "benchmarks/results/speech.json", "case": f"{data.get('clip_seconds')} s clip",
                      "speedup": data.get("torch_over_ort"), "statistic": "median"})
    return cited

