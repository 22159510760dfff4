"""Collections are read by the HDF5 most people have: 1.10 and every later version.

The reader is a real old one: Debian 12's ``python3-h5py`` (h5py 3.7 on HDF5 1.10.8)
and ``hdf5-tools`` (``h5ls``, ``h5dump``), which ``.ci/run`` installs. Every dataset and
attribute of every shipped collection, and of collections just written by ``train``,
``import`` and ``canonicalize``, must be read by it with the values our h5py reads.
Without those packages the tests skip, saying so.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from zoo_helpers import run_quietly

from posteriorzoo.collection import verify
from posteriorzoo.reference import reference_path
from posteriorzoo.zoo import create_zoo, open_zoo, upgrade_zoo
from posteriorzoo.zoo.schema import HDF5_FORMAT

OLD_PYTHON = Path("/usr/bin/python3")
SHIPPED = sorted(reference_path("de").parent.glob("*.h5"))

# Every object of each file, as JSON: run by Debian's Python with its h5py (HDF5 1.10),
# and by this environment's.
READER = r"""
import hashlib, json, sys
import h5py
import numpy as np

def value(item):
    if isinstance(item, bytes):
        return item.decode("utf-8", "backslashreplace")
    if isinstance(item, np.ndarray):
        return [value(x) for x in item.tolist()]
    if isinstance(item, np.generic):
        return item.item()
    return item

def dump(path):
    found = {}
    with h5py.File(path, "r") as handle:
        def visit(name, item):
            entry = {"attrs": {k: value(item.attrs[k]) for k in sorted(item.attrs)}}
            if isinstance(item, h5py.Dataset):
                data = np.ascontiguousarray(item[()])
                entry.update(dtype=item.dtype.descr, shape=list(item.shape),
                             sha256=hashlib.sha256(data.tobytes()).hexdigest())
            found[name] = entry
        visit("/", handle)
        handle.visititems(visit)
    return found

print(json.dumps({"hdf5": h5py.version.hdf5_version,
                  "files": {path: dump(path) for path in sys.argv[1:]}}))
"""


def reading(python: str, paths: list[Path]) -> dict:
    """What the reader script says of ``paths`` when ``python`` runs it: Debian's old
    one, or this environment's (the same code on both sides of the comparison)."""
    result = subprocess.run([python, "-c", READER, *map(str, paths)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def ours(path: Path) -> dict[str, dict]:
    return reading(sys.executable, [path])["files"][str(path)]


def _old_h5py_version() -> str | None:
    if not OLD_PYTHON.exists():
        return None
    probe = subprocess.run([str(OLD_PYTHON), "-c", "import h5py; print(h5py.version.hdf5_version)"],
                           capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


OLD_HDF5 = _old_h5py_version()
needs_old_reader = pytest.mark.skipif(
    OLD_HDF5 is None or not OLD_HDF5.startswith("1.10"),
    reason="Debian's python3-h5py (HDF5 1.10) is not installed (.ci/run installs it)")
needs_hdf5_tools = pytest.mark.skipif(
    shutil.which("h5ls") is None or shutil.which("h5dump") is None,
    reason="Debian's hdf5-tools (h5ls, h5dump) are not installed (.ci/run installs them)")


def assert_old_reader_agrees(paths: list[Path]) -> None:
    theirs, mine = reading(str(OLD_PYTHON), paths), reading(sys.executable, paths)
    assert theirs["hdf5"].startswith("1.10") and not mine["hdf5"].startswith("1.10")
    for path in map(str, paths):
        assert set(theirs["files"][path]) == set(mine["files"][path]), path
        for name, entry in mine["files"][path].items():
            assert theirs["files"][path][name] == entry, (path, name)


def assert_tools_read(path: Path) -> None:
    listing = subprocess.run(["h5ls", "-r", "-v", str(path)], capture_output=True, text=True)
    assert listing.returncode == 0 and "*ERROR*" not in listing.stdout, listing.stdout[-2000:]
    dump = subprocess.run(["h5dump", "-A", str(path)], capture_output=True, text=True)
    assert dump.returncode == 0, dump.stderr[-2000:]
    assert "error" not in dump.stderr.lower(), dump.stderr[-2000:]


@needs_old_reader
def test_hdf5_1_10_reads_every_object_of_every_shipped_collection():
    assert_old_reader_agrees(SHIPPED)


@needs_hdf5_tools
@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_h5ls_and_h5dump_read_every_shipped_collection(path):
    assert_tools_read(path)


def test_every_shipped_collection_records_its_format_bound():
    for path in SHIPPED:
        with h5py.File(path, "r", locking=False) as handle:
            assert handle.attrs["hdf5_format"] == HDF5_FORMAT[1], path
            # superblock version 3: HDF5 1.10's, what single-writer appends need
            assert handle.id.get_create_plist().get_version()[0] == 3, path


def _cli(*argv: object) -> None:
    """Run a command in this process; fail with its stderr unless it exits 0."""
    code, err = run_quietly(*argv)
    assert code == 0, err[-2000:]


SPEC = """recipe = "optunet-mnist"
dataset = "digits"
method = "de"
checkpoints = 2
base_seed = 5
[recipe_overrides]
epochs = 1
"""


@pytest.fixture(scope="module")
def fresh_collections(tmp_path_factory) -> list[Path]:
    """Collections written just now by train, import (new and appended) and canonicalize."""
    folder = tmp_path_factory.mktemp("fresh")
    spec = folder / "spec.toml"
    spec.write_text(SPEC)
    trained, canonical = folder / "trained.h5", folder / "canonical.h5"
    imported = folder / "imported.h5"
    _cli("train", spec, "--out", trained, "--backend", "serial", "--no-progress")
    _cli("export", trained, "0", "--out", folder / "first.safetensors")
    _cli("export", trained, "1", "--out", folder / "second.safetensors")
    _cli("import", "--out", imported, folder / "first.safetensors", "--no-progress")
    _cli("import", "--out", imported, folder / "second.safetensors", "--no-progress")
    _cli("canonicalize", trained, "--out", canonical, "--no-progress")
    with open_zoo(imported) as zoo:
        assert len(zoo) == 2
    return [trained, imported, canonical]


@needs_old_reader
def test_hdf5_1_10_reads_collections_just_written(fresh_collections):
    assert_old_reader_agrees(fresh_collections)


@needs_hdf5_tools
def test_h5ls_and_h5dump_read_collections_just_written(fresh_collections):
    for path in fresh_collections:
        assert_tools_read(path)


def _latest_format_copy(source: Path, path: Path) -> None:
    """``source`` written as an earlier posteriorzoo wrote it: HDF5's newest formats
    (h5py's ``libver="latest"``), no ``hdf5_format`` attribute."""
    with h5py.File(source, "r", locking=False) as old, \
            h5py.File(path, "w", libver="latest", locking=False) as new:
        for name, value in old.attrs.items():
            if name != "hdf5_format":
                new.attrs[name] = value
        for name in old:
            old.copy(old[name], new, name=name)


def test_a_file_of_the_newest_formats_is_rewritten_within_the_bounds(tmp_path):
    """What the shipped files went through: upgrade_zoo rewrites a file written with the
    newest formats, keeping every checkpoint, row and digest; an append does the same;
    a file already within the bounds is left byte for byte."""
    old = tmp_path / "old.h5"
    _latest_format_copy(reference_path("de"), old)
    before = ours(old)
    with open_zoo(old) as zoo:
        digests = zoo.digests
    assert any("upgrade_zoo" in note for note in verify(old).notes)
    assert "newer than v110" in upgrade_zoo(old)
    assert not any("upgrade_zoo" in note for note in verify(old).notes)
    after = ours(old)
    assert after.pop("/")["attrs"].pop("hdf5_format") == "v110"
    assert before.pop("/")["attrs"] == {k: v for k, v in ours(old)["/"]["attrs"].items()
                                        if k != "hdf5_format"}
    assert after == before
    with open_zoo(old, verify=True) as zoo:
        assert zoo.digests == digests
        zoo.verify_all()
    unchanged = hashlib.sha256(old.read_bytes()).hexdigest()
    assert upgrade_zoo(old) is None
    assert hashlib.sha256(old.read_bytes()).hexdigest() == unchanged


@needs_old_reader
def test_a_file_of_the_newest_formats_is_unreadable_by_hdf5_1_10_until_rewritten(tmp_path):
    """The defect itself, so that this test can fail: HDF5 1.10 cannot read a collection
    written with the newest formats; once rewritten it can."""
    old = tmp_path / "old.h5"
    _latest_format_copy(reference_path("laplace"), old)
    result = subprocess.run([str(OLD_PYTHON), "-c", READER, str(old)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "bad version number" in result.stderr
    upgrade_zoo(old)
    assert_old_reader_agrees([old])


def test_new_collections_are_created_within_the_bounds(tmp_path):
    from zoo_helpers import checkpoint

    path = tmp_path / "new.h5"
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0)) as zoo:
        zoo.append(checkpoint(1), seed=1)
    with h5py.File(path, "r", locking=False) as handle:
        assert handle.attrs["hdf5_format"] == "v110"
        assert handle.id.get_create_plist().get_version()[0] == 3
