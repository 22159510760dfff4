"""Fashion-MNIST's test split ships with the package: the main job runs with no dataset.

A machine with no system dataset (``POSTERIORZOO_SYSTEM_DATA=0``), an empty
``$POSTERIORZOO_DATA``, an empty cache and no network still loads the test split (from the
package, checked against the published digests) and evaluates the shipped reference zoo;
the training split, which is not shipped, is still reported missing in one clear message.
"""

from __future__ import annotations

import fnmatch
import gzip
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import posteriorzoo.data.download as download_module
from posteriorzoo.data import dataset_files, dataset_source, file_sha256, load_dataset, search_dirs
from posteriorzoo.errors import (
    ChecksumError,
    DataFormatError,
    DataNotFoundError,
    InvalidOptionError,
)
from posteriorzoo.reference import METHOD_COLLECTIONS

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "posteriorzoo" / "data" / "bundled" / "fashion-mnist"
DEBIAN = Path("/usr/share/datasets/fashion-mnist")
TEST_FILES = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def hidden_data_environment(root: Path) -> dict[str, str]:
    """Environment variables of a machine with no dataset anywhere and no network: an
    empty $POSTERIORZOO_DATA, no system folder, an empty cache, a download URL on which
    nothing listens."""
    for folder in ("data", "cache"):
        (root / folder).mkdir(exist_ok=True)
    return {"POSTERIORZOO_DATA": str(root / "data"), "POSTERIORZOO_SYSTEM_DATA": "0",
            "POSTERIORZOO_CACHE": str(root / "cache"),
            "POSTERIORZOO_URL_BASE": "http://127.0.0.1:9"}


@pytest.fixture
def no_data_anywhere(tmp_path, monkeypatch):
    """This process sees what a fresh machine sees (the package's own files aside)."""
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for name, value in hidden_data_environment(tmp_path).items():
        monkeypatch.setenv(name, value)
    return tmp_path


def test_the_bundled_test_split_loads_and_has_the_published_digests(no_data_anywhere):
    found = dataset_files("fashion-mnist", "test", download=False)
    assert {name: path.parent for name, path in found.items()} == dict.fromkeys(
        TEST_FILES, BUNDLED)
    published = {spec.filename: spec for spec in dataset_source("fashion-mnist").files}
    for name, path in found.items():
        # the official files as served, byte for byte: the digest of the file itself
        assert file_sha256(path) == published[name].sha256
        assert path.stat().st_size == published[name].size
    test = load_dataset("fashion-mnist", "test", download=False)
    assert test.images.shape == (10_000, 1, 28, 28) and test.images.dtype == np.uint8
    assert np.bincount(test.labels).tolist() == [1_000] * 10
    assert (test.mean, test.std) == ((0.2860,), (0.3530,))
    assert not any((no_data_anywhere / "cache").iterdir())  # nothing downloaded or copied


@pytest.mark.skipif(not all((DEBIAN / name).is_file() for name in TEST_FILES),
                    reason=f"Debian's dataset-fashion-mnist is not installed in {DEBIAN}")
def test_the_bundled_split_equals_debians_copy(no_data_anywhere, monkeypatch):
    for name in TEST_FILES:
        bundled, debian = (BUNDLED / name).read_bytes(), (DEBIAN / name).read_bytes()
        assert gzip.decompress(bundled) == gzip.decompress(debian)
        # the same deflate stream: only the gzip header differs (Debian dropped the name)
        header = 10 + len(name.removesuffix(".gz")) + 1
        assert bundled[header:] == debian[10:]
    shipped = load_dataset("fashion-mnist", "test", download=False)
    monkeypatch.setenv("POSTERIORZOO_SYSTEM_DATA", "1")
    monkeypatch.setattr(download_module, "DEBIAN_ROOT", DEBIAN.parent)
    found = dataset_files("fashion-mnist", "test", download=False)
    assert {path.parent for path in found.values()} == {DEBIAN}  # the system copy first
    system = load_dataset("fashion-mnist", "test", download=False)
    assert np.array_equal(shipped.images, system.images)
    assert np.array_equal(shipped.labels, system.labels)


def test_the_training_split_is_still_reported_missing(no_data_anywhere):
    with pytest.raises(DataNotFoundError) as info:
        load_dataset("fashion-mnist", "train", download=False)
    message = str(info.value)
    assert "\n" not in message
    assert "train-images-idx3-ubyte.gz" in message and "train-labels-idx1-ubyte.gz" in message
    assert "t10k" not in message
    assert f"{BUNDLED} (posteriorzoo ships only the test split)" in message
    assert str(DEBIAN.parent) not in message  # the system folder was not searched


def test_another_copy_is_preferred_to_the_bundled_one(no_data_anywhere, tmp_path):
    mine = tmp_path / "data" / "fashion-mnist"
    mine.mkdir()
    for name in TEST_FILES:
        (mine / name).write_bytes((BUNDLED / name).read_bytes())
    found = dataset_files("fashion-mnist", "test", download=False)
    assert {path.parent for path in found.values()} == {mine}


def test_the_system_folder_is_searched_unless_turned_off(tmp_path, monkeypatch):
    monkeypatch.setattr(download_module, "DEBIAN_ROOT", tmp_path / "system")
    monkeypatch.setenv("POSTERIORZOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("POSTERIORZOO_DATA", raising=False)
    for value in (None, "1", " 1 ", ""):
        if value is None:
            monkeypatch.delenv("POSTERIORZOO_SYSTEM_DATA", raising=False)
        else:
            monkeypatch.setenv("POSTERIORZOO_SYSTEM_DATA", value)
        assert search_dirs("mnist") == [tmp_path / "system" / "mnist",
                                        tmp_path / "cache" / "mnist"], value
    monkeypatch.setenv("POSTERIORZOO_SYSTEM_DATA", "0")
    assert search_dirs("mnist") == [tmp_path / "cache" / "mnist"]
    monkeypatch.setenv("POSTERIORZOO_SYSTEM_DATA", "off")
    with pytest.raises(InvalidOptionError, match=r"\$POSTERIORZOO_SYSTEM_DATA must be one of "
                                                 r"0, 1, not 'off'"):
        dataset_files("fashion-mnist", "test", download=False)


def test_a_bad_download_timeout_is_one_clear_error(no_data_anywhere, monkeypatch):
    for value in ("soon", "0", "-3", "nan"):
        monkeypatch.setenv("POSTERIORZOO_DOWNLOAD_TIMEOUT", value)
        with pytest.raises(InvalidOptionError, match="POSTERIORZOO_DOWNLOAD_TIMEOUT must be"):
            dataset_files("fashion-mnist", "test")
    monkeypatch.setenv("POSTERIORZOO_DOWNLOAD_TIMEOUT", "2.5")
    assert set(dataset_files("fashion-mnist", "test")) == set(TEST_FILES)


def test_a_damaged_bundled_copy_is_refused(no_data_anywhere, tmp_path, monkeypatch):
    damaged = tmp_path / "bundled" / "fashion-mnist"
    damaged.mkdir(parents=True)
    images = bytearray((BUNDLED / TEST_FILES[0]).read_bytes())
    images[5_000] ^= 0xFF
    (damaged / TEST_FILES[0]).write_bytes(bytes(images))
    (damaged / TEST_FILES[1]).write_bytes((BUNDLED / TEST_FILES[1]).read_bytes())
    monkeypatch.setattr(download_module, "BUNDLED_ROOT", tmp_path / "bundled")
    with pytest.raises(ChecksumError, match="damaged: reinstall posteriorzoo"):
        load_dataset("fashion-mnist", "test", download=False)
    # unchecked, the damage is still caught when the file is read
    with pytest.raises(DataFormatError, match="corrupt or truncated gzip stream"):
        load_dataset("fashion-mnist", "test", download=False, verify=False)


def test_the_bundled_files_are_package_data():
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = settings["tool"]["setuptools"]["package-data"]["posteriorzoo.data"]
    package = ROOT / "posteriorzoo" / "data"
    shipped = sorted(str(path.relative_to(package)) for path in (package / "bundled").rglob("*")
                     if path.is_file())
    assert shipped == ["bundled/fashion-mnist/LICENSE",
                       *(f"bundled/fashion-mnist/{name}" for name in TEST_FILES)]
    for name in shipped:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name


#: The cache's folders that hold no data: verification notes (posteriorzoo.zoo.verified)
#: and the distance cache (posteriorzoo.mmd.cache).
NOT_DATA = ("verified", "distances")


def _cached(cache: Path) -> list[str]:
    """What the cache holds as data, by folder and name up to the first dash: only the
    digits prepared from scikit-learn's copy (posteriorzoo.data.datasets), never a
    download."""
    return sorted(f"{path.parent.name}/{path.name.split('-')[0]}"
                  for path in cache.rglob("*")
                  if path.is_file() and path.relative_to(cache).parts[0] not in NOT_DATA)


def test_the_shipped_zoo_is_evaluated_with_no_data_anywhere(no_data_anywhere):
    from posteriorzoo.collection import evaluate
    from posteriorzoo.reference import reference_path

    result = evaluate(reference_path("de"), ood_dataset="digits", n_images=500)
    assert result.image_counts == {"id": 500, "ood": 450}  # digits' test split has 450
    assert 0.7 < result.ensemble_accuracy < 0.9  # 78% on the whole split (data_card.md)
    assert set(_cached(no_data_anywhere / "cache")) <= {"digits/prepared"}  # no download


def test_demo_writes_the_report_with_no_data_anywhere(tmp_path):
    """``make demo`` on a fresh machine: the report step runs, nothing is skipped."""
    env = {**os.environ, **hidden_data_environment(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("XDG_CACHE_HOME", None)
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "posteriorzoo", "demo", "--out", str(out), "--checkpoints", "1",
         "--epochs", "1", "--n-images", "200"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1_800)
    assert done.returncode == 0, done.stderr
    assert "skipped" not in done.stdout
    assert f"[2] report on the reference zoo (OOD: digits): {out / 'report' / 'report.html'}" \
        in done.stdout
    assert (out / "report" / "report.html").is_file()
    report = json.loads((out / "demo-summary.json").read_text())["report"]
    # every shipped method collection and the Deep Ensemble
    assert len(report["table1"]) == len(METHOD_COLLECTIONS) + 1 and report["ood"] == "digits"
    assert set(_cached(tmp_path / "cache")) <= {"digits/prepared"}  # no download
    # it ends saying how to run the command line
    assert any("posteriorzoo --help" in line for line in done.stdout.splitlines()[-2:])
