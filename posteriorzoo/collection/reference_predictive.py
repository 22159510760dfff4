"""Read a reference predictive from outside: an N x C probability file.

The layout is the NeurIPS 2021 approximate-inference competition's ``probs.csv``: one line
per test input, in the test split's order, with the C class probabilities of the
reference (there, full-batch HMC's) posterior predictive, comma-separated and without a
header (``numpy.savetxt(path, probabilities, delimiter=",")``). Whitespace-separated
values (``savetxt``'s default) are read too.

The file comes from outside, so it is read as untrusted: its size is bounded before and
while it is read, only printable ASCII is accepted, every value must be a plain decimal
number in [0, 1], and the file must describe the split it is scored on (its shape, rows
summing to 1, and, given the labels, predictions that match them better than chance).
Each refusal is one :class:`~posteriorzoo.errors.DataFormatError` (or
:class:`~posteriorzoo.errors.DataNotFoundError` for a missing file) that names the file
and, where one line is at fault, its number.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.errors import DataFormatError, DataNotFoundError, InvalidOptionError
from posteriorzoo.options import check_integer

__all__ = ["CHANCE_P_VALUE", "MAX_TOKEN_CHARACTERS", "read_reference_predictive",
           "row_sum_tolerance"]

#: The longest value accepted, in characters (``savetxt``'s ``%.18e`` writes 24).
MAX_TOKEN_CHARACTERS = 64
#: Bytes a file may spend per value by default (a ``%.18e`` value and its separator take
#: 25; the rest is room for spaces and line ends), and the allowance beyond that.
_BYTES_PER_VALUE = 64
_BYTES_SLACK = 4096
#: A file whose predictions match the labels with a one-sided binomial p-value above
#: this (against guessing, accuracy 1 / C) is refused as another split or order.
CHANCE_P_VALUE = 1e-6

_U32 = 2.0 ** -24   # float32 unit roundoff
_U64 = 2.0 ** -53   # float64 unit roundoff
#: The most members a float64 average in the reference's making is allowed for.
_MEMBERS = 2 ** 20
#: A plain non-negative decimal: digits with an optional fraction, an optional exponent.
_NUMBER = re.compile(r"(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d{1,4}))?")
_NOT_TEXT = re.compile(rb"[^\t\n\r\x20-\x7e]")


def _gamma(k: int, u: float) -> float:
    """Higham's ``gamma_k = k u / (1 - k u)``: the relative bound of a k-term sum."""
    return k * u / (1 - k * u)


def row_sum_tolerance(resolutions: np.ndarray) -> np.ndarray:
    """How far each row of a probability file may sum from 1, from its printed digits.

    A row of the file is a probability vector (summing to 1 exactly) after three
    roundings, each bounded without reference to any one machine:

    1. **Printing.** Each value is rounded to its last printed digit: a value printed
       with ``f`` fraction digits and exponent ``e`` (``7.15e-04``: ``f = 2``, ``e = -4``;
       ``0.0123``: ``f = 4``, ``e = 0``) has the absolute resolution ``r = 10^(e - f)``
       and is at most ``r / 2`` from the value printed. Over a row: ``sum_k r_k / 2``
       (``%.4f`` over 10 classes: 5e-4; ``%.18e``: about 1e-18).
    2. **The softmax in float32.** ``p_k = fl(e_k / fl(sum_j e_j))`` with ``e_k`` the
       rounded exponentials: their own errors cancel in ``sum_k p_k`` (the same ``e_k``
       are summed and divided), leaving the ``K - 1`` additions of the sum and the
       division, ``|sum_k p_k - 1| <= K u32`` to first order; ``gamma(K + 1, u32)``
       bounds it with its second-order terms (``u32 = 2^-24``). A float64 softmax is
       within this bound too.
    3. **Float64 averaging and reading.** The members' mean in float64 (any order, up to
       ``2^20`` members: ``gamma(2^20, u64)``, 1.2e-10), the parse of each printed value
       to the nearest float64 and the ``K - 1`` additions of the check's own row sum
       (``gamma(K + 1, u64)``), all relative to a sum of 1.

    So ``tol_row = sum_k r_k / 2 + gamma(K + 1, u32) + gamma(2^20, u64) + gamma(K + 1,
    u64)``. A file printed to few digits is held only to what its digits can say; one of
    whole numbers (``r = 1``) says nothing about its sums.

    Parameters
    ----------
    resolutions : ndarray of shape (n, K), float
        Each printed value's resolution ``r`` (capped at 1: a value in [0, 1] is never
        further than that from a probability).

    Returns
    -------
    ndarray of shape (n,), float64
    """
    classes = resolutions.shape[1]
    return (0.5 * np.minimum(resolutions, 1.0).sum(axis=1) + _gamma(classes + 1, _U32)
            + _gamma(_MEMBERS, _U64) + _gamma(classes + 1, _U64))


def _refuse(path: Path, message: str, line: int | None = None) -> DataFormatError:
    where = f"{path}" if line is None else f"{path}, line {line}"
    return DataFormatError(f"reference predictive {where}: {message}")


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    """The file's bytes, once it is a regular file of at most ``max_bytes``."""
    try:
        status = path.stat()
    except FileNotFoundError:
        raise DataNotFoundError(f"reference predictive {path}: no such file") from None
    except OSError as error:
        raise _refuse(path, f"cannot be read ({error.strerror or error})") from None
    if stat.S_ISDIR(status.st_mode):
        raise _refuse(path, "is a directory, not a probability file")
    if not stat.S_ISREG(status.st_mode):
        raise _refuse(path, "is not a regular file")
    too_large = (f"is larger than the {max_bytes:,} bytes a file of these rows and "
                 "classes may take")
    if status.st_size > max_bytes:
        raise _refuse(path, f"{too_large} ({status.st_size:,} bytes)")
    try:
        with open(path, "rb") as file:
            data = file.read(max_bytes + 1)   # bounded: the file may grow after stat
    except OSError as error:
        raise _refuse(path, f"cannot be read ({error.strerror or error})") from None
    if len(data) > max_bytes:
        raise _refuse(path, too_large)
    return data


def _parse(path: Path, data: bytes) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The values, their printed resolutions and each row's line number."""
    binary = _NOT_TEXT.search(data)
    if binary is not None:
        line = data.count(b"\n", 0, binary.start()) + 1
        raise _refuse(path, f"holds a byte that is not printable ASCII "
                            f"({data[binary.start()]:#04x}): not a text probability file",
                      line)
    values: list[list[float]] = []
    resolutions: list[list[float]] = []
    lines: list[int] = []
    comma: bool | None = None
    for number, text in enumerate(data.decode("ascii").split("\n"), start=1):
        text = text.strip()
        if not text:
            continue                                   # blank lines (and the last \n)
        if comma is None:
            comma = "," in text
        tokens = [token.strip() for token in text.split(",")] if comma else text.split()
        row, resolution = [], []
        for token in tokens:
            match = (_NUMBER.fullmatch(token) if len(token) <= MAX_TOKEN_CHARACTERS
                     else None)
            if match is None or not (match.group(1) or match.group(2)):
                shown = token if len(token) <= 24 else token[:21] + "..."
                raise _refuse(path, f"{shown!r} is not a plain non-negative decimal "
                                    "number", number)
            value = float(token)
            if value > 1.0:
                raise _refuse(path, f"{token} is not a probability (above 1)", number)
            exponent = int(match.group(3) or 0)
            row.append(value)
            resolution.append(10.0 ** min(exponent - len(match.group(2) or ""), 0))
        if values and len(row) != len(values[0]):
            raise _refuse(path, f"has {len(row)} values where line {lines[0]} has "
                                f"{len(values[0])} (ragged rows)", number)
        values.append(row)
        resolutions.append(resolution)
        lines.append(number)
    if not values:
        raise _refuse(path, "holds no rows")
    return np.array(values, dtype=np.float64), np.array(resolutions), lines


@public
def read_reference_predictive(path: str | os.PathLike, *, rows: int, classes: int,
                              labels: np.ndarray | None = None,
                              max_bytes: int | None = None) -> np.ndarray:
    """A reference predictive from an N x C probability file (the competition's layout).

    Parameters
    ----------
    path : str or path-like
        The file: ``rows`` lines of ``classes`` probabilities, separated by commas
        (``probs.csv``) or whitespace, no header; blank lines are skipped.
    rows : int
        The number of test inputs it must cover (those
        :func:`~posteriorzoo.collection.evaluate` scores, in the
        split's order).
    classes : int
        The number of classes, at least 2.
    labels : ndarray of shape (rows,), int, optional
        The test labels: the file's predictions must match them better than chance (a
        one-sided binomial test of its accuracy against ``1 / classes``, p-value at most
        :data:`CHANCE_P_VALUE`), which refuses rows of another split or in another order.
    max_bytes : int, optional
        The largest file read (default ``rows * classes * 64 + 4096``): checked before
        reading, and reading stops past it.

    Returns
    -------
    ndarray of shape (rows, classes), float64
        The probabilities as printed (not renormalised).

    Raises
    ------
    DataNotFoundError
        If there is no file at ``path``.
    DataFormatError
        If it is not a regular file, is too large, is not printable ASCII, holds a value
        that is not a plain decimal number in [0, 1], has ragged rows, another number of
        rows or columns, a row whose sum is further from 1 than its printed digits and
        float32 arithmetic allow (:func:`row_sum_tolerance`), or, given ``labels``,
        predictions that match them no better than chance.
    """
    rows = check_integer("rows", rows, 1)
    classes = check_integer("classes", classes, 2)
    if labels is not None:
        if labels.dtype.kind not in "iu" or labels.shape != (rows,):
            raise InvalidOptionError(f"labels must be {rows} integers (one per row), not "
                                     f"a {labels.dtype} array of shape {labels.shape}")
        if labels.min() < 0 or labels.max() >= classes:
            raise InvalidOptionError(f"labels must lie in 0..{classes - 1}; they span "
                                     f"{int(labels.min())}..{int(labels.max())}")
    limit = (rows * classes * _BYTES_PER_VALUE + _BYTES_SLACK if max_bytes is None
             else check_integer("max_bytes", max_bytes, 1))
    path = Path(path)
    values, resolutions, lines = _parse(path, _read_bounded(path, limit))
    if len(values) != rows:
        raise _refuse(path, f"has {len(values)} rows, but the test split it must cover has "
                            f"{rows} inputs: a file of another split or subset?")
    if values.shape[1] != classes:
        raise _refuse(path, f"has {values.shape[1]} values per row, but the collection has "
                            f"{classes} classes")
    error = np.abs(values.sum(axis=1) - 1.0)
    tolerance = row_sum_tolerance(resolutions)
    bad = np.flatnonzero(error > tolerance)
    if bad.size:
        first = int(bad[0])
        raise _refuse(path, f"its values sum to {values[first].sum():.9g}, not 1 (to "
                            f"{tolerance[first]:.2g}, what its printed digits allow)",
                      lines[first])
    if labels is not None:
        from scipy.stats import binomtest

        correct = int((values.argmax(axis=1) == labels).sum())
        p_value = binomtest(correct, rows, 1.0 / classes, alternative="greater").pvalue
        if p_value > CHANCE_P_VALUE:
            raise _refuse(path, f"the predictions match the test labels no better than "
                                f"chance (accuracy {correct / rows:.3f} vs 1/{classes}): "
                                "rows of another split or in another order?")
    return values
