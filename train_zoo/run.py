"""Train a whole collection into a zoo file: resumable, one writer, any backend.

Rerunning the same command after a crash or SIGKILL trains exactly the checkpoints the
file does not hold yet (identified by their index, stored as ``mode_id``), so the run
ends with N distinct, complete checkpoints whatever happened before.

A new collection is built under a temporary, locked name next to the output and appears
at the output path right after its first checkpoint is committed; from then on it is an
ordinary resumable file. A run that fails (or is killed) before that leaves nothing at
the output path (a killed run's temporary file is reclaimed by the next one). One
process trains a collection at a time: a second one gets
:class:`~posteriorzoo.errors.ZooBusyError`, whether the first one's file is still
temporary or already published.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from posteriorzoo import outputs
from posteriorzoo.errors import (
    InvalidOptionError,
    OutputExistsError,
    PosteriorZooError,
    ZooBusyError,
    ZooSchemaError,
)
from posteriorzoo.zoo import Zoo, create_zoo, open_zoo
from train_zoo.backends import LocalBackend
from train_zoo.data import load_training_data
from train_zoo.job import resolve_engine
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

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("nan")


def completed_indices(zoo: Zoo) -> set[int]:
    """Spec indices already in the collection."""
    return {int(i) for i in np.asarray(zoo.metadata["mode_id"]) if i >= 0}


def missing_indices(spec: ZooSpec, zoo: Zoo) -> list[int]:
    """Indices 0..N-1 of ``spec`` that ``zoo`` does not hold yet, ascending."""
    done = completed_indices(zoo)
    return [index for index in range(spec.checkpoints) if index not in done]


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
    recipe = spec.collection_recipe()
    for _ in range(2):
        if out.exists() or out.is_symlink():
            return _open_existing(spec, out, recipe, verify)
        if not out.parent.is_dir():
            raise InvalidOptionError(f"{out}: the folder {out.parent} does not exist")
        if outputs.partial_in_progress(out):
            raise ZooBusyError(f"{out}: another process is training this collection")
        template = _template(spec)
        data = load_training_data(spec.dataset, spec.data_dir)
        if spec.num_classes is not None and spec.num_classes < data.train.num_classes:
            raise InvalidOptionError(
                f"spec field 'num_classes' is {spec.num_classes}, but {spec.dataset} has "
                f"{data.train.num_classes} classes")
        try:
            return create_zoo(out, architecture=spec.architecture, dataset=spec.dataset,
                              method=spec.method,
                              num_classes=spec.num_classes or data.train.num_classes,
                              model_options=spec.model_options, template=template,
                              recipe=recipe, command=command, publish=False)
        except OutputExistsError:
            continue  # published by another process meanwhile: open it (busy if it writes)
    raise ZooBusyError(f"{out}: another process is training this collection")


def _open_existing(spec: ZooSpec, out: Path, recipe: dict, verify: bool) -> Zoo:
    zoo = open_zoo(out, mode="a", verify=verify)
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
    """The untrained network's state_dict: checks that the spec's model can be built."""
    try:
        return initial_model(spec, 0).state_dict()
    except PosteriorZooError:
        raise
    except (TypeError, ValueError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise InvalidOptionError(
            f"model options {dict(spec.model_options)} do not build a {spec.architecture}: "
            f"{message}") from None


def train_collection(spec: ZooSpec, out: str | os.PathLike, *, backend: object | None = None,
                     engine: str = "auto", progress: bool = True, command: str | None = None,
                     verify: bool = True) -> TrainSummary:
    """Train the checkpoints of ``spec`` that ``out`` lacks and append each as it finishes.

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
    from tqdm.auto import tqdm

    resolve_engine(spec, engine)  # refuse before creating anything
    backend = backend or LocalBackend()
    started = time.perf_counter()
    # A new file stays temporary until its first checkpoint is committed: a failure before
    # that (missing data, an error in a worker, a kill) leaves nothing at ``out``.
    with open_collection(spec, out, command, verify) as zoo:
        missing = missing_indices(spec, zoo)
        trained = diverged = steps = 0
        source = f"train_zoo spec {spec.name}"
        with tqdm(total=spec.checkpoints, initial=spec.checkpoints - len(missing), unit="ckpt",
                  desc=f"train {Path(out).name}", disable=not progress) as bar:
            results = backend.run(spec, missing, engine)
            try:
                for result in results:
                    zoo.append(result.state, **result.metadata(spec.recipe.epochs,
                                                               spec.recipe_hash, source))
                    if not zoo.published:
                        zoo.publish()  # from now on an ordinary, resumable collection
                    trained += 1
                    diverged += result.diverged
                    steps += result.steps
                    elapsed = time.perf_counter() - started
                    bar.set_postfix(steps_per_s=f"{steps / elapsed:.0f}", diverged=diverged)
                    bar.update(1)
            finally:
                close = getattr(results, "close", None)
                if close is not None:  # stop the backend's workers now on an error
                    close()
        total = len(completed_indices(zoo))
    return TrainSummary(Path(out), total, trained, diverged, steps,
                        time.perf_counter() - started)
