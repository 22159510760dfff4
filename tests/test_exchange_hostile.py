"""Import/export under hostile input: the output policy, all-or-nothing and idempotent
imports, and files built to exhaust memory or time (issue 9).

Every CLI case checks exit code 2, exactly one line on stderr, no traceback, and that
every file that existed before is byte-identical afterwards (and no file appeared).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors_bytes
from safetensors.torch import save_file
from zoo_helpers import assert_one_line_error, checkpoint, flip_byte_in_chunk, run

from posteriorzoo.collection import export_all, export_checkpoint, import_checkpoints, verify
from posteriorzoo.errors import (
    ChecksumError,
    OutputExistsError,
    PosteriorZooError,
    ZooFormatError,
)
from posteriorzoo.zoo import (
    KeyMap,
    ReadLimits,
    create_zoo,
    open_zoo,
    read_checkpoint,
    read_release_archive,
    sniff_format,
)
from posteriorzoo.zoo import keymap as keymap_module

GOOD = 70
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- helpers
def snapshot(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (hidden temporaries included)."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def make_zoo(path: Path, seeds) -> Path:
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0)) as zoo:
        for seed in seeds:
            zoo.append(checkpoint(seed), seed=seed, test_accuracy=0.5)
    return path


def header_bytes(header: dict) -> bytes:
    """A safetensors file from a raw header dict and no tensor data."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text


def write_with_metadata(path: Path, state, **metadata: str) -> Path:
    path.write_bytes(save_safetensors_bytes(state, metadata=metadata))
    return path


def digests(path: Path) -> list[str]:
    with open_zoo(path) as zoo:
        return zoo.digests


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A collection of 70 checkpoints and its export: 000000..000069.safetensors."""
    root = tmp_path_factory.mktemp("exported")
    zoo = make_zoo(root / "source.h5", range(GOOD))
    export_all(zoo, root / "files")
    return root / "source.h5", sorted((root / "files").glob("*.safetensors"))


@pytest.fixture
def work(tmp_path):
    """An empty folder for the case, and a collection of 3 checkpoints in it."""
    folder = tmp_path / "work"
    folder.mkdir()
    return folder, make_zoo(folder / "zoo.h5", range(100, 103))


# ---------------------------------------------------------------------- export policy
def test_export_never_writes_onto_its_input(capsys, work):
    folder, zoo = work
    before = snapshot(folder)
    for extra in ([], ["--overwrite"]):
        code, _, err = run(capsys, "export", zoo, 0, "--out", zoo, *extra)
        assert_one_line_error(code, err, "input")
        assert snapshot(folder) == before
    # a folder export may not replace the folder that holds the collection
    code, _, err = run(capsys, "export", zoo, "--all", "--out", folder, "--overwrite")
    assert_one_line_error(code, err)
    assert snapshot(folder) == before


def test_export_refuses_an_existing_output_unless_overwrite(capsys, work):
    folder, zoo = work
    target = folder / "c.safetensors"
    target.write_bytes(b"precious")
    before = snapshot(folder)
    code, _, err = run(capsys, "export", zoo, 1, "--out", target)
    assert_one_line_error(code, err, "already exists")
    assert snapshot(folder) == before
    with pytest.raises(OutputExistsError):
        export_checkpoint(zoo, 1, target)
    code, out, err = run(capsys, "export", zoo, 1, "--out", target, "--overwrite")
    assert code == 0, err
    state, header = read_checkpoint(target)
    assert all(torch.equal(state[k], checkpoint(101)[k]) for k in state)
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


def test_export_all_refuses_an_existing_folder_unless_overwrite(capsys, work):
    folder, zoo = work
    out = folder / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = snapshot(folder)
    code, _, err = run(capsys, "export", zoo, "--all", "--out", out)
    assert_one_line_error(code, err, "already exists")
    assert snapshot(folder) == before
    code, _, err = run(capsys, "export", zoo, "--all", "--out", out, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [f"{i:06d}.safetensors" for i in range(3)]
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


def test_export_needs_an_existing_parent_folder(capsys, work):
    folder, zoo = work
    before = snapshot(folder)
    for argv in ([1, "--out", folder / "absent" / "c.safetensors"],
                 ["--all", "--out", folder / "absent" / "d"]):
        code, _, err = run(capsys, "export", zoo, *argv)
        assert_one_line_error(code, err, "does not exist")
        assert not (folder / "absent").exists()
        assert snapshot(folder) == before


def test_export_verifies_checkpoints(capsys, tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    zoo = make_zoo(folder / "zoo.h5", range(3))
    flip_byte_in_chunk(zoo, "conv2.weight", offset=4 * 250 * 1 + 2)  # inside checkpoint 1
    before = snapshot(folder)
    for argv in ([1, "--out", folder / "c.safetensors"], ["--all", "--out", folder / "all"]):
        code, _, err = run(capsys, "export", zoo, *argv)
        assert_one_line_error(code, err, "corrupt")
        assert snapshot(folder) == before
    # a collection opened without verification: export still checks the checkpoint
    with pytest.raises(ChecksumError), open_zoo(zoo) as opened:
        export_checkpoint(opened, 1, folder / "c.safetensors")
    assert snapshot(folder) == before
    code, _, err = run(capsys, "export", zoo, 0, "--out", folder / "c.safetensors")
    assert code == 0, err  # an intact checkpoint of a damaged file can be rescued
    code, _, err = run(capsys, "export", zoo, 1, "--out", folder / "d.safetensors", "--no-verify")
    assert code == 0, err


# ---------------------------------------------------------------------- all or nothing
@pytest.mark.parametrize("bad", [
    {"metadata": json.dumps({"seed": "abc"})},
    {"metadata": "{not json"},
    {"metadata": json.dumps({"diverged": "yes"})},
    {"metadata": json.dumps(["a list"])},
    {"num_classes": "ten"},
    {"num_classes": "-3"},
    {"model_options": "[1, 2]"},
    {"state_keys": "5"},
    {"state_keys": json.dumps([1, 2])},
    {"metadata": "[" * 100_000 + "]" * 100_000},
])
def test_one_bad_header_among_good_files_changes_nothing(capsys, exported, work, bad):
    source, files = exported
    folder, zoo = work
    state, header = read_checkpoint(files[5])
    header.update(bad)
    write_with_metadata(folder / "bad.safetensors", state, **header)
    inputs = [*files[:40], folder / "bad.safetensors", *files[40:]]
    before = snapshot(folder)
    # small batches: a check left to the append would only stop after 5 committed batches
    code, _, err = run(capsys, "import", "--no-progress", "--checkpoints-per-batch", 8,
                       "--out", zoo, *inputs)
    assert_one_line_error(code, err, "bad.safetensors")
    code, _, err = run(capsys, "import", "--no-progress", "--checkpoints-per-batch", 8,
                       "--out", folder / "new.h5", *inputs)
    assert_one_line_error(code, err, "bad.safetensors")
    assert snapshot(folder) == before


def test_bad_tensor_dtype_and_bad_values(capsys, work):
    folder, zoo = work
    state = checkpoint(7)
    cases = {
        "bf16": {k: v.to(torch.bfloat16) for k, v in state.items()},
        "nan": {**state, "fc.bias": torch.full_like(state["fc.bias"], float("nan"))},
    }
    for name, tensors in cases.items():
        save_file(tensors, str(folder / f"{name}.safetensors"))
    before = snapshot(folder)
    for name, fragment in (("bf16", "dtype"), ("nan", "NaN")):
        code, _, err = run(capsys, "import", "--no-progress", "--out", zoo,
                           folder / f"{name}.safetensors")
        assert_one_line_error(code, err, fragment)
    assert snapshot(folder) == before


def test_failed_import_into_a_new_path_leaves_no_file(monkeypatch, exported, tmp_path):
    import posteriorzoo.collection.exchange as exchange

    _, files = exported
    calls = []

    def fail_on_second(name):
        calls.append(name)
        if len(calls) == 2:
            raise ZooFormatError("simulated failure after one committed batch")

    monkeypatch.setattr(exchange, "fault_point", fail_on_second)
    with pytest.raises(ZooFormatError, match="simulated"):
        import_checkpoints(tmp_path / "new.h5", files[:10], checkpoints_per_batch=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_import_refuses_the_collection_as_its_own_input(capsys, work):
    folder, zoo = work
    before = snapshot(folder)
    code, _, err = run(capsys, "import", "--no-progress", "--out", zoo, zoo)
    assert_one_line_error(code, err, "input")
    assert snapshot(folder) == before


# ---------------------------------------------------------------------- idempotence
def test_reimport_adds_nothing_and_repeats_are_skipped(capsys, exported, tmp_path):
    _, files = exported
    target = tmp_path / "copy.h5"
    code, out, err = run(capsys, "import", "--no-progress", "--out", target, *files[:5], files[2])
    assert code == 0, err
    assert "5 checkpoint(s) added" in out and "1 repeated" in out
    first = target.read_bytes()
    code, out, err = run(capsys, "import", "--no-progress", "--out", target, *files[:5])
    assert code == 0, err
    assert "0 checkpoint(s) added" in out and "skipped 5 already in the collection" in out
    assert target.read_bytes() == first
    summary = import_checkpoints(target, files[3:8])
    assert summary.indices == range(5, 8) and summary.skipped_existing == 2
    assert digests(target) == [digests_of(f) for f in files[:8]]


def digests_of(file: Path) -> str:
    _, header = read_checkpoint(file)
    return json.loads(header["metadata"])["sha256"]


IMPORTER = (
    "import sys; from posteriorzoo.collection import import_checkpoints; "
    "import_checkpoints(sys.argv[1], sys.argv[2:], checkpoints_per_batch=4)"
)


def _killed_import(target: Path, files: list[Path], at: str) -> None:
    env = {**os.environ, "POSTERIORZOO_KILL_AT": at,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", IMPORTER, str(target), *map(str, files)],
                            env=env, capture_output=True, timeout=300)
    assert result.returncode == -9, result.stderr.decode()


def test_import_killed_part_way_finishes_when_run_again(exported, tmp_path):
    _, files = exported
    inputs = files[10:30]
    interrupted = make_zoo(tmp_path / "interrupted.h5", range(GOOD, GOOD + 2))
    whole = tmp_path / "whole.h5"
    shutil.copy(interrupted, whole)
    _killed_import(interrupted, inputs, "import-batch:2")
    assert len(digests(interrupted)) == 2 + 8  # two batches of 4 were committed
    summary = import_checkpoints(interrupted, inputs, checkpoints_per_batch=4)
    assert summary.skipped_existing == 8 and summary.indices == range(10, 22)
    import_checkpoints(whole, inputs, checkpoints_per_batch=4)
    assert digests(interrupted) == digests(whole)
    assert len(set(digests(interrupted))) == 22
    assert verify(interrupted).ok
    # a new collection killed after a committed batch leaves nothing at its path
    new = tmp_path / "new.h5"
    _killed_import(new, inputs, "import-batch:1")
    assert not new.exists()
    import_checkpoints(new, inputs)  # reclaims the dead process's temporary file
    assert digests(new) == digests(whole)[2:]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ---------------------------------------------------------------------- hostile files
def test_zero_filled_file_is_refused_at_once(capsys, work):
    folder, zoo = work
    fake = folder / "zeros.safetensors"
    with open(fake, "wb") as handle:
        handle.truncate(3 * 2**30)  # 3 GB of zeros (sparse: no disk space used)
    before = snapshot_names_and_zoo(folder, zoo)
    start = time.perf_counter()
    code, _, err = run(capsys, "import", "--no-progress", "--out", zoo, fake)
    assert_one_line_error(code, err, "neither a safetensors file nor a tar archive")
    with pytest.raises(ZooFormatError, match="not a valid safetensors"):
        read_checkpoint(fake)
    assert time.perf_counter() - start < 2
    assert snapshot_names_and_zoo(folder, zoo) == before


def snapshot_names_and_zoo(folder: Path, zoo: Path):
    """File names in ``folder`` and the collection's bytes (avoids hashing 3 GB)."""
    return sorted(p.name for p in folder.iterdir()), zoo.read_bytes()


@pytest.mark.parametrize("length", [2**62, 2**40, 10**6])
def test_huge_declared_header_is_refused(capsys, work, length):
    folder, zoo = work
    fake = folder / "huge.safetensors"
    fake.write_bytes(length.to_bytes(8, "little") + b'{"a": {"dtype": "F32", ' + b" " * 2000)
    before = snapshot(folder)
    code, _, err = run(capsys, "import", "--no-progress", "--out", zoo, fake)
    assert_one_line_error(code, err, "header")
    assert snapshot(folder) == before


def test_header_and_file_size_limits(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file(checkpoint(0), str(good))
    with pytest.raises(ZooFormatError, match="header of .* exceeds the limit"):
        read_checkpoint(good, limits=ReadLimits(header_bytes=64))
    with pytest.raises(ZooFormatError, match="exceeds the limit"):
        read_checkpoint(good, limits=ReadLimits(checkpoint_bytes=1000))
    # a file far larger than the architecture's checkpoints is refused before reading
    big = {**checkpoint(0), "optimizer.state": torch.zeros(400_000, dtype=torch.float64)}
    save_file(big, str(tmp_path / "big.safetensors"))
    with pytest.raises(ZooFormatError, match="exceeds the limit"):
        import_checkpoints(tmp_path / "z.h5", [tmp_path / "big.safetensors"],
                           architecture="optunet", dataset="d", method="de")
    # a key of absurd length
    path = tmp_path / "long.safetensors"
    path.write_bytes(header_bytes({"k" * 10_000: {"dtype": "F32", "shape": [],
                                                  "data_offsets": [0, 0]}}))
    with pytest.raises(ZooFormatError, match="state key"):
        read_checkpoint(path)
    assert not (tmp_path / "z.h5").exists()


def _tar_header(name: str, size: int, kind: bytes = tarfile.REGTYPE,
                fmt: int = tarfile.GNU_FORMAT) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.type = kind
    return info.tobuf(format=fmt)


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=9)


def test_archive_member_declared_too_large(capsys, work):
    folder, zoo = work
    archive = folder / "mnist-optunet-0-0.tgz"
    # a member that claims 10 GB; its data is never read
    archive.write_bytes(_gzip(_tar_header("m/model_0.safetensors", 10 * 2**30)
                              + b"\0" * 4096))
    before = snapshot(folder)
    start = time.perf_counter()
    code, _, err = run(capsys, "import", "--no-progress", "--out", zoo, archive)
    assert_one_line_error(code, err, "declares 10737418240 bytes")
    code, _, err = run(capsys, "import", "--no-progress", "--out", folder / "new.h5", archive)
    assert_one_line_error(code, err, "declares")
    assert time.perf_counter() - start < 5
    assert snapshot(folder) == before


def test_gzip_bombs_fail_fast_with_bounded_memory(capsys, tmp_path):
    limits = ReadLimits(checkpoint_bytes=2**20, archive_header_bytes=2**16,
                        archive_members=50, archive_bytes=4 * 2**20)
    # 1: many honest-looking members whose total expands past the archive cap
    members = b"".join(_tar_header(f"doc/readme{i}.txt", 2**20 - 512) + b"\0" * (2**20 - 512)
                       for i in range(40))
    many = tmp_path / "many.tgz"
    many.write_bytes(_gzip(members + b"\0" * 1024))
    # 2: a long-name record of 64 MiB, read by tar itself before any member is returned
    longname = tmp_path / "longname.tgz"
    longname.write_bytes(_gzip(_tar_header("././@LongLink", 64 * 2**20, tarfile.GNUTYPE_LONGNAME)
                               + b"a" * (64 * 2**20)))
    # 3: too many (empty) members
    crowd = tmp_path / "crowd.tgz"
    crowd.write_bytes(_gzip(b"".join(_tar_header(f"d{i}/", 0, tarfile.DIRTYPE)
                                     for i in range(200)) + b"\0" * 1024))
    # 4: gzip-compressed zeros: not a tar archive at all
    zeros = tmp_path / "zeros.tgz"
    zeros.write_bytes(_gzip(b"\0" * (64 * 2**20)))
    assert max(p.stat().st_size for p in (many, longname, crowd, zeros)) < 200_000
    cases = [(many, "expands beyond"), (longname, "more data than its member headers"),
             (crowd, "more than 50 archive members"), (zeros, "does not hold a tar")]
    for archive, fragment in cases:
        tracemalloc.start()
        start = time.perf_counter()
        with pytest.raises(ZooFormatError, match=fragment):
            list(read_release_archive(archive, limits=limits))
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert elapsed < 5, archive
        assert peak < 16 * 2**20, (archive, peak)
    # through the CLI with the default limits: one line, nothing created
    before = snapshot(tmp_path)
    for archive in (longname, zeros):
        code, _, err = run(capsys, "import", "--no-progress", "--out", tmp_path / "z.h5", archive,
                           "--architecture", "optunet", "--dataset", "d", "--method", "de")
        assert_one_line_error(code, err, archive.name)
    assert snapshot(tmp_path) == before


def test_formats_are_told_by_their_first_bytes(tmp_path):
    save_file(checkpoint(0), str(tmp_path / "a.bin"))
    assert sniff_format(tmp_path / "a.bin") == "safetensors"
    with tarfile.open(tmp_path / "b.bin", "w") as archive:
        data = b"x"
        info = tarfile.TarInfo("x.txt")
        info.size = 1
        archive.addfile(info, io.BytesIO(data))
    assert sniff_format(tmp_path / "b.bin") == "tar"
    (tmp_path / "c.bin").write_bytes(_gzip((tmp_path / "b.bin").read_bytes()))
    assert sniff_format(tmp_path / "c.bin") == "tar.gz"
    for content in (b"", b"PK\x03\x04zip", b"\x89HDF\r\n\x1a\n" + b"\0" * 600,
                    (20).to_bytes(8, "little") + b"[" + b" " * 19):
        (tmp_path / "d.bin").write_bytes(content)
        with pytest.raises(ZooFormatError, match="neither"):
            sniff_format(tmp_path / "d.bin")


# ---------------------------------------------------------------------- key maps
@pytest.mark.parametrize("content, fragment", [
    ({"rules": [["^(a+)+$", ""]]}, "nested"),
    ({"rules": [["(x|xy)*z", ""]]}, "nested"),
    ({"drop": ["(\\w+\\.)*opt"]}, "nested"),
    ({"rules": [["(a)\\1", ""]]}, "backreference"),
    ({"rules": [["a" * 400, ""]]}, "400 characters"),
    ({"rules": [["a*b*c*d*", ""]]}, "repeats"),
    ({"rules": 5}, "'rules' must be a list"),
    ({"rules": [["only a pattern"]]}, "pair of strings"),
    ({"rules": [[1, 2]]}, "must be a string"),
    ({"rules": [["^x", "\\9"]]}, "replacement"),
    ({"rename": {"a": 1}}, "'rename' must map strings"),
    ({"rename": ["a", "b"]}, "'rename' must map strings"),
    ({"drop": "opt"}, "'drop' must be a list"),
    ({"drop": [5]}, "must be a string"),
    ({"keys": {}}, "unknown entries"),
    ([1, 2], "JSON object"),
    ("[" * 100_000, "not valid JSON"),
])
def test_bad_key_maps_are_refused(capsys, work, content, fragment):
    folder, zoo = work
    key_map = folder / "keys.json"
    key_map.write_text(content if isinstance(content, str) else json.dumps(content))
    good = folder / "good.safetensors"
    save_file(checkpoint(5), str(good))
    before = snapshot(folder)
    start = time.perf_counter()
    code, _, err = run(capsys, "import", "--no-progress", "--out", zoo, good, "--key-map", key_map)
    assert_one_line_error(code, err, fragment)
    assert time.perf_counter() - start < 2
    assert snapshot(folder) == before
    with pytest.raises(ZooFormatError):
        KeyMap.from_file(key_map)


def test_safe_key_maps_still_work():
    key_map = KeyMap(rules=[("^module\\.", ""), ("^layer(\\d+)\\.(\\d+)\\.", "l\\1_\\2.")],
                     drop=["^opt(imizer)?\\."], rename={"head.w": "fc.weight"})
    mapped = key_map.apply({"module.layer1.0.w": torch.zeros(1), "optimizer.x": torch.zeros(1),
                            "head.w": torch.zeros(1)})
    assert list(mapped) == ["l1_0.w", "fc.weight"]
    with pytest.raises(ZooFormatError, match="state key"):
        key_map.apply({"k" * 1000: torch.zeros(1)})


@pytest.mark.parametrize("size", [keymap_module.MAX_KEY_MAP_BYTES + 1, 2**30],
                         ids=["cap-plus-one", "1GiB-sparse"])
def test_a_key_map_over_the_cap_is_refused_unread(capsys, work, size):
    folder, zoo = work
    key_map = folder / "keys.json"
    with open(key_map, "wb") as handle:
        handle.truncate(size)  # sparse: costs the test neither disk nor memory
    good = folder / "good.safetensors"
    save_file(checkpoint(5), str(good))
    before = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    code, _, err = run(capsys, "import", "--no-progress", "--out", zoo, good, "--key-map", key_map)
    assert_one_line_error(code, err, f"{size:,} bytes, over the limit of "
                                     f"{keymap_module.MAX_KEY_MAP_BYTES:,}")
    tracemalloc.start()
    try:
        with pytest.raises(ZooFormatError, match="a key map is a short JSON file"):
            KeyMap.from_file(key_map)
        assert tracemalloc.get_traced_memory()[1] < 2**20  # refused by its size, unread
    finally:
        tracemalloc.stop()
    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == before


#: A pattern the checks allow (3 repeats, none nested) that backtracks for about a second
#: on a long key it does not match: harmless once, not on every key of a large header.
SLOW_PATTERN = "a*a*a*$b"
#: Long distinct keys, as many as an OptuNet-sized header (64 KiB + 1 KiB a tensor) holds.
LONG_KEYS = ["a" * 250 + f"{number:06d}" for number in range(150)]


@pytest.mark.parametrize("field, bound", [("rules", 1.0), ("drop", 1.0), ("rules", None)],
                         ids=["rules", "drop", "rules-default-bound"])
def test_key_map_matching_time_is_bounded_in_total(capsys, monkeypatch, work, field, bound):
    if bound is not None:  # a smaller bound keeps the case short; the last one is real
        monkeypatch.setattr(keymap_module, "MAX_MATCHING_SECONDS", bound)
    bound = keymap_module.MAX_MATCHING_SECONDS
    folder, _ = work
    key_map = folder / "keys.json"
    key_map.write_text(json.dumps({field: [[SLOW_PATTERN, ""]] if field == "rules"
                                   else [SLOW_PATTERN]}))
    foreign = folder / "foreign.safetensors"
    save_file({key: torch.zeros(1) for key in LONG_KEYS}, str(foreign))
    start = time.perf_counter()
    re.search(SLOW_PATTERN, LONG_KEYS[0])
    unbounded = len(LONG_KEYS) * (time.perf_counter() - start)
    assert unbounded > 3 * bound  # without the bound, one pass over the keys takes long
    before = snapshot(folder)
    start = time.perf_counter()
    code, _, err = run(capsys, "import", "--no-progress", "--architecture", "optunet",
                       "--dataset", "mnist", "--method", "de", "--out", folder / "new.h5",
                       foreign, "--key-map", key_map)
    elapsed = time.perf_counter() - start
    assert_one_line_error(code, err, f"key map {key_map}: its patterns took over {bound:g} s")
    assert bound < elapsed < bound + 3  # refused within a few seconds of the bound
    assert snapshot(folder) == before  # nothing written, the inputs unchanged


def test_a_key_map_matches_each_distinct_key_once(monkeypatch):
    monkeypatch.setattr(keymap_module, "MAX_MATCHING_SECONDS", 2.0)
    key_map = KeyMap(rules=[(SLOW_PATTERN, "")])
    state = {"a" * 160 + "x": torch.zeros(1)}
    start = time.perf_counter()
    key_map.apply(state)
    once = time.perf_counter() - start
    inputs = int(3 * 2.0 / once) + 1  # matched again on each, they would be refused
    for _ in range(inputs):  # the inputs of one import share their keys
        assert list(key_map.apply(state)) == list(state)


# ---------------------------------------------------------------------- recorded digests
def test_altered_tensor_bytes_are_refused(capsys, exported, work):
    """An exported file whose tensor bytes changed while its header kept the digest."""
    _, files = exported
    folder, zoo = work
    altered = folder / "altered.safetensors"
    data = bytearray(files[3].read_bytes())
    data[-4] ^= 0x01  # the lowest mantissa byte of the last float: still a finite value
    altered.write_bytes(bytes(data))
    state, _ = read_checkpoint(altered)  # a well-formed file: only the digest tells
    assert all(torch.isfinite(value).all() for value in state.values())
    before = snapshot(folder)
    for target in (zoo, folder / "new.h5"):
        code, _, err = run(capsys, "import", "--no-progress", "--out", target,
                           *files[:2], altered)
        assert_one_line_error(code, err, "altered.safetensors", "differ from the SHA-256")
        assert snapshot(folder) == before
    with pytest.raises(ChecksumError, match="altered or corrupt"):
        import_checkpoints(folder / "new.h5", [altered])
    assert snapshot(folder) == before
    # asked not to verify, the altered tensors are imported as they are
    code, _, err = run(capsys, "import", "--no-progress", "--no-verify", "--out",
                       folder / "new.h5", altered)
    assert code == 0 and err == "", err


def test_input_without_a_digest_imports_with_one_warning(capsys, work):
    folder, zoo = work
    plain = [folder / f"plain{i}.safetensors" for i in range(3)]
    for seed, path in enumerate(plain):
        save_file(checkpoint(200 + seed), str(path))  # no header metadata at all
    code, out, err = run(capsys, "import", "--no-progress", "--out", zoo, *plain)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("posteriorzoo import: warning: 3 input checkpoint(s) record no "
                               "SHA-256"), lines
    assert "plain0.safetensors and 2 more" in lines[0]
    assert digests(zoo)[3:] == [digests_of_state(checkpoint(200 + seed)) for seed in range(3)]


def digests_of_state(state) -> str:
    from posteriorzoo.zoo.schema import checkpoint_digest

    return checkpoint_digest({key: value.numpy() for key, value in state.items()}, list(state))


# ---------------------------------------------------------------------- decompression bombs
BOMB_MEMBER = 2**30  # what the member declares and holds (zeros), 1 GiB
PEAK_BOUND = 600 * 2**20  # the interpreter with torch and h5py alone takes about 400 MB


def _bomb(path: Path, prefix: bytes = b"", size: int = BOMB_MEMBER) -> Path:
    """A release-like .tgz of one member of ``size`` bytes: ``prefix``, then zeros.

    Written as a stream, so the test never holds the member in memory (about 5 MB on
    disk at gzip level 1).
    """
    info = tarfile.TarInfo("models/model_0.safetensors")
    info.size = size
    zeros = bytes(2**24)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1,
                                               mtime=0) as out:
        out.write(info.tobuf(format=tarfile.GNU_FORMAT))
        out.write(prefix)
        left = size - len(prefix)
        while left:
            out.write(zeros[:min(left, len(zeros))])
            left -= min(left, len(zeros))
        out.write(bytes(-size % 512 + 2 * 512))  # padding and the end-of-archive blocks
    return path


def _tensor_header(size: int, **metadata: str) -> bytes:
    """The first bytes of a safetensors file of ``size`` bytes: one float32 tensor that
    fills the rest, and ``metadata``."""
    def encoded(data_bytes: int) -> bytes:
        header = {"w": {"dtype": "F32", "shape": [data_bytes // 4],
                        "data_offsets": [0, data_bytes]}}
        if metadata:
            header["__metadata__"] = metadata
        return json.dumps(header).encode()

    text = encoded(size)
    length = len(text) + (-len(text) % 8) + 8  # room for the longer numbers, 8-aligned
    text = encoded(size - 8 - length).ljust(length)
    return length.to_bytes(8, "little") + text


def _peak_of_import(args: list) -> tuple[int, str, int]:
    """Run ``posteriorzoo import ARGS`` in a child process; its exit code, stderr, and
    peak resident memory in bytes (measured by a wrapper process whose only child it is,
    so no other test's children count)."""
    wrapper = ("import resource, subprocess, sys; "
               "done = subprocess.run([sys.executable, '-m', 'posteriorzoo', 'import', "
               "*sys.argv[1:]], capture_output=True, text=True); "
               "sys.stderr.write(done.stderr); "
               "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", wrapper, *map(str, args)], env=env,
                            capture_output=True, text=True, timeout=300)
    code, peak_kib = result.stdout.split()
    return int(code), result.stderr, int(peak_kib) * 1024


def test_gzip_bomb_member_without_architecture_stays_small(tmp_path):
    """The audit's bomb: 1 GiB of zeros in one member, no --architecture to bound it."""
    bomb = _bomb(tmp_path / "bomb.tgz")
    assert bomb.stat().st_size < 8 * 2**20
    before = snapshot(tmp_path)
    start = time.perf_counter()
    code, err, peak = _peak_of_import(["--no-progress", bomb, "--out", tmp_path / "z.h5",
                                       "--dataset", "d", "--method", "de"])
    assert_one_line_error(code, err, "bomb.tgz", "header length 0")
    assert peak < PEAK_BOUND, f"peak {peak / 2**20:.0f} MB"
    assert time.perf_counter() - start < 60
    assert snapshot(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("metadata, fragment", [
    ({}, "cannot tell the new collection's architecture"),
    ({"format": "posteriorzoo-checkpoint", "architecture": "optunet", "dataset": "d",
      "method": "de", "num_classes": "10"}, "exceeds the limit"),
], ids=["no-architecture", "architecture-in-header"])
def test_well_formed_bomb_header_is_refused_before_its_tensors(tmp_path, metadata, fragment):
    """A valid header declaring a 1 GiB tensor of zeros: refused from the header alone."""
    bomb = _bomb(tmp_path / "bomb.tgz", _tensor_header(BOMB_MEMBER, **metadata))
    before = snapshot(tmp_path)
    code, err, peak = _peak_of_import(["--no-progress", bomb, "--out", tmp_path / "z.h5"])
    assert_one_line_error(code, err, "bomb.tgz", fragment)
    assert peak < PEAK_BOUND, f"peak {peak / 2**20:.0f} MB"
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("metadata, given, fragment", [
    ({}, {}, "cannot tell the new collection's architecture"),
    ({}, {"architecture": "optunet", "dataset": "d", "method": "de"}, "over the limit"),
    ({"format": "posteriorzoo-checkpoint", "architecture": "optunet", "dataset": "d",
      "method": "de"}, {}, "exceeds the limit"),
    ({"format": "posteriorzoo-checkpoint", "architecture": "no-such-net", "dataset": "d",
      "method": "de"}, {}, "no-such-net"),
], ids=["nothing-tells", "given", "header-tells", "unknown-architecture"])
def test_huge_declared_tensors_are_refused_from_the_header(tmp_path, metadata, given,
                                                          fragment):
    """Only the header is read: the archive ends 1 MiB after it (its tensors would be
    1 GiB), and the refusal names the header's problem, not a truncation."""
    archive = tmp_path / "crafted.tgz"
    info = tarfile.TarInfo("models/model_0.safetensors")
    info.size = BOMB_MEMBER
    archive.write_bytes(_gzip(info.tobuf(format=tarfile.GNU_FORMAT)
                              + _tensor_header(BOMB_MEMBER, **metadata) + bytes(2**20)))
    tracemalloc.start()
    with pytest.raises(PosteriorZooError, match=fragment):
        import_checkpoints(tmp_path / "z.h5", [archive], **given)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 * 2**20
    assert not (tmp_path / "z.h5").exists()


@pytest.mark.parametrize("entry, fragment", [
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, "declares 8 bytes"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "valid shape"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}, "does not start"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}, "declare"),
])
def test_tensor_entries_must_cover_the_data_exactly(tmp_path, entry, fragment):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(header_bytes({"w": entry}) + b"\0" * 8)
    with pytest.raises(ZooFormatError, match=fragment):
        read_checkpoint(path)
