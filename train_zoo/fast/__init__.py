"""Fast path for small networks on CPU: OptuNet-shaped networks trained by numba kernels.

:func:`supports` says whether a spec can be trained here exactly as the generic torch
engine would train it (``optunet`` and ``optunet-v1`` without dropout, any recipe);
:func:`train_fast` trains one checkpoint; :func:`evaluate` measures a trained network's
loss and accuracy on a split with the kernels' forward pass (the trainer's evaluation of
every checkpoint on the fast engine). Everything else falls back to the torch engine
(``train_zoo.job.resolve_engine(spec, "auto")``).

Modules: :mod:`~train_zoo.fast.layout` (layer shapes read from the model, flat weights),
:mod:`~train_zoo.fast.kernels` (numba forward, cross-entropy, backward, SGD, batch
preparation), :mod:`~train_zoo.fast.batches` (the torch engine's batches in the kernels'
layout), :mod:`~train_zoo.fast.engine` (the training loop).
"""

from __future__ import annotations

from train_zoo.fast.batches import FastTransform, fast_batches
from train_zoo.fast.engine import FastNet, evaluate, supports, train_fast, unsupported_reason
from train_zoo.fast.layout import ARCHITECTURES, NetLayout, UnsupportedModelError, describe_model

__all__ = [
    "ARCHITECTURES",
    "FastNet",
    "FastTransform",
    "NetLayout",
    "UnsupportedModelError",
    "describe_model",
    "evaluate",
    "fast_batches",
    "supports",
    "train_fast",
    "unsupported_reason",
]
