"""Backends on this machine: in-process, or a pool of worker processes."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

import torch

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.models.plugins import WorkerPlugins, worker_plugins
from train_zoo.backends.tasks import groups
from train_zoo.data import load_training_data
from train_zoo.device import resolve_device
from train_zoo.job import resolve_engine, train_checkpoints
from train_zoo.result import CheckpointResult
from train_zoo.spec import ZooSpec


class SerialBackend:
    """Train in this process, one group after another (callbacks are supported here)."""

    def __init__(self, group_size: int = 1, callbacks: Sequence[object] = (),
                 device: str = "cpu") -> None:
        self.group_size = group_size
        self.callbacks = tuple(callbacks)
        self.device = resolve_device(device)   # refused here: cuda without a GPU

    def run(self, spec: ZooSpec, indices: Sequence[int], engine: str = "auto",
            progress: str | os.PathLike | None = None) -> Iterator[CheckpointResult]:
        resolve_engine(spec, engine, self.device)
        data = load_training_data(spec.dataset, spec.data_dir)
        for group in groups(indices, self.group_size):
            yield from train_checkpoints(spec, group, data, engine, self.callbacks,
                                         self.device, progress)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_WATCH_INTERVAL = 1.0  # seconds between two checks of the parent


def _exit_with_parent(parent: int) -> None:
    """End this worker process as soon as ``parent`` (the process that started it) dies.

    A parent killed by SIGKILL cannot stop its pool, and idle workers would wait for work
    forever (each holds both ends of the task queue, so they never see it close). On
    Linux the kernel sends SIGKILL when the parent dies (``PR_SET_PDEATHSIG``); since
    that follows the *thread* that forked, a daemon thread also checks once a second
    that the parent is still ours (a dead parent's children are re-parented) and ends
    the process if not. Elsewhere only the watchdog thread runs.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(_WATCH_INTERVAL)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="posteriorzoo-parent-watchdog", daemon=True).start()


def _start_worker(threads: int, parent: int | None = None) -> None:
    if parent is not None:
        _exit_with_parent(parent)
    torch.set_num_threads(threads)


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    """Stop a pool at once: drop queued tasks and end the workers mid-task."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        with contextlib.suppress(Exception):
            process.terminate()
    for process in processes:
        with contextlib.suppress(Exception):
            process.join(timeout=5)


def _train_group(spec: ZooSpec, group: list[int], engine: str,
                 plugins: WorkerPlugins | None = None, device: str = "cpu",
                 progress: str | os.PathLike | None = None) -> list[CheckpointResult]:
    if plugins is not None:  # a fresh interpreter knows only the built-in models
        plugins.load()
    return train_checkpoints(spec, group, engine=engine, device=device, progress=progress)


class LocalBackend:
    """A pool of ``workers`` processes (default: one per core), ``threads`` torch threads each.

    One single-threaded process per core is the default because it is faster for small
    networks than one process using every core (benchmarks/bench_training.py measures
    both). Processes are started with ``spawn`` (fresh interpreters: forking a process
    that already runs torch threads is unsafe). At most ``2 * workers`` groups are in
    flight, so results stream back while the rest wait. Results are yielded in the order
    of ``indices`` (mode order): a group that finishes before an earlier one waits, and
    counts among those in flight, so no more are started while it does.

    Workers load the plugin modules of the models of your own that this process loaded
    (:func:`posteriorzoo.models.plugins.worker_plugins`). Workers end with the process
    that started them, even when it is killed by SIGKILL
    (see :func:`_exit_with_parent`); when the consumer stops early or a task fails, the
    remaining tasks are dropped and the workers stopped at once.
    """

    def __init__(self, workers: int | None = None, threads: int = 1, group_size: int = 1,
                 device: str = "cpu") -> None:
        self.workers = workers or os.cpu_count() or 1
        if self.workers < 1 or threads < 1:
            raise InvalidOptionError("workers and threads must be at least 1")
        self.threads = threads
        self.group_size = group_size
        self.device = resolve_device(device)   # each worker trains there

    def run(self, spec: ZooSpec, indices: Sequence[int], engine: str = "auto",
            progress: str | os.PathLike | None = None) -> Iterator[CheckpointResult]:
        resolve_engine(spec, engine, self.device)  # fail here, not in a worker
        # The models of your own this process knows, for the workers to load too.
        plugins = worker_plugins(spec.architecture)
        pending_groups = groups(indices, self.group_size)
        if not pending_groups:
            return
        context = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_start_worker,
                                   initargs=(self.threads, os.getpid()))
        finished = False
        try:
            # Groups in submission (mode) order, running or done but not yet yielded: at
            # most 2 * workers, so results that finish early wait in bounded memory.
            window: collections.deque[Future] = collections.deque()
            while pending_groups or window:
                while pending_groups and len(window) < 2 * self.workers:
                    window.append(pool.submit(_train_group, spec, pending_groups.pop(0), engine,
                                              plugins, self.device.name,
                                              *(() if progress is None else (progress,))))
                running = [future for future in window if not future.done()]
                if running:
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()  # a failed task stops the run now, not in its turn
                while window and window[0].done():
                    yield from window.popleft().result()
            finished = True
        finally:
            if finished:
                pool.shutdown(wait=True)
            else:  # a task failed, or the consumer stopped: no point finishing the rest
                _stop_pool(pool)
