"""The decoder plan of a build: which decoder files it makes (one variant per file, with the LoRA adapters it runs or
merges) and which file answers each input mode. Computed once per build from options `validate_options` accepted.

A routed CPU int4 / int8 build also writes a decoder for each input mode (layout.MODE_DECODERS): the mode's adapter
always applied (text: none), no ``If`` nodes, the routed decoder's I/O (its mode layer included) and the same data
file. The run time answers a conversation with its mode's decoder where the project's kernel library reads the weights
in place, so the extra decoders hold no second copy of them (runtime.package). The routing's ``If`` nodes cost a text
prompt about 5 % of its prefill (the skipped branches copy each projection's output) and 1-5 % of every decode
step; a plain onnxruntime-genai app runs the routed decoder, which genai_config.json names, for every mode."""

from __future__ import annotations

from dataclasses import dataclass

from builder_plugin.layout import INPUT_MODES, MAIN_DECODER, MODE_DECODERS, MODE_LORA, SPLIT_DECODERS, Component
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
        """The routed decoder's I/O: its mode layer, which records the conversation's input mode (`mode_routing`)."""
        return self.lora == "routed"

    @property
    def routes_adapters(self) -> bool:
        """One graph for every input mode, choosing its adapter from the placeholder ids: the routed decoder itself,
        not a mode's decoder beside it (whose adapter always applies)."""
        return self.self_routing and self.input_mode is None


@dataclass(frozen=True)
class DecoderPlan:
    variants: tuple[DecoderVariant, ...]  # the first is the one genai_config.json names

    @classmethod
    def for_options(cls, options: BuildOptions) -> DecoderPlan:
        """The decoder files `options.lora` / `options.merge_lora` ask for."""
        lora = options.lora
        if options.merge_lora:
            return cls((DecoderVariant(MAIN_DECODER, lora, merged=lora),))
        if lora == "split":
            return cls(tuple(DecoderVariant(SPLIT_DECODERS[mode], MODE_LORA[mode],
                                            adapters=LORA_ADAPTERS[MODE_LORA[mode]], input_mode=mode)
                             for mode in SPLIT_ORDER))
        main = DecoderVariant(MAIN_DECODER, lora, adapters=LORA_ADAPTERS[lora])
        if main.self_routing and options.execution_provider == "cpu" and options.quantize:
            # a package without a speech model takes no audio: the routed decoder stands for that mode
            modes = [m for m in INPUT_MODES if m != "speech" or Component.SPEECH in options.components]
            return cls((main, *(DecoderVariant(MODE_DECODERS[mode], lora, adapters=LORA_ADAPTERS[MODE_LORA[mode]],
                                               input_mode=mode) for mode in modes)))
        return cls((main,))

    def variant(self, filename: str) -> DecoderVariant:
        """The variant written to `filename`."""
        return next(v for v in self.variants if v.filename == filename)

    @property
    def self_routing(self) -> bool:
        """Whether the build's decoder routes itself (every variant of one build has the same I/O)."""
        return self.variants[0].self_routing

    @property
    def routing(self) -> str:
        """manifest.json's routing: one self-routing decoder, a split build's file per mode, or one fixed decoder."""
        if self.self_routing:
            return "self"
        return "split" if any(v.input_mode for v in self.variants) else "fixed"

    @property
    def decoders(self) -> dict[str, str]:
        """manifest.json's decoder file per input mode, in INPUT_MODES order: the variant made for that mode, else the
        one that answers every mode."""
        files = {v.input_mode: v.filename for v in self.variants}
        return {mode: files[mode] if mode in files else files[None] for mode in INPUT_MODES}
