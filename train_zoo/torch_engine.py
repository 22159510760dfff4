"""The generic engine: any registered model, trained with torch autograd and SGD.

Every other engine must reproduce what this one does (same batches, same learning-rate
schedule, same update rule); the tests compare them against it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import grad_and_value

from posteriorzoo.data import ArrayDataset, iterate_batches
from posteriorzoo.models import build
from train_zoo.data import TrainingData, eval_transform, train_transform
from train_zoo.device import CPU, TrainingDevice
from train_zoo.loop import fit
from train_zoo.methods import sghmc_update
from train_zoo.methods.common import Params
from train_zoo.methods.sghmc_steppers import LogPosteriorGradient
from train_zoo.recipes import Recipe
from train_zoo.result import CheckpointResult, is_diverged
from train_zoo.seeds import CheckpointSeeds, checkpoint_seeds
from train_zoo.spec import ZooSpec

Batch = tuple[torch.Tensor, torch.Tensor]


def initial_model(spec: ZooSpec, init_seed: int, *, training: bool = True) -> nn.Module:
    """The untrained network of a mode: a pure function of ``init_seed``.

    ``training`` builds it with the options it is trained with (MC Dropout's dropout
    layer); ``False`` with the options the collection stores (the base architecture).
    """
    options = spec.training_model_options if training else spec.model_options
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        return build(spec.architecture, num_classes=spec.num_classes, **options)


@torch.no_grad()
def evaluate(model: nn.Module, dataset, batch_size: int = 1000,
             device: TrainingDevice = CPU) -> tuple[float, float]:
    """Mean cross-entropy (nats) and accuracy of ``model`` in eval mode on ``dataset``
    (on ``device``, where the model is; the loss summed in float32 there, then in
    float64 over batches)."""
    model.eval()
    loss, correct = 0.0, 0
    for images, labels in iterate_batches(dataset, batch_size, seed=0, epoch=0,
                                          transform=eval_transform(dataset), shuffle=False,
                                          resident=resident(dataset, device)):
        with device.compute():
            logits = model(device.inputs(images)).float()
        loss += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        correct += int((logits.argmax(1) == labels).sum())
    return loss / len(dataset), correct / len(dataset)


def resident(dataset, device: TrainingDevice) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The dataset's images and labels copied to a non-CPU device once, for
    :func:`~posteriorzoo.data.iterate_batches` to gather and augment batches there (None
    on CPU: batches are gathered from the arrays)."""
    if device.device.type == "cpu":
        return None
    return (torch.from_numpy(dataset.images).to(device.device),
            torch.from_numpy(dataset.labels).to(device.device))


def torch_batches(data: TrainingData, recipe: Recipe, seed: int, *, augment: bool = True,
                  replacement: bool = False, device: TrainingDevice = CPU
                  ) -> Callable[[int], Iterable[Batch]]:
    """``batches(epoch)`` for :func:`train_zoo.loop.fit`: the recipe's batches of the
    training split in the order ``seed`` gives, augmented as the recipe says (or only
    normalised with ``augment=False``); with ``replacement``, each epoch's examples drawn
    independently (:func:`posteriorzoo.data.iterate_batches`); on a GPU ``device`` the
    training split is copied there once and batched and augmented there."""
    transform = (train_transform(recipe, data.train) if augment
                 else eval_transform(data.train))
    on_device = resident(data.train, device)

    def batches(epoch: int) -> Iterable[Batch]:
        return iterate_batches(data.train, recipe.batch_size, seed=seed, epoch=epoch,
                               transform=transform, replacement=replacement,
                               resident=on_device)

    return batches


class TorchSGD:
    """A model trained by ``torch.optim.SGD`` on the recipe: the torch engine's stepper.

    Dropout draws come from a private torch random state seeded with ``noise_seed``
    (swapped in for each step), so they form one stream per network whatever else runs
    in the process (on CPU; a GPU's dropout draws from its own generator). ``device``:
    where ``model`` is and how it computes (:mod:`train_zoo.device`).
    """

    def __init__(self, model: nn.Module, recipe: Recipe, noise_seed: int,
                 device: TrainingDevice = CPU) -> None:
        self.model = model
        self.device = device
        self.optimizer = torch.optim.SGD(model.parameters(), lr=recipe.lr,
                                         momentum=recipe.momentum, nesterov=recipe.nesterov,
                                         weight_decay=recipe.weight_decay)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(noise_seed)
            self._rng = torch.get_rng_state()
        self.stopped = False

    def step(self, batch: Batch, lr: float) -> float:
        images, labels = batch
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng)
            self.optimizer.zero_grad(set_to_none=True)
            with self.device.compute():
                logits = self.model(self.device.inputs(images))
            loss = nn.functional.cross_entropy(logits.float(), labels)
            loss.backward()
            self.optimizer.step()
            self._rng = torch.get_rng_state()
        value = loss.item()
        self.stopped = not np.isfinite(value)
        return value

    def arrays(self) -> Mapping[str, np.ndarray]:
        return {key: value.detach().cpu().numpy()
                for key, value in self.model.state_dict().items()}


def train_base(spec: ZooSpec, index: int, data: TrainingData, callbacks: Sequence[object] = (),
               device: TrainingDevice = CPU) -> tuple[nn.Module, int]:
    """Train mode ``index``'s base network with torch (on ``device``); returns it, back
    on CPU in the standard layout, and the steps taken."""
    seeds = checkpoint_seeds(spec.base_seed, index)
    model = device.place(initial_model(spec, seeds.init))
    stepper = TorchSGD(model, spec.recipe, seeds.noise, device)
    result = fit(stepper, torch_batches(data, spec.recipe, seeds.data, device=device),
                 spec.recipe.learning_rate, spec.recipe.epochs, index=index,
                 callbacks=callbacks)
    # Module.to accepts memory_format (as Tensor.to); torch's stubs omit it.
    return model.to("cpu", memory_format=torch.contiguous_format), result.steps  # type: ignore[call-overload]


def train_torch(spec: ZooSpec, index: int, data: TrainingData,
                callbacks: Sequence[object] = ()) -> CheckpointResult:
    """Train checkpoint ``index`` of a Deep-Ensemble spec with torch autograd."""
    started = time.perf_counter()
    model, steps = train_base(spec, index, data, callbacks)
    return finish(spec, index, model, checkpoint_seeds(spec.base_seed, index), steps,
                  started, "torch", data)


def finish(spec: ZooSpec, index: int, model: nn.Module, seeds: CheckpointSeeds, steps: int,
           started: float, engine: str, data: TrainingData, sample: int = 0,
           measure: Callable[[nn.Module, ArrayDataset], tuple[float, float]] = evaluate
           ) -> CheckpointResult:
    """Evaluate the final model on both splits and package the result (``measure``: the
    evaluation, :func:`evaluate` or the fast engine's :func:`train_zoo.fast.evaluate`)."""
    train_loss, train_accuracy = measure(model, data.train)
    test_loss, test_accuracy = measure(model, data.test)
    state = {key: value.detach().cpu().clone().contiguous().numpy()
             for key, value in model.state_dict().items()}
    metrics = {"train_loss": train_loss, "train_accuracy": train_accuracy,
               "test_loss": test_loss, "test_accuracy": test_accuracy}
    return CheckpointResult(
        index=index, state=state, metrics=metrics,
        wall_time=time.perf_counter() - started,
        diverged=is_diverged(state, metrics),
        seeds=seeds, steps=steps, engine=engine, sample=sample)


def torch_log_posterior(model: nn.Module, buffers: Mapping[str, torch.Tensor], num_data: int,
                        prior_precision: float) -> LogPosteriorGradient:
    """SGHMC's gradient with torch.func (any architecture; the model in eval mode)."""
    model.eval()

    def objective(params: Params, batch: tuple) -> torch.Tensor:
        return sghmc_update.log_posterior(model, params, buffers, batch, num_data, prior_precision)

    gradient = grad_and_value(objective)

    def evaluate(params: Params, batch: tuple) -> tuple[float, Params]:
        grads, value = gradient({k: v.detach() for k, v in params.items()}, batch)
        return -float(value) / num_data, dict(grads)

    return evaluate
