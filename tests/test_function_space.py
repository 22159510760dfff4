"""Distances in function space: the NeurIPS 2021 competition's agreement and total
variation, their noise band, reference probability files, and ``evaluate``'s references.

Tolerances. Every value here is float64 arithmetic on float64 or float32 inputs drawn from
numpy Generators (the same bits on every CPU); implementations differ only in the order
of their sums. Each comparison is bounded by Higham's ``gamma(k, U64)`` of the terms'
scale, ``k`` the roundings on the longest path (``tests/rounding_bounds.py``). Agreement
is a count over n divided by n: compared exactly, except where a row's two largest
probabilities lie within the rounding bound (then it may change its arg-max; counted).
Values built from binary fractions are exact and compared exactly.
"""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np
import pytest
import torch
from rounding_bounds import U32, U64, gamma

from posteriorzoo.collection import evaluate, read_reference_predictive
from posteriorzoo.collection import reference_predictive as reference_module
from posteriorzoo.errors import DataFormatError, DataNotFoundError, InvalidOptionError
from posteriorzoo.metrics import agreement, predictive_noise, total_variation
from posteriorzoo.models import build
from posteriorzoo.zoo import create_zoo

# -------------------------------------------------------------------- the pure core


def _dirichlet(rng: np.random.Generator, n: int, classes: int, *lead: int,
               dtype=np.float64) -> np.ndarray:
    """Random probability rows, with a few dominant classes (so arg-maxes are clear)."""
    return rng.dirichlet(np.full(classes, 0.5), size=(*lead, n)).astype(dtype)


def _tv_exactly(p: np.ndarray, q: np.ndarray) -> float:
    """The competition's total variation summed with math.fsum (correctly rounded sums)."""
    rows = [math.fsum(abs(float(a) - float(b)) for a, b in zip(x, y, strict=True))
            for x, y in zip(p, q, strict=True)]
    return math.fsum(rows) / len(rows) / 2


def test_identical_and_disjoint_closed_forms():
    rng = np.random.default_rng(0)
    p = _dirichlet(rng, 50, 7)
    assert agreement(p, p) == 1.0
    assert total_variation(p, p) == 0.0
    one_hot = np.eye(4)[[0, 1, 2, 3, 0]]
    other = np.eye(4)[[1, 2, 3, 0, 3]]          # a different class on every row
    assert agreement(one_hot, other) == 0.0
    assert total_variation(one_hot, other) == 1.0   # 0.5 * (1 + 1) per row, exactly


def test_a_hand_computed_example():
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]])
    q = np.array([[0.2, 0.5, 0.3], [0.1, 0.7, 0.2], [0.5, 0.25, 0.25]])
    # arg-max: p (0, 1, 2), q (1, 1, 0): only the second row agrees; 1 / 3 is the mean of
    # (0, 1, 0), a correctly rounded division
    assert agreement(p, q) == 1 / 3
    # per row 0.5 * (0.3 + 0.2 + 0.1), 0.5 * (0 + 0.1 + 0.1), 0.5 * (0.25 + 0 + 0.25)
    expected = (0.3 + 0.1 + 0.25) / 3
    # decimal inputs are stored to u (relative, each of the 18 values, sum |p| + |q| = 6
    # over 3 rows), then 3 subtractions, 2 additions per row, 2 additions and a division
    # of the mean, and the expected value's own 3 roundings: gamma(10) of the terms.
    bound = gamma(10, U64) * (np.abs(p).sum() + np.abs(q).sum()) / 3
    assert abs(total_variation(p, q) - expected) <= bound


def test_the_competitions_formulas_and_the_metric_axioms():
    rng = np.random.default_rng(1)
    n, classes = 300, 10
    p, q, r = (_dirichlet(rng, n, classes, dtype=np.float32) for _ in range(3))
    # The competition's agreement, as written there: equal arg-maxes, averaged.
    assert agreement(p, q) == np.mean(np.argmax(p, -1) == np.argmax(q, -1))
    # Its total variation, |p - q|.sum(-1).mean() / 2, with correctly rounded sums (fsum)
    # of the same float64 differences: the metric's K - 1 + n - 1 additions and its
    # division by n, gamma(K + n) of the result.
    for first, second in ((p, q), (q, r), (p, r)):
        exact = _tv_exactly(first, second)
        assert abs(total_variation(first, second) - exact) <= gamma(classes + n, U64) * exact
    # Symmetric, bit for bit (|a - b| = |b - a| and the same sums).
    assert total_variation(p, q) == total_variation(q, p)
    assert agreement(p, q) == agreement(q, p)
    # The triangle inequality, up to the three values' rounding.
    pq, qr, pr = total_variation(p, q), total_variation(q, r), total_variation(p, r)
    assert pr <= pq + qr + gamma(classes + n, U64) * (pq + qr + pr)
    assert min(pq, qr, pr) >= 0 and max(pq, qr, pr) <= 1


@pytest.mark.parametrize("function", [agreement, total_variation])
def test_bad_input_is_refused(function):
    rng = np.random.default_rng(2)
    p = _dirichlet(rng, 20, 5)
    name = function.__name__
    with pytest.raises(InvalidOptionError, match=rf"{name}\(\).*same shape"):
        function(p, p[:19])
    with pytest.raises(InvalidOptionError, match="same shape"):
        function(p, _dirichlet(rng, 20, 6))
    with pytest.raises(InvalidOptionError, match=r"shape \(n, K\)"):
        function(p[0], p[0])
    with pytest.raises(InvalidOptionError, match=r"reference must lie in \[0, 1\]"):
        function(p, p - 0.5)
    with pytest.raises(InvalidOptionError, match="sum to 1"):
        function(p * 0.9, p)
    with pytest.raises(InvalidOptionError, match="NaN"):
        function(p, np.full_like(p, np.nan))
    with pytest.raises(InvalidOptionError, match="reference must be"):
        function(p, p.tolist())


def _dyadic_members(rng: np.random.Generator, m: int, n: int, classes: int) -> np.ndarray:
    """Probability rows of multiples of 2^-10 summing to exactly 1: their sums over up to
    2^42 members are exact in float64."""
    scaled = np.floor(_dirichlet(rng, n, classes, m) * 1024)
    scaled[..., -1] = 1024 - scaled[..., :-1].sum(axis=-1)
    return scaled / 1024


def _plain_noise(members: np.ndarray, held_out: int, splits: int, seed: int):
    """The noise band by a plain loop over the same draws, and each split's bound on how
    far the function's total variation may be from this one's, and its near ties."""
    rng = np.random.default_rng(seed)
    m = len(members)
    agreements, variations, bounds, near = [], [], [], []
    total_mass = members.sum(axis=0, dtype=np.float64)
    for _ in range(splits):
        drawn = rng.permutation(m)[:held_out]
        rest = np.setdiff1d(np.arange(m), drawn)
        method = members[drawn].mean(axis=0, dtype=np.float64)
        target = members[rest].mean(axis=0, dtype=np.float64)
        agreements.append(np.mean(method.argmax(-1) == target.argmax(-1)))
        variations.append(np.abs(method - target).sum(-1).mean() / 2)
        # Each entry (positive terms): the method's mean gamma(h + 1) on both sides; the
        # target's rest = (total - drawn) / (m - h) carries gamma(m) of the total's and
        # gamma(h) of the drawn sum's terms, plus a subtraction and a division (2 u),
        # and this loop's mean gamma(m - h + 1).
        drawn_mass = members[drawn].sum(axis=0, dtype=np.float64)
        error_method = 2 * gamma(held_out + 1, U64) * method
        error_target = ((gamma(m, U64) * total_mass + gamma(held_out, U64) * drawn_mass)
                        / (m - held_out) + (2 * U64 + gamma(m - held_out + 1, U64)) * target)
        classes, n = members.shape[2], members.shape[1]
        moved = error_method + error_target
        tv = variations[-1]
        bounds.append(0.5 * moved.sum(-1).mean() + 2 * gamma(classes + n, U64) * (tv + 1e-300))
        gaps = []
        for predictive, error in ((method, error_method), (target, error_target)):
            order = np.argsort(predictive, axis=-1)[:, -2:]
            top = np.take_along_axis(predictive, order, -1)
            slack = np.take_along_axis(error, order, -1).sum(-1)
            gaps.append(top[:, 1] - top[:, 0] <= slack)
        near.append(int((gaps[0] | gaps[1]).sum()))
    return (np.array(agreements), np.array(variations), np.array(bounds), np.array(near))


def test_predictive_noise_matches_a_plain_loop_and_is_reproducible():
    rng = np.random.default_rng(3)
    members = _dirichlet(rng, 80, 6, 40, dtype=np.float32)       # m = 40, n = 80, K = 6
    band = predictive_noise(members, 8, 12, 5)
    assert set(band) == {"agreement", "total_variation"}
    assert band["agreement"].shape == band["total_variation"].shape == (12,)
    again = predictive_noise(members, 8, 12, 5)
    for key in band:
        np.testing.assert_array_equal(band[key], again[key])
    other = predictive_noise(members, 8, 12, 6)
    assert not np.array_equal(other["total_variation"], band["total_variation"])
    agreements, variations, bounds, near = _plain_noise(members, 8, 12, 5)
    n = members.shape[1]
    assert (np.abs(band["agreement"] - agreements) * n <= near + 1e-9).all()
    assert (np.abs(band["total_variation"] - variations) <= bounds).all()
    # a band that says something: these independent members disagree
    assert variations.min() > 0.05 and agreements.max() < 1


def test_predictive_noise_of_identical_members_is_zero():
    rng = np.random.default_rng(4)
    one = _dyadic_members(rng, 1, 30, 5)
    members = np.repeat(one, 9, axis=0)
    # dyadic rows: every sum, the rest (9p - 4p) / 5 and the drawn 4p / 4 are exact
    band = predictive_noise(members, 4, 7, 0)
    np.testing.assert_array_equal(band["agreement"], np.ones(7))
    np.testing.assert_array_equal(band["total_variation"], np.zeros(7))
    # and with dyadic members that differ, the plain loop's values exactly
    members = _dyadic_members(rng, 16, 30, 5)
    band = predictive_noise(members, 4, 7, 1)
    agreements, variations, _, _ = _plain_noise(members, 4, 7, 1)
    np.testing.assert_array_equal(band["agreement"], agreements)
    np.testing.assert_array_equal(band["total_variation"], variations)


def test_predictive_noise_refuses_bad_options():
    rng = np.random.default_rng(5)
    members = _dirichlet(rng, 10, 3, 5)
    for held_out in (0, 5, 6):
        with pytest.raises(InvalidOptionError, match=r"held_out must lie in 1\.\.4"):
            predictive_noise(members, held_out, 3, 0)
    with pytest.raises(InvalidOptionError, match="splits"):
        predictive_noise(members, 2, 0, 0)
    with pytest.raises(InvalidOptionError, match="seed"):
        predictive_noise(members, 2, 3, -1)
    with pytest.raises(InvalidOptionError, match=r"\(m, n, K\)"):
        predictive_noise(members[0], 2, 3, 0)
    with pytest.raises(InvalidOptionError, match="sum to 1"):
        predictive_noise(members * 2 / 3, 2, 3, 0)


# ----------------------------------------------------------- reference probability files


def _accurate_predictive(rng: np.random.Generator, n: int, classes: int,
                         share: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """A float64 predictive whose arg-max is the label on ``share`` of the rows."""
    labels = rng.integers(0, classes, size=n)
    predicted = labels.copy()
    wrong = rng.random(n) >= share
    predicted[wrong] = (labels[wrong] + rng.integers(1, classes, size=wrong.sum())) % classes
    logits = rng.normal(size=(n, classes))
    logits[np.arange(n), predicted] += 6.0
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    return probabilities / probabilities.sum(axis=1, keepdims=True), labels


def _write(tmp_path, text: str | bytes, name: str = "probs.csv"):
    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def test_good_files_round_trip(tmp_path):
    rng = np.random.default_rng(6)
    predictive, labels = _accurate_predictive(rng, 120, 10)
    comma = tmp_path / "comma.csv"
    np.savetxt(comma, predictive, delimiter=",")          # the competition's probs.csv
    read = read_reference_predictive(comma, rows=120, classes=10, labels=labels)
    assert read.dtype == np.float64 and read.shape == (120, 10)
    np.testing.assert_array_equal(read, predictive)       # %.18e: 19 digits, exact
    spaced = tmp_path / "spaced.txt"
    np.savetxt(spaced, predictive)                         # savetxt's default: spaces
    np.testing.assert_array_equal(read_reference_predictive(spaced, rows=120, classes=10),
                                  predictive)
    # A float32 softmax written in full: its rows sum to 1 only within gamma(K + 1, U32).
    softmax = torch.softmax(torch.from_numpy(rng.normal(size=(200, 10)) * 3).float(), 1)
    single = tmp_path / "float32.csv"
    np.savetxt(single, softmax.numpy().astype(np.float64), delimiter=",")
    errors = np.abs(softmax.numpy().astype(np.float64).sum(1) - 1)
    assert errors.max() <= gamma(11, U32)
    np.testing.assert_array_equal(read_reference_predictive(single, rows=200, classes=10),
                                  softmax.numpy().astype(np.float64))


def test_rounded_digits_are_allowed_their_resolution(tmp_path):
    # %.4f over K = 5: each value is within 0.5e-4 of the probability, a row's sum within
    # 5 * 0.5e-4 = 2.5e-4 of 1. Here 4 x 0.20004 -> 0.2000 and 0.19984 -> 0.1998: the
    # printed row sums to 0.9998, 2e-4 off, and is accepted.
    row = [0.20004, 0.20004, 0.20004, 0.20004, 0.19984]
    rounded = tmp_path / "rounded.csv"
    np.savetxt(rounded, np.array([row, [0.1, 0.2, 0.3, 0.2, 0.2]]), fmt="%.4f", delimiter=",")
    read = read_reference_predictive(rounded, rows=2, classes=5)
    np.testing.assert_array_equal(read[0], [0.2, 0.2, 0.2, 0.2, 0.1998])
    assert abs(read[0].sum() - 1) > 1e-4
    # 0.9990 is further than the digits allow; so is 1.001 printed in full
    far = _write(tmp_path, "0.2000,0.2000,0.2000,0.2000,0.1990\n0.1,0.2,0.3,0.2,0.2\n")
    with pytest.raises(DataFormatError, match=r"probs\.csv, line 1: its values sum to 0\.999"):
        read_reference_predictive(far, rows=2, classes=5)
    full = tmp_path / "full.csv"
    np.savetxt(full, np.array([[0.5, 0.5], [0.5, 0.501]]), delimiter=",")
    with pytest.raises(DataFormatError, match=r"full\.csv, line 2: its values sum to 1\.001"):
        read_reference_predictive(full, rows=2, classes=2)
    # the tolerance is the analysis: half the resolutions plus the float32 softmax's
    tolerance = reference_module.row_sum_tolerance(np.full((1, 5), 1e-4))
    assert tolerance[0] == pytest.approx(2.5e-4 + gamma(6, U32), rel=1e-6)


def test_missing_directory_and_oversized_files_are_refused(tmp_path, monkeypatch):
    with pytest.raises(DataNotFoundError, match=r"absent\.csv: no such file"):
        read_reference_predictive(tmp_path / "absent.csv", rows=2, classes=2)
    with pytest.raises(DataFormatError, match="is a directory"):
        read_reference_predictive(tmp_path, rows=2, classes=2)
    small = _write(tmp_path, "0.5,0.5\n0.5,0.5\n")
    with pytest.raises(DataFormatError, match="larger than the 10 bytes"):
        read_reference_predictive(small, rows=2, classes=2, max_bytes=10)
    # A sparse 64 GB file is refused from its size, before a byte of it is read.
    huge = tmp_path / "huge.csv"
    huge.touch()
    os.truncate(huge, 64 * 2 ** 30)
    opened = []
    monkeypatch.setattr(reference_module, "open", lambda *a, **k: opened.append(a),
                        raising=False)
    with pytest.raises(DataFormatError, match=r"huge\.csv: is larger than the 4,352 bytes"):
        read_reference_predictive(huge, rows=2, classes=2)   # default 2 * 2 * 64 + 4096
    assert opened == []


def test_a_file_that_grows_after_its_size_was_checked_is_read_no_further(tmp_path,
                                                                        monkeypatch):
    import io

    path = _write(tmp_path, "0.5,0.5\n")
    reads = []

    class Growing(io.BytesIO):
        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

    monkeypatch.setattr(reference_module, "open",
                        lambda *a, **k: Growing(b"0.5,0.5\n" * 1000), raising=False)
    with pytest.raises(DataFormatError, match="larger than the 100 bytes"):
        read_reference_predictive(path, rows=1, classes=2, max_bytes=100)
    assert reads == [101]


@pytest.mark.parametrize(("text", "line", "match"), [
    (b"0.5,0.5\n0.5,0.5\xc3\xa9\n", 2, r"holds a byte that is not printable ASCII \(0xc3\)"),
    (b"0.5,0.5\n\x00\x01\x02\n", 2, r"holds a byte that is not printable ASCII \(0x00\)"),
    ("0.5,0.5\nnan,0.5\n", 2, "'nan' is not a plain non-negative decimal"),
    ("0.5,inf\n0.5,0.5\n", 1, "'inf' is not a plain"),
    ("0.5,0.5\n-0.1,1.1\n", 2, "'-0.1' is not a plain"),
    ("0.5,0.5\n+0.5,0.5\n", 2, r"'\+0\.5' is not a plain"),
    ("0.5,0.5\n0x1p-1,0.5\n", 2, "'0x1p-1' is not a plain"),
    ("0.5,0.5\n0.5,0.5,\n", 2, "'' is not a plain"),
    ("0.5,0.5\n.,0.5\n", 2, "'.' is not a plain"),
    ("0.5,0.5\n1_0,0.5\n", 2, "'1_0' is not a plain"),
    ("0.5," + "0" * 70 + "\n0.5,0.5\n", 1, "'000000000000000000000...' is not a plain"),
    ("0.5,0.5\n1.5,0.0\n", 2, r"1\.5 is not a probability \(above 1\)"),
    ("0.5,0.5\n1e5,0\n", 2, r"1e5 is not a probability"),
    ("0.5,0.5\n0.2,0.3,0.5\n", 2, "has 3 values where line 1 has 2 \\(ragged rows\\)"),
    ("0.5 0.5\n0.5,0.5\n", 2, "'0.5,0.5' is not a plain"),
    ("# probabilities\n0.5,0.5\n", 1, "'#' is not a plain"),
])
def test_untrusted_content_is_refused_with_its_line(tmp_path, text, line, match):
    path = _write(tmp_path, text)
    with pytest.raises(DataFormatError, match=rf"probs\.csv, line {line}: {match}"):
        read_reference_predictive(path, rows=2, classes=2)


def test_the_shape_must_be_the_splits(tmp_path):
    path = _write(tmp_path, "0.5,0.5\n\n0.25,0.75\n0.125,0.875\n")   # blank lines skipped
    np.testing.assert_array_equal(read_reference_predictive(path, rows=3, classes=2),
                                  [[0.5, 0.5], [0.25, 0.75], [0.125, 0.875]])
    with pytest.raises(DataFormatError, match="has 3 rows, but the test split it must "
                                              "cover has 450 inputs"):
        read_reference_predictive(path, rows=450, classes=2)
    with pytest.raises(DataFormatError, match="has 2 values per row, but the collection "
                                              "has 10 classes"):
        read_reference_predictive(path, rows=3, classes=10)
    empty = _write(tmp_path, "\n\n", "empty.csv")
    with pytest.raises(DataFormatError, match="holds no rows"):
        read_reference_predictive(empty, rows=3, classes=2)


def test_rows_of_another_order_are_refused_by_the_labels(tmp_path):
    rng = np.random.default_rng(7)
    predictive, labels = _accurate_predictive(rng, 300, 10)
    assert np.mean(predictive.argmax(1) == labels) >= 0.85
    path = tmp_path / "probs.csv"
    np.savetxt(path, predictive, delimiter=",")
    read_reference_predictive(path, rows=300, classes=10, labels=labels)
    np.savetxt(path, predictive[rng.permutation(300)], delimiter=",")
    with pytest.raises(DataFormatError, match=r"no better than chance \(accuracy 0\.\d+ "
                                              r"vs 1/10\): rows of another split"):
        read_reference_predictive(path, rows=300, classes=10, labels=labels)
    with pytest.raises(InvalidOptionError, match="labels must be 300 integers"):
        read_reference_predictive(path, rows=300, classes=10, labels=labels[:10])
    with pytest.raises(InvalidOptionError, match=r"labels must lie in 0\.\.9"):
        read_reference_predictive(path, rows=300, classes=10, labels=labels + 1)


# ------------------------------------------------------------ evaluate's references


def _collection(path, seeds):
    models = []
    for seed in seeds:
        torch.manual_seed(seed)
        models.append(build("optunet").eval())
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=models[0].state_dict()) as zoo:
        for model in models:
            zoo.append(model.state_dict())
    return path


def test_evaluate_scores_the_predictive_against_references(tmp_path):
    first = _collection(tmp_path / "a.h5", [0, 1, 2])
    second = _collection(tmp_path / "b.h5", [3, 4])
    plain = evaluate(first, n_images=100)
    assert plain.function_space is None and plain.payload()["function_space"] is None
    assert plain.predictive.shape == (100, 10) and plain.predictive.dtype == np.float64
    other = evaluate(second, n_images=100)
    result = evaluate(first, n_images=100,
                      references={"self": plain.predictive, "other": other.predictive})
    # the same kernels on the same images in one process: the same predictive, bit for bit
    np.testing.assert_array_equal(result.predictive, plain.predictive)
    assert result.function_space["self"] == {"agreement": 1.0, "total_variation": 0.0}
    assert result.function_space["other"] == {
        "agreement": agreement(plain.predictive, other.predictive),
        "total_variation": total_variation(plain.predictive, other.predictive)}
    assert 0 < result.function_space["other"]["total_variation"] < 1
    # the table 1 numbers do not change with references
    assert result.metrics() == plain.metrics()
    payload = result.to_dict()
    assert payload["function_space"] == result.function_space
    assert "predictive" not in payload and "predictive" not in repr(result)
    provenance = payload["provenance"]
    assert provenance["options"]["references"] == ["other", "self"]
    assert provenance["inputs"]["references"]["other"] == {
        "shape": [100, 10], "dtype": "float64",
        "sha256": hashlib.sha256(other.predictive.tobytes()).hexdigest()}
    assert plain.provenance["options"]["references"] is None
    assert "references" not in plain.provenance["inputs"]
    written = result.write(tmp_path / "out")
    assert sorted(written) == ["evaluate.json", "members.csv"]


def test_evaluate_refuses_a_reference_of_other_images(tmp_path):
    path = _collection(tmp_path / "a.h5", [0, 1])
    predictive = evaluate(path, n_images=100).predictive
    with pytest.raises(InvalidOptionError, match=r"reference predictive 'short' has shape "
                                                 r"\(60, 10\).*\(100, 10\)"):
        evaluate(path, n_images=100, references={"short": predictive[:60]})
    calls = []

    def predict(zoo, images):
        calls.append(1)
        raise AssertionError("the members must not run")

    with pytest.raises(InvalidOptionError, match=r"references\['bad'\] must lie in \[0, 1\]"):
        evaluate(path, n_images=100, references={"bad": predictive - 0.5}, predict=predict)
    assert calls == []
