"""Before any weight moves: the options checked against the config, the output folder, the disk space the download
and the package need, and the plan that --dry-run prints."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from builder_plugin.build import BUILD_ORDER, validate_options
from builder_plugin.config import Phi4MMConfig
from builder_plugin.errors import InputError
from builder_plugin.hub import ModelSource
from builder_plugin.options import LORA_ADAPTERS, BuildOptions
from builder_plugin.package import OutputFolder
from builder_plugin.units import human

# Package bytes per checkpoint byte of a bfloat16 checkpoint, by precision, with every component: the full-size
# packages measured 22.2 GB (fp32) and 3.54 GB (int4 with algo_config=default) from an 11.15 GB checkpoint; fp16
# keeps two bytes a weight, int8 one plus its scales. A tied embedding adds a second copy (lm_head), hence headroom.
PACKAGE_BYTES_PER_CHECKPOINT_BYTE = {"fp32": 2.1, "fp16": 1.05, "int8": 0.6, "int4": 0.35}
DECODER_LAYOUTS = {
    "routed": "one decoder that picks each conversation's LoRA (text: none, image: vision, audio: speech)",
    "split": "one decoder file per input mode, base weights shared on disk",
    "vision+speech": "one decoder with both LoRAs always added",
    "none": "one decoder without LoRA",
}


@dataclass(frozen=True)
class Plan:
    source: ModelSource
    options: BuildOptions
    package_bytes: int

    def report(self) -> str:
        s, o = self.source, self.options
        prov = s.provenance
        if "repository" in prov:
            lines = [f"model: {prov['repository']} (revision {prov['revision']}, commit {prov['commit']}) from "
                     f"{prov['endpoint']}, cached in {s.cache_dir}"]
        else:
            lines = [f"model: local folder {prov['local_folder']}"]
        todo = [f for f in s.metadata + s.weights if not f.cached]
        if todo:
            lines.append(f"would download {len(todo)} file(s), {human(s.download_bytes)}:")
        else:
            lines.append("nothing to download: every file is on disk")
        for f in s.metadata + s.weights:
            state = "on disk" if f.cached else (f"resume at {human(f.partial)}" if f.partial else "download")
            lines.append(f"  {f.path}  {human(f.size) if f.size is not None else '?'}  ({state})")
        components = [c.value for c in BUILD_ORDER if c in o.components]
        lines.append(f"would build: {', '.join(components)} for {o.execution_provider}")
        lines.append(f"  decoder layout: --lora {o.lora}: {decoder_layout(o)}")
        lines.append(f"  quantization: {quantization(o)}")
        lines.append(f"expected package size: about {human(self.package_bytes)} in {o.output_dir}")
        lines.append("dry run: no weights downloaded, nothing written")
        return "\n".join(lines)


def decoder_layout(options: BuildOptions) -> str:
    if options.lora in DECODER_LAYOUTS:
        return DECODER_LAYOUTS[options.lora]
    adapter = LORA_ADAPTERS[options.lora][0]
    merged = "folded into the base weights" if options.merge_lora else "added"
    return f"one decoder with the {adapter} LoRA {merged}"


def quantization(options: BuildOptions) -> str:
    if not options.quantize:
        return f"none ({options.weight_dtype} weights)"
    encoders = options.precision if options.quantize_encoders else "float"
    return (f"{options.precision} MatMulNBits, algo_config={options.algo_config}, block_size={options.block_size}, "
            f"accuracy_level={options.accuracy_level}; vision and speech encoders: {encoders}")


def expected_package_bytes(source: ModelSource, options: BuildOptions) -> int:
    side_files = sum(f.size or 0 for f in source.metadata)
    return int(source.weight_bytes * PACKAGE_BYTES_PER_CHECKPOINT_BYTE[options.precision]) + side_files


def preflight(source: ModelSource, options: BuildOptions) -> Plan:
    """Everything that can refuse a build before its weights are downloaded; the plan of the build."""
    validate_options(options, Phi4MMConfig.from_dir(source.folder))
    OutputFolder(options.output_dir, options.overwrite).check()
    plan = Plan(source, options, expected_package_bytes(source, options))
    check_disk_space(source, plan.package_bytes, options.output_dir)
    return plan


def check_disk_space(source: ModelSource, package_bytes: int, output: Path) -> None:
    """The bytes still to download must fit in the cache's file system and the package in the output's (both in
    one when they share it); else one line naming both figures."""
    out_dir = _existing(Path(output).resolve().parent)
    out_free = shutil.disk_usage(out_dir).free
    download = source.download_bytes
    if not download:
        if package_bytes > out_free:
            raise InputError(f"not enough disk space: the package needs about {human(package_bytes)} in {out_dir}, "
                             f"which has {human(out_free)} free")
        return
    cache_dir = _existing(source.cache_dir)
    cache_free = shutil.disk_usage(cache_dir).free
    if os.stat(cache_dir).st_dev == os.stat(out_dir).st_dev:
        fits = download + package_bytes <= out_free
    else:
        fits = download <= cache_free and package_bytes <= out_free
    if not fits:
        raise InputError(f"not enough disk space: the download needs {human(download)} in {cache_dir} "
                         f"({human(cache_free)} free) and the package about {human(package_bytes)} in {out_dir} "
                         f"({human(out_free)} free); nothing was downloaded")


def _existing(path: Path) -> Path:
    path = Path(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    return path
