"""mypy over train_zoo, with the configuration committed in pyproject.toml (``[tool.mypy]``),
reports no error: a wrong hint, an Optional used unnarrowed or a method reading an option
with the wrong type is caught here, before a run trips on it. A cold run takes about 12 s.

The second test checks that the committed configuration still finds errors (no global
``ignore_errors``, the strictness it had), so the first cannot pass by checking nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mypy")


def _mypy(tmp_path: Path, *targets: str) -> subprocess.CompletedProcess:
    """mypy as ``make test`` would run it: the committed configuration, a fresh cache."""
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                           str(ROOT / "pyproject.toml"), "--cache-dir",
                           str(tmp_path / "mypy-cache"), *targets],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_train_zoo_type_checks(tmp_path):
    done = _mypy(tmp_path)  # the files the configuration names: train_zoo
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues found" in done.stdout, done.stdout


def test_the_configuration_still_finds_errors(tmp_path):
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def width(size: int | None) -> int:\n"
                     "    return size * 2\n")
    done = _mypy(tmp_path, str(wrong))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "wrong.py:2" in done.stdout and "operator" in done.stdout, done.stdout
