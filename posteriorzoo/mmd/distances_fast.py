"""Pairwise L1 and squared-L2 distances near the arithmetic limit: float32 GEMM and SIMD.

The exact kernels of :mod:`posteriorzoo.mmd.distances` add one feature at a time in
float64 (bit-for-bit reproducible, about 20 times a float32 GEMM of the same shape). This
module computes the same matrices from float32 arithmetic in chunks of features, with
float64 accumulation across chunks, within a bound of exact stated below.

Per block of features, each sample's block is **centred** on a reference (the mean of the
first sample's rows over the block; Y's own mean for Y's self-distances) and rounded to
float32, feature-major. Centring leaves every distance unchanged and makes the rounding
relative to the spread of the rows instead of their distance from 0.

* **L2** through GEMM: ``|c_i - c_j|^2 = N_i + N_j - 2 G_ij``, with ``G`` the Gram matrix
  of the centred rows, summed in float32 by ``numpy.matmul`` over chunks of at most
  :data:`GRAM_CHUNK` features and added into float64, and ``N`` the squared norms summed
  in float64. Self blocks compute the upper triangle only, a block row at a time. The
  result is clamped at 0 (the true value is >= 0).
* **L1** through a SIMD numba kernel: ``sum_k |c_ik - c_jk|`` in float32 over chunks of
  at most :data:`L1_CHUNK` features (vectorised across pairs j, four features per pass
  over the accumulators), each chunk's sums added into float64: three operations per
  pair-weight (subtract, absolute value, add).

Error bound, per pair (c the exactly centred rows, u = 2^-24, gamma(k) = k u / (1 - k u);
the rounding to float32 moves every centred value by at most u |c|, to first order):

    |l1 - l1_exact|   <= u (|c_i|_1 + |c_j|_1) (1 + gamma(L1_CHUNK + 1))
                         + gamma(L1_CHUNK + 1) l1_exact + gamma64(chunks + 1) l1_exact
    |l2sq - l2sq_exact| <= 2 u sum_k |c_ik - c_jk| (|c_ik| + |c_jk|) + (2u + u^2)... (input)
                         + 2 gamma(GRAM_CHUNK) sum_k |c_ik c_jk|
                         + gamma64(d + 2) (N_i + N_j + 2 sum_k |c_ik c_jk|)

The L2 bound is relative to the centred norms, not to the distance (Gram cancellation):
two rows much closer to each other than to the reference get a relatively larger error;
centring on the sample's own mean keeps that small for draws of one posterior. The tests
(``tests/test_mmd_distances_fast.py``) check both bounds against the exact kernels and
that a missing centring or a dropped feature would exceed them. Unlike the exact path the
result depends (within the bound) on the blocking and on the BLAS library.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numba
import numpy as np
from numba import prange, uint64

from posteriorzoo._numba import announce_compilation
from posteriorzoo.errors import ShapeMismatchError

announce_compilation()

#: Features summed in float32 by one GEMM call before the float64 accumulation.
GRAM_CHUNK = 1024
#: Features summed in float32 by the L1 kernel before the float64 accumulation.
L1_CHUNK = 256
#: Rows of one block row of a self Gram (upper triangle, one GEMM per block row).
GRAM_TILE = 256


# ---------------------------------------------------------------------------- numba kernels
@numba.njit(parallel=True, cache=True, nogil=True)
def centred_transpose(block, reference, out):  # pragma: no cover - compiled
    """out[c, r] = float32(block[r, c] - reference[c]): centred, feature-major, float32."""
    rows, features = block.shape
    for c in prange(features):
        ref = reference[c]
        for r in range(rows):
            out[c, r] = np.float32(block[r, c] - ref)


@numba.njit(cache=True, nogil=True)
def add_squared_norms(t, out):  # pragma: no cover - compiled
    """out[r] += sum_c float64(t[c, r])^2 (each square exact in float64)."""
    features, rows = t.shape
    for c in range(features):
        for r in range(uint64(rows)):
            value = np.float64(t[c, r])
            out[r] += value * value


@numba.njit(inline="always")
def _l1_row(t, start, width, i, acc, lo, count):  # pragma: no cover - compiled
    """acc[k] (float32) += sum over features [start, start + width) of |t[c, i] - t[c, lo + k]|.

    Four features per pass over the accumulators; unsigned loop indices let the compiler
    vectorise across k."""
    full = width - width % 4
    for c in range(start, start + full, 4):
        c0 = t[c][lo:]
        c1 = t[c + 1][lo:]
        c2 = t[c + 2][lo:]
        c3 = t[c + 3][lo:]
        x0 = t[c, i]
        x1 = t[c + 1, i]
        x2 = t[c + 2, i]
        x3 = t[c + 3, i]
        for k in range(uint64(count)):
            s = acc[k]
            s += abs(x0 - c0[k])
            s += abs(x1 - c1[k])
            s += abs(x2 - c2[k])
            s += abs(x3 - c3[k])
            acc[k] = s
    for c in range(start + full, start + width):
        column = t[c][lo:]
        x = t[c, i]
        for k in range(uint64(count)):
            acc[k] += abs(x - column[k])


@numba.njit(inline="always")
def _l1_cross_row(a, b, start, width, i, acc, count):  # pragma: no cover - compiled
    """acc[k] (float32) += sum over the features of |a[c, i] - b[c, k]|."""
    full = width - width % 4
    for c in range(start, start + full, 4):
        c0 = b[c]
        c1 = b[c + 1]
        c2 = b[c + 2]
        c3 = b[c + 3]
        x0 = a[c, i]
        x1 = a[c + 1, i]
        x2 = a[c + 2, i]
        x3 = a[c + 3, i]
        for k in range(uint64(count)):
            s = acc[k]
            s += abs(x0 - c0[k])
            s += abs(x1 - c1[k])
            s += abs(x2 - c2[k])
            s += abs(x3 - c3[k])
            acc[k] = s
    for c in range(start + full, start + width):
        column = b[c]
        x = a[c, i]
        for k in range(uint64(count)):
            acc[k] += abs(x - column[k])


@numba.njit(inline="always")
def _flush(acc, out, count):  # pragma: no cover - compiled
    """out[k] += float64(acc[k]); acc[k] = 0."""
    for k in range(uint64(count)):
        out[k] += np.float64(acc[k])
        acc[k] = np.float32(0.0)


@numba.njit(parallel=True, cache=True, nogil=True)
def l1_self(t, out, chunk, tasks):  # pragma: no cover - compiled
    """Add the L1 distances of the columns of ``t`` (features, rows), pairs i < j packed
    (see ``distances.packed_offset``), to ``out``: float32 within ``chunk`` features.

    Rows i and rows - 1 - i go to the same task (equal work per task); every task walks
    the chunks in order, so a chunk of ``t`` stays in its core's cache for all its rows.
    """
    features, rows = t.shape
    half = (rows + 1) // 2
    for task in prange(tasks):
        acc = np.zeros(rows, dtype=np.float32)
        for start in range(0, features, chunk):
            width = min(chunk, features - start)
            for p in range(task, half, tasks):
                for side in range(2):
                    i = p if side == 0 else rows - 1 - p
                    if side == 1 and i == p:
                        continue
                    count = rows - i - 1
                    first = i * (2 * rows - i - 1) // 2
                    _l1_row(t, start, width, i, acc, i + 1, count)
                    _flush(acc, out[first:first + count], count)


@numba.njit(parallel=True, cache=True, nogil=True)
def l1_cross(a, b, out, chunk, tasks):  # pragma: no cover - compiled
    """Add ``sum_k |a[k, i] - b[k, j]|`` to ``out[i, j]`` (a: (features, m), b: (features,
    n)), float32 within ``chunk`` features."""
    features, m = a.shape
    n = b.shape[1]
    for task in prange(tasks):
        acc = np.zeros(n, dtype=np.float32)
        for start in range(0, features, chunk):
            width = min(chunk, features - start)
            for i in range(task, m, tasks):
                _l1_cross_row(a, b, start, width, i, acc, n)
                _flush(acc, out[i], n)


# ---------------------------------------------------------------------------- GEMM helpers
def gram_upper(t: np.ndarray, out: np.ndarray, chunk: int = GRAM_CHUNK,
               tile: int = GRAM_TILE) -> None:
    """Add the upper block triangle of ``t.T @ t`` (float32 per chunk) to ``out`` (float64).

    Block row ``[i0, i0 + tile)`` gets columns ``[i0, rows)``: entries i <= j are all
    there; some below the diagonal too (not read)."""
    features, rows = t.shape
    for start in range(0, features, chunk):
        part = t[start:start + chunk]
        for i0 in range(0, rows, tile):
            out[i0:i0 + tile, i0:] += part[:, i0:i0 + tile].T @ part[:, i0:]


def gram_cross(a: np.ndarray, b: np.ndarray, out: np.ndarray, chunk: int = GRAM_CHUNK
               ) -> None:
    """Add ``a.T @ b`` (float32 per chunk of features) to ``out`` (float64)."""
    for start in range(0, a.shape[0], chunk):
        out += a[start:start + chunk].T @ b[start:start + chunk]


def squared_from_gram(norms_a: np.ndarray, norms_b: np.ndarray, gram: np.ndarray
                      ) -> np.ndarray:
    """``max(N_i + N_j - 2 G_ij, 0)`` (float64)."""
    out = norms_a[:, None] + norms_b[None, :]
    out -= 2 * gram
    np.maximum(out, 0.0, out=out)
    return out


def centred(block: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """``block - reference``, feature-major float32 (features, rows)."""
    out = np.empty((block.shape[1], block.shape[0]), dtype=np.float32)
    if block.size:
        centred_transpose(block, reference, out)
    return out


def tasks_for(rows: int) -> int:
    """Parallel tasks of the L1 kernels: one per thread, at most one per row."""
    return max(1, min(numba.get_num_threads(), rows))


# ---------------------------------------------------------------------------- accumulator
class FastDistances:
    """The fast engine behind ``SharedTargetDistances(precision="fast")``.

    Parameters
    ----------
    m : int
        Rows of X.
    ns : sequence of int
        Rows of each Y_k.
    within : bool
        Also the self-distances X-X and Y_k-Y_k (False: only the X-Y_k blocks).

    :meth:`update` takes checked C-contiguous float blocks of the same features;
    :meth:`blocks` returns ``(xx, xy, yy)`` of sample k in the layout of
    :class:`~posteriorzoo.mmd.distances.Distances`.
    """

    def __init__(self, m: int, ns: Sequence[int], within: bool = True) -> None:
        self.m, self.ns, self.within = int(m), [int(n) for n in ns], within
        self.norms_x = np.zeros(m)
        self.gram_xx = np.zeros((m, m)) if within else None
        self.l1_xx = np.zeros(m * (m - 1) // 2) if within else None
        self.norms_yx = [np.zeros(n) for n in self.ns]          # Y centred on X's mean
        self.gram_xy = [np.zeros((m, n)) for n in self.ns]
        self.l1_xy = [np.zeros((m, n)) for n in self.ns]
        if within:
            self.norms_yy = [np.zeros(n) for n in self.ns]      # Y centred on its own
            self.gram_yy = [np.zeros((n, n)) for n in self.ns]
            self.l1_yy = [np.zeros(n * (n - 1) // 2) for n in self.ns]

    def update(self, x_block: np.ndarray, y_blocks: Sequence[np.ndarray]) -> None:
        """Accumulate one block of features (shapes and dtypes already checked)."""
        reference = x_block.mean(axis=0, dtype=np.float64)
        xt = centred(x_block, reference)
        add_squared_norms(xt, self.norms_x)
        if self.within:
            gram_upper(xt, self.gram_xx)
            l1_self(xt, self.l1_xx, L1_CHUNK, tasks_for(self.m))
        for k, y_block in enumerate(y_blocks):
            yt = centred(y_block, reference)
            add_squared_norms(yt, self.norms_yx[k])
            gram_cross(xt, yt, self.gram_xy[k])
            l1_cross(xt, yt, self.l1_xy[k], L1_CHUNK, tasks_for(self.m))
            if self.within:
                own = centred(y_block, y_block.mean(axis=0, dtype=np.float64))
                add_squared_norms(own, self.norms_yy[k])
                gram_upper(own, self.gram_yy[k])
                l1_self(own, self.l1_yy[k], L1_CHUNK, tasks_for(self.ns[k]))

    def xx(self) -> tuple[np.ndarray, np.ndarray]:
        """X's self-distances, packed pairs i < j: (L1, squared L2)."""
        return self.l1_xx, _packed(squared_from_gram(self.norms_x, self.norms_x,
                                                     self.gram_xx))

    def xy(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The (m, n_k) X-Y_k block: (L1, squared L2)."""
        return self.l1_xy[k], squared_from_gram(self.norms_x, self.norms_yx[k],
                                                self.gram_xy[k])

    def yy(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Y_k's self-distances, packed pairs i < j."""
        return self.l1_yy[k], _packed(squared_from_gram(self.norms_yy[k], self.norms_yy[k],
                                                        self.gram_yy[k]))


def _packed(matrix: np.ndarray) -> np.ndarray:
    """The entries i < j of a square matrix, row by row."""
    return matrix[np.triu_indices(matrix.shape[0], 1)]


def cross_tile(a_blocks: Iterable[np.ndarray], b_blocks: Iterable[np.ndarray] | None, *,
               precision: str, device: str, check_finite: bool
               ) -> tuple[np.ndarray, np.ndarray]:
    """The body of :func:`posteriorzoo.mmd.distances.cross_distances` (blocks given)."""
    from posteriorzoo.mmd.distances import SharedTargetDistances, unpack

    pairs = (((block, ()) for block in a_blocks) if b_blocks is None
             else ((x, (y,)) for x, y in zip(a_blocks, b_blocks, strict=True)))
    engine = None
    for x_block, y_blocks in pairs:
        if engine is None:
            engine = SharedTargetDistances(
                np.shape(x_block)[0], [np.shape(y)[0] for y in y_blocks],
                precision=precision, device=device, within=b_blocks is None)
        engine.update(x_block, list(y_blocks), check_finite=check_finite)
    if engine is None or engine.features == 0:
        raise ShapeMismatchError("the row sets have no features (an empty layer)")
    if b_blocks is None:
        l1, l2sq = engine.self_packed()
        return unpack(l1, engine.m), unpack(l2sq, engine.m)
    return engine.cross(0)
