"""One checkpoint's training loop in plain torch: SGD, weight decay, seeded data order."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posteriorzoo.data import ArrayDataset, Compose, Normalize, RandomCrop, iterate_batches
from posteriorzoo.models import build


@dataclass
class TrainResult:
    """A trained checkpoint and the numbers its metadata row records."""

    state_dict: dict[str, torch.Tensor]
    metrics: dict[str, float]
    wall_time: float
    diverged: bool


@torch.no_grad()
def evaluate(model: nn.Module, dataset: ArrayDataset, batch_size: int = 512) -> dict[str, float]:
    """Mean cross-entropy (nats) and accuracy in [0, 1] of ``model`` on ``dataset``."""
    model.eval()
    normalize = Normalize(dataset.mean, dataset.std)
    loss, correct = 0.0, 0
    for images, labels in iterate_batches(dataset, batch_size, seed=0, epoch=0,
                                          transform=normalize, shuffle=False):
        logits = model(images)
        loss += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        correct += int((logits.argmax(1) == labels).sum())
    return {"loss": loss / len(dataset), "accuracy": correct / len(dataset)}


def train_classifier(
    architecture: str,
    train: ArrayDataset,
    test: ArrayDataset,
    *,
    seed: int,
    data_seed: int,
    epochs: int,
    batch_size: int = 64,
    lr: float = 0.04,
    weight_decay: float = 2e-4,
    crop_padding: int = 4,
    num_classes: int | None = None,
    model_options: Mapping[str, Any] | None = None,
) -> TrainResult:
    """Train one network with SGD from the initialisation ``seed`` and data order ``data_seed``.

    The global torch RNG is forked, so the caller's random state is untouched and the
    result depends only on the arguments. Returns the final weights and the final
    train/test loss and accuracy (no early stopping).
    """
    started = time.perf_counter()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build(architecture, num_classes=num_classes, **dict(model_options or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
    _, height, width = train.image_shape
    augment = Compose([RandomCrop((height, width), padding=crop_padding),
                       Normalize(train.mean, train.std)])
    for epoch in range(epochs):
        model.train()
        for images, labels in iterate_batches(train, batch_size, seed=data_seed, epoch=epoch,
                                              transform=augment):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
    train_metrics = evaluate(model, train)
    test_metrics = evaluate(model, test)
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    finite = all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    chance = 1.0 / (num_classes or train.num_classes)
    diverged = not finite or test_metrics["accuracy"] <= chance + 0.02
    return TrainResult(
        state_dict=state,
        metrics={"train_loss": train_metrics["loss"], "train_accuracy": train_metrics["accuracy"],
                 "test_loss": test_metrics["loss"], "test_accuracy": test_metrics["accuracy"]},
        wall_time=time.perf_counter() - started,
        diverged=diverged,
    )
