"""The vectorised engine (torch.func over stacked parameters) against the torch engine.

Tolerance: the vectorised engine feeds each model exactly the same batches, dropout masks,
learning rates and SGD rule as the torch engine, but under ``vmap`` a convolution becomes
one grouped convolution over all models and a linear layer a batched matrix product, so
gradients are summed in a different order and differ in the last bits. Over the 22 steps
of one epoch on digits the measured maximum absolute weight difference is <= 5e-8
(OptuNet, paper recipe, with and without MC dropout) and <= 2e-7 (MLP with Nesterov
momentum); the tolerances below leave more than an order of magnitude of headroom.
Replaying the dropout masks from another noise seed moves the MC-dropout weights by 7e-3.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from posteriorzoo.errors import InvalidOptionError
from train_zoo.data import load_training_data
from train_zoo.job import resolve_engine, train_checkpoints
from train_zoo.seeds import checkpoint_seeds
from train_zoo.spec import ZooSpec, make_spec
from train_zoo.torch_engine import initial_model, train_torch
from train_zoo.vectorised import supports, train_vectorised

INDICES = [0, 1, 2]

SPECS = {
    # The paper's OptuNet recipe (crop augmentation, weight decay), one epoch.
    "optunet": (make_spec("optunet-mnist", dataset="digits", checkpoints=3,
                          recipe_overrides={"epochs": 1}), 1e-6),
    # Dropout: per-model dropout masks replayed from each checkpoint's noise seed.
    "optunet-mc-dropout": (make_spec("optunet-mnist", dataset="digits", checkpoints=3,
                                     model_options={"dropout": 0.2},
                                     recipe_overrides={"epochs": 1}),
                           1e-6),
    # An MLP with Nesterov momentum and weight decay, no augmentation.
    "mlp-nesterov": (make_spec("optunet-mnist", dataset="digits", architecture="mlp",
                               checkpoints=3, model_options={"widths": (784, 16, 10)},
                               recipe_overrides={"epochs": 1, "crop_padding": 0,
                                                 "momentum": 0.9, "nesterov": True}),
                     1e-5),
}


@pytest.fixture(scope="module")
def data():
    return load_training_data("digits")


@pytest.fixture(scope="module")
def trained(data):
    """Per case: (torch results, vectorised results) for INDICES."""
    cache: dict[str, tuple[list, list]] = {}

    def get(case: str) -> tuple[list, list]:
        if case not in cache:
            spec, _ = SPECS[case]
            cache[case] = ([train_torch(spec, i, data) for i in INDICES],
                           train_vectorised(spec, INDICES, data))
        return cache[case]

    return get


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.parametrize("case", list(SPECS))
def test_matches_torch_engine(case, trained, data):
    spec, tolerance = SPECS[case]
    assert supports(spec)
    reference, vectorised = trained(case)
    steps_per_epoch = math.ceil(len(data.train) / spec.recipe.batch_size)
    assert len(data.train) % spec.recipe.batch_size != 0  # the last batch is smaller
    for ref, vec in zip(reference, vectorised, strict=True):
        assert vec.index == ref.index
        assert vec.engine == "vectorised"
        assert vec.seeds == ref.seeds
        assert vec.steps == ref.steps == steps_per_epoch * spec.recipe.epochs
        assert vec.diverged == ref.diverged
        for key, value in ref.state.items():
            assert vec.state[key].shape == value.shape
            assert vec.state[key].dtype == value.dtype
        difference = max_difference(ref.state, vec.state)
        print(f"{case} checkpoint {ref.index}: max |w_vec - w_torch| = {difference:.2e}")
        assert difference <= tolerance, difference
        for name in ("train_loss", "test_loss"):
            assert vec.metrics[name] == pytest.approx(ref.metrics[name], abs=1e-4)
        for name, split in (("train_accuracy", data.train), ("test_accuracy", data.test)):
            assert abs(vec.metrics[name] - ref.metrics[name]) <= 2 / len(split)


def test_weights_moved(trained):
    """Training changed the weights, so the comparison above is not vacuous."""
    spec, _ = SPECS["optunet-mc-dropout"]
    _, vectorised = trained("optunet-mc-dropout")
    start = initial_model(spec, checkpoint_seeds(spec.base_seed, 0).init).state_dict()
    initial = {key: value.numpy() for key, value in start.items()}
    assert max_difference(initial, vectorised[0].state) > 1e-2


def test_group_order_does_not_matter(trained, data):
    spec, _ = SPECS["optunet"]
    _, full = trained("optunet")
    by_index = {result.index: result for result in full}
    subset = train_vectorised(spec, [2, 0], data)
    assert [result.index for result in subset] == [2, 0]
    for result in subset:
        # Each model is an independent slice of every batched kernel: on CPU the result
        # is bit-identical whatever the group's size and order.
        for key, value in result.state.items():
            np.testing.assert_array_equal(value, by_index[result.index].state[key])
        assert result.steps == by_index[result.index].steps


def test_divergence_stops_each_model_like_torch(data):
    # lr = 50 blows each MLP up after a different number of steps (13 to 15 here): a
    # non-finite loss freezes that model only, as the torch engine stops that checkpoint.
    spec = make_spec("optunet-mnist", dataset="digits", architecture="mlp", checkpoints=4,
                     model_options={"widths": (784, 16, 10)},
                     recipe_overrides={"epochs": 1, "lr": 50.0, "momentum": 0.9})
    indices = [0, 1, 2, 3]
    reference = [train_torch(spec, i, data) for i in indices]
    vectorised = train_vectorised(spec, indices, data)
    steps = [r.steps for r in reference]
    assert len(set(steps)) > 1 and max(steps) < math.ceil(len(data.train) / 64)
    assert [r.steps for r in vectorised] == steps
    assert [r.diverged for r in vectorised] == [r.diverged for r in reference] == [True] * 4


def test_engine_dispatch(data):
    spec, _ = SPECS["mlp-nesterov"]
    assert resolve_engine(spec, "vectorised") == "vectorised"
    assert resolve_engine(SPECS["optunet"][0], "vectorised") == "vectorised"
    resnet: ZooSpec = make_spec("resnet18-cifar100", checkpoints=2)
    assert not supports(resnet)
    with pytest.raises(InvalidOptionError, match="vectorised"):
        resolve_engine(resnet, "vectorised")
    with pytest.raises(InvalidOptionError, match="buffers|not one of"):
        train_vectorised(resnet, [0], data)
    small = spec.replace(model_options={"widths": (784, 4, 10)})
    results = train_checkpoints(small, [1, 0], data, engine="vectorised")
    assert [r.index for r in results] == [1, 0]
    assert all(r.engine == "vectorised" for r in results)
    assert train_vectorised(small, [], data) == []
