"""The build pipeline: checkpoint folder -> four-model phi4mm package.

The checkpoint's config files are parsed once (Phi4MMConfig) and every option is checked against them before any work;
the checkpoint is indexed lazily and every tensor routed. Then each selected component runs the same steps
(`build_component`): its float graph(s), each quantized for int4/int8, finished (the decoder's LoRA routing) and
checked against the component's I/O spec, then written with shared external data into a staging folder that replaces
the output only when everything succeeded.
"""

from __future__ import annotations

import resource
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from builder_plugin.checkpoint.files import check_tokenizer
from builder_plugin.checkpoint.reader import CheckpointReader, TensorRef
from builder_plugin.checkpoint.routing import route_weights
from builder_plugin.components.base import BuildOutput, ComponentBuilder, DecoderRuntimeSettings
from builder_plugin.components.decoder import DecoderBuilder
from builder_plugin.components.embedding import EmbeddingBuilder
from builder_plugin.components.speech import SpeechBuilder
from builder_plugin.components.vision import VisionBuilder
from builder_plugin.config import Phi4MMConfig
from builder_plugin.errors import InputError
from builder_plugin.layout import (
    DATA_FILES,
    GENAI_CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    GRAPH_FILES,
    MANIFEST_FILE,
    RUNNABLE_MINIMUM,
    SPEECH_PROCESSOR_FILE,
    TOKENIZER_FILES,
    VISION_PROCESSOR_FILE,
)
from builder_plugin.options import LORA_ADAPTERS, BuildOptions
from builder_plugin.package import OutputFolder, PackageWriter
from builder_plugin.quant.matmul import wants_prepacking
from builder_plugin.quant.weights import QuantizationCache
from builder_plugin.runtime.manifest import FORMAT_VERSION, Manifest, provenance_json
from builder_plugin.spec import Component, IOSpec, check_io
from genai_config import make_genai_config, speech_processor_config, vision_processor_config, write_json

# The builder of each component, in the order a build runs them.
BUILDERS: dict[Component, type[ComponentBuilder]] = {
    Component.VISION: VisionBuilder,
    Component.SPEECH: SpeechBuilder,
    Component.EMBEDDING: EmbeddingBuilder,
    Component.DECODER: DecoderBuilder,
}
BUILD_ORDER = tuple(BUILDERS)
COPIED_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG_FILE)  # from the checkpoint into the package, as they are


@dataclass
class BuildResult:
    output_dir: Path
    files: list[tuple[str, int]]
    components: list[Component]
    seconds: float
    peak_rss_bytes: int
    runnable: bool
    quantize_seconds: float = 0.0  # computing quantized weights, within `seconds`
    jobs: int = 1  # the threads that did it

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def builder_class(component: Component) -> type[ComponentBuilder]:
    return BUILDERS[component]


def validate_options(options: BuildOptions, config: Phi4MMConfig) -> None:
    """Every check of the options, against each other and against the checkpoint's config, made before any work:
    each refusal is one InputError line. The builders rely on it: none checks the options again."""
    options.extra  # noqa: B018  - parses every --extra_options key (block_size too), raising InputError on a bad one
    if options.lora not in LORA_ADAPTERS:
        raise InputError(f"unknown --lora choice {options.lora!r}; choose from {', '.join(LORA_ADAPTERS)}")
    if options.precision == "fp16" and options.execution_provider == "cpu":
        raise InputError("fp16 builds are for -e cuda, dml or webgpu; on cpu use -p fp32, int4 or int8")
    missing = [name for name in LORA_ADAPTERS[options.lora] if name not in config.loras]
    if missing and Component.DECODER in options.components:
        raise InputError(f"--lora {options.lora} needs the {' and '.join(missing)} LoRA, which this checkpoint lacks")
    if options.merge_lora and options.lora not in ("vision", "speech"):
        raise InputError("--merge-lora folds one adapter into the base weights: use it with --lora vision or speech")
    if options.jobs is not None and options.jobs < 1:
        raise InputError(f"--jobs must be at least 1, got {options.jobs}")
    if options.max_length is not None:
        context = config.text.max_position_embeddings
        if options.max_length <= 0:
            raise InputError("--max-length must be positive")
        if options.max_length > context:
            raise InputError(f"--max-length {options.max_length} exceeds the model's context length {context}")


def build_component(builder: ComponentBuilder, weights: Mapping[str, TensorRef]) -> BuildOutput:
    """One component's graphs as the package stores them, by the same steps for every component: the float graphs,
    then each one quantized (int4/int8) and finished, and checked against the component's I/O spec."""
    output = builder.build_output(weights)
    graphs = {}
    for filename, model in output.graphs.items():
        model = builder.finish(builder.quantize(model), filename)
        check_io(model, output.spec, filename)
        graphs[filename] = model
    return replace(output, graphs=graphs)


def build(options: BuildOptions, progress: bool = True) -> BuildResult:
    start = time.perf_counter()
    config = Phi4MMConfig.from_dir(options.model_dir)
    validate_options(options, config)
    check_tokenizer(options.model_dir)
    components = [c for c in BUILD_ORDER if c in options.components]
    runnable = set(components) >= RUNNABLE_MINIMUM
    weights = route_weights(CheckpointReader(options.model_dir, config.source_format), config)
    classes = {c: builder_class(c) for c in components}

    folder = OutputFolder(options.output_dir, options.overwrite)
    with folder as staging:
        writer = PackageWriter(staging, progress=progress)
        specs: dict[Component, IOSpec] = {}
        filenames: dict[Component, str] = {}
        runtime: DecoderRuntimeSettings | None = None
        quant_cache = QuantizationCache(options.jobs)
        prepacking: dict[Component, bool] = {}
        for step, component in enumerate(components, 1):
            if progress:
                print(f"[{step}/{len(components)}] {component.value}: building the graph", file=sys.stderr, flush=True)
            builder = classes[component](config, options, quant_cache)
            output = build_component(builder, weights[component])
            wanted = {wants_prepacking(model) for model in output.graphs.values()} - {None}
            if wanted:
                prepacking[component] = True in wanted
            for filename, model in output.graphs.items():
                writer.save(model, filename, DATA_FILES[component])
            specs[component] = output.spec
            filenames[component] = GRAPH_FILES[component]
            runtime = output.runtime or runtime
        if runnable:
            _write_runtime_configs(staging, config, options, specs, filenames, runtime, prepacking)
        else:  # graphs only: no runtime manifest, but still where the package came from
            provenance = provenance_json(options.source_record, options.provenance())
            write_json(staging / MANIFEST_FILE, {"format": FORMAT_VERSION, **provenance})
        for name in COPIED_FILES:
            if (options.model_dir / name).is_file():
                shutil.copy(options.model_dir / name, staging / name)
        files = sorted((p.name, p.stat().st_size) for p in staging.iterdir() if p.is_file())
        folder.commit()
    return BuildResult(
        output_dir=folder.final,
        files=files,
        components=components,
        seconds=time.perf_counter() - start,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        runnable=runnable,
        quantize_seconds=quant_cache.stats.seconds,
        jobs=quant_cache.stats.jobs,
    )


def _write_runtime_configs(folder: Path, config: Phi4MMConfig, options: BuildOptions,
                           specs: dict[Component, IOSpec], filenames: dict[Component, str],
                           runtime: DecoderRuntimeSettings, prepacking: Mapping[Component, bool]) -> None:
    genai = make_genai_config(config, specs, filenames, options.execution_provider, options.max_length,
                              share_kv_buffer=runtime.past_present_share_buffer, generation=config.generation,
                              provider_options=list(runtime.provider_options), prepacking=prepacking)
    write_json(folder / GENAI_CONFIG_FILE, genai)
    Manifest(runtime.decoders, runtime.routing, config.text.original_max_position_embeddings,
             source=options.source_record, builder=options.provenance()).write(folder)
    write_json(folder / VISION_PROCESSOR_FILE, vision_processor_config(config.vision.crop_size, config.dynamic_hd))
    if Component.SPEECH in specs:
        write_json(folder / SPEECH_PROCESSOR_FILE, speech_processor_config(config.audio.compression_rate))
