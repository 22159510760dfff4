"""A figure's PNG and PDF are one output, and plot's working folders are reclaimed (issue 16).

- **Multi-file outputs.** ``plot`` publishes a figure's two files together
  (:func:`posteriorzoo.outputs.atomic_files`). Killed between the two (the fault point
  ``publish-file``), it leaves the PNG published but still a hard link of its dead
  temporary file; the rerun recognises it as the half of an unfinished figure, replaces
  it and leaves exactly the complete pair, equal to an uninterrupted run's. A file a
  live command is publishing, or one a user made, is still refused.
- **Temp after kill.** ``plot marginals`` and ``plot mmd`` canonicalize into a folder of
  TMPDIR locked by the running process (:func:`posteriorzoo.outputs.temporary_folder`).
  Killed mid-way they leave it, with a partial canonical copy; the next plot removes it
  and leaves the folders of live processes alone.

Every kill is a SIGKILL at a named point (``POSTERIORZOO_KILL_AT``, see
:mod:`posteriorzoo._faults`), in a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fuzz_driver import make_collection

from posteriorzoo import outputs
from posteriorzoo.errors import OutputExistsError

REPO = Path(__file__).resolve().parents[1]


def run_plot(argv: list, tmpdir: Path, kill_at: str | None = None
             ) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "POSTERIORZOO_KILL_AT"}
    env.update(TMPDIR=str(tmpdir), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    if kill_at:
        env["POSTERIORZOO_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "posteriorzoo", "plot", *map(str, argv)],
                          env=env, capture_output=True, text=True, timeout=600)


def assert_killed(result: subprocess.CompletedProcess, point: str) -> None:
    assert result.returncode != 0, f"{point} was never reached: the command completed"
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def assert_complete_pdf(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(b"%PDF-") and data.rstrip().endswith(b"%%EOF"), path


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inputs") / "target.h5"
    make_collection(path, 0, 8)
    return path


@pytest.fixture(scope="module")
def method(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inputs") / "method.h5"
    make_collection(path, 100, 6)
    return path


@pytest.fixture(scope="module")
def reference_png(tmp_path_factory, target) -> bytes:
    """The PCA figure's PNG of an uninterrupted run (deterministic; the PDF records its
    creation time)."""
    folder = tmp_path_factory.mktemp("reference")
    result = run_plot(["pca", target, "--out", folder / "pca"], folder)
    assert result.returncode == 0, result.stderr
    return (folder / "pca.png").read_bytes()


# ---------------------------------------------------------------------- multi-file outputs
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_plot_killed_between_a_figures_files_is_completed_by_the_rerun(
        overwrite, target, reference_png, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    argv = ["pca", target, "--out", out / "pca"] + (["--overwrite"] if overwrite else [])
    if overwrite:  # an older complete figure to replace
        (out / "pca.png").write_bytes(b"old png")
        (out / "pca.pdf").write_bytes(b"old pdf")

    killed = run_plot(argv, tmp_path, kill_at="publish-file:1")
    assert_killed(killed, "publish-file:1")
    # the moment: the PNG is in place (a link of the dead run's temporary PNG), the PDF
    # is not, both temporaries are there
    png_partials = sorted(out.glob(".pca.png.partial-*"))
    pdf_partials = sorted(out.glob(".pca.pdf.partial-*"))
    assert len(png_partials) == 1 and len(pdf_partials) == 1, names(out)
    assert os.path.samefile(out / "pca.png", png_partials[0])
    assert (out / "pca.pdf").exists() == overwrite
    if overwrite:
        assert (out / "pca.pdf").read_bytes() == b"old pdf"

    rerun = run_plot(argv, tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert names(out) == ["pca.pdf", "pca.png"], "temporaries left after the rerun"
    assert (out / "pca.png").read_bytes() == reference_png
    assert_complete_pdf(out / "pca.pdf")


def test_plot_killed_before_publishing_leaves_no_figure(target, reference_png, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    argv = ["pca", target, "--out", out / "pca"]
    killed = run_plot(argv, tmp_path, kill_at="publish:1")
    assert_killed(killed, "publish:1")
    assert not (out / "pca.png").exists() and not (out / "pca.pdf").exists()
    assert len(names(out)) == 2  # the two complete temporaries
    rerun = run_plot(argv, tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert names(out) == ["pca.pdf", "pca.png"]
    assert (out / "pca.png").read_bytes() == reference_png


def test_a_live_or_a_users_file_is_still_refused(tmp_path):
    """Only a file linked to a dead command's temporary file is replaced."""
    png, pdf = tmp_path / "f.png", tmp_path / "f.pdf"
    partial, fd = outputs.new_partial(png, member=True)
    os.link(partial, png)  # published by a command still running (this one)
    try:
        with pytest.raises(OutputExistsError):
            outputs.check_output(png)
        assert png.exists() and partial.exists()
    finally:
        os.close(fd)  # the command dies
    assert outputs.check_output(png) == png
    assert not png.exists() and not partial.exists()
    pdf.write_bytes(b"a user's file")
    with pytest.raises(OutputExistsError):
        outputs.check_output(pdf)
    assert pdf.read_bytes() == b"a user's file"


def test_atomic_files_publish_all_or_nothing(tmp_path, monkeypatch):
    paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
    with pytest.raises(RuntimeError), outputs.atomic_files(paths) as partials:
        partials[0].write_text("a")
        raise RuntimeError("the second file failed")
    assert names(tmp_path) == []

    def another_writer(point: str) -> None:  # b.txt appears once a.txt is published
        if point == "publish-file" and not paths[1].exists():
            paths[1].write_text("appeared meanwhile")

    monkeypatch.setattr(outputs, "fault_point", another_writer)
    with pytest.raises(OutputExistsError), outputs.atomic_files(paths) as partials:
        for partial in partials:
            partial.write_text("mine")
    assert names(tmp_path) == ["b.txt"], "the published half was left"
    assert paths[1].read_text() == "appeared meanwhile"

    with outputs.atomic_files(paths, overwrite=True) as partials:
        for partial, text in zip(partials, "AB", strict=True):
            partial.write_text(text)
    assert [p.read_text() for p in paths] == ["A", "B"]
    assert names(tmp_path) == ["a.txt", "b.txt"]


# ---------------------------------------------------------------------- temp after kill
@pytest.mark.parametrize("figure", ["marginals", "mmd"])
def test_killed_plot_leaves_a_temp_folder_the_next_plot_reclaims(figure, target, method,
                                                                 tmp_path):
    out, tmpdir = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    tmpdir.mkdir()
    argv = (["marginals", target, "--symmetries", "both"] if figure == "marginals" else
            ["mmd", target, method, "--symmetries", "remove", "--noise-splits", "2"])
    argv += ["--out", out / figure]

    killed = run_plot(argv, tmpdir, kill_at="canonicalize-batch:1")
    assert_killed(killed, "canonicalize-batch:1")
    (left,) = tmpdir.iterdir()
    assert left.name.startswith("posteriorzoo-plot-"), left
    copies = [p.name for p in left.iterdir()]
    assert len(copies) == 1 and ".partial-" in copies[0], copies  # a partial canonical copy
    assert names(out) == []

    with outputs.temporary_folder("plot", tmpdir) as live:  # another plot, running
        rerun = run_plot(argv, tmpdir)
        assert rerun.returncode == 0, rerun.stderr
        assert names(tmpdir) == [live.name], "the dead plot's folder was not reclaimed"
    assert names(tmpdir) == []
    assert names(out) == [f"{figure}.pdf", f"{figure}.png"]


def test_temporary_folder_is_locked_and_removed(tmp_path):
    with outputs.temporary_folder("plot", tmp_path) as folder:
        (folder / "x").write_text("x")
        with outputs.temporary_folder("plot", tmp_path) as other:
            assert folder.exists() and other != folder  # a live folder is not reclaimed
    assert names(tmp_path) == []
    dead = tmp_path / "posteriorzoo-plot-1-dead"
    dead.mkdir()
    (dead / ".canonical.h5.partial-1-ab").write_text("x")
    unrelated = tmp_path / "posteriorzoo-mmd-keep"
    unrelated.mkdir()
    with outputs.temporary_folder("plot", tmp_path):
        pass
    assert names(tmp_path) == ["posteriorzoo-mmd-keep"]
