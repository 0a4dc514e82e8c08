"""Decoder build benchmark: our lazy, streaming int4 path against the stock GenAI builder's whole-graph path.

    python -m benchmarks.bench_decoder_build [--work DIR] [--modes ours,ours-routed,stock] [--no-latency]
        [--latency-only] [--repeat N]

The checkpoint is the full-width model cut to 2 text layers (real hidden/intermediate/vocab sizes), generated once
into the work folder by `make_checkpoint(preset="full", text_layers=2, vision_layers=1, audio_blocks=1)`.

Every measurement runs in its own process (peak RSS = the process's ru_maxrss, which includes the ~0.5 GB of imports):

- ``ours``: DecoderBuilder, int4 cpu, ``--lora vision`` (one decoder, vision LoRA branches), written by PackageWriter.
- ``ours-routed``: the same for ``--lora routed`` (one self-routing decoder holding both adapters).
- ``stock``: onnxruntime-genai 0.18.0's own ``Phi4MMModel`` driven through its Model API (the builder class
  constructed directly and handed a module tree holding the checkpoint tensors as ``from_pretrained`` would: stored
  dtype, PEFT-style vision LoRA modules), ``make_model`` then ``save_model``, i.e. ``to_nbits`` on the whole graph and
  ``ir.save``.
- ``run`` (latency): onnxruntime CPU session load, a 64-token prefill and 16 cached decode steps for the ``ours`` and
  ``stock`` decoders (both int4 with the vision LoRA: packed-qkv LoRA branches vs the stock unpacked q/k/v path),
  alternated ``--repeat`` times (median kept), with onnxruntime's profiler splitting decode kernel time between the
  decoder layers and the lm_head (which dominates a 2-layer model).

Results go to benchmarks/results/decoder_build.json (a partial rerun updates only what it measures) and are printed as
a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, ROOT, current_rss_bytes, peak_rss_bytes, rss_split
from builder_plugin.layout import DATA_FILES, MAIN_DECODER, Component

RESULTS = RESULTS_DIR / "decoder_build.json"
DEFAULT_WORK = Path(tempfile.gettempdir()) / "bench_decoder"
MODES = ("ours", "ours-routed", "stock")
PREFILL_TOKENS = 64
DECODE_STEPS = 16


def _files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def _op_counts(path: Path) -> dict[str, int]:
    import onnx

    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _build_result(out: Path, start: float, imported: float, graphs: float, saved: float, rss_imported: int
                  ) -> dict[str, Any]:
    """Phase times (perf_counter marks), memory and output of one build worker."""
    return {
        "import_s": imported - start,
        "graph_s": graphs - imported,
        "quantize_and_write_s": saved - graphs,
        "build_s": saved - imported,
        "rss_after_import_bytes": rss_imported,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_at_end": rss_split(),
        "files": _files(out),
        "ops": _op_counts(out / MAIN_DECODER),
    }


# ----------------------------------------------------------------------------------------------------------------
# Workers (each runs in a fresh process)


def worker_ours(checkpoint: Path, out: Path, lora: str) -> dict[str, Any]:
    start = time.perf_counter()
    from builder_plugin.build import build_component
    from builder_plugin.checkpoint.reader import CheckpointReader
    from builder_plugin.checkpoint.routing import route_weights
    from builder_plugin.components.decoder import DecoderBuilder, genai_builder_class
    from builder_plugin.config import Phi4MMConfig
    from builder_plugin.options import BuildOptions
    from builder_plugin.package import PackageWriter

    genai_builder_class()
    imported = time.perf_counter()
    rss_imported = current_rss_bytes()

    config = Phi4MMConfig.from_dir(checkpoint)
    weights = route_weights(CheckpointReader(checkpoint, config.source_format), config)[Component.DECODER]
    options = BuildOptions(model_dir=checkpoint, output_dir=out, precision="int4", execution_provider="cpu", lora=lora)
    models = build_component(DecoderBuilder(config, options), weights).graphs
    graphs = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    writer = PackageWriter(out, progress=False)
    for filename, model in models.items():
        writer.save(model, filename, DATA_FILES[Component.DECODER])
    saved = time.perf_counter()
    store = writer.stores[DATA_FILES[Component.DECODER]]
    return {**_build_result(out, start, imported, graphs, saved, rss_imported),
            "data_written_bytes": store.written_bytes, "data_deduplicated_bytes": store.reused_bytes}


def _stock_tree(weights: dict, config: Any) -> Any:
    """What `AutoModelForCausalLM.from_pretrained` + PEFT would hand the stock builder: real tensors in the stored
    dtype, the text layers with PEFT-style LoRA modules (``lora_A``/``lora_B`` dicts keyed by adapter name, as the stock
    class walks them). Vision LoRA only: the stock class
    ignores the speech adapter."""
    import torch

    text = config.text
    lora = config.loras["vision"]

    def tensor(name: str) -> torch.nn.Parameter:
        return torch.nn.Parameter(weights[name].load(None), requires_grad=False)

    def linear(weight: torch.nn.Parameter) -> torch.nn.Linear:
        module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        module.weight = weight
        return module

    class LoraLinear(torch.nn.Module):
        def __init__(self, prefix: str) -> None:
            super().__init__()
            self.base_layer = linear(tensor(f"{prefix}.weight"))
            self.lora_A = torch.nn.ModuleDict({"vision": linear(tensor(f"{prefix}.lora_A.vision.weight"))})
            self.lora_B = torch.nn.ModuleDict({"vision": linear(tensor(f"{prefix}.lora_B.vision.weight"))})
            self.scaling = {"vision": lora.scaling}

        @property
        def weight(self) -> torch.Tensor:
            return self.base_layer.weight

        @property
        def bias(self) -> None:
            return None

    class Norm(torch.nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.weight = tensor(name)

    class Attention(torch.nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.qkv_proj = LoraLinear(f"layers.{i}.self_attn.qkv_proj")
            self.o_proj = LoraLinear(f"layers.{i}.self_attn.o_proj")

    class MLP(torch.nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.gate_up_proj = LoraLinear(f"layers.{i}.mlp.gate_up_proj")
            self.down_proj = LoraLinear(f"layers.{i}.mlp.down_proj")

    class Phi4MMDecoderLayer(torch.nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.input_layernorm = Norm(f"layers.{i}.input_layernorm.weight")
            self.self_attn = Attention(i)
            self.post_attention_layernorm = Norm(f"layers.{i}.post_attention_layernorm.weight")
            self.mlp = MLP(i)

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(text.vocab_size, text.hidden_size, device="meta")
            self.layers = torch.nn.ModuleList(Phi4MMDecoderLayer(i) for i in range(text.num_hidden_layers))
            self.norm = Norm("norm.weight")

    class Root(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()
            self.lm_head = linear(tensor("embed_tokens.weight"))  # tied

    return Root()


def worker_stock(checkpoint: Path, out: Path) -> dict[str, Any]:
    start = time.perf_counter()
    import onnx_ir as ir

    # isort: off
    import onnxruntime_genai.models.builder  # noqa: F401  - first, for the top-level `builders` modules
    from builders.phi import Phi4MMModel
    # isort: on

    from builder_plugin.checkpoint.reader import CheckpointReader
    from builder_plugin.checkpoint.routing import route_weights
    from builder_plugin.components.decoder import genai_text_config
    from builder_plugin.config import Phi4MMConfig

    imported = time.perf_counter()
    rss_imported = current_rss_bytes()
    config = Phi4MMConfig.from_dir(checkpoint)
    weights = route_weights(CheckpointReader(checkpoint, config.source_format), config)[Component.DECODER]

    class StockPhi4MM(Phi4MMModel):
        def load_weights(self, input_path: str) -> Any:
            return _stock_tree(weights, config)

    out.mkdir(parents=True, exist_ok=True)
    builder = StockPhi4MM(genai_text_config(config), ir.DataType.FLOAT, ir.DataType.INT4, "cpu",
                          str(out / "cache"), {"exclude_embeds": True, "filename": MAIN_DECODER})
    builder.make_model(str(checkpoint))
    graphs = time.perf_counter()
    builder.save_model(str(out))
    saved = time.perf_counter()
    return _build_result(out, start, imported, graphs, saved, rss_imported)


def worker_run(checkpoint: Path, decoder: Path) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort

    from builder_plugin.config import Phi4MMConfig

    text = Phi4MMConfig.from_dir(checkpoint).text
    rss_start = current_rss_bytes()
    start = time.perf_counter()
    options = ort.SessionOptions()
    options.enable_profiling = True  # per-node kernel times: the decoder layers apart from the lm_head
    options.profile_file_prefix = str(decoder.parent / "ort_profile")
    session = ort.InferenceSession(str(decoder), options, providers=["CPUExecutionProvider"])
    loaded = time.perf_counter()
    outputs = [o.name for o in session.get_outputs()]
    rng = np.random.default_rng(0)
    max_length = PREFILL_TOKENS + DECODE_STEPS
    layers = text.num_hidden_layers
    shape = (1, text.num_key_value_heads, max_length, text.head_dim)
    past = {f"past_key_values.{n}.{k}": np.zeros(shape, np.float32) for n in range(layers) for k in ("key", "value")}
    hidden = text.hidden_size

    def step(embeds: np.ndarray, total: int, past: dict) -> dict:
        feeds = {"inputs_embeds": embeds, "attention_mask": np.ones((1, total), np.int64), **past}
        return dict(zip(outputs, session.run(None, feeds)))

    t0 = time.perf_counter()
    result = step(rng.standard_normal((1, PREFILL_TOKENS, hidden)).astype(np.float32) * 0.02, PREFILL_TOKENS, past)
    t1 = time.perf_counter()
    for i in range(DECODE_STEPS):
        past = {f"past_key_values.{n}.{k}": result[f"present.{n}.{k}"] for n in range(layers) for k in ("key", "value")}
        result = step(rng.standard_normal((1, 1, hidden)).astype(np.float32) * 0.02, PREFILL_TOKENS + i + 1, past)
    t2 = time.perf_counter()
    profile = Path(session.end_profiling())
    events = json.loads(profile.read_text())
    profile.unlink()
    runs = sorted(e["ts"] + e["dur"] for e in events if e.get("name") == "model_run")
    kernel_us = {"layers": 0, "lm_head": 0}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] > runs[0]:
            kernel_us["lm_head" if "/lm_head/" in event["name"] else "layers"] += event["dur"]
    return {
        "session_load_s": loaded - start,
        "prefill_s": t1 - t0,
        "decode_ms_per_token": (t2 - t1) * 1000 / DECODE_STEPS,
        "decode_layers_kernel_ms_per_token": kernel_us["layers"] / 1000 / DECODE_STEPS,
        "decode_lm_head_kernel_ms_per_token": kernel_us["lm_head"] / 1000 / DECODE_STEPS,
        "session_rss_bytes": current_rss_bytes() - rss_start,
        "peak_rss_bytes": peak_rss_bytes(),
    }


# ----------------------------------------------------------------------------------------------------------------
# Driver


def _spawn(args: list[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", __spec__.name, *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    return result


def _gb(value: int) -> str:
    return f"{value / 1e9:.2f}"


def _table(results: dict[str, Any]) -> str:
    rows = [("mode", "build s", "import s", "peak RSS GB", "data GB", ".onnx MB", "MatMulNBits")]
    for mode, r in results["builds"].items():
        data = sum(v for k, v in r["files"].items() if k.endswith(".data"))
        onnx_files = sum(v for k, v in r["files"].items() if k.endswith(".onnx"))
        rows.append((mode, f"{r['build_s']:.1f}", f"{r['import_s']:.1f}", _gb(r["peak_rss_bytes"]), _gb(data),
                     f"{onnx_files / 1e6:.1f}", str(r["ops"].get("MatMulNBits", 0))))
    lines = _format(rows)
    if results.get("latency"):
        rows = [("decoder", "session load s", f"prefill {PREFILL_TOKENS} s", "decode ms/token",
                 "of which layers / lm_head", "session RSS GB")]
        for mode, r in results["latency"].items():
            rows.append((mode, f"{r['session_load_s']:.2f}", f"{r['prefill_s']:.3f}",
                         f"{r['decode_ms_per_token']:.1f}",
                         f"{r['decode_layers_kernel_ms_per_token']:.1f} / "
                         f"{r['decode_lm_head_kernel_ms_per_token']:.1f}",
                         _gb(r["session_rss_bytes"])))
        lines += ["", *_format(rows)]
    return "\n".join(lines)


def _format(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="checkpoint and outputs (default %(default)s)")
    parser.add_argument("--checkpoint", type=Path, help="use this checkpoint instead of generating one")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--latency-only", action="store_true", help="rerun only the latency part on existing outputs")
    parser.add_argument("--repeat", type=int, default=3, help="latency runs per decoder, alternating (median kept)")
    parser.add_argument("--worker", choices=(*MODES, "run"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        if args.worker == "run":
            result = worker_run(args.checkpoint, args.out)
        elif args.worker == "stock":
            result = worker_stock(args.checkpoint, args.out)
        else:
            result = worker_ours(args.checkpoint, args.out, "routed" if args.worker == "ours-routed" else "vision")
        print(json.dumps(result))
        return 0

    checkpoint = args.checkpoint or args.work / "full-2layer"
    if not checkpoint.is_dir():
        from builder_plugin.testing.make_checkpoint import make_checkpoint

        print(f"generating {checkpoint} ...", flush=True)
        make_checkpoint(checkpoint, preset="full", text_layers=2, vision_layers=1, audio_blocks=1)
    results: dict[str, Any] = {"checkpoint": str(checkpoint), "precision": "int4", "execution_provider": "cpu",
                               "builds": {}, "latency": {}}
    if RESULTS.is_file():  # a partial rerun (--modes, --latency-only) updates only what it measures
        previous = json.loads(RESULTS.read_text(encoding="utf-8"))
        if previous.get("checkpoint") == str(checkpoint):
            results = previous
    for mode in [] if args.latency_only else args.modes.split(","):
        out = args.work / f"out-{mode}"
        if out.exists():
            import shutil

            shutil.rmtree(out)
        print(f"building: {mode} ...", flush=True)
        results["builds"][mode] = _spawn(["--worker", mode, "--checkpoint", str(checkpoint), "--out", str(out)])
    if not args.no_latency:
        # Alternate the decoders and keep each one's median run: a shared host's load drifts between runs.
        samples: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.repeat):
            for mode in ("ours", "stock"):
                if mode in results["builds"]:
                    print(f"running: {mode} ...", flush=True)
                    samples.setdefault(mode, []).append(_spawn(
                        ["--worker", "run", "--checkpoint", str(checkpoint), "--out",
                         str(args.work / f"out-{mode}" / MAIN_DECODER)]))
        results["latency"] = {}
        for mode, runs in samples.items():
            runs.sort(key=lambda r: r["decode_ms_per_token"])
            results["latency"][mode] = dict(runs[len(runs) // 2], runs=len(runs))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(_table(results))
    print(f"\nwritten to {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
