"""The generic engine: any registered model, trained with torch autograd and SGD.

Every other engine must reproduce what this one does (same batches, same learning-rate
schedule, same update rule); the tests compare them against it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from posteriorzoo.data import iterate_batches
from posteriorzoo.models import build
from train_zoo.callbacks import StepInfo, notify
from train_zoo.data import TrainingData, eval_transform, train_transform
from train_zoo.result import CheckpointResult, is_diverged
from train_zoo.seeds import CheckpointSeeds, checkpoint_seeds
from train_zoo.spec import ZooSpec


def initial_model(spec: ZooSpec, init_seed: int) -> nn.Module:
    """The untrained network of a checkpoint: a pure function of ``init_seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        return build(spec.architecture, num_classes=spec.num_classes, **spec.model_options)


@torch.no_grad()
def evaluate(model: nn.Module, dataset, batch_size: int = 1000) -> tuple[float, float]:
    """Mean cross-entropy (nats) and accuracy of ``model`` in eval mode on ``dataset``."""
    model.eval()
    loss, correct = 0.0, 0
    for images, labels in iterate_batches(dataset, batch_size, seed=0, epoch=0,
                                          transform=eval_transform(dataset), shuffle=False):
        logits = model(images)
        loss += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        correct += int((logits.argmax(1) == labels).sum())
    return loss / len(dataset), correct / len(dataset)


def _arrays(model: nn.Module) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy() for key, value in model.state_dict().items()}


def train_torch(spec: ZooSpec, index: int, data: TrainingData,
                callbacks: Sequence[object] = ()) -> CheckpointResult:
    """Train checkpoint ``index`` of ``spec`` with torch autograd."""
    started = time.perf_counter()
    seeds = checkpoint_seeds(spec.base_seed, index)
    recipe = spec.recipe
    model = initial_model(spec, seeds.init)
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=recipe.momentum,
                                nesterov=recipe.nesterov, weight_decay=recipe.weight_decay)
    augment = train_transform(recipe, data.train)
    step, loss_value, finite = 0, float("nan"), True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seeds.noise)  # dropout masks
        for epoch in range(recipe.epochs):
            lr = recipe.learning_rate(epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            model.train()
            for images, labels in iterate_batches(data.train, recipe.batch_size,
                                                  seed=seeds.data, epoch=epoch,
                                                  transform=augment):
                optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()
                step += 1
                loss_value = loss.item()
                if callbacks:
                    notify(callbacks, "on_step_end",
                           StepInfo(index, epoch, step, lr, loss_value), _arrays(model))
                if not np.isfinite(loss_value):
                    finite = False
                    break
            if callbacks:
                notify(callbacks, "on_epoch_end",
                       StepInfo(index, epoch, step, lr, loss_value), _arrays(model))
            if not finite:
                break
    return finish(spec, index, model, seeds, step, started, "torch", data)


def finish(spec: ZooSpec, index: int, model: nn.Module, seeds: CheckpointSeeds, steps: int,
           started: float, engine: str, data: TrainingData) -> CheckpointResult:
    """Evaluate the final model on both splits and package the result."""
    train_loss, train_accuracy = evaluate(model, data.train)
    test_loss, test_accuracy = evaluate(model, data.test)
    state = {key: value.detach().clone().numpy() for key, value in model.state_dict().items()}
    num_classes = spec.num_classes or data.train.num_classes
    return CheckpointResult(
        index=index, state=state,
        metrics={"train_loss": train_loss, "train_accuracy": train_accuracy,
                 "test_loss": test_loss, "test_accuracy": test_accuracy},
        wall_time=time.perf_counter() - started,
        diverged=is_diverged(state, test_accuracy, num_classes),
        seeds=seeds, steps=steps, engine=engine)
