"""SHA256SUMS manifests: posteriorzoo.zoo.manifest."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tracemalloc
from pathlib import Path

import pytest
from test_hub import make_h5
from zoo_helpers import assert_one_line_error, run

from posteriorzoo.errors import ChecksumError, ZooFormatError
from posteriorzoo.zoo.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SHOWN_LINE_CHARACTERS,
    read_manifest,
    sha256_file,
    verify_manifest,
    write_manifest,
)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A folder with two collections (one nested), a non-collection file and a manifest."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.h5").write_bytes(b"alpha" * 1000)
    (tmp_path / "sub" / "b.h5").write_bytes(bytes(range(256)) * 5000)  # > one 1 MiB block
    (tmp_path / "notes.txt").write_text("not covered")
    write_manifest(tmp_path)
    return tmp_path


def _flip_byte(path: Path, offset: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    data = bytes(range(256)) * 9000  # spans several read blocks
    (tmp_path / "x").write_bytes(data)
    assert sha256_file(tmp_path / "x") == hashlib.sha256(data).hexdigest()


def test_round_trip_lists_collections_only(folder: Path) -> None:
    entries = read_manifest(folder / MANIFEST_NAME)
    assert entries == {
        "a.h5": hashlib.sha256((folder / "a.h5").read_bytes()).hexdigest(),
        "sub/b.h5": hashlib.sha256((folder / "sub" / "b.h5").read_bytes()).hexdigest(),
    }
    assert verify_manifest(folder) == ["a.h5", "sub/b.h5"]


def test_lines_are_sorted_sha256sum_format(folder: Path) -> None:
    lines = (folder / MANIFEST_NAME).read_text().splitlines()
    assert [line.split("  ")[1] for line in lines] == ["a.h5", "sub/b.h5"]
    assert all(len(line.split("  ")[0]) == 64 for line in lines)


def test_explicit_names_and_manifest_never_lists_itself(folder: Path) -> None:
    write_manifest(folder, names=["notes.txt", MANIFEST_NAME, "a.h5"])
    assert sorted(read_manifest(folder / MANIFEST_NAME)) == ["a.h5", "notes.txt"]
    assert not (folder / (MANIFEST_NAME + ".tmp")).exists()


def test_flipped_byte_is_detected(folder: Path) -> None:
    _flip_byte(folder / "sub" / "b.h5", offset=1_100_000)  # in the second 1 MiB block
    with pytest.raises(ChecksumError, match=r"sub/b\.h5: SHA-256 mismatch"):
        verify_manifest(folder)
    assert verify_manifest(folder, ["a.h5"]) == ["a.h5"]  # the intact file still checks


def test_missing_file_is_reported(folder: Path) -> None:
    (folder / "a.h5").unlink()
    with pytest.raises(ChecksumError, match=r"a\.h5: missing"):
        verify_manifest(folder)


def test_all_problems_in_one_error(folder: Path) -> None:
    (folder / "a.h5").unlink()
    _flip_byte(folder / "sub" / "b.h5")
    with pytest.raises(ChecksumError) as info:
        verify_manifest(folder)
    assert "a.h5: missing" in str(info.value)
    assert "sub/b.h5: SHA-256 mismatch" in str(info.value)


def test_name_not_in_manifest_is_an_error(folder: Path) -> None:
    with pytest.raises(ChecksumError, match=r"notes\.txt: not listed"):
        verify_manifest(folder, ["notes.txt"])


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(ZooFormatError, match="manifest not found"):
        read_manifest(tmp_path / MANIFEST_NAME)
    with pytest.raises(ZooFormatError):
        verify_manifest(tmp_path)


@pytest.mark.parametrize(
    "line",
    [
        "deadbeef  a.h5",  # digest too short
        "0" * 64 + " a.h5",  # one space: not the separator
        "0" * 64 + "  ",  # no name
        "just some text",
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str) -> None:
    good = "0" * 64 + "  ok.h5"
    (tmp_path / MANIFEST_NAME).write_text(f"{good}\n{line}\n")
    with pytest.raises(ZooFormatError, match=rf"{MANIFEST_NAME}:2: not a sha256sum line"):
        read_manifest(tmp_path / MANIFEST_NAME)


def test_binary_marker_blank_lines_and_upper_case(tmp_path: Path) -> None:
    digest = "AB" * 32
    (tmp_path / MANIFEST_NAME).write_text(f"\n{digest} *x.h5\n\n".replace(" *", "  *"))
    assert read_manifest(tmp_path / MANIFEST_NAME) == {"x.h5": digest.lower()}


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils sha256sum")
def test_sha256sum_accepts_the_manifest(folder: Path) -> None:
    result = subprocess.run(
        ["sha256sum", "-c", MANIFEST_NAME], cwd=folder, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    _flip_byte(folder / "a.h5")
    failed = subprocess.run(["sha256sum", "-c", MANIFEST_NAME], cwd=folder, capture_output=True)
    assert failed.returncode != 0


# ---------------------------------------------------------------------- hostile manifests
#: Longest error line a hostile manifest may cause: a path, a reason and a cut quote.
LONGEST_ERROR_LINE = 1000


def _state(folder: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file under ``folder`` (a sparse gigabyte is
    not hashed)."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _peak_bytes(call) -> tuple[BaseException, int]:
    """The error ``call`` raises and the peak of Python memory allocated meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(ZooFormatError) as raised:
            call()
        return raised.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("size", [MAX_MANIFEST_BYTES + 1, 100 * 2**20, 2**30],
                         ids=["cap-plus-one", "100MiB", "1GiB"])
def test_a_manifest_over_the_cap_is_refused_unread(tmp_path: Path, capsys, size: int) -> None:
    collection = make_h5(tmp_path / "a.h5", 0)
    manifest = tmp_path / MANIFEST_NAME
    with open(manifest, "wb") as handle:
        handle.truncate(size)  # sparse: costs the test neither disk nor memory
    before = _state(tmp_path)
    code, out, err = run(capsys, "verify", collection)
    assert_one_line_error(code, err, f"{size:,} bytes, over the limit of "
                                     f"{MAX_MANIFEST_BYTES:,}")
    assert len(err.strip()) < LONGEST_ERROR_LINE
    error, peak = _peak_bytes(lambda: read_manifest(manifest))
    assert "over the limit" in str(error)
    assert peak < 2**20  # refused by its size: not a byte of it was read
    assert _state(tmp_path) == before


def test_a_manifest_without_a_size_is_read_up_to_the_cap(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).symlink_to("/dev/zero")  # endless, and its size says 0
    error, peak = _peak_bytes(lambda: verify_manifest(tmp_path))
    assert f"more than {MAX_MANIFEST_BYTES:,} bytes (not read further)" in str(error)
    assert peak < 3 * MAX_MANIFEST_BYTES
    assert len(str(error)) < LONGEST_ERROR_LINE


@pytest.mark.parametrize("line", ["x" * 3_000_000, "\0" * 1_000_000,
                                  "0" * 64 + " " + "n" * 500, "\U0001f600" * 300],
                         ids=["3M-characters", "1M-nul-bytes", "one-space-long-name",
                              "emoji"])
def test_a_long_bad_line_is_shown_cut_short(tmp_path: Path, capsys, line: str) -> None:
    collection = make_h5(tmp_path / "a.h5", 0)
    manifest = tmp_path / MANIFEST_NAME
    manifest.write_text(f"{'0' * 64}  a.h5\n{line}\n", encoding="utf-8")
    before = _state(tmp_path)
    code, out, err = run(capsys, "verify", collection)
    assert_one_line_error(code, err, f"{MANIFEST_NAME}:2: not a sha256sum line: ",
                          f"... ({len(line):,} characters)")
    assert len(err.strip()) < LONGEST_ERROR_LINE
    error, peak = _peak_bytes(lambda: read_manifest(manifest))
    quoted = str(error).split("not a sha256sum line: ", 1)[1]
    assert quoted == f"{repr(line)[:SHOWN_LINE_CHARACTERS]}... ({len(line):,} characters)"
    assert peak < 3 * MAX_MANIFEST_BYTES
    assert _state(tmp_path) == before


def test_a_short_bad_line_is_shown_whole(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text("just some text\n")
    with pytest.raises(ZooFormatError, match=r":1: not a sha256sum line: 'just some text'$"):
        read_manifest(tmp_path / MANIFEST_NAME)
