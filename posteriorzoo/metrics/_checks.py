"""The argument checks the metrics share: one :class:`InvalidOptionError` per mistake.

``posteriorzoo._api.public`` has already checked the types (an ``np.ndarray`` where one is
annotated); these check what a type cannot say: shapes, dtypes, finiteness, ranges and
option values. Each message starts with the name of the public function the user called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from posteriorzoo.errors import InvalidOptionError

#: How far a row of probabilities may sum from 1: float32 softmax outputs over a few
#: hundred classes are off by ~1e-5; logits or unnormalised scores are off by far more.
SUM_TOLERANCE = 1e-3

_LAYOUTS = {2: "(n, K)", 3: "(m, n, K)"}


def fail(function: str, message: str) -> NoReturn:
    """Raise the one-line error of ``function`` (named as the user called it)."""
    raise InvalidOptionError(f"{function}(): {message}")


def probability_layout(function: str, name: str, value: np.ndarray, ndim: int) -> None:
    """The part of :func:`probabilities` that does not read the values: a real dtype, the
    number of axes, not empty."""
    if value.dtype.kind not in "iuf":
        fail(function, f"{name} must hold real numbers, not {value.dtype}")
    if value.ndim != ndim:
        fail(function, f"{name} must have shape {_LAYOUTS[ndim]}, not {value.shape}")
    if value.size == 0:
        fail(function, f"{name} must not be empty; its shape is {value.shape}")


def probabilities(function: str, name: str, value: np.ndarray, ndim: int) -> np.ndarray:
    """``value`` itself, once it is a non-empty (n, K) or (m, n, K) array of probabilities.

    Entries must be finite, in [0, 1], and each row over the last axis (the classes) must
    sum to 1 within :data:`SUM_TOLERANCE`. The array is returned as given (no copy).
    """
    probability_layout(function, name, value, ndim)
    if not np.isfinite(value).all():
        fail(function, f"{name} holds NaN or infinite values")
    low, high = value.min(), value.max()
    if low < 0 or high > 1:
        fail(function, f"{name} must lie in [0, 1]; its values span [{low:.6g}, {high:.6g}]")
    error = np.abs(value.sum(axis=-1, dtype=np.float64) - 1.0)
    if error.max() > SUM_TOLERANCE:
        worst = np.unravel_index(int(error.argmax()), error.shape)
        fail(function, f"{name} must sum to 1 over its last axis (the classes); the row "
                       f"at {tuple(int(i) for i in worst)} sums to "
                       f"{float(value[worst].sum(dtype=np.float64)):.6g}")
    return value


def class_labels(function: str, labels: np.ndarray, samples: int, classes: int) -> np.ndarray:
    """``labels`` as int64, once it is an integer array of shape (samples,) in [0, classes)."""
    if labels.dtype.kind not in "iu":
        fail(function, f"labels must be integers, not {labels.dtype}")
    if labels.shape != (samples,):
        fail(function, f"labels must have shape ({samples},) to match the probabilities, "
                       f"not {labels.shape}")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= classes:
        fail(function, f"labels must lie in 0..{classes - 1} (K = {classes} classes); "
                       f"they span {low}..{high}")
    return labels.astype(np.int64, copy=False)


def scores(function: str, name: str, value: np.ndarray) -> np.ndarray:
    """``value`` as float64, once it is a non-empty 1-D array of finite real numbers."""
    if value.dtype.kind not in "iuf":
        fail(function, f"{name} must hold real numbers, not {value.dtype}")
    if value.ndim != 1 or value.size == 0:
        fail(function, f"{name} must be a non-empty 1-D array, not of shape {value.shape}")
    if not np.isfinite(value).all():
        fail(function, f"{name} holds NaN or infinite values")
    return value.astype(np.float64, copy=False)


def positive_int(function: str, name: str, value: int) -> int:
    """``value`` as an int, once it is an integer >= 1 (a bool is not a count)."""
    if isinstance(value, bool | np.bool_) or value < 1:
        fail(function, f"{name} must be a positive integer, not {value!r}")
    return int(value)


def choice(function: str, name: str, value: str, allowed: Sequence[str]) -> str:
    """``value``, once it is one of ``allowed``."""
    if value not in allowed:
        fail(function, f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    return value
