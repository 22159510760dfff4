"""Pairwise L1 and squared-L2 distances, accumulated over blocks of features.

The MMD of a layer needs, for the pooled sample Z = [X; Y] (m + n rows of d weights),
the matrices of L1 distances ``sum_k |z_ik - z_jk|`` and of squared L2 distances
``sum_k (z_ik - z_jk)^2``. Both are accumulated in one pass over the data, in blocks of
columns (features), so a layer with millions of weights can stream from an HDF5 zoo:
memory is O((m + n)^2 + block), never O((m + n) d).

Exactness. In the exact path every distance is accumulated in float64 (whatever the
input dtype), in the order of the features, one feature at a time: the kernels vectorise
across *pairs* (the j loop), never across features. The result is therefore bit-for-bit
the same for every way of cutting the features into blocks, every number of threads, and
whether a pair (i, j) is computed as part of X's self-distances, Y's, or X-against-Y.

Precision. ``precision="exact"`` (the default of the existing entry points,
:data:`DEFAULT_PRECISION`) runs the float64 kernels below; ``precision="fast"`` runs
:mod:`posteriorzoo.mmd.distances_fast` (L2 through a float32 GEMM of centred rows, L1
through a float32 SIMD kernel, both accumulated in float64), within the error bound that
module states, in less than half the time; ``device="cuda"`` (or ``"cuda:N"``) runs that
fast path in torch (:mod:`posteriorzoo.mmd.distances_torch`). :func:`cross_distances`
gives one tile of the matrices (fast by default), for tiled and cached computations.

When one reference sample X (the target posterior) is compared with several samples
Y_1, ..., Y_K (the methods), X's self-distances are shared:
:class:`SharedTargetDistances` accumulates X-X once and X-Y_k, Y_k-Y_k for each k in the
same pass over the features.
"""

# ruff: noqa: N803, N806, N815 -- the paper's and MMDAgg's names: X, Y, K, B1, B2, B3

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numba
import numpy as np
from numba import prange, uint64

from posteriorzoo._api import public
from posteriorzoo._numba import announce_compilation
from posteriorzoo.errors import (
    InvalidOptionError,
    NonFiniteWeightsError,
    SampleSizeError,
    ShapeMismatchError,
)
from posteriorzoo.vocabulary import DISTANCE_PRECISIONS

announce_compilation()

#: Default number of features per block when an in-memory array is cut into blocks.
DEFAULT_BLOCK_FEATURES = 16384
#: Bytes of one task's transposed float64 tile (kept in the core's L2 cache).
_TILE_BYTES = 1 << 19
#: The precision of the existing entry points (pooled distances, ``kernel_mmds``,
#: ``mmdagg``, ``compare_arrays``, the noise floor): "exact", because the report's noise
#: floor and ``compare_arrays`` are tested to agree to float64 rounding. "fast" is asked
#: for per call (``precision="fast"``); :func:`cross_distances` (tiles) is fast by default.
DEFAULT_PRECISION = "exact"


# ---------------------------------------------------------------------------- numba kernels
@numba.njit(inline="always")
def packed_offset(i, rows):  # pragma: no cover - compiled
    """Start of row i's pairs (i, i+1), ..., (i, rows-1) in packed upper-triangle storage."""
    return i * (2 * rows - i - 1) // 2


@numba.njit(inline="always")
def _transpose_tile(block, buffer, start, width):  # pragma: no cover - compiled
    """buffer[c, r] = block[r, start + c] for the tile's ``width`` features (as float64)."""
    for r in range(block.shape[0]):
        for c in range(width):
            buffer[c, r] = block[r, start + c]


@numba.njit(inline="always")
def _accumulate_row(buffer, width, xs, acc1, acc2, lo, count):  # pragma: no cover - compiled
    """acc[k] += sum over the tile's features c of |xs[c] - buffer[c, lo + k]| (and squared).

    Features are added one at a time in order, so every accumulator sees exactly the
    additions of a plain feature-by-feature loop; four features are handled per pass over
    k so the accumulators are loaded and stored once per four features. The loops use
    unsigned indices, which lets the compiler vectorise them.
    """
    full = width - width % 4
    for c in range(0, full, 4):
        c0 = buffer[c][lo:]
        c1 = buffer[c + 1][lo:]
        c2 = buffer[c + 2][lo:]
        c3 = buffer[c + 3][lo:]
        x0 = xs[c]
        x1 = xs[c + 1]
        x2 = xs[c + 2]
        x3 = xs[c + 3]
        for k in range(uint64(count)):
            s1 = acc1[k]
            s2 = acc2[k]
            diff = x0 - c0[k]
            s1 += abs(diff)
            s2 += diff * diff
            diff = x1 - c1[k]
            s1 += abs(diff)
            s2 += diff * diff
            diff = x2 - c2[k]
            s1 += abs(diff)
            s2 += diff * diff
            diff = x3 - c3[k]
            s1 += abs(diff)
            s2 += diff * diff
            acc1[k] = s1
            acc2[k] = s2
    for c in range(full, width):
        column = buffer[c][lo:]
        x = xs[c]
        for k in range(uint64(count)):
            diff = x - column[k]
            acc1[k] += abs(diff)
            acc2[k] += diff * diff


@numba.njit(parallel=True, cache=True, nogil=True)
def _self_block(block, l1, l2sq, workspace):  # pragma: no cover - compiled
    """Add the distances between the rows of ``block`` (rows, features) to l1, l2sq.

    ``l1`` and ``l2sq`` hold the pairs i < j in packed upper-triangle order (see
    :func:`packed_offset`). Rows i and rows - 1 - i are handled by the same task so that
    tasks get equal work. Each task copies a tile of features into its own float64
    buffer, feature-major, then updates its rows' accumulators (:func:`_accumulate_row`).
    """
    rows, features = block.shape
    half = (rows + 1) // 2
    tasks, tile = workspace.shape[0], workspace.shape[1]
    for task in prange(tasks):
        buffer = workspace[task]
        xs = np.empty(tile, dtype=np.float64)
        for start in range(0, features, tile):
            width = min(tile, features - start)
            _transpose_tile(block, buffer, start, width)
            for p in range(task, half, tasks):
                for side in range(2):
                    i = p if side == 0 else rows - 1 - p
                    if side == 1 and i == p:
                        continue
                    for c in range(width):
                        xs[c] = buffer[c, i]
                    first = packed_offset(i, rows)
                    count = rows - i - 1
                    _accumulate_row(buffer, width, xs, l1[first:first + count],
                                    l2sq[first:first + count], i + 1, count)


@numba.njit(parallel=True, cache=True, nogil=True)
def _cross_block(a_block, b_block, l1, l2sq, workspace):  # pragma: no cover - compiled
    """Add the distances between the rows of ``a_block`` and of ``b_block`` to l1, l2sq.

    ``l1[i, j]`` accumulates ``|a_i - b_j|`` (difference taken as a - b, as in the pooled
    self-distances where X's rows come first).
    """
    a_rows, features = a_block.shape
    b_rows = b_block.shape[0]
    tasks, tile = workspace.shape[0], workspace.shape[1]
    for task in prange(tasks):
        buffer = workspace[task]
        xs = np.empty(tile, dtype=np.float64)
        for start in range(0, features, tile):
            width = min(tile, features - start)
            _transpose_tile(b_block, buffer, start, width)
            for i in range(task, a_rows, tasks):
                for c in range(width):
                    xs[c] = a_block[i, start + c]
                _accumulate_row(buffer, width, xs, l1[i], l2sq[i], 0, b_rows)


# ---------------------------------------------------------------------------- helpers
def zeros(*shape: int) -> np.ndarray:
    """A float64 array of zeros whose memory is touched here, in the calling thread.

    Fresh pages first written inside a parallel region cost far more (concurrent page
    faults) than zeroing them up front.
    """
    array = np.empty(shape)
    array.fill(0.0)
    return array


def workspace(rows: int) -> np.ndarray:
    """Per-task tile buffers (tasks, tile, rows) for the distance kernels."""
    tile = int(max(8, min(512, _TILE_BYTES // (8 * max(rows, 1)))))
    return zeros(max(1, numba.get_num_threads()), tile, rows)


def as_block(array: np.ndarray, name: str = "sample", check_finite: bool = True
             ) -> np.ndarray:
    """``array`` as a C-contiguous 2-D float32 or float64 block, checked to be finite.

    Parameters
    ----------
    array : array-like of shape (rows, features) or (rows, *shape)
        Trailing axes are flattened in C order. Integer and float16 inputs become float64
        or float32; other float dtypes are kept.

    Raises
    ------
    NonFiniteWeightsError
        If a value is NaN or infinite (the message names the first such row).
    """
    array = np.asarray(array)
    if array.ndim < 1:
        raise ShapeMismatchError(f"{name}: expected an array of shape (samples, features)")
    array = array.reshape(array.shape[0], -1)
    if array.dtype == np.float16:
        array = array.astype(np.float32)
    elif array.dtype not in (np.float32, np.float64):
        if not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
            raise ShapeMismatchError(f"{name}: dtype {array.dtype} is not numeric")
        array = array.astype(np.float64)
    array = np.ascontiguousarray(array)
    if check_finite and array.size and not np.isfinite(array).all():
        row = int(np.flatnonzero(~np.isfinite(array).all(axis=1))[0])
        raise NonFiniteWeightsError(f"{name}: row {row} has NaN or infinite values")
    return array


def check_samples(m: int, n: int, d_x: int, d_y: int, names: tuple[str, str] = ("X", "Y")
                  ) -> None:
    """Raise unless both samples have at least 2 rows and the same positive dimension."""
    for rows, name in ((m, names[0]), (n, names[1])):
        if rows < 2:
            raise SampleSizeError(
                f"{name} has {rows} sample(s); the unbiased MMD needs at least 2 per sample")
    if d_x != d_y:
        raise ShapeMismatchError(
            f"{names[0]} has {d_x} features per sample but {names[1]} has {d_y}")
    if d_x == 0:
        raise ShapeMismatchError("the samples have no features (an empty layer)")


@numba.njit(parallel=True, cache=True, nogil=True)
def _assemble(xx, yy, xy, out):  # pragma: no cover - compiled
    """The full symmetric pooled matrix from packed X-X and Y-Y pairs and the X-Y block.

    Written in 64 x 64 tiles so that the mirrored (column) writes stay in cache.
    """
    m, n = xy.shape
    rows = m + n
    size = 64
    tiles = (rows + size - 1) // size
    for ti in prange(tiles):
        for tj in range(ti, tiles):
            for i in range(ti * size, min(rows, (ti + 1) * size)):
                out[i, i] = 0.0
                for j in range(max(i + 1, tj * size), min(rows, (tj + 1) * size)):
                    if j < m:
                        value = xx[packed_offset(i, m) + j - i - 1]
                    elif i < m:
                        value = xy[i, j - m]
                    else:
                        a = i - m
                        value = yy[packed_offset(a, n) + j - m - a - 1]
                    out[i, j] = value
                    out[j, i] = value


def unpack(packed: np.ndarray, rows: int) -> np.ndarray:
    """A symmetric (rows, rows) matrix with zero diagonal from packed pairs i < j."""
    full = np.zeros((rows, rows))
    upper = np.triu_indices(rows, 1)
    full[upper] = packed
    return full + full.T


@dataclass
class Distances:
    """Pairwise distances of the pooled sample Z = [X; Y], kept as its three blocks.

    Attributes
    ----------
    xx : (ndarray (m (m - 1) / 2,), ndarray (m (m - 1) / 2,))
        L1 and squared-L2 distances between rows of X, pairs i < j packed row by row:
        (0, 1), (0, 2), ..., (0, m - 1), (1, 2), ... (``unpack`` gives the matrix).
    xy : (ndarray (m, n), ndarray (m, n))
        L1 and squared-L2 distances between X's row i and Y's row j.
    yy : (ndarray (n (n - 1) / 2,), ndarray (n (n - 1) / 2,))
        As ``xx`` for Y.
    m, n : int
        Rows of X and of Y.

    All values are float64, in the units of the data (L1) and squared (L2). The arrays may
    be shared with other comparisons of the same X: do not modify them.
    """

    xx: tuple[np.ndarray, np.ndarray]
    xy: tuple[np.ndarray, np.ndarray]
    yy: tuple[np.ndarray, np.ndarray]
    m: int
    n: int

    def pooled(self) -> tuple[np.ndarray, np.ndarray]:
        """The full symmetric (m + n, m + n) L1 and squared-L2 matrices of Z = [X; Y]."""
        rows = self.m + self.n
        out = (zeros(rows, rows), zeros(rows, rows))
        for k in range(2):
            _assemble(self.xx[k], self.yy[k], self.xy[k], out[k])
        return out


class SharedTargetDistances:
    """Distances of one reference sample X and several samples Y_k, fed block by block.

    Parameters
    ----------
    m : int
        Rows of X.
    ns : sequence of int
        Rows of each Y_k.
    precision : {"exact", "fast"}
        ``"exact"`` (default, :data:`DEFAULT_PRECISION`): float64 feature by feature, the
        same bits for every blocking and thread count; ``"fast"``: float32 GEMM (L2) and
        SIMD (L1) kernels accumulated in float64, within the bound of
        :mod:`posteriorzoo.mmd.distances_fast`, about half the time (see
        ``benchmarks/bench_mmd.py``).
    device : str
        ``"cpu"`` (default), or a torch device (``"cuda"``, ``"cuda:1"``) for the fast
        path in torch (:mod:`posteriorzoo.mmd.distances_torch`).
    within : bool
        Also the self-distances X-X and Y_k-Y_k (default); False computes only the X-Y_k
        blocks (a tile of a larger matrix: :func:`cross_distances`).

    Feed column blocks with :meth:`update` (the same features of X and of every Y_k, in
    the same order each time), then read :meth:`pooled` (k). X's self-distances are
    computed once for all k.
    """

    def __init__(self, m: int, ns: Sequence[int], *, precision: str = DEFAULT_PRECISION,
                 device: str = "cpu", within: bool = True) -> None:
        self.m = int(m)
        self.ns = [int(n) for n in ns]
        self.features = 0
        self.precision = check_precision(precision, device)
        self.within = bool(within)
        self._engine = None
        if device != "cpu":
            from posteriorzoo.mmd.distances_torch import TorchDistances

            self._engine = TorchDistances(self.m, self.ns, self.within, device)
        elif self.precision == "fast":
            from posteriorzoo.mmd.distances_fast import FastDistances

            self._engine = FastDistances(self.m, self.ns, self.within)
        else:
            self._xx = [zeros(m * (m - 1) // 2), zeros(m * (m - 1) // 2)] if within else None
            self._xy = [[zeros(m, n), zeros(m, n)] for n in self.ns]
            self._yy = ([[zeros(n * (n - 1) // 2), zeros(n * (n - 1) // 2)] for n in self.ns]
                        if within else None)
            self._workspaces: dict[int, np.ndarray] = {}

    def _workspace(self, rows: int) -> np.ndarray:
        if rows not in self._workspaces:
            self._workspaces[rows] = workspace(rows)
        return self._workspaces[rows]

    def update(self, x_block: np.ndarray, y_blocks: Sequence[np.ndarray],
               check_finite: bool = True) -> None:
        """Accumulate one block of features.

        Parameters
        ----------
        x_block : ndarray of shape (m, b)
            Features [f, f + b) of X; any float dtype (see :func:`as_block`).
        y_blocks : sequence of ndarray of shape (n_k, b)
            The same features of each Y_k.
        check_finite : bool
            Raise :class:`NonFiniteWeightsError` on NaN or infinite values (turn off only
            if the caller has checked).
        """
        x_block = as_block(x_block, "X", check_finite)
        if x_block.shape[0] != self.m or len(y_blocks) != len(self.ns):
            raise ShapeMismatchError("a block does not match the sample sizes given")
        y_blocks = [as_block(y_block, f"Y[{k}]", check_finite)
                    for k, y_block in enumerate(y_blocks)]
        # One dtype for all blocks (float32 only if every block is float32): the values
        # are converted to float64 inside the exact kernels either way.
        common = np.result_type(x_block, *y_blocks)
        x_block = x_block.astype(common, copy=False)
        width = x_block.shape[1]
        for k, y_block in enumerate(y_blocks):
            if y_block.shape != (self.ns[k], width):
                raise ShapeMismatchError(
                    f"block of Y[{k}] has shape {y_block.shape}; expected "
                    f"{(self.ns[k], width)}")
        y_blocks = [y_block.astype(common, copy=False) for y_block in y_blocks]
        if self._engine is not None:
            self._engine.update(x_block, y_blocks)
            self.features += width
            return
        if self.within:
            _self_block(x_block, self._xx[0], self._xx[1], self._workspace(self.m))
        for k, y_block in enumerate(y_blocks):
            _cross_block(x_block, y_block, self._xy[k][0], self._xy[k][1],
                         self._workspace(self.ns[k]))
            if self.within:
                _self_block(y_block, self._yy[k][0], self._yy[k][1],
                            self._workspace(self.ns[k]))
        self.features += width

    def self_packed(self) -> tuple[np.ndarray, np.ndarray]:
        """X's self-distances (L1, squared L2), pairs i < j packed (see :class:`Distances`)."""
        if not self.within:
            raise ShapeMismatchError("these distances were computed without X-X (within=False)")
        if self._engine is not None:
            if not hasattr(self, "_xx_done"):
                self._xx_done = self._engine.xx()
            return self._xx_done
        return tuple(self._xx)

    def cross(self, k: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The (m, n_k) X-Y_k distances (L1, squared L2)."""
        if self._engine is not None:
            return self._engine.xy(k)
        return tuple(self._xy[k])

    def pooled(self, k: int = 0) -> Distances:
        """The distances of the pooled sample Z = [X; Y_k] (see :class:`Distances`)."""
        if not self.within:
            raise ShapeMismatchError("these distances were computed without X-X and Y-Y "
                                     "(within=False): read cross(k)")
        yy = self._engine.yy(k) if self._engine is not None else tuple(self._yy[k])
        return Distances(self.self_packed(), self.cross(k), yy, self.m, self.ns[k])


def check_precision(precision: object, device: object) -> str:
    """``precision`` if it is one of :data:`~posteriorzoo.vocabulary.DISTANCE_PRECISIONS`
    (how the distances are computed: ``"exact"``, float64 feature by feature with
    reproducible bits, or ``"fast"``, float32 GEMM and SIMD kernels within a stated bound
    of exact) and ``device`` allows it."""
    if precision not in DISTANCE_PRECISIONS:
        raise InvalidOptionError("precision must be one of "
                                 f"{', '.join(map(repr, DISTANCE_PRECISIONS))}"
                                 f", not {precision!r}")
    if not isinstance(device, str) or not device:
        raise InvalidOptionError(f"device must be a string such as 'cpu' or 'cuda', not "
                                 f"{device!r}")
    if precision == "exact" and device != "cpu":
        raise InvalidOptionError(f"precision 'exact' runs on the CPU only, not on {device!r}")
    return precision


def column_blocks(array: np.ndarray, block_features: int) -> Iterable[np.ndarray]:
    """Consecutive column blocks of a 2-D array (views)."""
    width = array.shape[1]
    for start in range(0, width, max(1, int(block_features))):
        yield array[:, start:start + block_features]


@public
def pooled_distances(X: np.ndarray, Y: np.ndarray, *,
                     block_features: int = DEFAULT_BLOCK_FEATURES,
                     precision: str = DEFAULT_PRECISION,
                     device: str = "cpu") -> Distances:
    """L1 and squared-L2 distance matrices of the pooled sample Z = [X; Y].

    Parameters
    ----------
    X : array-like of shape (m, d) or (m, *shape)
        First sample (trailing axes are flattened).
    Y : array-like of shape (n, d) or (n, *shape)
        Second sample, same number of features.
    block_features : int
        Features per block; the exact result does not depend on it (see the module
        notes), the fast one only within its bound.
    precision : {"fast", "exact"}
        See :class:`SharedTargetDistances`.
    device : str
        ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (see :class:`SharedTargetDistances`).

    Returns
    -------
    Distances
        Its blocks X-X, X-Y, Y-Y; ``.pooled()`` gives the (m + n, m + n) matrices.
    """
    X = as_block(X, "X")
    Y = as_block(Y, "Y")
    check_samples(X.shape[0], Y.shape[0], X.shape[1], Y.shape[1])
    return stream_pooled_distances(
        zip(column_blocks(X, block_features), column_blocks(Y, block_features),
            strict=True), X.shape[0], Y.shape[0], precision=precision, device=device)


@public
def stream_pooled_distances(blocks: Iterable[tuple[np.ndarray, np.ndarray]], m: int,
                            n: int, *, precision: str = DEFAULT_PRECISION,
                            device: str = "cpu") -> Distances:
    """Pooled distances from a stream of ``(x_block, y_block)`` column blocks.

    Parameters
    ----------
    blocks : iterable of (ndarray (m, b_t), ndarray (n, b_t))
        The same features of X and Y, block after block (e.g. read from HDF5).
    m, n : int
        Rows of X and of Y.
    precision, device : str
        See :class:`SharedTargetDistances`.
    """
    shared = SharedTargetDistances(m, [n], precision=precision, device=device)
    for x_block, y_block in blocks:
        shared.update(x_block, [y_block])
    if shared.features == 0:
        raise ShapeMismatchError("the samples have no features (an empty layer)")
    return shared.pooled(0)



def _blocks_of(rows: np.ndarray | Iterable, block_features: int, name: str
               ) -> Iterable[np.ndarray]:
    """Column blocks of an array (anything with ``shape``) or the blocks of a stream."""
    if hasattr(rows, "shape"):
        if len(rows.shape) < 1:
            raise ShapeMismatchError(f"{name}: expected an array of shape (rows, features)")
        if len(rows.shape) != 2:
            rows = np.asarray(rows).reshape(rows.shape[0], -1)
        return column_blocks(rows, block_features)
    return iter(rows)


@public
def cross_distances(a: np.ndarray | Iterable, b: np.ndarray | Iterable, *,
                    precision: str = "fast", device: str = "cpu",
                    block_features: int = DEFAULT_BLOCK_FEATURES,
                    check_finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One tile of the distance matrices: L1 and squared-L2 distances of two row sets.

    Parameters
    ----------
    a : array of shape (m, d) or (m, *shape), or iterable of arrays (m, b_t)
        The first rows: an array (anything with ``shape`` and column slicing, e.g. an
        h5py dataset, read in blocks of ``block_features``) or a stream of its column
        blocks.
    b : array of shape (n, d) or (n, *shape), or iterable of arrays (n, b_t)
        The second rows, with the same features in the same blocks. Pass the same object
        as ``a`` (``b is a``) for a diagonal tile: it is computed once, and is symmetric
        with an exactly zero diagonal.
    precision : {"fast", "exact"}
        ``"fast"`` (default): float32 arithmetic in chunks of features, accumulated in
        float64, within the bound stated in :mod:`posteriorzoo.mmd.distances_fast`;
        ``"exact"``: the float64 kernels, the same bits for every blocking.
    device : str
        ``"cpu"`` (default: numba and numpy), or a torch device (``"cuda"``,
        ``"cuda:1"``): the same GEMM path in torch (fast precision only).
    block_features : int
        Features per block when ``a`` and ``b`` are arrays.
    check_finite : bool
        Refuse NaN or infinite values (:class:`NonFiniteWeightsError`).

    Returns
    -------
    (ndarray (m, n), ndarray (m, n))
        ``l1[i, j] = sum_k |a_ik - b_jk|`` and ``l2sq[i, j] = sum_k (a_ik - b_jk)^2``,
        float64.
    """
    return _cross_tile(_blocks_of(a, block_features, "a"),
                       None if b is a else _blocks_of(b, block_features, "b"),
                       precision=precision, device=device, check_finite=check_finite)


def _cross_tile(a_blocks: Iterable[np.ndarray], b_blocks: Iterable[np.ndarray] | None, *,
               precision: str, device: str, check_finite: bool
               ) -> tuple[np.ndarray, np.ndarray]:
    """The body of :func:`cross_distances` (blocks given)."""

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
