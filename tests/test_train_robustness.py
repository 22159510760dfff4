"""The trainer under bad input, concurrent writers, failures and kills (issue 9).

- A bad spec (wrong type, out of range, unknown field, unreadable file) is refused with
  one line and exit code 2 before anything is created.
- A new collection appears only once its first checkpoint is committed: a train that
  fails or is killed before leaves no file at the output path, and its rerun reaches the
  same collection as an uninterrupted run.
- A second train of the same output is refused as busy, whether the first one's file is
  still temporary or already published.
- The local backend's worker processes end when the train process is killed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from posteriorzoo import outputs
from posteriorzoo.cli import main
from posteriorzoo.collection import verify
from posteriorzoo.data import download
from posteriorzoo.errors import DataNotFoundError, PosteriorZooError
from posteriorzoo.zoo import create_zoo, open_zoo
from train_zoo import Recipe, get_recipe, load_spec, make_spec
from train_zoo.backends import LocalBackend, SerialBackend
from train_zoo.run import train_collection
from train_zoo.spec import MAX_SPEC_BYTES
from train_zoo.torch_engine import initial_model

TRAIN = [sys.executable, "-m", "posteriorzoo", "train"]


def spec_text(top: dict | None = None, overrides: dict | None | bool = None,
              tables: str = "") -> str:
    """A tiny digits spec (one epoch) with top-level values and recipe overrides replaced.

    Values are TOML source text; ``None`` drops a key; ``overrides=False`` drops the
    ``[recipe_overrides]`` table.
    """
    fields = {"recipe": '"optunet-mnist"', "dataset": '"digits"', "checkpoints": "2",
              "base_seed": "7", **(top or {})}
    lines = [f"{key} = {value}" for key, value in fields.items() if value is not None]
    if overrides is not False:
        table = {"epochs": "1", **(overrides or {})}
        lines += ["", "[recipe_overrides]",
                  *(f"{key} = {value}" for key, value in table.items() if value is not None)]
    return "\n".join(lines) + "\n" + tables


def folder_state(folder: Path) -> dict[str, bytes | None]:
    """Every entry of ``folder`` (hidden ones included) with a file's bytes."""
    return {entry.name: entry.read_bytes() if entry.is_file() else None
            for entry in folder.iterdir()}


def digests(path: Path) -> dict[int, bytes]:
    """Checkpoint index -> SHA-256 of its weights."""
    with open_zoo(path) as zoo:
        rows = zoo.metadata
        return {int(i): str(d) for i, d in zip(rows["mode_id"], rows["sha256"], strict=True)}


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------- bad specs
BAD_SPECS = {
    "checkpoints-float": (spec_text({"checkpoints": "2.5"}), "checkpoints"),
    "checkpoints-bool": (spec_text({"checkpoints": "true"}), "checkpoints"),
    "checkpoints-zero": (spec_text({"checkpoints": "0"}), "checkpoints"),
    "checkpoints-string": (spec_text({"checkpoints": '"3"'}), "checkpoints"),
    "base-seed-negative": (spec_text({"base_seed": "-1"}), "base_seed"),
    "base-seed-float": (spec_text({"base_seed": "1.5"}), "base_seed"),
    "name-number": (spec_text({"name": "3"}), "name"),
    "method-number": (spec_text({"method": "3"}), "method"),
    "method-unknown": (spec_text({"method": '"vi"'}), "vi"),
    "method-option-unknown": (spec_text({"method": '"swag"'}) + "\n[method_options]\nrate = 1\n",
                              "rate"),
    "method-option-bad": (spec_text({"method": '"sghmc"'}) + "\n[method_options]\nalpha = 2\n",
                          "alpha"),
    "de-with-samples": (spec_text({"samples_per_mode": "3"}), "samples_per_mode"),
    "modes-times-samples": (spec_text({"method": '"laplace"', "modes": "2",
                                       "samples_per_mode": "2"}), "checkpoints"),
    "dataset-number": (spec_text({"dataset": "3"}), "dataset"),
    "dataset-unknown": (spec_text({"dataset": '"no-such-set"'}), "no-such-set"),
    "architecture-list": (spec_text({"architecture": "[]"}), "architecture"),
    "architecture-unknown": (spec_text({"architecture": '"no-such-net"'}), "no-such-net"),
    "recipe-number": (spec_text({"recipe": "3"}), "recipe"),
    "recipe-unknown": (spec_text({"recipe": '"no-such-recipe"'}), "no-such-recipe"),
    "recipe-missing": (spec_text({"recipe": None}), "recipe"),
    "num-classes-bool": (spec_text({"num_classes": "true"}), "num_classes"),
    "num-classes-too-few": (spec_text({"num_classes": "3"}), "num_classes"),
    "data-dir-number": (spec_text({"data_dir": "3"}), "data_dir"),
    "unknown-spec-key": (spec_text({"batchsize": "3"}), "batchsize"),
    "overrides-not-table": (spec_text({"recipe_overrides": "3"}, overrides=False),
                            "recipe_overrides"),
    "model-options-not-table": (spec_text({"model_options": "3"}), "model_options"),
    "model-options-list": (spec_text({"model_options": "[1, 2]"}), "model_options"),
    "model-option-unknown": (spec_text(tables="[model_options]\nwidth_factor = 2\n"),
                             "width_factor"),
    "model-option-out-of-range": (spec_text(tables="[model_options]\ndropout = 1.5\n"),
                                  "dropout"),
    "epochs-string": (spec_text(overrides={"epochs": '"x"'}), "epochs"),
    "epochs-float": (spec_text(overrides={"epochs": "2.5"}), "epochs"),
    "epochs-bool": (spec_text(overrides={"epochs": "true"}), "epochs"),
    "epochs-negative": (spec_text(overrides={"epochs": "-1"}), "epochs"),
    "lr-string": (spec_text(overrides={"lr": '"x"'}), "lr"),
    "lr-nan": (spec_text(overrides={"lr": "nan"}), "lr"),
    "lr-inf": (spec_text(overrides={"lr": "inf"}), "lr"),
    "lr-zero": (spec_text(overrides={"lr": "0"}), "lr"),
    "lr-bool": (spec_text(overrides={"lr": "true"}), "lr"),
    "lr-date": (spec_text(overrides={"lr": "1979-05-27"}), "lr"),
    "batch-size-zero": (spec_text(overrides={"batch_size": "0"}), "batch_size"),
    "momentum-negative": (spec_text(overrides={"momentum": "-0.5"}), "momentum"),
    "gamma-minus-inf": (spec_text(overrides={"gamma": "-inf"}), "gamma"),
    "weight-decay-string": (spec_text(overrides={"weight_decay": '"none"'}), "weight_decay"),
    "crop-padding-float": (spec_text(overrides={"crop_padding": "1.5"}), "crop_padding"),
    "nesterov-number": (spec_text(overrides={"nesterov": "1"}), "nesterov"),
    "nesterov-without-momentum": (spec_text(overrides={"nesterov": "true"}), "nesterov"),
    "flip-string": (spec_text(overrides={"horizontal_flip": '"yes"'}), "horizontal_flip"),
    "schedule-unknown": (spec_text(overrides={"schedule": '"exponential"'}), "schedule"),
    "schedule-number": (spec_text(overrides={"schedule": "3"}), "schedule"),
    "milestones-int": (spec_text(overrides={"milestones": "3"}), "milestones"),
    "milestones-strings": (spec_text(overrides={"milestones": '["a"]'}), "milestones"),
    "milestones-string": (spec_text(overrides={"milestones": '"15,30"'}), "milestones"),
    "milestones-bools": (spec_text(overrides={"milestones": "[true]"}), "milestones"),
    "milestones-negative": (spec_text(overrides={"milestones": "[-1]"}), "milestones"),
    "unknown-recipe-field": (spec_text(overrides={"learning_rate": "0.1"}), "learning_rate"),
    "recipe-model-options-number": (spec_text(overrides={"model_options": "3"}),
                                    "model_options"),
    "not-toml": ("recipe = [\n", "TOML"),
    "not-utf8": (b'recipe = "optunet-mnist"\nname = "\xff\xfe"\n', "UTF-8"),
    "empty-file": ("", "recipe"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_spec_is_refused_before_anything_is_created(case, tmp_path, capsys):
    content, field = BAD_SPECS[case]
    spec = tmp_path / "bad.toml"
    if isinstance(content, bytes):
        spec.write_bytes(content)
    else:
        spec.write_text(content, encoding="utf-8")
    (tmp_path / "other.h5").write_bytes(b"an unrelated file")
    before = folder_state(tmp_path)
    out = tmp_path / "new.h5"
    code = main(["train", str(spec), "--out", str(out), "--backend", "serial",
                 "--engine", "torch", "--no-progress"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert line.startswith("posteriorzoo train: error:")
    assert field in line
    assert not out.exists()
    assert folder_state(tmp_path) == before  # no new file, not even a hidden one


@pytest.mark.parametrize("kind", ["folder", "missing"])
def test_spec_path_that_is_no_file(kind, tmp_path, capsys):
    spec = tmp_path / "specs"
    if kind == "folder":
        spec.mkdir()
    before = folder_state(tmp_path)
    code = main(["train", str(spec), "--out", str(tmp_path / "new.h5"), "--no-progress"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and ("folder" if kind == "folder" else "no such spec") in line
    assert folder_state(tmp_path) == before


def test_bad_spec_in_a_real_process(tmp_path):
    spec = tmp_path / "bad.toml"
    spec.write_text(spec_text({"checkpoints": "2.5"}))
    out = tmp_path / "new.h5"
    done = subprocess.run([*TRAIN, str(spec), "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "checkpoints" in one_error_line(done.stderr)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]


def _endless_fifo(path: Path) -> None:
    """A named pipe at ``path`` whose writer (a daemon thread) writes a valid spec and then
    comment bytes until its reader goes away."""
    os.mkfifo(path)

    def write() -> None:
        with contextlib.suppress(BrokenPipeError), open(path, "wb") as pipe:
            pipe.write(spec_text().encode())
            while True:
                pipe.write(b"#" * 65536)

    threading.Thread(target=write, daemon=True).start()


def _sizes(folder: Path) -> dict[str, tuple[int, int] | None]:
    """Every entry of ``folder``, a regular file's size and modification time (a sparse
    gigabyte is not read)."""
    return {entry.name: (entry.stat().st_size, entry.stat().st_mtime_ns)
            if entry.is_file() and not entry.is_fifo() else None
            for entry in folder.iterdir()}


@pytest.mark.parametrize("source", ["dev-zero", "cap-plus-one", "1GiB-sparse", "fifo"])
def test_a_spec_over_the_cap_is_refused_before_parsing(source, tmp_path, capsys):
    spec = tmp_path / "big.toml"
    if source == "dev-zero":
        spec = Path("/dev/zero")
    elif source == "cap-plus-one":  # a valid spec, then a comment past the cap
        text = spec_text().encode()
        spec.write_bytes(text + b"#" * (MAX_SPEC_BYTES + 1 - len(text)))
    elif source == "1GiB-sparse":
        with open(spec, "wb") as handle:
            handle.truncate(2**30)
    (tmp_path / "other.h5").write_bytes(b"an unrelated file")
    for attempt in ("cli", "api"):
        if source == "fifo":
            spec.unlink(missing_ok=True)
            _endless_fifo(spec)
        before = _sizes(tmp_path)
        out = tmp_path / "new.h5"
        if attempt == "cli":
            code = main(["train", str(spec), "--out", str(out), "--backend", "serial",
                         "--engine", "torch", "--no-progress"])
            line = one_error_line(capsys.readouterr().err)
            assert code == 2 and line.startswith("posteriorzoo train: error:")
            assert f"over the limit of {MAX_SPEC_BYTES:,}" in line or \
                f"more than {MAX_SPEC_BYTES:,} bytes" in line, line
            assert len(line) < 500
        else:
            tracemalloc.start()
            try:
                with pytest.raises(PosteriorZooError, match="a spec is a short TOML file"):
                    load_spec(spec)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 3 * MAX_SPEC_BYTES  # read at most the cap and a byte
        assert not out.exists()
        assert _sizes(tmp_path) == before  # nothing written, the spec unchanged


@pytest.mark.parametrize("option, value", [
    ("--workers", "0"), ("--workers", "-2"), ("--workers", "two"),
    ("--group-size", "0"), ("--group-size", "-1"),
    ("--checkpoints", "0"), ("--checkpoints", "-5"), ("--checkpoints", "2.5"),
])
def test_train_option_values_are_checked_when_parsed(option, value, tmp_path, capsys):
    spec = tmp_path / "zoo.toml"
    spec.write_text(spec_text())
    with pytest.raises(SystemExit) as exited:
        main(["train", str(spec), "--out", str(tmp_path / "z.h5"), option, value])
    assert exited.value.code == 2
    assert option in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zoo.toml"]


@pytest.mark.parametrize("call, field", [
    (lambda: make_spec(checkpoints=2.5), "checkpoints"),
    (lambda: make_spec(checkpoints=True), "checkpoints"),
    (lambda: make_spec(base_seed=-3), "base_seed"),
    (lambda: make_spec(method=["de"]), "method"),
    (lambda: make_spec(model_options=[("dropout", 0.1)]), "model_options"),
    (lambda: make_spec(recipe_overrides=3), "recipe_overrides"),
    (lambda: make_spec(recipe_overrides={"lr": float("nan")}), "lr"),
    (lambda: make_spec(recipe_overrides={"epochs": "x"}), "epochs"),
    (lambda: make_spec(recipe_overrides={"milestones": 3}), "milestones"),
    (lambda: make_spec(recipe=3), "recipe"),
    (lambda: make_spec(epochs=3), "epochs"),  # a recipe field given as a spec field
    (lambda: make_spec(name=5), "name"),
    (lambda: get_recipe("optunet-mnist", gamma=float("inf")), "gamma"),
    (lambda: Recipe("optunet", "digits", epochs=1, batch_size=8, lr="0.1"), "lr"),
    (lambda: Recipe("optunet", "digits", epochs=1.0, batch_size=8, lr=0.1), "epochs"),
    (lambda: Recipe("optunet", "digits", epochs=1, batch_size=8, lr=0.1, milestones=[1.5]),
     "milestones"),
    (lambda: make_spec().replace(checkpoints=0), "checkpoints"),
])
def test_api_refuses_bad_values_with_a_library_error(call, field):
    with pytest.raises(PosteriorZooError, match=field) as raised:
        call()
    message = str(raised.value)
    assert "\n" not in message and "--" not in message  # one line, no CLI flags


def test_valid_values_are_kept_as_given():
    spec = make_spec(dataset="digits", recipe_overrides={"lr": 1, "milestones": [3, 5],
                                                         "epochs": 6})
    assert spec.recipe.lr == 1 and isinstance(spec.recipe.lr, int)
    assert spec.recipe.milestones == (3, 5)
    assert make_spec(dataset="digits", recipe_overrides={"epochs": 0}).recipe.epochs == 0


# ---------------------------------------------------------------- nothing left by a failure
class FailingBackend:
    """Yields the first ``good`` results of the serial backend, then raises."""

    def __init__(self, good: int) -> None:
        self.good = good

    def run(self, spec, indices, engine="auto"):
        if self.good == 0:
            raise RuntimeError("a worker failed")
        for count, result in enumerate(SerialBackend().run(spec, indices, engine), 1):
            yield result
            if count == self.good:
                raise RuntimeError("a worker failed")


def test_failure_before_the_first_checkpoint_leaves_no_file(tmp_path):
    spec = make_spec(dataset="digits", checkpoints=2, base_seed=7,
                     recipe_overrides={"epochs": 1})
    out = tmp_path / "z.h5"
    with pytest.raises(RuntimeError, match="a worker failed"):
        train_collection(spec, out, backend=FailingBackend(0), engine="torch", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_failure_after_the_first_checkpoint_leaves_a_resumable_file(tmp_path):
    spec = make_spec(dataset="digits", checkpoints=2, base_seed=7,
                     recipe_overrides={"epochs": 1})
    out = tmp_path / "z.h5"
    with pytest.raises(RuntimeError, match="a worker failed"):
        train_collection(spec, out, backend=FailingBackend(1), engine="torch", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["z.h5"]
    assert list(digests(out)) == [0]
    summary = train_collection(spec, out, backend=SerialBackend(), engine="torch",
                               progress=False)
    assert (summary.trained, summary.checkpoints) == (1, 2)
    assert sorted(digests(out)) == [0, 1] and verify(out).ok


def test_missing_data_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(download, "DEBIAN_ROOT", tmp_path / "no-system-datasets")
    monkeypatch.setenv("POSTERIORZOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("POSTERIORZOO_URL_BASE", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.delenv("POSTERIORZOO_DATA", raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    spec = make_spec(dataset="mnist", data_dir=str(empty), recipe_overrides={"epochs": 1})
    with pytest.raises(DataNotFoundError):
        train_collection(spec, out_dir / "z.h5", backend=SerialBackend(), progress=False)
    assert list(out_dir.iterdir()) == []


def test_local_backend_stops_its_workers_when_a_task_fails():
    # num_classes=3 on the 10-class digits: the first training step fails in a worker.
    spec = make_spec(dataset="digits", num_classes=3, checkpoints=6,
                     recipe_overrides={"epochs": 1})
    with pytest.raises(IndexError):
        for _ in LocalBackend(workers=2).run(spec, range(6), "torch"):
            pass
    deadline = time.monotonic() + 10
    while multiprocessing.active_children():
        assert time.monotonic() < deadline, multiprocessing.active_children()
        time.sleep(0.1)


# ---------------------------------------------------------------- one writer at a time
def test_second_train_is_busy_while_the_first_one_creates_the_file(tmp_path, capsys):
    spec_path = tmp_path / "zoo.toml"
    spec_path.write_text(spec_text())
    spec = load_spec(spec_path)
    out = tmp_path / "z.h5"
    # This process plays the first train: its new collection is still a locked partial.
    first = create_zoo(out, architecture=spec.architecture, dataset=spec.dataset,
                       method=spec.method, template=initial_model(spec, 0).state_dict(),
                       recipe=spec.collection_recipe(), publish=False)
    try:
        before = folder_state(tmp_path)
        code = main(["train", str(spec_path), "--out", str(out), "--backend", "serial",
                     "--engine", "torch", "--no-progress"])
        line = one_error_line(capsys.readouterr().err)
        assert code == 2 and "another process" in line
        assert folder_state(tmp_path) == before and not out.exists()
    finally:
        first.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zoo.toml"]


def test_second_train_is_busy_while_the_first_one_appends(tmp_path, capsys):
    spec_path = tmp_path / "zoo.toml"
    spec_path.write_text(spec_text({"checkpoints": "1"}))
    out = tmp_path / "z.h5"
    train_collection(load_spec(spec_path), out, backend=SerialBackend(), engine="torch",
                     progress=False)
    with open_zoo(out, mode="r+"):  # the first train, appending to its published file
        code = main(["train", str(spec_path), "--out", str(out), "--checkpoints", "2",
                     "--backend", "serial", "--engine", "torch", "--no-progress"])
        line = one_error_line(capsys.readouterr().err)
    assert code == 2 and "another process" in line
    assert list(digests(out)) == [0]


# ---------------------------------------------------------------- kills
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Spec, command and checkpoint digests of an uninterrupted serial train."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    spec = folder / "zoo.toml"
    spec.write_text(spec_text())
    flags = ["--backend", "serial", "--engine", "torch", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("POSTERIORZOO_KILL_AT", None)
    subprocess.run([*TRAIN, str(spec), "--out", str(folder / "z.h5"), *flags], check=True,
                   capture_output=True, env=env, timeout=300)
    return spec, flags, env, digests(folder / "z.h5")


@pytest.mark.parametrize("kill_at", ["zoo-commit:1", "zoo-before-commit:2"])
def test_killed_train_leaves_nothing_or_a_resumable_file(kill_at, uninterrupted, tmp_path):
    spec, flags, env, expected = uninterrupted
    assert sorted(expected) == [0, 1]
    out = tmp_path / "z.h5"
    command = [*TRAIN, str(spec), "--out", str(out), *flags]
    killed = subprocess.run(command, capture_output=True,
                            env={**env, "POSTERIORZOO_KILL_AT": kill_at}, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    if kill_at == "zoo-commit:1":
        # Killed right after committing its first checkpoint, before publishing it:
        # nothing at the output path, only the dead process's hidden temporary file,
        # which nobody holds and the next writer reclaims.
        assert not out.exists()
        assert len(outputs.partial_paths(out)) == 1
        assert not outputs.partial_in_progress(out)
    else:
        # Killed while writing its second checkpoint: the file was published after the
        # first one and holds exactly that.
        assert list(digests(out)) == [0]
    subprocess.run(command, check=True, capture_output=True, env=env, timeout=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["z.h5"]  # partial reclaimed
    assert digests(out) == expected  # the same weights as the uninterrupted run
    assert verify(out).ok


# ---------------------------------------------------------------- orphaned workers
def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process (Linux /proc)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path("/proc", entry, "stat").read_text()
                state, parent = stat[stat.rindex(")") + 2:].split()[:2]
                table[int(entry)] = (int(parent), state)
    return table


def _descendants(pid: int) -> set[int]:
    table = _processes()
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = {p for p, (ppid, _) in table.items() if ppid == parent} - found
        found |= children
        frontier.extend(children)
    return found


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path("/proc", str(pid), "stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path("/proc", str(pid), "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_end_when_the_train_process_is_killed(tmp_path, capsys):
    spec = tmp_path / "zoo.toml"
    spec.write_text(spec_text({"checkpoints": "12"}))
    out = tmp_path / "z.h5"
    with open(tmp_path / "stderr.txt", "wb") as stderr:
        train = subprocess.Popen([*TRAIN, str(spec), "--out", str(out), "--workers", "2",
                                  "--engine", "torch", "--no-progress"],
                                 stdout=subprocess.DEVNULL, stderr=stderr,
                                 start_new_session=True)
    try:
        # Wait until the first checkpoint is published: both workers are then training.
        deadline = time.monotonic() + 120
        workers: set[int] = set()
        while not (out.exists() and len(workers) >= 2):
            assert train.poll() is None, (tmp_path / "stderr.txt").read_text()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.1)
            workers = {p for p in _descendants(train.pid) if "spawn_main" in _cmdline(p)}
        # A second train of the same file is refused while the first one runs.
        code = main(["train", str(spec), "--out", str(out), "--backend", "serial",
                     "--no-progress"])
        assert code == 2 and "another process" in one_error_line(capsys.readouterr().err)

        everything = _descendants(train.pid)
        assert workers <= everything
        os.kill(train.pid, signal.SIGKILL)  # only the parent
        train.wait()
        deadline = time.monotonic() + 10
        while left := {pid for pid in everything if _running(pid)}:
            assert time.monotonic() < deadline, \
                f"still running 10 s after their parent was killed: {left}"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(train.pid, signal.SIGKILL)
        train.wait()
    # What was committed before the kill stays readable.
    assert 1 <= len(digests(out)) < 12
