"""Shared helpers for the benchmark scripts: where things are (the repository root, the results folder, the docs page),
timing summaries, peak RSS, the machine description, a memory-bandwidth probe, and JSON / Markdown output (including
replacing one section of docs/benchmarks.md).

Standard library and numpy only, so every benchmark (and its worker subprocesses) can import it cheaply.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cpu_class import CLASSES as CPU_CLASSES
from benchmarks.cpu_class import ENV as CPU_CLASS_ENV

ROOT = Path(__file__).resolve().parents[1]  # the repository root: `python -m benchmarks.<script>` runs from here
RESULTS_DIR = ROOT / "benchmarks" / "results"
BENCHMARKS_DOC = ROOT / "docs" / "benchmarks.md"

GB = 1e9
GIB = 1 << 30
# Instruction sets that decide which onnxruntime CPU kernels run (int8 dot products for int4 MatMulNBits).
# The environment variables that change which kernels a run measures (builder_plugin.kernels, runtime/package.py).
KERNEL_SETTINGS = ("BUILDER_PLUGIN_KERNELS", "BUILDER_PLUGIN_OPS_PATH", "BUILDER_PLUGIN_OPS_WEIGHTS")
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


# ---- timing -------------------------------------------------------------------------------------------------------


def summarize(seconds: Sequence[float]) -> dict[str, Any]:
    """{"best", "median", "runs"} of a list of durations in seconds (the list is kept, rounded to 0.1 ms)."""
    values = [float(s) for s in seconds]
    if not values:
        return {"best": None, "median": None, "runs": []}
    return {"best": min(values), "median": statistics.median(values), "runs": [round(v, 4) for v in values]}


def time_in_turn(runners: Mapping[str, Callable[[], Any]], repeats: int
                 ) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Call every runner once untimed (first-run allocations, kernel selection), then `repeats` rounds of each in turn,
    so background load hits all of them alike. Returns (seconds per runner, each runner's last output)."""
    outputs = {name: run() for name, run in runners.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            outputs[name] = run()
            times[name].append(time.perf_counter() - start)
    return times, outputs


def cpu_session(path: str | Path, threads: int | None = None) -> Any:
    """A plain onnxruntime CPU session with `threads` intra-op threads (default: the count the packages' sessions get
    at load, runtime.threads.default_threads; onnxruntime imported on first use)."""
    import onnxruntime as ort

    from builder_plugin.runtime.threads import default_threads

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or default_threads()
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


# ---- memory -------------------------------------------------------------------------------------------------------


def _status_bytes(field: str) -> int | None:
    from builder_plugin.memory import proc_kib_field

    try:
        return proc_kib_field("/proc/self/status", field)
    except OSError:
        return None


def peak_rss_bytes() -> int:
    """High-water mark of this process' resident set (VmHWM; since start or the last reset_peak_rss)."""
    value = _status_bytes("VmHWM")
    if value is None:
        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return value


def current_rss_bytes() -> int:
    return _status_bytes("VmRSS") or 0


def rss_split() -> dict[str, int]:
    """Current anonymous vs file-backed resident bytes ({"RssAnon", "RssFile"}; mmap'd files count as RssFile)."""
    found = {}
    for field in ("RssAnon", "RssFile"):
        value = _status_bytes(field)
        if value is not None:
            found[field] = value
    return found


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs); False where not supported."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---- machine ------------------------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """CPU model, logical cores, RAM, load averages and library versions of this machine."""
    cpu_model = platform.processor() or platform.machine()
    cpu_id, simd = None, None
    class_name = os.environ.get(CPU_CLASS_ENV)
    cpu_class = CPU_CLASSES.get(class_name) if class_name else None
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        fields = dict(re.findall(r"^([^:\n]+?)\s*:\s*(.*)$", text.split("\n\n")[0], re.MULTILINE))
        cpu_model = fields.get("model name", cpu_model).strip()
        if "cpu family" in fields:
            cpu_id = f"family {fields['cpu family']} model {fields.get('model')}"
        flags = set(fields.get("flags", "").split())
        simd = [flag for flag in SIMD_FLAGS if flag in flags and (cpu_class is None or cpu_class.shows(flag))]
    except OSError:
        pass
    ram = None
    try:
        found = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(encoding="ascii"), re.MULTILINE)
        ram = int(found.group(1)) * 1024 if found else None
    except OSError:
        pass
    versions: dict[str, str] = {"python": platform.python_version(), "numpy": np.__version__}
    for module in ("onnxruntime", "onnxruntime_genai", "torch", "transformers", "onnx"):
        with contextlib.suppress(Exception):  # a missing or broken optional library is just not listed
            versions[module] = __import__(module).__version__
    from builder_plugin.runtime.threads import default_threads

    return {
        "cpu_model": cpu_model,
        "cpu_id": cpu_id,
        "simd": simd,
        "logical_cores": os.cpu_count(),
        "default_threads": default_threads(),
        "ram_bytes": ram,
        **({"cpu_class": class_name} if cpu_class else {}),
        "os": f"{platform.system()} {platform.release()}",
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "versions": versions,
    }


def machine_markdown(machine: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in machine.get("versions", {}).items())
    ram = machine.get("ram_bytes")
    simd = machine.get("simd")
    return "\n".join([
        f"- CPU: {machine.get('cpu_model')}"
        + (f" ({machine['cpu_id']})" if machine.get("cpu_id") else "")
        + f", {machine.get('logical_cores')} logical cores"
        + (f"; SIMD: {', '.join(simd)}" if simd else ""),
        *([f"- Run as the class `{machine['cpu_class']}` (benchmarks/cpu_class.py: the CPUID the processes saw hid "
           f"what the class lacks, the same cores ran the code): {CPU_CLASSES[machine['cpu_class']].description}"]
          if machine.get("cpu_class") in CPU_CLASSES else []),
        f"- RAM: {ram / GIB:.1f} GiB" if ram else "- RAM: unknown",
        *([f"- Threads: {machine['default_threads']} intra-op threads per session, the run time's default here (one "
           "per physical core the process may use) unless the command sets --threads"]
          if "default_threads" in machine else []),
        f"- OS: {machine.get('os')}",
        f"- Libraries: {versions}",
        "- No GPU. Every timing is repeated and reported as best and median (background load only ever slows a "
        "run down).",
    ])


# ---- memory bandwidth ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bandwidth:
    """Memory bandwidth of one probe: "copy" = bytes copied per second (each also read and written once), "read" =
    bytes read per second by a reduction that writes nothing."""

    kind: str
    size_bytes: int
    threads: int
    best_gb_s: float
    median_gb_s: float
    runs_gb_s: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bandwidth_probe(kind: str, size_bytes: int, repeats: int, threads: int) -> Bandwidth:
    count = size_bytes // 4
    source = np.ones(count, dtype=np.float32)  # touched, so page faults are not timed
    target = np.zeros_like(source) if kind == "copy" else None
    bounds = np.linspace(0, count, threads + 1).astype(np.int64)
    slices = [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]

    def work(part: slice) -> None:  # numpy releases the GIL in both, so the threads run in parallel
        if target is not None:
            np.copyto(target[part], source[part])
        else:
            source[part].max()

    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        if threads == 1:
            work(slices[0])
        else:
            workers = [threading.Thread(target=work, args=(part,)) for part in slices]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        runs.append(count * 4 / (time.perf_counter() - start) / GB)
    return Bandwidth(kind, count * 4, threads, max(runs), statistics.median(runs), tuple(round(r, 2) for r in runs))


def memcpy_bandwidth(size_bytes: int = GIB, repeats: int = 7, threads: int = 1) -> Bandwidth:
    """numpy copy of a `size_bytes` array, `threads` Python threads one slice each, `repeats` times; GB/s = bytes
    copied / s (the memory moves twice that: every byte is read and written)."""
    return _bandwidth_probe("copy", size_bytes, repeats, threads)


def read_bandwidth(size_bytes: int = GIB, repeats: int = 7, threads: int = 1) -> Bandwidth:
    """numpy max() over a `size_bytes` float32 array (reads only), `threads` threads one slice each; GB/s = bytes
    read / s. Closer than a copy to what a decode step does with its weights."""
    return _bandwidth_probe("read", size_bytes, repeats, threads)


def read_probe_gb_s(repeats: int = 3) -> float:
    """Read bandwidth now, with every CPU this process may use: the best of `repeats` 1 GB reads (~0.1 s), taken
    right beside a measurement to set it against the bandwidth of that moment."""
    from builder_plugin.cpus import available_cpus

    return read_bandwidth(threads=available_cpus(), repeats=repeats).best_gb_s


# ---- output -------------------------------------------------------------------------------------------------------


def write_json(path: str | Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub Markdown table; `align` is one character per column, "l" or "r" (default: first left, rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def replace_markdown_section(path: str | Path, heading: str, body: str, title: str = "# Benchmarks",
                             before: str | None = None) -> Path:
    """Write `body` under the level-2 `heading` ("## Run time") of `path`, replacing that section's old text up to
    the next level-2 heading. A missing file is created with `title`; a missing section is inserted before the
    section `before` when that exists, else appended. Other sections are left as they are."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.is_file() else f"{title}\n"
    section = f"{heading}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}[ \t]*\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        anchor = re.search(rf"^{re.escape(before)}[ \t]*$", text, re.MULTILINE) if before else None
        if anchor:
            text = text[: anchor.start()] + section + "\n" + text[anchor.start():]
        else:
            text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
    return path


def fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    """A number for a table cell ("-" when missing)."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}{unit}"


def make_media(folder: Path, image_size: tuple[int, int], audio_seconds: float) -> Path:
    """A generated photo.png and clip.wav (random content, the given sizes) in `folder`."""
    from builder_plugin.testing.media import make_image, make_wav

    folder.mkdir(parents=True, exist_ok=True)
    make_image(folder / "photo.png", *image_size, seed=3)
    make_wav(folder / "clip.wav", audio_seconds, sample_rate=16000, seed=4)
    return folder


def greedy_text_answer(package: str | Path, question: str, new_tokens: int,
                       threads: int | None = None) -> dict[str, Any]:
    """Load `package` with onnxruntime-genai in this process, as an app following docs/runtime.md does (every session
    given `threads` intra-op threads, default one per physical core the process may use), and answer one text
    question greedily: load time, prompt tokens, prefill (to the first token), the time of each later step, the
    tokens."""
    import onnxruntime_genai as og

    from builder_plugin.layout import GENAI_CONFIG_FILE
    from builder_plugin.runtime.threads import thread_overlay

    started = time.perf_counter()
    config = og.Config(str(package))
    genai_config = json.loads((Path(package) / GENAI_CONFIG_FILE).read_text(encoding="utf-8"))
    config.overlay(json.dumps({"model": thread_overlay(genai_config, threads)}))
    model = og.Model(config)
    tokenizer = og.Tokenizer(model)
    loaded = time.perf_counter()
    ids = tokenizer.encode(f"<|user|>{question}<|end|><|assistant|>")
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new_tokens + 1, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    generator.generate_next_token()
    first = time.perf_counter()
    tokens, steps = [int(generator.get_next_tokens()[0])], []
    for _ in range(new_tokens):
        before = time.perf_counter()
        generator.generate_next_token()
        steps.append(time.perf_counter() - before)
        tokens.append(int(generator.get_next_tokens()[0]))
    return {"load_s": loaded - started, "prompt_tokens": len(ids), "prefill_s": first - loaded, "step_s": steps,
            "tokens": tokens}


def git_state(*paths: str) -> dict[str, Any]:
    """The checkout's commit and its modified files (under `paths` when given), for a result to name its code."""
    def git(*arguments: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *arguments],
                              capture_output=True, text=True)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "modified_files": git("status", "--porcelain", *(("--", *paths) if paths else ())).splitlines()}


def names_from(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names, each one of `choices` (else the option's error names the
    unknown ones and the choices); `what` names one item, e.g. "mode"."""
    def parse(value: str) -> list[str]:
        names = [name.strip() for name in value.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {', '.join(unknown)}; "
                                             f"choose from {', '.join(choices)}")
        return names
    return parse


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that ran a benchmark, as the reports quote it: under benchmarks.cpu_class with it, and with the
    kernel library's settings (KERNEL_SETTINGS) the run had."""
    cpu_class = os.environ.get(CPU_CLASS_ENV)
    settings = "".join(f"{name}={shlex.quote(os.environ[name])} " for name in KERNEL_SETTINGS if name in os.environ)
    return (f"python -m benchmarks.cpu_class {cpu_class} -- " if cpu_class else "") + settings + \
        f"python -m benchmarks.{script.removesuffix('.py')} " + shlex.join(sys.argv[1:] if argv is None else argv)


class _GivenOut(argparse.Action):
    """--out, noting that it was given (results_out)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.out_given = True


def add_report_options(parser: argparse.ArgumentParser, results_name: str, *, note: bool = True,
                       replay: bool = True) -> None:
    """The report options: --out (RESULTS_DIR / results_name; a replay rewrites the file it replays), --doc, --note (if
    note), --from-json (if replay)."""
    default = (RESULTS_DIR / results_name).relative_to(ROOT)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / results_name, action=_GivenOut,
                        help=f"the results JSON (default: {default}{'; a replay: the --from-json file' * replay})")
    parser.set_defaults(out_given=False)
    parser.add_argument("--doc", default=str(BENCHMARKS_DOC),
                        help=f"the Markdown page to update (default: {BENCHMARKS_DOC.relative_to(ROOT)}; "
                        "'' leaves the docs alone)")
    if note:  # None lets --from-json keep the earlier file's note; without replay "" is the plain default
        parser.add_argument("--note", default=None if replay else "",
                            help="a note kept in the results, for the report")
    if replay:
        parser.add_argument("--from-json", type=Path, help="measure nothing: publish an earlier --out file")


def publish(results: dict[str, Any], out: str | Path, doc: str, heading: str, body: str) -> None:
    """Write the results JSON, print the report and, unless `doc` is empty, put it under `heading` in `doc`."""
    write_json(out, results)
    print(body)
    if doc:
        replace_markdown_section(doc, heading, body)


# The kernel library's level (builder_plugin.kernels.level()) -> the CPU class a per-class report section names.
MACHINE_CLASSES = {"amx_bf16": "", "amx": "AMX int8", "avx512_vnni": "AVX-512 VNNI without AMX",
                   "avx2": "without AVX-512 VNNI", "none": "without AVX2"}


def per_machine_class(heading: str) -> Callable[[dict[str, Any]], str]:
    """The section heading of results measured at `results["library_level"]`: `heading` itself for AMX bf16 (the class
    these sections were first measured on), "`heading`, <class>" for the others, so each class keeps its own."""
    def named(results: dict[str, Any]) -> str:
        machine = MACHINE_CLASSES[results.get("library_level", "amx_bf16")]
        return f"{heading}, {machine}" if machine else heading
    return named


def results_out(args: Any) -> Path:
    """Where a benchmark writes its results (add_report_options): --out, and a replay (--from-json) without --out
    rewrites the file it replays."""
    return Path(args.from_json) if getattr(args, "from_json", None) and not args.out_given else args.out


def measure_or_replay(args: Any, argv: Sequence[str] | None, script: str,
                      heading: str | Callable[[dict[str, Any]], str],
                      run: Callable[[Any], dict[str, Any]], report: Callable[[dict[str, Any]], str]) -> int:
    """The end of a benchmark's main with --out, --doc, --note and --from-json: publish an earlier results file (its
    note replaced when --note is given), or `run(args)` and publish what it measured with the command, the checkout
    and the machine. `heading`: the section, or what names it from the results (per_machine_class)."""
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        if args.note is not None:
            results["note"] = args.note
    else:
        results = run(args)
        results.update(command=command_line(script, argv), git=git_state(), machine=machine_info(),
                       note=args.note or "")
    publish(results, results_out(args), args.doc, heading if isinstance(heading, str) else heading(results),
            report(results))
    return 0
