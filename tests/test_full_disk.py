"""Every writing command on a full disk: one line, exit code 2, nothing left, inputs kept.

The promise (issue 16): a command whose output does not fit prints ``no space left on
device: FOLDER needs ...`` and exits with code 2; it leaves no temporary output, the
inputs are unchanged, and an append to an existing collection leaves it as it was (its
committed checkpoints readable, ``verify`` passing). Before, HDF5's failed flush crashed
the process when it exited (a segmentation fault, exit 139).

- **Real full disks.** Each command runs in a subprocess (a crash shows as a signal)
  with its output on a small tmpfs mounted for the test, its inputs outside. Mounting
  needs root (CI runs as root); elsewhere these tests are skipped with the reason.
- **Injected failures**, always run: ENOSPC raised inside HDF5's flush, Python's file
  writes and matplotlib's ``savefig``; a real HDF5 write failure under a file-size limit
  (no root needed); a reservation or free-space check that says no.

With ``POSTERIORZOO_PROBE_LOG`` each test is a probe of class "full disk"
(``tests/conftest.py``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import pytest
from fuzz_driver import SPEC, make_collection
from zoo_helpers import assert_one_line_error, checkpoint, run

from posteriorzoo import outputs
from posteriorzoo.collection import verify
from posteriorzoo.errors import NoSpaceError
from posteriorzoo.zoo import create_zoo, open_zoo

REPO = Path(__file__).resolve().parents[1]
QUIET = "--no-progress"
#: HDF5's message for a write that found the disk full, as h5py raises it.
HDF5_FULL = ("Unable to synchronously flush file (file write failed: time = Mon Jan  1 "
             "00:00:00 2026\n, filename = 'x.h5', file descriptor = 5, errno = 28, error "
             "message = 'No space left on device', buf = 0x1, total write size = 16384, "
             "bytes this sub-write = 16384, offset = 862184)")


# ---------------------------------------------------------------------- helpers
def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def subprocess_env(tmpdir: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "POSTERIORZOO_KILL_AT"}
    env.update(TMPDIR=str(tmpdir), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    return env


def run_command(argv: list, tmpdir: Path, **options) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posteriorzoo", *map(str, argv)],
                          env=subprocess_env(tmpdir), capture_output=True, text=True,
                          timeout=600, **options)


def assert_no_space_line(result: subprocess.CompletedProcess, folder: Path) -> None:
    """Exit code 2 (not a signal), one line naming ``folder``, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f": error: no space left on device: {folder} needs " in lines[0], lines[0]
    assert "HDF5" not in lines[0] and "errno" not in lines[0], lines[0]


def free_bytes(folder: Path) -> int:
    stats = os.statvfs(folder)
    return stats.f_bfree * stats.f_frsize


def fill(folder: Path, leave: int) -> None:
    """Write a filler file so that about ``leave`` bytes stay free in ``folder``."""
    with open(folder / "filler", "wb") as handle:
        size = max(0, free_bytes(folder) - leave)
        while size > 0:
            try:
                size -= handle.write(b"\0" * min(size, 1 << 20))
            except OSError as error:  # the last page: full is what was asked for
                if error.errno != errno.ENOSPC:
                    raise
                break


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Callable[[int], Path]]:
    """Mount tmpfs file systems of a given size (kB) under ``tmp_path``; unmounted after."""
    mounted: list[Path] = []

    def mount(kilobytes: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root (CI runs the tests as root)")
        disk = tmp_path / f"disk{len(mounted)}"
        disk.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kilobytes}k", "tmpfs",
                                 str(disk)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Collections, exported checkpoints and a train spec, outside every small disk."""
    root = tmp_path_factory.mktemp("inputs")
    make_collection(root / "target.h5", 0, 8)
    make_collection(root / "method.h5", 100, 6)
    exported = root / "exported"
    with open_zoo(root / "method.h5") as zoo:
        from posteriorzoo.collection import export_checkpoint

        exported.mkdir()
        for index in range(len(zoo)):
            export_checkpoint(zoo, index, exported / f"{index:06d}.safetensors")
    (root / "spec.toml").write_text(SPEC)
    return {"root": root, "target": root / "target.h5", "method": root / "method.h5",
            "exported": exported, "spec": root / "spec.toml"}


# ---------------------------------------------------------------------- real full disks
# command -> (disk size in kB, bytes left free, argv given the inputs and the disk)
COMMANDS: dict[str, tuple[int, int, Callable[[dict, Path], list]]] = {
    "canonicalize": (400, 400_000, lambda i, d: [
        "canonicalize", i["target"], "--out", d / "canonical.h5", QUIET]),
    "import": (400, 400_000, lambda i, d: [
        "import", "--out", d / "new.h5", *sorted(i["exported"].iterdir()), QUIET]),
    "train": (400, 400_000, lambda i, d: [
        "train", i["spec"], "--out", d / "trained.h5", "--backend", "serial", QUIET]),
    "mmd": (400, 400_000, lambda i, d: [
        "mmd", i["target"], i["method"], "--symmetries", "both", "--out", d / "report",
        QUIET]),
    "report": (400, 400_000, lambda i, d: [
        "report", i["target"], f"DE={i['method']}", "--splits", "2", "--n-images", "50",
        "--n-pairs", "3", "--out", d / "report", QUIET]),
    "plot": (400, 0, lambda i, d: [
        "plot", "pca", i["target"], "--out", d / "pca"]),
    "min-mass": (400, 0, lambda i, d: [
        "min-mass", i["target"], "--out", d / "mass", QUIET]),
    "export": (400, 0, lambda i, d: [
        "export", i["target"], "3", "--out", d / "one.safetensors"]),
    "export-all": (400, 0, lambda i, d: [
        "export", i["target"], "--all", "--out", d / "all"]),
    "study": (400, 0, lambda i, d: [
        "study", "toy", "--networks", "50", "--points", "20", "--out", d / "toy", QUIET]),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_full_disk(command, inputs, small_disk, tmp_path):
    size, leave, argv = COMMANDS[command]
    disk = small_disk(size)
    fill(disk, leave)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    before = snapshot(inputs["root"])

    result = run_command(argv(inputs, disk), tmpdir)

    assert_no_space_line(result, disk)
    left = sorted(p.name for p in disk.iterdir())
    assert left == ["filler"], f"left on the disk: {left}"
    assert snapshot(inputs["root"]) == before, "an input changed"
    assert list(tmpdir.iterdir()) == [], "left files in the system temp folder"


def test_full_disk_plot_temp_folder(inputs, small_disk, tmp_path):
    """plot marginals canonicalizes into TMPDIR: a full TMPDIR is named, and emptied."""
    tmpdir = small_disk(400)
    out = tmp_path / "out"
    out.mkdir()
    before = snapshot(inputs["root"])
    result = run_command(["plot", "marginals", inputs["target"], "--symmetries", "both",
                          "--out", out / "marginals"], tmpdir)
    assert_no_space_line(result, tmpdir)
    assert list(tmpdir.iterdir()) == [] and list(out.iterdir()) == []
    assert snapshot(inputs["root"]) == before


@pytest.mark.slow
def test_full_disk_demo(small_disk, tmp_path):
    from posteriorzoo.reference import reference_path

    disk = small_disk(400)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    shipped = reference_path("target").parent
    before = snapshot(shipped)
    result = run_command(["demo", "--out", disk / "demo", "--checkpoints", "1", "--epochs",
                          "1", QUIET], tmpdir)
    assert_no_space_line(result, disk)
    assert list(disk.iterdir()) == [] and list(tmpdir.iterdir()) == []
    assert snapshot(shipped) == before


def _collection_on(disk: Path) -> Path:
    """10 committed checkpoints in small chunks, so that an append needs new ones."""
    path = disk / "zoo.h5"
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0), chunk_bytes=4096) as zoo:
        zoo.append_many([checkpoint(i) for i in range(10)], [{"seed": i} for i in range(10)])
    return path


def assert_collection_kept(path: Path, digest: str, count: int = 10) -> None:
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, "the collection changed"
    with open_zoo(path, verify=True) as zoo:
        assert len(zoo) == count
        zoo.verify_all()
    assert verify(path).ok


def test_full_disk_append_keeps_the_collection(inputs, small_disk, tmp_path):
    disk = small_disk(1024)
    path = _collection_on(disk)
    fill(disk, 16_000)  # an append of 6 checkpoints needs new chunks: more than this
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    before = snapshot(inputs["root"])

    result = run_command(["import", "--out", path, *sorted(inputs["exported"].iterdir()),
                          QUIET], tmp_path)

    assert_no_space_line(result, disk)
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "zoo.h5"]
    assert_collection_kept(path, digest)
    assert snapshot(inputs["root"]) == before
    # with room again the same command appends everything
    (disk / "filler").unlink()
    result = run_command(["import", "--out", path, *sorted(inputs["exported"].iterdir()),
                          QUIET], tmp_path)
    assert result.returncode == 0, result.stderr
    with open_zoo(path) as zoo:
        assert len(zoo) == 16


def test_full_disk_reservation_is_given_back(small_disk, monkeypatch):
    """A block's disk is reserved before it is written, and what it did not use is
    free again after it: the file holds no blocks past its end."""
    disk = small_disk(4096)
    path = _collection_on(disk)
    reservations = []
    reserve = outputs.reserve_space

    def spy(fd: int, offset: int, length: int) -> bool:
        reservations.append(reserve(fd, offset, length))
        return reservations[-1]

    monkeypatch.setattr(outputs, "reserve_space", spy)
    with open_zoo(path, mode="r+") as zoo:
        zoo.append_many([checkpoint(20 + i) for i in range(3)],
                        [{"seed": 20 + i} for i in range(3)])
        state = path.stat()
        assert state.st_blocks * 512 <= state.st_size + 4096, "reserved blocks kept"
    assert reservations == [True]
    state = path.stat()
    assert state.st_blocks * 512 <= state.st_size + 4096


# ---------------------------------------------------------------------- injected failures
# A subprocess whose h5py flushes fail as on a full disk from the N-th one on (what HDF5
# raises then), running the CLI: a crash at exit shows as a signal.
FAILING_FLUSH = f"""
import os, sys
import h5py
failing_from = int(os.environ["FAIL_FLUSH_FROM"])
calls = [0]
real = h5py.File.flush
def flush(self):
    calls[0] += 1
    if calls[0] >= failing_from:
        raise RuntimeError({HDF5_FULL!r})
    return real(self)
h5py.File.flush = flush
from posteriorzoo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_failing(argv: list, tmpdir: Path, failing_from: int) -> subprocess.CompletedProcess:
    env = subprocess_env(tmpdir)
    env["FAIL_FLUSH_FROM"] = str(failing_from)
    return subprocess.run([sys.executable, "-c", FAILING_FLUSH, *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("failing_from", [1, 2, 3, 4],
                         ids=["create", "data", "commit", "publish"])
def test_injected_hdf5_failure_new_collection(failing_from, inputs, tmp_path):
    """canonicalize's output: the 1st flush creates the file, the 2nd writes the block's
    data, the 3rd commits it, the 4th publishes (opening for appending, straight in SWMR
    mode, flushes nothing)."""
    out = tmp_path / "out"
    out.mkdir()
    before = snapshot(inputs["root"])
    result = run_failing(["canonicalize", inputs["target"], "--out", out / "canonical.h5",
                          QUIET], tmp_path, failing_from)
    assert_no_space_line(result, out)
    assert list(out.iterdir()) == [], "a temporary collection was left"
    assert snapshot(inputs["root"]) == before
    # the next run is not in the way of anything
    result = run_command(["canonicalize", inputs["target"], "--out", out / "canonical.h5",
                          QUIET], tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("failing_from, kept", [(1, 4), (2, 10), (3, 10)],
                         ids=["data", "commit", "close"])
def test_injected_hdf5_failure_append(failing_from, kept, inputs, tmp_path):
    """An append whose write fails (opening for appending, straight in SWMR mode, flushes
    nothing; the 1st flush writes the data, the 2nd follows the commit, the 3rd closes
    the file): the collection keeps its
    committed checkpoints, readable and verified, and the next append completes it. A
    failure after the commit point keeps the whole block, which was written and flushed
    before it was committed."""
    path = tmp_path / "zoo.h5"
    make_collection(path, 0, 4)
    with open_zoo(path) as zoo:
        digests = zoo.digests
    result = run_failing(["import", "--out", path, *sorted(inputs["exported"].iterdir()),
                          QUIET], tmp_path, failing_from)
    assert_no_space_line(result, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    with open_zoo(path, verify=True) as zoo:
        assert len(zoo) == kept and zoo.digests[:4] == digests
        zoo.verify_all()
    assert verify(path).ok
    result = run_command(["import", "--out", path, *sorted(inputs["exported"].iterdir()),
                          QUIET], tmp_path)
    assert result.returncode == 0, result.stderr
    with open_zoo(path) as zoo:
        assert len(zoo) == 10 and zoo.digests[:4] == digests


def _file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return apply


def test_real_hdf5_write_failure_does_not_crash(inputs, tmp_path):
    """A write really failing inside HDF5 (a file size limit: EFBIG, no root needed): one
    line, exit 2, no temporary left. Before, the process crashed when it exited."""
    out = tmp_path / "out"
    out.mkdir()
    result = run_command(["canonicalize", inputs["target"], "--out", out / "canonical.h5",
                          QUIET], tmp_path, preexec_fn=_file_size_limit(300_000))
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("cannot be written: File too large"), lines
    assert list(out.iterdir()) == []


def test_injected_enospc_in_python_writes(inputs, tmp_path, capsys, monkeypatch):
    """min-mass writes its CSV with Python: ENOSPC there is one line, no folder left."""
    def full(self, *args, **kwargs):
        with open(self, "w") as handle:
            handle.write("partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full)
    code, _, err = run(capsys, "min-mass", inputs["target"], "--out", tmp_path / "mass", QUIET)
    assert_one_line_error(code, err, f"no space left on device: {tmp_path} needs more than")
    assert list(tmp_path.iterdir()) == []


def test_injected_enospc_in_matplotlib(inputs, tmp_path, capsys, monkeypatch):
    """The PNG written, the PDF meets a full disk: neither is left."""
    from matplotlib.figure import Figure

    real = Figure.savefig

    def savefig(self, target, *args, **kwargs):
        if kwargs.get("format") == "pdf":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, target, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    code, _, err = run(capsys, "plot", "pca", inputs["target"], "--out", tmp_path / "pca")
    assert_one_line_error(code, err, f"no space left on device: {tmp_path} needs more than")
    assert list(tmp_path.iterdir()) == []


def test_free_space_is_checked_before_any_work(inputs, tmp_path, capsys, monkeypatch):
    """canonicalize knows its output's size: it is refused before canonicalizing."""
    import posteriorzoo.collection.canonicalization as canonicalization

    monkeypatch.setattr(outputs, "free_bytes", lambda folder: 50_000)
    monkeypatch.setattr(canonicalization, "canonicalize_batch",
                        lambda *a, **k: pytest.fail("canonicalized before checking space"))
    code, _, err = run(capsys, "canonicalize", inputs["target"], "--out",
                       tmp_path / "c.h5", QUIET)
    assert_one_line_error(code, err, f"no space left on device: {tmp_path} needs about")
    assert list(tmp_path.iterdir()) == []


def test_refused_reservation_leaves_the_collection_untouched(tmp_path, monkeypatch):
    path = tmp_path / "zoo.h5"
    make_collection(path, 0, 3)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setattr(outputs, "_fallocate_call",
                        lambda fd, mode, offset, length: errno.ENOSPC)
    with open_zoo(path, mode="r+") as zoo, pytest.raises(NoSpaceError) as refused:
        zoo.append(checkpoint(50), seed=50)
    assert str(refused.value).startswith(f"no space left on device: {tmp_path} needs about")
    assert_collection_kept(path, digest, count=3)


def test_no_space_errors_are_recognised():
    assert outputs.is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert outputs.is_no_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert outputs.is_no_space(RuntimeError(HDF5_FULL))
    chained = ValueError("wrapped")
    chained.__cause__ = OSError(errno.ENOSPC, "full")
    assert outputs.is_no_space(chained)
    assert not outputs.is_no_space(OSError(errno.EACCES, "Permission denied"))
    assert not outputs.is_no_space(RuntimeError("errno = 280, something else"))
    assert str(NoSpaceError("/d", 1_234_567)) == \
        "no space left on device: /d needs about 1.2 MB"
    assert str(NoSpaceError("/d", 30_000, at_least=True)) == \
        "no space left on device: /d needs more than 30 kB"


def test_atomic_outputs_map_no_space_and_remove_the_partial(tmp_path):
    import numpy as np

    with pytest.raises(NoSpaceError, match="needs more than"), \
            outputs.atomic_file(tmp_path / "a.npy") as partial:
        with open(partial, "wb") as handle:  # np.save on a name would add ".npy"
            np.save(handle, np.zeros(10_000))
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(NoSpaceError), outputs.atomic_directory(tmp_path / "d") as partial:
        (partial / "x").write_text("x")
        raise RuntimeError(HDF5_FULL)
    with pytest.raises(PermissionError), outputs.atomic_file(tmp_path / "b") as partial:
        raise PermissionError(errno.EACCES, "not a full disk: unchanged")
    assert list(tmp_path.iterdir()) == []


def test_abandoned_file_is_closed(tmp_path):
    """After abandon, HDF5 holds no file open (none is left to crash at exit)."""
    from posteriorzoo.zoo.store import abandon

    path = tmp_path / "x.h5"
    handle = h5py.File(path, "w", libver="latest", locking=False)
    handle.create_dataset("d", data=list(range(10)))
    abandon(handle)
    assert not handle.id.valid
    still_open = [f.name for f in h5py.h5f.get_obj_ids(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)]
    assert str(path).encode() not in still_open
