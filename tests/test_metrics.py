"""Member and ensemble predictions against an independent computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posteriorzoo.collection import evaluate
from posteriorzoo.collection.evaluation import member_probabilities, normalized_images
from posteriorzoo.data import load_dataset
from posteriorzoo.errors import InvalidOptionError, PosteriorZooError
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
        probabilities = member_probabilities(zoo, images, batch_size=33, engine="torch")
        subset = member_probabilities(zoo, images, indices=[2], batch_size=33)
        kernels = member_probabilities(zoo, images)       # engine "auto": OptuNet kernels
    assert probabilities.shape == kernels.shape == (3, 100, 10)
    assert np.abs(kernels - probabilities).max() < 2e-6
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


def test_evaluate_gives_every_table_1_metric_of_the_predictive(three_models, tmp_path):
    """ECE, Brier, MI, AUPR, FPR95 and pairwise MI of ``evaluate`` equal the pure metrics
    on the members' probabilities, with OOD images normalised like the ID ones."""
    from posteriorzoo.data import Normalize
    from posteriorzoo.metrics import (
        aupr,
        brier_score,
        expected_calibration_error,
        fpr_at_95_recall,
        mean_mutual_information,
        ood_scores,
        pairwise_mutual_information,
    )

    models, path = three_models
    ood_name = "fashion-mnist"
    try:
        ood = load_dataset(ood_name, "test", download=False)
    except PosteriorZooError:
        pytest.skip("the Fashion-MNIST files are not installed")
    test = load_dataset("digits", "test")
    normalize = Normalize(test.mean, test.std)      # the ID statistics for both sets
    with torch.no_grad():
        id_members = np.stack([torch.softmax(m(normalized_images(test)), 1).numpy()
                               for m in models])
        ood_members = np.stack([torch.softmax(m(normalize(torch.from_numpy(
            ood.images[:300]))), 1).numpy() for m in models])
    result = evaluate(path, ood_dataset=ood_name, ood_score="mutual-information", bins=10,
                      n_images=300, n_pairs=2, seed=1)
    labels = test.labels[:300]
    id_members = id_members[:, :300]
    predictive = id_members.mean(axis=0)
    assert result.image_counts == {"id": 300, "ood": 300}
    assert result.ensemble_brier == pytest.approx(brier_score(predictive, labels), rel=1e-5)
    assert result.ensemble_ece == pytest.approx(
        expected_calibration_error(predictive, labels, 10), rel=1e-4, abs=1e-6)
    assert result.idmi == pytest.approx(mean_mutual_information(id_members), rel=1e-4)
    assert result.oodmi == pytest.approx(mean_mutual_information(ood_members), rel=1e-4)
    scores = (ood_scores(id_members, "mutual-information"),
              ood_scores(ood_members, "mutual-information"))
    assert result.aupr == pytest.approx(aupr(*scores), rel=1e-4)
    assert result.fpr95 == pytest.approx(fpr_at_95_recall(*scores), abs=1e-3)
    assert result.pairs.shape == (2, 2) and (result.pairs[:, 0] < result.pairs[:, 1]).all()
    expected, _ = pairwise_mutual_information(ood_members, result.pairs)
    np.testing.assert_allclose(result.pairwise_ood, expected, rtol=1e-4)
    assert sorted(result.write(tmp_path / "ev")) == ["evaluate.json", "members.csv",
                                                      "pairwise_mi.csv"]
    assert evaluate(path, n_pairs=99).pairs.shape == (3, 2)     # all 3 pairs of 3 members
    with pytest.raises(InvalidOptionError, match="ood_score"):
        evaluate(path, ood_score="entropy")


def test_reusing_images_reads_each_split_once_and_changes_nothing(three_models, monkeypatch):
    """Inside ``reusing_images`` the report's evaluations read each split once; every
    number is the same as without it, and a caller that changes its images does not
    change the next call's."""
    from posteriorzoo.collection import evaluation

    _, path = three_models
    plain = evaluate(path, ood_dataset="digits", split="test", n_images=200)
    reads = []
    original = evaluation.load_dataset
    monkeypatch.setattr(evaluation, "load_dataset",
                        lambda *args, **kwargs: reads.append(args) or original(*args, **kwargs))

    def spoiling(zoo, images):
        probabilities = member_probabilities(zoo, images)
        images.fill_(float("nan"))               # a careless predict: must not leak
        return probabilities

    with evaluation.reusing_images():
        first = evaluate(path, ood_dataset="digits", split="test", n_images=200,
                         predict=spoiling)
        second = evaluate(path, ood_dataset="digits", split="test", n_images=200)
    assert len(reads) == 2                       # once as ID, once as OOD: not again
    for result in (first, second):
        np.testing.assert_array_equal(result.member_accuracy, plain.member_accuracy)
        assert (result.ensemble_nll, result.idmi, result.oodmi, result.aupr) == (
            plain.ensemble_nll, plain.idmi, plain.oodmi, plain.aupr)
    evaluate(path, n_images=200)
    assert len(reads) == 3                       # outside the block: read again
