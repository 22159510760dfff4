"""The fast engine: OptuNet-shaped networks trained by numba kernels, exactly as by torch.

Same initial weights (:func:`train_zoo.torch_engine.initial_model`), same batches in the
same order with the same augmentation (:func:`posteriorzoo.data.iterate_batches` with the
recipe's transform, replayed by :class:`~train_zoo.fast.batches.FastTransform`), the same
loss and gradients (numba, :mod:`train_zoo.fast.kernels`), the same SGD update and
learning-rate schedule; the loop, its callbacks and its stop at a non-finite loss are
:func:`train_zoo.loop.fit` itself, and evaluation and packaging are
:func:`train_zoo.torch_engine.finish`. Only float32 rounding differs.

What the engine covers: the SGD training of base networks and of SWAG's continuation
(:class:`FastNet`), the gradient of the mean cross-entropy for SGHMC
(:func:`train_zoo.fast.gradients.fast_loss_and_grad`) and BBB's steps through dL/dw
(:class:`train_zoo.fast.bbb.FastBBB`). Not covered: dropout during training
(MC Dropout's base networks), BatchNorm, and the Laplace curvature (torch.func).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from posteriorzoo.data import ArrayDataset
from posteriorzoo.models import input_shape
from train_zoo.data import TrainingData, eval_transform, train_transform
from train_zoo.fast.batches import FastTransform, fast_batches, normalize_table
from train_zoo.fast.kernels import evaluate_batch, prepare_batch, train_step
from train_zoo.fast.layout import (
    ARCHITECTURES,
    NetLayout,
    UnsupportedModelError,
    describe_model,
)
from train_zoo.loop import fit
from train_zoo.recipes import Recipe
from train_zoo.result import CheckpointResult
from train_zoo.seeds import checkpoint_seeds
from train_zoo.spec import ZooSpec
from train_zoo.torch_engine import evaluate as torch_evaluate
from train_zoo.torch_engine import finish, initial_model
from train_zoo.torch_engine import train_base as torch_train_base

__all__ = ["FastNet", "batches_for", "evaluate", "layout_for", "supports", "train_fast",
           "unsupported_reason"]

#: Recipe fields whose meaning this engine implements. A field added to Recipe later is
#: unknown here, so such recipes fall back to the torch engine until it is implemented.
KNOWN_RECIPE_FIELDS = frozenset({
    "architecture", "dataset", "epochs", "batch_size", "lr", "weight_decay", "momentum",
    "nesterov", "schedule", "milestones", "gamma", "crop_padding", "horizontal_flip",
    "model_options"})

FastBatch = tuple[np.ndarray, np.ndarray]
#: Images per forward pass when a trained network is evaluated (as the torch engine's).
EVALUATION_BATCH = 1000


class FastNet:
    """One network's flat weights, gradient and SGD state, trained by the numba kernels.

    Parameters
    ----------
    layout : NetLayout
    state : mapping of str to tensor or array
        Initial weights in state_dict layout (copied).
    recipe : Recipe
        Supplies weight_decay, momentum and nesterov (the learning rate is per step).

    Attributes
    ----------
    theta, grad, momentum_buffer : float32 arrays ``(P,)``
        Weights in state_dict order, the last step's gradient (without weight decay) and
        SGD's momentum buffer (used when ``recipe.momentum > 0``).
    steps : int
        Updates taken (the momentum buffer is initialised on the first).
    stopped : bool
        The last step's loss was not finite (:func:`train_zoo.loop.fit` stops there).
    """

    def __init__(self, layout: NetLayout, state: Mapping[str, torch.Tensor | np.ndarray],
                 recipe: Recipe) -> None:
        self.layout = layout
        self.theta = layout.flatten(state)
        self.grad = np.zeros_like(self.theta)
        self.momentum_buffer = np.zeros_like(self.theta)
        self.dims = layout.dims()
        self.weight_decay = float(recipe.weight_decay)
        self.momentum = float(recipe.momentum)
        self.nesterov = bool(recipe.nesterov)
        self.steps = 0
        self.stopped = False
        self._views = layout.views(self.theta)
        self._logits: dict[int, np.ndarray] = {}

    def step(self, batch: FastBatch, lr: float) -> float:
        """One SGD step on a batch ``(x, labels)``: ``x`` float32 ``(C, H, W, B)``,
        ``labels`` int64 ``(B,)``; returns the batch's mean cross-entropy before the
        update."""
        x, labels = batch
        x = np.ascontiguousarray(x, dtype=np.float32)
        labels = np.ascontiguousarray(labels, dtype=np.int64)
        count = x.shape[3]
        logits = self._logits.get(count)
        if logits is None:
            logits = self._logits[count] = np.empty((self.layout.num_classes, count),
                                                    dtype=np.float32)
        loss = train_step(x, labels, self.theta, self.dims, self.grad, logits,
                          self.momentum_buffer, lr, self.weight_decay, self.momentum,
                          self.nesterov, self.steps > 0)
        self.steps += 1
        self.stopped = not math.isfinite(loss)
        return loss

    def arrays(self) -> dict[str, np.ndarray]:
        """The live weights as numpy views in state_dict layout (no copy)."""
        return self._views

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the weights as tensors (``model.load_state_dict`` accepts it)."""
        return {key: torch.from_numpy(value.copy()) for key, value in self._views.items()}


def unsupported_reason(spec: ZooSpec) -> str | None:
    """Why the fast engine cannot reproduce the torch engine on ``spec``, or None if it can."""
    if spec.architecture not in ARCHITECTURES:
        return f"architecture {spec.architecture!r} is not one of {ARCHITECTURES}"
    unknown = {f.name for f in dataclasses.fields(spec.recipe)} - KNOWN_RECIPE_FIELDS
    if unknown:
        return f"recipe fields {sorted(unknown)} are not implemented"
    try:
        shape = input_shape(spec.architecture, **spec.model_options)
        if len(shape) != 3:
            return f"inputs of shape {shape} are not images (C, H, W)"
        describe_model(initial_model(spec, 0), (shape[0], shape[1], shape[2]))
    except UnsupportedModelError as error:
        return str(error)
    except Exception as error:  # a spec the registry refuses: the torch engine reports it
        return f"the model cannot be built: {error}"
    return None


def supports(spec: ZooSpec) -> bool:
    """Whether the fast engine trains ``spec`` exactly as the torch engine would.

    True for ``optunet`` and ``optunet-v1`` without dropout, with any recipe (SGD with
    weight decay, momentum, Nesterov; any schedule; random crop, horizontal flip).
    """
    return unsupported_reason(spec) is None


def layout_for(model: nn.Module, data: TrainingData) -> NetLayout | None:
    """``model``'s layout for ``data``'s images, or None if the kernels cannot take them
    (labels outside the head included: torch raises its own error for those)."""
    try:
        layout = describe_model(model, data.train.image_shape)
    except UnsupportedModelError:
        return None
    labels = data.train.labels
    if len(labels) and (labels.min() < 0 or labels.max() >= layout.num_classes):
        return None
    return layout


def evaluate(model: nn.Module, dataset: ArrayDataset, batch_size: int = EVALUATION_BATCH
             ) -> tuple[float, float]:
    """:func:`train_zoo.torch_engine.evaluate` by the kernels: the mean cross-entropy
    (nats) and the accuracy of ``model`` in eval mode on ``dataset``'s normalised images.

    The same numbers up to float32 rounding (the forward pass of the training kernels,
    :func:`~train_zoo.fast.kernels.evaluate_batch`), in a fraction of the time: the
    trainer evaluates every checkpoint on both splits (70,000 images for Fashion-MNIST),
    which took longer than training it with the kernels. Networks the kernels do not
    take (see :func:`layout_for`) and a loss that is not finite go to the torch engine's
    evaluation, so its results and errors stay the reference there.
    """
    layout = _evaluation_layout(model, dataset)
    if layout is None or len(dataset) == 0:
        return torch_evaluate(model, dataset, batch_size)
    theta = layout.flatten(model.state_dict())
    dims = layout.dims()
    channels, height, width = dataset.image_shape
    table = normalize_table(eval_transform(dataset), channels)
    logits = np.empty((layout.num_classes, batch_size), dtype=np.float32)
    total, correct = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        images = np.ascontiguousarray(dataset.images[start:start + batch_size])
        count = len(images)
        x = np.empty((channels, height, width, count), dtype=np.float32)
        still = np.zeros(count, dtype=np.int64)
        prepare_batch(images, still, still, np.zeros(count, dtype=np.bool_), 0, table, x)
        labels = np.ascontiguousarray(dataset.labels[start:start + count], dtype=np.int64)
        loss, right = evaluate_batch(x, labels, theta, dims, logits[:, :count])
        total += loss
        correct += right
    if not math.isfinite(total):   # an overflow or NaN weights: as torch says
        return torch_evaluate(model, dataset, batch_size)
    return total / len(dataset), correct / len(dataset)


def _evaluation_layout(model: nn.Module, dataset: ArrayDataset) -> NetLayout | None:
    """``model``'s layout when the evaluation kernel takes it and ``dataset`` (its uint8
    images, its labels), else None."""
    try:
        layout = describe_model(model, dataset.image_shape)
    except UnsupportedModelError:
        return None
    labels = dataset.labels
    if len(labels) and (labels.min() < 0 or labels.max() >= layout.num_classes):
        return None
    return layout


def batches_for(data: TrainingData, recipe: Recipe, seed: int, *, augment: bool = True,
                replacement: bool = False) -> Callable[[int], Iterable[FastBatch]]:
    """:func:`train_zoo.torch_engine.torch_batches` in the kernels' layout."""
    transform = (train_transform(recipe, data.train) if augment
                 else eval_transform(data.train))
    fast_transform = FastTransform(transform, data.train.image_shape)

    def batches(epoch: int) -> Iterable[FastBatch]:
        return fast_batches(data.train, recipe.batch_size, seed, epoch, fast_transform,
                            replacement=replacement)

    return batches


def train_base(spec: ZooSpec, index: int, data: TrainingData, callbacks: Sequence[object] = ()
               ) -> tuple[nn.Module, int, str]:
    """Train mode ``index``'s base network with the kernels (with torch where the data do
    not fit them); returns the model, the steps taken and the engine that trained it."""
    seeds = checkpoint_seeds(spec.base_seed, index)
    model = initial_model(spec, seeds.init)
    layout = layout_for(model, data)
    if layout is None:
        model, steps = torch_train_base(spec, index, data, callbacks)
        return model, steps, "torch"
    net = FastNet(layout, model.state_dict(), spec.recipe)
    result = fit(net, batches_for(data, spec.recipe, seeds.data), spec.recipe.learning_rate,
                 spec.recipe.epochs, index=index, callbacks=callbacks)
    model.load_state_dict(net.state_dict())
    return model, result.steps, "fast"


def train_fast(spec: ZooSpec, index: int, data: TrainingData,
               callbacks: Sequence[object] = ()) -> CheckpointResult:
    """Train checkpoint ``index`` of a Deep-Ensemble spec with the numba kernels.

    Reproduces :func:`train_zoo.torch_engine.train_torch` (same seeds, batches, updates,
    callbacks, stopping and evaluation) up to float32 rounding; data the kernels do not
    take (another image size, labels outside the head) go to ``train_torch`` instead.
    The result's ``engine`` is ``"fast"``.
    """
    started = time.perf_counter()
    model, steps, engine = train_base(spec, index, data, callbacks)
    return finish(spec, index, model, checkpoint_seeds(spec.base_seed, index), steps,
                  started, engine, data, measure=evaluate)
