"""numba kernels of the ensemble metrics: one pass over an ``(m, n, K)`` array of member
probabilities instead of one NumPy pass per member and per quantity.

The report evaluates 15 collections of up to 1,000 members on 10,000 images each; there
the per-member passes (a float64 copy, ``entr``, a sum) took more time than the
predictions. The arithmetic is NumPy's (float64 accumulation, ``0 log 0 = 0``); the sums
run in a different order, so results agree to rounding (tests compare them with
:mod:`posteriorzoo.metrics.information` and :mod:`scipy.special`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from posteriorzoo._numba import announce_compilation

announce_compilation()

#: Samples per parallel task of :func:`ensemble_entropies`: each task reads its rows of
#: every member in turn (contiguous ``block * K`` values), not a member's stride per sample.
_BLOCK = 256


@njit(cache=True, inline="always")
def _entr(x: float) -> float:
    # scipy.special.entr on [0, 1]: -x log x, and 0 at x = 0.
    return -x * np.log(x) if x > 0.0 else 0.0


@njit(parallel=True, cache=True, nogil=True)
def ensemble_entropies(members: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(predictive (n, K), expected (n,), bounds (4,))``, float64: the members' mean
    probabilities, the mean over members of each member's entropy (nats), for ``members``
    ``(m, n, K)``, and in the same pass what :func:`posteriorzoo.metrics._checks.probabilities`
    checks: ``bounds`` = (non-finite entries, smallest entry, largest entry, largest
    ``|row sum - 1|``), so that the members are read once, not twice."""
    count, samples, classes = members.shape
    predictive = np.zeros((samples, classes))
    expected = np.zeros(samples)
    blocks = (samples + _BLOCK - 1) // _BLOCK
    found = np.zeros((blocks, 4))
    for block in prange(blocks):
        start = block * _BLOCK
        stop = min(start + _BLOCK, samples)
        bad, low, high, error = 0.0, np.inf, -np.inf, 0.0
        for member in range(count):
            for sample in range(start, stop):
                entropy = 0.0
                total = 0.0
                for k in range(classes):
                    value = np.float64(members[member, sample, k])
                    predictive[sample, k] += value
                    entropy += _entr(value)
                    total += value
                    # branch-free: value - value is 0 unless value is NaN or infinite
                    bad += 0.0 if value - value == 0.0 else 1.0
                    low = value if value < low else low
                    high = value if value > high else high
                expected[sample] += entropy
                error = max(error, abs(total - 1.0))
        for sample in range(start, stop):
            for k in range(classes):
                predictive[sample, k] /= count
            expected[sample] /= count
        found[block, 0], found[block, 1] = bad, low
        found[block, 2], found[block, 3] = high, error
    bounds = np.empty(4)
    bounds[0] = found[:, 0].sum()
    bounds[1] = found[:, 1].min()
    bounds[2] = found[:, 2].max()
    bounds[3] = found[:, 3].max()
    return predictive, expected, bounds


@njit(parallel=True, cache=True, nogil=True)
def member_hits(members: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(accuracy (m,), picked (m, n))``, float64: each member's share of top-1
    predictions (the first largest probability, as ``argmax``) that equal ``labels``
    ``(n,)``, and the probability it gives each label, at least 1e-12 (``np.clip``), for
    ``members`` ``(m, n, K)``, in one pass. (The logarithm and the mean are left to NumPy,
    whose rounding the per-member functions have.)"""
    count, samples, classes = members.shape
    accuracy = np.empty(count)
    picked = np.empty((count, samples))
    for member in prange(count):
        right = 0
        for sample in range(samples):
            top, best = 0, members[member, sample, 0]
            for k in range(1, classes):
                if members[member, sample, k] > best:
                    top, best = k, members[member, sample, k]
            label = labels[sample]
            right += top == label
            picked[member, sample] = max(np.float64(members[member, sample, label]), 1e-12)
        accuracy[member] = right / samples
    return accuracy, picked


@njit(parallel=True, cache=True, nogil=True)
def pair_mixture_entropies(members: np.ndarray, first: np.ndarray, second: np.ndarray
                           ) -> np.ndarray:
    """``(P,)`` float64: for each pair ``(first[p], second[p])`` of members, the mean over
    samples of the entropy of their average ``(p_i + p_j) / 2`` (nats)."""
    _, samples, classes = members.shape
    out = np.empty(first.shape[0])
    for pair in prange(first.shape[0]):
        i, j = first[pair], second[pair]
        total = 0.0
        for sample in range(samples):
            entropy = 0.0
            for k in range(classes):
                entropy += _entr(0.5 * (np.float64(members[i, sample, k])
                                        + members[j, sample, k]))
            total += entropy
        out[pair] = total / samples
    return out
