"""Both k-quant kernels -- the compiled one (builder_plugin.quant.k_quant_numba) and the numpy one it replaces when
numba is missing (builder_plugin.quant.k_quant) -- against onnxruntime's own `quant_tensor_k_quant_cpu`, byte for byte,
on blocks made to reach every special case of the search: constant blocks (whose candidates divide by zero), zeros of
both signs, magnitudes whose squares or differences overflow float32 and ones that underflow to subnormals, values that
round from exactly .5 (half to even), nan and inf, both bit widths, every block size, the sums in order that a
Fortran-ordered input gets, float16 input, and tiles cut short."""

from __future__ import annotations

import numpy as np
import pytest
from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

import builder_plugin.quant.k_quant as k_quant
from builder_plugin.quant import k_quant_numba
from builder_plugin.quant_choices import BLOCK_SIZES


def _numba_kernel(chunk: np.ndarray, bits: int, sequential: bool = False):
    return k_quant_numba.k_quant_chunk(chunk, bits, k_quant.candidate_factors(bits), sequential)


KERNELS = {"numba": _numba_kernel, "numpy": k_quant.numpy_k_quant_chunk}


def _adversarial_blocks(rng: np.random.Generator, group_size: int, bits: int) -> np.ndarray:
    """Blocks [n, group_size] (float32) of every kind the search treats specially, among ordinary ones."""
    maxq = 2**bits - 1
    g = group_size
    blocks = [
        rng.standard_normal((120, g)) * rng.uniform(1e-3, 1e3, size=(120, 1)),  # ordinary, many scales
        rng.uniform(0, 1, (8, g)), -rng.uniform(0, 1, (8, g)),  # one-signed
        # constant: rmin == rmax, so iscale = 1 and every candidate is nan; the half-integers tie in the zero point
        # and the codes (x / 1 + zero point)
        np.array([0.0, -0.0, 0.25, 0.5, -0.5, 2.5, -2.5, 3.5, maxq + 0.5, -maxq - 0.5, 1e30, -1e-40])[:, None]
        * np.ones((1, g)),
        np.where(rng.uniform(size=(6, g)) < 0.5, -0.0, 0.0),  # zeros of both signs
        np.where(rng.uniform(size=(6, g)) < 0.85, -0.0, rng.standard_normal((6, g))),  # mostly -0.0
        np.where(rng.uniform(size=(6, g)) < 0.5, 1.0, -1.0) * rng.uniform(0.5, 2, (6, 1)),  # two values
        rng.standard_normal((4, g)) * 1e18, rng.standard_normal((4, g)) * 1e19,  # x**2 sums overflow
        rng.standard_normal((4, g)) * 1e30, rng.uniform(-3.4e38, 3.4e38, (4, g)),  # rmax - rmin overflows
        rng.standard_normal((4, g)) * 1e-30, rng.standard_normal((4, g)) * 1e-40,  # subnormal products, values
        rng.standard_normal((4, g)) * 1e-45,
    ]
    # Ties: integers and half-integers spanning exactly maxq, so that iscale is 1 and iscale * (x - rmin) is k + .5
    # (the first candidate and the tenth, whose factor is maxq again); shifted and scaled by powers of two.
    ties = rng.integers(0, 2 * maxq + 1, (24, g)) / 2
    ties[:, 0], ties[:, 1] = 0, maxq
    blocks.append((ties - rng.integers(0, maxq + 1, (24, 1))) * 2.0 ** rng.integers(-6, 6, (24, 1)))
    special = rng.standard_normal((6, g))
    special[0, 3], special[1, 3], special[2, 3] = np.nan, np.inf, -np.inf
    special[3, :] = np.inf
    special[4, 1], special[4, 2] = np.inf, -np.inf
    blocks.append(special)
    with np.errstate(all="ignore"):
        return np.concatenate(blocks).astype(np.float32)


def _reference(blocks: np.ndarray, bits: int, group_size: int):
    with np.errstate(all="ignore"):
        codes, scale, zero_point = quant_tensor_k_quant_cpu(blocks, bits, group_size)
        return codes.astype(np.uint8), scale, zero_point  # the float64 codes as the builder casts them


def _assert_same_bytes(ours, theirs) -> None:
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.dtype == reference.dtype and mine.shape == reference.shape
        assert np.ascontiguousarray(mine).tobytes() == np.ascontiguousarray(reference).tobytes()


@pytest.mark.parametrize("group_size", BLOCK_SIZES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_equals_onnxruntime_routine_on_adversarial_blocks(kernel, bits, group_size) -> None:
    blocks = _adversarial_blocks(np.random.default_rng(group_size * 10 + bits), group_size, bits)
    _assert_same_bytes(KERNELS[kernel](blocks, bits), _reference(blocks, bits, group_size))


@pytest.mark.parametrize("group_size", [16, 32, 256])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_sequential_kernel_equals_onnxruntime_routine_on_fortran_ordered_blocks(kernel, bits, group_size) -> None:
    """A Fortran-ordered input keeps its order through the reference's reshape and astype, and numpy then sums each
    block in order."""
    blocks = _adversarial_blocks(np.random.default_rng(group_size + bits), group_size, bits)
    theirs = _reference(np.asfortranarray(blocks), bits, group_size)
    _assert_same_bytes(KERNELS[kernel](blocks, bits, True), theirs)
    assert KERNELS[kernel](blocks, bits, False)[1].tobytes() != theirs[1].tobytes()  # the two orders do differ here


@pytest.mark.parametrize("blocks", [1, 127, 128, 129, 1000])
def test_numba_kernel_on_short_and_uneven_tiles(blocks) -> None:
    data = (np.random.default_rng(blocks).standard_normal((blocks, 32)) * 0.02).astype(np.float32)
    _assert_same_bytes(_numba_kernel(data, 4), _reference(data, 4, 32))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_float16_blocks(kernel) -> None:
    blocks = _adversarial_blocks(np.random.default_rng(5), 32, 4)
    with np.errstate(all="ignore"):
        blocks = blocks.astype(np.float16)
    _assert_same_bytes(KERNELS[kernel](blocks, 4), _reference(blocks, 4, 32))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_adversarial_blocks_reach_the_special_cases(bits) -> None:
    """The blocks above do make the reference round ties and divide by zero (else the tests would prove less)."""
    maxq = 2**bits - 1
    blocks = _adversarial_blocks(np.random.default_rng(320 + bits), 32, bits)
    with np.errstate(all="ignore"):
        _, scale, zero_point = quant_tensor_k_quant_cpu(blocks, bits, 32)
        rmin, rmax = blocks.min(axis=1, keepdims=True), blocks.max(axis=1, keepdims=True)
        iscale = np.where(rmin != rmax, maxq / (rmax - rmin), np.float32(1))
        first_candidate = iscale * (blocks - rmin)
        final = blocks / scale + zero_point
        constant_zero_point = -blocks[:, :1] / scale
    assert (first_candidate % 1 == 0.5).sum() > 100
    assert (final % 1 == 0.5).sum() > 50
    assert (constant_zero_point[(rmin == rmax)[:, 0]] % 1 == 0.5).sum() > 3  # the zero point's rounding
    assert (rmin == rmax).sum() > 10 and np.isinf(scale).any() and np.isnan(scale).any()


def test_the_builder_runs_the_numba_kernel() -> None:
    blocks = _adversarial_blocks(np.random.default_rng(9), 32, 4)
    assert k_quant.KERNEL == "numba"
    _assert_same_bytes(k_quant.k_quant_chunk(blocks, 4), _numba_kernel(blocks, 4))


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("shape", [(256, 300), (32, 70), (96, 1)])
def test_a_weight_slab_on_the_pool_equals_onnxruntime_routine(shape, kernel, jobs, monkeypatch) -> None:
    """k_quant_weight, what the builder runs on a padded column slab [K, cols] (K = 32 and cols > 1: the reference's
    blocks are strided and its sums run in order), with many chunks per slab, at 1 and 2 threads."""
    monkeypatch.setattr(k_quant, "CHUNK_BLOCKS", 37)
    monkeypatch.setattr(k_quant, "KERNEL", kernel)
    weight = (np.random.default_rng(shape[1]).standard_normal(shape) * 0.05).astype(np.float32)
    weight[:8, ::3] = 0.0
    pool = k_quant.BlockPool(jobs)
    try:
        ours = k_quant.k_quant_weight(weight, 32, 4, shape[0] == 32 and shape[1] > 1, pool)
    finally:
        pool.close()
    _assert_same_bytes(ours, _reference(weight.T, 4, 32))


def test_without_numba_the_numpy_kernel_runs_and_says_so(monkeypatch, capsys) -> None:
    monkeypatch.setattr(k_quant, "k_quant_numba", None)
    monkeypatch.setattr(k_quant, "KERNEL", "numpy")
    monkeypatch.setattr(k_quant, "_noticed", False)
    blocks = _adversarial_blocks(np.random.default_rng(11), 32, 4)
    pool = k_quant.BlockPool(1)
    try:
        ours = k_quant.k_quant_weight(np.ascontiguousarray(blocks.T), 32, 4, False, pool)
        again = k_quant.k_quant_chunk(blocks, 4)
    finally:
        pool.close()
    _assert_same_bytes(ours, _reference(blocks, 4, 32))
    _assert_same_bytes(again, _reference(blocks, 4, 32))
    assert capsys.readouterr().err.count("numba is not installed, so the search runs in numpy") == 1
