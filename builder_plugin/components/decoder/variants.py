"""Which decoder files a build makes: one variant per file, with the LoRA adapters it runs or merges."""

from __future__ import annotations

from dataclasses import dataclass

from builder_plugin.config import Phi4MMConfig
from builder_plugin.errors import DecoderBuildError
from builder_plugin.layout import INPUT_MODES, MAIN_DECODER, MODE_LORA, SPLIT_DECODERS
from builder_plugin.options import LORA_ADAPTERS, BuildOptions

# The input modes of a split build's decoders in the order they are built and written: the main decoder, the one
# genai_config.json names, first.
SPLIT_ORDER: tuple[str, ...] = ("vision", "speech", "text")


@dataclass(frozen=True)
class DecoderVariant:
    """One decoder graph: which adapters run as LoRA branches, or which one is merged into the base weights."""

    filename: str
    lora: str  # the --lora choice this graph is built for: "routed", "vision", "speech", "none" or "vision+speech"
    adapters: tuple[str, ...] = ()
    merged: str | None = None
    input_mode: str | None = None  # the one input mode it answers (a split build's file), None: every mode

    @property
    def self_routing(self) -> bool:
        """One graph for every input mode, choosing its adapter from the placeholder ids (`mode_routing`)."""
        return self.lora == "routed"


def decoder_variants(config: Phi4MMConfig, options: BuildOptions) -> tuple[DecoderVariant, ...]:
    """The decoder files `options.lora` / `options.merge_lora` ask for; the first is the one genai_config names."""
    lora = options.lora
    if lora not in LORA_ADAPTERS:
        raise DecoderBuildError(f"unknown lora choice {lora!r}")
    if options.merge_lora and lora not in ("vision", "speech"):
        raise DecoderBuildError(
            f"merge_lora folds exactly one adapter into the base weights: use it with lora 'vision' or 'speech', "
            f"not {lora!r}"
        )
    adapters = LORA_ADAPTERS[lora]
    _require_adapters(config, adapters)
    if options.merge_lora:
        return (DecoderVariant(MAIN_DECODER, lora, merged=lora),)
    if lora == "split":
        return tuple(DecoderVariant(SPLIT_DECODERS[mode], MODE_LORA[mode], adapters=LORA_ADAPTERS[MODE_LORA[mode]],
                                    input_mode=mode) for mode in SPLIT_ORDER)
    return (DecoderVariant(MAIN_DECODER, lora, adapters=adapters),)


def _require_adapters(config: Phi4MMConfig, names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in config.loras]
    if missing:
        raise DecoderBuildError(
            f"the checkpoint has no {' / '.join(missing)} LoRA adapter (has: {sorted(config.loras) or 'none'}); "
            "use --lora none"
        )


def decoders_by_input_mode(variants: tuple[DecoderVariant, ...]) -> tuple[str, dict[str, str]]:
    """manifest.json's routing and decoder file per input mode: one self-routing decoder for every mode, a split
    build's file per mode, or one fixed decoder for every mode."""
    decoders = {mode: next(v.filename for v in variants if v.input_mode in (mode, None)) for mode in INPUT_MODES}
    if variants[0].self_routing:
        return "self", decoders
    return ("split" if any(v.input_mode for v in variants) else "fixed"), decoders
