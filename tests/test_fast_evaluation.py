"""The fast engine's evaluation of a trained network (train_zoo.fast.evaluate) against the
torch engine's (train_zoo.torch_engine.evaluate), which the trainer ran on both splits of
every checkpoint: the same loss and accuracy to float32 rounding, the torch path itself
for what the kernels do not take, and checkpoints that do not change.

Tolerances: the loss within ``rounding_bounds.evaluation_bounds`` (the forward pass's
worst-case bound for the values at hand, carried by the cross-entropy, plus its own
rounding and the float32 sums over the split: 0.13% to 0.63% of the loss here; measured
differences, with AVX-512 and AVX2, below 1e-7 of it), the number of correct examples
within the count of examples whose two largest logits lie within that bound of each
other (0 to 74 here; the accuracies measured are equal, but another instruction set may
round such an example the other way)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from rounding_bounds import evaluation_bounds

from posteriorzoo.models import build
from train_zoo import make_spec, train_checkpoints
from train_zoo.data import load_training_data
from train_zoo.fast import evaluate as fast_evaluate
from train_zoo.fast.engine import train_base
from train_zoo.torch_engine import evaluate as torch_evaluate


@pytest.fixture(scope="module")
def digits():
    return load_training_data("digits")


def _model(architecture: str, seed: int, scale: float = 1.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build(architecture)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(scale)
    return model.eval()


@pytest.mark.parametrize("architecture", ["optunet", "optunet-v1"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_evaluation_gives_the_torch_engines_numbers(digits, architecture, seed):
    model = _model(architecture, seed, scale=3.0)   # confident, varied predictions
    for split in (digits.train, digits.test):
        loss, accuracy = fast_evaluate(model, split, batch_size=300)   # a partial batch
        expected_loss, expected_accuracy = torch_evaluate(model, split)
        loss_bound, flips = evaluation_bounds(model, split)
        assert abs(loss - expected_loss) <= loss_bound
        assert abs(accuracy - expected_accuracy) * len(split) <= flips + 1e-9


def test_what_the_kernels_do_not_take_is_evaluated_by_torch(digits):
    torch.manual_seed(0)
    with_dropout = build("optunet", dropout=0.2).eval()   # the kernels have no dropout
    assert fast_evaluate(with_dropout, digits.test) == torch_evaluate(with_dropout,
                                                                      digits.test)
    wrong_labels = dataclasses.replace(digits.test, labels=digits.test.labels + 5,
                                       num_classes=15)
    with pytest.raises(IndexError):   # labels beyond the head: torch's own error
        fast_evaluate(_model("optunet", 0), wrong_labels)
    broken = _model("optunet", 1)
    with torch.no_grad():
        broken.conv2.weight[0, 0, 0, 0] = float("nan")
    fast_loss, fast_accuracy = fast_evaluate(broken, digits.test)
    torch_loss, torch_accuracy = torch_evaluate(broken, digits.test)
    assert np.isnan(fast_loss) and np.isnan(torch_loss) and fast_accuracy == torch_accuracy


def test_fast_engine_checkpoints_are_those_of_its_training_and_metrics_its_evaluation(digits):
    spec = make_spec("optunet-mnist", dataset="digits", method="de", checkpoints=2,
                     base_seed=4, recipe_overrides={"epochs": 1})
    results = train_checkpoints(spec, [0, 1], data=digits, engine="fast")
    for index, result in enumerate(results):
        model, steps, engine = train_base(spec, index, digits)
        assert engine == "fast" and steps == result.steps
        for key, value in model.state_dict().items():
            assert np.array_equal(result.state[key], value.numpy())   # bit for bit
        model.eval()
        for split in ("train", "test"):
            dataset = getattr(digits, split)
            loss, accuracy = torch_evaluate(model, dataset)
            loss_bound, flips = evaluation_bounds(model, dataset)
            assert abs(result.metrics[f"{split}_loss"] - loss) <= loss_bound
            assert abs(result.metrics[f"{split}_accuracy"] - accuracy) * len(dataset) \
                <= flips + 1e-9
