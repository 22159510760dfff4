"""Tests of posteriorzoo.data: IDX files, file search and downloads, loaders, transforms."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import json
import os
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image
from rounding_bounds import U32, U64, gamma

import posteriorzoo.data.download as download_module
from posteriorzoo.data import (
    ArrayDataset,
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    available_datasets,
    cache_root,
    dataset_files,
    dataset_source,
    download_file,
    epoch_generators,
    file_sha256,
    iterate_batches,
    load_dataset,
    read_idx,
    search_dirs,
    write_idx,
)
from posteriorzoo.data import sources as sources_module
from posteriorzoo.data.datasets import _digits_arrays
from posteriorzoo.data.readers import fit_square
from posteriorzoo.data.sources import DatasetSource, DownloadFile
from posteriorzoo.errors import (
    ChecksumError,
    DataFormatError,
    DataNotFoundError,
    InvalidOptionError,
    UnknownNameError,
)

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
HAVE_FASHION = (FASHION_DIR / "train-images-idx3-ubyte.gz").is_file()
needs_fashion = pytest.mark.skipif(
    not HAVE_FASHION,
    reason=f"Debian's dataset-fashion-mnist files are not installed in {FASHION_DIR}",
)


@pytest.fixture(autouse=True)
def isolated_data_env(tmp_path, monkeypatch):
    """Every test starts with empty data roots, so no real cache or env var leaks in."""
    for var in ("POSTERIORZOO_DATA", "POSTERIORZOO_URL_BASE", "POSTERIORZOO_DOWNLOAD_TIMEOUT",
                "POSTERIORZOO_SYSTEM_DATA", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("POSTERIORZOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(download_module, "DEBIAN_ROOT", tmp_path / "debian")
    monkeypatch.setattr(download_module, "BUNDLED_ROOT", tmp_path / "bundled")
    return tmp_path


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


@pytest.fixture
def http_root(tmp_path):
    """A loopback HTTP server in a thread; yields (folder served, base URL)."""
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # A short poll interval keeps shutdown (and so each test's teardown) quick.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- IDX


IDX_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64]


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("dtype", IDX_DTYPES, ids=lambda d: np.dtype(d).name)
def test_idx_round_trip(tmp_path, dtype, compress):
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
    if info is not None:
        array = rng.integers(info.min, info.max, size=(4, 3, 5), endpoint=True, dtype=dtype)
    else:
        array = rng.standard_normal((4, 3, 5)).astype(dtype)
    path = write_idx(tmp_path / "a.idx", array, gzip=compress)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == compress
    back = read_idx(path)
    assert back.dtype == np.dtype(dtype) and back.dtype.isnative
    assert back.shape == (4, 3, 5)
    np.testing.assert_array_equal(back, array)
    back[0, 0, 0] = 1  # writable, not a view of an immutable buffer


def test_idx_known_bytes(tmp_path):
    # Hand-written big-endian int16 file: header 00 00 0B 01, dim 3, values 258, -2, 1.
    raw = b"\x00\x00\x0b\x01" + b"\x00\x00\x00\x03" + b"\x01\x02\xff\xfe\x00\x01"
    (tmp_path / "plain.gz").write_bytes(raw)  # a .gz name does not make it gzip
    (tmp_path / "zipped").write_bytes(gzip.compress(raw))  # nor does its absence hide gzip
    for name in ("plain.gz", "zipped"):
        out = read_idx(tmp_path / name)
        assert out.dtype == np.int16
        np.testing.assert_array_equal(out, [258, -2, 1])
    # And the writer produces exactly the documented header.
    write_idx(tmp_path / "w", np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint8))
    assert (tmp_path / "w").read_bytes() == (
        b"\x00\x00\x08\x02\x00\x00\x00\x02\x00\x00\x00\x03" + bytes([1, 2, 3, 4, 5, 6])
    )
    write_idx(tmp_path / "f", np.array([1.5], dtype=np.float32))
    assert (tmp_path / "f").read_bytes()[2] == 0x0D
    assert (tmp_path / "f").read_bytes()[-4:] == struct.pack(">f", 1.5)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x01\x00\x08\x01\x00\x00\x00\x02ab", "not an IDX file"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x02ab", "unknown IDX type code 0x07"),
        (b"\x00\x00\x08\x02\x00\x00\x00\x02", "truncated IDX header"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x05abc", "truncated"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x02abc", "trailing bytes"),
        (b"\x00\x00", "not an IDX file"),
    ],
    ids=["bad-magic", "bad-type", "short-header", "short-payload", "long-payload", "tiny"],
)
def test_idx_rejects_bad_files(tmp_path, content, message):
    path = tmp_path / "bad-file.idx"
    path.write_bytes(content)
    with pytest.raises(DataFormatError, match=message) as info:
        read_idx(path)
    assert "bad-file.idx" in str(info.value)


def test_idx_truncated_gzip(tmp_path):
    path = write_idx(tmp_path / "labels.gz", np.arange(1000, dtype=np.int32), gzip=True)
    path.write_bytes(path.read_bytes()[:-30])
    with pytest.raises(DataFormatError, match="labels.gz"):
        read_idx(path)


def test_write_idx_rejects_int64(tmp_path):
    with pytest.raises(DataFormatError, match="int64"):
        write_idx(tmp_path / "x", np.zeros(3, dtype=np.int64))


# ------------------------------------------------------------------- registry


def test_registry_names_and_unknown_name():
    assert available_datasets() == [
        "cifar10", "cifar100", "digits", "fashion-mnist", "mnist", "svhn", "textures",
        "tinyimagenet",
    ]
    with pytest.raises(UnknownNameError, match="cifar10, cifar100, digits") as info:
        load_dataset("imagenet")
    assert isinstance(info.value, KeyError)
    with pytest.raises(InvalidOptionError, match="no split 'valid'"):
        load_dataset("digits", "valid")
    with pytest.raises(InvalidOptionError, match="image_size"):
        load_dataset("cifar10", image_size=32)


def test_every_downloadable_file_has_a_digest_and_url():
    for name in available_datasets():
        for spec in dataset_source(name).files:
            assert spec.sha256 is not None and len(spec.sha256) == 64, spec
            assert spec.urls and all(u.endswith("/" + spec.filename) for u in spec.urls)


# --------------------------------------------------------------- search order


def _fake_mnist_dir(folder: Path, label: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for prefix in ("train", "t10k"):
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz",
                  np.full((2, 28, 28), label, np.uint8), gzip=True)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz",
                  np.full(2, label, np.uint8), gzip=True)


def test_search_order(isolated_data_env, monkeypatch):
    root = isolated_data_env
    explicit, env, debian, cache = (root / "explicit", root / "env", root / "debian",
                                    root / "cache")
    monkeypatch.setenv("POSTERIORZOO_DATA", str(env))
    _fake_mnist_dir(explicit, 1)
    _fake_mnist_dir(env / "mnist", 2)
    _fake_mnist_dir(debian / "mnist", 3)
    _fake_mnist_dir(cache / "mnist", 4)
    assert search_dirs("mnist", explicit) == [explicit, env / "mnist", debian / "mnist",
                                              cache / "mnist"]

    def label_loaded(**kw):
        return int(load_dataset("mnist", "train", download=False, verify=False, **kw).labels[0])

    assert label_loaded(data_dir=explicit) == 1
    assert label_loaded() == 2  # no data_dir: the environment variable wins
    monkeypatch.delenv("POSTERIORZOO_DATA")
    assert label_loaded() == 3  # then Debian's folder
    monkeypatch.setattr(download_module, "DEBIAN_ROOT", root / "nowhere")
    assert label_loaded() == 4  # then the cache
    paths = dataset_files("mnist", "test", download=False, verify=False)
    assert set(paths) == {"t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}
    assert all(p.parent == cache / "mnist" for p in paths.values())


def test_search_accepts_decompressed_alias(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    write_idx(folder / "t10k-images-idx3-ubyte", np.full((3, 28, 28), 7, np.uint8))
    write_idx(folder / "t10k-labels-idx1-ubyte", np.array([1, 2, 3], np.uint8))
    # MNIST publishes no digest of its decompressed files: used, with a warning each
    with pytest.warns(UserWarning, match="no published digest of the decompressed") as seen:
        ds = load_dataset("mnist", "test", data_dir=folder, download=False)
    assert len(seen) == 2
    assert ds.images.shape == (3, 1, 28, 28) and ds.labels.tolist() == [1, 2, 3]
    assert ds.labels.dtype == np.int64 and ds.mean == (0.1307,)


def test_cache_root_precedence(monkeypatch, tmp_path):
    assert cache_root() == tmp_path / "cache"
    monkeypatch.delenv("POSTERIORZOO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "posteriorzoo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "posteriorzoo"


def test_missing_without_download_names_files_and_folder(tmp_path):
    with pytest.raises(DataNotFoundError) as info:
        dataset_files("cifar10", "train", download=False)
    message = str(info.value)
    assert "cifar-10-binary.tar.gz" in message
    assert str(tmp_path / "cache" / "cifar10") in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz" in message
    assert isinstance(info.value, FileNotFoundError)


# ------------------------------------------------------------------ downloads


def test_download_file_correct_digest(http_root, tmp_path):
    served, base = http_root
    payload = bytes(range(256)) * 50
    (served / "blob.bin").write_bytes(payload)
    dest = tmp_path / "out" / "blob.bin"
    assert download_file(f"{base}/blob.bin", dest, _sha(payload), progress=False) == dest
    assert dest.read_bytes() == payload
    assert sorted(p.name for p in dest.parent.iterdir()) == ["blob.bin"]
    assert file_sha256(dest) == _sha(payload)


def test_download_file_wrong_digest_leaves_nothing(http_root, tmp_path):
    served, base = http_root
    (served / "blob.bin").write_bytes(b"not what was published")
    dest = tmp_path / "out" / "blob.bin"
    with pytest.raises(ChecksumError, match="expected 0000"):
        download_file(f"{base}/blob.bin", dest, "0" * 64, progress=False)
    assert list(dest.parent.iterdir()) == []
    with pytest.raises(ValueError, match="without a known SHA-256"):
        download_file(f"{base}/blob.bin", dest, None)


def test_dataset_download_into_cache(http_root, monkeypatch, tmp_path):
    served, base = http_root
    labels = np.array([3, 1, 4], np.uint8)
    images = np.arange(3 * 28 * 28, dtype=np.uint32).reshape(3, 28, 28).astype(np.uint8)
    write_idx(served / "t10k-labels-idx1-ubyte.gz", labels, gzip=True)
    write_idx(served / "t10k-images-idx3-ubyte.gz", images, gzip=True)
    specs = tuple(DownloadFile(n, ("http://unused.invalid/" + n,), file_sha256(served / n))
                  for n in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"))
    fake = DatasetSource("mnist", {"train": (), "test": specs}, "fake")
    monkeypatch.setitem(sources_module._SOURCES, "mnist", fake)
    monkeypatch.setenv("POSTERIORZOO_URL_BASE", base)
    ds = load_dataset("mnist", "test")
    np.testing.assert_array_equal(ds.images[:, 0], images)
    assert ds.labels.tolist() == [3, 1, 4]
    cache = tmp_path / "cache" / "mnist"
    assert sorted(p.name for p in cache.iterdir()) == sorted(s.filename for s in specs)
    # A second load finds the cached files: the server is not needed any more.
    monkeypatch.setenv("POSTERIORZOO_URL_BASE", f"http://127.0.0.1:{_closed_port()}")
    assert load_dataset("mnist", "test", timeout=1).labels.tolist() == [3, 1, 4]


def test_dataset_download_wrong_digest_leaves_nothing(http_root, tmp_path):
    served, base = http_root
    (served / "train_32x32.mat").write_bytes(b"an impostor")
    with pytest.raises(ChecksumError, match="train_32x32.mat"):
        dataset_files("svhn", "train", url_base=base)
    cache = tmp_path / "cache" / "svhn"
    assert not cache.exists() or list(cache.iterdir()) == []


def test_dataset_without_digest_is_not_downloaded(http_root, monkeypatch):
    served, base = http_root
    (served / "x.bin").write_bytes(b"data")
    spec = DownloadFile("x.bin", (base + "/x.bin",), None)
    monkeypatch.setitem(sources_module._SOURCES, "svhn",
                        DatasetSource("svhn", {"train": (spec,)}, "fake"))
    with pytest.raises(DataNotFoundError, match="no trustworthy SHA-256 is known for x.bin"):
        dataset_files("svhn", "train")


def test_offline_fails_fast_with_instructions(tmp_path):
    base = f"http://127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    with pytest.raises(DataNotFoundError) as info:
        load_dataset("fashion-mnist", "train", url_base=base, timeout=2)
    assert time.monotonic() - start < 2.5
    message = str(info.value)
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        assert name in message
        assert f"{base}/{name}" in message
    assert str(tmp_path / "cache" / "fashion-mnist") in message
    assert "t10k" not in message  # only what this split needs
    assert not (tmp_path / "cache" / "fashion-mnist").exists() or not any(
        (tmp_path / "cache" / "fashion-mnist").iterdir())


def test_verify_local_files(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "test_32x32.mat").write_bytes(b"corrupted copy")
    with pytest.raises(ChecksumError, match="test_32x32.mat.*verify=False"):
        dataset_files("svhn", "test", data_dir=folder, download=False)  # checked by default
    with pytest.raises(ChecksumError, match="test_32x32.mat"):
        load_dataset("svhn", "test", data_dir=folder, download=False)
    # With verify=False the local file is trusted (and only its format is checked later).
    assert dataset_files("svhn", "test", data_dir=folder, download=False,
                         verify=False)["test_32x32.mat"] == folder / "test_32x32.mat"


# --------------------------------------------------------------- Fashion-MNIST


def _official_fashion_gz(filename: str, mtime: int) -> bytes:
    """Debian's file with the gzip header the official file has (name + timestamp)."""
    debian = (FASHION_DIR / filename).read_bytes()
    assert debian[:4] == b"\x1f\x8b\x08\x00"  # Debian dropped the FNAME field
    name = filename.removesuffix(".gz").encode() + b"\0"
    return b"\x1f\x8b\x08\x08" + struct.pack("<I", mtime) + b"\x00\x03" + name + debian[10:]


@needs_fashion
@pytest.mark.fashion_mnist
def test_fashion_mnist_from_debian(monkeypatch):
    monkeypatch.setattr(download_module, "DEBIAN_ROOT", FASHION_DIR.parent)
    train = load_dataset("fashion-mnist", "train", download=False, verify=True)
    test = load_dataset("fashion-mnist", "test", download=False)
    assert train.images.shape == (60000, 1, 28, 28) and train.images.dtype == np.uint8
    assert test.images.shape == (10000, 1, 28, 28)
    assert train.labels.dtype == np.int64 and train.num_classes == 10
    assert np.bincount(train.labels).tolist() == [6000] * 10
    assert np.bincount(test.labels).tolist() == [1000] * 10
    assert train.labels[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert int(train.images.sum(dtype=np.int64)) == 3431114169
    assert int(test.images.sum(dtype=np.int64)) == 573469082
    # The published normalization constants are those of this train split, rounded to
    # the 4 digits shown (half a unit, 5e-5), plus the float64 mean's and std's rounding
    # over N pixels in any order (gamma(N + 6, u64) of values below 1: 5e-9). Measured
    # 4.1e-5 (mean 0.286041) and 2.4e-5 (std 0.353024).
    slack = 5e-5 + gamma(train.images.size + 6, U64)
    assert train.images.mean() / 255 == pytest.approx(train.mean[0], rel=0, abs=slack)
    assert (train.images / 255).std() == pytest.approx(train.std[0], rel=0, abs=slack)


@needs_fashion
def test_a_file_checked_by_its_content_is_read_from_the_bytes_checked(monkeypatch, tmp_path):
    """Debian's gzip headers differ from the published files, so they pass by their
    content's digest: that content is kept and parsed, not decompressed a second time;
    it is given out once, and not at all for a file changed since its check."""
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (tmp_path / name).write_bytes((FASHION_DIR / name).read_bytes())
    monkeypatch.setattr(download_module, "_VERIFIED", set())
    monkeypatch.setattr(download_module, "_VERIFIED_CONTENT", {})
    labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
    dataset_files("fashion-mnist", "test", data_dir=tmp_path, download=False)
    assert download_module.verified_content(labels) == gzip.decompress(labels.read_bytes())
    assert download_module.verified_content(labels) is None
    monkeypatch.setattr(download_module, "_VERIFIED", set())
    dataset_files("fashion-mnist", "test", data_dir=tmp_path, download=False)
    os.utime(labels, ns=(1, 1))   # "changed" since the check
    assert download_module.verified_content(labels) is None
    assert list(download_module._VERIFIED_CONTENT) == [  # the other one, still unread
        str((tmp_path / "t10k-images-idx3-ubyte.gz").resolve())]
    monkeypatch.setattr(download_module, "_VERIFIED", set())
    loaded = load_dataset("fashion-mnist", "test", data_dir=tmp_path, download=False)
    assert download_module._VERIFIED_CONTENT == {}    # both taken by the reader
    assert np.array_equal(loaded.images[:, 0], read_idx(tmp_path / "t10k-images-idx3-ubyte.gz"))
    assert np.array_equal(loaded.labels, read_idx(labels))


@needs_fashion
def test_fashion_mnist_official_files_download(http_root, tmp_path):
    # Re-inserting the original name and timestamp into Debian's gzip headers gives
    # byte for byte the official files: served locally, they pass the published digests.
    served, base = http_root
    for filename, mtime in (("t10k-images-idx3-ubyte.gz", 1504176627),
                            ("t10k-labels-idx1-ubyte.gz", 1504176627)):
        (served / filename).write_bytes(_official_fashion_gz(filename, mtime))
    ds = load_dataset("fashion-mnist", "test", url_base=base)
    assert ds.images.shape == (10000, 1, 28, 28)
    cached = tmp_path / "cache" / "fashion-mnist"
    assert sorted(p.name for p in cached.iterdir()) == ["t10k-images-idx3-ubyte.gz",
                                                        "t10k-labels-idx1-ubyte.gz"]


# ---------------------------------------------------------------------- digits


def test_digits():
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    assert train.images.shape == (1347, 1, 28, 28) and test.images.shape == (450, 1, 28, 28)
    assert train.images.dtype == np.uint8 and train.labels.dtype == np.int64
    assert set(train.labels.tolist()) == set(range(10)) == set(test.labels.tolist())
    assert train.images.max() == 255 and train.images.min() == 0
    # Stratified: every class keeps its share of the 1797 digits within one example.
    full = np.bincount(np.concatenate([train.labels, test.labels]))
    assert np.all(np.abs(np.bincount(test.labels) - full * 0.25) <= 1)
    # Disjoint and complete: the resized images of both splits are the 1797 originals.
    images, labels, train_idx, test_idx = _digits_arrays()
    assert len(set(train_idx) & set(test_idx)) == 0
    assert sorted(np.concatenate([train_idx, test_idx]).tolist()) == list(range(1797))
    np.testing.assert_array_equal(train.images, images[train_idx])
    # Deterministic: recomputed from scratch, the split and pixels are identical.
    _digits_arrays.cache_clear()
    again = load_dataset("digits", "test")
    np.testing.assert_array_equal(again.images, test.images)
    np.testing.assert_array_equal(again.labels, test.labels)
    # channel_stats divides each pixel by 255, then averages (float64, per channel); this
    # averages, then divides: N nonnegative terms summed in any order, each side within
    # gamma(N + 2, u64) of the exact mean (a relative 2.3e-10 here; measured 1.8e-16).
    assert train.mean[0] == pytest.approx(
        train.images.mean() / 255, rel=2 * gamma(train.images.size + 2, U64), abs=0)


def test_prepared_digits_come_from_the_cache_without_scikit_learn(isolated_data_env):
    from posteriorzoo.data.datasets import _digits_cache_path, _prepare_digits

    _digits_arrays.cache_clear()
    first = load_dataset("digits", "test")
    path = _digits_cache_path()
    assert path.is_file() and path.is_relative_to(isolated_data_env / "cache")
    for cached, fresh in zip(_digits_arrays(), _prepare_digits(), strict=True):
        np.testing.assert_array_equal(cached, fresh)
    # A new process reads the cache: the same arrays, and scikit-learn is not imported.
    script = ("import sys\n"
              "from posteriorzoo.data import load_dataset\n"
              "d = load_dataset('digits', 'test')\n"
              "print(int(d.images.sum()), int(d.labels.sum()), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ}, check=True).stdout.split()
    assert out == [str(int(first.images.sum())), str(int(first.labels.sum())), "False"]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong shape", "pickled",
                                    "not a partition", "extra array"])
def test_a_damaged_digits_cache_is_ignored_and_replaced(isolated_data_env, damage):
    from posteriorzoo.data.datasets import _digits_cache_path, _prepare_digits

    _digits_arrays.cache_clear()
    images, labels, train, test = _prepare_digits()
    path = _digits_cache_path()
    path.parent.mkdir(parents=True)
    arrays = {"images": images, "labels": labels, "train": train, "test": test}
    if damage == "garbage":
        path.write_bytes(b"not an npz" * 100)
    else:
        if damage == "wrong shape":
            arrays["images"] = images[:, :, :27]
        elif damage == "pickled":
            arrays["labels"] = np.array([{"a": 1}] * len(labels), dtype=object)
        elif damage == "not a partition":
            arrays["test"] = np.r_[test[:-1], train[0]]
        elif damage == "extra array":
            arrays["more"] = np.zeros(3)
        with open(path, "wb") as handle:
            np.savez(handle, **arrays)
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[:5000])
    np.testing.assert_array_equal(load_dataset("digits", "test").images, images[test])
    with np.load(path, allow_pickle=False) as replaced:   # rewritten whole
        np.testing.assert_array_equal(replaced["images"], images)
        assert set(replaced.files) == {"images", "labels", "train", "test"}


def test_digits_resize_matches_original():
    from sklearn.datasets import load_digits

    images, _, _, _ = _digits_arrays()
    original = load_digits().images[0] * 255 / 16
    # Bilinear (half-pixel centers) 8 -> 28: pixel (3, 3) of the output samples the
    # input at (3.5 * 8 / 28 - 0.5) = 0.5, halfway between rows/columns 0 and 1.
    expected = original[:2, :2].mean()
    # Rounding to an integer moves at most 0.5; torch's float32 bilinear weights (the
    # source coordinate's scale, product and shift, 1 - lambda, the weights' products)
    # and 4-term sum round at most 18 times, gamma(18) of the (nonnegative) value: 2.7e-4
    # at 255. The float64 expected value: exact (multiples of 255/16, one division by 4).
    assert abs(int(images[0, 0, 3, 3]) - expected) <= 0.5 + gamma(18) * expected


# ------------------------------------------------------------- fake archives


def _cifar_records(labels: list[list[int]], images: np.ndarray) -> bytes:
    return b"".join(bytes(lab) + img.tobytes() for lab, img in zip(labels, images, strict=True))


def _write_tar_gz(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_cifar10_binary(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (7, 3, 32, 32), dtype=np.uint8)
    labels = [5, 0, 9, 3, 3, 1, 2]
    # Batches 1..5 hold 2, 1, 1, 1, 1 images; the tar lists them out of order.
    splits = [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    members = {f"cifar-10-batches-bin/data_batch_{i}.bin":
               _cifar_records([[lab] for lab in labels[a:b]], images[a:b])
               for i, (a, b) in reversed(list(enumerate(splits, 1)))}
    members["cifar-10-batches-bin/test_batch.bin"] = _cifar_records([[labels[6]]], images[6:])
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
             "ship", "truck"]
    members["cifar-10-batches-bin/batches.meta.txt"] = ("\n".join(names) + "\n\n").encode()
    _write_tar_gz(tmp_path / "cifar-10-binary.tar.gz", members)

    train = load_dataset("cifar10", "train", data_dir=tmp_path, download=False, verify=False)
    np.testing.assert_array_equal(train.images, images[:6])
    assert train.labels.tolist() == labels[:6] and train.labels.dtype == np.int64
    assert train.class_names == tuple(names) and train.num_classes == 10
    assert train.mean == (0.4914, 0.4822, 0.4465)
    test = load_dataset("cifar10", "test", data_dir=tmp_path, download=False, verify=False)
    np.testing.assert_array_equal(test.images, images[6:])


def test_cifar100_binary_fine_and_coarse(tmp_path):
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)
    pairs = [[4, 72], [19, 99], [0, 0]]  # (coarse, fine) label bytes
    _write_tar_gz(tmp_path / "cifar-100-binary.tar.gz", {
        "cifar-100-binary/train.bin": _cifar_records(pairs, images),
        "cifar-100-binary/test.bin": _cifar_records(pairs[:1], images[:1]),
    })
    fine = load_dataset("cifar100", data_dir=tmp_path, download=False, verify=False)
    coarse = load_dataset("cifar100", data_dir=tmp_path, download=False, verify=False,
                          label_type="coarse")
    assert fine.labels.tolist() == [72, 99, 0] and fine.num_classes == 100
    assert coarse.labels.tolist() == [4, 19, 0] and coarse.num_classes == 20
    np.testing.assert_array_equal(fine.images, images)


def test_cifar_corrupt_archives(tmp_path):
    _write_tar_gz(tmp_path / "cifar-100-binary.tar.gz",
                  {"cifar-100-binary/train.bin": b"\x00" * 3075})
    with pytest.raises(DataFormatError, match="3074-byte records"):
        load_dataset("cifar100", data_dir=tmp_path, download=False, verify=False)
    with pytest.raises(DataFormatError, match="lacks test.bin"):
        load_dataset("cifar100", "test", data_dir=tmp_path, download=False, verify=False)
    (tmp_path / "cifar-10-binary.tar.gz").write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(DataFormatError, match="cifar-10-binary.tar.gz"):
        load_dataset("cifar10", data_dir=tmp_path, download=False, verify=False)


def test_svhn_mat(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (32, 32, 3, 4), dtype=np.uint8)
    y = np.array([[10], [1], [9], [10]], dtype=np.uint8)
    scipy.io.savemat(tmp_path / "test_32x32.mat", {"X": x, "y": y})
    ds = load_dataset("svhn", "test", data_dir=tmp_path, download=False, verify=False)
    assert ds.images.shape == (4, 3, 32, 32) and ds.labels.tolist() == [0, 1, 9, 0]
    assert ds.images[2, 1, 5, 7] == x[5, 7, 1, 2]
    np.testing.assert_array_equal(ds.images, x.transpose(3, 2, 0, 1))
    (tmp_path / "train_32x32.mat").write_bytes(b"MATLAB? no")
    with pytest.raises(DataFormatError, match="train_32x32.mat"):
        load_dataset("svhn", "train", data_dir=tmp_path, download=False, verify=False)


def _jpeg(color, size=(64, 64), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def test_tinyimagenet_zip(tmp_path):
    colors = {"n02": (200, 30, 30), "n01": (30, 200, 30), "n03": (30, 30, 200)}
    with zipfile.ZipFile(tmp_path / "tiny-imagenet-200.zip", "w") as zf:
        zf.writestr("tiny-imagenet-200/wnids.txt", "n02\nn01\nn03\n")  # not sorted
        for wnid, color in colors.items():
            for k in range(2):
                zf.writestr(f"tiny-imagenet-200/train/{wnid}/images/{wnid}_{k}.JPEG",
                            _jpeg(color))
            zf.writestr(f"tiny-imagenet-200/train/{wnid}/{wnid}_boxes.txt", "ignored")
        zf.writestr("tiny-imagenet-200/val/images/val_0.JPEG", _jpeg(140, mode="L"))
        zf.writestr("tiny-imagenet-200/val/images/val_1.JPEG", _jpeg(colors["n02"]))
        zf.writestr("tiny-imagenet-200/val/val_annotations.txt",
                    "val_0.JPEG\tn03\t0\t0\t10\t10\nval_1.JPEG\tn02\t1\t2\t30\t40\n")
    train = load_dataset("tinyimagenet", "train", data_dir=tmp_path, download=False, verify=False)
    assert train.images.shape == (6, 3, 64, 64) and train.num_classes == 200
    assert train.class_names == ("n01", "n02", "n03")
    assert train.labels.tolist() == [0, 0, 1, 1, 2, 2]
    for image, label in zip(train.images, train.labels, strict=True):
        color = colors[train.class_names[label]]
        assert np.abs(image.reshape(3, -1).mean(1) - color).max() < 3
    test = load_dataset("tinyimagenet", "test", data_dir=tmp_path, download=False, verify=False)
    assert test.labels.tolist() == [2, 1]
    gray = test.images[0].astype(int)
    assert np.all(gray[0] == gray[1]) and np.all(gray[1] == gray[2])  # L -> RGB
    assert abs(gray.mean() - 140) < 3


def test_fit_square_center_crop():
    # 60 x 20 image of three vertical stripes: the 20 x 20 center is the green one.
    stripes = np.zeros((20, 60, 3), np.uint8)
    stripes[:, :20, 0] = stripes[:, 20:40, 1] = stripes[:, 40:, 2] = 255
    out = np.asarray(fit_square(Image.fromarray(stripes), 10))
    assert out.shape == (10, 10, 3)
    np.testing.assert_array_equal(out[:, 2:8], np.broadcast_to([0, 255, 0], (10, 6, 3)))


def test_textures_dtd(tmp_path):
    sizes = {"banded/banded_0001.jpg": (90, 60), "banded/banded_0002.jpg": (50, 70),
             "zigzagged/zigzagged_0001.jpg": (64, 64), "zigzagged/zigzagged_0002.jpg": (80, 40)}
    color = {"banded": (220, 40, 40), "zigzagged": (40, 40, 220)}
    members = {f"dtd/images/{k}": _jpeg(color[k.split("/")[0]], size)
               for k, size in sizes.items()}
    members["dtd/labels/train1.txt"] = b"banded/banded_0001.jpg\nzigzagged/zigzagged_0002.jpg\n"
    members["dtd/labels/test1.txt"] = b"zigzagged/zigzagged_0001.jpg\nbanded/banded_0002.jpg\n"
    members["dtd/labels/test2.txt"] = b"banded/banded_0001.jpg\n"
    _write_tar_gz(tmp_path / "dtd-r1.0.1.tar.gz", members)

    test = load_dataset("textures", "test", data_dir=tmp_path, download=False, verify=False,
                        image_size=16)
    assert test.images.shape == (2, 3, 16, 16) and test.labels.tolist() == [1, 0]
    assert test.class_names == ("banded", "zigzagged")
    assert np.abs(test.images[0].reshape(3, -1).mean(1) - color["zigzagged"]).max() < 4
    # as for digits: two float64 orders of N nonnegative terms, each gamma(N + 2, u64)
    assert test.mean[2] == pytest.approx(
        test.images[:, 2].mean() / 255, rel=2 * gamma(test.images[:, 2].size + 2, U64), abs=0)
    every = load_dataset("textures", "all", data_dir=tmp_path, download=False, verify=False)
    assert every.images.shape == (4, 3, 64, 64) and every.labels.tolist() == [0, 0, 1, 1]
    other = load_dataset("textures", "test", data_dir=tmp_path, download=False, verify=False,
                         partition=2)
    assert other.labels.tolist() == [0]
    with pytest.raises(DataFormatError, match="lacks labels/val1.txt"):
        load_dataset("textures", "val", data_dir=tmp_path, download=False, verify=False)


# ------------------------------------------------------- hostile local files


BOMB_BYTES = 2**30  # what each bomb expands to, 1 GiB
PEAK_BOUND = 600 * 2**20  # the interpreter with torch alone takes about 400 MB
REPO = Path(__file__).resolve().parents[1]


def _gzip_bomb(path: Path, prefix: bytes = b"", size: int = BOMB_BYTES) -> Path:
    """``prefix`` then zeros up to ``size`` bytes, gzipped as a stream (about 5 MB)."""
    zeros = bytes(2**24)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1,
                                               mtime=0) as out:
        out.write(prefix)
        left = size - len(prefix)
        while left:
            out.write(zeros[:min(left, len(zeros))])
            left -= min(left, len(zeros))
    return path


_LOADER = """
import json, sys
from posteriorzoo.data import load_dataset
from posteriorzoo.errors import PosteriorZooError
outcomes = []
for folder, verify in json.loads(sys.argv[1]):
    try:
        load_dataset("fashion-mnist", "train", data_dir=folder, download=False, verify=verify)
        outcomes.append("loaded")
    except PosteriorZooError as error:
        outcomes.append(f"{type(error).__name__}: {error}")
print(json.dumps(outcomes))
"""
#: Runs the loader as its only child and reports the child's peak memory: a process's own
#: ru_maxrss would include the memory of the process it was forked from (pytest's).
_MEASURE = """
import json, resource, subprocess, sys
done = subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], capture_output=True,
                      text=True)
sys.stderr.write(done.stderr)
print(json.dumps({"code": done.returncode, "outcomes": json.loads(done.stdout or "[]"),
                  "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def test_gzip_bombs_in_data_dir_are_refused_with_bounded_memory(tmp_path):
    """The audit's bomb (gzipped zeros named like a Fashion-MNIST file) and one behind a
    valid IDX header: refused by the digest check, which decompresses no further than the
    published content size, and, unverified, by the reader, which reads no further than
    the header declares, nor a header declaring more than the published size."""
    images = "train-images-idx3-ubyte.gz"
    cases = {"zeros": b"", "idx-header": bytes([0, 0, 8, 3]) + struct.pack(">3I", 60000, 28, 28),
             "huge-shape": bytes([0, 0, 8, 3]) + struct.pack(">3I", 10**6, 28, 28)}
    runs = []
    for name, prefix in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        size = BOMB_BYTES if name != "huge-shape" else 2**20
        _gzip_bomb(folder / images, prefix, size)
        write_idx(folder / "train-labels-idx1-ubyte.gz", np.zeros(60000, np.uint8), gzip=True)
        assert (folder / images).stat().st_size < 8 * 2**20
        runs += [(str(folder), True), (str(folder), False)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _MEASURE, _LOADER, json.dumps(runs)],
                            env=env, capture_output=True, text=True, timeout=300)
    report = json.loads(result.stdout)
    assert report["code"] == 0, result.stderr
    for refusal in report["outcomes"][::2]:  # verified (the default)
        assert refusal.startswith("ChecksumError: ") and images in refusal, refusal
    zeros, header, huge = report["outcomes"][1::2]
    assert zeros.startswith("DataFormatError: ") and "unknown IDX type code 0x00" in zeros
    assert header.startswith("DataFormatError: ") and "has trailing bytes" in header
    assert huge.startswith("DataFormatError: ") and "more than the 47040016" in huge
    assert report["peak"] < PEAK_BOUND, f"peak {report['peak'] / 2**20:.0f} MB"
    assert time.monotonic() - start < 60


def test_local_files_are_checked_once_per_process(tmp_path, monkeypatch):
    folder = tmp_path / "mine"
    folder.mkdir()
    payload = b"the published bytes"
    spec = DownloadFile("x.bin", ("http://unused.invalid/x.bin",), _sha(payload))
    monkeypatch.setitem(sources_module._SOURCES, "svhn",
                        DatasetSource("svhn", {"train": (spec,)}, "fake"))
    (folder / "x.bin").write_bytes(payload)
    hashed = []
    real = download_module.file_sha256
    monkeypatch.setattr(download_module, "file_sha256",
                        lambda path, **kw: hashed.append(path) or real(path, **kw))
    for _ in range(3):
        assert dataset_files("svhn", "train", data_dir=folder, download=False)
    assert len(hashed) == 1
    (folder / "x.bin").write_bytes(b"the altered bytes!!")  # same size, new content
    with pytest.raises(ChecksumError, match="x.bin"):
        dataset_files("svhn", "train", data_dir=folder, download=False)


def test_archive_members_are_bounded_before_decompression(tmp_path):
    # a CIFAR-10 batch declaring more records than a batch holds (only its header is real)
    huge = tmp_path / "cifar-10-binary.tar.gz"
    info = tarfile.TarInfo("cifar-10-batches-bin/test_batch.bin")
    info.size = 10_001 * 3073
    huge.write_bytes(gzip.compress(info.tobuf() + bytes(4096)))
    with pytest.raises(DataFormatError, match="declares 30733073 bytes, more than the 30730000"):
        load_dataset("cifar10", "test", data_dir=tmp_path, download=False, verify=False)
    # a DTD image member of 1 GiB
    dtd = tmp_path / "dtd-r1.0.1.tar.gz"
    info = tarfile.TarInfo("dtd/images/banded/banded_0001.jpg")
    info.size = 2**30
    dtd.write_bytes(gzip.compress(info.tobuf() + bytes(4096)))
    with pytest.raises(DataFormatError, match="banded_0001.jpg.*more than"):
        load_dataset("textures", "all", data_dir=tmp_path, download=False, verify=False)
    # an image declaring 5000 x 5000 pixels (a PNG header), refused before it is decoded
    small = io.BytesIO()
    Image.new("L", (1, 1)).save(small, format="PNG")
    data = small.getvalue()
    ihdr = b"IHDR" + struct.pack(">II", 5000, 5000) + data[24:29]
    data = data[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]
    _write_tar_gz(dtd, {"dtd/images/banded/banded_0001.jpg": data})
    with pytest.raises(DataFormatError, match="5000x5000 pixels"):
        load_dataset("textures", "all", data_dir=tmp_path, download=False, verify=False)


# ------------------------------------------------------------------ transforms


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape, size, padding", [((6, 3, 8, 8), 8, 2), ((5, 2, 7, 9), (5, 6), 3)])
def test_random_crop_matches_numpy_reference(shape, size, padding):
    images = torch.randint(1, 256, shape, generator=_gen(0), dtype=torch.int64).to(torch.uint8)
    crop = RandomCrop(size, padding)
    tops, lefts = crop.sample(images.shape, _gen(7))
    out = crop(images, _gen(7))
    h, w = crop.size
    padded = np.pad(images.numpy(), ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    for i in range(shape[0]):
        t, left = int(tops[i]), int(lefts[i])
        np.testing.assert_array_equal(out[i].numpy(), padded[i, :, t:t + h, left:left + w])
    assert out.dtype == torch.uint8 and out.shape == (shape[0], shape[1], h, w)


def test_random_crop_offsets_and_padding():
    crop = RandomCrop(4, padding=2)
    tops, lefts = crop.sample((5000, 1, 4, 4), _gen(1))
    assert set(tops.tolist()) == set(range(5)) == set(lefts.tolist())  # 0 .. 4 + 4 - 4
    ones = torch.ones(1, 1, 4, 4)
    corner = crop.apply(ones, torch.tensor([0]), torch.tensor([0]))
    expected = torch.zeros(1, 1, 4, 4)
    expected[..., 2:, 2:] = 1
    assert torch.equal(corner, expected)
    with pytest.raises(ValueError, match="explicit torch.Generator"):
        crop(ones)


def test_random_horizontal_flip_flips_chosen_images():
    images = torch.rand(64, 2, 3, 5, generator=_gen(0))
    flip = RandomHorizontalFlip(0.5)
    mask = flip.sample(64, _gen(3))
    out = flip(images, _gen(3))
    assert 0 < int(mask.sum()) < 64
    for i in range(64):
        expected = images[i].flip(-1) if mask[i] else images[i]
        assert torch.equal(out[i], expected)
    assert torch.equal(RandomHorizontalFlip(0.0)(images, _gen(0)), images)
    assert torch.equal(RandomHorizontalFlip(1.0)(images, _gen(0)), images.flip(-1))


def test_normalize_closed_form():
    mean, std = (0.25, 0.5, 0.75), (0.5, 0.25, 2.0)
    images = torch.randint(0, 256, (4, 3, 5, 5), generator=_gen(0)).to(torch.uint8)
    out = Normalize(mean, std)(images)
    x = images.numpy().astype(np.float64) / 255
    expected = (x - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    assert out.dtype == torch.float32
    # float32: x / 255 (2 u of x: a division, or a product with a rounded 1 / 255), the
    # subtraction (u of |x - mean|; the means are exact in float32), the division by a
    # power of two (exact); float64's own expected value within gamma(3, u64) of it.
    # Bound 1.8e-7-7.2e-7 per entry; a wrong channel's constant moves entries by 0.1+.
    centred = np.abs(x - np.array(mean)[:, None, None])
    bound = ((2 * U32 * x + U32 * centred) / np.array(std)[:, None, None]
             + gamma(3, U64) * np.abs(expected))
    assert np.all(np.abs(out.numpy() - expected) <= bound)
    floats = torch.from_numpy(x).float()   # the cast: u of x, within the bound's 2 u
    assert np.all(np.abs(Normalize(mean, std)(floats).numpy() - expected) <= bound)
    assert torch.equal(Normalize((0.0,), (1.0,))(torch.full((1, 1, 1, 1), 255, dtype=torch.uint8)),
                       torch.ones(1, 1, 1, 1))


def test_compose_and_global_rng_untouched():
    images = torch.randint(0, 256, (8, 3, 6, 6), generator=_gen(0)).to(torch.uint8)
    crop, flip, norm = RandomCrop(6, 1), RandomHorizontalFlip(), Normalize((0.5,), (0.5,))
    state = torch.get_rng_state()
    out = Compose([crop, flip, norm])(images, _gen(11))
    g = _gen(11)
    expected = norm(flip(crop(images, g), g))
    assert torch.equal(out, expected)
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------- batches


def _indexed_dataset(n: int = 103) -> ArrayDataset:
    # Image i is filled with the value i, so a batch reveals which examples it holds.
    images = np.broadcast_to(np.arange(n, dtype=np.uint8)[:, None, None, None],
                             (n, 1, 4, 4)).copy()
    return ArrayDataset(images, np.arange(n, dtype=np.int64) % 7, 7, "indexed", "train",
                        (0.5,), (0.25,))


def _epoch(ds, seed, epoch, **kw):
    return [(x.clone(), y.clone()) for x, y in iterate_batches(ds, 10, seed, epoch, **kw)]


def test_iterate_batches_is_a_function_of_seed_and_epoch():
    ds = _indexed_dataset()
    aug = Compose([RandomCrop(4, 1), RandomHorizontalFlip()])
    state = torch.get_rng_state()
    a = _epoch(ds, 5, 0, transform=aug)
    torch.manual_seed(1234)  # the global RNG must not matter
    b = _epoch(ds, 5, 0, transform=aug)
    torch.set_rng_state(state)
    assert len(a) == 11 and a[-1][0].shape == (3, 1, 4, 4)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb)
               for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    c = _epoch(ds, 5, 1, transform=aug)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c, strict=True))
    d = _epoch(ds, 6, 0, transform=aug)
    assert not all(torch.equal(ya, yd) for (_, ya), (_, yd) in zip(a, d, strict=True))


def test_iterate_batches_covers_every_example_once():
    ds = _indexed_dataset()
    for epoch in range(3):
        batches = _epoch(ds, 0, epoch)
        x = torch.cat([b[0] for b in batches])
        assert x.dtype == torch.float32 and batches[0][1].dtype == torch.int64
        order = torch.round(x[:, 0, 0, 0] * 255).long()
        assert sorted(order.tolist()) == list(range(103))
        # Labels travel with their images.
        assert torch.equal(torch.cat([b[1] for b in batches]), order % 7)
        # The documented scheme: permutation from the first SeedSequence word.
        word = np.random.SeedSequence([0, epoch]).generate_state(2, np.uint64)[0]
        assert torch.equal(order, torch.randperm(103, generator=_gen(int(word))))
    kept = _epoch(ds, 0, 0, drop_last=True)
    assert len(kept) == 10 and all(len(y) == 10 for _, y in kept)
    plain = torch.cat([x for x, _ in _epoch(ds, 0, 0, shuffle=False)])
    assert torch.equal(torch.round(plain[:, 0, 0, 0] * 255).long(), torch.arange(103))


def test_iterate_batches_normalized_output():
    ds = _indexed_dataset(20)
    (x, _), = list(iterate_batches(ds, 20, 0, 0, transform=Normalize(ds.mean, ds.std),
                                   shuffle=False))
    expected = (torch.arange(20).float() / 255 - 0.5) / 0.25
    # Normalize's own float32 operations on the same values in the same order (division
    # by the scalar 255, subtraction of 0.5, division by 0.25), each one correctly
    # rounded elementwise on any CPU: the same bits.
    assert torch.equal(x[:, 0, 2, 2], expected)
    assert epoch_generators(0, 0)[0].initial_seed() != epoch_generators(0, 1)[0].initial_seed()
