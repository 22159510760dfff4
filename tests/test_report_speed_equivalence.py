"""The report's faster paths give the numbers of the slower ones.

- The numba prediction kernels (``posteriorzoo.collection._optunet_kernels``, what
  ``member_probabilities``' engine "auto" uses for OptuNets) against its torch engine:
  probabilities within float32 rounding, for several blocks of networks, other class
  counts and padding, and the torch path itself wherever the kernels do not apply.
- The noise floor, which gathers each split's distances from the target's and sums the
  target's pairs once in a table, against ``compare_arrays`` on the split's arrays: the
  same to rounding (1e-10 relative).
- A whole report with the kernels against the same report with the torch path: Table 1,
  the Table 2 detail and the noise floor the same to their printed precision.
"""

from __future__ import annotations

import csv
import functools
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from zoo_helpers import checkpoint

from analysis.report import build_report
from analysis.report.tables import table1_rows, table2_rows
from posteriorzoo.collection import _optunet_kernels as kernels
from posteriorzoo.collection.evaluation import member_probabilities
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.mmd import compare_arrays
from posteriorzoo.mmd.noise import noise_floor
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


def _images(count: int, seed: int = 0, size: int = 28) -> torch.Tensor:
    """Normalised-looking images: (count, 1, size, size), values of a few units."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 1, size, size, generator=generator) * 1.5


@pytest.mark.parametrize(("networks", "classes"), [(5, 10), (130, 10), (3, 3)])
def test_kernels_give_the_torch_paths_probabilities(tmp_path, networks, classes):
    assert 5 < kernels.B < 130   # 130 networks: a full block and a padded one
    # 3 classes: another head
    path = _random_collection(tmp_path / "zoo.h5", networks, classes)
    images = _images(37)
    with open_zoo(path) as zoo:
        assert kernels.supports(zoo.architecture, zoo.shapes, tuple(images.shape[1:]))
        ours = ours_path(zoo, images)
        theirs = torch_path(zoo, images)
    assert ours.shape == theirs.shape == (networks, 37, classes) and ours.dtype == np.float32
    assert np.abs(ours - theirs).max() < 2e-6
    assert np.abs(ours.sum(axis=2) - 1).max() < 1e-5
    # the argmax (accuracy) agrees wherever the top two are not within rounding
    top2 = np.sort(theirs, axis=2)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-5
    assert (ours.argmax(2) == theirs.argmax(2))[clear].all()


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
    assert np.abs(subset - everything[[1, 3]]).max() < 2e-6


def test_exponential_is_accurate_over_the_softmax_range():
    logits = np.linspace(-120.0, 0.0, 20001, dtype=np.float32)
    layers = {"conv1.weight": np.zeros((1, 2, 1, 4, 4), np.float32),
              "conv2.weight": np.zeros((1, 10, 1, 5, 5), np.float32),
              "fc.weight": np.zeros((1, 2, 10), np.float32),
              "fc.bias": np.zeros((1, 2), np.float32)}
    # a two-class head whose bias sets the logits: p(class 1) = 1 / (1 + exp(-gap))
    for gap in logits[::400]:
        layers["fc.bias"][0] = [0.0, gap]
        p = kernels.kernel_probabilities(layers, np.zeros((1, 1, 28, 28), np.float32))[0, 0]
        exact = np.array([1.0, np.exp(np.float64(gap))]) / (1.0 + np.exp(np.float64(gap)))
        assert np.allclose(p, exact, rtol=1e-6, atol=2e-38), gap


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
    of all the target's pairs (posteriorzoo.mmd.pair_sums), so they agree to rounding."""
    same = functools.partial(pytest.approx, rel=1e-10, abs=1e-15)
    rng = np.random.default_rng(3)
    target = {"a": rng.normal(size=(30, 4, 3)).astype(np.float32),
              "b": rng.normal(size=(30, 7)).astype(np.float32)}
    floor = noise_floor(target, symmetries="remove", held_out=6, splits=4, seed=9)
    draws = np.random.default_rng(9)
    order = draws.permutation(30)
    halves = compare_arrays({k: v[order[:15]] for k, v in target.items()},
                            {"draw": {k: v[order[15:]] for k, v in target.items()}},
                            symmetries="remove").summary("draw", "remove")
    assert floor.halves["median"] == same(halves.median)
    assert floor.halves["max"] == same(halves.max)
    for split in range(4):
        order = draws.permutation(30)
        direct = compare_arrays({k: v[order[6:]] for k, v in target.items()},
                                {"draw": {k: v[order[:6]] for k, v in target.items()}},
                                symmetries="remove")
        assert floor.splits[split] == same(direct.summary("draw", "remove").median)
        for result in direct.results:
            assert floor.layers[result.layer][split] == same(result.median)


def _printed(report) -> dict[str, object]:
    """What the report prints: Table 1 and the Table 2 detail as shown, the noise floor."""
    noise = list(csv.reader(io.StringIO(report.tables()["noise_floor.csv"])))
    return {"table1": table1_rows(report.rows), "table2": table2_rows(report.rows),
            "noise": noise}


def test_report_with_kernels_prints_what_the_torch_path_prints(tmp_path):
    target = _collection(tmp_path / "target.h5", range(40))
    methods = {"DE": _collection(tmp_path / "de.h5", range(100, 110)),
               "Wide": _collection(tmp_path / "wide.h5", range(200, 212), scale=2.0,
                                   method="swag")}
    options = {"ood_data": "mnist" if _has("mnist") else None, "splits": 4, "n_images": 300,
               "n_pairs": 5, "figures": False}
    timings: dict[str, float] = {}
    fast = build_report(target, methods, timings=timings, **options)
    slow = build_report(target, methods, predict=torch_path, **options)
    assert _printed(fast) == _printed(slow)
    for mine, theirs in zip(fast.rows, slow.rows, strict=True):
        for key in ("accuracy", "ece", "brier", "idmi", "nll"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key
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
