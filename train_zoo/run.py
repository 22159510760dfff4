"""Train a whole collection into a zoo file: resumable, one writer, any backend.

The unit of work is a *mode* (:func:`train_zoo.programs.produce_mode`): a base network and
the ``samples_per_mode`` samples around it, stored with ``mode_id`` (the mode) and
``sample_id`` (the draw) and appended in one commit with the mode's training record
(what its method phase recorded, :meth:`posteriorzoo.zoo.Zoo.training_records`).
Rerunning the same command after a crash or SIGKILL produces exactly the modes the file
does not hold yet, so the run ends with ``modes x samples_per_mode`` distinct, complete
checkpoints whatever happened before, bit-identical to an uninterrupted run (a mode
depends only on its seeds).

Modes are committed in ascending order whatever the number of workers or the backend,
so row i holds mode i's samples (in ``sample_id`` order): a mode that finishes before
one of its predecessors waits in memory until they are committed. The backends yield
modes in order themselves and keep a bounded number of tasks in flight, finished or
not (:mod:`train_zoo.backends`), so what waits is bounded too. A killed run keeps its
committed modes, a prefix of the missing ones; the next run produces the rest.

A new collection is built under a temporary, locked name next to the output and appears
at the output path right after its first checkpoint is committed; from then on it is an
ordinary resumable file. A run that fails (or is killed) before that leaves nothing at
the output path (a killed run's temporary file is reclaimed by the next one). One
process trains a collection at a time: a second one gets
:class:`~posteriorzoo.errors.ZooBusyError`, whether the first one's file is still
temporary or already published.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from posteriorzoo import outputs
from posteriorzoo.errors import (
    InvalidOptionError,
    OutputExistsError,
    PosteriorZooError,
    ZooBusyError,
    ZooSchemaError,
)
from posteriorzoo.vocabulary import POSTERIOR_GROUPS
from posteriorzoo.zoo import Zoo, create_zoo, open_zoo
from train_zoo.backends import LocalBackend
from train_zoo.data import check_channels, load_training_data
from train_zoo.job import resolve_engine
from train_zoo.methods.registry import get_method
from train_zoo.programs import mode_progress
from train_zoo.result import CheckpointResult, near_chance
from train_zoo.spec import ZooSpec
from train_zoo.torch_engine import initial_model


@dataclass
class TrainSummary:
    """What :func:`train_collection` did."""

    path: Path
    checkpoints: int
    trained: int
    diverged: int
    steps: int
    seconds: float
    #: Finite checkpoints trained now whose test accuracy is near chance (undertrained).
    near_chance: int = 0

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("nan")


def completed_indices(zoo: Zoo) -> set[int]:
    """Modes already in the collection (their ``mode_id``)."""
    return {int(i) for i in np.asarray(zoo.metadata["mode_id"]) if i >= 0}


def missing_indices(spec: ZooSpec, zoo: Zoo) -> list[int]:
    """Modes 0..modes-1 of ``spec`` that ``zoo`` does not hold yet, ascending."""
    done = completed_indices(zoo)
    return [index for index in range(spec.counts()[0]) if index not in done]


def _warn_if_out_of_order(zoo: Zoo, missing: list[int]) -> None:
    """Say so when the collection will not end in mode order: its rows already are not
    (written by an earlier version with several workers), or a mode it lacks comes
    before one it holds (a gap such a run left)."""
    from posteriorzoo.zoo.reorder import collection_row_order

    ordering = collection_row_order(zoo)
    done = completed_indices(zoo)
    late = [index for index in missing if done and index < max(done)]
    if ordering.in_order and not late:
        return
    problem = (ordering.describe(len(zoo)) if not ordering.in_order else
               f"mode {late[0]} will be appended after mode {max(done)}")
    warnings.warn(f"{zoo.path}: {problem}; `posteriorzoo reorder {zoo.path} --in-place` "
                  "puts the rows in mode order once the run is complete", stacklevel=3)


def _annotations(spec: ZooSpec) -> dict[str, object]:
    """What a method collection says about its modes (file attribute ``annotations``)."""
    if get_method(spec.method).one_sample_per_mode:
        return {}
    single, multi = POSTERIOR_GROUPS
    return {"posterior": multi if spec.counts()[0] > 1 else single,
            "modes": spec.modes, "samples_per_mode": spec.samples_per_mode}


def open_collection(spec: ZooSpec, out: str | os.PathLike, command: str | None = None,
                    verify: bool = True) -> Zoo:
    """Open ``out`` for appending if it exists (and was made by this spec), else create it.

    An existing collection's checkpoints are checked against their digests first (unless
    ``verify`` is False): nothing is appended to a corrupt collection.

    A new collection is created unpublished: it lives under a temporary, locked name next
    to ``out`` until :meth:`Zoo.publish` (or the end of its ``with`` block) puts it in
    place, and it is deleted if that block raises. Nothing is created when the spec's
    model cannot be built or its data cannot be loaded.

    Raises
    ------
    ZooBusyError
        Another process is writing ``out``, or creating it.
    ZooSchemaError
        ``out`` exists but was trained from another spec.
    """
    out = Path(out)
    for _ in range(2):
        if out.exists() or out.is_symlink():
            return _open_existing(spec, out, verify)
        if not out.parent.is_dir():
            raise InvalidOptionError(f"{out}: the folder {out.parent} does not exist")
        if outputs.partial_in_progress(out):
            raise ZooBusyError(f"{out}: another process is training this collection")
        template = _template(spec)
        data = load_training_data(spec.dataset, spec.data_dir)
        check_channels(spec.architecture, spec.model_options, data)
        recipe = spec.collection_recipe(len(data.train))
        if spec.num_classes is not None and spec.num_classes < data.train.num_classes:
            raise InvalidOptionError(
                f"spec field 'num_classes' is {spec.num_classes}, but {spec.dataset} has "
                f"{data.train.num_classes} classes")
        try:
            return create_zoo(out, architecture=spec.architecture, dataset=spec.dataset,
                              method=spec.method,
                              num_classes=spec.num_classes or data.train.num_classes,
                              model_options=spec.model_options, template=template,
                              recipe=recipe, annotations=_annotations(spec), command=command,
                              publish=False)
        except OutputExistsError:
            continue  # published by another process meanwhile: open it (busy if it writes)
    raise ZooBusyError(f"{out}: another process is training this collection")


def _open_existing(spec: ZooSpec, out: Path, verify: bool) -> Zoo:
    # The models are built here once, as for a new collection: a model of your own whose
    # factory fails is one line from this process, not a traceback from every worker.
    _template(spec)
    num_data = (len(load_training_data(spec.dataset, spec.data_dir).train)
                if get_method(spec.method).options_need_data else None)  # BBB's KL weight
    recipe = spec.collection_recipe(num_data)
    zoo = open_zoo(out, mode="r+", verify=verify)
    try:
        zoo.verify_all()
    except BaseException:
        zoo.close()
        raise
    zoo.verify = False  # what this run appends is checked when it is written
    if zoo.recipe != recipe:
        differing = sorted(k for k in set(recipe) | set(zoo.recipe)
                           if recipe.get(k) != zoo.recipe.get(k))
        zoo.close()
        raise ZooSchemaError(
            f"{out} was trained from another spec (differs in {', '.join(differing)}); "
            "resume with the original spec or write to another file")
    return zoo


def _template(spec: ZooSpec) -> dict:
    """The untrained base network's state_dict: checks that the spec's models (trained and
    stored) can be built."""
    try:
        initial_model(spec, 0)
        return initial_model(spec, 0, training=False).state_dict()
    except PosteriorZooError:
        raise
    except (TypeError, ValueError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise InvalidOptionError(
            f"model options {dict(spec.model_options)} do not build a {spec.architecture}: "
            f"{message}") from None


class Backend(Protocol):
    """What :func:`train_collection` asks of a backend (:mod:`train_zoo.backends`).

    A backend whose ``run`` also takes ``progress`` (a folder; the local, serial and Ray
    backends do) is given the collection's progress folder (:func:`progress_folder`), so
    a mode killed midway resumes where its method left it; other backends restart such a
    mode from its start.
    """

    def run(self, spec: ZooSpec, indices: Sequence[int], engine: str = "auto"
            ) -> Iterator[CheckpointResult]: ...


def progress_folder(out: str | os.PathLike) -> Path:
    """The hidden folder beside ``out`` where the modes being trained keep their state
    between runs (``.<out name>.progress/mode-<i>/``, :attr:`ModeRun.progress`)."""
    out = Path(out)
    return out.parent / f".{out.name}.progress"


def _takes_progress(backend: object) -> bool:
    run = getattr(backend, "run", None)
    try:
        return run is not None and "progress" in inspect.signature(run).parameters
    except (TypeError, ValueError):
        return False


def train_collection(spec: ZooSpec, out: str | os.PathLike, *, backend: Backend | None = None,
                     engine: str = "auto", progress: bool = True, command: str | None = None,
                     verify: bool = True) -> TrainSummary:
    """Produce the modes of ``spec`` that ``out`` lacks and append each as it finishes.

    Parameters
    ----------
    spec : ZooSpec
    out : path-like
        The collection file; created if missing, resumed otherwise.
    backend : object, optional
        A backend of :mod:`train_zoo.backends` (default: :class:`LocalBackend`, one process
        per core).
    engine : {"auto", "torch", "fast", "vectorised"}
    progress : bool
        Show a progress bar (checkpoints done, model-steps/s, ETA).
    command : str, optional
        Recorded as the collection's provenance.
    verify : bool
        Check an existing collection's checkpoints against their digests before
        appending to it (default True).
    """
    from posteriorzoo.progress import progress as progress_bar

    resolve_engine(spec, engine)  # refuse before creating anything
    backend = backend or LocalBackend()
    started = time.perf_counter()
    # A new file stays temporary until its first checkpoint is committed: a failure before
    # that (missing data, an error in a worker, a kill) leaves nothing at ``out``.
    with open_collection(spec, out, command, verify) as zoo:
        missing = missing_indices(spec, zoo)
        if len(zoo):
            _warn_if_out_of_order(zoo, missing)
        trained = diverged = chance = steps = 0
        num_classes = zoo.num_classes
        source = f"train_zoo spec {spec.name}"
        modes, per_mode = spec.counts()
        with progress_bar(total=spec.checkpoints,
                          initial=(modes - len(missing)) * per_mode,
                          unit="ckpt", desc=f"train {Path(out).name}",
                          enabled=progress) as bar:

            def commit(mode: list) -> None:
                """A mode's samples in one commit, with what its method phase recorded
                (the same record on every sample): a collection holds whole modes."""
                nonlocal trained, diverged, chance, steps
                record = mode[0].record
                zoo.append_many([r.state for r in mode],
                                [r.metadata(spec.recipe.epochs, spec.recipe_hash, source)
                                 for r in mode],
                                records=None if record is None else {mode[0].index: record})
                if not zoo.published:
                    zoo.publish()  # from now on an ordinary, resumable collection
                if progress_root is not None:  # the mode is in: its saved state is not needed
                    shutil.rmtree(mode_progress(progress_root, mode[0].index),
                                  ignore_errors=True)
                trained += len(mode)
                diverged += sum(r.diverged for r in mode)
                if num_classes is None:  # a collection train_zoo writes records its classes
                    raise AssertionError(f"{out}: the collection records no num_classes")
                chance += sum(near_chance(r.metrics["test_accuracy"], num_classes)
                              for r in mode)
                steps += mode[0].steps
                elapsed = time.perf_counter() - started
                bar.set_postfix(steps_per_s=f"{steps / elapsed:.0f}", diverged=diverged)
                bar.update(len(mode))

            progress_root = progress_folder(out) if _takes_progress(backend) else None
            results = (backend.run(spec, missing, engine) if progress_root is None
                       else backend.run(spec, missing, engine,  # type: ignore[call-arg]
                                        progress=progress_root))
            assembling: dict[int, list] = {}  # modes whose samples are still coming
            finished: dict[int, list] = {}  # whole modes waiting for a predecessor
            next_position = 0  # missing[next_position] is the next mode to commit
            try:
                for result in results:
                    mode = assembling.setdefault(result.index, [])
                    mode.append(result)
                    if len(mode) < per_mode:
                        continue
                    finished[result.index] = assembling.pop(result.index)
                    # Mode order: commit every finished mode whose predecessors are in.
                    while (next_position < len(missing)
                           and missing[next_position] in finished):
                        commit(finished.pop(missing[next_position]))
                        next_position += 1
                if finished:  # a backend that skipped a mode: keep what was trained
                    for index in sorted(finished):
                        commit(finished.pop(index))
                    raise RuntimeError(f"the backend never produced mode "
                                       f"{missing[next_position]}; the modes after it were "
                                       "committed out of order")
            finally:
                close = getattr(results, "close", None)
                if close is not None:  # stop the backend's workers now on an error
                    close()
        total = len(zoo)
        if progress_root is not None:  # every mode committed leaves an empty folder
            with contextlib.suppress(OSError):
                progress_root.rmdir()
    return TrainSummary(Path(out), total, trained, diverged, steps,
                        time.perf_counter() - started, chance)
