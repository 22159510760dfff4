"""Every writing command killed with SIGKILL at chosen moments: nothing half-written.

Each case runs one command in a subprocess with ``POSTERIORZOO_KILL_AT=POINT:K`` (see
:mod:`posteriorzoo._faults`), so the kill lands at a known moment rather than after a
sleep, and checks:

1. the process died by SIGKILL (a command that completes never reached the point, and
   the case fails: it would not test what it claims);
2. the inputs are byte-identical, and the system temp folder (``TMPDIR``) is empty;
3. each output path is absent, or complete and equal to an uninterrupted run's; the
   only other files are the dead process's temporaries ``.NAME.partial-*``, and they
   hold what the kill point says they hold (the moment really was the one named);
4. the same command run again (in this process, without the kill variable) exits 0,
   reclaims the temporaries and leaves exactly the uninterrupted run's result.

A complete ``min-mass --out DIR`` result is the folder holding ``min_mass.csv`` and
``min_mass.json`` (whose ``table_sha256`` is the CSV's digest). Kills of ``import`` into
an existing collection and of ``train`` are in ``test_exchange_hostile.py``
(``test_import_killed_part_way_finishes_when_run_again``) and
``test_train_robustness.py`` (``test_killed_train_leaves_nothing_or_a_resumable_file``);
here ``import`` is killed once, into a new path, just before publishing. ``demo`` is
killed in its training and in its MMD step (marked slow: even with ``--checkpoints 1
--epochs 1`` it runs its steps on the shipped reference zoo, a minute or more a run).

With ``POSTERIORZOO_PROBE_LOG=FILE`` each case appends one JSON line
``{"suite": "faults", "command", "class": "sigkill", "refused": false, "ok"}``
(``tests/probe_table.py`` prints them as a table).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import pytest
import torch
from fuzz_driver import make_collection

from posteriorzoo.cli import main
from posteriorzoo.collection import verify
from posteriorzoo.zoo import open_zoo

REPO = Path(__file__).resolve().parents[1]
QUIET = "--no-progress"
TARGET_SIZE, METHOD_SIZE = 8, 6
MMD_FILES = ["mmd_layers.csv", "mmd_report.json", "mmd_report.md", "mmd_summary.csv"]


# ---------------------------------------------------------------------- helpers
def snapshot(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (hidden ones included)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def _no_kill_variable() -> Iterator[None]:
    saved = os.environ.pop("POSTERIORZOO_KILL_AT", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["POSTERIORZOO_KILL_AT"] = saved


def run_here(argv: list) -> tuple[int, str]:
    """Run the CLI in this process (no kill variable); returns (exit code, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with _no_kill_variable(), contextlib.redirect_stdout(stdout), \
            contextlib.redirect_stderr(stderr):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as stop:
            code = stop.code
    return code, stderr.getvalue()


def run_killed(argv: list, kill_at: str, tmpdir: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "POSTERIORZOO_KILL_AT"}
    env.update(POSTERIORZOO_KILL_AT=kill_at, TMPDIR=str(tmpdir), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "posteriorzoo", *map(str, argv)], env=env,
                          capture_output=True, timeout=300)


def partials(folder: Path, name: str) -> list[Path]:
    return sorted(folder.glob(f".{name}.partial-*"))


def committed(path: Path) -> int:
    """The committed checkpoint count of a (possibly unpublished) collection file."""
    with h5py.File(path, "r", swmr=True, locking=False) as handle:
        return int(handle["committed"][0])


def collection_state(path: Path) -> tuple:
    """Digests, metadata (without write and training times) and tensors of a collection."""
    with open_zoo(path) as zoo:
        digests = [str(d) for d in zoo.metadata["sha256"]]
        names = [n for n in zoo.metadata.dtype.names if n not in ("written_at", "wall_time")]
        rows = [[repr(row[n]) for n in names] for row in zoo.metadata]  # NaN == NaN
        tensors = [zoo.state_dict(i) for i in range(len(zoo))]
    return digests, rows, tensors


def assert_same_collection(path: Path, reference: Path) -> None:
    report = verify(path)
    assert report.ok, report.summary()
    digests, rows, tensors = collection_state(path)
    want_digests, want_rows, want_tensors = collection_state(reference)
    assert digests == want_digests
    assert rows == want_rows
    for got, want in zip(tensors, want_tensors, strict=True):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def _data_rows(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.startswith("#")]


_VOLATILE = {"command", "created_at", "seconds", "files"}  # differ run to run (the Markdown
# holds the provenance, so its digest in "files" does too)


def _stable(value):
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def assert_same_mmd_report(folder: Path, reference: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == MMD_FILES
    for name in ("mmd_layers.csv", "mmd_summary.csv"):
        assert _data_rows(folder / name) == _data_rows(reference / name), name
    got, want = (json.loads((f / "mmd_report.json").read_text()) for f in (folder, reference))
    assert _stable(got) == _stable(want)
    table = [(f / "mmd_report.md").read_text().split("## Provenance")[0]
             for f in (folder, reference)]
    assert table[0] == table[1]


def assert_same_min_mass(folder: Path, reference: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == ["min_mass.csv", "min_mass.json"]
    table = (folder / "min_mass.csv").read_bytes()
    assert table == (reference / "min_mass.csv").read_bytes()
    sidecar = json.loads((folder / "min_mass.json").read_text())
    want = json.loads((reference / "min_mass.json").read_text())
    assert sidecar["files"]["min_mass.csv"] == hashlib.sha256(table).hexdigest()
    assert _stable(sidecar) == _stable(want)


def _safetensors(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's parsed header and its data bytes."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def assert_same_export(path: Path, reference: Path) -> None:
    """The same safetensors file(s), byte for byte (the exporter sorts the header)."""
    if reference.is_dir():
        assert sorted(p.name for p in path.iterdir()) == sorted(
            p.name for p in reference.iterdir())
        for file in reference.iterdir():
            assert_same_export(path / file.name, file)
        return
    assert path.read_bytes() == reference.read_bytes()


# ---------------------------------------------------------------------- commands
@dataclass(frozen=True)
class Inputs:
    root: Path
    target: Path
    method: Path
    exported: list[Path]


@dataclass(frozen=True)
class Command:
    """A writing command: its arguments, its outputs and how to compare them."""

    argv: Callable[[Inputs, Path], list]
    outputs: tuple[str, ...]  # names in the output folder; the first is the main one
    same: Callable[[Path, Path], None]  # (output, reference output) -> assert equal


COMMANDS = {
    "canonicalize": Command(
        lambda i, out: ["canonicalize", i.target, "--out", out / "canonical.h5",
                        "--checkpoints-per-batch", "2", QUIET],
        ("canonical.h5",), assert_same_collection),
    "min-mass": Command(
        lambda i, out: ["min-mass", i.target, "--out", out / "mass", "--checkpoints-per-batch", "2",
                        QUIET],
        ("mass",), assert_same_min_mass),
    "mmd": Command(
        lambda i, out: ["mmd", i.target, i.method, "--symmetries", "both", "--out",
                        out / "report", QUIET],
        ("report",), assert_same_mmd_report),
    "export": Command(
        lambda i, out: ["export", i.target, "3", "--out", out / "one.safetensors"],
        ("one.safetensors",), assert_same_export),
    "export-all": Command(
        lambda i, out: ["export", i.target, "--all", "--out", out / "all"],
        ("all",), assert_same_export),
    "import": Command(
        lambda i, out: ["import", "--out", out / "new.h5", *i.exported,
                        "--checkpoints-per-batch", "3", QUIET],
        ("new.h5",), assert_same_collection),
}


# What the dead process left at each kill point: proof that the kill landed at the moment
# the case names. Each check gets (the output folder, the reference run's folder).
def _only_partial(out: Path, name: str) -> Path:
    found = partials(out, name)
    assert len(found) == 1, found
    return found[0]


def _collection_with(name: str, count: int):
    def check(out: Path, reference: Path) -> None:
        assert committed(_only_partial(out, name)) == count
    return check


def _min_mass_written(out: Path, reference: Path) -> None:
    # both files, complete, in the temporary folder about to be published
    assert_same_min_mass(_only_partial(out, "mass"), reference / "mass")


def _export_written(out: Path, reference: Path) -> None:
    assert_same_export(_only_partial(out, "one.safetensors"), reference / "one.safetensors")


def _exported_files(count: int):
    def check(out: Path, reference: Path) -> None:
        folder = _only_partial(out, "all")
        names = sorted(p.name for p in folder.iterdir())
        assert names == [f"{i:06d}.safetensors" for i in range(count)]
        for name in names:
            assert_same_export(folder / name, reference / "all" / name)
    return check


def _mmd_computing(out: Path, reference: Path) -> None:
    # statistics under way: the canonical copies (symmetries both) live inside the
    # temporary output folder, no report file is written yet
    (work,) = _only_partial(out, "report").iterdir()
    assert work.name.startswith("posteriorzoo-mmd-"), work
    copies = sorted(p.name for p in work.iterdir())
    assert len(copies) == 2 and not any(".partial-" in name for name in copies), copies


def _mmd_canonicalizing(out: Path, reference: Path) -> None:
    # the target's canonical copy is being built, as a temporary file inside the
    # temporary output folder
    (work,) = _only_partial(out, "report").iterdir()
    assert work.name.startswith("posteriorzoo-mmd-"), work
    (copy,) = work.iterdir()
    assert ".partial-" in copy.name and committed(copy) == TARGET_SIZE


def _mmd_written(out: Path, reference: Path) -> None:
    assert_same_mmd_report(_only_partial(out, "report"), reference / "report")


@dataclass(frozen=True)
class Case:
    command: str
    kill_at: str
    moment: Callable[[Path, Path], None]


CASES = [
    Case("canonicalize", "canonicalize-batch:1", _collection_with("canonical.h5", 2)),
    Case("canonicalize", "canonicalize-batch:2", _collection_with("canonical.h5", 4)),
    Case("canonicalize", "zoo-publish", _collection_with("canonical.h5", TARGET_SIZE)),
    Case("min-mass", "publish", _min_mass_written),
    # 4 layers x 1 method per treatment: 1 and 3 while keeping symmetries, 6 removing
    Case("mmd", "mmd-layer:1", _mmd_computing),
    Case("mmd", "mmd-layer:3", _mmd_computing),
    Case("mmd", "mmd-layer:6", _mmd_computing),
    Case("mmd", "canonicalize-batch:1", _mmd_canonicalizing),
    # the target's and the method's canonical copies are published first (publish 1, 2)
    Case("mmd", "publish:3", _mmd_written),
    Case("export", "publish", _export_written),
    Case("export-all", "export-file:2", _exported_files(2)),
    Case("export-all", "publish", _exported_files(TARGET_SIZE)),
    Case("import", "zoo-publish", _collection_with("new.h5", TARGET_SIZE)),
]


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Inputs:
    root = tmp_path_factory.mktemp("inputs")
    target, method = root / "target.h5", root / "method.h5"
    make_collection(target, 0, TARGET_SIZE)
    make_collection(method, 100, METHOD_SIZE)
    exported = root / "exported"
    code, err = run_here(["export", target, "--all", "--out", exported])
    assert code == 0, err
    return Inputs(root, target, method, sorted(exported.iterdir()))


@pytest.fixture(scope="module")
def references(tmp_path_factory, inputs) -> Callable[[str], Path]:
    """The output folder of one uninterrupted run per command (run on first use)."""
    done: dict[str, Path] = {}

    def reference(command: str) -> Path:
        if command not in done:
            folder = tmp_path_factory.mktemp(f"reference-{command}")
            code, err = run_here(COMMANDS[command].argv(inputs, folder))
            assert code == 0, err
            assert sorted(p.name for p in folder.iterdir()) == sorted(COMMANDS[command].outputs)
            done[command] = folder
        return done[command]

    return reference


@contextlib.contextmanager
def probe(command: str) -> Iterator[None]:
    ok = False
    try:
        yield
        ok = True
    finally:
        path = os.environ.get("POSTERIORZOO_PROBE_LOG")
        if path:
            with open(path, "a") as log:
                log.write(json.dumps({"suite": "faults", "command": command,
                                      "class": "sigkill", "refused": False, "ok": ok}) + "\n")


# ---------------------------------------------------------------------- the test
def _check_outputs(command: Command, out: Path, reference: Path) -> None:
    """Each output is absent or complete; anything else is a temporary of an output."""
    present = [name for name in command.outputs if (out / name).exists()]
    if present:
        missing = sorted(set(command.outputs) - set(present))
        assert not missing, f"incomplete result: {present} written, {missing} not"
        command.same(out / command.outputs[0], reference / command.outputs[0])
    for path in out.iterdir():
        assert path.name in command.outputs or any(
            path.name.startswith(f".{name}.partial-") for name in command.outputs), path


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c.command}-{c.kill_at}")
                                  for c in CASES])
def test_sigkill_leaves_nothing_or_the_complete_result(case, inputs, references, tmp_path):
    with probe(case.command):
        command = COMMANDS[case.command]
        reference = references(case.command)
        out, tmpdir = tmp_path / "out", tmp_path / "tmp"
        out.mkdir()
        tmpdir.mkdir()
        argv = command.argv(inputs, out)
        before = snapshot(inputs.root)

        killed = run_killed(argv, case.kill_at, tmpdir)
        assert killed.returncode != 0, f"{case.kill_at} was never reached: the command completed"
        assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()

        assert snapshot(inputs.root) == before, "an input changed"
        assert list(tmpdir.iterdir()) == [], "left files in the system temp folder"
        case.moment(out, reference)
        _check_outputs(command, out, reference)

        code, err = run_here(argv)
        assert code == 0, err
        assert sorted(p.name for p in out.iterdir()) == sorted(command.outputs), \
            "temporaries left after the rerun"
        command.same(out / command.outputs[0], reference / command.outputs[0])
        assert snapshot(inputs.root) == before, "an input changed"


# ---------------------------------------------------------------------- demo
DEMO_FILES = ["SHA256SUMS", "checkpoint-0.safetensors", "de-canonical.h5", "demo-summary.json",
              "mmd-report", "optunet-digits-de.h5", "roundtrip.h5"]


def demo_argv(out: Path) -> list:
    return ["demo", "--out", out / "demo", "--checkpoints", "1", "--epochs", "1", QUIET]


@pytest.fixture(scope="module")
def demo_reference(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("reference-demo")
    code, err = run_here(demo_argv(folder))
    assert code == 0, err
    return folder / "demo"


def assert_same_demo(folder: Path, reference: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == DEMO_FILES
    for name in ("de-canonical.h5", "optunet-digits-de.h5", "roundtrip.h5"):
        assert_same_collection(folder / name, reference / name)
    assert_same_mmd_report(folder / "mmd-report", reference / "mmd-report")
    # the exported checkpoint's header records its training time: compare the tensors
    (header, data), (want_header, want_data) = (
        _safetensors(f / "checkpoint-0.safetensors") for f in (folder, reference))
    header.pop("__metadata__")
    want_header.pop("__metadata__")
    assert (header, data) == (want_header, want_data)
    summary, want = (json.loads((f / "demo-summary.json").read_text())
                     for f in (folder, reference))
    for key in ("symmetry", "mmd", "verify_ok", "roundtrip_identical", "base_seed"):
        assert _stable(summary[key]) == _stable(want[key]), key


def _demo_training(work: Path) -> None:
    # the digits zoo's first checkpoint committed, the zoo not yet published
    names = [p.name for p in work.iterdir()]
    assert len(names) == 1 and names[0].startswith(".optunet-digits-de.h5.partial-"), names
    assert committed(work / names[0]) == 1


def _demo_comparing(work: Path) -> None:
    # steps 3 to 5 done, the MMD statistics (step 6) under way: its canonical copies are
    # in a working folder inside the demo's temporary output, not in the system's
    names = sorted(p.name for p in work.iterdir())
    assert names[:3] == ["checkpoint-0.safetensors", "de-canonical.h5", "optunet-digits-de.h5"]
    assert names[3].startswith("posteriorzoo-mmd-") and names[4:] == ["roundtrip.h5"], names


@pytest.mark.slow
@pytest.mark.parametrize("kill_at, moment", [("zoo-commit:1", _demo_training),
                                             ("mmd-layer:1", _demo_comparing)],
                         ids=["zoo-commit:1", "mmd-layer:1"])
def test_sigkill_demo_leaves_nothing_or_the_complete_result(kill_at, moment, demo_reference,
                                                            tmp_path):
    from posteriorzoo.reference import reference_path

    with probe("demo"):
        out, tmpdir = tmp_path / "out", tmp_path / "tmp"
        out.mkdir()
        tmpdir.mkdir()
        shipped = reference_path("target").parent
        before = snapshot(shipped)

        killed = run_killed(demo_argv(out), kill_at, tmpdir)
        assert killed.returncode != 0, f"{kill_at} was never reached: the demo completed"
        assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()

        assert snapshot(shipped) == before, "the shipped reference zoo changed"
        assert not (out / "demo").exists()
        (work,) = out.iterdir()
        assert work.name.startswith(".demo.partial-"), work
        moment(work)
        leftovers = sorted(p.name for p in tmpdir.iterdir())  # checked last

        code, err = run_here(demo_argv(out))
        assert code == 0, err
        assert [p.name for p in out.iterdir()] == ["demo"], "temporaries left after the rerun"
        assert_same_demo(out / "demo", demo_reference)
        assert snapshot(shipped) == before, "the shipped reference zoo changed"
        assert leftovers == [], f"the killed demo left in the system temp folder: {leftovers}"
