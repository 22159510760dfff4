"""The command line starts fast (lazy imports) and says when numba compiles.

Speed itself is not timed here: what makes ``--help`` slow is importing torch, numpy,
h5py or numba, so the test asserts that none of them is imported.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posteriorzoo._numba import MESSAGE

HEAVY = ("torch", "numpy", "h5py", "numba", "scipy", "huggingface_hub", "train_zoo")
COMMANDS = ["info", "verify", "export", "import", "download", "upload", "train",
            "canonicalize", "min-mass", "mmd", "report", "plot", "study", "demo"]


def _loaded_after(argv: list[str]) -> list[str]:
    code = ("import contextlib, io, json, sys\n"
            "from posteriorzoo.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            f"        main({argv!r})\n"
            "    except SystemExit:\n"
            "        pass\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], *[[c, "--help"] for c in COMMANDS]],
                         ids=lambda argv: " ".join(argv))
def test_help_imports_nothing_heavy(argv):
    assert _loaded_after(argv) == []


def test_first_numba_compilation_is_announced_once(tmp_path):
    code = ("from posteriorzoo._numba import announce_compilation\n"
            "announce_compilation(); announce_compilation()\n"
            "from numba import njit\n"
            "@njit(cache=True)\n"
            "def twice(x):\n"
            "    return 2 * x\n"
            "@njit(cache=True)\n"
            "def thrice(x):\n"
            "    return 3 * x\n"
            "print(twice(2) + thrice(1))\n")
    script = tmp_path / "kernels.py"  # cache=True needs a file to key the cache on
    script.write_text(code)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           env=env, timeout=300, check=True)
    assert first.stdout.strip() == "7"
    assert first.stderr.count(MESSAGE) == 1          # once, though two kernels compile
    again = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           env=env, timeout=300, check=True)
    assert MESSAGE not in again.stderr                # loaded from the cache: silent


def test_other_libraries_compilations_are_not_announced(tmp_path):
    """A library that jit-compiles in every process (ArviZ does, uncached) must not make
    the first-use message appear on every run; our own kernel after it still does."""
    (tmp_path / "otherlib.py").write_text("from numba import njit\n"
                                          "@njit\n"
                                          "def square(x):\n"
                                          "    return x * x\n")
    code = ("from posteriorzoo._numba import announce_compilation\n"
            "announce_compilation()\n"
            "import sys\n"
            "import otherlib\n"
            "otherlib.square(3)\n"
            "print('between', file=sys.stderr, flush=True)\n"
            "from numba import njit\n"
            "@njit\n"
            "def ours(x):\n"
            "    return x + 1\n"
            "ours(1)\n")
    script = tmp_path / "run.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300, check=True)
    before, after = done.stderr.split("between")
    assert MESSAGE not in before
    assert after.count(MESSAGE) == 1


def test_every_module_with_kernels_announces():
    """Every module that defines numba kernels registers the announcement at import."""
    root = Path(__file__).resolve().parent.parent
    with_kernels = []
    for path in [*root.joinpath("posteriorzoo").rglob("*.py"),
                 *root.joinpath("train_zoo").rglob("*.py")]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        decorated = any(
            "njit" in ast.unparse(decorator) or "numba.jit" in ast.unparse(decorator)
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            for decorator in node.decorator_list)
        if decorated:
            with_kernels.append(path.name)
            calls = [ast.unparse(node.value) for node in tree.body
                     if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
            assert "announce_compilation()" in calls, path
    assert len(with_kernels) >= 3
