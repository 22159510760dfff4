"""Layer-wise comparison reports: zoo files and arrays, streaming, symmetries, the CLI.

Tolerances (issue 30 section 1): a report's statistics take the target's pairs from a
table (posteriorzoo.mmd.pair_sums), so they differ from kernel_mmds' by the table's
and the sums' rounding (test_pair_sums.x_pairs_bound, for the values at hand). NS-MMD
of symmetric copies differs by what float32 storage does to their canonical forms:
:func:`canonical_difference` bounds that per weight, :func:`perturbation_bound` carries
it to the statistics. The known-answer checks run on fixed inputs (numpy's Generator
at fixed seeds, the bundled reference collections: the same bits on every CPU) and are
deterministic, with margins far above rounding; the statistics themselves may differ
in the last bits between CPUs (test_mmd_statistics).
"""

# ruff: noqa: N803, N806 -- the statistics' names: samples X, Y

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from rounding_bounds import U32, U64, gamma
from scipy.spatial.distance import cdist
from test_mmd_statistics import (
    assert_within,
    cross_distance_error,
    naive_bound,
    statistic_weights,
)
from test_pair_sums import x_pairs_bound
from zoo_helpers import assert_one_line_error, checkpoint, run

from posteriorzoo.collection import CompareResult, CompatibilityWarning, compare
from posteriorzoo.collection.comparison import parameter_keys
from posteriorzoo.errors import InvalidOptionError, SampleSizeError, ShapeMismatchError
from posteriorzoo.hashing import sha256_file
from posteriorzoo.mmd import compare_arrays, kernel_mmds, pooled_distances
from posteriorzoo.mmd.pair_sums import KernelPairSums
from posteriorzoo.mmd.sources import block_plan
from posteriorzoo.models import build
from posteriorzoo.reference import reference_path
from posteriorzoo.symmetry import random_symmetry
from posteriorzoo.zoo import create_zoo, open_zoo

OPTUNET_LAYERS = {"conv1.weight": 32, "conv2.weight": 250, "fc.weight": 100, "fc.bias": 10}


def make_zoo(path, states, architecture="optunet", num_classes=10, **options):
    with create_zoo(path, architecture=architecture, dataset="digits", method="test",
                    num_classes=num_classes, model_options=options, template=states[0]) as zoo:
        zoo.append_many(states, [{"seed": i} for i in range(len(states))])
    return path


@pytest.fixture(scope="module")
def zoos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mmd")
    target = [checkpoint(seed) for seed in range(30)]
    near = [checkpoint(seed) for seed in range(100, 112)]
    # a method whose members are symmetric copies of `near`: same functions, other weights
    moved = [random_symmetry("optunet", state, seed=7 + i) for i, state in enumerate(near)]
    return {"target": make_zoo(folder / "target.h5", target),
            "near": make_zoo(folder / "near.h5", near),
            "moved": make_zoo(folder / "moved.h5", moved), "folder": folder}


def layers_of(path):
    with open_zoo(path) as zoo:
        return {key: zoo.layer(key) for key in zoo.state_keys}


def tabled_bound(X, Y, direct, smallest=None) -> np.ndarray:
    """How far a report's statistics of X against Y may lie from ``direct`` (kernel_mmds'):
    the report's table of X's pairs is made for the smallest bandwidths of every method
    compared with X (``smallest``: L1, L2; default ``direct``'s), on the distances
    pooled_distances gives (the report's shared ones are the same bits)."""
    distances = pooled_distances(X, Y)
    if smallest is None:
        smallest = (direct.bandwidths[0], direct.bandwidths[len(direct.bandwidths) // 2])
    table = KernelPairSums(*distances.xx, *smallest)
    return x_pairs_bound(table, distances, direct)[1]


#: Per weight, in units of float32's u of the weight, how far the stored canonical forms
#: of an OptuNet checkpoint and of a random symmetric copy may lie apart. The copy
#: (random_symmetry, float32) rounds each product: conv1's rows once (times their
#: scale), conv2's three times (its scale, the reciprocal of conv1's and that product),
#: fc's twice (conv2's reciprocal scale and the product). The canonical scaling (in
#: float64) divides a row by its norm, each within the row's rounding, and multiplies
#: the next layer's readers by it: conv1 2, conv2 2 (1 + 3), fc 2 + (1 + 3). Storing
#: either form in float32 rounds once more each (2), and 1 more covers the float64
#: operations (2^-53 each) and the stored forms standing in for the exact ones.
CANONICAL_ROUNDINGS = {"conv1.weight": 5, "conv2.weight": 11, "fc.weight": 9}


def canonical_difference(key: str, canonical: np.ndarray, moved: np.ndarray) -> np.ndarray:
    """The elementwise bound ``(n, ...)`` on the stored canonical forms' difference for
    ``key`` (:data:`CANONICAL_ROUNDINGS`), from the near copy's canonical form and the
    moved copy's stored weights. fc.bias: the copy's shift rounds each bias once (u32 of
    the moved bias), the canonical mean (the same bound, over ten) once more, and
    storing the forms twice more of the canonical bias (3 with the float64 slack)."""
    if key == "fc.bias":
        largest = np.abs(moved).max(1, keepdims=True)
        return 2 * U32 * (1 + U32) * largest + gamma(3) * np.abs(canonical)
    return gamma(CANONICAL_ROUNDINGS[key]) * np.abs(canonical)


def perturbation_bound(X, Y, E, bandwidths) -> np.ndarray:
    """``(20,)``: how far the exact statistics of X against Y move when each entry of Y
    moves by at most ``E`` (X fixed).

    A distance moves by the rows' ``sum E`` (L1) or ``|E|_2`` (L2), at most ``e`` for a
    cross distance; the lowest bandwidth (half the smallest cross distance or a
    quantile, ``max(., 0.1)``) by ``e / 2``, the highest by ``2 e``, and
    ``ln b_i = (1 - t) ln b_0 + t ln b_max`` in between; an argument ``l / b`` or
    ``(l / b)**2`` by ``da`` from these; a kernel value by ``exp(-a) e^da da``. The
    distances are cdist's of the stored values (within 1e-13 of exact); the rule's
    branch (smallest distance below 0.1) must be the same for every distance within
    ``e``.
    """
    m, n = len(X), len(Y)
    Z = np.vstack([X, Y]).astype(np.float64)
    E = np.abs(E).reshape(n, -1)
    count = len(bandwidths) // 2
    t = np.arange(count) / (count - 1)
    moves = []
    for family, metric in enumerate(("cityblock", "euclidean")):
        e = np.concatenate([np.zeros(m), E.sum(1) if family == 0 else np.sqrt((E ** 2).sum(1))])
        move = e[:, None] + e[None, :]
        distance = cdist(Z, Z, metric)
        cross, largest = distance[:min(m, 500), m:m + min(n, 500)], e.max()
        assert abs(cross.min() - 0.1) > largest, "the bandwidth rule's branch within reach"
        b = bandwidths[family * count:(family + 1) * count]
        low, high = -math.log1p(-largest / (2 * b[0])), -math.log1p(-2 * largest / b[-1])
        for width, relative in zip(b, np.expm1((1 - t) * low + t * high), strict=True):
            q = 1 / (1 - relative)
            if family == 0:
                A = distance / width
                da = (move / width + A * relative) * q
            else:
                A = (distance / width) ** 2
                da = (2 * distance + move) * move / width ** 2 * q ** 2 + A * (q ** 2 - 1)
            moves.append(np.exp(-A) * np.exp(da) * da)
    weights, _ = statistic_weights(m, n)
    return (np.abs(weights) * np.stack(moves)).sum((1, 2))


# ------------------------------------------------------------------------ the numbers
def test_layer_values_and_weighted_means(zoos):
    report = compare(zoos["target"], {"near": zoos["near"]}, symmetries="keep")
    target, near = layers_of(zoos["target"]), layers_of(zoos["near"])
    assert [r.layer for r in report.results] == list(OPTUNET_LAYERS)
    for result in report.results:
        X, Y = target[result.layer], near[result.layer]
        direct = kernel_mmds(X, Y)
        # the same distances, so the same bandwidths (the same bits)
        assert np.array_equal(result.mmd.bandwidths, direct.bandwidths)
        # the target's own pairs come from a table made once for every method's
        # bandwidths (posteriorzoo.mmd.pair_sums): tabled_bound, 1.4e-17 to 2.9e-13
        # here; measured at most 1/300 of it (host and AVX2). A pair left out of the
        # table moves a statistic by 1e-4 or more.
        bound = tabled_bound(X, Y, direct)
        assert_within(result.mmd.values, direct.values, bound, result.layer)
        assert result.parameters == OPTUNET_LAYERS[result.layer]
        assert (result.mmd.m, result.mmd.n) == (30, 12)
        # a median moves by at most the largest of its values' moves
        assert result.median == pytest.approx(np.median(direct.values), rel=0,
                                              abs=float(bound.max()))
    summary = report.summary("near", "keep")
    sizes = np.array([r.parameters for r in report.results])
    for stat in ("median", "mean", "max"):
        values = np.array([getattr(r, stat) for r in report.results])
        # np.average and this: four products and a sum of four, in some order, and a
        # division, each within gamma(6) of the weighted absolute values
        absolute = (np.abs(values) * sizes).sum() / sizes.sum()
        assert getattr(summary, stat) == pytest.approx(
            (values * sizes).sum() / sizes.sum(), rel=0, abs=2 * gamma(6, U64) * absolute)
    assert summary.parameters == 392 and summary.layers == 4


def test_block_plan_covers_every_value_in_order():
    rng = np.random.default_rng(0)
    for shape in [(10, 1, 5, 5), (7,), (3, 4, 5), (2, 1, 1, 9), ()]:
        tensor = rng.normal(size=(4, *shape))
        flat = tensor.reshape(4, -1)
        for budget in (1, 2, 3, 7, 26, 1000):
            pieces = [tensor[(slice(None), *index)].reshape(4, -1)
                      for index in block_plan(shape, budget)]
            assert all(p.shape[1] <= max(budget, 1) for p in pieces) or len(pieces) == 1
            assert np.array_equal(np.concatenate(pieces, axis=1), flat)


def test_streaming_from_hdf5_equals_in_memory_exactly(zoos):
    streamed = compare(zoos["target"], [zoos["near"]], symmetries="keep",
                       block_bytes=8 * 42 * 3)       # 3 values per block
    target, near = layers_of(zoos["target"]), layers_of(zoos["near"])
    in_memory = compare_arrays(target, {"near": near})
    for a, b in zip(streamed.results, in_memory.results, strict=True):
        assert a.layer == b.layer
        assert np.array_equal(a.mmd.values, b.mmd.values)


def test_module_grouping_concatenates_weight_and_bias(zoos):
    report = compare(zoos["target"], [zoos["near"]], symmetries="keep", group="module")
    assert [(r.layer, r.parameters) for r in report.results] == [
        ("conv1", 32), ("conv2", 250), ("fc", 110)]
    target, near = layers_of(zoos["target"]), layers_of(zoos["near"])

    def joined(arrays):
        return np.concatenate([arrays["fc.weight"].reshape(len(arrays["fc.bias"]), -1),
                               arrays["fc.bias"]], axis=1)

    X, Y = joined(target), joined(near)
    direct = kernel_mmds(X, Y)
    # weight then bias, in the report's order too: the same distances and bandwidths;
    # the table's and the sums' rounding as in test_layer_values_and_weighted_means
    # (measured 1/300 of the bound)
    assert np.array_equal(report.results[-1].mmd.bandwidths, direct.bandwidths)
    assert_within(report.results[-1].mmd.values, direct.values, tabled_bound(X, Y, direct),
                  "fc")


def test_ns_mmd_removes_symmetries(zoos, tmp_path):
    report = compare(zoos["target"], {"near": zoos["near"], "moved": zoos["moved"]},
                     symmetries="both", canonical_dir=tmp_path)
    kept = {(r.method, r.layer): r.mmd.values for r in report.results if r.symmetries == "keep"}
    removed = {(r.method, r.layer): r.mmd.values for r in report.results
               if r.symmetries == "remove"}
    assert len(kept) == len(removed) == 8
    target = layers_of(tmp_path / "target-canonical.h5")
    near = layers_of(tmp_path / "near-canonical.h5")
    moved = layers_of(tmp_path / "moved-canonical.h5")
    raw = layers_of(zoos["moved"])
    differ = 0
    for layer in OPTUNET_LAYERS:
        # The canonical forms of symmetric copies agree up to float32 rounding
        # (canonical_difference), as long as no two units' sort keys lie within it.
        E = canonical_difference(layer, near[layer], raw[layer])
        if layer in ("conv1.weight", "conv2.weight"):     # each unit's sort key, its reach
            units = near[layer].shape[1]
            keys = near[layer].reshape(len(E), units, -1)[:, :, 0]
            reach = E.reshape(len(E), units, -1)[:, :, 0]
            gaps = (np.abs(keys[:, :, None] - keys[:, None, :])
                    - reach[:, :, None] - reach[:, None, :])
            assert np.all(gaps[:, ~np.eye(units, dtype=bool)] > 0), "sort keys within reach"
        X, Y, Y2, E = (a.reshape(len(a), -1).astype(np.float64)
                       for a in (target[layer], near[layer], moved[layer], E))
        # Each report statistic within tabled_bound of kernel_mmds' on the stored copies,
        # that within naive_bound (either side's) of the exact one, and the exact ones
        # apart by perturbation_bound: up to 4e-5 (conv1) to 7e-4 (fc.bias) of the
        # largest statistic here; measured 1/80 to 1/10,000 of the bound (host and AVX2).
        # A copy whose symmetry the canonical form keeps differs by 16 to 230 times the
        # largest statistic (below).
        direct, direct2 = kernel_mmds(X, Y), kernel_mmds(X, Y2)
        half = len(direct.bandwidths) // 2
        smallest = (min(direct.bandwidths[0], direct2.bandwidths[0]),
                    min(direct.bandwidths[half], direct2.bandwidths[half]))
        bound = (tabled_bound(X, Y, direct, smallest) + tabled_bound(X, Y2, direct2, smallest)
                 + naive_bound(X, Y, direct.bandwidths, cross_distance_error(X, Y))
                 + naive_bound(X, Y2, direct2.bandwidths, cross_distance_error(X, Y2))
                 + perturbation_bound(X, Y, E, direct.bandwidths))
        assert_within(removed[("moved", layer)], removed[("near", layer)], bound, layer)
        # Not a rounding tolerance: with the symmetries kept the copies look different.
        # Deterministic (fixed checkpoints and symmetries): measured 16 to 230 times the
        # largest statistic apart (all four layers).
        change = np.abs(kept[("moved", layer)] - kept[("near", layer)]).max()
        differ += bool(change > 1e-2 * np.abs(kept[("near", layer)]).max())
    assert differ >= 3
    canonical = report.provenance["canonicalizer"]
    assert canonical["permutation"] == "first" and canonical["scaling"] == "norm"
    assert canonical["softmax"] is True


def test_canonical_copies_are_kept_with_their_options(zoos, tmp_path):
    folder = tmp_path / "canonical"
    folder.mkdir()
    report = compare(zoos["target"], [zoos["near"]], symmetries="remove", scaling="std",
                     canonical_dir=folder)
    copies = sorted(p.name for p in folder.iterdir())
    assert copies == ["near-canonical.h5", "target-canonical.h5"]
    with open_zoo(folder / "near-canonical.h5") as zoo:
        assert (zoo.annotations["scaling"], zoo.annotations["permutation"]) == ("std", "first")
    assert report.provenance["canonicalizer"]["scaling"] == "std"
    assert report.to_dict()["options"]["computed"] == ["remove"]


@pytest.mark.parametrize("argument", ["workdir", "canonical_dir"])
def test_compare_refuses_a_missing_or_file_folder_before_any_work(zoos, tmp_path, argument,
                                                                  monkeypatch):
    """A folder compare writes into that does not exist (or is a file) was a bare
    FileNotFoundError once every input had been read."""
    import posteriorzoo.collection.comparison as comparison

    def no_work(*_, **__):
        raise AssertionError("the folder should have been refused before any input is read")

    monkeypatch.setattr(comparison, "open_zoo", no_work)
    digests = {name: sha256_file(zoos[name]) for name in ("target", "near")}
    missing, a_file = tmp_path / "absent", tmp_path / "notes.txt"
    a_file.write_text("mine")
    for folder, what in ((missing, "no such folder"), (a_file, "not a folder")):
        with pytest.raises(InvalidOptionError) as caught:
            compare(zoos["target"], [zoos["near"]], symmetries="remove",
                    **{argument: folder})
        assert str(caught.value) == f"{argument} {folder}: {what}"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt"]
    assert a_file.read_text() == "mine"
    assert {name: sha256_file(zoos[name]) for name in digests} == digests


def test_already_canonical_inputs_are_not_canonicalized_again(zoos, tmp_path):
    """Canonical copies compare as they are (NS-MMD only); mixing raw and canonical is an
    error, and so are canonicalizer options other than the copies'."""
    folder = tmp_path / "canonical"
    folder.mkdir()
    made = compare(zoos["target"], [zoos["near"]], symmetries="remove", canonical_dir=folder)
    target, near = folder / "target-canonical.h5", folder / "near-canonical.h5"
    again = compare(target, {"near": near})  # "both" means "remove" here
    assert {r.symmetries for r in again.results} == {"remove"}
    assert again.provenance["canonicalizer"]["inputs_already_canonical"] is True
    for a, b in zip(made.results, again.results, strict=True):
        assert np.array_equal(a.mmd.values, b.mmd.values)
    with pytest.raises(InvalidOptionError, match="raw collections"):
        compare(target, [near], symmetries="keep")
    with pytest.raises(InvalidOptionError, match="already canonical"):
        compare(zoos["target"], [near])
    with pytest.raises(InvalidOptionError, match="canonicalized with"):
        compare(target, [near], scaling="std")


def test_layouts_compare_whatever_the_model_options(zoos, tmp_path):
    """An OptuNet stored with dropout options has the same weights: it compares, and a
    dataset or recipe that differs is a warning, recorded in the provenance."""
    states = [checkpoint(seed) for seed in range(200, 205)]
    with create_zoo(tmp_path / "dropout.h5", architecture="optunet", dataset="mnist",
                    method="mc-dropout", num_classes=10, model_options={"dropout": 0.2},
                    template=states[0], recipe={"epochs": 3}) as zoo:
        zoo.append_many(states, [{"seed": i} for i in range(5)])
    with pytest.warns(CompatibilityWarning, match="trained on mnist"):
        report = compare(zoos["target"], [tmp_path / "dropout.h5"], symmetries="keep")
    assert report.summary("dropout").n == 5 and report.summary("dropout").m == 30
    assert any("mnist" in note for note in report.provenance["warnings"])
    assert "| dropout | 5 |" in report.to_markdown()


def test_parameters_only_by_default(tmp_path):
    states = [checkpoint(seed, "resnet18", num_classes=10, width=2) for seed in range(3)]
    path = make_zoo(tmp_path / "resnet.h5", states, architecture="resnet18", width=2)
    with open_zoo(path) as zoo:
        keys = parameter_keys(zoo)
        with_buffers = parameter_keys(zoo, include_buffers=True)
    assert {"conv1.weight", "bn1.weight", "bn1.bias", "fc.weight", "fc.bias"} <= set(keys)
    assert not any(k.endswith(("running_mean", "running_var", "num_batches_tracked"))
                   for k in keys)
    assert "bn1.running_mean" in with_buffers and "bn1.running_var" in with_buffers
    assert not any(k.endswith("num_batches_tracked") for k in with_buffers)
    model_parameters = sum(p.numel() for p in build("resnet18", num_classes=10,
                                                     width=2).parameters())
    with open_zoo(path) as zoo:
        assert sum(math.prod(zoo.shapes[k]) for k in keys) == model_parameters


def test_arrays_api_with_the_test(tmp_path):
    rng = np.random.default_rng(0)
    target = {"a": rng.normal(size=(40, 3, 2)), "b": rng.normal(size=(40, 5))}
    methods = {"same": {"a": rng.normal(size=(20, 3, 2)), "b": rng.normal(size=(20, 5))},
               "shifted": {"a": rng.normal(size=(20, 3, 2)) + 2, "b": rng.normal(size=(20, 5))}}
    comparison = compare_arrays(target, methods, test=True, B1=300, B2=300, B3=20, seed=3)
    # Deterministic: numpy's Generator at fixed seeds, the same bits on every CPU.
    # Measured: medians 0.17 against -0.0033; the shifted layer's smallest p-value
    # 1/301 against its threshold 0.013 (host and AVX2).
    assert comparison.summary("shifted").median > comparison.summary("same").median
    tests = {(r.method, r.layer): r.test for r in comparison.results}
    assert tests[("shifted", "a")].reject and tests[("shifted", "a")].seed == 3
    assert comparison.summary("shifted").rejected_layers >= 1
    paths = CompareResult(comparison).write(tmp_path / "out")
    data = json.loads(paths["mmd_report.json"].read_text())
    assert data["options"]["mmdagg_test"]["seed"] == 3
    assert data["layers"][0]["mmdagg"]["kernels"][0]["kernel"] == "laplace"
    only_b = compare_arrays(target, methods, layers=["b"])
    assert [r.layer for r in only_b.results] == ["b", "b"]
    with pytest.raises(ShapeMismatchError):
        compare_arrays(target, {"bad": {"a": rng.normal(size=(20, 6)), "b": target["b"][:5]}})
    with pytest.raises(SampleSizeError):
        compare_arrays(target, {"one": {k: v[:1] for k, v in target.items()}})
    with pytest.raises(InvalidOptionError):
        compare_arrays(target, {})


# ------------------------------------------------------------------------ outputs
def test_outputs_record_provenance(zoos, tmp_path):
    report = compare(zoos["target"], {"near": zoos["near"]}, symmetries="both",
                     command="posteriorzoo mmd (test)")
    report.scale = 100
    paths = report.write(tmp_path / "report")
    data = json.loads(paths["mmd_report.json"].read_text())
    provenance = data["provenance"]
    assert provenance["command"] == "posteriorzoo mmd (test)"
    assert {"posteriorzoo", "numpy", "h5py", "torch"} <= set(provenance["versions"])
    assert "git_commit" in provenance
    assert provenance["inputs"]["target"]["sha256"] == sha256_file(zoos["target"])
    assert provenance["inputs"]["method near"]["sha256"] == sha256_file(zoos["near"])
    assert provenance["seeds"]["mmdagg"] is None
    assert len(data["layers"]) == 8 and len(data["layers"][0]["mmd2"]) == 20
    assert [s["symmetries"] for s in data["summary"]] == ["keep", "remove"]
    for name, count in (("mmd_layers.csv", 8), ("mmd_summary.csv", 2)):
        text = paths[name].read_text()
        assert not any(line.startswith("#") for line in text.splitlines())  # plain tables
        rows = list(csv.DictReader(text.splitlines()))
        assert len(rows) == count
    rows = list(csv.DictReader(paths["mmd_layers.csv"].read_text().splitlines()))
    assert float(rows[0]["mmd2_laplace_1"]) == report.results[0].mmd.values[0]
    summary_rows = list(csv.DictReader(paths["mmd_summary.csv"].read_text().splitlines()))
    assert (summary_rows[0]["m"], summary_rows[0]["n"]) == ("30", "12")
    markdown = paths["mmd_report.md"].read_text()
    assert ("| Method | n | MMD median (x 100) | MMD mean (x 100) | MMD max (x 100) | "
            "NS-MMD median (x 100) | NS-MMD mean (x 100) | NS-MMD max (x 100) |") in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| near |"))
    assert f"{report.summary('near').median * 100:.4f}" in row
    assert sha256_file(zoos["near"]) in markdown


def test_reports_are_deterministic(zoos):
    def numbers(report):
        data = report.to_dict()
        return data["layers"], data["summary"]

    first = compare(zoos["target"], [zoos["near"]], symmetries="keep")
    second = compare(zoos["target"], [zoos["near"]], symmetries="keep")
    assert numbers(first) == numbers(second)


# ------------------------------------------------------------------------ the CLI


def test_cli_on_the_bundled_reference_zoo(capsys, tmp_path):
    out_dir = tmp_path / "report"
    code, out, _ = run(capsys, "mmd", reference_path("target"), f"DE={reference_path('de')}",
                       "--out", out_dir, "--no-progress", "--scale", "100")
    assert code == 0
    assert "| DE |" in out and "NS-MMD median" in out
    data = json.loads((out_dir / "mmd_report.json").read_text())
    assert data["provenance"]["command"].startswith("posteriorzoo mmd ")
    assert data["provenance"]["inputs"]["target"]["checkpoints"] == 1000
    assert data["provenance"]["inputs"]["method DE"]["checkpoints"] == 100
    assert {r["layer"] for r in data["layers"]} == set(OPTUNET_LAYERS)
    summary = {s["symmetries"]: s for s in data["summary"]}
    # independent checkpoints against the target: MMD^2 tiny (the paper's DE row is 0.0).
    # Deterministic (the bundled collections); not a rounding tolerance: measured 1.9e-4
    # (keep) and -2.5e-4 (remove), host and AVX2, where their rounding is below 1e-12.
    for treatment in ("keep", "remove"):
        assert abs(summary[treatment]["median"]) < 1e-3
    for name in ("mmd_layers.csv", "mmd_summary.csv", "mmd_report.md"):
        assert (out_dir / name).is_file()


def test_cli_bad_input(capsys, zoos, tmp_path):
    target, near = zoos["target"], zoos["near"]
    out = ["--out", tmp_path / "x", "--no-progress", "--symmetries", "keep"]
    code, _, err = run(capsys, "mmd", target, tmp_path / "absent.h5", *out)
    assert_one_line_error(code, err, "no such file")
    mlp = make_zoo(tmp_path / "mlp.h5",
                   [checkpoint(s, "mlp") for s in range(3)], architecture="mlp",
                   num_classes=1)
    code, _, err = run(capsys, "mmd", target, mlp, *out)
    assert_one_line_error(code, err, "laid out differently")
    single = make_zoo(tmp_path / "single.h5", [checkpoint(0)])
    code, _, err = run(capsys, "mmd", target, single, *out)
    assert_one_line_error(code, err, "at least 2")
    code, _, err = run(capsys, "mmd", target, near, "--layers", "nothing*", *out)
    assert_one_line_error(code, err, "no layer matches")
    code, _, err = run(capsys, "mmd", target, near, "--bandwidths", "1", *out)
    assert_one_line_error(code, err, "number_bandwidths")
    code, _, err = run(capsys, "mmd", target, near, "--test", "--alpha", "2", *out)
    assert_one_line_error(code, err, "alpha")
    nan = checkpoint(1)
    nan["conv2.weight"][0, 0, 0, 0] = float("nan")
    with create_zoo(tmp_path / "nan.h5", architecture="optunet", dataset="digits",
                    method="test", num_classes=10, template=nan) as zoo:
        zoo.append_many([checkpoint(0), nan], [{"seed": 0}, {"seed": 1, "diverged": True}])
    code, _, err = run(capsys, "mmd", target, tmp_path / "nan.h5", *out)
    assert_one_line_error(code, err, "checkpoint 1", "NaN", "conv2.weight")
    code, _, err = run(capsys, "mmd", target, "A=", *out)
    assert_one_line_error(code, err, "NAME=PATH")


def test_cli_prints_compatibility_warnings_as_one_line(capsys, zoos, tmp_path):
    states = [checkpoint(seed) for seed in range(300, 304)]
    with create_zoo(tmp_path / "other.h5", architecture="optunet", dataset="mnist",
                    method="de", num_classes=10, template=states[0]) as zoo:
        zoo.append_many(states, [{"seed": i} for i in range(4)])
    code, _, err = run(capsys, "mmd", zoos["target"], tmp_path / "other.h5", "--symmetries",
                       "keep", "--out", tmp_path / "report", "--no-progress")
    assert code == 0
    assert err.strip().splitlines() == [
        "posteriorzoo mmd: warning: other.h5 was trained on mnist, the target on digits"]
