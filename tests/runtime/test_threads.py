"""Thread counts chosen at load: onnxruntime's own trace of each session's options (its verbose log) is the reference
for what every session got, and that the package's own entries (session.disable_prepacking) survived the overlay."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import onnxruntime_genai as og
import pytest

from builder_plugin import kernels
from builder_plugin.build import build
from builder_plugin.layout import GENAI_CONFIG_FILE, MAIN_DECODER, SPLIT_DECODERS
from builder_plugin.options import BuildOptions
from builder_plugin.runtime import Chat, PackageError
from builder_plugin.runtime.threads import SESSION_SECTIONS
from tests.conftest import TINY_PACKAGE_MAX_LENGTH

TRACE = re.compile(r"TraceSessionOptions\] Session Options \{.*?session_logid:(\S*) .*?"
                   r"intra_op_param:OrtThreadPoolParams \{ thread_pool_size: (-?\d+) .*?config_options: \{(.*?)\}")
PREPACKING_OFF = "session.disable_prepacking: 1"
# onnxruntime reads this entry when it creates the session's pool, after the trace of its thread parameters
SPINNING_OFF = "session.intra_op.allow_spinning: 0"


@pytest.fixture(scope="module")
def float_encoders_package(tmp_path_factory, tiny_checkpoint) -> Path:
    """An int4 package whose vision and speech stay float: those sections have session_options of their own."""
    out = tmp_path_factory.mktemp("threads") / "int4-float-encoders"
    build(BuildOptions(model_dir=tiny_checkpoint, output_dir=out, precision="int4", execution_provider="cpu",
                       max_length=TINY_PACKAGE_MAX_LENGTH, quantize_encoders=False), progress=False)
    return out


def traced_copy(package: Path, folder: Path) -> tuple[Path, dict]:
    """`package` with verbose session logs, each section's sessions named after it (log_id); files linked."""
    folder.mkdir()
    for item in package.iterdir():
        if item.name != GENAI_CONFIG_FILE:
            (folder / item.name).symlink_to(item)
    config = json.loads((package / GENAI_CONFIG_FILE).read_text())
    for section in SESSION_SECTIONS:
        options = config["model"].get(section, {}).get("session_options")
        if options is not None:
            options.update(log_id=section, log_severity_level=0)
    (folder / GENAI_CONFIG_FILE).write_text(json.dumps(config))
    return folder, config


def sessions(capfd) -> list[tuple[str, int, str]]:
    """(log id, intra-op threads, config entries) of every session onnxruntime created, in order; none may let its
    intra-op pool spin."""
    err = capfd.readouterr().err
    found = [(m[1], int(m[2]), m[3]) for m in TRACE.finditer(err)]
    assert found and all(SPINNING_OFF in entries for _, _, entries in found)
    return found


def physical_cores() -> int:
    """Cores of this process's CPUs, read here from Linux's topology files (one entry per set of SMT siblings)."""
    return len({Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list").read_text()
                for cpu in os.sched_getaffinity(0)})


def load(package: Path, **kwargs) -> None:
    chat = Chat(package, **kwargs)
    chat.load(chat.main_decoder)


@pytest.mark.parametrize("threads", [None, 3])
def test_every_session_gets_the_threads_and_keeps_its_own_options(float_encoders_package, tmp_path, capfd, threads):
    package, config = traced_copy(float_encoders_package, tmp_path / "traced")
    assert config["model"]["vision"]["session_options"]["session.disable_prepacking"] == "1"
    assert "session_options" not in config["model"]["embedding"]  # follows the decoder's
    capfd.readouterr()
    load(package, threads=threads)
    found = sessions(capfd)
    expected = physical_cores() if threads is None else threads
    # created in the order vision, speech, embedding (with the decoder's options), decoder
    assert [(name, count) for name, count, _ in found] == [
        ("vision", expected), ("speech", expected), ("decoder", expected), ("decoder", expected)]
    assert [PREPACKING_OFF in entries for _, _, entries in found] == [True, True, False, False]


@pytest.mark.skipif(kernels.level() == "none", reason="text has a decoder of its own where the library runs")
def test_a_text_decoders_media_sessions_skip_prepacking(tiny_int4_package, tmp_path, capfd):
    """The text decoder's og.Model loads the vision and speech sessions all the same and never runs them: those skip
    prepacking (nothing they would prepack is read); the routed decoder's sessions keep it."""
    package, _ = traced_copy(tiny_int4_package, tmp_path / "traced")
    chat = Chat(package)
    capfd.readouterr()
    chat.load(SPLIT_DECODERS["text"])
    assert [PREPACKING_OFF in entries for _, _, entries in sessions(capfd)] == [True, True, False, False]
    chat.load(MAIN_DECODER)
    assert [PREPACKING_OFF in entries for _, _, entries in sessions(capfd)] == [False] * 4


def test_a_plain_overlay_would_drop_an_encoder_sections_options(float_encoders_package, tmp_path, capfd):
    """Why the vision/speech overlay repeats the package's options: onnxruntime-genai replaces those objects."""
    package, _ = traced_copy(float_encoders_package, tmp_path / "traced")
    config = og.Config(str(package))
    config.overlay(json.dumps({"model": {"vision": {"session_options": {"intra_op_num_threads": 2,
                                                                        "log_severity_level": 0}}}}))
    capfd.readouterr()
    model = og.Model(config)  # loaded for its log only
    del model
    vision = TRACE.search(capfd.readouterr().err)
    assert vision[1] == "" and PREPACKING_OFF not in vision[3]


def test_the_decoder_keeps_its_entries(tiny_package, tmp_path, capfd):
    package, config = traced_copy(tiny_package, tmp_path / "traced")  # fp32: the decoder's options say unpacked
    assert config["model"]["decoder"]["session_options"]["session.disable_prepacking"] == "1"
    capfd.readouterr()
    load(package, threads=1)
    found = sessions(capfd)
    assert len(found) == 4
    assert all(count == 1 and PREPACKING_OFF in entries for _, count, entries in found)


def test_a_count_the_package_sets_is_kept_unless_asked(tiny_package, tmp_path, capfd):
    package, config = traced_copy(tiny_package, tmp_path / "traced")
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 3
    (package / GENAI_CONFIG_FILE).write_text(json.dumps(config))
    capfd.readouterr()
    load(package)
    assert {count for _, count, _ in sessions(capfd)} == {3}
    load(package, threads=2)
    assert {count for _, count, _ in sessions(capfd)} == {2}


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_bad_thread_counts(tiny_package, threads):
    with pytest.raises(PackageError, match="threads must be a positive integer"):
        Chat(tiny_package, threads=threads)


def test_serve_and_sample_refuse_bad_counts_in_one_line(tiny_package, capsys):
    from builder_plugin.serve.__main__ import main as serve_main
    from samples.chat import main as sample_main

    for main in (serve_main, sample_main):
        assert main([str(tiny_package), "--threads", "0"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "threads must be a positive integer" in err
