from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from builder_plugin.errors import OutputError
from builder_plugin.graph import GraphBuilder
from builder_plugin.package import ExternalDataStore, OutputFolder, PackageWriter
from builder_plugin.spec import IOSpec, TensorSpec

SPEC = IOSpec(inputs=(TensorSpec("x", "float32", ("n", 64)),), outputs=(TensorSpec("y", "float32", ("n", 32)),))


def _model(shared: torch.Tensor, own: torch.Tensor) -> ir.Model:
    g = GraphBuilder("m", SPEC)
    y = g.op("MatMul", g.inputs["x"], g.weight("shared", shared, transform=lambda t: t.T))
    g.output("y", g.op("MatMul", y, g.weight("own", own)))
    return g.model()


def test_identical_initializers_are_stored_once_and_both_graphs_run(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)  # fixed: a float32 product's rounding varies with the values
    shared, own_a, own_b = (torch.randn(*shape, generator=generator) for shape in ((32, 64), (32, 32), (32, 32)))
    writer = PackageWriter(tmp_path, progress=False)
    writer.save(_model(shared, own_a), "a.onnx", "weights.data")
    writer.save(_model(shared, own_b), "b.onnx", "weights.data")
    store = writer.stores["weights.data"]
    assert store.reused_bytes == shared.numel() * 4
    assert (tmp_path / "weights.data").stat().st_size < (shared.numel() + 2 * own_a.numel()) * 4 + 3 * 64
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    for name, own in (("a.onnx", own_a), ("b.onnx", own_b)):
        got = ort.InferenceSession(str(tmp_path / name)).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, x @ shared.numpy().T @ own.numpy(), rtol=1e-5, atol=1e-5)


def test_store_distinguishes_same_bytes_with_other_shape(tmp_path: Path) -> None:
    store = ExternalDataStore(tmp_path / "d.data")
    a = ir.tensor(np.arange(8, dtype=np.float32).reshape(2, 4))
    b = ir.tensor(np.arange(8, dtype=np.float32).reshape(4, 2))
    assert store.put(a) != store.put(b)
    assert store.put(ir.tensor(np.arange(8, dtype=np.float32).reshape(2, 4))) == store.put(a)


def test_output_folder_replaces_only_on_commit(tmp_path: Path) -> None:
    final = tmp_path / "pkg"
    final.mkdir()
    (final / "old").write_text("old")
    with pytest.raises(OutputError, match="not empty"):
        OutputFolder(final, overwrite=False).check()
    with pytest.raises(RuntimeError), OutputFolder(final, overwrite=True) as staging:
        (staging / "new").write_text("new")
        raise RuntimeError("fail before commit")
    assert [p.name for p in final.iterdir()] == ["old"]
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]
    folder = OutputFolder(final, overwrite=True)
    with folder as staging:
        (staging / "new").write_text("new")
        folder.commit()
    assert [p.name for p in final.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]


def test_output_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="not a folder"):
        OutputFolder(tmp_path / "file", overwrite=True).check()


def test_progress_bars_write_nothing_when_the_output_is_not_a_terminal(tmp_path: Path, capfd) -> None:
    """Into a log or a pipe a bar would be one \\r-line per update; there it is left out."""
    PackageWriter(tmp_path, progress=True).save(_model(torch.randn(32, 64), torch.randn(32, 32)), "a.onnx", "w.data")
    out, err = capfd.readouterr()
    assert "\r" not in out + err and "writing a.onnx" not in err
