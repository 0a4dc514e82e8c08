from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from builder_plugin.errors import OutputError
from builder_plugin.graph import GraphBuilder
from builder_plugin.package import ExternalDataStore, OutputFolder, PackageWriter, initializers
from builder_plugin.quant.weights import StoredView
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


def test_a_view_is_its_bases_bytes_and_a_graph_reads_it_in_its_own_shape(tmp_path: Path) -> None:
    """A StoredView costs no bytes of its own: stored before or after its base, both name one location, and a graph
    reading the view gets the base's values in the view's shape."""
    values = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) * 0.5
    base = ir.LazyTensor(lambda: ir.tensor(values), dtype=ir.DataType.FLOAT, shape=ir.Shape(values.shape), name="w")
    view = StoredView(base, (2, 12))
    store = ExternalDataStore(tmp_path / "d.data")
    assert store.put(view) == store.put(base) == store.put(StoredView(base, (6, 4)))
    assert store.written_bytes == values.nbytes and (tmp_path / "d.data").stat().st_size == values.nbytes
    with pytest.raises(ValueError, match="cannot read"):
        StoredView(base, (5, 5))

    spec = IOSpec(inputs=(TensorSpec("x", "float32", ("n", 12)),), outputs=(TensorSpec("y", "float32", ("n", 2)),))
    g = GraphBuilder("m", spec)
    g.output("y", g.op("MatMul", g.inputs["x"], g.op("Transpose", g.initializer(view), perm=[1, 0])))
    writer = PackageWriter(tmp_path, progress=False)
    writer.save(g.model(), "m.onnx", "m.data")
    x = np.random.default_rng(0).standard_normal((3, 12)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, x @ values.reshape(2, 12).T, rtol=1e-5, atol=1e-5)


def test_initializers_of_nested_branches_are_each_found_once() -> None:
    def stored(name: str) -> ir.Value:
        return ir.Value(name=name, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.FLOAT),
                        const_value=ir.tensor(np.ones(1, np.float32), name=name))

    cond = ir.val("c", shape=[], type=ir.TensorType(ir.DataType.BOOL))

    def branch(name: str, inner: ir.Graph | None = None) -> ir.Graph:
        value = stored(f"{name}_w")
        nodes = []
        if inner is not None:
            nodes = [ir.node("If", [cond], attributes={"then_branch": inner, "else_branch": branch(f"{name}_else")},
                             name=f"{name}_If")]
            nodes[0].outputs[0].name = f"{name}_out"
            value = nodes[0].outputs[0]
        graph = ir.Graph([], [value], nodes=nodes, name=name)
        if inner is None:
            graph.register_initializer(value)
        return graph

    outer = branch("top", inner=branch("deep"))
    main = ir.Graph([cond], [], nodes=[], name="main")
    main.register_initializer(stored("main_w"))
    main.append(ir.node("If", [cond], attributes={"then_branch": outer, "else_branch": branch("other")}, name="If"))
    assert sorted(v.name for v in initializers(main)) == ["deep_w", "main_w", "other_w", "top_else_w"]


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
