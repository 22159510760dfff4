"""The ``Engine`` Protocol (``train_zoo.methods.base``) says what methods really ask of
their engine, and a type checker keeps it honest:

- every attribute a method module reads from its engine (``run.engine.X``,
  ``engine.X``) is a member of the Protocol;
- mypy finds the trainer's engine (``train_zoo.programs.ModeEngine``) structurally a
  ``Engine``, signatures included;
- and mypy refuses an engine whose method lacks a keyword the Protocol promises (the
  check can fail).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from train_zoo.methods.base import Engine

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = {name for name in dir(Engine) if not name.startswith("_")} | set(
    Engine.__annotations__)

pytest.importorskip("mypy")


def _engine_reads(path: Path) -> set[tuple[str, int]]:
    """``(attribute, line)`` of every ``<something>.engine.attribute`` and
    ``engine.attribute`` in the module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Attribute) and base.attr == "engine") or (
                isinstance(base, ast.Name) and base.id == "engine"):
            found.add((node.attr, node.lineno))
    return found


def test_methods_ask_their_engine_only_what_the_protocol_says():
    offences = sorted(f"{path.name}:{line} engine.{attribute}"
                      for path in (ROOT / "train_zoo" / "methods").glob("*.py")
                      for attribute, line in _engine_reads(path)
                      if attribute not in MEMBERS)
    assert not offences, offences
    assert {"batches", "log_posterior", "loss_gradient", "rank1_network"} <= MEMBERS


def _mypy(source: str, tmp_path: Path) -> subprocess.CompletedProcess:
    stub = tmp_path / "conformance.py"
    stub.write_text(source)
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nignore_missing_imports = True\nfollow_imports = silent\n")
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config),
                           "--cache-dir", str(tmp_path / "cache"), str(stub)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


HEADER = ("from train_zoo.methods.base import Engine\n"
          "from train_zoo.programs import ModeEngine\n\n\n")


def test_the_trainers_engine_is_an_engine(tmp_path):
    done = _mypy(HEADER + "def conforms(engine: ModeEngine) -> Engine:\n"
                          "    return engine\n", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_engine_missing_a_promised_keyword_is_refused(tmp_path):
    done = _mypy(HEADER + "class Narrow(ModeEngine):\n"
                          "    def batches(self, model, seed, batch_size=None):\n"
                          "        return super().batches(model, seed, batch_size)\n\n\n"
                          "def conforms(engine: Narrow) -> Engine:\n"
                          "    return engine\n", tmp_path)
    assert done.returncode == 1 and "batches" in done.stdout, done.stdout
