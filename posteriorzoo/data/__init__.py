"""Datasets by name: IDX reader, SHA-256-verified downloads, batch transforms.

>>> from posteriorzoo.data import load_dataset, iterate_batches, Compose, RandomCrop
>>> train = load_dataset("digits")                 # always available offline
>>> train.images.shape, train.images.dtype
((1347, 1, 28, 28), dtype('uint8'))

Modules: :mod:`~posteriorzoo.data.idx` (IDX files), :mod:`~posteriorzoo.data.sources`
(URLs and digests), :mod:`~posteriorzoo.data.download` (search order, downloads),
:mod:`~posteriorzoo.data.readers` (CIFAR, SVHN, Tiny ImageNet, DTD formats),
:mod:`~posteriorzoo.data.datasets` (``load_dataset``),
:mod:`~posteriorzoo.data.transforms` and :mod:`~posteriorzoo.data.batches`.
"""

from posteriorzoo.data.batches import epoch_generators, epoch_order, iterate_batches
from posteriorzoo.data.datasets import ArrayDataset, channel_stats, load_dataset
from posteriorzoo.data.download import (
    cache_root,
    dataset_files,
    download_file,
    file_sha256,
    search_dirs,
)
from posteriorzoo.data.idx import read_idx, write_idx
from posteriorzoo.data.sources import (
    DatasetSource,
    DownloadFile,
    available_datasets,
    dataset_source,
)
from posteriorzoo.data.transforms import Compose, Normalize, RandomCrop, RandomHorizontalFlip

__all__ = [
    "ArrayDataset",
    "Compose",
    "DatasetSource",
    "DownloadFile",
    "Normalize",
    "RandomCrop",
    "RandomHorizontalFlip",
    "available_datasets",
    "cache_root",
    "channel_stats",
    "dataset_files",
    "dataset_source",
    "download_file",
    "epoch_generators",
    "epoch_order",
    "file_sha256",
    "iterate_batches",
    "load_dataset",
    "read_idx",
    "search_dirs",
    "write_idx",
]
