"""The fast distance path (posteriorzoo.mmd.distances_fast, and its torch twin) against the
exact float64 kernels, within the error bound the module states.

The bound (:func:`l1_bound`, :func:`l2_bound`) is evaluated here from the exactly centred
rows, independently of the code under test: the centred values' rounding to float32, the
float32 sums of each chunk (Higham's ``gamma``, any order, with or without FMA), the
float64 sums across chunks and the last combination. The exact kernels' own float64 error
(``gamma(d + 2, U64)`` of the value) is added, since they are the reference. Each check
also shows the bound can fail: a missing centring and a dropped feature exceed it.

Rows come with a large common offset (1000, the spread about 1) so that centring
matters, and in odd and even numbers (the L1 kernel takes rows in twos); the feature count
spans several blocks and several chunks of both kernels.
"""

# ruff: noqa: N806 -- the statistics' names: samples X, Y

from __future__ import annotations

import numba
import numpy as np
import pytest
from rounding_bounds import U32, U64, gamma
from threadpoolctl import threadpool_limits

from posteriorzoo.errors import (
    InvalidOptionError,
    NonFiniteWeightsError,
    PosteriorZooError,
    ShapeMismatchError,
)
from posteriorzoo.mmd import (
    SharedTargetDistances,
    compare_arrays,
    cross_distances,
    kernel_mmds,
    pooled_distances,
)
from posteriorzoo.mmd import distances_fast as fast
from posteriorzoo.mmd.distances import unpack
from posteriorzoo.mmd.distances_torch import TorchDistances

#: Rounding of one centred value to float32: fl32(fl64(x - r)).
V = (1 + U32) * (1 + U64) - 1
D = 2 * fast.GRAM_CHUNK + 700      # features: 3 Gram chunks, 11 L1 chunks in one block
BLOCK = 1500                       # ... and blocks that cut both kinds of chunk


def sample(rows: int, seed: int, scale: float = 1.0, offset: float = 1000.0) -> np.ndarray:
    """Rows with a common offset, a spread that varies by feature (float64)."""
    rng = np.random.default_rng(seed)
    spread = rng.uniform(0.2, 2.0, size=D)
    return offset + scale * spread * rng.standard_normal((rows, D))


def centred(rows: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return rows - reference


def l1_bound(ca: np.ndarray, cb: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """The module's L1 bound for every pair (a_i, b_j) of centred rows, plus the exact
    kernel's own float64 error."""
    s = np.abs(ca).sum(1)[:, None] + np.abs(cb).sum(1)[None, :]
    g = gamma(fast.L1_CHUNK + 1)
    value = exact + V * s
    return V * s + g * value + gamma(D, U64) * (1 + g) * value + gamma(D + 2, U64) * exact


def l2_bound(ca: np.ndarray, cb: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """The module's squared-L2 bound for every pair (Gram cancellation: relative to the
    centred norms), plus the exact kernel's own float64 error."""
    abs_a, abs_b = np.abs(ca), np.abs(cb)
    diff = np.abs(ca[:, None, :] - cb[None, :, :])
    both = abs_a[:, None, :] + abs_b[None, :, :]
    inputs = 2 * V * (diff * both).sum(-1) + V**2 * (both**2).sum(-1)
    w = (1 + V) ** 2
    p = abs_a @ abs_b.T
    norms = (ca**2).sum(1)[:, None] + (cb**2).sum(1)[None, :]
    g = gamma(fast.GRAM_CHUNK)
    rounding = (2 * g * p + gamma(D, U64) * norms + 2 * gamma(D, U64) * (1 + g) * p
                + gamma(2, U64) * (norms + 2 * (1 + g) * p))
    return inputs + w * rounding + gamma(D + 2, U64) * exact


def exact_cross(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return cross_distances(a, b, precision="exact", block_features=BLOCK)


def within(actual: np.ndarray, expected: np.ndarray, bound: np.ndarray) -> float:
    """The largest |actual - expected| / bound (<= 1 passes)."""
    return float(np.max(np.abs(actual - expected) / bound))


# ---------------------------------------------------------------------------- the bound
def test_a_tile_is_within_the_bound_of_exact():
    X, Y = sample(9, 1), sample(6, 2, scale=1.5)
    l1, l2 = cross_distances(X, Y, block_features=BLOCK)
    e1, e2 = exact_cross(X, Y)
    reference = X.mean(0)
    cx, cy = centred(X, reference), centred(Y, reference)
    assert within(l1, e1, l1_bound(cx, cy, e1)) <= 1
    assert within(l2, e2, l2_bound(cx, cy, e2)) <= 1
    assert l1.shape == l2.shape == (9, 6) and l1.dtype == l2.dtype == np.float64


def test_a_diagonal_tile_is_symmetric_with_a_zero_diagonal():
    X = sample(7, 3)
    l1, l2 = cross_distances(X, X, block_features=BLOCK)
    e1, e2 = exact_cross(X, X)
    cx = centred(X, X.mean(0))
    assert np.array_equal(l1, l1.T) and np.array_equal(l2, l2.T)
    assert not np.diag(l1).any() and not np.diag(l2).any()
    off = ~np.eye(7, dtype=bool)
    assert within(l1[off], e1[off], l1_bound(cx, cx, e1)[off]) <= 1
    assert within(l2[off], e2[off], l2_bound(cx, cx, e2)[off]) <= 1


@pytest.mark.parametrize(("m", "n"), [(7, 6), (8, 5), (5, 8)])
def test_pooled_blocks_are_within_the_bound(m, n):
    """X-X and X-Y centred on X's mean, Y-Y on Y's own (a method far from the target)."""
    X, Y = sample(m, 4), sample(n, 5, scale=0.3, offset=1003.0)
    got = pooled_distances(X, Y, block_features=BLOCK, precision="fast")
    want = pooled_distances(X, Y, block_features=BLOCK, precision="exact")
    cx, cyx, cyy = centred(X, X.mean(0)), centred(Y, X.mean(0)), centred(Y, Y.mean(0))
    upper_x, upper_y = np.triu_indices(m, 1), np.triu_indices(n, 1)
    for k, bound in ((0, l1_bound), (1, l2_bound)):
        assert within(got.xx[k], want.xx[k],
                      bound(cx, cx, unpack(want.xx[k], m))[upper_x]) <= 1
        assert within(got.xy[k], want.xy[k], bound(cx, cyx, want.xy[k])) <= 1
        assert within(got.yy[k], want.yy[k],
                      bound(cyy, cyy, unpack(want.yy[k], n))[upper_y]) <= 1


def test_the_l2_bound_needs_the_centring():
    """Without centring (reference 0) the float32 Gram of rows 1000 from the origin
    cancels far beyond the bound of the centred path."""
    X = sample(6, 6)
    t = fast.centred(X, np.zeros(D))
    gram = np.zeros((6, 6))
    fast.gram_self(t, gram)
    norms = np.zeros(6)
    fast.add_squared_norms(t, norms)
    uncentred = fast.squared_from_gram(norms, norms, gram)
    e2 = exact_cross(X, X)[1]
    cx = centred(X, X.mean(0))
    off = ~np.eye(6, dtype=bool)
    assert within(uncentred[off], e2[off], l2_bound(cx, cx, e2)[off]) > 10


def test_the_bounds_catch_a_dropped_feature():
    """An off-by-one chunk (one feature per L1 chunk left out) misses both bounds."""
    X, Y = sample(5, 7), sample(4, 8)
    keep = np.ones(D, dtype=bool)
    keep[fast.L1_CHUNK - 1::fast.L1_CHUNK] = False
    d1, d2 = exact_cross(X[:, keep], Y[:, keep])
    e1, e2 = exact_cross(X, Y)
    cx, cy = centred(X, X.mean(0)), centred(Y, X.mean(0))
    assert np.all(np.abs(d1 - e1) > l1_bound(cx, cy, e1))
    assert np.all(np.abs(d2 - e2) > l2_bound(cx, cy, e2))


def test_kernel_mmds_move_within_the_bound_the_distances_carry():
    """The 20 MMD^2 values of the fast path against the exact path's, within the change
    the distance bounds allow: each kernel ``exp(-a)``, ``a = d / s`` (Laplace) or
    ``d2 / s^2`` (Gaussian), moves by at most ``exp(-a (1 - r)) a r`` with
    ``r = (1 + e_ij) / (1 - e_s)^p - 1`` (``e_ij`` the pair's relative distance bound,
    ``e_s`` the bandwidths': ``lower^(1 - t) upper^t`` keeps the cross distances' largest
    relative bound, the L2 family's rule reads square roots), plus both runs' float64
    rounding (sums of (m + n)^2 terms, the engine's exp within 1e-14)."""
    m, n = 12, 10
    X, Y = sample(m, 20), sample(n, 21, scale=1.2)
    got = kernel_mmds(X, Y, precision="fast", block_features=BLOCK)
    want = kernel_mmds(X, Y, precision="exact", block_features=BLOCK)
    Z = np.vstack([X, Y])
    exact = exact_cross(Z, Z)
    cz, cy = np.vstack([X, Y]) - X.mean(0), Y - Y.mean(0)
    off = ~np.eye(m + n, dtype=bool)
    weights = np.zeros((m + n, m + n))
    weights[:m, :m], weights[m:, m:] = 1 / (m * (m - 1)), 1 / (n * (n - 1))
    weights[:m, m:] = weights[m:, :m] = 1 / (m * n)
    weights[~off] = 0.0
    count = len(want.bandwidths) // 2
    bound = []
    for family, (function, power) in enumerate(((l1_bound, 1), (l2_bound, 2))):
        relative = np.zeros((m + n, m + n))
        relative[off] = (function(cz, cz, exact[family]) / np.where(off, exact[family], 1))[off]
        own = function(cy, cy, exact[family][m:, m:])
        relative[m:, m:][off[m:, m:]] = (own / np.where(off[m:, m:], exact[family][m:, m:],
                                                        1))[off[m:, m:]]
        e_s = relative[:m, m:].max() + (count + 3) * 16 * U64
        for s in want.bandwidths[family * count:(family + 1) * count]:
            a = exact[family] / s**power
            r = (1 + relative) / (1 - e_s) ** power - 1
            moved = np.exp(-a * (1 - r)) * a * r
            rounding = 2 * (gamma((m + n) ** 2, U64) + 1e-14) * np.exp(-a)
            bound.append(float((weights * (moved + rounding)).sum()))
    difference = np.abs(got.values - want.values)
    assert np.all(difference <= np.array(bound)), float(np.max(difference / bound))
    assert difference.max() > 0     # the paths do differ: the check is not vacuous


# ---------------------------------------------------------------------------- structure
def test_streams_of_blocks_give_the_arrays_result():
    X, Y = sample(5, 9), sample(3, 10)
    from_arrays = cross_distances(X, Y, block_features=BLOCK)
    streamed = cross_distances((X[:, s:s + BLOCK] for s in range(0, D, BLOCK)),
                               (Y[:, s:s + BLOCK] for s in range(0, D, BLOCK)))
    for a, b in zip(from_arrays, streamed, strict=True):
        assert np.array_equal(a, b)
    # float32 rows (a collection's) and trailing axes are taken as they are
    l1, _ = cross_distances(X.astype(np.float32).reshape(5, -1, 2),
                            Y.astype(np.float32).reshape(3, -1, 2))
    assert l1.shape == (5, 3)


def test_cross_and_self_parts_are_the_pooled_bits():
    """The distance cache's contract: X-Y from ``within=False`` and Y-Y from Y alone are
    the bits of the pooled pass (same kernels, same blocks, same references)."""
    X, Y = sample(7, 11), sample(5, 12, offset=990.0)
    pooled = SharedTargetDistances(7, [5], precision="fast")
    cross = SharedTargetDistances(7, [5], precision="fast", within=False)
    own = SharedTargetDistances(5, [], precision="fast")
    for s in range(0, D, BLOCK):
        pooled.update(X[:, s:s + BLOCK], [Y[:, s:s + BLOCK]])
        cross.update(X[:, s:s + BLOCK], [Y[:, s:s + BLOCK]])
        own.update(Y[:, s:s + BLOCK], [])
    whole = pooled.pooled(0)
    for k in range(2):
        assert np.array_equal(whole.xy[k], cross.cross(0)[k])
        assert np.array_equal(whole.yy[k], own.self_packed()[k])
    with pytest.raises(ShapeMismatchError):
        cross.pooled(0)


def test_the_bits_do_not_depend_on_the_thread_count():
    X, Y = sample(9, 13), sample(4, 14)
    results = []
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            with threadpool_limits(1):
                results.append(pooled_distances(X, Y, precision="fast").pooled())
    finally:
        numba.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        assert np.array_equal(a, b)


# ---------------------------------------------------------------------------- torch
def test_the_torch_path_on_the_cpu_is_within_the_same_bound():
    X, Ys = sample(7, 15), [sample(6, 16, scale=2.0), sample(3, 17, offset=1001.0)]
    engine = TorchDistances(7, [6, 3], device="cpu")
    for s in range(0, D, BLOCK):
        engine.update(X[:, s:s + BLOCK], [Y[:, s:s + BLOCK] for Y in Ys])
    cx = centred(X, X.mean(0))
    upper = np.triu_indices(7, 1)
    want_xx = exact_cross(X, X)
    for family, bound in ((0, l1_bound), (1, l2_bound)):
        assert within(engine.xx()[family], want_xx[family][upper],
                      bound(cx, cx, want_xx[family])[upper]) <= 1
    for k, Y in enumerate(Ys):
        want = exact_cross(X, Y)
        cyx, cyy = centred(Y, X.mean(0)), centred(Y, Y.mean(0))
        own = exact_cross(Y, Y)
        pairs = np.triu_indices(len(Y), 1)
        for family, bound in ((0, l1_bound), (1, l2_bound)):
            assert within(engine.xy(k)[family], want[family],
                          bound(cx, cyx, want[family])) <= 1
            assert within(engine.yy(k)[family], own[family][pairs],
                          bound(cyy, cyy, own[family])[pairs]) <= 1


def test_a_missing_device_is_one_line():
    for device in ("cuda:7" if not _cuda() else "bogus", "no-such-device"):
        with pytest.raises(InvalidOptionError) as caught:
            SharedTargetDistances(3, [3], precision="fast", device=device)
        assert "\n" not in str(caught.value) and "device" in str(caught.value)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------- bad input
def test_compare_arrays_takes_the_precision_and_records_it():
    X, Y = sample(6, 22), sample(4, 23)
    fast_run = compare_arrays({"w": X}, {"m": {"w": Y}}, precision="fast")
    exact_run = compare_arrays({"w": X}, {"m": {"w": Y}})
    assert fast_run.options["precision"] == "fast" and exact_run.options["precision"] == "exact"
    assert fast_run.options["device"] == "cpu"
    with pytest.raises(InvalidOptionError, match="precision"):
        compare_arrays({"w": X}, {"m": {"w": Y}}, precision="half")


def test_bad_options_and_inputs_are_refused():
    X = sample(4, 18)
    with pytest.raises(InvalidOptionError, match="precision"):
        cross_distances(X, X, precision="float32")
    with pytest.raises(InvalidOptionError, match="exact"):
        pooled_distances(X, X, precision="exact", device="cuda")
    with pytest.raises(ShapeMismatchError):
        cross_distances(X, X[:, :-1])
    bad = X.copy()
    bad[2, 5] = np.nan
    with pytest.raises(NonFiniteWeightsError, match="row 2"):
        cross_distances(X, bad)
    with pytest.raises(PosteriorZooError):
        cross_distances(iter([]), iter([]))
