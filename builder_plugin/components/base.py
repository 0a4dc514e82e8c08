"""The component-builder contract: each graph of the package is built by one subclass, which owns its I/O spec."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import onnx_ir as ir

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.config import Phi4MMConfig
from builder_plugin.options import BuildOptions
from builder_plugin.quantize import QuantizationCache
from builder_plugin.spec import Component, IOSpec

BUILDERS: dict[Component, type[ComponentBuilder]] = {}


class ComponentBuilder(ABC):
    component: ClassVar[Component]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "component" not in cls.__dict__:
            raise TypeError(f"{cls.__name__} must declare its `component`")
        BUILDERS[cls.component] = cls

    def __init__(self, config: Phi4MMConfig, options: BuildOptions) -> None:
        self.config = config
        self.options = options
        # build() hands every component one cache, so the embedding and the decoder share the token table's blocks
        self.quant_cache = QuantizationCache()

    @classmethod
    @abstractmethod
    def io_spec(cls, config: Phi4MMConfig, io_dtype: str, execution_provider: str = "cpu") -> IOSpec:
        """Names, dtypes and symbolic shapes of the graph's inputs and outputs (the provider matters for the
        decoder: on dml it takes position_ids)."""

    @classmethod
    def spec_for(cls, config: Phi4MMConfig, options: BuildOptions) -> IOSpec:
        """The I/O spec of the graphs a build with `options` makes."""
        return cls.io_spec(config, options.io_dtype, options.execution_provider)

    @abstractmethod
    def build(self, weights: Mapping[str, TensorRef]) -> dict[str, ir.Model]:
        """Build the graph(s) from the routed weights (local name -> tensor); returns file name -> model."""
