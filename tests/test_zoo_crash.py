"""Crash safety: a writer killed with SIGKILL loses nothing committed and half-writes nothing."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import torch
from zoo_helpers import checkpoint

from posteriorzoo.collection import verify
from posteriorzoo.zoo import open_zoo

WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from zoo_helpers import checkpoint
    from posteriorzoo.zoo import create_zoo, open_zoo

    path = Path(sys.argv[1])
    if path.exists():
        zoo = open_zoo(path, mode="r+")
    else:
        zoo = create_zoo(path, architecture="optunet", dataset="digits", method="de",
                         num_classes=10, template=checkpoint(0))
    seed = len(zoo)
    while True:  # appends until killed; batches of 1-3 to vary the kill point
        batch = [checkpoint(s) for s in range(seed, seed + 1 + seed % 3)]
        zoo.append_many(batch, [{{"seed": s}} for s in range(seed, seed + len(batch))])
        seed += len(batch)
    """
)


def _start_writer(script: Path, path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _count(path: Path) -> int:
    if not path.exists():
        return 0
    try:
        with open_zoo(path) as zoo:
            return len(zoo)
    except Exception:  # the file may be mid-creation under its temporary name
        return 0


def _kill_after(process: subprocess.Popen, path: Path, at_least: int, delay: float) -> None:
    deadline = time.monotonic() + 120
    while _count(path) < at_least:
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline, "writer made no progress"
        time.sleep(0.05)
    time.sleep(delay)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL


def _assert_exact(path: Path) -> int:
    """Every committed checkpoint is complete and is the one its seed determines."""
    with open_zoo(path) as zoo:
        count = len(zoo)
        np.testing.assert_array_equal(zoo.metadata["seed"], np.arange(count))
        for index in sorted({0, count // 2, count - 1}):
            expected = checkpoint(index)
            loaded = zoo.state_dict(index)
            assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    report = verify(path)
    assert report.ok, report.summary()
    assert report.checkpoints == count
    return count


def test_sigkill_during_appends_keeps_exactly_the_committed_checkpoints(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(tests=str(Path(__file__).parent)))
    path = tmp_path / "zoo.h5"
    rng = random.Random(1234)
    previous = 0
    for _ in range(3):
        writer = _start_writer(script, path)
        _kill_after(writer, path, previous + 5, delay=rng.uniform(0.0, 0.3))
        count = _assert_exact(path)
        assert count >= previous + 5
        previous = count
    # An in-process writer recovers the file and continues with the next seed.
    with open_zoo(path, mode="r+") as zoo:
        assert len(zoo) == previous
        zoo.append(checkpoint(previous), seed=previous)
    assert _assert_exact(path) == previous + 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left
