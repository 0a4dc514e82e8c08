"""The run-time benchmark's report: the analysis added to the result, the JSON written, the Markdown tables printed
and put into the "Machine" and "Run time" sections of the docs file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import GB, fmt, machine_markdown, markdown_table, replace_markdown_section, write_json
from benchmarks.runtime_bench import REAL_TEXT_LAYERS
from benchmarks.runtime_bench.analysis import PLAUSIBLE_BANDWIDTH_FACTOR, analyse, analyse_full_depth, read_and_copy


def publish(result: dict[str, Any], out: Path, doc: str | Path) -> int:
    """Analyse the measurements of `result`, write the JSON, print the Markdown and put it into `doc`."""
    runs = {int(layers): value for layers, value in result["runs"].items()}
    setup = result["setup"]
    result["analysis"] = analyse(runs, result["decoder_weight_bytes"], result["bandwidth"], setup["text_layers"],
                                 setup["scaling_layers"])
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


def _gb(value: float | None) -> str:
    return "" if value is None else f"{value / GB:.2f}"


def _pair(first: float | None, second: float | None, digits: int = 2) -> str:
    return f"{fmt(first, digits)} / {fmt(second, digits)}"


def report_markdown(result: dict[str, Any]) -> str:
    analysis = result["analysis"]
    rows = analysis["rows"]
    setup = result["setup"]
    read, copy = read_and_copy(result["bandwidth"])
    machine = result["machine"]
    est = f"estimate_{REAL_TEXT_LAYERS}_layers"
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
        table.append([
            row["backend"], row["prompt"], row["prompt_tokens"],
            _pair(row["prefill_s_best"], row["prefill_s_median"]),
            _pair(row.get("encoder_s_best"), row.get("encoder_s_median")) if row.get("encoder_s_best") else "",
            _pair(row["decode_tokens_per_s_median"], row["decode_tokens_per_s_best"]),
            _gb(row.get("bytes_per_token")),
            f"{fmt(row['bound_tokens_per_s'], 1)} ({fmt(row['pct_of_bound_median'], 0)}% / "
            f"{fmt(row['pct_of_bound_best'], 0)}%)" if row.get("pct_of_bound_best") else "",
            f"{fmt(row['pct_of_memcpy_bound_best'], 0)}%" if row.get("pct_of_memcpy_bound_best") else "",
            _gb(row.get("peak_rss_bytes")),
        ])
    headers = ["engine", "prompt", "tokens", "prefill s best / median", "encoder s best / median",
               "decode tok/s median / best", "weights GB/step", "bound tok/s (median / best as %)",
               "best as % of memcpy bound", "peak RSS GB"]
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
            ])
        headers = ["engine", "prompt", f"decode tok/s @{REAL_TEXT_LAYERS} median / best",
                   f"bound tok/s @{REAL_TEXT_LAYERS} (median / best as %)",
                   f"prefill s @{REAL_TEXT_LAYERS} best / median"]
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

