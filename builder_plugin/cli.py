"""Command line: `python -m builder_plugin -m microsoft/Phi-4-multimodal-instruct` (options mirror
`python -m onnxruntime_genai.models.builder`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from builder_plugin import __version__
from builder_plugin.errors import BuildError, InputError
from builder_plugin.extra_options import EXTRA_OPTIONS, check_extra_options
from builder_plugin.layout import Component
from builder_plugin.options import LORA_CHOICES, BuildOptions
from builder_plugin.precisions import EXECUTION_PROVIDERS, PRECISIONS
from builder_plugin.quant_choices import ALGO_CONFIGS, DEFAULT_ALGO_CONFIG
from builder_plugin.units import human

COMPONENT_ALIASES: dict[str, frozenset[Component]] = {
    "all": frozenset(Component),
    "text": frozenset({Component.EMBEDDING, Component.DECODER}),
    **{c.value: frozenset({c}) for c in Component},
}


def parse_components(text: str) -> frozenset[Component]:
    chosen: set[Component] = set()
    for part in (p.strip() for p in text.replace("+", ",").split(",")):
        if part not in COMPONENT_ALIASES:
            raise argparse.ArgumentTypeError(
                f"unknown component {part!r} (choose from {', '.join(COMPONENT_ALIASES)})"
            )
        chosen |= COMPONENT_ALIASES[part]
    return frozenset(chosen)


def parse_extra_options(pairs: Sequence[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"--extra_options expects KEY=VALUE, got {pair!r}")
        options[key.strip()] = value.strip()
    return options


PROG = "python -m builder_plugin"


def make_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Build the four-model ONNX Runtime GenAI package (vision, speech, embedding, text decoder) of "
        "Phi-4-multimodal-instruct, with genai_config.json and processor configs.",
    )
    p.add_argument("--version", action="version", version=f"builder_plugin {__version__}")
    src = p.add_argument_group("input and output")
    src.add_argument("-m", "--model_name", help="Hugging Face model id (or a local folder), "
                     "e.g. microsoft/Phi-4-multimodal-instruct; only the files a build needs are downloaded (config, "
                     "tokenizer and weights: no ONNX files, adapters of other layouts, code or samples); an "
                     "interrupted download resumes on the next run; HF_HUB_OFFLINE=1 builds from the cache only")
    src.add_argument("--revision", help="branch, tag or commit of the -m hub model (default: main); the commit "
                     "downloaded is recorded in the package's manifest.json")
    src.add_argument("-i", "--input", help="local checkpoint folder (original phi4mm or transformers-native "
                     "phi4_multimodal layout); wins over -m")
    src.add_argument("-o", "--output", help="output folder (default: <model>-<precision>-<provider> in the "
                     "current folder); built in a temporary sibling and moved into place on success")
    src.add_argument("-c", "--cache_dir", default=None,
                     help="download cache (default: the Hugging Face cache, shared with other tools: $HF_HUB_CACHE, "
                     "else $HF_HOME/hub, else ~/.cache/huggingface/hub)")
    src.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    tgt = p.add_argument_group("target")
    tgt.add_argument("-p", "--precision", choices=PRECISIONS, default="int4",
                     help="fp32, fp16 (cuda/dml/webgpu), int4 or int8 (MatMulNBits weights; default: %(default)s, "
                     f"quantized with algo_config={DEFAULT_ALGO_CONFIG['int4']} unless --extra_options says otherwise)")
    tgt.add_argument("-e", "--execution_provider", choices=EXECUTION_PROVIDERS, default="cpu",
                     help="execution provider the package targets (default: %(default)s); no GPU is needed to build")
    tgt.add_argument("--extra_options", nargs="+", default=[], metavar="KEY=VALUE",
                     help="quantization options of the GenAI builder, same names and meanings: "
                     f"{', '.join(EXTRA_OPTIONS)}; algo_config is one of {', '.join(ALGO_CONFIGS)}; "
                     "matmul_mixed_precision e.g. last_matmul:int8,mixed_layers:int8; any other key is refused")
    tgt.add_argument("--max-length", type=int, default=None,
                     help="search.max_length written to genai_config.json: the preallocated KV cache length "
                     "(default: min(16384, context length))")
    plg = p.add_argument_group("plugin options")
    plg.add_argument("--lora", choices=LORA_CHOICES, default="routed",
                     help="LoRA handling: routed = one decoder that applies each conversation's adapter (text: "
                     "none, image: vision, audio: speech; default); split = one decoder file per input mode, base "
                     "weights shared on disk; vision / speech / none = a single decoder with that choice; "
                     "vision+speech = both adapters always added")
    plg.add_argument("--merge-lora", action="store_true",
                     help="fold the single adapter of --lora vision|speech into the base weights (fastest decoder)")
    plg.add_argument("--components", type=parse_components, default=COMPONENT_ALIASES["all"],
                     help="comma-separated subset to build: vision, speech, embedding, decoder, text "
                     "(= embedding+decoder) or all (default). A runnable package needs vision and text.")
    plg.add_argument("--float-encoders", action="store_true",
                     help="with -p int4/int8, keep the vision and speech encoders in float")
    plg.add_argument("--list-routes", action="store_true",
                     help="print where every checkpoint tensor goes (component and name) and exit")
    plg.add_argument("--dry-run", action="store_true",
                     help="resolve the model (local or hub), check the options and config, and print what would be "
                     "downloaded (files, sizes), what would be built and the expected package size; downloads no "
                     "weights and writes nothing (the Hugging Face cache included)")
    plg.add_argument("--jobs", type=int, default=None, metavar="N",
                     help="threads that quantize the weights (default: the cores this process may use)")
    plg.add_argument("--no-progress", action="store_true", help="no progress bars")
    plg.add_argument("-v", "--verbose", action="store_true", help="show tracebacks and debug logging")
    return p


def default_output(model_dir: Path, model_name: str | None, precision: str, provider: str) -> Path:
    base = (model_name or str(model_dir)).rstrip("/").split("/")[-1] or "model"
    return Path.cwd() / f"{base}-{precision}-{provider}"


def invoked_as() -> str:
    """The command's name for its usage line: the console script's own name, or `python -m builder_plugin`."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return PROG if name in ("", "__main__.py", "-c") else name


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser(invoked_as() if argv is None else PROG).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(message)s")
    stop = StopSignals()
    try:
        with stop:
            return _run(args)
    except BuildError as exc:
        return _fail(str(exc), args.verbose)
    except KeyboardInterrupt:
        return _fail(INTERRUPTED, args.verbose)
    except Exception as exc:  # anything unexpected still gets one line unless --verbose
        if stop.received:  # the interrupt surfaced as another error (e.g. an ImportError when it hit a module's import)
            return _fail(INTERRUPTED, args.verbose)
        if isinstance(exc, ModuleNotFoundError) and exc.name and not exc.name.startswith("builder_plugin"):
            return _fail(f"{exc.name} is not installed: building needs the build extra "  # the base install only runs
                         f"(pip install \"builder_plugin[build]\", README \"Set up\")", args.verbose)
        return _fail(f"{type(exc).__name__}: {exc} (run with --verbose for details)", args.verbose)


INTERRUPTED = "interrupted; nothing was written (any existing output is unchanged)"


class StopSignals:
    """While active, Ctrl-C, SIGTERM and SIGHUP (a killed job, a closed terminal) all unwind as KeyboardInterrupt,
    so the staging folder is removed instead of left behind half-written; `received` records that one came."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received = False
        self._previous: dict[int, object] = {}

    def _interrupt(self, signum: int, frame: object) -> None:
        self.received = True
        raise KeyboardInterrupt

    def __enter__(self) -> StopSignals:
        try:
            self._previous = {s: signal.signal(s, self._interrupt) for s in self.SIGNALS}
        except ValueError:  # not the main thread: signals stay as they are
            self._previous = {}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _fail(message: str, verbose: bool) -> int:
    if verbose:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    return 1


def _run(args: argparse.Namespace) -> int:
    from builder_plugin.hub import open_source

    extra_options = parse_extra_options(args.extra_options)
    parsed_extra_options = check_extra_options(extra_options, args.precision)  # before any download or graph
    if args.no_progress:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    source = open_source(args.model_name, args.input, Path(args.cache_dir) if args.cache_dir else None,
                         args.revision, dry_run=args.dry_run)
    model_dir = source.folder
    if args.list_routes:
        from builder_plugin.checkpoint.routing import describe_routes
        from builder_plugin.config import Phi4MMConfig

        print(describe_routes(Phi4MMConfig.from_dir(model_dir)))
        return 0
    output = Path(args.output) if args.output else default_output(
        model_dir, args.model_name if not args.input else None, args.precision, args.execution_provider)
    options = BuildOptions(
        model_dir=model_dir,
        output_dir=output,
        precision=args.precision,
        execution_provider=args.execution_provider,
        cache_dir=source.cache_dir or Path(args.cache_dir or "cache_dir"),
        components=args.components,
        lora=args.lora,
        merge_lora=args.merge_lora,
        quantize_encoders=not args.float_encoders,
        max_length=args.max_length,
        overwrite=args.overwrite,
        extra_options=extra_options,
        parsed_extra_options=parsed_extra_options,
        source=source.provenance,
        jobs=args.jobs,
    )
    from builder_plugin.preflight import preflight

    plan = preflight(source, options)  # options, config, output folder and disk space: before any weight moves
    if args.dry_run:
        print(plan.report())
        return 0
    source.fetch()
    from builder_plugin.build import build

    result = build(options, progress=not args.no_progress)
    _print_summary(result)
    return 0


def _print_summary(result) -> None:
    width = max(len(name) for name, _ in result.files)
    for name, size in result.files:
        print(f"  {name:<{width}}  {human(size):>9}")
    built = ", ".join(c.value for c in result.components)
    quantized = (f" (quantization {result.quantize_seconds:.1f} s on {result.jobs} threads)"
                 if result.quantize_seconds else "")
    print(f"built {built} in {result.seconds:.1f} s{quantized}, peak memory {human(result.peak_rss_bytes)}, "
          f"{len(result.files)} files, {human(result.total_bytes)}")
    if result.runnable:
        print(f"package ready: {result.output_dir}")
    else:
        print(f"wrote {result.output_dir} (graphs only: onnxruntime-genai needs vision and text to run a package)")
