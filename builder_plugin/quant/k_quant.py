"""onnxruntime's k-quant search (neural_compressor `quant_tensor_k_quant_cpu`), many blocks at a time on many cores.

The reference runs its 20-candidate search on the whole weight at once, one block per row: every step allocates and
walks a dozen float32 temporaries of the weight's size, and its per-block sums (`np.sum(axis=1)` over 32 values) are
numpy's slowest operation here. This module runs the same operations in the same order on the same float32 values,
on chunks of `CHUNK_BLOCKS` blocks held transposed ([group_size, blocks]: one value of every block per row) in
preallocated work arrays. Every operation then runs over contiguous values, and a block's sum is numpy's pairwise
summation written out as row additions (`pairwise_sum`), so every block gets the very bits the reference gives it.
The candidate steps stay in order, since each step starts from the best minimum found before it. The reference also
copies the best candidate's codes at each step, which it never reads again; that copy is skipped.

Chunks are independent, so `BlockPool` spreads them over threads: numpy releases the GIL inside each operation, and
threads share the weight instead of copying it to other processes.

`k_quant_chunk` runs the same search compiled with numba (`builder_plugin.quant.k_quant_numba`, several times faster,
the same bits) when numba can be imported, and this numpy kernel otherwise (`KERNEL` says which).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:
    from builder_plugin.quant import k_quant_numba
except ImportError:  # numba missing, or not built for this numpy
    k_quant_numba = None

# Blocks per chunk: large enough that the ~50 numpy calls of a candidate step cost little against their work, small
# enough that a thread's work arrays stay in the caches (six of 32 x 8192 float32 are 6 MB). 4096 to 32768 measured
# within ~30 % of each other on one 3072 x 512 slab; 8192-16384 were the fastest.
CHUNK_BLOCKS = 8192
STEPS = 20
RDELTA = 0.1
RRMIN = -1
KERNEL = "numpy" if k_quant_numba is None else "numba"  # what k_quant_chunk runs (a benchmark sets "numpy" to compare)
# quantize.COST_PER_VALUE of k-quant with this kernel (measured on a full-width layer: numba 4-6x less CPU than numpy)
K_QUANT_COST_PER_VALUE = 60.0 if KERNEL == "numpy" else 12.0
_NOTICE = threading.Lock()
_noticed = False


class _Scratch(threading.local):
    """Each thread's work arrays, reused from chunk to chunk (reallocated only for another shape)."""

    def get(self, group_size: int, blocks: int) -> dict[str, np.ndarray]:
        arrays = getattr(self, "arrays", None)
        if arrays is None or arrays["tmp"].shape != (group_size, blocks):
            arrays = {name: np.empty((group_size, blocks), np.float32) for name in ("data", "weights", "tmp", "q",
                                                                                   "mwq", "prod")}
            arrays["lanes"] = np.empty((8, blocks), np.float32)
            self.arrays = arrays
        return arrays


_SCRATCH = _Scratch()


def pairwise_sum(values: np.ndarray, lanes: np.ndarray) -> np.ndarray:
    """The sum over axis 0 of `values` [n, blocks] that `np.sum(axis=1)` gives each block's n contiguous values:
    numpy's pairwise summation (eight running sums for n <= 128, halves above), computed for every block at once."""
    n = values.shape[0]
    if n < 8:
        total = values[0].copy()
        for i in range(1, n):
            total += values[i]
    elif n <= 128:
        np.add(values[0:8], values[8:16], out=lanes) if n >= 16 else np.copyto(lanes, values[0:8])
        whole = n - n % 8
        for i in range(16, whole, 8):
            lanes += values[i:i + 8]
        pairs = lanes[0::2] + lanes[1::2]
        quads = pairs[0::2] + pairs[1::2]
        total = quads[0] + quads[1]
        for i in range(whole, n):
            total += values[i]
    else:
        half = n // 2 - (n // 2) % 8
        total = pairwise_sum(values[:half], lanes) + pairwise_sum(values[half:], lanes)
    return total


def _sum(values: np.ndarray, lanes: np.ndarray, sequential: bool) -> np.ndarray:
    """np.add.reduce's result, which starts from the identity 0.0 (turning a sum of -0.0 into 0.0): the pairwise sum
    of a block's values, or their sum in order when the blocks are the columns of a Fortran-ordered array (numpy
    then adds one value of every block at a time)."""
    if not sequential:
        total = pairwise_sum(values, lanes)
        total += np.float32(0)
        return total
    total = values[0] + np.float32(0)
    for i in range(1, values.shape[0]):
        total += values[i]
    return total


def candidate_factors(bits: int) -> np.ndarray:
    """Each candidate step's factor as the reference computes it: in Python floats, then cast to float32."""
    maxq, minq = 2**bits - 1, 0
    return np.array([RRMIN + RDELTA * step + maxq - minq for step in range(STEPS)]).astype(np.float32)


def k_quant_chunk(chunk: np.ndarray, bits: int, sequential: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`quant_tensor_k_quant_cpu` on `chunk` [blocks, group_size]: codes (uint8, [blocks, group_size]), scale (float64)
    and zero point (uint8), each [blocks, 1]. `sequential`: the reference's sums run in order, as they do when its
    input is Fortran-ordered (a weight of one block per column, whose transpose numpy reshapes without a copy).
    The numba kernel when numba is there, else `numpy_k_quant_chunk`."""
    if KERNEL == "numba" and k_quant_numba.supports(chunk.shape[1]):
        return k_quant_numba.k_quant_chunk(chunk, bits, candidate_factors(bits), sequential)
    if k_quant_numba is None:
        _notice_numpy_kernel()
    return numpy_k_quant_chunk(chunk, bits, sequential)


def _notice_numpy_kernel() -> None:
    global _noticed
    with _NOTICE:
        if not _noticed:
            print("k-quant: numba is not installed, so the search runs in numpy, several times slower "
                  "(pip install numba)", file=sys.stderr, flush=True)
        _noticed = True


def k_quant_weight(weight: np.ndarray, block_size: int, bits: int, sequential: bool,
                   pool: BlockPool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`quant_tensor_k_quant_cpu(weight.T, bits, block_size)` of a padded slab [k_blocks * block_size, cols] on the
    pool's threads: codes [cols * k_blocks, block_size], scales and zero points [cols * k_blocks, 1], one row per
    block of one column. The numba kernel reads the blocks in place; the numpy one gets them transposed."""
    if KERNEL == "numba" and k_quant_numba.supports(block_size):
        return k_quant_numba.k_quant_columns(weight, block_size, bits, candidate_factors(bits), sequential, pool,
                                             CHUNK_BLOCKS)
    blocks = weight.T.reshape(-1, block_size)  # one row per block of one column, as the reference reshapes
    return pool.run(lambda chunk: k_quant_chunk(chunk, bits, sequential), blocks, np.uint8, np.float64)


def numpy_k_quant_chunk(chunk: np.ndarray, bits: int,
                        sequential: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`k_quant_chunk` in numpy. The work arrays hold one value of every block per row ([group_size, blocks]), so that
    each operation runs over contiguous values and a block's sums are row operations."""
    with np.errstate(all="ignore"):  # a constant block divides by zero, as in the reference, and is then not chosen
        return _k_quant_chunk(chunk, bits, sequential)


def _k_quant_chunk(chunk: np.ndarray, bits: int, sequential: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks, group_size = chunk.shape
    s = _SCRATCH.get(group_size, blocks)
    data, weights, tmp, q, mwq, prod, lanes = (s[k] for k in ("data", "weights", "tmp", "q", "mwq", "prod", "lanes"))
    np.copyto(data, chunk.T, casting="unsafe")  # the reference's astype(np.float32)
    maxq, minq = 2**bits - 1, 0

    np.multiply(data, data, out=tmp)
    sum_x2 = _sum(tmp, lanes, sequential)
    av_x = np.sqrt(sum_x2 / group_size)
    np.abs(data, out=weights)
    np.add(av_x, weights, out=weights)
    rmin = np.min(data, axis=0)
    rmax = np.max(data, axis=0)
    sum_w = _sum(weights, lanes, sequential)
    np.multiply(weights, data, out=tmp)
    sum_x = _sum(tmp, lanes, sequential)
    mask = rmin != rmax
    iscale = np.where(mask, (maxq - minq) / (rmax - rmin), np.float32(1))
    scale = 1 / iscale
    _codes(data, rmin, iscale, minq, maxq, q)
    np.multiply(scale, q, out=tmp)
    np.add(tmp, rmin, out=tmp)
    np.subtract(tmp, data, out=tmp)
    best_mad = _weighted_square_sum(weights, tmp, prod, lanes, sequential)

    for step in range(STEPS):
        factor = np.array([RRMIN + RDELTA * step + maxq - minq]).astype(np.float32)[0]
        mask = rmin != rmax
        iscale_new = np.where(mask, factor / (rmax - rmin), np.float32(1))
        _codes(data, rmin, iscale_new, minq, maxq, q)
        np.multiply(weights, q, out=mwq)
        sum_l = _sum(mwq, lanes, sequential)
        np.multiply(mwq, q, out=prod)
        sum_l2 = _sum(prod, lanes, sequential)
        np.multiply(mwq, data, out=prod)
        sum_xl = _sum(prod, lanes, sequential)
        d = np.subtract(sum_w * sum_l2, sum_l**2)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / d
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d
        np.multiply(this_scale, q, out=tmp)
        np.add(tmp, this_min, out=tmp)
        np.subtract(tmp, data, out=tmp)
        mad = _weighted_square_sum(weights, tmp, prod, lanes, sequential)
        better = mad < best_mad
        np.copyto(best_mad, mad, where=better)
        np.copyto(scale, this_scale, where=better)
        np.copyto(rmin, this_min, where=better)

    zero_point = np.clip(((-rmin) / scale).round(), 0, maxq).astype("uint8")
    scale = scale.astype(np.float64)
    q_weight = np.empty(data.shape, np.float64)
    np.divide(data, scale, out=q_weight)
    np.add(q_weight, zero_point, out=q_weight)
    np.round(q_weight, out=q_weight)
    np.clip(q_weight, minq, maxq, out=q_weight)
    return q_weight.T.astype(np.uint8), scale[:, None], zero_point[:, None]


def _codes(data: np.ndarray, rmin: np.ndarray, iscale: np.ndarray, minq: int, maxq: int, out: np.ndarray) -> None:
    """np.clip(np.round(iscale * (data - rmin)), minq, maxq) into `out`."""
    np.subtract(data, rmin, out=out)
    np.multiply(iscale, out, out=out)
    np.round(out, out=out)
    np.clip(out, minq, maxq, out=out)


def _weighted_square_sum(weights: np.ndarray, diff: np.ndarray, out: np.ndarray, lanes: np.ndarray,
                         sequential: bool) -> np.ndarray:
    """np.sum(weights * diff**2, axis=1, keepdims=True), per block."""
    np.multiply(diff, diff, out=out)
    np.multiply(weights, out, out=out)
    return _sum(out, lanes, sequential)


ChunkFunction = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


class BlockPool:
    """Runs a per-block quantizer over the rows of a [blocks, group_size] array, `CHUNK_BLOCKS` rows at a time, on
    `jobs` threads; the results are concatenated in row order, so they do not depend on `jobs`."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self._executor = ThreadPoolExecutor(jobs, thread_name_prefix="quantize") if jobs > 1 else None

    def run(self, function: ChunkFunction, data: np.ndarray, codes_dtype: np.dtype,
            scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = data.shape[0]
        codes = np.empty(data.shape, codes_dtype)
        scales = np.empty((rows, 1), scale_dtype)
        zero_points = np.empty((rows, 1), np.uint8)

        def one(chunk: int) -> None:
            start = chunk * CHUNK_BLOCKS
            stop = min(rows, start + CHUNK_BLOCKS)
            q, scale, zp = function(data[start:stop])
            codes[start:stop] = q
            scales[start:stop] = scale
            zero_points[start:stop] = zp

        self.each(one, -(-rows // CHUNK_BLOCKS))
        return codes, scales, zero_points

    def each(self, function: Callable[[int], None], count: int) -> None:
        """function(0), ..., function(count - 1) on the threads, each index once."""
        if self._executor is None or count == 1:
            for i in range(count):
                function(i)
        else:
            for future in [self._executor.submit(function, i) for i in range(count)]:
                future.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
