"""Ray backend: the same job list as Ray tasks, results streamed back to the single writer.

Ray is an optional extra (``pip install posteriorzoo[ray]``): it is imported only inside
this module's functions, when the backend is used, so ``import train_zoo`` never needs it.

Every task trains one group of checkpoint indices with
:func:`train_zoo.job.train_checkpoints` in a Ray worker process with one torch thread;
the worker loads the data set once (:func:`train_zoo.data.load_training_data` caches it
per process) and returns a list of :class:`CheckpointResult`, whose weights are numpy
arrays (no torch tensors cross the object store). The driver keeps a bounded number of
tasks in flight and yields the results in mode order as soon as a task and those before
it have finished (``ray.wait``), so the caller, the only writer of the zoo file, appends
each mode at once, in order; a task that finishes early waits with its results and
counts among those in flight.

On a cluster every node needs posteriorzoo installed (same torch build for bit-identical
weights), the data set reachable (``data_dir`` of the spec, or the default locations) and
the plugin modules of models of your own importable: each task loads the ones the driver
loaded (:func:`posteriorzoo.models.plugins.worker_plugins`).

Progress: like the local backends, :meth:`RayBackend.run` takes the collection's progress
folder (:func:`train_zoo.run.progress_folder`) and hands it to every task, so a mode whose
method keeps state between runs (an HMC chain, saved after every iteration) resumes where
a killed run left it. The folder is a path on the driver's file system: on a cluster, it
must be on storage every node mounts at the same path, or a task on another node starts
its mode over (in a folder of that node's, which the driver never removes).

GPUs: ``num_gpus`` > 0 asks Ray for that many GPUs per task (a fraction below 1 lets
several small models share one GPU; above 1, whole GPUs) and the task trains on
``cuda`` (the GPU Ray assigned it, through ``CUDA_VISIBLE_DEVICES``). A task that Ray
gave a GPU but whose torch sees none fails with one line saying so.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.models.plugins import WorkerPlugins, worker_plugins
from posteriorzoo.options import check_num_gpus
from train_zoo.backends.tasks import groups
from train_zoo.job import resolve_engine
from train_zoo.result import CheckpointResult
from train_zoo.spec import ZooSpec

__all__ = ["RayBackend", "check_num_gpus", "import_ray", "task_device"]


def import_ray() -> ModuleType:
    """The ``ray`` module, or InvalidOptionError saying how to install it."""
    try:
        return importlib.import_module("ray")
    except ImportError as error:
        raise InvalidOptionError(
            "the ray backend needs Ray: pip install posteriorzoo[ray] "
            f"(or pip install 'ray>=2.9'); import failed: {error}") from None


def task_device(num_gpus: float) -> str:
    """The torch device of a task granted ``num_gpus``: ``cpu``, or ``cuda`` (the first GPU
    Ray made visible to it) after checking that torch sees one."""
    if num_gpus <= 0:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise InvalidOptionError(
            f"this Ray task was given {num_gpus:g} GPU(s) (CUDA_VISIBLE_DEVICES={visible}) "
            f"but torch {torch.__version__} on node {os.uname().nodename} sees no CUDA "
            "device: install a CUDA build of torch there, or train with num_gpus 0")
    return "cuda"


def train_group(spec: ZooSpec, group: list[int], engine: str,
                plugins: WorkerPlugins | None = None, num_gpus: float = 0.0,
                progress: str | None = None) -> list[CheckpointResult]:
    """Body of one Ray task: train checkpoints ``group`` of ``spec`` with one torch thread,
    after loading the plugin modules of the driver's models of your own; on ``cuda``
    when Ray granted the task GPUs (:func:`task_device`). ``progress`` is the collection's
    progress folder, where each mode's method keeps its state between runs
    (:attr:`train_zoo.methods.base.ModeRun.progress`); None keeps it in memory only."""
    import torch

    from train_zoo.data import load_training_data
    from train_zoo.job import train_checkpoints

    if plugins is not None:
        plugins.load()
    device = task_device(num_gpus)  # before loading anything: a GPU-less node says so
    torch.set_num_threads(1)
    data = load_training_data(spec.dataset, spec.data_dir)  # cached per worker process
    if device == "cpu":
        return train_checkpoints(spec, group, data=data, engine=engine, progress=progress)
    return train_checkpoints(spec, group, data=data, engine=engine, device=device,
                             progress=progress)


#: The logger of Ray's token-authentication notices (Ray 2.5x).
_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextlib.contextmanager
def _quiet_token_notice() -> Iterator[None]:
    """Hide Ray's token-authentication warning while Ray starts.

    Every ``ray.init`` of a local instance warns that token authentication is enabled
    and how to opt out: Ray enables the token itself, so the notice asks nothing of the
    user and only repeats in every training log. Errors still show.
    """
    logger = logging.getLogger(_TOKEN_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class RayBackend:
    """Train checkpoints as Ray tasks and stream the results back.

    Parameters
    ----------
    address : str or None
        ``None``: start a private local Ray instance (``ray.init(address="local",
        num_cpus=num_cpus, include_dashboard=False)``), shut down when :meth:`run`
        ends. ``"auto"`` (on a cluster node) or ``"ray://HEAD:10001"`` (Ray client):
        connect to an existing cluster; at the end this driver disconnects and the
        cluster keeps running. If Ray is already initialised in this process, that
        connection is used and left open.
    num_cpus : int or None
        CPUs of the local instance (default: all); ignored when connecting to a cluster.
    group_size : int
        Checkpoint indices per task (with ``engine="vectorised"`` a group trains in
        lockstep; otherwise one after another in the same worker).
    max_in_flight : int or None
        Tasks whose results are not yet yielded: running, or finished and waiting for
        an earlier one (default: twice the cluster's CPUs).
    init_options : mapping, optional
        Extra keyword arguments of ``ray.init`` (e.g. ``runtime_env``).
    num_gpus : float
        GPUs per task (default 0: CPU only): a fraction below 1 (``0.25``: four small
        models per GPU) or a whole number; the task then trains on ``cuda``
        (:func:`check_num_gpus`, :func:`task_device`).
    """

    def __init__(self, address: str | None = None, num_cpus: int | None = None,
                 group_size: int = 1, *, max_in_flight: int | None = None,
                 init_options: Mapping[str, Any] | None = None,
                 num_gpus: float = 0.0) -> None:
        if num_cpus is not None and num_cpus < 1:
            raise InvalidOptionError("num_cpus must be at least 1")
        if group_size < 1:
            raise InvalidOptionError("group size must be at least 1")
        if max_in_flight is not None and max_in_flight < 1:
            raise InvalidOptionError("max_in_flight must be at least 1")
        self.address = address
        self.num_cpus = num_cpus
        self.group_size = group_size
        self.max_in_flight = max_in_flight
        self.init_options = dict(init_options or {})
        self.num_gpus = check_num_gpus(num_gpus)

    def run(self, spec: ZooSpec, indices: Sequence[int], engine: str = "auto",
            progress: str | os.PathLike | None = None) -> Iterator[CheckpointResult]:
        """Train checkpoints ``indices`` of ``spec``; yield each result once, as it completes.

        Results come in the order of ``indices`` (mode order). The engine is checked and Ray
        imported here, before anything starts; the Ray instance is started (or connected
        to) on the first iteration and shut down when the iterator is exhausted or closed.
        ``progress`` (the collection's progress folder, given by
        :func:`train_zoo.run.train_collection` as to the local backends) reaches every
        task, so a mode resumes its method's saved state (module docstring); on a cluster
        it must be a path every node sees.
        """
        ray = import_ray()
        resolve_engine(spec, engine)  # fail here, not in a worker
        pending = groups([int(i) for i in indices], self.group_size)
        # Absolute: a worker's working folder need not be the driver's.
        folder = None if progress is None else os.path.abspath(progress)
        return self._stream(ray, spec, pending, engine, folder)

    def _connect(self, ray: ModuleType) -> bool:
        """Initialise Ray as configured; True if this call did (so we shut it down)."""
        if ray.is_initialized():
            return False
        options = {"include_dashboard": False, **self.init_options}
        with _quiet_token_notice():
            if self.address is None:
                ray.init(address="local", num_cpus=self.num_cpus, **options)
            else:
                options.pop("include_dashboard")  # only meaningful when starting an instance
                ray.init(address=self.address, **options)
        return True

    def _stream(self, ray: ModuleType, spec: ZooSpec, pending: list[list[int]],
                engine: str, progress: str | None = None) -> Iterator[CheckpointResult]:
        if not pending:
            return
        started = self._connect(ray)
        running: list[Any] = []
        try:
            limit = self.max_in_flight or max(1, 2 * int(ray.cluster_resources().get("CPU", 1)))
            # Tasks are deterministic, so Ray's retries after a worker crash are safe.
            task = ray.remote(num_cpus=1)(train_group).options(num_gpus=self.num_gpus)
            spec_ref = ray.put(spec)
            plugins = worker_plugins(spec.architecture)
            # Tasks in submission (mode) order, running or finished but not yet yielded:
            # at most ``limit``, so results that finish early wait in bounded memory.
            finished: dict[int, list[CheckpointResult]] = {}  # id(ref) -> its results
            while pending or running:
                while pending and len(running) < limit:
                    running.append(task.remote(spec_ref, pending.pop(0), engine, plugins,
                                               self.num_gpus, progress))
                waiting = [ref for ref in running if id(ref) not in finished]
                if waiting:
                    done, _ = ray.wait(waiting, num_returns=1)
                    for ref in done:  # a failed task raises here, not in its turn
                        finished[id(ref)] = ray.get(ref)
                while running and id(running[0]) in finished:
                    yield from finished.pop(id(running.pop(0)))
        finally:
            for ref in running:  # closed early or failed: drop the rest
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            if started:
                ray.shutdown()
