"""Command line behaviour: help, and every bad input gives one line, exit code 1 and loses nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from builder_plugin import cli
from builder_plugin.spec import Component, IOSpec

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (fast); `python -m builder_plugin` itself is exercised by test_help."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def partial_folders(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if ".partial-" in p.name]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy whose big shards are symlinks (tests below only break small files)."""
    dst.mkdir()
    for item in src.iterdir():
        if item.is_file() and item.stat().st_size > 10_000_000:
            (dst / item.name).symlink_to(item)
        elif item.is_file():
            shutil.copy(item, dst / item.name)
    return dst


def test_help_documents_every_option() -> None:
    result = subprocess.run([sys.executable, "-m", "builder_plugin", "--help"], capture_output=True, text=True,
                            env=ENV, timeout=300)
    assert result.returncode == 0
    for action in cli.make_parser()._actions:
        for flag in action.option_strings:
            assert flag in result.stdout, flag
        if action.option_strings and action.help:
            assert action.help.split()[0] in result.stdout


def test_nonexistent_input_folder(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("-i", str(tmp_path / "nope"), "-o", str(tmp_path / "out")), "not found")


def test_unknown_hub_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_cli("-m", "nobody/no-such-model-xyz", "-c", str(tmp_path / "cache"), "-o", str(tmp_path / "out"))
    assert_one_line_error(result, "nobody/no-such-model-xyz")
    assert not (tmp_path / "out").exists()


def test_non_phi4mm_config(tmp_path: Path) -> None:
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama",
                                                                 "architectures": ["LlamaForCausalLM"]}))
    result = run_cli("-i", str(tmp_path / "llama"), "-o", str(tmp_path / "out"))
    assert_one_line_error(result, "not a Phi-4-multimodal checkpoint", "llama")


def test_missing_shard(tmp_path: Path, tiny_checkpoint: Path) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert_one_line_error(run_cli("-i", str(ckpt), "-o", str(tmp_path / "out")), shard.name)
    assert not (tmp_path / "out").exists() and not partial_folders(tmp_path)


def test_truncated_safetensors(tmp_path: Path, tiny_checkpoint: Path) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    shard = sorted(ckpt.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)[0]
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data[: len(data) * 2 // 3])
    assert_one_line_error(run_cli("-i", str(ckpt), "-o", str(tmp_path / "out")), shard.name)


def test_tensor_of_the_wrong_shape(tmp_path: Path, tiny_checkpoint: Path) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    raw = json.loads((ckpt / "config.json").read_text())
    raw["audio_processor"]["config"]["linear_units"] += 2  # the checkpoint's FFN weights no longer fit
    (ckpt / "config.json").write_text(json.dumps(raw))
    assert_one_line_error(run_cli("-i", str(ckpt), "-o", str(tmp_path / "out")), "has shape", "feed_forward")


def test_unreadable_tokenizer(tmp_path: Path, tiny_checkpoint: Path) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 12}}')
    assert_one_line_error(run_cli("-i", str(ckpt), "-o", str(tmp_path / "out")), "tokenizer")


def test_non_empty_output_is_refused_and_untouched(tmp_path: Path, tiny_checkpoint: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(run_cli("-i", str(tiny_checkpoint), "-o", str(out)), "not empty", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


class _FailingBuilder:
    """Stands in for a component builder and fails halfway through the build."""

    error: BaseException = RuntimeError("boom")

    def __init__(self, config, options) -> None:
        pass

    @classmethod
    def io_spec(cls, config, io_dtype) -> IOSpec:
        return IOSpec(inputs=(), outputs=())

    def build_output(self, weights):
        raise self.error


@pytest.mark.parametrize("error", [RuntimeError("boom in the middle"), KeyboardInterrupt()])
def test_failure_mid_build_leaves_nothing_behind(tmp_path: Path, tiny_checkpoint: Path, monkeypatch, capsys,
                                                 error: BaseException) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("previous package")
    monkeypatch.setattr(_FailingBuilder, "error", error)
    monkeypatch.setattr("builder_plugin.build.builder_class", lambda component: _FailingBuilder)
    code = cli.main(["-i", str(tiny_checkpoint), "-o", str(out), "--overwrite", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    assert not partial_folders(tmp_path)


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_killed_build_leaves_nothing_behind(tmp_path: Path, tiny_checkpoint: Path, signal_name: str) -> None:
    """A build stopped by `kill` (or a closed terminal) removes its staging folder like Ctrl-C does."""
    import signal
    import time

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("previous package")
    build = subprocess.Popen([sys.executable, "-m", "builder_plugin", "-i", str(tiny_checkpoint), "-o", str(out),
                              "--overwrite", "--no-progress"], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not partial_folders(tmp_path) and build.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert partial_folders(tmp_path), "the build finished before it could be stopped"
    build.send_signal(getattr(signal, signal_name))
    _, err = build.communicate(timeout=120)
    assert build.returncode == 1 and "interrupted" in err and "Traceback" not in err
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    assert not partial_folders(tmp_path)


def test_verbose_shows_the_traceback(tmp_path: Path) -> None:
    result = run_cli("-i", str(tmp_path / "nope"), "-o", str(tmp_path / "out"), "--verbose")
    assert result.returncode == 1 and "Traceback" in result.stderr and "error: " in result.stderr


def test_components_option_parses_aliases() -> None:
    assert cli.parse_components("text,vision") == {Component.EMBEDDING, Component.DECODER, Component.VISION}
    assert cli.parse_components("all") == set(Component)
    with pytest.raises(Exception, match="unknown component"):
        cli.parse_components("audio")


@pytest.mark.parametrize(("extra", "needles"), [
    (["no_such_option=1"], ["no_such_option", "accepted: algo_config"]),
    (["block_size=32", "int4_algo_config=k_quant"], ["int4_algo_config", "use algo_config"]),
    (["exclude_embeds=false"], ["exclude_embeds", "set by builder_plugin"]),
    (["algo_config=gptq"], ["algo_config=gptq", "k_quant_mixed"]),
    (["matmul_mixed_precision=first_matmul:int8"], ["matmul_mixed_precision", "first_matmul"]),
    (["block_size=48"], ["block_size=48"]),
    (["op_types_to_quantize=Gather"], ["op_types_to_quantize", "MatMul"]),
    (["is_symmetric=maybe"], ["is_symmetric"]),
])
def test_bad_extra_option_is_refused_before_anything_is_written(tmp_path: Path, tiny_checkpoint: Path, extra,
                                                                needles) -> None:
    out = tmp_path / "out"
    result = run_cli("-i", str(tiny_checkpoint), "-o", str(out), "--extra_options", *extra)
    assert_one_line_error(result, *needles)
    assert not out.exists() and not partial_folders(tmp_path)


def test_quantization_option_on_a_float_build_is_refused(tmp_path: Path, tiny_checkpoint: Path) -> None:
    result = run_cli("-i", str(tiny_checkpoint), "-o", str(tmp_path / "out"), "-p", "fp32",
                     "--extra_options", "algo_config=rtn")
    assert_one_line_error(result, "algo_config", "-p int4 and -p int8")
    assert not (tmp_path / "out").exists()


def test_every_accepted_extra_option_is_in_the_help() -> None:
    from builder_plugin.extra_options import EXTRA_OPTIONS
    from builder_plugin.quant_choices import ALGO_CONFIGS

    text = " ".join(cli.make_parser().format_help().split())
    for name in [*EXTRA_OPTIONS, *ALGO_CONFIGS]:
        assert name in text, name


def _no_work(monkeypatch) -> None:
    """Fail the test if the build gets as far as routing weights or asking for a graph builder."""
    def refuse(*args, **kwargs):
        pytest.fail("an option check came after the build started")

    monkeypatch.setattr("builder_plugin.build.route_weights", refuse)
    monkeypatch.setattr("builder_plugin.build.builder_class", refuse)


@pytest.mark.parametrize(("args", "needles"), [
    (["--max-length", "0"], ["--max-length must be positive"]),
    (["--jobs", "0"], ["--jobs must be at least 1"]),
    (["--max-length", "1000000000"], ["--max-length 1000000000", "context length"]),
    (["--extra_options", "block_size=512"], ["block_size=512", "16, 32, 64, 128, 256"]),
    (["-p", "fp16"], ["fp16", "cuda"]),
    (["--lora", "routed", "--merge-lora"], ["--merge-lora", "--lora vision or speech"]),
])
def test_bad_option_is_refused_before_any_work(tmp_path: Path, tiny_checkpoint: Path, monkeypatch, args,
                                               needles) -> None:
    _no_work(monkeypatch)
    out = tmp_path / "out"
    assert_one_line_error(run_cli("-i", str(tiny_checkpoint), "-o", str(out), "--no-progress", *args), *needles)
    assert not out.exists() and not partial_folders(tmp_path)


@pytest.mark.parametrize(("name", "content", "needles"), [
    ("preprocessor_config.json", "{not json", ["preprocessor config", "preprocessor_config.json"]),
    ("preprocessor_config.json", '{"dynamic_hd": "many"}', ["dynamic_hd", "integer"]),
    ("generation_config.json", "[1, 2]", ["generation config", "not a JSON object"]),
])
def test_unreadable_runtime_config_input_is_refused_before_any_work(tmp_path: Path, tiny_checkpoint: Path,
                                                                    monkeypatch, name, content, needles) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / name).write_text(content)
    _no_work(monkeypatch)
    out = tmp_path / "out"
    assert_one_line_error(run_cli("-i", str(ckpt), "-o", str(out), "--no-progress"), *needles)
    assert not out.exists() and not partial_folders(tmp_path)


def test_missing_adapter_is_refused_before_any_work(tiny_checkpoint: Path, tiny_config) -> None:
    import dataclasses

    from builder_plugin.build import validate_options
    from builder_plugin.errors import InputError
    from builder_plugin.options import BuildOptions

    config = dataclasses.replace(tiny_config, loras={})
    for lora, needle in (("routed", "needs the vision and speech LoRA"), ("speech", "needs the speech LoRA")):
        with pytest.raises(InputError, match=needle):
            validate_options(BuildOptions(model_dir=tiny_checkpoint, output_dir=Path("unused"), lora=lora), config)
    validate_options(BuildOptions(model_dir=tiny_checkpoint, output_dir=Path("unused"), lora="none"), config)
    with pytest.raises(InputError, match="unknown --lora choice"):
        validate_options(BuildOptions(model_dir=tiny_checkpoint, output_dir=Path("unused"), lora="all"), tiny_config)


HEAVY_MODULES = ("torch", "transformers", "onnx", "onnx_ir", "onnxruntime", "numpy", "safetensors")


def imported_modules(*command: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime *command`; the top-level names of every module the interpreter imported."""
    result = subprocess.run([sys.executable, "-X", "importtime", *command], capture_output=True, text=True, env=ENV,
                            timeout=300)
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in result.stderr.splitlines()
             if line.startswith("import time:") and "|" in line}
    assert "argparse" in names, result.stderr[-2000:]  # the report is there
    return result, names


@pytest.mark.parametrize("module", ["builder_plugin", "builder_plugin.verify", "builder_plugin.serve"])
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["--no-such-option"]])
def test_parsing_the_command_line_imports_no_heavy_module(module: str, args: list[str]) -> None:
    result, names = imported_modules("-m", module, *args)
    assert result.returncode == (2 if args == ["--no-such-option"] else 0), result.stderr[-2000:]
    assert not names & set(HEAVY_MODULES), sorted(names & set(HEAVY_MODULES))


def test_a_bad_build_option_is_refused_before_any_heavy_import(tmp_path: Path) -> None:
    result, names = imported_modules("-m", "builder_plugin", "-i", str(tmp_path), "--extra_options", "int4_algo=rtn")
    assert result.returncode == 1 and "error: " in result.stderr and "int4_algo" in result.stderr
    assert not names & set(HEAVY_MODULES), sorted(names & set(HEAVY_MODULES))


def test_version_is_the_installed_distribution_version() -> None:
    from importlib.metadata import version

    result = subprocess.run([sys.executable, "-m", "builder_plugin", "--version"], capture_output=True, text=True,
                            env=ENV, timeout=300)
    assert result.returncode == 0 and result.stdout.split() == ["builder_plugin", version("builder_plugin")]


def test_usage_line_names_the_command_it_was_called_as() -> None:
    script = Path(sysconfig.get_path("scripts")) / "phi4mm-genai-build"  # the console script pip installed
    assert script.is_file(), f"{script} is missing: pip install -e . installs it"
    as_script = subprocess.run([str(script), "--help"], capture_output=True, text=True, env=ENV, timeout=300)
    as_module = subprocess.run([sys.executable, "-m", "builder_plugin", "--help"], capture_output=True, text=True,
                               env=ENV, timeout=300)
    assert as_script.returncode == as_module.returncode == 0, as_script.stderr
    assert as_script.stdout.startswith("usage: phi4mm-genai-build ")
    assert as_module.stdout.startswith("usage: python -m builder_plugin ")
def test_jobs_reach_the_quantizer_and_the_summary_says_how_long_quantization_took(tmp_path: Path,
                                                                                  tiny_checkpoint: Path) -> None:
    out = tmp_path / "out"
    result = run_cli("-i", str(tiny_checkpoint), "-o", str(out), "--no-progress", "--components", "vision",
                     "--jobs", "2")
    assert result.returncode == 0, result.stderr
    summary = [line for line in result.stdout.splitlines() if line.startswith("built vision in ")]
    assert len(summary) == 1 and re.search(r"\(quantization \d+\.\d s on 2 threads\)", summary[0]), result.stdout
    float_build = run_cli("-i", str(tiny_checkpoint), "-o", str(tmp_path / "fp32"), "--no-progress", "--components",
                          "vision", "-p", "fp32")
    assert float_build.returncode == 0 and "quantization" not in float_build.stdout
