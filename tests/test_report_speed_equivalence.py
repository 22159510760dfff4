"""The report's faster paths give the numbers of the slower ones.

- The numba prediction kernels (``posteriorzoo.collection._optunet_kernels``, what
  ``member_probabilities``' engine "auto" uses for OptuNets) against its torch engine:
  probabilities within float32 rounding, for several blocks of networks, other class
  counts and padding, and the torch path itself wherever the kernels do not apply.
- The noise floor, which gathers each split's distances from the target's and sums the
  target's pairs once in a table, against ``compare_arrays`` on the split's arrays: the
  same to float64 rounding.
- A whole report with the kernels against the same report with the torch path: Table 1's
  metrics within the bounds the probabilities' bound gives them, the tables printed the
  same wherever a value is not within its bound of a rounding boundary of its printed
  digits (where it is, another CPU may print the neighbouring digit).

Tolerances come from error analyses that hold on any x86-64 CPU (``tests/rounding_bounds.py``:
Higham's ``gamma(k) = k u / (1 - k u)``, ``u = 2^-24`` in float32, ``2^-53`` in float64),
with the margins measured stated where they are used. The kernels sum in another order
than torch and fuse multiply-adds where the CPU has FMA, so their bits differ between
instruction sets as torch's do; both stay within the bounds.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from rounding_bounds import (
    U32,
    U64,
    gamma,
    noise_floor_bound,
    optunet_forward_bounds,
    softmax_bounds,
    softmax_sum_bound,
)
from zoo_helpers import checkpoint

from analysis.report import build_report
from analysis.report.tables import shown, table1_rows, table2_rows
from posteriorzoo.collection import _optunet_kernels as kernels
from posteriorzoo.collection.evaluation import member_probabilities
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.mmd import compare_arrays
from posteriorzoo.mmd.noise import noise_floor
from posteriorzoo.models import build
from posteriorzoo.zoo import create_zoo, open_zoo


def _collection(path: Path, seeds: range, *, scale: float = 1.0, num_classes: int = 10,
                architecture: str = "optunet", method: str = "de") -> Path:
    """Freshly initialised networks (seed by seed), their weights times ``scale``."""
    states = [{key: value * scale for key, value in
               checkpoint(seed, architecture, num_classes=num_classes).items()}
              for seed in seeds]
    return _write(path, states, architecture, method, num_classes)


def _random_collection(path: Path, count: int, num_classes: int) -> Path:
    """``count`` OptuNets with random weights of an initialisation's size (quicker than
    initialising each network)."""
    rng = np.random.default_rng(count)
    template = checkpoint(0, num_classes=num_classes)
    states = [{key: torch.from_numpy(rng.normal(scale=0.4, size=value.shape).astype(np.float32))
               for key, value in template.items()} for _ in range(count)]
    return _write(path, states, "optunet", "de", num_classes)


def _write(path: Path, states: list, architecture: str, method: str, num_classes: int) -> Path:
    with create_zoo(path, architecture=architecture, dataset="digits", method=method,
                    num_classes=num_classes, template=states[0]) as zoo:
        zoo.append_many(states)
    return path


def ours_path(zoo, images: torch.Tensor) -> np.ndarray:
    return member_probabilities(zoo, images)            # engine "auto"


def torch_path(zoo, images: torch.Tensor) -> np.ndarray:
    return member_probabilities(zoo, images, engine="torch")


def _probability_bounds(zoo, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray,
                                                             np.ndarray]:
    """Per checkpoint of an open OptuNet collection, on ``images``: the bound on
    ``|p_kernels - p_torch|`` (``softmax_bounds`` of the forward pass's worst-case
    bound), the bound on one side's probabilities' distance of their sum from 1
    (``softmax_sum_bound``), and the exact probabilities; ``(N, n, K)``, ``(N, n)``,
    ``(N, n, K)``."""
    classes = zoo.shapes["fc.bias"][0]
    model = build("optunet", num_classes=classes)
    bound, total, exact = [], [], []
    for index in range(len(zoo)):
        model.load_state_dict({key: torch.as_tensor(np.asarray(value))
                               for key, value in zoo.arrays(index).items()})
        bounds = optunet_forward_bounds(model.eval(), images)
        bound.append(softmax_bounds(bounds).numpy())
        total.append(softmax_sum_bound(bounds).numpy())
        exact.append(torch.softmax(bounds.logits, 1).numpy())
    return np.stack(bound), np.stack(total), np.stack(exact)


def _images(count: int, seed: int = 0, size: int = 28) -> torch.Tensor:
    """Normalised-looking images: (count, 1, size, size), values of a few units."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 1, size, size, generator=generator) * 1.5


@pytest.mark.parametrize(("networks", "classes"), [(5, 10), (130, 10), (3, 3)])
def test_kernels_give_the_torch_paths_probabilities(tmp_path, networks, classes):
    """Every probability within ``softmax_bounds`` of torch's (measured: at most 0.3% of
    the bound, AVX-512 and AVX2; the kernels' head weights times 1 + 1e-3 exceed it);
    every network's outputs sum to 1 within ``softmax_sum_bound`` and the float32 sum's
    ``gamma(K - 1)``; the arg-max agrees wherever the top two are farther apart than
    their bounds."""
    assert 5 < kernels.B < 130   # 130 networks: a full block and a padded one
    # 3 classes: another head
    path = _random_collection(tmp_path / "zoo.h5", networks, classes)
    images = _images(37)
    with open_zoo(path) as zoo:
        assert kernels.supports(zoo.architecture, zoo.shapes, tuple(images.shape[1:]))
        ours = ours_path(zoo, images)
        theirs = torch_path(zoo, images)
        bound, total, _ = _probability_bounds(zoo, images)
    assert ours.shape == theirs.shape == (networks, 37, classes) and ours.dtype == np.float32
    difference = np.abs(ours.astype(np.float64) - theirs)
    print(f"largest ratio to the bound: {(difference / bound).max():.2e}")
    assert (difference <= bound).all()
    for side in (ours, theirs):
        assert (np.abs(side.sum(axis=2, dtype=np.float32) - 1.0)
                <= total * (1 + gamma(classes - 1)) + gamma(classes - 1)).all()
    # the argmax (accuracy) agrees wherever the top two are farther apart than their bounds
    order = np.argsort(theirs, axis=2)[..., -2:]
    top2 = np.take_along_axis(theirs, order, axis=2)
    clear = top2[..., 1] - top2[..., 0] > np.take_along_axis(bound, order, axis=2).sum(2)
    assert (ours.argmax(2) == theirs.argmax(2))[clear].all()
    assert clear.mean() > 0.99


def test_the_engine_option_is_checked_and_a_subset_goes_to_the_torch_path(tmp_path):
    path = _random_collection(tmp_path / "zoo.h5", 4, 10)
    images = _images(6)
    with open_zoo(path) as zoo:
        with pytest.raises(InvalidOptionError, match="engine"):
            member_probabilities(zoo, images, engine="fast")
        everything = ours_path(zoo, images)
        subset = member_probabilities(zoo, images, indices=[1, 3])
        assert np.array_equal(subset, torch_path(zoo, images)[[1, 3]])
        assert not np.array_equal(everything, torch_path(zoo, images))   # the kernels ran
        bound = _probability_bounds(zoo, images)[0]
    assert (np.abs(subset.astype(np.float64) - everything[[1, 3]]) <= bound[[1, 3]]).all()


def test_exponential_is_accurate_over_the_softmax_range():
    """A two-class head whose bias sets the logits exactly: ``p_1 = e / (1 + e)`` with
    ``e = exp(gap)`` within 2 ulp (4 u) of exact, ``1 + e`` one rounding plus ``e``'s
    error, the division one: 10 u for ``p_1`` (6 u for ``p_0``). Below the kernels' floor
    ``exp(-87)`` (~1.6e-38, where the metrics' 1e-12 clip makes any value the same) the
    floor itself. Measured: at most 1.2 u (AVX-512 and AVX2); the kernels' probabilities
    times 1 + 1e-3 fail."""
    logits = np.linspace(-120.0, 0.0, 20001, dtype=np.float32)
    layers = {"conv1.weight": np.zeros((1, 2, 1, 4, 4), np.float32),
              "conv2.weight": np.zeros((1, 10, 1, 5, 5), np.float32),
              "fc.weight": np.zeros((1, 2, 10), np.float32),
              "fc.bias": np.zeros((1, 2), np.float32)}
    floor = math.exp(float(kernels._EXP_LOW)) * (1 + gamma(10))
    worst = 0.0
    # a two-class head whose bias sets the logits: p(class 1) = 1 / (1 + exp(-gap))
    for gap in logits[::400]:
        layers["fc.bias"][0] = [0.0, gap]
        p = kernels.kernel_probabilities(layers, np.zeros((1, 1, 28, 28), np.float32))[0, 0]
        exact = np.array([1.0, np.exp(np.float64(gap))]) / (1.0 + np.exp(np.float64(gap)))
        assert np.allclose(p, exact, rtol=gamma(10), atol=floor), gap
        if gap > kernels._EXP_LOW:
            worst = max(worst, float((np.abs(p - exact) / exact).max()) / U32)
    print(f"largest relative error: {worst:.2f} u")


def test_what_the_kernels_do_not_cover_goes_to_the_torch_path(tmp_path):
    images = _images(11, seed=1)
    other = _collection(tmp_path / "v1.h5", range(3), architecture="optunet-v1")
    with open_zoo(other) as zoo:
        assert not kernels.supports(zoo.architecture, zoo.shapes, tuple(images.shape[1:]))
        assert np.array_equal(ours_path(zoo, images),
                              torch_path(zoo, images))
    path = _collection(tmp_path / "zoo.h5", range(3))
    larger = _images(4, size=32)          # OptuNet takes them; the kernels are for 28x28
    with open_zoo(path) as zoo:
        assert np.array_equal(ours_path(zoo, larger),
                              torch_path(zoo, larger))
    # weights so large that the logits overflow: the torch path's outputs, NaN included
    huge = _collection(tmp_path / "huge.h5", range(2), scale=1e15)
    with open_zoo(huge) as zoo:
        ours, theirs = ours_path(zoo, images), torch_path(zoo, images)
    assert not np.isfinite(theirs).all()
    assert np.array_equal(ours, theirs, equal_nan=True)


def test_a_diverged_checkpoint_fails_as_on_the_torch_path(tmp_path):
    state = checkpoint(0)
    broken = {key: value.clone() for key, value in checkpoint(1).items()}
    broken["conv2.weight"][0, 0, 0, 0] = float("nan")
    path = tmp_path / "diverged.h5"
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=state) as zoo:
        zoo.append(state)
        zoo.append(broken, diverged=True)
    images = _images(5)
    with open_zoo(path) as zoo:
        ours, theirs = ours_path(zoo, images), torch_path(zoo, images)
    assert np.isnan(ours[1]).all() and np.array_equal(ours, theirs, equal_nan=True)


def test_noise_floor_splits_are_compare_arrays():
    """Each split is scored as compare_arrays scores it; its X-X sums come from one table
    of all the target's pairs (posteriorzoo.mmd.pair_sums), so they agree to rounding:
    within :func:`noise_floor_bound` (2.4e-12 for the halves, 9.0e-13 for the splits;
    measured at most 2.0e-16, AVX-512 and AVX2). One X-X sum off by 1e-9 of itself
    exceeds it."""
    rng = np.random.default_rng(3)
    target = {"a": rng.normal(size=(30, 4, 3)).astype(np.float32),
              "b": rng.normal(size=(30, 7)).astype(np.float32)}
    floor = noise_floor(target, symmetries="remove", held_out=6, splits=4, seed=9)
    draws = np.random.default_rng(9)
    order = draws.permutation(30)
    halves = compare_arrays({k: v[order[:15]] for k, v in target.items()},
                            {"draw": {k: v[order[15:]] for k, v in target.items()}},
                            symmetries="remove").summary("draw", "remove")
    bound, worst = noise_floor_bound(15, 15), 0.0
    for got, expected in ((floor.halves["median"], halves.median),
                          (floor.halves["max"], halves.max)):
        assert abs(got - expected) <= bound
        worst = max(worst, abs(got - expected))
    bound = noise_floor_bound(24, 6)
    for split in range(4):
        order = draws.permutation(30)
        direct = compare_arrays({k: v[order[6:]] for k, v in target.items()},
                                {"draw": {k: v[order[:6]] for k, v in target.items()}},
                                symmetries="remove")
        expected = direct.summary("draw", "remove").median
        assert abs(floor.splits[split] - expected) <= bound
        worst = max(worst, abs(floor.splits[split] - expected))
        for result in direct.results:
            assert abs(floor.layers[result.layer][split] - result.median) <= bound
            worst = max(worst, abs(floor.layers[result.layer][split] - result.median))
    print(f"largest difference: {worst:.2e}")


#: Table 1's columns computed from the members' predictions (the others: from weights).
PREDICTED = ("accuracy", "ece", "brier", "aupr", "fpr95", "idmi", "oodmi")


def _entropy_change(p: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """A bound on ``|phi(p) - phi(q)|``, ``phi(x) = -x log x``, for ``|p - q| <= delta``:
    the mean value theorem, ``|phi'(x)| = |1 + log x|``, where the interval stays above
    ``delta``; else both lie in ``[0, 3 delta]``, where ``phi`` rises (for
    ``3 delta < 1/e``) to at most ``3 delta (1 + |log delta|)``."""
    tiny = np.finfo(np.float64).tiny
    above = p - delta > delta
    far = delta * (1 + np.abs(np.log(np.maximum(p - delta, tiny))))
    near = 3 * delta * (1 + np.abs(np.log(np.maximum(delta, tiny))))
    return np.where(above, far, near)


def _metric_bounds(members: np.ndarray, bound: np.ndarray, bins: int = 15
                   ) -> dict[str, float]:
    """How far Table 1's metrics of ``members`` ``(M, n, K)`` (one path's probabilities)
    may be from the other path's, whose probabilities lie within ``bound`` of them
    elementwise; label-free (the worst label), the metrics' float64 arithmetic included
    (``gamma(M n K)`` in u64 of their scale, at most 28.6).

    The predictive ``P`` (the members' mean) moves by at most ``D``, the mean of the
    bounds. Accuracy: the examples whose two largest ``P`` lie within their ``D`` (only
    they may change their arg-max). NLL (clipped at 1e-12): ``|log a - log b| <= |a - b|
    / min(a, b)``. Brier: ``sum_k D (2 max(P, 1 - P) + D)``. ECE: the confidence moves by
    ``max_k D``; an example within that of a bin edge may change bins (``2 / n`` each), an
    arg-max flip changes one bin's accuracy (``1 / n``). IDMI: each entropy term by
    :func:`_entropy_change`, in the predictive and in every member."""
    count, n, classes = members.shape
    members = members.astype(np.float64)
    predictive, moved = members.mean(0), bound.mean(0)
    order = np.argsort(predictive, axis=1)[:, -2:]
    top2 = np.take_along_axis(predictive, order, axis=1)
    flips = int((top2[:, 1] - top2[:, 0] <= np.take_along_axis(moved, order, 1).sum(1)).sum())
    confidence, shift = predictive.max(1), moved.max(1)
    edges = np.arange(1, bins) / bins
    switches = int((np.abs(confidence[:, None] - edges[None, :]) <= shift[:, None]).any(1).sum())
    low = np.maximum(predictive - moved, 1e-12)
    arithmetic = gamma(count * n * classes, U64) * 28.6
    return {
        "accuracy": flips / n + arithmetic,
        "nll": float(np.minimum(moved / low, math.log(1e12)).max(1).mean()) + arithmetic,
        "brier": float((moved * (2 * np.maximum(predictive, 1 - predictive) + moved)
                        ).sum(1).mean()) + arithmetic,
        "ece": float((shift.sum() + 2 * switches + flips) / n) + arithmetic,
        "idmi": float(_entropy_change(predictive, moved).sum(1).mean()
                      + _entropy_change(members, bound).sum(2).mean()) + arithmetic,
    }


def _printed(report) -> dict[str, object]:
    """What the report prints: Table 1 and the Table 2 detail as shown, the noise floor."""
    noise = list(csv.reader(io.StringIO(report.tables()["noise_floor.csv"])))
    return {"table1": table1_rows(report.rows), "table2": table2_rows(report.rows),
            "noise": noise}


def test_report_with_kernels_prints_what_the_torch_path_prints(tmp_path):
    """The same report twice, the members' predictions by the kernels and by torch.
    What comes from the weights alone (the MMD columns, Table 2, the noise floor) is the
    same code on the same numbers: printed the same. Every member probability within
    ``softmax_bounds``, and each of Table 1's metrics within :func:`_metric_bounds` of
    them (measured: at most 1.6e-6 of the bound, AVX-512 and AVX2). A metric is printed
    the same wherever its bound does not reach a rounding boundary of its two printed
    decimals; where it does, another CPU may legitimately print the neighbouring digit.
    Here the worst-case bounds (10^3 to 10^4 times the probabilities' observed
    differences, on untrained near-uniform networks) reach one in all eight predicted
    cells, so their printed equality (measured, AVX-512 and AVX2) is not promised."""
    target = _collection(tmp_path / "target.h5", range(40))
    methods = {"DE": _collection(tmp_path / "de.h5", range(100, 110)),
               "Wide": _collection(tmp_path / "wide.h5", range(200, 212), scale=2.0,
                                   method="swag")}
    options = {"ood_data": "mnist" if _has("mnist") else None, "splits": 4, "n_images": 300,
               "n_pairs": 5, "figures": False}
    seen: dict[str, list] = {"fast": [], "slow": []}

    def recorded(name, function):
        def predict(zoo, images):
            out = function(zoo, images)
            seen[name].append((images.clone(), out, _probability_bounds(zoo, images)[0]
                               if name == "slow" else None))
            return out
        return predict

    timings: dict[str, float] = {}
    fast = build_report(target, methods, timings=timings, predict=recorded("fast", ours_path),
                        **options)
    slow = build_report(target, methods, predict=recorded("slow", torch_path), **options)
    printed_fast, printed_slow = _printed(fast), _printed(slow)
    assert printed_fast["table2"] == printed_slow["table2"]
    assert printed_fast["noise"] == printed_slow["noise"]
    if options["ood_data"] is None:   # the ID images: the target's (the agreement and
        # TV reference), then each method's
        assert len(seen["slow"]) == len(seen["fast"]) == len(methods) + 1
    ratios, straddling = [], 0
    for index, (mine, theirs) in enumerate(zip(fast.rows, slow.rows, strict=True)):
        images, ours, _ = seen["fast"][index + 1]
        same_images, reference, bound = seen["slow"][index + 1]
        assert torch.equal(images, same_images)
        assert (np.abs(ours.astype(np.float64) - reference) <= bound).all()
        limits = _metric_bounds(reference, bound)
        for key, limit in limits.items():
            assert abs(mine[key] - theirs[key]) <= limit, (key, mine[key], theirs[key], limit)
            ratios.append(abs(mine[key] - theirs[key]) / limit)
        row_fast, row_slow = printed_fast["table1"][index], printed_slow["table1"][index]
        assert row_fast[:5] == row_slow[:5]            # name, group, n, MMD, NS-MMD
        for column, key in enumerate(PREDICTED, start=5):
            if key not in limits:                      # OOD metrics: no OOD data here
                assert theirs[key] is None and row_fast[column] == row_slow[column] == "-"
                continue
            low = shown(theirs[key] - limits[key], 100.0)
            if low == shown(theirs[key] + limits[key], 100.0):
                assert row_fast[column] == row_slow[column] == low, key
            else:
                straddling += 1
    print(f"largest ratio to the bounds: {max(ratios):.2e}; cells within their bound of "
          f"a printing boundary: {straddling}")
    assert set(timings) >= {"load", "canonicalize", "mmd", "noise floor", "predictions",
                            "metrics", "diagnostics"}
    assert all(seconds >= 0 for seconds in timings.values())


def _has(name: str) -> bool:
    from posteriorzoo.data import load_dataset
    from posteriorzoo.errors import PosteriorZooError

    try:
        load_dataset(name, "test", download=False)
    except PosteriorZooError:
        return False
    return True


def test_member_metrics_are_the_per_member_functions_bit_for_bit():
    from posteriorzoo.metrics import accuracy, negative_log_likelihood
    from posteriorzoo.metrics.information import member_scores

    rng = np.random.default_rng(1)
    labels = rng.integers(0, 10, 503)
    for dtype in (np.float32, np.float64):
        members = rng.dirichlet(np.ones(10) * 0.2, size=(7, 503)).astype(dtype)
        members[0, :5] = 0.0
        members[0, :5, 3] = 1.0              # certain, and a zero probability of the label
        right, nll = member_scores(members, labels)
        assert np.array_equal(right, [accuracy(p, labels) for p in members])
        assert np.array_equal(nll, [negative_log_likelihood(p, labels) for p in members])
