"""Member and ensemble predictions against an independent computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posteriorzoo.collection import evaluate
from posteriorzoo.collection.evaluation import member_probabilities, normalized_images
from posteriorzoo.data import load_dataset
from posteriorzoo.metrics import accuracy, negative_log_likelihood
from posteriorzoo.models import build
from posteriorzoo.zoo import create_zoo, open_zoo


@pytest.fixture
def three_models(tmp_path):
    """Three seeded OptuNets and the collection ``z.h5`` that holds them."""
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(build("optunet").eval())
    with create_zoo(tmp_path / "z.h5", architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=models[0].state_dict()) as zoo:
        for model in models:
            zoo.append(model.state_dict())
    return models, tmp_path / "z.h5"


def test_member_probabilities_match_each_model(three_models):
    models, path = three_models
    test = load_dataset("digits", "test")
    images = normalized_images(test)[:100]
    with open_zoo(path) as zoo:
        probabilities = member_probabilities(zoo, images, batch_size=33)
        subset = member_probabilities(zoo, images, indices=[2], batch_size=33)
    assert probabilities.shape == (3, 100, 10)
    with torch.no_grad():
        for member, model in zip(probabilities, models, strict=True):
            expected = torch.softmax(model(images), dim=1).numpy()
            np.testing.assert_allclose(member, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(subset[0], probabilities[2])


def test_accuracy_and_nll_closed_form():
    probabilities = np.array([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]])
    labels = np.array([0, 1, 1])
    assert accuracy(probabilities, labels) == pytest.approx(2 / 3)
    expected = -(np.log(0.7) + np.log(0.8) + np.log(0.4)) / 3
    assert negative_log_likelihood(probabilities, labels) == pytest.approx(expected)


def test_evaluate_a_collection_against_each_model(three_models, tmp_path):
    models, path = three_models
    test = load_dataset("digits", "test")
    images = normalized_images(test)
    result = evaluate(path)
    with torch.no_grad():
        members = [torch.softmax(model(images), dim=1).numpy() for model in models]
    expected = [accuracy(p, test.labels) for p in members]
    np.testing.assert_allclose(result.member_accuracy, expected)
    ensemble = np.mean(members, axis=0)
    assert result.ensemble_nll == pytest.approx(negative_log_likelihood(ensemble, test.labels),
                                                rel=1e-5)
    paths = result.write(tmp_path / "out")
    assert sorted(paths) == ["evaluate.json", "members.csv"]
