"""The component-builder contract: each graph of the package is built by one subclass, which owns its I/O spec.

The build runs the same steps for every component (`builder_plugin.build.build_component`): `build_output` makes the
float graphs, `quantize` rewrites each one for int4/int8, `finish` completes it, and the result is checked against the
spec before it is written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import onnx_ir as ir

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.config import Phi4MMConfig
from builder_plugin.options import BuildOptions
from builder_plugin.quant.matmul import quantize_matmuls
from builder_plugin.quant.plan import QuantPlan
from builder_plugin.quant.weights import QuantizationCache
from builder_plugin.spec import Component, IOSpec


@dataclass(frozen=True)
class DecoderRuntimeSettings:
    """What genai_config.json and manifest.json take from the decoder build."""

    past_present_share_buffer: bool  # read from the GenAI builder that made the decoder
    provider_options: tuple[dict[str, dict[str, str]], ...]  # likewise: its session options for the provider
    routing: str  # manifest.json: "self" (one self-routing decoder), "split" (a file per input mode) or "fixed"
    decoders: dict[str, str]  # input mode -> decoder file, in layout.INPUT_MODES order


@dataclass(frozen=True)
class BuildOutput:
    graphs: dict[str, ir.Model]  # file name -> graph, in the order they are written
    spec: IOSpec  # the I/O of every graph once finished
    runtime: DecoderRuntimeSettings | None = None  # the decoder's; None for the other components


class ComponentBuilder(ABC):
    component: ClassVar[Component]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "component" not in cls.__dict__:
            raise TypeError(f"{cls.__name__} must declare its `component`")

    def __init__(self, config: Phi4MMConfig, options: BuildOptions,
                 quant_cache: QuantizationCache | None = None) -> None:
        self.config = config
        self.options = options
        # build() hands every component one cache, so the embedding and the decoder share the token table's blocks
        self.quant_cache = quant_cache or QuantizationCache(options.jobs)

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
        """Build the float graph(s) from the routed weights (local name -> tensor); returns file name -> model."""

    def build_output(self, weights: Mapping[str, TensorRef]) -> BuildOutput:
        """The float graphs, the spec they meet once finished, and what the runtime configs need from the build."""
        return BuildOutput(self.build(weights), self.spec_for(self.config, self.options))

    def quantize(self, model: ir.Model) -> ir.Model:
        """int4/int8 (unless --float-encoders): every MatMul with a constant weight becomes MatMulNBits with the
        encoders' scheme. That is the vision and speech graphs; the embedding has no MatMul (its quantized lookup
        reads the lm_head's blocks from `quant_cache` while it is built). No weight of theirs is in another graph;
        the cache counts their quantization time and holds the threads."""
        options = self.options
        if not (options.quantize and options.quantize_encoders):
            return model
        return quantize_matmuls(model, QuantPlan.for_encoders(options), options.accuracy_level,
                                cache=self.quant_cache)

    def finish(self, model: ir.Model, filename: str) -> ir.Model:
        """What the graph written to `filename` still needs after quantization before it is checked and written
        (nothing by default)."""
        return model
