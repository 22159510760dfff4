"""A writer killed at any moment of opening, appending to or closing a collection.

What must hold after every kill: the collection opens, ``info`` and ``verify`` exit 0,
it holds exactly the checkpoints committed before the kill (each the one its seed
makes), and the next writer appends after them, leaving no temporary file.

The moments are chosen two ways:

- every fault point of the writer (:mod:`posteriorzoo._faults`): the open, the resize
  of each dataset, each tensor written, the metadata rows, the training records, before
  and after the commit, the close, and the rename of a rebuilt file, each at its first
  and a later hit, for the API and for the ``import`` command;
- random times within a writer that opens, appends and closes in a loop, so that kills
  land inside HDF5's own writes too (an earlier writer, killed within milliseconds of
  opening a collection, left it unreadable by every command).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from zoo_helpers import checkpoint, run_quietly

from posteriorzoo.collection import export_checkpoint
from posteriorzoo.zoo import create_zoo, open_zoo

TESTS = Path(__file__).parent
WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from zoo_helpers import checkpoint, run_quietly
    from posteriorzoo.zoo import open_zoo

    path, rounds = sys.argv[1], int(sys.argv[2])
    with open_zoo(path) as zoo:
        seed = len(zoo)
    print("ready", flush=True)
    for _ in range(rounds):  # open, append 1 to 3, close: every phase again and again
        with open_zoo(path, mode="r+") as zoo:
            batch = list(range(seed, seed + 1 + seed % 3))
            zoo.append_many([checkpoint(s) for s in batch],
                            [{{"seed": s, "mode_id": seed}} for s in batch],
                            records={{seed: {{"seed": seed}}}})
        seed = batch[-1] + 1
    """)
#: Every fault point an append passes, and how often one round of the writer passes it
#: (4 tensors: resized and written 4 times).
POINTS = {"zoo-opened": 1, "zoo-resized": 4, "zoo-tensor-written": 4, "zoo-rows-written": 1,
          "zoo-records-resized": 1, "zoo-before-commit": 1, "zoo-commit": 1, "zoo-close": 1}
KILLS = [(point, hit) for point, hits in POINTS.items() for hit in sorted({1, hits + 2})]


def _collection(path: Path, count: int = 3) -> None:
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0)) as zoo:
        zoo.append_many([checkpoint(s) for s in range(count)],
                        [{"seed": s, "mode_id": s} for s in range(count)])


def _writer(folder: Path) -> Path:
    script = folder / "writer.py"
    script.write_text(WRITER.format(tests=str(TESTS)))
    return script


def assert_intact_and_appendable(path: Path, at_least: int) -> int:
    """What every kill must leave: readable by the commands, exactly the committed
    checkpoints, and a next writer that appends after them. Returns the count."""
    for argv in (("info", path), ("verify", path, "--no-progress")):
        code, err = run_quietly(*argv)
        assert code == 0, (argv[0], err)
    with open_zoo(path, verify=True) as zoo:
        count = len(zoo)
        assert count >= at_least
        np.testing.assert_array_equal(zoo.metadata["seed"], np.arange(count))
        for index in sorted({0, count // 2, count - 1}):
            loaded, expected = zoo.state_dict(index), checkpoint(index)
            assert all(torch.equal(loaded[key], expected[key]) for key in expected)
        zoo.verify_all()
    with open_zoo(path, mode="r+") as zoo:
        zoo.append(checkpoint(count), seed=count)
    with open_zoo(path, verify=True) as zoo:
        assert len(zoo) == count + 1
        zoo.verify_all()
    assert not [p.name for p in path.parent.iterdir() if ".partial-" in p.name]
    return count + 1


def _killed_writer(script: Path, path: Path, point: str) -> None:
    env = {**os.environ, "POSTERIORZOO_KILL_AT": point}
    process = subprocess.run([sys.executable, str(script), str(path), "3"], env=env,
                             capture_output=True, timeout=300)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-1000:]


@pytest.mark.parametrize("point, hit", KILLS, ids=[f"{p}:{k}" for p, k in KILLS])
def test_kill_at_every_step_of_an_append(point, hit, tmp_path):
    path = tmp_path / "zoo.h5"
    _collection(path)
    _killed_writer(_writer(tmp_path), path, f"{point}:{hit}")
    assert_intact_and_appendable(path, at_least=3)


@pytest.mark.parametrize("point", ["zoo-rebuilt", "zoo-opened", "zoo-before-commit"])
def test_kill_while_a_file_is_rebuilt_before_its_first_append(point, tmp_path):
    """A file a writer must rebuild first (here: one of an earlier posteriorzoo, without
    the format bound): killed before the rebuilt file replaces it, or just after."""
    path = tmp_path / "zoo.h5"
    _collection(path)
    with h5py.File(path, "r+", locking=False) as handle:
        del handle.attrs["hdf5_format"]
    _killed_writer(_writer(tmp_path), path, point)
    assert_intact_and_appendable(path, at_least=3)


IMPORT_POINTS = ["zoo-opened", "zoo-resized:3", "zoo-tensor-written:2", "zoo-rows-written",
                 "zoo-before-commit", "zoo-commit", "import-batch", "zoo-close"]


@pytest.mark.parametrize("point", IMPORT_POINTS)
def test_kill_an_import_at_every_step(point, tmp_path):
    """The command of the report: ``import`` into an existing collection, killed."""
    path = tmp_path / "zoo.h5"
    _collection(path)
    source = tmp_path / "source.h5"
    with create_zoo(source, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0)) as zoo:
        zoo.append_many([checkpoint(s) for s in (3, 4)], [{"seed": s} for s in (3, 4)])
    inputs = [tmp_path / "3.safetensors", tmp_path / "4.safetensors"]
    for index, file in enumerate(inputs):
        export_checkpoint(source, index, file)
    env = {**os.environ, "POSTERIORZOO_KILL_AT": point}
    process = subprocess.run([sys.executable, "-m", "posteriorzoo", "import", "--out",
                              str(path), *map(str, inputs), "--no-progress"], env=env,
                             capture_output=True, timeout=300)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-1000:]
    count = assert_intact_and_appendable(path, at_least=3)
    assert count in (4, 6)  # nothing or the whole batch, then the one appended above


def _random_kills(tmp_path: Path, seed: int, kills: int) -> None:
    path = tmp_path / "zoo.h5"
    _collection(path)
    script = _writer(tmp_path)
    rng = random.Random(seed)
    count = 3
    for _ in range(kills):
        process = subprocess.Popen([sys.executable, str(script), str(path), "100000"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert process.stdout.readline().strip() == b"ready", process.stderr.read()[-1000:]
        time.sleep(rng.uniform(0.0, 0.25))  # tens of rounds of open, append and close
        process.kill()
        process.wait()
        count = assert_intact_and_appendable(path, at_least=count)


@pytest.mark.parametrize("seed", range(4))
def test_kill_at_random_moments(seed, tmp_path):
    _random_kills(tmp_path, seed, kills=3)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4, 24))
def test_kill_at_random_moments_many(seed, tmp_path):
    _random_kills(tmp_path, seed, kills=5)
