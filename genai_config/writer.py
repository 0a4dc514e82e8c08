"""genai_config.json for the phi4mm runtime, generated from the component I/O specs.

A leaf module: it imports only the spec types and the parsed config, never the builders, so every file name and
tensor name in the config comes from the same specs the graphs were checked against.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from builder_plugin.config import Phi4MMConfig
from builder_plugin.layout import INPUT_IDS, LOGITS, RUNNABLE_MINIMUM, SPEECH_PROCESSOR_FILE, VISION_PROCESSOR_FILE
from builder_plugin.spec import Component, IOSpec, TensorSpec

# KV buffer per token for the real model is 256 KiB in fp32; this keeps the preallocated cache at a few GiB while
# leaving room for the largest single image (~9.6k tokens) plus an answer.
DEFAULT_MAX_LENGTH = 16384
# An app that turns do_sample on without a top_k of its own samples as transformers does for a generation config
# without one (GenerationConfig's default, also the stock builder's): Phi-4-multimodal-instruct's has none.
DEFAULT_TOP_K = 50

PROVIDER_OPTIONS: dict[str, list[dict[str, Any]]] = {
    "cpu": [],
    "cuda": [{"cuda": {"enable_cuda_graph": "0"}}],
    "dml": [{"dml": {}}],
    "webgpu": [{"webgpu": {}}],
}

# On cpu a session whose weights are all float runs with prepacking off: onnxruntime then computes on the weights where
# it mapped them from the .data file (page cache: shared, reclaimable, read on first use) instead of holding a packed
# copy of every one of them in the process. A float MatMul decodes a few percent slower so; a MatMulNBits would
# fall back to a path over a hundred times slower, so quantized graphs keep prepacking.
UNPACKED_WEIGHTS_ENTRIES = {"session.disable_prepacking": "1"}

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def default_max_length(config: Phi4MMConfig) -> int:
    return min(DEFAULT_MAX_LENGTH, config.text.max_position_embeddings)


def _io_names(specs: tuple[TensorSpec, ...]) -> dict[str, str]:
    """genai_config key -> graph tensor name; per-layer tensors collapse into one `%d` template."""
    names: dict[str, str] = {}
    for spec in specs:
        if _LAYER_INDEX.search(spec.name):
            template = _LAYER_INDEX.sub(".%d.", spec.name, count=1)
            key = spec.genai_key or _kv_key(template)
            names.setdefault(key, template)
        else:
            names[spec.genai_key or spec.name] = spec.name
    return names


def _kv_key(template: str) -> str:
    kind = "key" if template.endswith("key") else "value"
    role = "present" if template.startswith("present") else "past"
    return f"{role}_{kind}_names"


def make_genai_config(
    config: Phi4MMConfig,
    specs: Mapping[Component, IOSpec],
    filenames: Mapping[Component, str],
    execution_provider: str = "cpu",
    max_length: int | None = None,
    share_kv_buffer: bool = True,
    generation: Mapping[str, Any] | None = None,
    provider_options: list[dict[str, Any]] | None = None,
    prepacking: Mapping[Component, bool] | None = None,
) -> dict[str, Any]:
    """The genai_config.json content. `specs`/`filenames` must cover decoder, embedding and vision; speech is
    optional (without it the speech section only disables speech, as the runtime requires). `provider_options`
    defaults to PROVIDER_OPTIONS[execution_provider]; the build passes the decoder builder's own. `prepacking` says
    which components' graphs want onnxruntime's CPU prepacking (True: MatMulNBits) and which run unpacked (False: all
    MatMul weights float; on cpu their sessions get UNPACKED_WEIGHTS_ENTRIES); the others follow the decoder's."""
    missing = [c.value for c in Component if c in RUNNABLE_MINIMUM and c not in specs]
    if missing:
        raise ValueError(f"a phi4mm package needs the {' and '.join(missing)} model")
    text = config.text
    decoder = specs[Component.DECODER]
    logits = decoder.output(LOGITS)
    vocab = logits.shape[-1] if isinstance(logits.shape[-1], int) else text.vocab_size
    if provider_options is None:
        provider_options = PROVIDER_OPTIONS[execution_provider]
    session = {"log_id": "onnxruntime-genai", "provider_options": provider_options}
    unpacked = {**session, **UNPACKED_WEIGHTS_ENTRIES}
    prepacking = prepacking or {}

    def session_of(component: Component, otherwise: dict[str, Any]) -> dict[str, Any]:
        if execution_provider != "cpu" or component not in prepacking:
            return otherwise
        return session if prepacking[component] else unpacked

    model: dict[str, Any] = {
        "type": "phi4mm",
        "vocab_size": vocab,
        "context_length": text.max_position_embeddings,
        "bos_token_id": config.bos_token_id,
        "pad_token_id": config.pad_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "decoder": {
            "session_options": session_of(Component.DECODER, session),
            "filename": filenames[Component.DECODER],
            "hidden_size": text.hidden_size,
            "head_size": text.head_dim,
            "num_attention_heads": text.num_attention_heads,
            "num_key_value_heads": text.num_key_value_heads,
            "num_hidden_layers": text.num_hidden_layers,
            "inputs": _io_names(decoder.inputs),
            "outputs": _io_names(decoder.outputs),
        },
        "embedding": _section(specs[Component.EMBEDDING], filenames[Component.EMBEDDING]),
        "vision": _section(specs[Component.VISION], filenames[Component.VISION], VISION_PROCESSOR_FILE),
        "speech": (
            _section(specs[Component.SPEECH], filenames[Component.SPEECH], SPEECH_PROCESSOR_FILE)
            if Component.SPEECH in specs
            else {"config_filename": ""}
        ),
    }
    for component in (Component.EMBEDDING, Component.VISION, Component.SPEECH):
        own = session_of(component, model["decoder"]["session_options"])
        if component in specs and own != model["decoder"]["session_options"]:
            model[component.value] = {"session_options": own, **model[component.value]}
    embedding_ids = specs[Component.EMBEDDING].inputs[0].name
    if embedding_ids != model["decoder"]["inputs"].get(INPUT_IDS, INPUT_IDS):
        raise ValueError("the embedding graph must take its ids under the decoder's input_ids name")

    gen = dict(generation or {})
    search = {
        "diversity_penalty": 0.0,
        "do_sample": bool(gen.get("do_sample", False)),
        "early_stopping": True,
        "length_penalty": 1.0,
        "max_length": int(max_length or default_max_length(config)),
        "min_length": 0,
        "no_repeat_ngram_size": 0,
        "num_beams": 1,
        "num_return_sequences": 1,
        "past_present_share_buffer": share_kv_buffer,
        "repetition_penalty": float(gen.get("repetition_penalty", 1.0)),
        "temperature": float(gen.get("temperature", 1.0)),
        "top_k": int(gen.get("top_k", DEFAULT_TOP_K)),
        "top_p": float(gen.get("top_p", 1.0)),
    }
    if search["max_length"] > text.max_position_embeddings:
        raise ValueError(
            f"max_length {search['max_length']} exceeds the model's context length {text.max_position_embeddings}"
        )
    return {"model": model, "search": search}


def _section(spec: IOSpec, filename: str, config_filename: str | None = None) -> dict[str, Any]:
    section: dict[str, Any] = {"filename": filename}
    if config_filename:
        section["config_filename"] = config_filename
    section["inputs"] = _io_names(spec.inputs)
    section["outputs"] = _io_names(spec.outputs)
    return section


def write_json(path: Path, content: Mapping[str, Any]) -> Path:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return path
