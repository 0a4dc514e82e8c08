"""--extra_options: the one table of accepted keys, each parsed and checked before anything is built.

Names, values and meanings are the stock onnxruntime-genai 0.18 builder's (`python -m onnxruntime_genai.models.builder
--help`, `quantization/quant_config.py`). A key not in `EXTRA_OPTIONS` is refused with one line that names it, and with
the reason when the plugin knows one (`REFUSED`, the old `int4_*` names).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from builder_plugin.errors import InputError
from builder_plugin.precisions import DEFAULT_BLOCK_SIZE, QUANTIZED_PRECISIONS
from builder_plugin.quant_choices import ALGO_CONFIGS, BLOCK_SIZES, MIXED_SELECTORS, OP_TYPES, QUANT_TYPE_BITS

_BOOL_WORDS = {"1": True, "true": True, "True": True, "0": False, "false": False, "False": False}


def _choice(choices: Mapping[str, Any] | tuple[Any, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"choose from {', '.join(map(str, choices))}")
        return text

    return parse


def _int_in(choices: tuple[int, ...]) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) not in choices:
            raise ValueError(f"choose from {', '.join(map(str, choices))}")
        return int(text)

    return parse


def _bool(text: str) -> bool:
    if text not in _BOOL_WORDS:
        raise ValueError("must be true/True/1 or false/False/0")
    return _BOOL_WORDS[text]


def _mixed_precision(text: str) -> dict[str, str]:
    """'selector:quant_type[,...]', as quant_config._normalize_mixed_precision reads it."""
    placement = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        selector, sep, quant_type = (part.strip() for part in entry.partition(":"))
        if not sep:
            raise ValueError(f"entries are selector:quant_type, got {entry!r}")
        if selector not in MIXED_SELECTORS:
            raise ValueError(f"selector {selector!r} is not one of {', '.join(MIXED_SELECTORS)}")
        if quant_type not in QUANT_TYPE_BITS:
            raise ValueError(f"quant type {quant_type!r} is not one of {', '.join(QUANT_TYPE_BITS)}")
        placement[selector] = quant_type
    return placement


def _node_names(text: str) -> frozenset[str]:
    return frozenset(filter(None, (name.strip() for name in text.split(","))))


def _op_types(text: str) -> tuple[str, ...]:
    op_types = tuple(filter(None, (op.strip() for op in text.split("/"))))
    if not op_types or any(op not in OP_TYPES for op in op_types):
        raise ValueError(f"'/'-separated op types from {', '.join(OP_TYPES)}")
    if "MatMul" not in op_types:
        # The embedding reads the lm_head's table (quantized with the MatMuls): Gather alone has no meaning here.
        raise ValueError("must include MatMul (the embedding's Gather always shares the lm_head's table)")
    return op_types


@dataclass(frozen=True)
class ExtraOption:
    parse: Callable[[str], Any]
    default: Any  # None: chosen by precision / execution provider (see BuildOptions)
    meaning: str


EXTRA_OPTIONS: dict[str, ExtraOption] = {
    "algo_config": ExtraOption(_choice(ALGO_CONFIGS), None, "quantization method (+ implied mixed precision)"),
    "matmul_mixed_precision": ExtraOption(_mixed_precision, {}, "selector:int4|int8 pairs"),
    "block_size": ExtraOption(_int_in(BLOCK_SIZES), DEFAULT_BLOCK_SIZE, "weights per block along K"),
    "accuracy_level": ExtraOption(_int_in((0, 1, 2, 3, 4)), None, "MatMulNBits compute accuracy"),
    "is_symmetric": ExtraOption(_bool, True, "symmetric (int) or asymmetric (uint) blocks"),
    "nodes_to_exclude": ExtraOption(_node_names, frozenset(), "comma-separated MatMul node names kept float"),
    "op_types_to_quantize": ExtraOption(_op_types, ("MatMul",), "MatMul (or MatMul/Gather)"),
}

REFUSED: dict[str, str] = {
    "exclude_embeds": "set by builder_plugin (the decoder always takes inputs_embeds from the embedding graph)",
    "prune_lm_head": "set by builder_plugin (the decoder computes last-position logits only)",
    "filename": "set by builder_plugin (file names are fixed by the package layout)",
    "shared_embeddings": "set by builder_plugin (the embedding always reads the lm_head's table)",
    "use_qdq": "not supported: weights are quantized to MatMulNBits (QOperator) only",
}


def check_extra_options(raw: Mapping[str, str], precision: str) -> dict[str, Any]:
    """Every key parsed (defaults filled in except the by-precision ones); raises InputError naming a bad key."""
    for key, text in raw.items():
        if key in EXTRA_OPTIONS:
            try:
                EXTRA_OPTIONS[key].parse(str(text))
            except ValueError as exc:
                raise InputError(f"--extra_options {key}={text}: {exc}") from None
            if precision not in QUANTIZED_PRECISIONS:
                raise InputError(f"--extra_options {key} applies to -p int4 and -p int8 only, not -p {precision}")
        elif key in REFUSED:
            raise InputError(f"--extra_options {key}: {REFUSED[key]}")
        elif key.startswith("int4_") and key[5:] in EXTRA_OPTIONS:
            raise InputError(f"--extra_options {key} is the old name of {key[5:]} (the 0.18 builder ignores it); "
                             f"use {key[5:]}")
        else:
            raise InputError(f"unknown --extra_options key {key!r}; accepted: {', '.join(EXTRA_OPTIONS)}")
    return {key: EXTRA_OPTIONS[key].parse(str(raw[key])) if key in raw else option.default
            for key, option in EXTRA_OPTIONS.items()}
