"""onnxruntime's k-quant search (neural_compressor `quant_tensor_k_quant_cpu`) compiled with numba, with its bits.

`builder_plugin.quant.k_quant`'s numpy kernel runs the reference's array operations over chunks of thousands of blocks:
some 400 passes over arrays of the chunk's size per chunk, so it waits on memory. Here `TILE` blocks at a time run their
whole 20-candidate search in one small work array of one row per value (value i of every block of the tile in row i),
which stays in the L1/L2 cache; each loop over a row compiles to a few AVX-512 (or AVX2) instructions, and the running
sums are updated as the values are computed instead of after a pass over a temporary. A tile is 128 blocks side by side
in a weight slab's rows, read where they are (no transposed copy of the weight).

Every value is the reference's: the same float32 operations in the same order (numba without fastmath neither
reassociates nor contracts a * b + c into a fused multiply-add), numpy's summation order for each block's sums,
np.round's round-half-to-even (np.rint), nan propagating through np.clip's bounds and np.min / np.max, division by zero
giving inf or nan as in numpy (`error_model="numpy"`: a constant block's candidates come out nan and are never chosen),
and the final codes computed in float64 from the float32 scale as numpy promotes them. Three liberties change no bit,
as they only change the sign of a zero:

- numpy's pairwise sum of a block starts its eight running sums from the block's first eight values; here they start
  from +0.0 and add them. A running sum can differ only when it is zero; adding a nonzero value to it loses the sign,
  and a total of zero is +0.0 in both, since numpy's reduction adds the pairwise sum to its +0.0 start.
- np.clip turns a code of -0.0 into +0.0; here it stays -0.0. A code is only multiplied into sums (as above) and
  into `scale * code + min - x`, which is squared.
- np.min / np.max of a block holding both zeros may return either; here the first one. The minimum enters `x - min` (a
  code of either zero), `scale * code + min - x` (squared) and the zero point `-min / scale`, 0 either way.

The kernel holds no Python objects and releases the GIL (`nogil`), so `k_quant.BlockPool`'s threads run it side by side
on their chunks. It is compiled on first use (a few seconds) and cached on disk (`cache=True`: in `__pycache__` next to
this file, or numba's user cache folder when that is read-only), so later builds start at once.
"""

from __future__ import annotations

import numba
import numpy as np

TILE = 128  # blocks searched together: one row is 8 AVX-512 registers; 64 and 256 measured slower
MAX_GROUP = 256  # the largest block size MatMulNBits takes: the work array has rows for that many values
PAIRWISE_BLOCK = 128  # numpy's pairwise summation keeps eight running sums per this many values, halves above

# Rows of the work array: the tile's values, weights and codes (one row per value of a block), the running sums of four
# sums (8 per 128 values), then one row per per-block quantity.
X = 0
W = X + MAX_GROUP
Q = W + MAX_GROUP
LANES = Q + MAX_GROUP
LANE_ROWS = 8 * (MAX_GROUP // PAIRWISE_BLOCK)
SUMS = LANES + 4 * LANE_ROWS
SUM_X2, SUM_W, SUM_X, SUM_L, SUM_L2, SUM_XL, MAD, RMIN, RMAX, ISCALE, SCALE, BEST_MAD, THIS_SCALE, THIS_MIN = (
    SUMS + k for k in range(14))
ROWS = SUMS + 14

_JIT = dict(nogil=True, cache=True, error_model="numpy", fastmath=False)


def supports(group_size: int) -> bool:
    """Whether this kernel takes blocks of `group_size` values (all of MatMulNBits' block sizes, 16 to 256)."""
    return group_size % 8 == 0 and 8 <= group_size <= MAX_GROUP


def k_quant_columns(weight: np.ndarray, block_size: int, bits: int, factors: np.ndarray, sequential: bool,
                    pool, chunk_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`quant_tensor_k_quant_cpu(weight.T, bits, block_size)` of a slab [k_blocks * block_size, cols]: codes (uint8,
    [cols * k_blocks, block_size]), scale (float64) and zero point (uint8), each [cols * k_blocks, 1], one row per
    block of one column (the reference's order). The kernel reads the blocks from the slab where they are (no
    transposed copy); `pool` (a `k_quant.BlockPool`) runs ranges of about `chunk_blocks` blocks' columns on its
    threads. `factors`: each candidate step's float32 factor; `sequential`: each block's sums run in order, as the
    reference's do when its input is Fortran-ordered."""
    if not supports(block_size):
        raise ValueError(f"the numba k-quant kernel takes blocks of 8 to {MAX_GROUP} values in eights, "
                         f"not {block_size}")
    rows, cols = weight.shape
    k_blocks = rows // block_size
    if k_blocks * block_size != rows:
        raise ValueError(f"{rows} rows are not whole blocks of {block_size}")
    codes = np.empty((cols * k_blocks, block_size), np.uint8)
    scales = np.empty(cols * k_blocks, np.float64)
    zero_points = np.empty(cols * k_blocks, np.uint8)
    step = max(1, chunk_blocks // max(1, k_blocks))

    def one(chunk: int) -> None:
        c0, c1 = chunk * step, min(cols, (chunk + 1) * step)
        if c0 >= c1:
            return
        part = np.ascontiguousarray(weight[:, c0:c1], dtype=np.float32)  # the reference's astype(np.float32)
        b0, b1 = c0 * k_blocks, c1 * k_blocks
        search(part, block_size, 2**bits - 1, factors, sequential, codes[b0:b1], scales[b0:b1], zero_points[b0:b1])

    pool.each(one, -(-cols // step))
    return codes, scales[:, None], zero_points[:, None]


def k_quant_chunk(chunk: np.ndarray, bits: int, factors: np.ndarray,
                  sequential: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`quant_tensor_k_quant_cpu` on `chunk` [blocks, group_size], on this thread: codes (uint8, [blocks,
    group_size]), scale (float64) and zero point (uint8), each [blocks, 1]. Its blocks are the columns of a slab of
    one block per column."""
    blocks, group_size = chunk.shape
    if not supports(group_size):
        raise ValueError(f"the numba k-quant kernel takes blocks of 8 to {MAX_GROUP} values in eights, "
                         f"not {group_size}")
    slab = np.ascontiguousarray(chunk.T, dtype=np.float32)
    codes = np.empty((blocks, group_size), np.uint8)
    scales = np.empty(blocks, np.float64)
    zero_points = np.empty(blocks, np.uint8)
    search(slab, group_size, 2**bits - 1, factors, sequential, codes, scales, zero_points)
    return codes, scales[:, None], zero_points[:, None]


@numba.njit(inline="always", **_JIT)
def _lane(i, sequential):
    """The running sum that value i of a block goes into: numpy's pairwise summation adds value i to sum i % 8 of its
    128 values; the sum in order has one."""
    if sequential:
        return 0
    return (i // PAIRWISE_BLOCK) * 8 + i % 8


@numba.njit(**_JIT)
def _finish(work, lanes, out, group_size, sequential):
    """out[t] = block t's sum from its running sums in rows lanes... of `work`: numpy's reduction starts from 0.0 and
    adds the pairwise sum, ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)) of each 128 values, 256 as two halves."""
    if sequential:
        for t in range(TILE):
            out[t] = work[lanes, t]
        return
    halves = (group_size + PAIRWISE_BLOCK - 1) // PAIRWISE_BLOCK
    for t in range(TILE):
        total = np.float32(0)
        for half in range(halves):
            r = lanes + half * 8
            part = (((work[r, t] + work[r + 1, t]) + (work[r + 2, t] + work[r + 3, t]))
                    + ((work[r + 4, t] + work[r + 5, t]) + (work[r + 6, t] + work[r + 7, t])))
            total = part if half == 0 else total + part
        out[t] = np.float32(0) + total


@numba.njit(inline="always", **_JIT)
def _code(value, iscale, rmin, maxq):
    """np.clip(np.round(iscale * (value - rmin)), 0, maxq) in float32, a nan staying nan."""
    code = np.rint(iscale * (value - rmin))
    code = np.float32(0) if code < np.float32(0) else code
    return maxq if code > maxq else code


@numba.njit(inline="always", **_JIT)
def _to_uint8(value):
    """numpy's cast to uint8 of a value np.clip put in [0, maxq]: a nan casts to 0 (x86's conversion)."""
    return np.uint8(0) if value != value else np.uint8(value)


@numba.njit(**_JIT)
def search(slab, group_size, maxq_int, factors, sequential, codes, scales, zero_points):
    """The k-quant search on the blocks of `slab` (float32 [k_blocks * group_size, cols], C order: block (c, kb) is
    slab[kb * group_size:(kb + 1) * group_size, c]) into `codes` (uint8 [cols * k_blocks, group_size]), `scales`
    (float64 [cols * k_blocks]) and `zero_points` (uint8 [cols * k_blocks]), block (c, kb) in row c * k_blocks + kb.
    `maxq_int`: 2**bits - 1."""
    rows, cols = slab.shape
    k_blocks = rows // group_size
    blocks = cols * k_blocks
    values = slab.reshape(rows * cols)
    maxq = np.float32(maxq_int)
    zero = np.float32(0)
    one = np.float32(1)
    n = np.float32(group_size)
    # One array of constant shape for everything the loops read and write, so that the compiler sees that its rows do
    # not overlap and vectorizes each loop over a row without checks at run time.
    work = np.zeros((ROWS, TILE), np.float32)
    codes_tile = np.empty((MAX_GROUP, TILE), np.uint8)
    scale64 = np.empty(TILE, np.float64)
    zero_point64 = np.empty(TILE, np.float64)
    start = np.empty(TILE, np.int64)  # where block t of the tile starts in `values`
    row = np.empty(TILE, np.int64)  # and its row in the outputs
    # three sums at a time, then the candidate's error (np.int64: not four compile-time constants, which would
    # compile _finish once for each)
    first_lanes, second_lanes = np.int64(LANES), np.int64(LANES + LANE_ROWS)
    third_lanes, mad_lanes = np.int64(LANES + 2 * LANE_ROWS), np.int64(LANES + 3 * LANE_ROWS)
    # Tiles of TILE consecutive blocks in the order (kb, c): the blocks of a tile sit side by side in the slab's rows.
    for first in range(0, blocks, TILE):
        count = min(TILE, blocks - first)
        for t in range(count):
            kb, c = divmod(first + t, cols)
            start[t] = kb * group_size * cols + c
            row[t] = c * k_blocks + kb
        for i in range(group_size):
            for t in range(count):
                work[X + i, t] = values[start[t] + i * cols]
            for t in range(count, TILE):  # a short last tile: zero blocks, whose results are not read
                work[X + i, t] = zero

        # The starting point: the weights and their sums, min-max scale.
        work[LANES:SUMS] = zero
        for t in range(TILE):
            work[RMIN, t] = work[X, t]
            work[RMAX, t] = work[X, t]
        for i in range(group_size):
            lane = _lane(i, sequential)
            for t in range(TILE):
                value = work[X + i, t]
                work[first_lanes + lane, t] += value * value
                low, high = work[RMIN, t], work[RMAX, t]  # np.min / np.max: a nan wins
                work[RMIN, t] = value if value < low or value != value else low
                work[RMAX, t] = value if value > high or value != value else high
        _finish(work, first_lanes, work[SUM_X2], group_size, sequential)
        for t in range(TILE):
            work[SUM_X2, t] = np.sqrt(work[SUM_X2, t] / n)  # av_x, in place of sum_x2
        for i in range(group_size):
            lane = _lane(i, sequential)
            for t in range(TILE):
                value = work[X + i, t]
                weight = work[SUM_X2, t] + abs(value)
                work[W + i, t] = weight
                work[second_lanes + lane, t] += weight
                work[third_lanes + lane, t] += weight * value
        _finish(work, second_lanes, work[SUM_W], group_size, sequential)
        _finish(work, third_lanes, work[SUM_X], group_size, sequential)
        for t in range(TILE):
            rmin, rmax = work[RMIN, t], work[RMAX, t]
            iscale = maxq / (rmax - rmin) if rmin != rmax else one
            work[ISCALE, t] = iscale
            work[SCALE, t] = one / iscale
        for i in range(group_size):
            lane = _lane(i, sequential)
            for t in range(TILE):
                value = work[X + i, t]
                code = _code(value, work[ISCALE, t], work[RMIN, t], maxq)
                diff = work[SCALE, t] * code + work[RMIN, t] - value
                work[mad_lanes + lane, t] += work[W + i, t] * (diff * diff)
        _finish(work, mad_lanes, work[BEST_MAD], group_size, sequential)

        # The candidates, in order: each starts from the best minimum found before it.
        for step in range(factors.shape[0]):
            factor = factors[step]
            for t in range(TILE):
                rmin, rmax = work[RMIN, t], work[RMAX, t]
                work[ISCALE, t] = factor / (rmax - rmin) if rmin != rmax else one
            work[LANES:SUMS] = zero
            for i in range(group_size):
                lane = _lane(i, sequential)
                for t in range(TILE):
                    value = work[X + i, t]
                    code = _code(value, work[ISCALE, t], work[RMIN, t], maxq)
                    work[Q + i, t] = code
                    weighted = work[W + i, t] * code
                    work[first_lanes + lane, t] += weighted
                    work[second_lanes + lane, t] += weighted * code
                    work[third_lanes + lane, t] += weighted * value
            _finish(work, first_lanes, work[SUM_L], group_size, sequential)
            _finish(work, second_lanes, work[SUM_L2], group_size, sequential)
            _finish(work, third_lanes, work[SUM_XL], group_size, sequential)
            for t in range(TILE):
                sum_w, sum_x = work[SUM_W, t], work[SUM_X, t]
                sum_l, sum_l2, sum_xl = work[SUM_L, t], work[SUM_L2, t], work[SUM_XL, t]
                d = sum_w * sum_l2 - sum_l * sum_l
                work[THIS_SCALE, t] = (sum_w * sum_xl - sum_x * sum_l) / d
                work[THIS_MIN, t] = (sum_l2 * sum_x - sum_l * sum_xl) / d
            for i in range(group_size):
                lane = _lane(i, sequential)
                for t in range(TILE):
                    diff = work[THIS_SCALE, t] * work[Q + i, t] + work[THIS_MIN, t] - work[X + i, t]
                    work[mad_lanes + lane, t] += work[W + i, t] * (diff * diff)
            _finish(work, mad_lanes, work[MAD], group_size, sequential)
            for t in range(TILE):
                better = work[MAD, t] < work[BEST_MAD, t]
                work[BEST_MAD, t] = work[MAD, t] if better else work[BEST_MAD, t]
                work[SCALE, t] = work[THIS_SCALE, t] if better else work[SCALE, t]
                work[RMIN, t] = work[THIS_MIN, t] if better else work[RMIN, t]

        # Zero point in float32, codes in float64 (the scale widened, the zero point as its uint8).
        for t in range(TILE):
            zero_point = np.rint(-work[RMIN, t] / work[SCALE, t])
            zero_point = zero if zero_point < zero else zero_point
            zero_point = maxq if zero_point > maxq else zero_point
            zero_point64[t] = np.float64(_to_uint8(zero_point))
            scale64[t] = np.float64(work[SCALE, t])
        top = np.float64(maxq_int)
        for i in range(group_size):
            for t in range(TILE):
                code = np.rint(np.float64(work[X + i, t]) / scale64[t] + zero_point64[t])
                code = 0.0 if code < 0.0 else code
                code = top if code > top else code
                codes_tile[i, t] = _to_uint8(code)
        for t in range(count):
            scales[row[t]] = scale64[t]
            zero_points[row[t]] = np.uint8(zero_point64[t])
            for i in range(group_size):
                codes[row[t], i] = codes_tile[i, t]
