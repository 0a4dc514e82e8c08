"""Build options: everything the CLI decides, frozen before any work starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from builder_plugin.components.spec import Component

Precision = Literal["fp32", "fp16", "int4"]
ExecutionProvider = Literal["cpu", "cuda", "dml", "webgpu"]
LoraChoice = Literal["routed", "split", "vision", "speech", "none", "vision+speech"]

PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int4")
EXECUTION_PROVIDERS: tuple[str, ...] = ("cpu", "cuda", "dml", "webgpu")
LORA_CHOICES: tuple[str, ...] = ("routed", "split", "vision", "speech", "none", "vision+speech")
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

    @property
    def io_dtype(self) -> str:
        """Graph I/O dtype, as the GenAI builder chooses it: fp32 for fp32 builds and CPU int4, else fp16."""
        if self.precision == "fp32" or (self.precision == "int4" and self.execution_provider == "cpu"):
            return "float32"
        return "float16"

    @property
    def weight_dtype(self) -> str:
        """Float dtype of weights that stay unquantized."""
        return "float32" if self.precision == "fp32" else self.io_dtype

    @property
    def block_size(self) -> int:
        return int(self.extra_options.get("block_size", 32))

    @property
    def accuracy_level(self) -> int:
        default = 4 if self.execution_provider in ("cpu", "webgpu") else 0
        return int(self.extra_options.get("accuracy_level", default))

    @property
    def quantize(self) -> bool:
        return self.precision == "int4"
