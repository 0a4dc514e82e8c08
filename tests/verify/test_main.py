"""`python -m builder_plugin.verify`: a good package passes every mode, a package with the wrong decoder variant,
damaged vision weights or a mistake in the builder's routing fails the modes it breaks (and names them), both
checkpoint layouts work, and bad input gives one line."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from builder_plugin.layout import GRAPH_FILES, MAIN_DECODER, MODE_DECODERS, Component
from builder_plugin.testing.media import make_wav
from builder_plugin.verify.__main__ import EXIT_MISMATCH, main, make_parser
from builder_plugin.verify.modes import VERIFY_MODES
from builder_plugin.verify.package_info import package_precisions

NEW_TOKENS = 8


def run_verify(*args: str | Path) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*map(str, args), "--no-progress"])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def verify_json(tmp_path: Path, package: Path, checkpoint: Path, *extra: str | Path) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    result = run_verify(package, "--checkpoint", checkpoint, "--max-new-tokens", NEW_TOKENS, "--json", report,
                        "--report", tmp_path / "report.md", *extra)
    assert result.returncode in (0, EXIT_MISMATCH), result.stderr
    data = json.loads(report.read_text())
    assert (tmp_path / "report.md").read_text().startswith("# Package verification")
    assert data["passed"] == (result.returncode == 0)
    for mode in data["failed_modes"]:
        assert mode in result.stdout
    return result.returncode, data


def build_package(tmp_path_factory, checkpoint: Path, **options) -> Path:
    from builder_plugin.build import build
    from builder_plugin.options import BuildOptions

    output = tmp_path_factory.mktemp("verify-package") / "package"
    return build(BuildOptions(model_dir=checkpoint, output_dir=output, execution_provider="cpu", max_length=1024,
                              **{"precision": "fp32", **options}), progress=False).output_dir


def damage_vision(package: Path, out: Path) -> str:
    """A copy of `package` (links, but for the vision graph) with its largest vision initializer scaled by 1.5 in
    the external data file; returns the initializer's name."""
    out.mkdir()
    for item in package.iterdir():
        if item.name.startswith(GRAPH_FILES[Component.VISION]):
            (out / item.name).write_bytes(item.read_bytes())
        else:
            (out / item.name).symlink_to(item)
    model = onnx.load(str(out / GRAPH_FILES[Component.VISION]), load_external_data=False)
    external = [t for t in model.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL and t.data_type == onnx.TensorProto.FLOAT]
    tensor = max(external, key=lambda t: int(np.prod(t.dims)))
    where = {entry.key: entry.value for entry in tensor.external_data}
    offset, length = int(where.get("offset", 0)), int(where["length"])
    with open(out / where["location"], "r+b") as f:
        f.seek(offset)
        values = np.frombuffer(f.read(length), dtype=np.float32) * np.float32(1.5)
        f.seek(offset)
        f.write(values.tobytes())
    return tensor.name


@pytest.mark.parametrize("layout", ["original", "native"])
def test_good_package_passes_every_mode(request, tmp_path, layout):
    suffix = "" if layout == "original" else "_native"
    package = request.getfixturevalue(f"tiny{suffix}_package")
    checkpoint = request.getfixturevalue(f"tiny{suffix}_checkpoint")
    code, data = verify_json(tmp_path, package, checkpoint)
    assert code == 0, data["modes"]
    assert data["precision"] == "fp32" and data["checkpoint_format"] == layout
    assert [m["mode"] for m in data["modes"]] == list(VERIFY_MODES)
    for mode in data["modes"]:
        assert mode["passed"] and mode["top1_agreement"] == 1.0
        assert mode["positions"] == NEW_TOKENS
        assert mode["max_relative_diff"] <= 1e-3 and mode["prefill_max_relative_diff"] <= 1e-3
    assert data["matmul_kernel"] == "onnxruntime's own kernel"  # an fp32 package: no MatMulNBits, no library
    variants = {c["mode"]: c["variant"] for c in data["cases"]}
    assert variants == dict.fromkeys(VERIFY_MODES, MAIN_DECODER)  # one self-routing decoder answers every mode
    for side in ("package", "reference"):
        assert 0 < data["peak_private_gb"][side] <= data["peak_rss_gb"]["overall"]


def test_int4_package_reports_the_prompt_path(tmp_path, tiny_int4_package, tiny_checkpoint):
    """verify runs the package as the run-time helper does (the kernel library where it helps) and reports the
    prefill, which every built-in prompt makes long enough for a kernel's many-rows path, apart from decode. Each mode
    runs on the decoder the helper answers it with (with the library) and on the routed decoder a plain
    onnxruntime-genai app runs."""
    from builder_plugin import kernels

    _, data = verify_json(tmp_path, tiny_int4_package, tiny_checkpoint, "--modes", "text,image")
    library = kernels.level() != "none"
    assert data["matmul_kernel"] == (f"the builder_plugin library ({kernels.paths()})" if library
                                     else "onnxruntime's own kernel")
    decoders = {(case["mode"], case["variant"]) for case in data["cases"]}
    assert decoders == {("text", MAIN_DECODER), ("image", MAIN_DECODER),
                        *((("text", MODE_DECODERS["text"]), ("image", MODE_DECODERS["vision"])) if library else ())}
    assert all(case["prompt_tokens"] >= 16 for case in data["cases"])
    for mode in data["modes"]:
        assert mode["prefill_mean_kl"] >= 0 and 0 <= mode["prefill_top1"] <= 1
        assert mode["decode_mean_kl"] >= 0
    report = (tmp_path / "report.md").read_text()
    assert "prefill mean KL" in report and "MatMulNBits ran on" in report


def test_user_prompts_and_media_add_cases(tmp_path, tiny_package, tiny_checkpoint, media_dir):
    code, data = verify_json(tmp_path, tiny_package, tiny_checkpoint, "--modes", "image,audio",
                             "--prompt", "What colour dominates?", "--image", media_dir / "wide.jpg",
                             "--audio", media_dir / "clip_0_5s.wav")
    assert code == 0, data["modes"]
    assert [(c["case"], c["mode"]) for c in data["cases"]] == [
        ("image", "image"), ("image #2", "image"), ("audio", "audio"), ("audio #2", "audio")]
    assert data["cases"][0]["prompt_tokens"] != data["cases"][2]["prompt_tokens"]


def test_wrong_variant_fails_text_and_audio(tmp_path, tmp_path_factory, tiny_checkpoint):
    """--lora vision: one decoder with the vision LoRA answers everything, so text (no LoRA) and audio (speech LoRA)
    differ from the checkpoint while the image modes still match."""
    package = build_package(tmp_path_factory, tiny_checkpoint, lora="vision")
    code, data = verify_json(tmp_path, package, tiny_checkpoint)
    assert code == EXIT_MISMATCH
    assert data["failed_modes"] == ["text", "audio"]
    assert {c["variant"] for c in data["cases"]} == {MAIN_DECODER}


def test_damaged_vision_weights_fail_image_modes(tmp_path, tiny_package, tiny_checkpoint):
    damaged = tmp_path / "damaged"
    damage_vision(tiny_package, damaged)
    code, data = verify_json(tmp_path, damaged, tiny_checkpoint, "--modes", "text,image,image+audio")
    assert code == EXIT_MISMATCH
    assert data["failed_modes"] == ["image", "image+audio"]


def route_swapped(monkeypatch, first: str, second: str) -> None:
    """A routing table with one mistake, for the rest of the test: the checkpoint tensors the table routes to the
    decoder's `first` and `second` go to each other's place (same shape, so nothing in the build notices)."""
    from builder_plugin.checkpoint import routing

    table = routing.expanded_routes

    def mistaken(config):
        rows = table(config)
        swap = {first: second, second: first}
        assert sum(local in swap for _, _, local, _ in rows) == 2
        return [(source, route, swap.get(local, local), shape) for source, route, local, shape in rows]

    monkeypatch.setattr(routing, "expanded_routes", mistaken)


@pytest.mark.parametrize(("first", "second", "failed"), [
    ("layers.0.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight", list(VERIFY_MODES)),
    ("layers.0.self_attn.o_proj.lora_B.vision.weight", "layers.1.self_attn.o_proj.lora_B.vision.weight",
     ["image", "image+audio"]),
], ids=["two-layers-swapped", "vision-lora-swapped"])
def test_routing_mistake_in_the_builder_fails(tmp_path, tmp_path_factory, tiny_checkpoint, monkeypatch, first,
                                              second, failed):
    """verify reads the checkpoint without the builder's routing table, so a mistake in the table fails the modes
    it touches, while the table is still wrong in the verifying process: two layers' MLP weights swapped fail every
    mode; one projection's vision LoRA swapped between two layers fails the modes that run the vision LoRA."""
    route_swapped(monkeypatch, f"{first}", f"{second}")
    package = build_package(tmp_path_factory, tiny_checkpoint)
    code, data = verify_json(tmp_path, package, tiny_checkpoint)
    assert code == EXIT_MISMATCH
    assert data["failed_modes"] == failed


def test_precision_is_read_from_the_graphs(tmp_path_factory, tiny_checkpoint, tiny_package):
    assert set(package_precisions(tiny_package).values()) == {"fp32"}
    int4 = build_package(tmp_path_factory, tiny_checkpoint, precision="int4", lora="none")
    precisions = package_precisions(int4)
    assert precisions[MAIN_DECODER] == "int4" and precisions[GRAPH_FILES[Component.VISION]] == "int4"


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert result.returncode == code, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_input_gives_one_line(tmp_path, tmp_path_factory, tiny_package, tiny_checkpoint):
    from builder_plugin.testing.make_checkpoint import make_checkpoint

    assert_one_line_error(run_verify(tmp_path / "nowhere", "--checkpoint", tiny_checkpoint), 1, "not a model package")
    assert_one_line_error(run_verify(tiny_package, "--checkpoint", tmp_path), 1, "not a checkpoint folder")
    deeper = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "three-layers", preset="tiny", seed=1, text_layers=3)
    assert_one_line_error(run_verify(tiny_package, "--checkpoint", deeper), 1, "num_hidden_layers 2 vs 3")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    # media options before the package folder (each takes one value, so the folder is not swallowed)
    assert_one_line_error(run_verify("--image", broken, tiny_package, "--checkpoint", tiny_checkpoint), 1,
                          "cannot read image")
    noise = tmp_path / "noise.wav"
    noise.write_bytes(bytes(range(256)) * 8)
    assert_one_line_error(run_verify(tiny_package, "--checkpoint", tiny_checkpoint, "--modes", "audio", "--audio",
                                     noise), 1, "noise.wav", "not a readable audio clip")
    click = tmp_path / "click.wav"
    make_wav(click, 0.01)  # shorter clips crash onnxruntime-genai's feature extractor: refused before it
    assert_one_line_error(run_verify(tiny_package, "--checkpoint", tiny_checkpoint, "--modes", "audio", "--audio",
                                     click), 1, "click.wav: the clip is too short")


def test_usage_errors_exit_2(tiny_package, tiny_checkpoint):
    result = subprocess.run([sys.executable, "-m", "builder_plugin.verify", str(tiny_package), "--checkpoint",
                             str(tiny_checkpoint), "--modes", "text,video"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and "unknown mode(s) video" in result.stderr


def test_package_of_other_weights_fails(tmp_path, tmp_path_factory, tiny_package):
    """Same architecture, other weights (as a fine-tune is): the package of the seed-0 checkpoint does not match."""
    from builder_plugin.testing.make_checkpoint import make_checkpoint

    other = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "other-weights", preset="tiny", seed=1)
    code, data = verify_json(tmp_path, tiny_package, other, "--modes", "text,image")
    assert code == EXIT_MISMATCH and data["failed_modes"] == ["text", "image"]


def test_media_and_prompt_options_go_anywhere_and_repeat() -> None:
    args = make_parser().parse_args(["--image", "x.jpg", "PKG", "--audio", "a.wav", "--checkpoint", "CKPT",
                                     "--image", "y.png", "--prompt", "one", "--prompt", "two words"])
    assert args.package == Path("PKG") and args.checkpoint == Path("CKPT")
    assert args.image == [Path("x.jpg"), Path("y.png")] and args.audio == [Path("a.wav")]
    assert args.prompt == ["one", "two words"]
