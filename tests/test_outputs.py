"""The output policy itself: refusals, atomic publication, reclaiming, busy outputs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from posteriorzoo.errors import InvalidOptionError, OutputExistsError, ZooBusyError
from posteriorzoo.outputs import (
    atomic_directory,
    atomic_file,
    check_output,
    partial_in_progress,
    partial_paths,
    reclaim_partials,
)


def test_refusals(tmp_path):
    source = tmp_path / "in.h5"
    source.write_bytes(b"data")
    with pytest.raises(InvalidOptionError, match="replace the input"):
        check_output(source, inputs=[source], overwrite=True)
    with pytest.raises(InvalidOptionError, match="replace the input"):
        check_output(tmp_path / "." / "in.h5", inputs=[source], overwrite=True)
    with pytest.raises(OutputExistsError):
        check_output(source)
    with pytest.raises(InvalidOptionError, match="does not exist"):
        check_output(tmp_path / "missing" / "out")
    with pytest.raises(InvalidOptionError, match="holds the input"):
        check_output(tmp_path, inputs=[source], overwrite=True)
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(InvalidOptionError, match="is a folder"), \
            atomic_file(folder, overwrite=True):
        pass
    assert source.read_bytes() == b"data"


def test_published_only_when_complete(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(RuntimeError), atomic_file(target) as partial:
        partial.write_text("half")
        assert not target.exists() and partial.name.startswith(".out.txt.partial-")
        raise RuntimeError("failed half-way")
    assert not target.exists() and not partial_paths(target)
    with atomic_file(target) as partial:
        partial.write_text("whole")
    assert target.read_text() == "whole" and not partial_paths(target)
    with atomic_directory(tmp_path / "dir") as partial:
        (partial / "a").write_text("1")
    with atomic_directory(tmp_path / "dir", overwrite=True) as partial:
        (partial / "b").write_text("2")
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["b"]  # replaced, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "out.txt"]


def test_an_output_that_appears_meanwhile_is_not_replaced(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(OutputExistsError), atomic_file(target) as partial:
        partial.write_text("mine")
        target.write_text("someone else's")
    assert target.read_text() == "someone else's" and not partial_paths(target)


HOLDER = textwrap.dedent("""
    import sys, time
    from posteriorzoo.outputs import new_partial
    partial, fd = new_partial(sys.argv[1])
    print(partial, flush=True)
    time.sleep(60)
""")


def test_live_partials_are_busy_and_dead_ones_reclaimed(tmp_path):
    target = tmp_path / "out.h5"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(target)],
                              stdout=subprocess.PIPE, text=True)
    try:
        partial = holder.stdout.readline().strip()
        assert os.path.exists(partial) and partial_in_progress(target)
        assert reclaim_partials(target) == []  # a live builder keeps its partial
        with pytest.raises(ZooBusyError), atomic_file(target):
            pass
    finally:
        holder.kill()
        holder.wait()
    assert not partial_in_progress(target)
    with atomic_file(target) as fresh:  # the dead builder's partial is reclaimed
        fresh.write_text("x")
    assert not os.path.exists(partial) and partial_paths(target) == []
