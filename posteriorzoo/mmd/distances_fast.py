"""Pairwise L1 and squared-L2 distances near the arithmetic limit: float32 GEMM and SIMD.

The exact kernels of :mod:`posteriorzoo.mmd.distances` add one feature at a time in
float64 (bit-for-bit reproducible). This module computes the same matrices from float32
arithmetic in chunks of features, with float64 accumulation across chunks, within a bound
of exact stated below. Measured (``benchmarks/bench_mmd.py --only-kernels --threads 1``:
1,000 + 100 rows of 262,144 float32 features, this 2-core AVX-512 machine): the exact
path takes 5.4 times as long as a bare float32 GEMM ``Z @ Z.T`` of the pooled rows, this
path 2.8 times (L2 about 1, L1 about 1.4, centring and the Y blocks the rest).

Per block of features, each sample's block is **centred** on a reference (the mean of the
first sample's rows over the block; Y's own mean for Y's self-distances) and rounded to
float32, feature-major. Centring leaves every distance unchanged and makes the rounding
relative to the spread of the rows instead of their distance from 0.

* **L2** through GEMM: ``|c_i - c_j|^2 = N_i + N_j - 2 G_ij``, with ``G`` the Gram matrix
  of the centred rows, summed in float32 by ``numpy.matmul`` over chunks of at most
  :data:`GRAM_CHUNK` features and added into float64, and ``N`` the squared norms summed
  in float64. Self blocks take the whole square (with OpenBLAS a triangle, by SYRK or by
  block rows, took as long). The result is clamped at 0 (the true value is >= 0).
* **L1** through a SIMD numba kernel: ``sum_k |c_ik - c_jk|`` in float32 over chunks of
  at most :data:`L1_CHUNK` features (vectorised across pairs j, two rows i and four
  features per pass over the accumulators), each chunk's sums added into float64: three
  operations per pair-weight (subtract, absolute value, add).

Error bound, per pair, with c the exactly centred rows (either reference), ``u32`` and
``u64`` the unit roundoffs, ``g32(k) = k u32 / (1 - k u32)`` (Higham's gamma; it allows
any order of summation, with or without FMA), ``v = (1 + u32)(1 + u64) - 1`` the rounding
of a centred value to float32 (``|c~ - c| <= v |c|``), ``S = |c_i|_1 + |c_j|_1``,
``P = sum_k |c_ik| |c_jk|``, ``N = |c|_2^2`` and ``q`` the number of chunks summed::

    |l1 - l1_exact| <= v S + g32(L1_CHUNK + 1) (l1_exact + v S)
                       + g64(q) (1 + g32(L1_CHUNK + 1)) (l1_exact + v S)

    |l2 - l2_exact| <= 2 v sum_k |c_ik - c_jk| (|c_ik| + |c_jk|) + v^2 sum_k (|c_ik| + |c_jk|)^2
                       + w [2 g32(GRAM_CHUNK) P + g64(d) (N_i + N_j)
                            + 2 g64(q) (1 + g32(GRAM_CHUNK)) P
                            + g64(2) (N_i + N_j + 2 (1 + g32(GRAM_CHUNK)) P)]

with ``w = (1 + v)^2`` (the rounded values' products against the exact ones'). The L1
bound is relative to the distance (its sums have no cancellation); the L2 bound is
relative to the centred norms (Gram cancellation): two rows much closer to each other
than to the reference get a relatively larger error, which is why each sample is centred
on its own mean for its self-distances. ``tests/test_mmd_distances_fast.py`` evaluates
both bounds, checks the fast results against the exact kernels within them, and checks
that a missing centring or a dropped feature would exceed them. Unlike the exact path,
the bits depend (within the bound) on the blocking and on the BLAS library and CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import prange, uint64

from posteriorzoo._numba import announce_compilation

announce_compilation()

#: Features summed in float32 by one GEMM call before the float64 accumulation.
GRAM_CHUNK = 2048
#: Features summed in float32 by the L1 kernel before the float64 accumulation.
L1_CHUNK = 256


# ---------------------------------------------------------------------------- numba kernels
@numba.njit(parallel=True, cache=True, nogil=True)
def centred_transpose(block, reference, out):  # pragma: no cover - compiled
    """out[c, r] = float32(block[r, c] - reference[c]): centred, feature-major, float32.

    In 16 x 16 tiles, so that both the reads and the writes stay in cache lines."""
    rows, features = block.shape
    size = 16
    for tile in prange((features + size - 1) // size):
        c0 = tile * size
        c1 = min(features, c0 + size)
        for r0 in range(0, rows, size):
            r1 = min(rows, r0 + size)
            for c in range(c0, c1):
                ref = reference[c]
                for r in range(r0, r1):
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
def _l1_two_rows(a, i, b, lo, start, width, acc0, acc1, count):  # pragma: no cover
    """acc0[k] += sum_c |a[c, i] - b[c, lo + k]|, acc1[k] += the same for a[c, i + 1]
    (float32), over the features c in [start, start + width).

    Two rows share each load of b; four features per pass over the accumulators; the
    loops over k use unsigned indices, which lets the compiler vectorise them."""
    full = width - width % 4
    for c in range(start, start + full, 4):
        c0 = b[c][lo:]
        c1 = b[c + 1][lo:]
        c2 = b[c + 2][lo:]
        c3 = b[c + 3][lo:]
        x0, y0 = a[c, i], a[c, i + 1]
        x1, y1 = a[c + 1, i], a[c + 1, i + 1]
        x2, y2 = a[c + 2, i], a[c + 2, i + 1]
        x3, y3 = a[c + 3, i], a[c + 3, i + 1]
        for k in range(uint64(count)):
            v0, v1, v2, v3 = c0[k], c1[k], c2[k], c3[k]
            acc0[k] += abs(x0 - v0) + abs(x1 - v1) + abs(x2 - v2) + abs(x3 - v3)
            acc1[k] += abs(y0 - v0) + abs(y1 - v1) + abs(y2 - v2) + abs(y3 - v3)
    for c in range(start + full, start + width):
        column = b[c][lo:]
        x, y = a[c, i], a[c, i + 1]
        for k in range(uint64(count)):
            acc0[k] += abs(x - column[k])
            acc1[k] += abs(y - column[k])


@numba.njit(inline="always")
def _l1_one_row(a, i, b, lo, start, width, acc, count):  # pragma: no cover - compiled
    """acc[k] += sum_c |a[c, i] - b[c, lo + k]| (float32), as :func:`_l1_two_rows`."""
    full = width - width % 4
    for c in range(start, start + full, 4):
        c0 = b[c][lo:]
        c1 = b[c + 1][lo:]
        c2 = b[c + 2][lo:]
        c3 = b[c + 3][lo:]
        x0, x1, x2, x3 = a[c, i], a[c + 1, i], a[c + 2, i], a[c + 3, i]
        for k in range(uint64(count)):
            acc[k] += abs(x0 - c0[k]) + abs(x1 - c1[k]) + abs(x2 - c2[k]) + abs(x3 - c3[k])
    for c in range(start + full, start + width):
        column = b[c][lo:]
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

    Rows go in twos (i, i + 1) against the rows j > i + 1 (then the pair (i, i + 1)
    itself); the units p and units - 1 - p go to the same task (equal work per task);
    every task walks the chunks in order, so a chunk of ``t`` stays in cache for all its
    rows. A last odd row has no pairs."""
    features, rows = t.shape
    units = rows // 2
    half = (units + 1) // 2
    for task in prange(tasks):
        acc0 = np.zeros(rows, dtype=np.float32)
        acc1 = np.zeros(rows, dtype=np.float32)
        for start in range(0, features, chunk):
            width = min(chunk, features - start)
            for q in range(task, half, tasks):
                for side in range(2):
                    p = q if side == 0 else units - 1 - q
                    if side == 1 and p == q:
                        continue
                    i = 2 * p
                    count = rows - i - 2
                    _l1_two_rows(t, i, t, i + 2, start, width, acc0, acc1, count)
                    first = i * (2 * rows - i - 1) // 2
                    second = first + rows - i - 1     # row i + 1's first pair
                    pair = np.float32(0.0)
                    for c in range(start, start + width):
                        pair += abs(t[c, i] - t[c, i + 1])
                    out[first] += np.float64(pair)
                    _flush(acc0, out[first + 1:first + 1 + count], count)
                    _flush(acc1, out[second:second + count], count)


@numba.njit(parallel=True, cache=True, nogil=True)
def l1_cross(a, b, out, chunk, tasks):  # pragma: no cover - compiled
    """Add ``sum_k |a[k, i] - b[k, j]|`` to ``out[i, j]`` (a: (features, m), b: (features,
    n)), float32 within ``chunk`` features, rows of ``a`` in twos."""
    features, m = a.shape
    n = b.shape[1]
    units = (m + 1) // 2
    for task in prange(tasks):
        acc0 = np.zeros(n, dtype=np.float32)
        acc1 = np.zeros(n, dtype=np.float32)
        for start in range(0, features, chunk):
            width = min(chunk, features - start)
            for p in range(task, units, tasks):
                i = 2 * p
                if i + 1 < m:
                    _l1_two_rows(a, i, b, 0, start, width, acc0, acc1, n)
                    _flush(acc1, out[i + 1], n)
                else:
                    _l1_one_row(a, i, b, 0, start, width, acc0, n)
                _flush(acc0, out[i], n)


# ---------------------------------------------------------------------------- GEMM helpers
def gram_self(t: np.ndarray, out: np.ndarray, chunk: int = GRAM_CHUNK) -> None:
    """Add ``t.T @ t`` (float32 per chunk of features) to ``out`` (float64).

    The whole square: with OpenBLAS a triangle (SYRK, or GEMMs of block rows) took as
    long as the square here."""
    for start in range(0, t.shape[0], chunk):
        part = t[start:start + chunk]
        out += part.T @ part


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


_CONTROLLER = None
#: Share of the threads that run the GEMMs (BLAS) while the rest run the L1 kernels: the
#: L1 kernels take about 1.4 times as long as the GEMMs on one thread.
GEMM_SHARE = 0.4


def blas_threads(count: int):
    """A context in which BLAS (numpy's matmul) runs on ``count`` threads."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=count, user_api="blas")


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
        # X-Y L1 sums as (fewer rows, more rows): the kernel vectorises along the latter
        self.l1_xy = [np.zeros((n, m) if n < m else (m, n)) for n in self.ns]
        if within:
            self.norms_yy = [np.zeros(n) for n in self.ns]      # Y centred on its own
            self.gram_yy = [np.zeros((n, n)) for n in self.ns]
            self.l1_yy = [np.zeros(n * (n - 1) // 2) for n in self.ns]

    def update(self, x_block: np.ndarray, y_blocks: Sequence[np.ndarray]) -> None:
        """Accumulate one block of features (shapes and dtypes already checked).

        The GEMMs run in a thread of their own on :data:`GEMM_SHARE` of numba's threads
        (at least one) while the L1 kernels run on the others: BLAS threads that spin
        between calls would otherwise take the cores from the L1 kernels (on 2 cores
        the fast path took 3x longer with both on 2 threads, alternating)."""
        reference = x_block.mean(axis=0, dtype=np.float64)
        xt = centred(x_block, reference)
        add_squared_norms(xt, self.norms_x)
        ys, owns = [], []
        for k, y_block in enumerate(y_blocks):
            ys.append(centred(y_block, reference))
            add_squared_norms(ys[k], self.norms_yx[k])
            if self.within:
                owns.append(centred(y_block, y_block.mean(axis=0, dtype=np.float64)))
                add_squared_norms(owns[k], self.norms_yy[k])

        threads = numba.get_num_threads()
        blas = max(1, round(threads * GEMM_SHARE))

        def grams() -> None:
            with blas_threads(blas):
                if self.within:
                    gram_self(xt, self.gram_xx)
                for k, yt in enumerate(ys):
                    gram_cross(xt, yt, self.gram_xy[k])
                    if self.within:
                        gram_self(owns[k], self.gram_yy[k])

        if threads == 1:      # one thread asked for: one at a time
            grams()
            self._l1(xt, ys, owns)
            return
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(grams)
            numba.set_num_threads(max(1, threads - blas))   # this thread's setting only
            try:
                self._l1(xt, ys, owns)
            finally:
                numba.set_num_threads(threads)
            done.result()

    def _l1(self, xt: np.ndarray, ys: list[np.ndarray], owns: list[np.ndarray]) -> None:
        if self.within:
            l1_self(xt, self.l1_xx, L1_CHUNK, tasks_for(self.m))
        for k, yt in enumerate(ys):
            # the fewer rows against the more: long vectors (|y - x| = |x - y|, bit for bit)
            if self.ns[k] < self.m:
                l1_cross(yt, xt, self.l1_xy[k], L1_CHUNK, tasks_for(self.ns[k]))
            else:
                l1_cross(xt, yt, self.l1_xy[k], L1_CHUNK, tasks_for(self.m))
            if self.within:
                l1_self(owns[k], self.l1_yy[k], L1_CHUNK, tasks_for(self.ns[k]))

    def xx(self) -> tuple[np.ndarray, np.ndarray]:
        """X's self-distances, packed pairs i < j: (L1, squared L2)."""
        return self.l1_xx, _packed(self.norms_x, self.gram_xx)

    def xy(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The (m, n_k) X-Y_k block: (L1, squared L2)."""
        l1 = self.l1_xy[k]
        if self.ns[k] < self.m:
            l1 = np.ascontiguousarray(l1.T)
        return l1, squared_from_gram(self.norms_x, self.norms_yx[k], self.gram_xy[k])

    def yy(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Y_k's self-distances, packed pairs i < j."""
        return self.l1_yy[k], _packed(self.norms_yy[k], self.gram_yy[k])


@numba.njit(cache=True, nogil=True)
def packed_squared(norms, gram, out):  # pragma: no cover - compiled
    """out[pair (i, j)] = max(N_i + N_j - 2 G_ij, 0) for i < j, packed row by row."""
    rows = norms.shape[0]
    at = 0
    for i in range(rows):
        base = norms[i]
        for j in range(i + 1, rows):
            value = base + norms[j] - 2.0 * gram[i, j]
            out[at] = value if value > 0.0 else 0.0
            at += 1


def _packed(norms: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """The squared distances i < j, packed, from a self Gram matrix and its norms."""
    rows = norms.shape[0]
    out = np.empty(rows * (rows - 1) // 2)
    packed_squared(norms, gram, out)
    return out
