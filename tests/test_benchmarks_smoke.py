"""Every benchmark still runs: each ``benchmarks/*.py`` in its smoke mode (``--quick``).

A benchmark is a script nothing else imports, so an API it uses can move without any
test noticing (``bench_training.py`` once crashed on a changed ``FastNet.step``). Here
each one runs as a user runs it, in a subprocess from the repository root, with
``--quick`` and ``--json``: it must exit 0 and write its JSON record. A benchmark added to
the folder is picked up by itself; one without a ``--quick`` option fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
#: Seconds a smoke run may take on a loaded 2-core machine (each takes a few seconds).
LIMIT = 180


def test_every_benchmark_is_found():
    names = {path.name for path in BENCHMARKS}
    assert {"bench_training.py", "bench_report.py", "bench_mmd.py", "bench_import.py"} <= names


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda path: path.name)
def test_benchmark_runs_in_its_smoke_mode(script, tmp_path):
    out = tmp_path / "record.json"
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=LIMIT,
                          env=environment)
    assert done.returncode == 0, f"{script.name} --quick failed:\n{done.stdout[-2000:]}\n" \
                                 f"{done.stderr[-4000:]}"
    if "skipped:" in done.stdout:   # a benchmark whose data is not installed says so
        return
    record = json.loads(out.read_text())
    assert record, f"{script.name} wrote an empty record"
    assert "Traceback" not in done.stderr
