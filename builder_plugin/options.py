"""Build options: everything the CLI decides, frozen before any work starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from builder_plugin.extra_options import check_extra_options
from builder_plugin.layout import Component
from builder_plugin.precisions import (
    QUANTIZED_PRECISIONS,
    ExecutionProvider,
    Precision,
    default_accuracy_level,
    io_dtype,
)
from builder_plugin.quant_choices import DEFAULT_ALGO_CONFIG

LoraChoice = Literal["routed", "split", "vision", "speech", "none", "vision+speech"]

# The LoRA adapters each --lora choice puts into the decoder(s).
LORA_ADAPTERS: dict[str, tuple[str, ...]] = {
    "routed": ("vision", "speech"),
    "split": ("vision", "speech"),
    "vision": ("vision",),
    "speech": ("speech",),
    "none": (),
    "vision+speech": ("vision", "speech"),
}
LORA_CHOICES: tuple[str, ...] = tuple(LORA_ADAPTERS)
ALL_COMPONENTS: frozenset[Component] = frozenset(Component)


@dataclass(frozen=True)
class BuildOptions:
    model_dir: Path
    output_dir: Path
    precision: Precision = "int4"
    execution_provider: ExecutionProvider = "cpu"
    cache_dir: Path = Path("cache_dir")
    components: frozenset[Component] = ALL_COMPONENTS
    lora: LoraChoice = "routed"
    merge_lora: bool = False
    quantize_encoders: bool = True
    max_length: int | None = None
    overwrite: bool = False
    extra_options: dict[str, str] = field(default_factory=dict)
    # extra_options already parsed by check_extra_options (the command line does it before any download): not parsed
    # again. None: parsed on first use.
    parsed_extra_options: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    source: dict[str, Any] | None = None  # where the checkpoint came from (hub.ModelSource.provenance)
    jobs: int | None = None  # threads that quantize; None: the cores this process may use

    @property
    def source_record(self) -> dict[str, Any]:
        """Where the checkpoint came from, as manifest.json records it: the hub source, else the local folder."""
        return self.source or {"local_folder": str(Path(self.model_dir).resolve())}

    def provenance(self) -> dict[str, Any]:
        """The builder and the options it ran with, as manifest.json records them."""
        from builder_plugin import __version__

        options = {"precision": self.precision, "execution_provider": self.execution_provider,
                   "components": sorted(c.value for c in self.components), "lora": self.lora,
                   "merge_lora": self.merge_lora, "quantize_encoders": self.quantize_encoders,
                   "max_length": self.max_length, "extra_options": dict(self.extra_options)}
        if self.quantize:
            options["algo_config"] = self.algo_config
        return {"name": "builder_plugin", "version": __version__, "options": options}

    @property
    def io_dtype(self) -> str:
        """Graph I/O dtype, as the GenAI builder chooses it: fp32 for fp32 builds and CPU int4/int8, else fp16."""
        return io_dtype(self.precision, self.execution_provider)

    @property
    def weight_dtype(self) -> str:
        """Float dtype of weights that stay unquantized."""
        return "float32" if self.precision == "fp32" else self.io_dtype

    @cached_property
    def extra(self) -> dict[str, Any]:
        """--extra_options parsed (once), with their defaults (extra_options.EXTRA_OPTIONS); InputError for a
        bad key or value."""
        if self.parsed_extra_options is not None:
            return self.parsed_extra_options
        return check_extra_options(self.extra_options, self.precision)

    # The quantization options, typed: the keys of `extra` are read here only.

    @property
    def block_size(self) -> int:
        return self.extra["block_size"]

    @property
    def is_symmetric(self) -> bool:
        return self.extra["is_symmetric"]

    @property
    def nodes_to_exclude(self) -> frozenset[str]:
        return self.extra["nodes_to_exclude"]

    @property
    def matmul_mixed_precision(self) -> dict[str, str]:
        """selector -> quant type, as --extra_options matmul_mixed_precision gives them (algo_config's alias aside)."""
        return self.extra["matmul_mixed_precision"]

    @property
    def accuracy_level(self) -> int:
        chosen = self.extra["accuracy_level"]
        return chosen if chosen is not None else default_accuracy_level(self.execution_provider)

    @property
    def algo_config(self) -> str:
        return self.extra["algo_config"] or DEFAULT_ALGO_CONFIG.get(self.precision, "default")

    @property
    def quantize(self) -> bool:
        return self.precision in QUANTIZED_PRECISIONS
