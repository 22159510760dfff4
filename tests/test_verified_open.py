"""Opening a verified collection again costs no hashing, and corruption is still found.

A full check that passes notes the file's identity in the user's cache
(:mod:`posteriorzoo.zoo.verified`); a later open with ``verify=True`` that finds it
unchanged trusts its checkpoints. Any write to the file changes its times, so a
corrupted checkpoint is hashed again and refused; ``verify`` always hashes everything,
and catches what a forged note hides.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from zoo_helpers import checkpoint, flip_byte_in_chunk

from posteriorzoo.collection import describe, verify
from posteriorzoo.errors import ChecksumError
from posteriorzoo.zoo import create_zoo, open_zoo, verified
from posteriorzoo.zoo.store import Zoo

#: How long before its check a file must have been written to be noted, in these tests.
RACY = 0.2


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("POSTERIORZOO_CACHE", str(folder))
    monkeypatch.delenv(verified.RECORDS_VARIABLE, raising=False)
    monkeypatch.setattr(verified, "RACY_SECONDS", RACY)
    return folder


@pytest.fixture
def hashed(monkeypatch) -> list[tuple[int, int]]:
    """The row ranges whose tensors were hashed."""
    calls: list[tuple[int, int]] = []
    original = Zoo.check_checkpoints

    def counting(self, start, stop, arrays=None):
        calls.append((start, stop))
        return original(self, start, stop, arrays)

    monkeypatch.setattr(Zoo, "check_checkpoints", counting)
    return calls


def collection(path: Path, count: int = 6) -> Path:
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0)) as zoo:
        zoo.append_many([checkpoint(s) for s in range(count)],
                        [{"seed": s, "mode_id": s} for s in range(count)])
    time.sleep(RACY + 0.1)  # older than the racy window: a check of it can be noted
    return path


def open_and_read(path: Path) -> None:
    with open_zoo(path, verify=True) as zoo:
        zoo.verify_all()
        zoo.layer("fc.weight")


def test_a_second_open_hashes_nothing_and_the_folder_is_untouched(tmp_path, cache, hashed):
    (tmp_path / "data").mkdir()
    path = collection(tmp_path / "data" / "z.h5")
    before = sorted(p.name for p in path.parent.iterdir()), path.read_bytes()
    open_and_read(path)
    assert hashed and hashed[-1][1] == 6  # all six checked once
    assert len(list((cache / "verified").iterdir())) == 1
    hashed.clear()
    open_and_read(path)
    describe(path)  # info
    assert hashed == []
    assert (sorted(p.name for p in path.parent.iterdir()), path.read_bytes()) == before


def test_a_corrupted_checkpoint_after_a_note_is_found(tmp_path, cache, hashed):
    path = collection(tmp_path / "z.h5")
    open_and_read(path)
    flip_byte_in_chunk(path, "fc.weight")
    with pytest.raises(ChecksumError, match="corrupt"):
        open_and_read(path)
    assert list((cache / "verified").iterdir()) == []  # the stale note is gone


def test_putting_the_modification_time_back_does_not_hide_a_change(tmp_path, cache):
    path = collection(tmp_path / "z.h5")
    open_and_read(path)
    status = os.stat(path)
    flip_byte_in_chunk(path, "fc.weight")
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))  # same size, same mtime
    assert os.stat(path).st_mtime_ns == status.st_mtime_ns
    with pytest.raises(ChecksumError):  # the status-change time moved
        open_and_read(path)


def test_a_forged_note_is_trusted_by_open_but_not_by_verify(tmp_path, cache):
    """What the cheap check cannot see (a note written for a changed file, as a change
    that left both times alone would look): ``verify`` hashes everything and says so."""
    path = collection(tmp_path / "z.h5")
    flip_byte_in_chunk(path, "fc.weight")
    time.sleep(RACY + 0.1)
    with open_zoo(path) as zoo:
        forged = verified.remember(path, verified.snapshot(path), len(zoo),
                                   zoo._content_digest(len(zoo)))
    assert forged
    open_and_read(path)  # trusted: documented in the README
    report = verify(path)
    assert not report.ok and report.digest_mismatches
    with pytest.raises(ChecksumError):  # verify removed the note
        open_and_read(path)


def test_verify_notes_what_it_checked(tmp_path, cache, hashed):
    path = collection(tmp_path / "z.h5")
    assert verify(path).ok
    hashed.clear()
    open_and_read(path)
    assert hashed == []


def test_no_note_for_a_file_just_written_or_when_switched_off(tmp_path, cache, hashed,
                                                                monkeypatch):
    path = collection(tmp_path / "z.h5")
    with open_zoo(path, mode="r+") as zoo:  # a write just now: racy
        zoo.append(checkpoint(6), seed=6, mode_id=6)
    open_and_read(path)
    assert not (cache / "verified").exists()
    time.sleep(RACY + 0.1)
    monkeypatch.setenv(verified.RECORDS_VARIABLE, "0")
    open_and_read(path)
    hashed.clear()
    open_and_read(path)
    assert hashed and not (cache / "verified").exists()


def test_an_append_after_a_note_is_checked_again(tmp_path, cache, hashed):
    path = collection(tmp_path / "z.h5")
    open_and_read(path)
    with open_zoo(path, mode="r+") as zoo:
        zoo.append(checkpoint(6), seed=6, mode_id=6)
    hashed.clear()
    open_and_read(path)
    assert hashed and hashed[-1][1] == 7


def test_the_oldest_notes_go_beyond_the_limit(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(verified, "MAX_NOTES", 2)
    paths = [collection(tmp_path / f"z{i}.h5", count=1) for i in range(3)]
    for path in paths:
        open_and_read(path)
        time.sleep(0.01)
    assert len(list((cache / "verified").iterdir())) == 2
    first = verified._note_path(paths[0])
    assert not first.exists() and verified._note_path(paths[2]).exists()
