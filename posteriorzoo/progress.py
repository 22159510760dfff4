"""Progress of long work: a bar at a terminal, a line now and then in a log.

At a terminal the commands draw tqdm's bars. Where stderr is a pipe or a file (a batch
job's log, a cluster's), a redrawn bar would become a line per redraw, so the work
reports itself in plain lines instead (:class:`LogProgress`): none for work that ends
within :data:`FIRST_LINE_AFTER` seconds (a short command, or one refused at once, keeps
its single line), then one line every :data:`LINE_EVERY` seconds with the count, the
rate and the time left, and a last line with the total time. :func:`progress` picks one.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

#: Seconds of work before a log gets its first progress line.
FIRST_LINE_AFTER = 10.0
#: Seconds between two progress lines in a log.
LINE_EVERY = 60.0


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal (a closed or replaced stream is not)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "unknown"
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class LogProgress:
    """tqdm's interface (iteration, ``update``, ``set_postfix``, ``close``, a context
    manager) as occasional lines on stderr: ``DESC: N/TOTAL UNIT (P%), R UNIT/s, about T
    left`` every :data:`LINE_EVERY` seconds once :data:`FIRST_LINE_AFTER` have passed,
    and ``DESC: N UNIT in T (R UNIT/s)`` at the end of work that took that long."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None,
                 desc: str = "", unit: str = "it", initial: int = 0,
                 clock: Any = time.monotonic, stream: Any = None) -> None:
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            self.total = len(iterable)
        self.n = self.initial = initial
        self.postfix: dict[str, Any] = {}
        self._clock, self._stream = clock, stream
        self._start = clock()
        self._next_line = self._start + FIRST_LINE_AFTER
        self._closed = False

    def __iter__(self) -> Iterator:
        assert self.iterable is not None
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self._closed = True   # an error: its own line says what happened

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True,
                    **values: Any) -> None:
        """What the next line adds after the rate (``key value`` pairs), as tqdm's."""
        self.postfix = {**(ordered_dict or {}), **values}

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        """What the next line adds after the rate (a text), as tqdm's."""
        self.postfix = {"at": text} if text else {}

    def update(self, count: int = 1) -> None:
        self.n += count
        now = self._clock()
        if now >= self._next_line:
            self._say(self._running_line(now))
            self._next_line = now + LINE_EVERY

    def _rate(self, now: float) -> float:
        elapsed = now - self._start
        return (self.n - self.initial) / elapsed if elapsed > 0 else float("nan")

    def _running_line(self, now: float) -> str:
        rate = self._rate(now)
        done = f"{self.n:,}"
        if self.total:
            left = (self.total - self.n) / rate if rate > 0 else float("inf")
            done = (f"{self.n:,}/{self.total:,} {self.unit} ({100 * self.n / self.total:.0f}%)"
                    f", {rate:.3g} {self.unit}/s, about {_duration(left)} left")
        else:
            done = f"{done} {self.unit}, {rate:.3g} {self.unit}/s"
        return done + self._postfix_text()

    def _postfix_text(self) -> str:
        return "".join(f", {key} {value}" for key, value in self.postfix.items())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        now = self._clock()
        elapsed = now - self._start
        if elapsed >= FIRST_LINE_AFTER:
            self._say(f"{self.n:,} {self.unit} in {_duration(elapsed)} "
                      f"({self._rate(now):.3g} {self.unit}/s)" + self._postfix_text())

    def _say(self, text: str) -> None:
        stream = self._stream or sys.stderr
        print(f"{self.desc}: {text}" if self.desc else text, file=stream, flush=True)


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", enabled: bool = True, **options: Any) -> Any:
    """A progress reporter for long work: nothing when not ``enabled``; tqdm's bar
    (``options`` passed on) when stderr is a terminal; else :class:`LogProgress`."""
    from tqdm.auto import tqdm

    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if stderr_is_terminal():
        return tqdm(iterable, total=total, desc=desc, unit=unit, **options)
    return LogProgress(iterable, total, desc, unit, initial=options.get("initial", 0))
