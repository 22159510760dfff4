"""``mmd`` as tiles of the distance matrices, in this process or on Ray workers.

:func:`compare_tiles` gives what :func:`~posteriorzoo.collection.compare` gives for the
symmetry setting the inputs hold (stored weights: MMD; canonical copies from
``posteriorzoo canonicalize``: NS-MMD), but computes the distances as tiles
(:mod:`posteriorzoo.mmd.tiles`) kept in a folder: a killed run resumes where it stopped,
and the tiles can be computed by Ray tasks on a cluster.

A Ray task receives the plan and a tile's two row ranges, never arrays: it opens the
collection files itself (:class:`ZooRows`), checks that they still hold the rows that
were planned (their recorded digests), computes the tile and writes it into the tiles
folder. On a cluster, the collection files and the tiles folder must therefore be at the
same paths on every node (a shared file system), with posteriorzoo installed there.
"""

# ruff: noqa: N803 -- MMDAgg's names B1, B2, B3

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from posteriorzoo._api import public
from posteriorzoo.collection.comparison import (
    ZooSource,
    _canonical_state,
    _check_layouts,
    _named,
    parameter_keys,
)
from posteriorzoo.collection.comparison_result import CompareResult
from posteriorzoo.errors import ChecksumError, InvalidOptionError
from posteriorzoo.mmd.comparison import (
    Comparison,
    check_symmetry_setting,
    describe_options,
    mmdagg_options,
    score_layer,
)
from posteriorzoo.mmd.distances import DEFAULT_PRECISION, check_precision
from posteriorzoo.mmd.sources import (
    DEFAULT_BLOCK_BYTES,
    Layer,
    block_plan,
    check_sources,
    features_per_block,
    group_layers,
    select_layers,
)
from posteriorzoo.mmd.statistics import (
    check_number_bandwidths,
    kernel_names,
)
from posteriorzoo.mmd.tiles import DEFAULT_BLOCK_ROWS, TilePlan, TileStore, plan_tiles, run_serial
from posteriorzoo.options import check_choice, check_num_gpus
from posteriorzoo.provenance import record
from posteriorzoo.vocabulary import BACKENDS
from posteriorzoo.zoo import open_zoo

__all__ = ["TILE_BACKENDS", "ZooRows", "compare_tiles"]

#: Tiles run in this process or as Ray tasks: the vocabulary's backends less the trainer's
#: local process pool.
TILE_BACKENDS = tuple(b for b in BACKENDS if b != "local")


def _digest_of(digests: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


class ZooRows:
    """Reads row ranges of collection files by path, in each process that uses it.

    Pickled, it is only the paths and the digests planned (a Ray task opens the files
    itself); a file whose recorded digests are no longer those planned is refused
    (:class:`~posteriorzoo.errors.ChecksumError`).
    """

    def __init__(self, paths: Sequence[str | os.PathLike], digests: Sequence[str]) -> None:
        self.paths = [str(path) for path in paths]
        self.digests = list(digests)  # per file: SHA-256 of its rows' digests
        self._open: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "digests": self.digests}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["paths"], state["digests"])

    def _zoo(self, source: int):
        if source not in self._open:
            zoo = open_zoo(self.paths[source])
            if _digest_of(zoo.digests) != self.digests[source]:
                zoo.close()
                raise ChecksumError(f"{self.paths[source]} no longer holds the checkpoints "
                                    "the tiles were planned for")
            self._open[source] = (zoo, {})
        return self._open[source]

    def __call__(self, source: int, layer: Layer, start: int, stop: int,
                 features: int) -> Iterator[np.ndarray]:
        """The column blocks (rows, b) of rows [start, stop) of file ``source`` on
        ``layer``, cut as :func:`~posteriorzoo.mmd.sources.layer_blocks` cuts them."""
        zoo, direct = self._zoo(source)
        for key in layer.keys:
            if key not in direct:  # the chunk cache off: only the block's bytes are read
                dataset = zoo.dataset_handle(key)
                access = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
                access.set_chunk_cache(0, 0, 1.0)
                direct[key] = h5py.Dataset(h5py.h5d.open(dataset.file.id,
                                                         dataset.name.encode(), access))
            for index in block_plan(zoo.shapes[key], features):
                block = np.asarray(direct[key][(slice(start, stop), *index)])
                block = block.reshape(stop - start, -1)
                if not np.issubdtype(block.dtype, np.floating):
                    block = block.astype(np.float64)
                yield block

    def close(self) -> None:
        for zoo, direct in self._open.values():
            direct.clear()
            zoo.close()
        self._open.clear()


def _tile_task(folder: str, plan: TilePlan, tile: tuple[int, int], rows: ZooRows,
               features: int, threads: int) -> tuple[int, int]:
    """Body of one Ray task: compute a tile from the files and keep it in the folder."""
    import numba
    import ray

    from posteriorzoo.mmd.tiles import compute_tile

    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    if plan.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise InvalidOptionError(
                f"this Ray task was given a GPU (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) but torch "
                f"{torch.__version__} on node {os.uname().nodename} sees no CUDA device")
    try:
        TileStore(folder, plan).write(tile, compute_tile(plan, tile, rows, features),
                                      node=ray.get_runtime_context().get_node_id())
    finally:
        rows.close()
    return tile


def _import_ray():
    try:
        return importlib.import_module("ray")
    except ImportError as error:
        raise InvalidOptionError(
            "tiles on Ray need Ray: pip install posteriorzoo[ray] (or pip install "
            f"'ray>=2.9'); import failed: {error}") from None


def run_ray(store: TileStore, rows: ZooRows, features: int, *, address: str | None = None,
            num_cpus: int | None = None, cpus_per_task: int = 1, num_gpus: float = 0.0,
            max_in_flight: int | None = None) -> Iterator[tuple[int, int]]:
    """Compute the pending tiles as Ray tasks; yield each tile as its task finishes.

    ``address``: None starts a private local instance (``num_cpus``), else connects
    (``"auto"``, ``"HOST:PORT"``, ``"ray://HOST:10001"``); a connection this process
    already has is used and left open. At most ``max_in_flight`` tasks (default: twice
    the cluster's CPUs) are submitted at once; each asks Ray for ``cpus_per_task`` CPUs
    and ``num_gpus`` GPUs.
    """
    ray = _import_ray()
    pending = store.pending()
    if not pending:
        return
    started = False
    if not ray.is_initialized():
        if address is None:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
        else:
            ray.init(address=address)
        started = True
    running: list[Any] = []
    try:
        limit = max_in_flight or max(1, 2 * int(ray.cluster_resources().get("CPU", 1)))
        task = ray.remote(num_cpus=cpus_per_task, num_gpus=num_gpus)(_tile_task)
        plan = ray.put(store.plan)
        while pending or running:
            while pending and len(running) < limit:
                running.append(task.remote(str(store.folder), plan, pending.pop(0), rows,
                                           features, cpus_per_task))
            done, running = ray.wait(running, num_returns=1)
            for ref in done:
                yield tuple(ray.get(ref))
    finally:
        for ref in running:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        if started:
            ray.shutdown()


@public
def compare_tiles(target: str | os.PathLike,
                  methods: Sequence[str | os.PathLike] | Mapping[str, str | os.PathLike], *,
                  tiles_dir: str | os.PathLike, backend: str = "serial",
                  ray_address: str | None = None, workers: int | None = None,
                  block_rows: int = DEFAULT_BLOCK_ROWS, symmetries: str | None = None,
                  layers: Sequence[str] | None = None, group: str = "tensor",
                  include_buffers: bool = False, number_bandwidths: int = 10,
                  test: bool = False, alpha: float = 0.05, B1: int = 2000, B2: int = 2000,
                  B3: int = 50, seed: int = 0, block_bytes: int = DEFAULT_BLOCK_BYTES,
                  precision: str = DEFAULT_PRECISION, device: str = "cpu",
                  num_gpus: float = 0.0, verify: bool = True, progress: bool = False,
                  command: str | None = None) -> CompareResult:
    """Compare method collections with the target through tiles of the distance matrices.

    Parameters
    ----------
    target, methods
        As :func:`~posteriorzoo.collection.compare`.
    tiles_dir : path-like
        Where the finished tiles are kept (created if missing). A rerun with the same
        inputs and options computes only the tiles not there yet; a folder holding the
        tiles of other inputs is refused.
    backend : {"serial", "ray"}
        Compute the tiles in this process, or as Ray tasks (one CPU each).
    ray_address : str, optional
        ray: the cluster to connect to (``auto``, ``HOST:PORT``, ``ray://HOST:10001``);
        default: a private local instance with ``workers`` CPUs.
    workers : int, optional
        ray without an address: CPUs of the local instance (default: all).
    block_rows : int
        Rows per block: a tile holds 2 x block_rows^2 float64 per layer.
    symmetries : {"keep", "remove"}, optional
        What the inputs hold (default: "remove" if they are canonical copies, else
        "keep"); this function does not canonicalize: run ``posteriorzoo canonicalize`` on
        each input first for NS-MMD.
    layers, group, include_buffers, number_bandwidths, test, alpha, B1, B2, B3, seed,
    block_bytes, verify, progress, command
        As :func:`~posteriorzoo.collection.compare`; ``block_bytes`` budgets one block
        of features over a tile's rows.
    precision : {"exact", "fast"}
        The distance kernels (:func:`~posteriorzoo.mmd.distances.cross_distances`):
        ``exact`` (default, as :func:`~posteriorzoo.collection.compare`) gives the
        one-machine matrices bit for bit; ``fast`` within its stated bound.
    device : str
        Where each tile is computed: ``cpu``, or ``cuda`` (fast precision; on Ray, the
        GPU each task was granted).
    num_gpus : float
        ray: GPUs per task (a fraction below 1 shares a GPU among tasks, or whole GPUs);
        needed, and only allowed, with a ``cuda`` device.
    """
    from posteriorzoo.progress import progress as progress_bar

    check_choice("backend", backend, TILE_BACKENDS)
    check_precision(precision, device)
    num_gpus = check_num_gpus(num_gpus)
    if num_gpus and (backend != "ray" or device == "cpu"):
        raise InvalidOptionError("num_gpus gives Ray tasks GPUs: it needs the ray backend "
                                 "and a cuda device")
    if backend == "ray" and device != "cpu" and not num_gpus:
        raise InvalidOptionError(f"tiles on {device} as Ray tasks need GPUs per task: "
                                 "give num_gpus (e.g. 1, or 0.5 to share one)")
    check_number_bandwidths(number_bandwidths)
    if symmetries is not None:
        check_symmetry_setting(symmetries)
    if workers is not None and (isinstance(workers, bool) or workers < 1):
        raise InvalidOptionError(f"workers must be at least 1, not {workers}")
    mmdagg = mmdagg_options(test, alpha, B1, B2, B3, seed)
    named = _named(methods)
    if not named:
        raise InvalidOptionError("no method collection to compare with the target")
    inputs = [("target", Path(target)), *named]
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        zoos = [stack.enter_context(open_zoo(path, verify=verify)) for _, path in inputs]
        notes = _check_layouts(inputs, zoos)
        canonical = _canonical_state(inputs, zoos, {})
        label = "remove" if canonical else "keep"
        if symmetries not in (None, label):
            raise InvalidOptionError(
                "tiles compare the inputs as they are: these are canonical copies (NS-MMD, "
                "symmetries remove)" if canonical else
                "tiles compare the inputs as they are: for NS-MMD (symmetries remove) run "
                "'posteriorzoo canonicalize' on every input first and give the copies")
        keys = parameter_keys(zoos[0], include_buffers)
        shapes = zoos[0].shapes
        chosen = select_layers(group_layers(keys, shapes, group), layers)
        sources = [ZooSource(name, zoo) for (name, _), zoo in zip(inputs, zoos, strict=True)]
        check_sources(sources[0], sources[1:], chosen)
        digests = [source.row_digests for source in sources]
        # Verified here, once: the tasks then check only that the recorded digests are
        # still those planned (a tile reads a few rows; verifying per task would reread
        # whole files).
        for zoo in zoos:
            zoo.verify_all()
        provenance_inputs = {"target": sources[0].provenance,
                             **{f"method {s.name}": s.provenance for s in sources[1:]}}
        for source in sources:
            source.close()
    plan = plan_tiles(digests, chosen, shapes, block_rows=block_rows,
                      precision=precision, device=device)
    store = TileStore(tiles_dir, plan)
    rows = ZooRows([path for _, path in inputs], [_digest_of(d) for d in digests])
    features = features_per_block(2 * block_rows, block_bytes)
    pending = store.pending()
    clock = time.perf_counter()
    with progress_bar(total=len(plan.tiles), initial=len(plan.tiles) - len(pending),
                      desc="mmd tiles", unit="tile", enabled=progress) as bar:
        if backend == "serial":
            done = run_serial(store, rows, features, pending)
        else:
            done = run_ray(store, rows, features, address=ray_address, num_cpus=workers,
                           num_gpus=num_gpus)
        try:
            for _ in done:
                bar.update(1)
        finally:
            rows.close()
    computed = round(time.perf_counter() - clock, 3)
    results = []
    names = [name for name, _ in inputs[1:]]
    for number, layer in enumerate(chosen):
        pooled = [store.pooled(number, k) for k in range(1, len(inputs))]
        results += score_layer(pooled, names, layer, symmetries=label,
                               number_bandwidths=number_bandwidths, test=mmdagg)
    options = describe_options(chosen, number_bandwidths, block_bytes, mmdagg,
                               symmetries=label, computed=[label], group=group,
                               include_buffers=include_buffers,
                               layer_keys={layer.name: list(layer.keys) for layer in chosen},
                               precision=precision, device=device,
                               tiles={"folder": str(tiles_dir), "backend": backend,
                                      "ray_address": ray_address, "block_rows": block_rows,
                                      "num_gpus": num_gpus,
                                      "tiles": len(plan.tiles),
                                      "computed_now": len(pending),
                                      "fingerprint": plan.fingerprint})
    comparison = Comparison(results, names, kernel_names(number_bandwidths), options)
    provenance = record(
        "posteriorzoo mmd", command=command, inputs=provenance_inputs,
        seeds={"mmdagg": seed if test else None,
               "note": "the MMD statistics themselves use no random numbers"},
        options=options, warnings=notes,
        seconds={"tiles": computed, "total": round(time.perf_counter() - started, 3)})
    return CompareResult(comparison, provenance=provenance)
