"""Where each dataset's files come from, and their published SHA-256 digests.

Digest sources (all ``sha256`` values below are of the file exactly as served):

- mnist, fashion-mnist, cifar10 (binary), cifar100 (binary), svhn, textures (DTD):
  tensorflow/datasets ``tensorflow_datasets/url_checksums/{mnist,fashion_mnist,
  cifar10,cifar100,svhn_cropped,dtd}.txt``, for the same URLs (MNIST: the
  ``cvdf-datasets`` mirror, byte-identical by size to the original files).
- tinyimagenet: tensorflow/datasets ``url_checksums/tiny_imagenet.txt`` (from a
  tiny_imagenet contribution), agreeing with several independent projects that
  pin the same digest for ``tiny-imagenet-200.zip`` of 248,100,043 bytes.
- fashion-mnist ``content_sha256``: SHA-256 of the *decompressed* IDX files.
  Debian's ``dataset-fashion-mnist`` re-wrote the gzip headers (file name
  dropped), so its ``.gz`` files differ from the official ones although the
  compressed stream is the same: re-inserting the original name and timestamp
  (2017-08-31) into Debian's headers reproduces the official digests exactly.
  The content digests let :func:`posteriorzoo.data.dataset_files` with
  ``verify=True`` accept both. The test split shipped in the package
  (``posteriorzoo/data/bundled/fashion-mnist/``) is Debian's with those headers
  restored (name and time 1504176627, 2017-08-31 10:50:27 UTC), so it has the
  digests of the files as served.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from posteriorzoo._api import public
from posteriorzoo.errors import UnknownNameError

__all__ = [
    "DatasetSource",
    "DownloadFile",
    "available_datasets",
    "dataset_source",
]


@dataclass(frozen=True)
class DownloadFile:
    """One downloadable file.

    Attributes
    ----------
    filename : str
        Name of the file on disk and the last URL component.
    urls : tuple of str
        Official URL and mirrors, tried in order.
    sha256 : str or None
        Hex SHA-256 of the file as served; ``None`` when no trustworthy digest
        is known, in which case the file is never downloaded automatically.
    size : int or None
        Size in bytes as served, for messages and progress bars.
    aliases : tuple of str
        Other names under which a local copy is accepted (e.g. the
        decompressed ``train-images-idx3-ubyte`` for an IDX ``.gz``).
    content_sha256 : str or None
        For gzipped files: SHA-256 of the decompressed content, which stays the
        same when a distribution re-compresses the file.
    content_size : int or None
        For gzipped files: bytes of the decompressed content. Decompressing a local
        copy (to check its content digest, or to read it) stops there, so a file
        that expands further (a decompression bomb) is refused, never inflated.
    """

    filename: str
    urls: tuple[str, ...]
    sha256: str | None
    size: int | None = None
    aliases: tuple[str, ...] = ()
    content_sha256: str | None = None
    content_size: int | None = None


@dataclass(frozen=True)
class DatasetSource:
    """The files of one dataset, per split.

    Attributes
    ----------
    name : str
        Registry name, also the sub-folder searched under data roots.
    splits : Mapping[str, tuple of DownloadFile]
        Files needed to load each split (read-only).
    description : str
        One line for listings.
    """

    name: str
    splits: Mapping[str, tuple[DownloadFile, ...]]
    description: str
    files: tuple[DownloadFile, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "splits", MappingProxyType(dict(self.splits)))
        unique = {f.filename: f for files in self.splits.values() for f in files}
        object.__setattr__(self, "files", tuple(unique.values()))


#: Items in each IDX file of MNIST and Fashion-MNIST (their layouts are the same).
_IDX_ITEMS = {"train": 60_000, "t10k": 10_000}


def _idx_content_size(filename: str) -> int:
    """Bytes of a decompressed MNIST-layout IDX file: the header (4-byte magic and one
    4-byte size per dimension), then one byte per label or 28 x 28 bytes per image."""
    items = _IDX_ITEMS[filename.split("-")[0]]
    if "-images-" in filename:
        return 4 + 3 * 4 + items * 28 * 28
    return 4 + 4 + items


def _idx(base_urls: tuple[str, ...], filename: str, sha256: str, size: int,
         content_sha256: str | None = None) -> DownloadFile:
    return DownloadFile(
        filename=filename,
        urls=tuple(base + filename for base in base_urls),
        sha256=sha256,
        size=size,
        aliases=(filename.removesuffix(".gz"),),
        content_sha256=content_sha256,
        content_size=_idx_content_size(filename),
    )


_MNIST_BASES = (
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
# The S3 *website* endpoint serves plain HTTP only; the digest protects the content.
_FASHION_BASES = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",)
_SVHN = "http://ufldl.stanford.edu/housenumbers/"

_MNIST_FILES = {
    "train": (
        _idx(_MNIST_BASES, "train-images-idx3-ubyte.gz",
             "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609", 9912422),
        _idx(_MNIST_BASES, "train-labels-idx1-ubyte.gz",
             "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c", 28881),
    ),
    "test": (
        _idx(_MNIST_BASES, "t10k-images-idx3-ubyte.gz",
             "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6", 1648877),
        _idx(_MNIST_BASES, "t10k-labels-idx1-ubyte.gz",
             "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6", 4542),
    ),
}

_FASHION_FILES = {
    "train": (
        _idx(_FASHION_BASES, "train-images-idx3-ubyte.gz",
             "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84", 26421880,
             "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"),
        _idx(_FASHION_BASES, "train-labels-idx1-ubyte.gz",
             "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845", 29515,
             "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"),
    ),
    "test": (
        _idx(_FASHION_BASES, "t10k-images-idx3-ubyte.gz",
             "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073", 4422102,
             "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"),
        _idx(_FASHION_BASES, "t10k-labels-idx1-ubyte.gz",
             "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5", 5148,
             "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"),
    ),
}

_CIFAR10 = DownloadFile(
    "cifar-10-binary.tar.gz",
    ("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",),
    "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
    170052171,
)
_CIFAR100 = DownloadFile(
    "cifar-100-binary.tar.gz",
    ("https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",),
    "58a81ae192c23a4be8b1804d68e518ed807d710a4eb253b1f2a199162a40d8ec",
    168513733,
)
_SVHN_FILES = {
    "train": (DownloadFile("train_32x32.mat", (_SVHN + "train_32x32.mat",),
                       "435e94d69a87fde4fd4d7f3dd208dfc32cb6ae8af2240d066de1df7508d083b8",
                       182040794),),
    "test": (DownloadFile("test_32x32.mat", (_SVHN + "test_32x32.mat",),
                      "cdce80dfb2a2c4c6160906d0bd7c68ec5a99d7ca4831afa54f09182025b6a75b",
                      64275384),),
    "extra": (DownloadFile("extra_32x32.mat", (_SVHN + "extra_32x32.mat",),
                       "a133a4beb38a00fcdda90c9489e0c04f900b660ce8a316a5e854838379a71eb3",
                       1329278602),),
}
_TINY = DownloadFile(
    "tiny-imagenet-200.zip",
    ("http://cs231n.stanford.edu/tiny-imagenet-200.zip",),
    "6198c8ae015e2b3e007c7841da39ec069199b9aa3bfa943a462022fe5e43c821",
    248100043,
)
_DTD = DownloadFile(
    "dtd-r1.0.1.tar.gz",
    ("https://www.robots.ox.ac.uk/~vgg/data/dtd/download/dtd-r1.0.1.tar.gz",),
    "e42855a52a4950a3b59612834602aa253914755c95b0cff9ead6d07395f8e205",
    625239812,
)

_SOURCES: dict[str, DatasetSource] = {
    s.name: s
    for s in (
        DatasetSource("mnist", _MNIST_FILES, "MNIST handwritten digits, 28x28 grayscale"),
        DatasetSource("fashion-mnist", _FASHION_FILES, "Fashion-MNIST, 28x28 grayscale"),
        DatasetSource("cifar10", {"train": (_CIFAR10,), "test": (_CIFAR10,)},
                      "CIFAR-10, 32x32 RGB, binary version"),
        DatasetSource("cifar100", {"train": (_CIFAR100,), "test": (_CIFAR100,)},
                      "CIFAR-100, 32x32 RGB, binary version (fine or coarse labels)"),
        DatasetSource("svhn", _SVHN_FILES, "SVHN cropped digits, 32x32 RGB"),
        DatasetSource("tinyimagenet", {"train": (_TINY,), "test": (_TINY,)},
                      "Tiny ImageNet (200 classes), 64x64 RGB; test = official val"),
        DatasetSource("textures",
                      {s: (_DTD,) for s in ("train", "val", "test", "all")},
                      "Describable Textures Dataset (DTD, 47 classes), resized RGB"),
        DatasetSource("digits", {"train": (), "test": ()},
                      "scikit-learn's bundled 8x8 digits, resized to 28x28 (offline)"),
    )
}


@public
def available_datasets() -> list[str]:
    """Names accepted by :func:`posteriorzoo.data.load_dataset`, sorted.

    Returns
    -------
    list of str
    """
    return sorted(_SOURCES)


@public
def dataset_source(name: str) -> DatasetSource:
    """The :class:`DatasetSource` registered under ``name``.

    Raises
    ------
    UnknownNameError
        ``name`` is not registered; the message lists the known names.
    """
    try:
        return _SOURCES[name]
    except KeyError:
        known = ", ".join(available_datasets())
        raise UnknownNameError(f"unknown dataset {name!r}; known datasets: {known}") from None
