"""Backends on this machine: in-process, or a pool of worker processes."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

import torch

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from train_zoo.data import load_training_data
from train_zoo.job import resolve_engine, train_checkpoints
from train_zoo.result import CheckpointResult
from train_zoo.spec import ZooSpec

BACKENDS = ("local", "serial", "ray")


def groups(indices: Sequence[int], size: int) -> list[list[int]]:
    """``indices`` cut into consecutive groups of at most ``size`` (one task each)."""
    if size < 1:
        raise InvalidOptionError("group size must be at least 1")
    indices = list(indices)
    return [indices[start:start + size] for start in range(0, len(indices), size)]


class SerialBackend:
    """Train in this process, one group after another (callbacks are supported here)."""

    def __init__(self, group_size: int = 1, callbacks: Sequence[object] = ()) -> None:
        self.group_size = group_size
        self.callbacks = tuple(callbacks)

    def run(self, spec: ZooSpec, indices: Sequence[int], engine: str = "auto"
            ) -> Iterator[CheckpointResult]:
        resolve_engine(spec, engine)
        data = load_training_data(spec.dataset, spec.data_dir)
        for group in groups(indices, self.group_size):
            yield from train_checkpoints(spec, group, data, engine, self.callbacks)


def _start_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def _train_group(spec: ZooSpec, group: list[int], engine: str) -> list[CheckpointResult]:
    return train_checkpoints(spec, group, engine=engine)


class LocalBackend:
    """A pool of ``workers`` processes (default: one per core), ``threads`` torch threads each.

    One single-threaded process per core is the default because it is faster for small
    networks than one process using every core (benchmarks/bench_training.py measures
    both). Processes are started with ``spawn`` (fresh interpreters: forking a process
    that already runs torch threads is unsafe). At most ``2 * workers`` groups are in
    flight, so results stream back while the rest wait.
    """

    def __init__(self, workers: int | None = None, threads: int = 1, group_size: int = 1
                 ) -> None:
        self.workers = workers or os.cpu_count() or 1
        if self.workers < 1 or threads < 1:
            raise InvalidOptionError("workers and threads must be at least 1")
        self.threads = threads
        self.group_size = group_size

    def run(self, spec: ZooSpec, indices: Sequence[int], engine: str = "auto"
            ) -> Iterator[CheckpointResult]:
        resolve_engine(spec, engine)  # fail here, not in a worker
        pending_groups = groups(indices, self.group_size)
        if not pending_groups:
            return
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(self.workers, mp_context=context, initializer=_start_worker,
                                 initargs=(self.threads,)) as pool:
            running: set[Future] = set()
            try:
                while pending_groups or running:
                    while pending_groups and len(running) < 2 * self.workers:
                        running.add(pool.submit(_train_group, spec, pending_groups.pop(0),
                                                engine))
                    done, running = wait(running, return_when=FIRST_COMPLETED)
                    for future in done:
                        yield from future.result()
            finally:
                for future in running:
                    future.cancel()


def make_backend(name: str, workers: int | None = None, group_size: int = 1,
                 address: str | None = None, callbacks: Sequence[object] = ()) -> object:
    """A backend by name: ``local``, ``serial`` or ``ray``."""
    if name not in BACKENDS:
        raise UnknownNameError(f"unknown backend {name!r}; backends: {', '.join(BACKENDS)}")
    if callbacks and name != "serial":
        raise InvalidOptionError("callbacks run only with the serial backend")
    if name == "serial":
        return SerialBackend(group_size, callbacks)
    if name == "local":
        return LocalBackend(workers, group_size=group_size)
    from train_zoo.backends.ray_backend import RayBackend

    return RayBackend(address=address, num_cpus=workers, group_size=group_size)
