"""Declared sizes and concurrent writers: what a collection's own numbers may claim, and
two appends at once.

- A file may declare rows past its committed count only as one interrupted append leaves
  them (:data:`posteriorzoo.zoo.layout.MAX_APPEND_ROWS`); beyond that it is refused
  before anything is read, and within it no command works in proportion to rows that were
  never written (``verify`` reads up to the committed count; a writer rebuilds the file
  from its committed rows instead of shrinking each dataset chunk by chunk).
- Two writers of one collection: one appends, the other is told the collection is busy
  in one line before it reads anything; the collection ends whole, holding what the
  successful one appended.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from zoo_helpers import checkpoint, run_quietly

from posteriorzoo.collection import export_checkpoint, verify
from posteriorzoo.zoo import create_zoo, open_zoo
from posteriorzoo.zoo.layout import MAX_APPEND_ROWS

BUSY = "another process is writing to this collection"


#: Runs a command and prints its peak resident memory (KiB) as the last line: VmHWM, the
#: high-water mark of this program's own memory (getrusage's ru_maxrss would include the
#: parent's at the fork: Linux keeps the larger across exec, 2.8 GB under a full pytest).
PEAK_OF_COMMAND = """
import re, sys
from posteriorzoo.cli import main
code = main(sys.argv[1:])
with open("/proc/self/status") as status:
    print(re.search(r"VmHWM:\\s*(\\d+) kB", status.read()).group(1))
sys.exit(code)
"""


def _collection(path: Path, seeds: range = range(3)) -> None:
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0)) as zoo:
        zoo.append_many([checkpoint(s) for s in seeds], [{"seed": s} for s in seeds])


def _declare_rows(path: Path, rows: int) -> None:
    """Every growing dataset declares ``rows`` rows; the committed count stays."""
    with h5py.File(path, "r+", locking=False) as handle:
        for name in ("metadata", "metadata_sha256", "mode_records",
                     *(f"state/{key}" for key in handle["state"])):
            handle[name].resize(rows, axis=0)


def _exports(folder: Path, seeds: range) -> list[Path]:
    source = folder / f"source-{seeds.start}.h5"
    _collection(source, seeds)
    files = [folder / f"{seed}.safetensors" for seed in seeds]
    for index, file in enumerate(files):
        export_checkpoint(source, index, file)
    return files


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("rows", [MAX_APPEND_ROWS + 4, 2_000_000, 10**12],
                         ids=["just-beyond", "2e6", "1e12"])
def test_declared_rows_beyond_one_append_are_refused_at_once(rows, tmp_path):
    path = tmp_path / "zoo.h5"
    _collection(path)
    _declare_rows(path, rows)
    before = _sha(path)
    inputs = _exports(tmp_path, range(10, 11))
    for argv in (("info", path), ("verify", path, "--no-progress"),
                 ("import", "--out", path, *inputs, "--no-progress")):
        clock = time.perf_counter()
        code, err = run_quietly(*argv)
        assert time.perf_counter() - clock < 10, argv[0]  # it hung for minutes before
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "declares" in lines[0], (argv[0], err)
        assert _sha(path) == before


def test_rows_of_one_interrupted_append_are_never_read_and_cut_off_by_a_rebuild(tmp_path):
    """The most a killed writer can leave: one append's rows past the committed count.
    verify reads none of them (peak memory of the command well under the 0.9 GB that
    reading the metadata table whole takes), and the next append rebuilds the file from
    its 3 committed rows in seconds, not chunk by chunk."""
    path = tmp_path / "zoo.h5"
    _collection(path)
    _declare_rows(path, 3 + MAX_APPEND_ROWS)
    # The command in a process of its own that says its own peak at exit (RUSAGE_CHILDREN
    # would be the largest of every child this test process ever had).
    result = subprocess.run([sys.executable, "-c", PEAK_OF_COMMAND, "verify", str(path),
                             "--no-progress"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    peak_mib = int(result.stdout.splitlines()[-1]) / 1024
    assert peak_mib < 700, peak_mib  # torch and numba take about 350 MiB of it
    inputs = _exports(tmp_path, range(10, 12))
    clock = time.perf_counter()
    code, err = run_quietly("import", "--out", path, *inputs, "--no-progress")
    assert code == 0, err
    assert time.perf_counter() - clock < 30
    with open_zoo(path, verify=True) as zoo:
        assert len(zoo) == 5 and list(zoo.metadata["seed"]) == [0, 1, 2, 10, 11]
        zoo.verify_all()
    with h5py.File(path, "r", locking=False) as handle:
        assert handle["metadata"].shape == (5,)


def test_an_append_while_another_writer_holds_the_collection_is_busy(tmp_path):
    path = tmp_path / "zoo.h5"
    _collection(path)
    inputs = _exports(tmp_path, range(10, 11))
    with open_zoo(path, mode="r+"):
        before = _sha(path)
        code, err = run_quietly("import", "--out", path, *inputs, "--no-progress")
        assert code == 2 and err.strip().splitlines() == [err.strip()] and BUSY in err, err
        assert _sha(path) == before


@pytest.mark.parametrize("round_", range(3))
def test_two_imports_at_once(round_, tmp_path):
    """Both started together, each importing 3 checkpoints one batch at a time: each
    either appends all of its own or is busy (exit 2, one line), never a traceback or a
    misleading message, and the collection holds exactly what the successful ones
    appended."""
    path = tmp_path / "zoo.h5"
    _collection(path)
    groups = [_exports(tmp_path, range(10, 13)), _exports(tmp_path, range(20, 23))]
    processes = [subprocess.Popen([sys.executable, "-m", "posteriorzoo", "import", "--out",
                                   str(path), *map(str, files), "--checkpoints-per-batch",
                                   "1", "--no-progress"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for files in groups]
    expected = [0, 1, 2]
    for process, seeds in zip(processes, ([10, 11, 12], [20, 21, 22]), strict=True):
        _, err = process.communicate(timeout=300)
        lines = err.strip().splitlines()
        if process.returncode == 0:
            expected += seeds
        else:
            assert process.returncode == 2 and len(lines) == 1 and BUSY in lines[0], err
    with open_zoo(path, verify=True) as zoo:
        assert sorted(zoo.metadata["seed"]) == sorted(expected)
        zoo.verify_all()
    assert verify(path).ok
