"""One unit of work: train some checkpoints of a spec with a chosen engine.

Engines: ``torch`` (generic autograd, any model), ``fast`` (numba, OptuNet-shaped
networks), ``vectorised`` (torch.func, many small models in lockstep). ``auto`` picks
``fast`` when it supports the spec and ``torch`` otherwise, so everything the fast paths
do not cover falls back to the generic engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from train_zoo import fast, vectorised
from train_zoo.data import TrainingData, load_training_data
from train_zoo.result import CheckpointResult
from train_zoo.spec import ZooSpec
from train_zoo.torch_engine import train_torch

ENGINES = ("auto", "torch", "fast", "vectorised")


def resolve_engine(spec: ZooSpec, engine: str) -> str:
    """The engine that will train ``spec`` when ``engine`` is asked for."""
    if engine not in ENGINES:
        raise UnknownNameError(f"unknown engine {engine!r}; engines: {', '.join(ENGINES)}")
    if engine == "auto":
        return "fast" if fast.supports(spec) else "torch"
    if engine == "fast" and not fast.supports(spec):
        raise InvalidOptionError(
            f"the fast engine does not support {spec.architecture} with this recipe; "
            "choose the engine auto or torch")
    if engine == "vectorised" and not vectorised.supports(spec):
        raise InvalidOptionError(
            f"the vectorised engine does not support {spec.architecture}; choose the torch "
            "engine")
    return engine


def train_checkpoints(spec: ZooSpec, indices: Sequence[int], data: TrainingData | None = None,
                      engine: str = "auto", callbacks: Sequence[object] = ()
                      ) -> list[CheckpointResult]:
    """Train checkpoints ``indices`` of ``spec``; returns their results in that order."""
    data = data or load_training_data(spec.dataset, spec.data_dir)
    chosen = resolve_engine(spec, engine)
    if chosen == "vectorised":
        if callbacks:
            raise InvalidOptionError("callbacks are not supported by the vectorised engine")
        return vectorised.train_vectorised(spec, list(indices), data)
    trainer = fast.train_fast if chosen == "fast" else train_torch
    return [trainer(spec, index, data, callbacks) for index in indices]
