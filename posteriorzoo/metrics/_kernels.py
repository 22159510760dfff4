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


@njit(parallel=True, cache=True)
def ensemble_entropies(members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(predictive (n, K), expected (n,))``, float64: the members' mean probabilities and
    the mean over members of each member's entropy (nats), for ``members`` ``(m, n, K)``."""
    count, samples, classes = members.shape
    predictive = np.zeros((samples, classes))
    expected = np.zeros(samples)
    for block in prange((samples + _BLOCK - 1) // _BLOCK):
        start = block * _BLOCK
        stop = min(start + _BLOCK, samples)
        for member in range(count):
            for sample in range(start, stop):
                entropy = 0.0
                for k in range(classes):
                    value = np.float64(members[member, sample, k])
                    predictive[sample, k] += value
                    entropy += _entr(value)
                expected[sample] += entropy
        for sample in range(start, stop):
            for k in range(classes):
                predictive[sample, k] /= count
            expected[sample] /= count
    return predictive, expected


@njit(parallel=True, cache=True)
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
