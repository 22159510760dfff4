"""Train a whole collection into a zoo file: resumable, one writer, any backend.

Rerunning the same command after a crash or SIGKILL trains exactly the checkpoints the
file does not hold yet (identified by their index, stored as ``mode_id``), so the run
ends with N distinct, complete checkpoints whatever happened before.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from posteriorzoo.errors import ZooSchemaError
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


def open_collection(spec: ZooSpec, out: str | os.PathLike, command: str | None = None) -> Zoo:
    """Open ``out`` for appending if it exists (and was made by this spec), else create it."""
    out = Path(out)
    recipe = spec.collection_recipe()
    if out.exists():
        zoo = open_zoo(out, mode="a")
        if zoo.recipe != recipe:
            differing = sorted(k for k in set(recipe) | set(zoo.recipe)
                               if recipe.get(k) != zoo.recipe.get(k))
            zoo.close()
            raise ZooSchemaError(
                f"{out} was trained from another spec (differs in {', '.join(differing)}); "
                "resume with the original spec or choose another --out")
        return zoo
    data = load_training_data(spec.dataset, spec.data_dir)
    template = initial_model(spec, 0).state_dict()
    return create_zoo(out, architecture=spec.architecture, dataset=spec.dataset,
                      method=spec.method, num_classes=spec.num_classes or data.train.num_classes,
                      model_options=spec.model_options, template=template, recipe=recipe,
                      command=command)


def train_collection(spec: ZooSpec, out: str | os.PathLike, *, backend: object | None = None,
                     engine: str = "auto", progress: bool = True, command: str | None = None
                     ) -> TrainSummary:
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
    """
    from tqdm.auto import tqdm

    resolve_engine(spec, engine)  # refuse before creating anything
    backend = backend or LocalBackend()
    started = time.perf_counter()
    with open_collection(spec, out, command) as zoo:
        missing = missing_indices(spec, zoo)
        trained = diverged = steps = 0
        source = f"train_zoo spec {spec.name}"
        with tqdm(total=spec.checkpoints, initial=spec.checkpoints - len(missing), unit="ckpt",
                  desc=f"train {Path(out).name}", disable=not progress) as bar:
            for result in backend.run(spec, missing, engine):
                zoo.append(result.state, **result.metadata(spec.recipe.epochs, spec.recipe_hash,
                                                           source))
                trained += 1
                diverged += result.diverged
                steps += result.steps
                elapsed = time.perf_counter() - started
                bar.set_postfix(steps_per_s=f"{steps / elapsed:.0f}", diverged=diverged)
                bar.update(1)
        total = len(completed_indices(zoo))
    return TrainSummary(Path(out), total, trained, diverged, steps,
                        time.perf_counter() - started)
