"""The report streams the target from its file (issue 31 §2): its noise floor, marginals
and PCA curves read blocks of a collection, never its whole weights, and give what the
in-memory computations give; ``predictions=False`` (``--no-predictions``) is a
weights-only report that reads no data set.

Tolerances: the streamed noise floor and marginals read the same values through the same
kernels in the same blocks, so they are equal bit for bit. The PCA curve from distances
is checked with exact (float64) distances against the SVD of the centred weights, within
the float64 error analysis stated in the test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from rounding_bounds import U64, gamma
from zoo_helpers import checkpoint, run

from analysis.figures.statistics import pca_explained_variance, unit_marginals
from analysis.report import build_report
from analysis.report.figures import _explained_variance, _unit_weights
from posteriorzoo.collection.comparison import ZooSource, parameter_keys
from posteriorzoo.mmd.noise import noise_floor
from posteriorzoo.zoo import Zoo, create_zoo, open_zoo


def _collection(path: Path, seeds: range, method: str = "de") -> Path:
    states = [checkpoint(seed) for seed in seeds]
    with create_zoo(path, architecture="optunet", dataset="digits", method=method,
                    num_classes=10, template=states[0]) as zoo:
        for state in states:
            zoo.append(state)
    return path


@pytest.fixture(scope="module")
def collections(tmp_path_factory):
    folder = tmp_path_factory.mktemp("streaming")
    return {"target": _collection(folder / "target.h5", range(24)),
            "de": _collection(folder / "de.h5", range(100, 106))}


def test_the_streamed_noise_floor_is_the_in_memory_one(collections):
    with open_zoo(collections["target"], verify=True) as zoo:
        keys = parameter_keys(zoo)
        arrays = {key: zoo.layer(key) for key in keys}
        streamed = noise_floor(ZooSource("target", zoo, keys=keys), symmetries="keep",
                               held_out=6, splits=3, seed=4, block_bytes=4096)
    held = noise_floor(arrays, symmetries="keep", held_out=6, splits=3, seed=4,
                       block_bytes=4096)
    assert np.array_equal(streamed.splits, held.splits)
    assert streamed.halves == held.halves
    assert streamed.layers.keys() == held.layers.keys()


def test_the_marginals_hyperslab_is_what_unit_marginals_reads(collections):
    from analysis.figures.sources import unit_layout

    with open_zoo(collections["target"]) as zoo:
        layout = unit_layout(zoo)
        keys = parameter_keys(zoo)
        axes = {key: layout[key][0] for key in keys}
        shown = _unit_weights(ZooSource("target", zoo, keys=keys), axes, 4)
        for key in keys:
            whole = zoo.layer(key)
            assert shown[key].size <= 4 * len(zoo)    # a few values per checkpoint
            assert np.array_equal(unit_marginals(shown[key], axes[key], 4),
                                  unit_marginals(whole, axes[key], 4))


def test_the_pca_curve_from_distances_is_the_svds(collections, monkeypatch):
    """With exact float64 distances. Error analysis: each squared distance is a sum of
    D squares of differences, within gamma(D + 1, u64) of itself; double centring
    (-H S H / 2: three means and two sums per entry) and eigvalsh (backward stable, about
    N u64 ||K||) add gamma(4N) relative to ||S||_F; the SVD of the centred weights is
    within gamma(D + N) ||W||^2 the same way. Each cumulative ratio moves by at most
    2 k |d lambda| / total, k <= N."""
    import posteriorzoo.mmd as mmd

    exact = mmd.self_distances
    monkeypatch.setattr(mmd, "self_distances",
                        lambda *a, **k: exact(*a, **{**k, "precision": "exact"}))
    monkeypatch.setenv("POSTERIORZOO_DISTANCE_CACHE", "off")
    with open_zoo(collections["target"]) as zoo:
        keys = parameter_keys(zoo)
        flat = np.concatenate([zoo.layer(key).reshape(len(zoo), -1).astype(np.float64)
                               for key in keys], axis=1)
        curve = _explained_variance(ZooSource("target", zoo, keys=keys))
    reference = pca_explained_variance(flat)
    count, features = flat.shape
    centred = flat - flat.mean(axis=0)
    squared = ((centred[:, None, :] - centred[None, :, :]) ** 2).sum(axis=2)
    total = (centred ** 2).sum()
    error = (gamma(features + 1 + 4 * count, U64) * np.linalg.norm(squared)
             + gamma(features + count, U64) * total)
    assert curve.shape == reference.shape
    assert np.max(np.abs(curve - reference)) <= 2 * count * error / total
    assert np.all(np.diff(curve) >= -2 * count * error / total)


def test_a_weights_only_report_reads_no_dataset_and_no_whole_layer(collections,
                                                                   monkeypatch, tmp_path,
                                                                   capsys):
    """predictions=False: the MMD columns are the full report's, the predictive ones
    empty; no data set is read, and no collection's layer is read whole (Zoo.layer is
    what held the 45 GB target in memory)."""
    import posteriorzoo.collection.evaluation as evaluation

    full = build_report(collections["target"], [collections["de"]], figures=False,
                        splits=2, n_images=40)

    def refuse(*_, **__):
        raise AssertionError("read in a weights-only report")

    monkeypatch.setattr(evaluation, "load_dataset", refuse)
    monkeypatch.setattr(Zoo, "layer", refuse)
    weights = build_report(collections["target"], [collections["de"]], splits=2,
                           predictions=False)
    (row,), (full_row,) = weights.rows, full.rows
    assert row["mmd"] == full_row["mmd"] and row["ns_mmd"] == full_row["ns_mmd"]
    assert "accuracy" not in row and full_row["accuracy"] is not None
    assert "collapse" not in weights.figures and {"pca", "marginals", "mmd"} <= set(
        weights.figures)
    assert weights.provenance["options"]["predictions"] is False
    code, _, err = run(capsys, "report", collections["target"], collections["de"],
                       "--no-predictions", "--splits", "2", "--no-figures",
                       "--out", tmp_path / "weights", "--no-progress")
    assert code == 0, err
    page = (tmp_path / "weights" / "report.md").read_text()
    assert "weights-only report" in page


def test_a_device_this_torch_lacks_is_refused_before_any_work(collections, tmp_path,
                                                               capsys):
    """--device cuda without a CUDA torch: one line, exit 2, no output folder; the API's
    evaluate says the same."""
    from posteriorzoo.collection import evaluate
    from posteriorzoo.errors import InvalidOptionError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, err = run(capsys, "report", collections["target"], collections["de"],
                       "--device", "cuda", "--out", tmp_path / "r", "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "sees no CUDA GPU" in err
    assert not (tmp_path / "r").exists()
    with pytest.raises(InvalidOptionError, match="sees no CUDA GPU"):
        evaluate(collections["de"], dataset="digits", n_images=10, device="cuda:0")
