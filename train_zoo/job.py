"""One unit of work: produce some modes of a spec with a chosen engine.

Engines: ``torch`` (generic autograd, any model), ``fast`` (numba, OptuNet-shaped
networks), ``vectorised`` (torch.func, many small models in lockstep; Deep Ensembles
only). ``auto`` picks ``fast`` when it supports the spec's base networks and has kernels
for the method's phases, and ``torch`` otherwise, so everything the fast paths do not
cover falls back to the generic engine. All three are engines of the one loop
:func:`train_zoo.loop.fit`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.vocabulary import ENGINES
from train_zoo import fast, vectorised
from train_zoo.data import TrainingData, check_channels, load_training_data
from train_zoo.device import CPU, TrainingDevice, resolve_device
from train_zoo.methods.registry import get_method
from train_zoo.programs import produce_mode
from train_zoo.result import CheckpointResult
from train_zoo.spec import ZooSpec


def resolve_engine(spec: ZooSpec, engine: str, device: TrainingDevice = CPU) -> str:
    """The engine that will train ``spec`` when ``engine`` is asked for (on ``device``:
    the torch engine, the only one that runs off CPU or under autocast)."""
    if engine not in ENGINES:
        raise UnknownNameError(f"unknown engine {engine!r}; engines: {', '.join(ENGINES)}")
    if not device.is_cpu_default:
        if engine not in ("auto", "torch"):
            raise InvalidOptionError(
                f"the {engine} engine trains on CPU in float32 only; on {device.name}"
                f"{' with bf16 autocast' if device.mixed else ''} choose the engine auto "
                "or torch")
        return "torch"
    if engine == "auto":
        kernels = get_method(spec.method).uses_fast_kernels
        return "fast" if kernels and fast.supports(spec) else "torch"
    if engine == "fast" and not fast.supports(spec):
        raise InvalidOptionError(
            f"the fast engine does not support {spec.architecture} with this recipe; "
            "choose the engine auto or torch")
    if engine == "vectorised" and not get_method(spec.method).vectorisable:
        raise InvalidOptionError(
            f"the vectorised engine trains Deep Ensembles only, not {spec.method}; choose "
            "the engine auto, fast or torch")
    if engine == "vectorised" and not vectorised.supports(spec):
        raise InvalidOptionError(
            f"the vectorised engine does not support {spec.architecture}; choose the torch "
            "engine")
    return engine


def train_checkpoints(spec: ZooSpec, indices: Sequence[int], data: TrainingData | None = None,
                      engine: str = "auto", callbacks: Sequence[object] = (),
                      device: str | TrainingDevice | None = None,
                      progress: str | os.PathLike | None = None) -> list[CheckpointResult]:
    """Produce modes ``indices`` of ``spec``: their checkpoints, mode by mode, each mode's
    samples in order (:func:`train_zoo.programs.produce_mode`). ``device`` (``cpu``,
    ``cuda``, ``cuda:N`` or a :class:`~train_zoo.device.TrainingDevice`): where the torch
    engine trains (the numba engines run on CPU only). ``progress``: a folder where each
    mode's method may keep its state between runs (in ``mode-<i>``), so a mode killed
    midway resumes there (None: in memory only)."""
    device = resolve_device(device)
    data = data or load_training_data(spec.dataset, spec.data_dir)
    check_channels(spec.architecture, spec.model_options, data)
    chosen = resolve_engine(spec, engine, device)
    if chosen == "vectorised":
        if callbacks:
            raise InvalidOptionError("callbacks are not supported by the vectorised engine")
        return vectorised.train_vectorised(spec, list(indices), data)
    folder = None if progress is None else Path(progress)
    return [result for index in indices
            for result in produce_mode(spec, index, data, chosen, callbacks, device, folder)]
