"""Member and ensemble predictions against an independent computation.

Tolerances (issue 30 section 1). The members' probabilities come from two float32
implementations: the numba kernels (``evaluate``'s default for OptuNets) and torch, whose
sums run in other orders, with or without FMA, and whose bits differ between instruction
sets. Each probability lies within ``softmax_bounds`` of the other implementation's
(``tests/rounding_bounds.py``: the forward pass's worst-case bound, ``gamma(k) |W| |x|``
per layer, carried through the softmax), and every metric compared across them is
bounded by what that bound lets it move: an example may change its arg-max only where
its two largest probabilities lie within their bounds. Metrics of the *same*
probabilities are the same function on the same numbers in one process: compared
exactly, or, where the test sums them in another order (float64), within Higham's
``gamma(k, U64)`` of the terms.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from rounding_bounds import U64, gamma, optunet_forward_bounds, softmax_bounds

from posteriorzoo.collection import evaluate
from posteriorzoo.collection.evaluation import member_probabilities, normalized_images
from posteriorzoo.data import load_dataset
from posteriorzoo.errors import InvalidOptionError, PosteriorZooError
from posteriorzoo.metrics import accuracy, negative_log_likelihood
from posteriorzoo.models import build
from posteriorzoo.zoo import create_zoo, open_zoo

#: A float64 logarithm's relative error: numpy's AVX-512 loops (SVML) promise 4 ulp,
#: glibc's ``log`` less than 1; an ulp is at most 2 u of the value.
LOG_ROUNDING = 8 * U64


def _torch_members(models, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Each model's float32 softmax outputs by torch ``(M, n, K)``, and the bound on their
    distance from another float32 implementation's (``softmax_bounds``), float64."""
    with torch.no_grad():
        members = np.stack([torch.softmax(model(images), dim=1).numpy() for model in models])
    bound = np.stack([softmax_bounds(optunet_forward_bounds(model, images)).numpy()
                      for model in models])
    return members, bound


def _near_ties(probabilities: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Per row of ``(..., n, K)``: the examples whose two largest probabilities lie within
    the sum of their bounds (only they may change their arg-max)."""
    order = np.argsort(probabilities, axis=-1)[..., -2:]
    top2 = np.take_along_axis(probabilities, order, axis=-1)
    gap = top2[..., 1] - top2[..., 0]
    return (gap <= np.take_along_axis(bound, order, axis=-1).sum(-1)).sum(-1)


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
    # The kernels against torch, and torch at batch 33 against torch at batch 100 (its
    # products may be blocked differently; they differ here): two float32 implementations
    # each, within softmax_bounds (at most 2.3e-5 to 3.2e-5 per model here). Measured: at
    # most 0.0019 (kernels) and 0.0013 (batch sizes) of it, AVX-512 and AVX2 alike.
    # Images normalised 1% off, or one bias 1e-3 off, exceed it 4.7 and 6.2 times.
    expected, bound = _torch_members(models, images)
    assert (np.abs(kernels.astype(np.float64) - probabilities) <= bound).all()
    assert (np.abs(probabilities.astype(np.float64) - expected) <= bound).all()
    # the torch engine again, on one checkpoint: the same computation, bit for bit
    np.testing.assert_array_equal(subset[0], probabilities[2])


def test_accuracy_and_nll_closed_form():
    probabilities = np.array([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]])
    labels = np.array([0, 1, 1])
    # the mean of (True, False, True): 2 / 3 correctly rounded, as the literal
    assert accuracy(probabilities, labels) == 2 / 3
    logs = [math.log(0.7), math.log(0.8), math.log(0.4)]
    expected = -sum(logs) / 3
    # the same stored inputs; each side's three logarithms (LOG_ROUNDING: numpy's and
    # libm's may differ), two additions and a division (gamma(3)), of sum |log p| / 3.
    # Measured: equal.
    bound = 2 * (LOG_ROUNDING + gamma(3, U64)) * sum(abs(x) for x in logs) / 3
    assert abs(negative_log_likelihood(probabilities, labels) - expected) <= bound


def test_evaluate_a_collection_against_each_model(three_models, tmp_path):
    models, path = three_models
    test = load_dataset("digits", "test")
    images = normalized_images(test)
    result = evaluate(path)                     # the kernels' probabilities
    members, bound = _torch_members(models, images)
    n = len(test.labels)
    # Accuracy: a count over n; it may differ by the examples whose top two lie within
    # their bounds (1, 17 and 0 of the 450 for these untrained networks; measured: equal
    # counts, AVX-512 and AVX2).
    correct = np.rint(result.member_accuracy * n)
    assert np.array_equal(correct / n, result.member_accuracy)
    expected = (members.argmax(axis=2) == test.labels).sum(axis=1)
    assert (np.abs(correct - expected) <= _near_ties(members, bound)).all()
    # NLL of the float64 predictive: P moves by the members' mean bound D (each side's
    # mean of 3 adds gamma(4, U64) of P), -log P by D / (P - D) at the label (clipped at
    # 1e-12 as the metric is); each side's n logarithms and mean round by LOG_ROUNDING +
    # gamma(n + 1) of the NLL (its terms are positive): 1.6e-4 here. Measured 3.0e-6 of
    # the bound (AVX-512), 2.3e-5 (AVX2).
    ensemble = members.mean(axis=0, dtype=np.float64)
    picked = ensemble[np.arange(n), test.labels]
    moved = bound.mean(axis=0)[np.arange(n), test.labels] + 2 * gamma(4, U64) * picked
    nll = negative_log_likelihood(ensemble, test.labels)
    nll_bound = (float(np.minimum(moved / np.maximum(picked - moved, 1e-12),
                                  math.log(1e12)).mean())
                 + 2 * (LOG_ROUNDING + gamma(n + 1, U64)) * nll)
    assert abs(result.ensemble_nll - nll) <= nll_bound
    paths = result.write(tmp_path / "out")
    assert sorted(paths) == ["evaluate.json", "members.csv"]


def test_evaluate_gives_every_table_1_metric_of_the_predictive(three_models, tmp_path):
    """ECE, Brier, MI, AUPR, FPR95 and pairwise MI of ``evaluate`` equal the pure metrics
    on the members' probabilities, with OOD images normalised like the ID ones.

    The probabilities are ``evaluate``'s own engine's (the kernels) on images normalised
    here: the same computation on the same numbers in one process, so MI, AUPR, FPR95
    and the pairwise MI must be equal bit for bit (a wrong image, normalisation or member
    changes them); Brier and ECE within the float64 rounding of a predictive averaged in
    another order (kernels against torch: test_member_probabilities_match_each_model)."""
    from posteriorzoo.data import Normalize
    from posteriorzoo.metrics import (
        aupr,
        brier_score,
        expected_calibration_error,
        fpr_at_95_recall,
        mean_mutual_information,
        ood_scores,
        pairwise_mutual_information,
        posterior_predictive,
    )

    models, path = three_models
    ood_name = "fashion-mnist"
    try:
        ood = load_dataset(ood_name, "test", download=False)
    except PosteriorZooError:
        pytest.skip("the Fashion-MNIST files are not installed")
    test = load_dataset("digits", "test")
    normalize = Normalize(test.mean, test.std)      # the ID statistics for both sets
    id_images = normalized_images(test)[:300]
    ood_images = normalize(torch.from_numpy(ood.images[:300]))
    id_members = member_probabilities(path, id_images)
    ood_members = member_probabilities(path, ood_images)
    result = evaluate(path, ood_dataset=ood_name, ood_score="mutual-information", bins=10,
                      n_images=300, n_pairs=2, seed=1)
    labels = test.labels[:300]
    assert result.image_counts == {"id": 300, "ood": 300}
    assert result.idmi == mean_mutual_information(id_members)
    assert result.oodmi == mean_mutual_information(ood_members)
    scores = (ood_scores(id_members, "mutual-information"),
              ood_scores(ood_members, "mutual-information"))
    assert result.aupr == aupr(*scores)
    assert result.fpr95 == fpr_at_95_recall(*scores)
    assert result.pairs.shape == (2, 2) and (result.pairs[:, 0] < result.pairs[:, 1]).all()
    expected, _ = pairwise_mutual_information(ood_members, result.pairs)
    np.testing.assert_array_equal(result.pairwise_ood, expected)
    # Brier and ECE of the predictive numpy averages (the kernels sum the members in
    # another order): P within 2 gamma(m + 1, U64) P of evaluate's. Brier then moves by
    # sum_k 2 |P - y| dP, plus each side's gamma(n + K + 2) of it; the ECE's confidences
    # by max dP (an example that close to a bin edge, or its top two that close, may
    # change its bin: none here), plus each side's gamma(n + bins + 2) of accuracy +
    # mean confidence (the nearest edge is 0.012 away, the closest top two 0.0012 apart,
    # against shifts of 1e-16). Measured: equal (both), AVX-512 and AVX2.
    predictive = posterior_predictive(id_members)
    count, n, classes = id_members.shape
    moved = 2 * gamma(count + 1, U64) * predictive
    onehot = np.eye(classes)[labels]
    brier = brier_score(predictive, labels)
    brier_bound = (float((2 * np.abs(predictive - onehot) * moved).sum(axis=1).mean())
                   + 2 * gamma(n + classes + 2, U64) * brier)
    assert abs(result.ensemble_brier - brier) <= brier_bound
    confidence, shift = predictive.max(axis=1), moved.max(axis=1)
    edges = np.arange(11) / 10
    assert not (np.abs(confidence[:, None] - edges) <= shift[:, None]).any()
    assert not _near_ties(predictive, moved).any()
    ece = expected_calibration_error(predictive, labels, 10)
    ece_bound = (float(shift.mean()) + 2 * gamma(n + 10 + 2, U64)
                 * (float((predictive.argmax(1) == labels).mean()) + float(confidence.mean())))
    assert abs(result.ensemble_ece - ece) <= ece_bound
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
        # the same images (reused copies) and kernels: the same numbers, bit for bit
        assert (result.ensemble_nll, result.idmi, result.oodmi, result.aupr) == (
            plain.ensemble_nll, plain.idmi, plain.oodmi, plain.aupr)
    evaluate(path, n_images=200)
    assert len(reads) == 3                       # outside the block: read again
