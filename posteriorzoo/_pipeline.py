"""Overlapping a file-to-file command's reading, computing and writing (threads).

A ResNet-18 checkpoint is 45 MB: reading and verifying it (SHA-256), canonicalizing it
and writing it with its digest are each a few hundredths of a second, and on 2 cores they
can run at the same time. SHA-256 (hashlib), torch's kernels and HDF5's data copies
release the GIL for their long parts, so plain threads overlap them; h5py's own lock keeps
its calls one at a time, which is all HDF5 needs.

Both helpers keep memory bounded (at most ``depth`` items waiting) and re-raise a worker's
exception in the caller, at the next hand-over or at the end, so a failure still stops
the command before anything is published.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

Item = TypeVar("Item")

_DONE = object()
#: Seconds between checks, by a producer blocked on a full queue, that its reader has gone.
_POLL_SECONDS = 0.1


def read_ahead(items: Iterable[Item], depth: int = 1) -> Iterator[Item]:
    """Yield ``items`` in order while a background thread already produces the next
    ``depth``; the producer's exception is raised here, where its item would have been.

    Closing the generator early (the consumer failed or stopped) stops the producer at its
    next item.
    """
    waiting: queue.Queue = queue.Queue(maxsize=depth)
    stopped = threading.Event()

    def hand_over(entry: tuple[bool, Any]) -> bool:
        while not stopped.is_set():
            try:
                waiting.put(entry, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not hand_over((True, item)):
                    return
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer
            hand_over((False, error))
            return
        hand_over((True, _DONE))

    worker = threading.Thread(target=produce, name="posteriorzoo-read-ahead", daemon=True)
    worker.start()
    try:
        while True:
            ok, item = waiting.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item
    finally:
        stopped.set()
        worker.join()


class WriteBehind:
    """Run write calls one at a time, in order, in a background thread, while the caller
    prepares the next: at most one write waits behind the running one.

    Use as a context manager; leaving it waits for the last write and raises the first
    write error (a failed write stops the later ones).
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix="posteriorzoo-write")
        self._pending: Future | None = None

    def submit(self, write: Callable[..., Any], *args: Any) -> None:
        """Queue ``write(*args)`` after the previous write, which must have succeeded."""
        self.wait()
        self._pending = self._executor.submit(write, *args)

    def wait(self) -> None:
        """Wait for the queued write; raise its exception."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        try:
            if kind is None:
                self.wait()
            elif self._pending is not None:
                self._pending.cancel()
                self._pending.exception()  # let a running write finish before the cleanup
        finally:
            self._executor.shutdown(wait=True)
