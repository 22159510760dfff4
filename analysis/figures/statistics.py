"""The numbers the figures print: pure functions of arrays (no files, no plotting).

- :func:`unit_marginals` takes one weight position per unit of a layer (what the paper's
  Fig. 9 plots), :func:`unit_ks_pvalues` compares those marginals two by two with the
  two-sample Kolmogorov-Smirnov test and :func:`ks_summary` condenses the p-values.
- :func:`pearson` is the correlation of the functional-collapse scatter (Figs. 3 and 7);
  its member pairs are drawn by :func:`posteriorzoo.metrics.draw_pairs`.
- :func:`pca_explained_variance` (and :func:`gram_explained_variance`, for many more
  weights than checkpoints) gives the explained-variance curve of the weights.

Bad input raises :class:`~posteriorzoo.errors.InvalidOptionError`.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from posteriorzoo.errors import InvalidOptionError

__all__ = ["gram_explained_variance", "ks_summary", "pca_explained_variance", "pearson",
           "unit_ks_pvalues", "unit_marginals", "unit_position"]


def unit_position(axis: int, ndim: int) -> str:
    """How :func:`unit_marginals` picks a unit's weight, in words (for axis labels).

    Parameters
    ----------
    axis : int
        The tensor axis indexed by the units (0: output units, 1: input units).
    ndim : int
        Dimensions of one checkpoint's tensor.
    """
    index = ["0"] * ndim
    index[axis] = "u"
    where = "first incoming weight" if axis == 0 else "weight into output 0"
    if ndim == 1:
        where = "value"
    return f"w[{', '.join(index)}]: unit u's {where}"


def unit_marginals(layer: np.ndarray, axis: int = 0, units: int | None = None) -> np.ndarray:
    """One weight position per unit, across checkpoints.

    Parameters
    ----------
    layer : ndarray of shape (N, *shape)
        One tensor of N checkpoints (``Zoo.layer(key)``).
    axis : int
        The axis of ``shape`` indexed by the units (0: output channels or neurons, 1:
        input channels of the next layer).
    units : int, optional
        Keep the first ``units`` units (default: all).

    Returns
    -------
    ndarray of shape (N, U), float64
        Column ``u`` is the weight at index ``u`` on ``axis`` and 0 on every other axis:
        the marginal of one weight position of unit ``u`` (paper Fig. 9).
    """
    layer = np.asarray(layer)
    if layer.ndim < 2:
        raise InvalidOptionError(f"a layer is (N, *shape) with a tensor of at least one "
                                 f"axis, not an array of shape {layer.shape}")
    if not 0 <= axis < layer.ndim - 1:
        raise InvalidOptionError(f"unit axis {axis} is not an axis of a tensor of shape "
                                 f"{layer.shape[1:]}")
    if units is not None and units < 1:
        raise InvalidOptionError(f"units must be at least 1, not {units}")
    moved = np.moveaxis(layer, axis + 1, 1)
    flat = moved.reshape(moved.shape[0], moved.shape[1], -1)[:, :, 0]
    return flat[:, :units].astype(np.float64)


def unit_ks_pvalues(samples: np.ndarray) -> np.ndarray:
    """Two-sample Kolmogorov-Smirnov p-values between every two units' marginals.

    Parameters
    ----------
    samples : ndarray of shape (N, U)
        Column ``u``: N draws of unit ``u``'s weight (:func:`unit_marginals`). Non-finite
        values (diverged checkpoints) are left out of that unit's sample.

    Returns
    -------
    ndarray of shape (U, U), float64
        ``p[a, b]`` is :func:`scipy.stats.ks_2samp`'s two-sided p-value for units ``a``
        and ``b`` (symmetric; 1 on the diagonal). Large values everywhere are what
        Proposition 1 predicts for exchangeable units while permutations are not removed.
    """
    samples = np.asarray(samples, dtype=np.float64)
    if samples.ndim != 2:
        raise InvalidOptionError(f"samples must be (N, U), not of shape {samples.shape}")
    columns = [column[np.isfinite(column)] for column in samples.T]
    if any(column.size < 1 for column in columns):
        raise InvalidOptionError("every unit needs at least one finite value")
    count = len(columns)
    pvalues = np.ones((count, count))
    for a in range(count):
        for b in range(a + 1, count):
            pvalues[a, b] = pvalues[b, a] = stats.ks_2samp(columns[a], columns[b]).pvalue
    return pvalues


def ks_summary(pvalues: np.ndarray) -> dict[str, float | int | None]:
    """Median and minimum of the p-values between distinct units (``pairs`` of them).

    Parameters
    ----------
    pvalues : ndarray of shape (U, U)
        From :func:`unit_ks_pvalues`.

    Returns
    -------
    dict
        ``{"pairs": U (U - 1) / 2, "median": float, "min": float}``; median and min are
        None with fewer than two units.
    """
    pvalues = np.asarray(pvalues, dtype=np.float64)
    upper = pvalues[np.triu_indices(pvalues.shape[0], 1)]
    if upper.size == 0:
        return {"pairs": 0, "median": None, "min": None}
    return {"pairs": int(upper.size), "median": float(np.median(upper)),
            "min": float(upper.min())}


def pearson(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Pearson's correlation coefficient and its two-sided p-value.

    Parameters
    ----------
    x, y : ndarray of shape (P,)
        Paired values (e.g. in- and out-of-distribution MI of P member pairs), P >= 2.

    Returns
    -------
    (r, p) : tuple of float
        :func:`scipy.stats.pearsonr`'s statistic and p-value (NaN for constant input).
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape:
        raise InvalidOptionError(f"x and y must be 1-D of one length, not {x.shape} and "
                                 f"{y.shape}")
    if x.size < 2:
        raise InvalidOptionError(f"a correlation needs at least 2 pairs, not {x.size}")
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan"), float("nan")
    result = stats.pearsonr(x, y)
    return float(result.statistic), float(result.pvalue)


def _cumulative(variances: np.ndarray) -> np.ndarray:
    variances = np.clip(np.sort(variances)[::-1], 0.0, None)
    total = variances.sum()
    if not total > 0:
        raise InvalidOptionError("the weights do not vary: no explained variance to show")
    return np.minimum(np.cumsum(variances) / total, 1.0)


def pca_explained_variance(weights: np.ndarray) -> np.ndarray:
    """Cumulative explained-variance ratio of the principal components of the weights.

    Parameters
    ----------
    weights : ndarray of shape (N, D)
        One flattened checkpoint per row (N >= 2).

    Returns
    -------
    ndarray of shape (min(N, D),), float64
        Entry ``k - 1``: the fraction of the total variance (in [0, 1]) that the first
        ``k`` components explain; the same as scikit-learn's
        ``PCA().explained_variance_ratio_.cumsum()``, from numpy's SVD of the centred
        weights.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 2 or weights.shape[0] < 2:
        raise InvalidOptionError(f"weights must be (N, D) with N >= 2, not {weights.shape}")
    if not np.isfinite(weights).all():
        raise InvalidOptionError("the weights hold NaN or infinite values")
    centred = weights - weights.mean(axis=0)
    singular = np.linalg.svd(centred, compute_uv=False)
    return _cumulative(singular ** 2)


def gram_explained_variance(gram: np.ndarray, features: int | None = None) -> np.ndarray:
    """:func:`pca_explained_variance` from the Gram matrix of the centred weights.

    For D much larger than N: the nonzero eigenvalues of ``C C^T`` (N x N, C the centred
    weights) are those of ``C^T C``, so the Gram matrix can be summed layer by layer.

    Parameters
    ----------
    gram : ndarray of shape (N, N)
        ``C @ C.T`` with ``C = W - W.mean(axis=0)``.
    features : int, optional
        D, the weights per checkpoint: the curve then has ``min(N, D)`` entries, like
        :func:`pca_explained_variance` (default: N).

    Returns
    -------
    ndarray of shape (min(N, D),), float64
    """
    gram = np.asarray(gram, dtype=np.float64)
    if gram.ndim != 2 or gram.shape[0] != gram.shape[1] or gram.shape[0] < 2:
        raise InvalidOptionError(f"gram must be square (N, N) with N >= 2, not {gram.shape}")
    count = gram.shape[0] if features is None else min(gram.shape[0], features)
    return _cumulative(np.linalg.eigvalsh((gram + gram.T) / 2))[:count]
