"""The library's MatMulNBits kernel (builder_plugin/kernels) through onnxruntime, against independent numpy
references: the exact integer block sums of its int8 path, the float result within the activation quantization's
bound, and onnxruntime's own kernel; its bf16 path of many rows (AMX) against the exact sums of bf16-rounded operands.
Where this CPU lacks AVX2 the library must register nothing, and the session answers with onnxruntime's kernel."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from builder_plugin import kernels
from builder_plugin.quant_choices import BLOCK_SIZES
from tests.kernels.matmul_nbits_graphs import (
    bf16_bound,
    bf16_reference,
    int8_reference,
    quantization_bound,
    random_b,
    write_graph,
)

LIBRARY = kernels.library_path()
ACTIVE = kernels.level() != "none"
TRACE = "BUILDER_PLUGIN_OPS_TRACE"
# The int8 paths this CPU runs (BUILDER_PLUGIN_OPS_PATH forces one for every row count) and the trace naming each.
# avx2: the paths of a CPU with AVX2 alone, by node (avx2_trace).
PATHS = {"avx512": "int8 AVX-512 path", "panels": "int8 AVX-512 panels path", "amx": "int8 AMX path"}
VNNI = kernels.level() in ("avx512_vnni", "amx", "amx_bf16")
INT8_PATHS = ["avx2"] + (["avx512", "panels"] if VNNI else []) + (["amx"] if kernels.level() in ("amx", "amx_bf16")
                                                                 else [])
BF16 = kernels.level() == "amx_bf16"
BF16_FROM_ROWS = 16  # ops.cc: kBf16FromRows
PANELS_FROM_ROWS = 20  # ops.cc: kPanelsFromRows
AVX2_PANELS_FROM_ROWS = {4: 16, 8: 24}  # ops.cc: kAvx2PanelsFromRows, kAvx2Panels8FromRows
WITHOUT_AMX = f"int8 AVX-512 (up to {PANELS_FROM_ROWS - 1} rows) / int8 AVX-512 panels path"


def avx2_trace(bits: int, block: int) -> str:
    """The paths of a node with AVX2 alone: in place for few rows from blocks of 32, panels for many (blocks of 16:
    panels only)."""
    if block < 32:
        return "int8 AVX2 panels path"
    return f"int8 AVX2 (up to {AVX2_PANELS_FROM_ROWS[bits] - 1} rows) / int8 AVX2 panels path"


# The paths a 4-bit node with blocks of 32 takes by default on this CPU, as the trace names them ("" where the
# library registers nothing).
DEFAULT_PATHS = {"none": "", "avx2": avx2_trace(4, 32), "avx512_vnni": WITHOUT_AMX,
                 "amx": "int8 AVX-512 (up to 11 rows) / int8 AMX path",
                 "amx_bf16": f"int8 AVX-512 (up to {BF16_FROM_ROWS - 1} rows) / bf16 AMX path"}[kernels.level()]


@pytest.fixture(params=INT8_PATHS)
def int8_path(request, monkeypatch):
    monkeypatch.setenv("BUILDER_PLUGIN_OPS_PATH", request.param)
    return request.param


def test_library_is_built_and_matches_the_cpu():
    assert LIBRARY is not None, "pip install builds builder_plugin/kernels/libbuilder_plugin_ops.so"
    flags = kernels.cpu_flags()
    assert ACTIVE is {"avx2", "fma"}.issubset(flags)
    assert VNNI is {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}.issubset(flags)


def session(path, library: bool, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library:
        options.register_custom_ops_library(str(LIBRARY))
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run(path, a: np.ndarray, library: bool) -> np.ndarray:
    return session(path, library).run(None, {"A": a})[0]


def forced_trace(int8_path: str, bits: int, block: int) -> str:
    """The trace of a node of `bits` and `block` under BUILDER_PLUGIN_OPS_PATH=`int8_path`."""
    return avx2_trace(bits, block) if int8_path == "avx2" else PATHS[int8_path]


def traced_path(capfd, path) -> str:
    """The path the library's kernel reports for the graph's node ("" when onnxruntime's own kernel runs)."""
    capfd.readouterr()
    session(path, library=True)
    lines = [line for line in capfd.readouterr().err.splitlines() if "MatMulNBits mnb" in line]
    return lines[0].rsplit(": ", 1)[1] if lines else ""


# Every block size the builder emits, both bit widths, with and without zero points; K a whole number of blocks or
# not (padding), N odd, rows 1..9 and beyond a block of 64.
CASES = [(bits, block, zp) for bits in (4, 8) for block in BLOCK_SIZES for zp in (False, True)]


@pytest.mark.parametrize(("bits", "block", "zero_points"), CASES)
# 37 blocks: the panels unpack 16 blocks at a time, the last group odd; 7 columns: a panel of 48 mostly past N. 11
# rows read B in place where a path does, 30 take the panels.
@pytest.mark.parametrize(("blocks", "n", "m"), [(4, 37, 11), (37, 7, 11), (37, 7, 30)])
def test_integer_sums_are_exact(tmp_path, monkeypatch, capfd, int8_path, bits, block, zero_points, blocks, n, m):
    """Activations on their int8 grid and scales powers of two: every product and sum is exact in float32, so the
    kernel's Y must equal the exact integer result bit for bit."""
    rng = np.random.default_rng(bits * 1000 + block + zero_points + blocks + m)
    k = (blocks - 1) * block + block // 2 + 3
    column_scale = np.float32(2.0) ** rng.integers(-8, -2, size=(n, 1))
    b = random_b(rng, k, n, bits, block, zero_points, scales=np.repeat(column_scale, -(-k // block), axis=1))
    codes = rng.integers(-127, 128, size=(m, k))
    first = np.arange(0, k, block)
    codes[:, first] = 127  # every block's largest activation is 127 steps: its scale is exactly the step
    a = (codes * np.float32(2.0) ** rng.integers(-6, 0, size=(m, 1))).astype(np.float32)
    path = write_graph(tmp_path / "g.onnx", b)
    monkeypatch.setenv(TRACE, "1")
    assert traced_path(capfd, path) == (forced_trace(int8_path, bits, block) if ACTIVE else "")
    y = run(path, a, library=True)
    expected = int8_reference(b, a)
    if ACTIVE:
        np.testing.assert_array_equal(y.astype(np.float64), expected)
    else:
        np.testing.assert_array_equal(y, run(path, a, library=False))


@pytest.mark.parametrize(("bits", "block", "zero_points"), CASES)
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 70])
def test_random_weights_within_bounds(tmp_path, int8_path, bits, block, zero_points, rows):
    rng = np.random.default_rng(rows * 7 + bits * 100 + block + zero_points)
    k, n = (4 * block + 40 if block < 256 else 600), 45
    b = random_b(rng, k, n, bits, block, zero_points)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    a[:, 5] *= 20  # an outlier channel, as LLM activations have
    bias = rng.standard_normal(n).astype(np.float32) if zero_points else None
    path = write_graph(tmp_path / "g.onnx", b, bias=bias)
    y = run(path, a, library=True).astype(np.float64)
    builtin = run(path, a, library=False).astype(np.float64)
    exact = a.astype(np.float64) @ b.dequantized().T + (bias if bias is not None else 0.0)
    bound = quantization_bound(b, a)
    if ACTIVE:  # float32 sums of exact block products, then within the quantization bound of the float result
        assert np.abs(y - int8_reference(b, a, bias)).max() <= 1e-5 * (np.abs(exact).max() + 1)
        assert np.all(np.abs(y - exact) <= bound * 1.001 + 1e-5)
        assert np.all(np.abs(y - builtin) <= 2 * bound + 1e-4)
    else:
        np.testing.assert_array_equal(y, builtin)


@pytest.mark.parametrize("seed", range(8))
def test_drawn_shapes_against_the_int8_reference(tmp_path, int8_path, seed):
    """Shapes drawn at random (a fixed seed each): any bit width, block size and zero-point form, K from one row to
    40 blocks, N from 1 to 200 (panels of 48 partly or wholly past N), 1 to 70 rows, with or without a bias."""
    rng = np.random.default_rng(1000 + seed)
    bits, block = int(rng.choice([4, 8])), int(rng.choice(BLOCK_SIZES))
    k, n, rows = int(rng.integers(1, 40 * block + 1)), int(rng.integers(1, 201)), int(rng.integers(1, 71))
    b = random_b(rng, k, n, bits, block, bool(rng.integers(2)))
    a = rng.standard_normal((rows, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if rng.integers(2) else None
    path = write_graph(tmp_path / "g.onnx", b, bias=bias)
    y = run(path, a, library=True).astype(np.float64)
    if ACTIVE:
        exact = a.astype(np.float64) @ b.dequantized().T
        assert np.abs(y - int8_reference(b, a, bias)).max() <= 1e-5 * (np.abs(exact).max() + 1)
    else:
        np.testing.assert_array_equal(y, run(path, a, library=False))


def test_full_size_shape_against_onnxruntime(tmp_path, int8_path):
    """One decoder shape of the full-size model (gate_up's K with down's N), one row and four."""
    rng = np.random.default_rng(3)
    b = random_b(rng, 8192, 3072, 4, 32, zero_points=False)
    path = write_graph(tmp_path / "g.onnx", b)
    for rows in (1, 4):
        a = rng.standard_normal((rows, 8192)).astype(np.float32)
        y = run(path, a, library=True).astype(np.float64)
        exact = a.astype(np.float64) @ b.dequantized().T
        assert np.all(np.abs(y - exact) <= quantization_bound(b, a) * 1.001 + 1e-4)
        assert np.all(np.abs(y - run(path, a, library=False)) <= 2 * quantization_bound(b, a) + 1e-4)


@pytest.mark.parametrize(("accuracy_level", "scales_2d"), [(0, False), (1, True)])
def test_float_path_for_other_accuracy_levels(tmp_path, monkeypatch, capfd, accuracy_level, scales_2d):
    """Below accuracy_level 4 the kernel keeps A in float: the float result up to float rounding."""
    rng = np.random.default_rng(accuracy_level)
    b = random_b(rng, 200, 33, 4, 32, zero_points=True)
    a = rng.standard_normal((3, 200)).astype(np.float32)
    path = write_graph(tmp_path / "g.onnx", b, accuracy_level=accuracy_level, scales_2d=scales_2d)
    monkeypatch.setenv(TRACE, "1")
    assert traced_path(capfd, path) == ("float path" if ACTIVE else "")
    y = run(path, a, library=True).astype(np.float64)
    np.testing.assert_allclose(y, a.astype(np.float64) @ b.dequantized().T, rtol=1e-5, atol=1e-5)


def check_bf16_path(y: np.ndarray, b, a: np.ndarray, bias: np.ndarray | None, builtin: np.ndarray) -> None:
    """Y of the bf16 path where this CPU has AMX bf16 (the exact sums of the bf16-rounded operands, up to float32
    summation, and within bf16's bound of the float result); elsewhere the library's int8 path (forcing a path the CPU
    lacks leaves the default), or onnxruntime's kernel where the library registers nothing."""
    y = y.astype(np.float64)
    exact = a.astype(np.float64) @ b.dequantized().T + (bias if bias is not None else 0.0)
    if BF16:
        expected, summation = bf16_reference(b, a, bias)
        assert np.all(np.abs(y - expected) <= summation + 1e-30)
        assert np.all(np.abs(y - exact) <= bf16_bound(b, a) + 1e-6)
    elif ACTIVE:
        assert np.abs(y - int8_reference(b, a, bias)).max() <= 1e-5 * (np.abs(exact).max() + 1)
    else:
        np.testing.assert_array_equal(y, builtin)


@pytest.mark.parametrize(("bits", "block", "zero_points"), CASES)
@pytest.mark.parametrize("rows", [12, 17, 64])
def test_bf16_path_against_the_bf16_reference(tmp_path, monkeypatch, capfd, bits, block, zero_points, rows):
    """Many rows: A and the dequantized B rounded to bf16, sums in float32 over all of K. A channel 1000 times larger
    than the others (the "massive activations" of real checkpoints) costs the others nothing: bf16 keeps each value's
    own exponent."""
    rng = np.random.default_rng(rows * 11 + bits * 100 + block + zero_points)
    k, n = 3 * block + block // 2 + 3, 37  # K ends inside a block and inside a tile's 32 rows
    b = random_b(rng, k, n, bits, block, zero_points)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    a[:, 5] *= 1000
    bias = rng.standard_normal(n).astype(np.float32) if zero_points else None
    path = write_graph(tmp_path / "g.onnx", b, bias=bias)
    monkeypatch.setenv("BUILDER_PLUGIN_OPS_PATH", "bf16")
    monkeypatch.setenv(TRACE, "1")
    assert traced_path(capfd, path) == ("bf16 AMX path" if BF16 else DEFAULT_PATHS)
    check_bf16_path(run(path, a, library=True), b, a, bias, run(path, a, library=False))


@pytest.mark.parametrize(("rows", "k", "n", "bits", "block"), [
    (70, 4200, 300, 4, 32),   # two depth blocks of K (the second adds to Y's sums), several panels, edge tiles
    (33, 4133, 45, 8, 16),    # blocks of 16 (a tile's 32 rows of K span two), K past 4096 and inside a tile
    (512, 256, 160, 4, 128),  # a prompt's rows over a short K (LoRA's B): the rows split over tasks
])
def test_bf16_path_long_k_and_many_rows(tmp_path, monkeypatch, rows, k, n, bits, block):
    rng = np.random.default_rng(rows + k + n)
    b = random_b(rng, k, n, bits, block, zero_points=True)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    path = write_graph(tmp_path / "g.onnx", b, bias=bias)
    monkeypatch.setenv("BUILDER_PLUGIN_OPS_PATH", "bf16")
    check_bf16_path(run(path, a, library=True), b, a, bias, run(path, a, library=False))


def test_rows_choose_the_path(tmp_path, capfd, monkeypatch):
    """By default a call with fewer than BF16_FROM_ROWS rows takes the int8 AVX-512 path and one with more the bf16
    path (where the CPU has it), chosen per call."""
    rng = np.random.default_rng(5)
    b = random_b(rng, 500, 40, 4, 32, zero_points=True)
    path = write_graph(tmp_path / "g.onnx", b)
    monkeypatch.delenv("BUILDER_PLUGIN_OPS_PATH", raising=False)
    monkeypatch.setenv(TRACE, "1")
    assert traced_path(capfd, path) == DEFAULT_PATHS
    monkeypatch.delenv(TRACE)
    for rows in (BF16_FROM_ROWS - 1, BF16_FROM_ROWS):
        a = rng.standard_normal((rows, 500)).astype(np.float32)
        y = run(path, a, library=True).astype(np.float64)
        int8 = int8_reference(b, a)
        if not ACTIVE:
            continue
        close_to_int8 = bool(np.abs(y - int8).max() <= 1e-5 * (np.abs(int8).max() + 1))
        assert close_to_int8 is (rows < BF16_FROM_ROWS or not BF16)
        if BF16 and rows >= BF16_FROM_ROWS:
            expected_y, summation = bf16_reference(b, a)
            assert np.all(np.abs(y - expected_y) <= summation)


def test_a_cpu_without_amx_is_emulated(tmp_path, capfd, monkeypatch):
    """BUILDER_PLUGIN_OPS_PATH=vnni gives any CPU with AVX-512 VNNI the paths of one without AMX (the benchmarks'
    library-vnni), and its many-rows path gives the int8 numbers."""
    rng = np.random.default_rng(6)
    b = random_b(rng, 700, 53, 4, 32, zero_points=False)
    path = write_graph(tmp_path / "g.onnx", b)
    monkeypatch.setenv("BUILDER_PLUGIN_OPS_PATH", "vnni")
    monkeypatch.setenv(TRACE, "1")
    assert traced_path(capfd, path) == (WITHOUT_AMX if ACTIVE else "")
    monkeypatch.delenv(TRACE)
    a = rng.standard_normal((PANELS_FROM_ROWS + 3, 700)).astype(np.float32)
    y = run(path, a, library=True).astype(np.float64)
    if ACTIVE:
        int8 = int8_reference(b, a)
        assert np.abs(y - int8).max() <= 1e-5 * (np.abs(int8).max() + 1)
