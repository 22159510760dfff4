"""Readers for the archive formats of CIFAR, SVHN, Tiny ImageNet and DTD.

Every reader returns ``(images, labels, class_names)`` with ``images`` uint8 of
shape ``(N, C, H, W)``, ``labels`` int64 of shape ``(N,)`` and ``class_names``
a tuple of str (or ``None``). Archives are read in place, without extracting
them, and only from their documented binary layouts: no pickle anywhere.

Every archive member is bounded before it is decompressed: by the size of the
dataset's own member (a CIFAR batch), else by :data:`MAX_IMAGE_BYTES` for an image
and :data:`MAX_TEXT_BYTES` for a list of names; an image's pixels are bounded by
:data:`MAX_IMAGE_PIXELS` before it is decoded.
"""

from __future__ import annotations

import io
import re
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from posteriorzoo.errors import DataFormatError, InvalidOptionError

__all__ = [
    "Arrays",
    "fit_square",
    "read_cifar_binary",
    "read_dtd_tar",
    "read_svhn_mat",
    "read_tinyimagenet_zip",
]

Arrays = tuple[np.ndarray, np.ndarray, tuple[str, ...] | None]

_CIFAR_PIXELS = 3 * 32 * 32
#: Records in each CIFAR binary batch file (``data_batch_N.bin``, ``test_batch.bin``,
#: CIFAR-100's ``train.bin`` and ``test.bin``).
_CIFAR_RECORDS = {"data_batch": 10_000, "test_batch": 10_000, "train": 50_000, "test": 10_000}
#: Largest image file read from an archive (Tiny ImageNet and DTD JPEGs are far smaller).
MAX_IMAGE_BYTES = 16 * 2**20
#: Largest text member read from an archive (class names, split lists, annotations).
MAX_TEXT_BYTES = 16 * 2**20
#: Most pixels an image may declare before it is decoded (4096 x 4096).
MAX_IMAGE_PIXELS = 2**24
# Archive readers fail in many ways on a truncated or foreign file; all mean "bad file".
# (NotImplementedError: a v7.3 / HDF5 .mat; scipy's MatReadError, "not a MATLAB file", is
# added by _archive_errors once a .mat is read: scipy.io is imported only then.)
_ARCHIVE_ERRORS = (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, OSError,
                   UnidentifiedImageError, Image.DecompressionBombError, KeyError, ValueError,
                   NotImplementedError)


def _archive_errors() -> tuple[type[BaseException], ...]:
    """:data:`_ARCHIVE_ERRORS`, with scipy's MatReadError where scipy.io is loaded."""
    import sys

    matlab = sys.modules.get("scipy.io.matlab")
    return _ARCHIVE_ERRORS + ((matlab.MatReadError,) if matlab is not None else ())


@contextmanager
def _format_errors(path: Path, what: str) -> Iterator[None]:
    try:
        yield
    except DataFormatError:
        raise
    except FileNotFoundError:
        raise
    except _archive_errors() as exc:
        raise DataFormatError(f"{path}: not a readable {what} ({type(exc).__name__}: {exc})") \
            from exc


def _check_member_size(path: Path, name: str, size: int, limit: int) -> None:
    if size > limit:
        raise DataFormatError(f"{path}: member {name[:200]!r} declares {size} bytes, more "
                              f"than the {limit} it may hold")


def _tar_members(path: Path, want: Callable[[str], bool],
                 limit: Callable[[str], int]) -> dict[str, bytes]:
    """Contents of the regular members whose name satisfies ``want``, in one pass; a
    wanted member is refused, before it is decompressed, if it declares more bytes than
    ``limit(name)``."""
    out = {}
    # Streaming mode ("r|*"): gzip cannot seek backwards, so read everything in order.
    with tarfile.open(path, mode="r|*") as tar:
        for member in tar:
            if member.isfile() and want(member.name):
                _check_member_size(path, member.name, member.size, limit(member.name))
                out[member.name] = tar.extractfile(member).read(member.size)
    return out


def _names_file(blob: bytes | None) -> tuple[str, ...] | None:
    if blob is None:
        return None
    return tuple(line.strip() for line in blob.decode("utf-8").splitlines() if line.strip())


def _parse_cifar_records(path: Path, blob: bytes, label_bytes: int,
                         label_index: int) -> tuple[np.ndarray, np.ndarray]:
    record = label_bytes + _CIFAR_PIXELS
    if len(blob) % record:
        raise DataFormatError(
            f"{path}: CIFAR binary batch of {len(blob)} bytes is not a whole number of "
            f"{record}-byte records"
        )
    rows = np.frombuffer(blob, dtype=np.uint8).reshape(-1, record)
    labels = rows[:, label_index].astype(np.int64)
    images = rows[:, label_bytes:].reshape(-1, 3, 32, 32).copy()
    return images, labels


def read_cifar_binary(path: str | Path, split: str, variant: str = "cifar10",
                      label_type: str = "fine") -> Arrays:
    """Read CIFAR-10 or CIFAR-100 from the official *binary* ``.tar.gz``.

    Parameters
    ----------
    path : str or pathlib.Path
        ``cifar-10-binary.tar.gz`` or ``cifar-100-binary.tar.gz``.
    split : {"train", "test"}
    variant : {"cifar10", "cifar100"}
    label_type : {"fine", "coarse"}
        CIFAR-100 only: 100 fine classes or 20 superclasses.

    Returns
    -------
    images : numpy.ndarray
        uint8, shape ``(N, 3, 32, 32)`` (N = 50000 train, 10000 test).
    labels : numpy.ndarray
        int64, shape ``(N,)``.
    class_names : tuple of str or None
        From the archive's ``*.txt`` label-name files, when present.

    Raises
    ------
    DataFormatError
        Not a tar archive, a batch missing, or a batch of the wrong size.
    """
    path = Path(path)
    if variant == "cifar10":
        batches = [f"data_batch_{i}.bin" for i in range(1, 6)] if split == "train" \
            else ["test_batch.bin"]
        label_bytes, label_index, names_file = 1, 0, "batches.meta.txt"
    elif variant == "cifar100":
        batches = ["train.bin" if split == "train" else "test.bin"]
        if label_type not in ("fine", "coarse"):
            raise InvalidOptionError(f"label_type must be 'fine' or 'coarse', not {label_type!r}")
        label_bytes, label_index = 2, (1 if label_type == "fine" else 0)
        names_file = f"{label_type}_label_names.txt"
    else:
        raise InvalidOptionError(f"unknown CIFAR variant {variant!r}")

    wanted = set(batches) | {names_file}
    record = label_bytes + _CIFAR_PIXELS

    def limit(name: str) -> int:
        base = name.rsplit("/", 1)[-1]
        if base == names_file:
            return MAX_TEXT_BYTES
        return _CIFAR_RECORDS[base.removesuffix(".bin").rstrip("_0123456789")] * record

    with _format_errors(path, "CIFAR binary tar archive"):
        members = _tar_members(path, lambda n: n.rsplit("/", 1)[-1] in wanted, limit)
    by_base = {name.rsplit("/", 1)[-1]: blob for name, blob in members.items()}
    absent = [b for b in batches if b not in by_base]
    if absent:
        raise DataFormatError(f"{path}: archive lacks {', '.join(absent)}")
    parts = [_parse_cifar_records(path, by_base[b], label_bytes, label_index) for b in batches]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return images, labels, _names_file(by_base.get(names_file))


def read_svhn_mat(path: str | Path) -> Arrays:
    """Read an SVHN cropped-digits ``*_32x32.mat`` file (MATLAB v5, via scipy).

    Parameters
    ----------
    path : str or pathlib.Path
        ``train_32x32.mat``, ``test_32x32.mat`` or ``extra_32x32.mat``.

    Returns
    -------
    images : numpy.ndarray
        uint8, shape ``(N, 3, 32, 32)``; the file stores ``X`` as ``(32, 32, 3, N)``.
    labels : numpy.ndarray
        int64, shape ``(N,)``, in 0..9: the file's label 10 (digit "0") maps to 0.
    class_names : tuple of str
        ``("0", ..., "9")``.

    Raises
    ------
    DataFormatError
        Not a MATLAB file, or ``X``/``y`` missing or of unexpected shape or range.
    """
    import scipy.io  # here: it would add 0.13 s to every import of posteriorzoo.data

    path = Path(path)
    with _format_errors(path, "SVHN MATLAB file"):
        mat = scipy.io.loadmat(path, variable_names=["X", "y"])
        x, y = mat["X"], np.asarray(mat["y"]).reshape(-1)
    if x.ndim != 4 or x.shape[2] != 3 or x.shape[3] != y.shape[0] or x.dtype != np.uint8:
        raise DataFormatError(
            f"{path}: expected X uint8 of shape (H, W, 3, N) and N labels, got X "
            f"{x.dtype} {x.shape} and {y.shape[0]} labels"
        )
    if y.size and (y.min() < 1 or y.max() > 10):
        raise DataFormatError(f"{path}: SVHN labels must lie in 1..10, found {y.min()}..{y.max()}")
    images = np.ascontiguousarray(x.transpose(3, 2, 0, 1))
    labels = (y.astype(np.int64) % 10)
    return images, labels, tuple(str(d) for d in range(10))


def _decode_rgb(data: bytes, draft_size: int | None = None) -> Image.Image:
    image = Image.open(io.BytesIO(data))  # reads the header only
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:  # reported with the archive's name
        raise ValueError(f"an image of {width}x{height} pixels, more than the "
                         f"{MAX_IMAGE_PIXELS} an image may have")
    if draft_size is not None:
        # JPEG only: decode at a reduced scale (still >= draft_size), several times faster.
        image.draft("RGB", (draft_size, draft_size))
    return image.convert("RGB")


def read_tinyimagenet_zip(path: str | Path, split: str) -> Arrays:
    """Read Tiny ImageNet from the official ``tiny-imagenet-200.zip``.

    Parameters
    ----------
    path : str or pathlib.Path
        The zip file, with ``<root>/wnids.txt``,
        ``<root>/train/<wnid>/images/*.JPEG`` and ``<root>/val/images/*.JPEG``
        described by ``<root>/val/val_annotations.txt``.
    split : {"train", "test"}
        ``"test"`` reads the official *val* set: the official test set has no
        labels.

    Returns
    -------
    images : numpy.ndarray
        uint8, shape ``(N, 3, 64, 64)`` (N = 100000 train, 10000 test);
        grayscale JPEGs are converted to RGB.
    labels : numpy.ndarray
        int64, shape ``(N,)``: index of the WordNet id in the sorted ``wnids``.
    class_names : tuple of str
        The 200 WordNet ids, sorted.

    Raises
    ------
    DataFormatError
        Missing ``wnids.txt`` or annotations, an unknown wnid, an image that
        cannot be decoded or is not 64x64.
    """
    path = Path(path)
    with _format_errors(path, "Tiny ImageNet zip"), zipfile.ZipFile(path) as zf:
        names = zf.namelist()

        def read(member: str, limit: int) -> bytes:
            # zipfile decompresses no further than the size the entry declares.
            _check_member_size(path, member, zf.getinfo(member).file_size, limit)
            return zf.read(member)

        wnid_files = [n for n in names if n.rsplit("/", 1)[-1] == "wnids.txt"]
        if not wnid_files:
            raise DataFormatError(f"{path}: no wnids.txt in the archive")
        root = wnid_files[0][: -len("wnids.txt")]
        wnids = tuple(sorted(_names_file(read(wnid_files[0], MAX_TEXT_BYTES)) or ()))
        index = {w: i for i, w in enumerate(wnids)}
        if split == "train":
            pattern = re.compile(re.escape(root) + r"train/([^/]+)/images/[^/]+\.jpe?g$", re.I)
            items = [(n, m.group(1)) for n in sorted(names) if (m := pattern.match(n))]
        else:
            annotations = read(root + "val/val_annotations.txt", MAX_TEXT_BYTES)
            lines = annotations.decode("utf-8").splitlines()
            items = [(root + "val/images/" + f[0], f[1])
                     for f in (line.split("\t") for line in lines if line.strip())]
        unknown = {w for _, w in items if w not in index}
        if unknown:
            raise DataFormatError(f"{path}: labels not in wnids.txt: {sorted(unknown)[:5]}")
        images = np.empty((len(items), 3, 64, 64), dtype=np.uint8)
        for i, (member, _) in enumerate(items):
            pixels = np.asarray(_decode_rgb(read(member, MAX_IMAGE_BYTES)))
            if pixels.shape != (64, 64, 3):
                raise DataFormatError(f"{path}: {member} is {pixels.shape[1]}x"
                                      f"{pixels.shape[0]}, expected 64x64")
            images[i] = pixels.transpose(2, 0, 1)
    labels = np.array([index[w] for _, w in items], dtype=np.int64)
    return images, labels, wnids


def fit_square(image: Image.Image, size: int) -> Image.Image:
    """Resize so the shorter side is ``size`` (bilinear), then center-crop to square.

    Parameters
    ----------
    image : PIL.Image.Image
    size : int
        Side of the output in pixels.

    Returns
    -------
    PIL.Image.Image
        ``size`` x ``size``, same mode as the input.
    """
    w, h = image.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    image = image.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    return image.crop((left, top, left + size, top + size))


def read_dtd_tar(path: str | Path, split: str, partition: int = 1,
                 image_size: int = 64) -> Arrays:
    """Read the Describable Textures Dataset from ``dtd-r1.0.1.tar.gz``.

    Parameters
    ----------
    path : str or pathlib.Path
        The tarball, with ``dtd/images/<class>/<file>.jpg`` and
        ``dtd/labels/{train,val,test}<partition>.txt``.
    split : {"train", "val", "test", "all"}
        One of the official splits of ``partition``, or every image.
    partition : int, default 1
        Official partition 1..10 (ignored for ``"all"``).
    image_size : int, default 64
        Every image is resized (shorter side to ``image_size``, bilinear, after
        JPEG draft-mode decoding at a reduced scale) and center-cropped to
        ``image_size`` x ``image_size``.

    Returns
    -------
    images : numpy.ndarray
        uint8, shape ``(N, 3, image_size, image_size)``; N = 1880 per split of
        a partition, 5640 for ``"all"``.
    labels : numpy.ndarray
        int64, shape ``(N,)``, index into ``class_names``.
    class_names : tuple of str
        The 47 texture classes, sorted.

    Raises
    ------
    DataFormatError
        Not a tar archive, a split list missing, or a listed image absent.
    """
    path = Path(path)
    if not 1 <= int(partition) <= 10:
        raise InvalidOptionError(f"DTD partition must be in 1..10, not {partition}")
    if int(image_size) < 1:
        raise InvalidOptionError(f"image_size must be positive, not {image_size}")
    image_re = re.compile(r"(?:^|/)images/([^/]+/[^/]+\.jpe?g)$", re.I)
    list_name = f"labels/{split}{partition}.txt"
    decoded: dict[str, np.ndarray] = {}
    split_list: bytes | None = None
    # One streaming pass decoding every image: the label lists come after the images
    # in the tarball, and holding ~600 MB of JPEG bytes instead would cost far more.
    with _format_errors(path, "DTD tar archive"), tarfile.open(path, mode="r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            if m := image_re.search(member.name):
                _check_member_size(path, member.name, member.size, MAX_IMAGE_BYTES)
                data = tar.extractfile(member).read(member.size)
                image = fit_square(_decode_rgb(data, image_size), image_size)
                decoded[m.group(1)] = np.asarray(image).transpose(2, 0, 1)
            elif member.name.endswith(list_name) and split != "all":
                _check_member_size(path, member.name, member.size, MAX_TEXT_BYTES)
                split_list = tar.extractfile(member).read(member.size)
    if split == "all":
        keys = sorted(decoded)
    elif split_list is None:
        raise DataFormatError(f"{path}: archive lacks {list_name}")
    else:
        keys = list(_names_file(split_list) or ())
    absent = [k for k in keys if k not in decoded]
    if absent:
        raise DataFormatError(f"{path}: images listed but absent: {absent[:5]}")
    classes = tuple(sorted({k.split("/")[0] for k in decoded}))
    index = {c: i for i, c in enumerate(classes)}
    images = np.empty((len(keys), 3, image_size, image_size), dtype=np.uint8)
    for i, k in enumerate(keys):
        images[i] = decoded[k]
    labels = np.array([index[k.split("/")[0]] for k in keys], dtype=np.int64)
    return images, labels, classes
