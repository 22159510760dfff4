"""Output a person and a log can both read.

- Progress bars only on a terminal: with stderr a pipe (a log, CI), ``verify`` prints its
  results and no bar, and a failing ``import`` prints exactly one error line; on a
  terminal the bars are still drawn (unless ``--no-progress``).
- ``info`` prints the recipe as one ``key  value`` line per setting; ``--json`` keeps it a
  JSON object.
- ``demo`` ends with how to run the command line.
- Ray's token-authentication notice is not printed when the Ray backend starts Ray.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pty
import select
import shlex
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from posteriorzoo.cli import main
from posteriorzoo.cli.demo import how_to_run_lines
from posteriorzoo.cli.zoo_commands import recipe_lines
from posteriorzoo.collection import describe, export_checkpoint
from posteriorzoo.reference import reference_path

#: What tqdm draws: a percentage, then the bar between pipes ("  0%|          | 0/100").
BAR_MARK = "%|"
COMMAND = [sys.executable, "-m", "posteriorzoo"]


def run_piped(*argv: object) -> subprocess.CompletedProcess:
    """The command with stdout and stderr pipes, as under a log or CI."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*COMMAND, *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=300)


def run_on_terminal(*argv: object) -> tuple[int, str]:
    """The command with stderr on a pseudo-terminal (stdout a pipe); its stderr text."""
    leader, follower = pty.openpty()
    # a new pseudo-terminal is 0 columns wide, and tqdm draws nothing in 0 columns
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([*COMMAND, *map(str, argv)], stdout=subprocess.PIPE,
                               stderr=follower, env=env)
    os.close(follower)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 300)
            if not ready:
                break
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the command ended
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
        process.stdout.close()
        code = process.wait(timeout=300)
    return code, b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def two_collections(tmp_path_factory) -> list[Path]:
    """Two small verified collections (copies of the shipped DE)."""
    folder = tmp_path_factory.mktemp("zoos")
    copies = [folder / f"de-{i}.h5" for i in range(2)]
    for copy in copies:
        shutil.copyfile(reference_path("de"), copy)
    return copies


def test_verify_on_a_pipe_prints_no_progress_bar(two_collections):
    done = run_piped("verify", *two_collections)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no 0% and 100% lines per file
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(str(path) in lines[i]
                                   for i, path in enumerate(two_collections))


def test_a_failing_import_on_a_pipe_is_one_line(two_collections, tmp_path):
    good = tmp_path / "good.safetensors"
    export_checkpoint(two_collections[0], 0, good)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    out = tmp_path / "new.h5"
    done = run_piped("import", good, bad, "--out", out)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("posteriorzoo import: error: ") and str(bad) in lines[0]
    assert done.stdout == "" and not out.exists()


def test_progress_bars_stay_on_a_terminal(two_collections):
    code, shown = run_on_terminal("verify", two_collections[0])
    assert code == 0 and BAR_MARK in shown and "verify" in shown
    code, shown = run_on_terminal("verify", two_collections[0], "--no-progress")
    assert code == 0 and BAR_MARK not in shown


def test_info_prints_the_recipe_one_setting_per_line(capsys):
    path = reference_path("sghmc")
    assert main(["info", str(path), "--no-verify"]) == 0
    lines = capsys.readouterr().out.splitlines()
    recipe = describe(path, verify=False).to_dict()["recipe"]
    start = lines.index("  recipe")
    block = lines[start + 1:start + 1 + len(recipe) + len(recipe["method_options"])]
    assert all(line.startswith("    ") and len(line) < 80 for line in block)
    settings = {line.split()[0]: line.split(None, 1)[1] if len(line.split()) > 1 else None
                for line in block if not line.startswith("      ")}
    assert set(settings) == set(recipe)
    assert settings["method"] == "sghmc" and settings["milestones"] == "[15, 30]"
    assert settings["nesterov"] == "false" and settings["num_classes"] == "null"
    assert settings["method_options"] is None  # a table: its settings follow, indented
    nested = {line.split()[0]: line.split()[1] for line in block if line.startswith("      ")}
    assert nested == {key: json.dumps(value).strip('"')
                      for key, value in recipe["method_options"].items()}
    # --json is unchanged: the recipe is the JSON object
    assert main(["info", str(path), "--no-verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recipe"] == recipe


def test_recipe_lines_align_and_nest():
    lines = recipe_lines({"lr": 0.1, "name": "x", "options": {"a": 1, "bb": [1, 2]},
                          "empty": {}, "text": ""}, indent=2)
    assert lines == ["  empty    {}", "  lr       0.1", "  name     x", "  options",
                     "    a   1", "    bb  [1, 2]", '  text     ""']


def test_demo_says_how_to_run_the_command(monkeypatch):
    script = Path(sys.prefix) / "bin" / "posteriorzoo"
    if not script.is_file():
        pytest.skip(f"no posteriorzoo script in {script.parent}")
    # as `make demo` runs it: the environment not activated, the shell cannot find it
    folders = [p for p in os.environ.get("PATH", "").split(os.pathsep)
               if not (Path(p) / "posteriorzoo").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(folders))
    monkeypatch.chdir(Path(sys.prefix).parent)
    lines = how_to_run_lines()
    assert lines[0] == f"next: {Path(sys.prefix).name}/bin/posteriorzoo --help lists the commands"
    # the command as printed runs, from the folder the demo ran in
    typed = shlex.split(lines[0].removeprefix("next: ").removesuffix(" lists the commands"))
    done = subprocess.run(typed, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: posteriorzoo" in done.stdout
    if sys.prefix != sys.base_prefix:
        assert f"source {Path(sys.prefix).name}/bin/activate" in lines[1]
    # once the shell finds this very script, its bare name is enough
    monkeypatch.setenv("PATH", os.pathsep.join([str(script.parent), *folders]))
    assert how_to_run_lines() == ["next: posteriorzoo --help lists the commands"]


class _FakeRay:
    """``ray.init`` logs Ray's token notice the way Ray 2.5x does."""

    def __init__(self) -> None:
        self.started = False

    def is_initialized(self) -> bool:
        return self.started

    def init(self, **_: object) -> None:
        logging.getLogger("ray._private.authentication.authentication_token_setup").warning(
            "Token authentication is enabled for this Ray cluster. Set "
            "RAY_AUTH_MODE=disabled to opt out.")
        logging.getLogger("ray._private.worker").warning("a warning that stays")
        self.started = True


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_ray_token_notice_is_silenced():
    from train_zoo.backends import ray_backend

    # A handler on each logger itself: Ray may have stopped its loggers propagating.
    collect = _Collect()
    loggers = [logging.getLogger(name) for name in (ray_backend._TOKEN_LOGGER,
                                                    "ray._private.worker")]
    level = loggers[0].level
    for logger in loggers:
        logger.addHandler(collect)
    try:
        assert ray_backend.RayBackend(num_cpus=1)._connect(_FakeRay()) is True
    finally:
        for logger in loggers:
            logger.removeHandler(collect)
    assert collect.messages == ["a warning that stays"]
    # the logger is quiet only while Ray starts
    assert loggers[0].level == level
    # and it is the logger Ray itself uses for the notice
    try:
        from ray._private.authentication import authentication_token_setup
    except ImportError:
        pytest.skip("Ray (or its token authentication, Ray >= 2.5x) is not installed")
    assert authentication_token_setup.logger.name == ray_backend._TOKEN_LOGGER
    assert "Token authentication is enabled" in Path(
        authentication_token_setup.__file__).read_text()
