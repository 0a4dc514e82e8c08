"""Which decoder files a build makes: one variant per file, with the LoRA adapters it runs or merges."""

from __future__ import annotations

from dataclasses import dataclass

from builder_plugin.components.decoder.mode_routing import ROUTED_ADAPTERS
from builder_plugin.config import Phi4MMConfig
from builder_plugin.errors import DecoderBuildError
from builder_plugin.layout import INPUT_MODES, MAIN_DECODER, SPLIT_DECODERS
from builder_plugin.options import BuildOptions

# The LoRA of each input mode's decoder in a split build, in the order they are built and written (the main decoder,
# the one genai_config.json names, first).
SPLIT_LORAS: dict[str, str] = {"vision": "vision", "speech": "speech", "text": "none"}


@dataclass(frozen=True)
class DecoderVariant:
    """One decoder graph: which adapters run as LoRA branches, or which one is merged into the base weights."""

    filename: str
    mode: str  # "routed" | "vision" | "speech" | "none" | "vision+speech"
    adapters: tuple[str, ...] = ()
    merged: str | None = None

    @property
    def self_routing(self) -> bool:
        """One graph for every input mode, choosing its adapter from the placeholder ids (`mode_routing`)."""
        return self.mode == "routed"


def decoder_variants(config: Phi4MMConfig, options: BuildOptions) -> tuple[DecoderVariant, ...]:
    """The decoder files `options.lora` / `options.merge_lora` ask for; the first is the one genai_config names."""
    lora = options.lora
    if options.merge_lora:
        if lora not in ("vision", "speech"):
            raise DecoderBuildError(
                f"merge_lora folds exactly one adapter into the base weights: use it with lora 'vision' or 'speech', "
                f"not {lora!r}"
            )
        _require_adapters(config, (lora,))
        return (DecoderVariant(MAIN_DECODER, lora, merged=lora),)
    if lora == "routed":
        _require_adapters(config, ROUTED_ADAPTERS)
        return (DecoderVariant(MAIN_DECODER, "routed", adapters=ROUTED_ADAPTERS),)
    if lora == "split":
        _require_adapters(config, ("vision", "speech"))
        return tuple(DecoderVariant(SPLIT_DECODERS[mode], lora, adapters=() if lora == "none" else (lora,))
                     for mode, lora in SPLIT_LORAS.items())
    if lora == "none":
        return (DecoderVariant(MAIN_DECODER, "none"),)
    adapters = tuple(lora.split("+"))
    if any(a not in ("vision", "speech") for a in adapters):
        raise DecoderBuildError(f"unknown lora choice {lora!r}")
    _require_adapters(config, adapters)
    return (DecoderVariant(MAIN_DECODER, lora, adapters=adapters),)


def _require_adapters(config: Phi4MMConfig, names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in config.loras]
    if missing:
        raise DecoderBuildError(
            f"the checkpoint has no {' / '.join(missing)} LoRA adapter (has: {sorted(config.loras) or 'none'}); "
            "use --lora none"
        )


@dataclass(frozen=True)
class DecoderRuntimeSettings:
    """What genai_config.json needs from the builder for the decoder section and the search options."""

    filename: str  # the decoder genai_config.json names
    variants: dict[str, str]  # input mode -> decoder file ("routed", "vision", "speech", "none", or the mode built)
    past_present_share_buffer: bool
    provider_options: tuple[dict[str, dict[str, str]], ...]
    context_length: int
    hidden_size: int
    head_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    io_dtype: str
    attention_op: str
    has_position_ids: bool

    def decoders_by_mode(self) -> tuple[str, dict[str, str]]:
        """How the decoder files answer the runtime's input modes: (routing, {mode: file}) for the manifest."""
        if set(self.variants) == {"vision", "speech", "none"}:
            return "split", dict(SPLIT_DECODERS)
        routing = "self" if set(self.variants) == {"routed"} else "fixed"
        return routing, dict.fromkeys(INPUT_MODES, self.filename)
