"""Datasets by name, loaded into memory as uint8 arrays.

Normalization statistics (:attr:`ArrayDataset.mean` / ``std``, per channel, in
[0, 1] pixel units, over all pixels of the *train* split):

================  ==========================  ==========================  ===========
dataset           mean                        std                         source
================  ==========================  ==========================  ===========
mnist             0.1307                      0.3081                      published
fashion-mnist     0.2860                      0.3530                      published,
                                                                          re-computed
cifar10           0.4914, 0.4822, 0.4465      0.2470, 0.2435, 0.2616      published
cifar100          0.5071, 0.4865, 0.4409      0.2673, 0.2564, 0.2762      published
svhn              0.4377, 0.4438, 0.4728      0.1980, 0.2010, 0.1970      published
tinyimagenet      0.4802, 0.4481, 0.3975      0.2770, 0.2691, 0.2821      published
digits            computed from the train split at load time
textures          computed from the loaded images (OOD data is usually normalized
                  with the in-distribution dataset's statistics instead)
================  ==========================  ==========================  ===========

The same statistics are used for every split of a dataset.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from posteriorzoo._api import public
from posteriorzoo.data.download import dataset_files, verified_content
from posteriorzoo.data.idx import read_idx_file
from posteriorzoo.data.readers import (
    read_cifar_binary,
    read_dtd_tar,
    read_svhn_mat,
    read_tinyimagenet_zip,
)
from posteriorzoo.data.sources import dataset_source
from posteriorzoo.errors import DataFormatError, InvalidOptionError

__all__ = ["DIGITS_SEED", "DIGITS_TEST_FRACTION", "ArrayDataset", "channel_stats", "load_dataset"]

#: Seed and test fraction of the stratified train/test split of ``digits``.
DIGITS_SEED = 0
DIGITS_TEST_FRACTION = 0.25

_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "tinyimagenet": ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)),
}


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """A labelled image dataset held in memory.

    Attributes
    ----------
    images : numpy.ndarray
        uint8, shape ``(N, C, H, W)``: channel-first, with an explicit channel
        axis even for grayscale (C = 1). Values 0..255.
    labels : numpy.ndarray
        int64, shape ``(N,)``, in ``0 .. num_classes - 1``.
    num_classes : int
    name : str
        Registry name, e.g. ``"cifar10"``.
    split : str
        e.g. ``"train"`` or ``"test"``.
    mean, std : tuple of float
        Per-channel normalization statistics in [0, 1] pixel units, length C
        (see the module docstring for their source).
    class_names : tuple of str or None
        Human-readable class names, index-aligned with the labels, if known.
    """

    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    name: str
    split: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.images, np.ndarray) or self.images.dtype != np.uint8 \
                or self.images.ndim != 4:
            raise DataFormatError(f"{self.name}: images must be uint8 (N, C, H, W), got "
                                  f"{getattr(self.images, 'dtype', type(self.images))} "
                                  f"{getattr(self.images, 'shape', '')}")
        n, c = self.images.shape[:2]
        if self.labels.dtype != np.int64 or self.labels.shape != (n,):
            raise DataFormatError(f"{self.name}: labels must be int64 of shape ({n},), got "
                                  f"{self.labels.dtype} {self.labels.shape}")
        if n and (self.labels.min() < 0 or self.labels.max() >= self.num_classes):
            raise DataFormatError(f"{self.name}: labels outside 0..{self.num_classes - 1}")
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if len(self.mean) != c or len(self.std) != c:
            raise DataFormatError(f"{self.name}: mean/std need {c} channel values")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        c, h, w = self.images.shape[1:]
        return int(c), int(h), int(w)


@public
def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 ``(N, C, H, W)`` images, in [0, 1] units."""
    x = images.astype(np.float64) / 255.0
    return tuple(x.mean(axis=(0, 2, 3))), tuple(x.std(axis=(0, 2, 3)))


#: The prepared digits (resized to 28x28, split) are kept in the cache, one ``.npz`` per
#: version of what makes them: scikit-learn, which load_digits and train_test_split need,
#: takes about a second to import, a tenth of the report on the shipped zoo.
_DIGITS_CACHE_VERSION = 1
_DIGITS_COUNT = 1797
_DIGITS_CACHE_BYTES = 4 << 20   # the prepared arrays take 1.4 MB


#: False while a command promises to write nothing (``train --dry-run``): what it loads
#: is then prepared in memory only.
_CACHE_WRITES = contextvars.ContextVar("posteriorzoo_cache_writes", default=True)


@contextlib.contextmanager
def no_cache_writes() -> Iterator[None]:
    """Within this block, loading a data set leaves the cache folder as it is."""
    token = _CACHE_WRITES.set(False)
    try:
        yield
    finally:
        _CACHE_WRITES.reset(token)


@cache
def _digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    path = _digits_cache_path()
    arrays = _read_prepared_digits(path)
    if arrays is None:
        arrays = _prepare_digits()
        if _CACHE_WRITES.get():
            _write_prepared_digits(path, arrays)
    return arrays


def _prepare_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = torch.from_numpy(bunch.images.astype(np.float32) * (255.0 / 16.0)).unsqueeze(1)
    resized = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    images = resized.round().clamp(0, 255).to(torch.uint8).numpy()
    labels = bunch.target.astype(np.int64)
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)), test_size=DIGITS_TEST_FRACTION, stratify=labels,
        random_state=DIGITS_SEED,
    )
    return images, labels, np.sort(train_idx), np.sort(test_idx)


def _digits_cache_path() -> Path:
    from importlib.metadata import version

    from posteriorzoo.data.download import cache_root

    return cache_root() / "digits" / (
        f"prepared-v{_DIGITS_CACHE_VERSION}-scikit-learn-{version('scikit-learn')}-"
        f"torch-{torch.__version__}.npz")


def _read_prepared_digits(path: Path
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The cached arrays, or None when the file is missing, too large, not an ``.npz``
    of exactly the prepared arrays (shapes, dtypes, labels 0..9, the samples split in
    two), or would need unpickling; such a file is then replaced."""
    try:
        if not path.is_file() or path.stat().st_size > _DIGITS_CACHE_BYTES:
            return None
        with np.load(path, allow_pickle=False) as data:
            if set(data.files) != {"images", "labels", "train", "test"}:
                return None
            images, labels, train, test = (data[key] for key in
                                           ("images", "labels", "train", "test"))
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    count = _DIGITS_COUNT
    split = train.ndim == test.ndim == 1 and train.dtype == test.dtype == np.int64
    valid = (split and images.dtype == np.uint8 and images.shape == (count, 1, 28, 28)
             and labels.dtype == np.int64 and labels.shape == (count,)
             and labels.min() >= 0 and labels.max() <= 9
             and test.size == int(np.ceil(DIGITS_TEST_FRACTION * count))
             and np.array_equal(np.sort(np.r_[train, test]), np.arange(count))
             and (np.diff(train) > 0).all() and (np.diff(test) > 0).all())
    return (images, labels, train, test) if valid else None


def _write_prepared_digits(path: Path, arrays: tuple[np.ndarray, ...]) -> None:
    """The cache file, written under a temporary name and renamed into place; a cache
    that cannot be written is skipped (it only saves time)."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".digits-",
                                         suffix=".tmp", delete=False) as handle:
            temporary = Path(handle.name)
            np.savez(handle, **dict(zip(("images", "labels", "train", "test"), arrays,
                                        strict=True)))
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            temporary.unlink(missing_ok=True)


def _load_digits(split: str) -> ArrayDataset:
    """scikit-learn's 1797 8x8 digits (0..16) as 0..255, bilinearly resized to 28x28.

    Split: stratified by label, 25 % test, seed :data:`DIGITS_SEED`
    (1347 train / 450 test), each in the original order.
    """
    images, labels, train_idx, test_idx = _digits_arrays()
    idx = train_idx if split == "train" else test_idx
    mean, std = channel_stats(images[train_idx])
    return ArrayDataset(images[idx], labels[idx], 10, "digits", split, mean, std,
                        tuple(str(d) for d in range(10)))


def _load_idx_pair(name: str, split: str, files: dict[str, Path]) -> ArrayDataset:
    prefix = "train" if split == "train" else "t10k"
    # Each file is read no further than the published size of its content.
    sizes = {spec.filename: spec.content_size for spec in dataset_source(name).files}
    images_file, labels_file = f"{prefix}-images-idx3-ubyte.gz", f"{prefix}-labels-idx1-ubyte.gz"
    # ... and parsed from the content its check decompressed, where that was kept
    images, labels = (read_idx_file(files[name], sizes.get(name), verified_content(files[name]))
                      for name in (images_file, labels_file))
    if images.ndim != 3 or images.dtype != np.uint8 or labels.shape != images.shape[:1]:
        raise DataFormatError(f"{name}: IDX images {images.dtype} {images.shape} do not pair "
                              f"with labels {labels.shape}")
    mean, std = _STATS[name]
    return ArrayDataset(images[:, None], labels.astype(np.int64), 10, name, split, mean, std)


def _only(files: dict[str, Path]) -> Path:
    (path,) = files.values()
    return path


def _load_cifar(name: str, split: str, files: dict[str, Path],
                label_type: str = "fine") -> ArrayDataset:
    images, labels, names = read_cifar_binary(_only(files), split, name, label_type)
    num_classes = 10 if name == "cifar10" else (100 if label_type == "fine" else 20)
    mean, std = _STATS[name]
    return ArrayDataset(images, labels, num_classes, name, split, mean, std, names)


def _load_svhn(name: str, split: str, files: dict[str, Path]) -> ArrayDataset:
    images, labels, names = read_svhn_mat(_only(files))
    mean, std = _STATS[name]
    return ArrayDataset(images, labels, 10, name, split, mean, std, names)


def _load_tiny(name: str, split: str, files: dict[str, Path]) -> ArrayDataset:
    images, labels, wnids = read_tinyimagenet_zip(_only(files), split)
    mean, std = _STATS[name]
    return ArrayDataset(images, labels, 200, name, split, mean, std, wnids)


def _load_textures(name: str, split: str, files: dict[str, Path],
                   image_size: int = 64, partition: int = 1) -> ArrayDataset:
    images, labels, classes = read_dtd_tar(_only(files), split, partition, image_size)
    mean, std = channel_stats(images) if len(images) else ((0.0,) * 3, (1.0,) * 3)
    # 47 for the real DTD; counted so that a partial archive still gives valid labels.
    return ArrayDataset(images, labels, len(classes), name, split, mean, std, classes)


Loader = Callable[..., ArrayDataset]
_LOADERS: dict[str, tuple[Loader, frozenset[str]]] = {
    "mnist": (_load_idx_pair, frozenset()),
    "fashion-mnist": (_load_idx_pair, frozenset()),
    "cifar10": (_load_cifar, frozenset()),
    "cifar100": (_load_cifar, frozenset({"label_type"})),
    "svhn": (_load_svhn, frozenset()),
    "tinyimagenet": (_load_tiny, frozenset()),
    "textures": (_load_textures, frozenset({"image_size", "partition"})),
}


@public
def load_dataset(
    name: str,
    split: str = "train",
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
    *,
    url_base: str | None = None,
    timeout: float | None = None,
    verify: bool = True,
    **options: Any,
) -> ArrayDataset:
    """Load dataset ``name``'s ``split`` into memory.

    Parameters
    ----------
    name : str
        One of :func:`posteriorzoo.data.available_datasets`: ``cifar10``,
        ``cifar100``, ``digits``, ``fashion-mnist``, ``mnist``, ``svhn``,
        ``textures``, ``tinyimagenet``.
    split : str, default "train"
        ``"train"`` or ``"test"`` for all; also ``"extra"`` for svhn and
        ``"val"`` / ``"all"`` for textures. For tinyimagenet, ``"test"`` is the
        official validation set (the official test set is unlabelled).
        ``digits`` needs no files: data_dir, download etc. are ignored.
    data_dir : str or os.PathLike, optional
        Folder searched first for the dataset's files (see
        :func:`posteriorzoo.data.dataset_files` for the search order).
    download : bool, default True
        Download missing files (SHA-256 verified) into the cache.
    url_base, timeout, verify
        Passed to :func:`posteriorzoo.data.dataset_files`: by default every local
        file is checked against its published digest before it is read.
    **options
        ``cifar100``: ``label_type="fine"`` (100 classes) or ``"coarse"`` (20).
        ``textures``: ``image_size=64`` (pixels, square output),
        ``partition=1`` (official DTD partition 1..10).

    Returns
    -------
    ArrayDataset
        ``images`` uint8 ``(N, C, H, W)``, ``labels`` int64 ``(N,)``.
        Shapes: mnist / fashion-mnist / digits ``(1, 28, 28)``; cifar / svhn
        ``(3, 32, 32)``; tinyimagenet ``(3, 64, 64)``; textures
        ``(3, image_size, image_size)``.

    Raises
    ------
    UnknownNameError
        Unknown ``name``; the message lists the known names.
    ValueError
        Unknown split.
    TypeError
        An option the dataset does not accept.
    DataNotFoundError, ChecksumError, DataFormatError
        Files missing and not downloadable, a wrong digest, a corrupt file.
    """
    source = dataset_source(name)
    if split not in source.splits:
        raise InvalidOptionError(f"dataset {name!r} has no split {split!r}; "
                         f"splits: {', '.join(source.splits)}")
    if name == "digits":
        loader, accepted = None, frozenset()
    else:
        loader, accepted = _LOADERS[name]
    unexpected = set(options) - accepted
    if unexpected:
        allowed = ", ".join(sorted(accepted)) or "none"
        raise InvalidOptionError(f"dataset {name!r} got unexpected option(s) "
                        f"{', '.join(sorted(unexpected))}; accepted: {allowed}")
    if loader is None:
        return _load_digits(split)
    files = dataset_files(name, split, data_dir, download, url_base=url_base,
                          timeout=timeout, verify=verify)
    return loader(name, split, files, **options)
