"""Progress of long work in a log (stderr not a terminal): posteriorzoo.progress."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from posteriorzoo import progress
from posteriorzoo.progress import FIRST_LINE_AFTER, LINE_EVERY, LogProgress


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_short_work_prints_nothing():
    """A command that ends within FIRST_LINE_AFTER seconds (or is refused at once) keeps
    its output: not a progress line."""
    clock, out = Clock(), io.StringIO()
    with LogProgress(total=100, desc="canonicalize", unit="ckpt", clock=clock,
                     stream=out) as bar:
        for _ in range(100):
            clock.now += (FIRST_LINE_AFTER - 1) / 100
            bar.update()
    assert out.getvalue() == ""


def test_long_work_says_count_rate_and_time_left_then_the_total():
    clock, out = Clock(), io.StringIO()
    with LogProgress(total=1000, desc="import", unit="ckpt", clock=clock, stream=out) as bar:
        for _ in range(1000):
            clock.now += 0.125          # 8 checkpoints a second, 125 s in all
            bar.update()
    lines = out.getvalue().splitlines()
    # the first line once 10 s have passed, then one a minute, then the total
    assert lines[0] == "import: 80/1,000 ckpt (8%), 8 ckpt/s, about 1.9 min left"
    assert lines[1] == "import: 560/1,000 ckpt (56%), 8 ckpt/s, about 55 s left"
    assert lines[2] == "import: 1,000 ckpt in 2.1 min (8 ckpt/s)"
    assert len(lines) == 3 and LINE_EVERY == 60


def test_iteration_resumed_counts_and_errors():
    """As an iterator it counts each item; a resumed run's rate counts only new work;
    an error ends it without a last line (the error's own line says what happened)."""
    clock, out = Clock(), io.StringIO()
    items = []
    for item in LogProgress(range(30), desc="check", unit="ckpt", clock=clock, stream=out):
        clock.now += 1.0
        items.append(item)
    assert items == list(range(30))
    assert out.getvalue().splitlines()[-1] == "check: 30 ckpt in 30 s (1 ckpt/s)"
    out = io.StringIO()
    bar = LogProgress(total=20, desc="train", unit="ckpt", initial=10, clock=clock,
                      stream=out)
    clock.now += 20.0
    bar.set_postfix(diverged=0)
    bar.update(2)
    assert out.getvalue() == "train: 12/20 ckpt (60%), 0.1 ckpt/s, about 80 s left, diverged 0\n"
    with pytest.raises(RuntimeError), bar:
        raise RuntimeError("a failure")
    assert out.getvalue().count("\n") == 1
    # tqdm's other postfix setter, as mmd's progress uses it
    bar = LogProgress(total=4, desc="mmd", unit="layer", clock=clock, stream=out)
    clock.now += 20.0
    bar.set_postfix_str("remove fc.weight SWAG", refresh=False)
    bar.update()
    assert out.getvalue().splitlines()[-1].endswith(", at remove fc.weight SWAG")


def test_progress_picks_a_bar_a_log_or_nothing(monkeypatch):
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: False)
    assert isinstance(progress.progress(total=3, desc="x"), LogProgress)
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    bar = progress.progress(total=3, desc="x")
    assert isinstance(bar, tqdm) and not bar.disable
    bar.close()
    assert progress.progress(total=3, enabled=False).disable
