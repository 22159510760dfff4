"""The vectorised paths: batches of checkpoints give exactly the per-checkpoint answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from zoo_helpers import assert_one_line_error, run

from posteriorzoo.cli import main
from posteriorzoo.collection import canonicalize as canonicalize_file
from posteriorzoo.collection import min_mass as min_mass_file
from posteriorzoo.models import build
from posteriorzoo.symmetry import (
    apply_symmetry,
    apply_symmetry_batch,
    canonicalize,
    canonicalize_many,
    min_mass,
    random_symmetry,
    sample_permutations,
    stack_states,
    symmetry_structure,
)
from posteriorzoo.symmetry import minmass as minmass_module
from posteriorzoo.zoo import create_zoo, open_zoo

ARCHITECTURES = [("optunet", {}), ("mlp", {"widths": (5, 7, 6, 4, 3)}),
                 ("resnet18", {"width": 4, "num_classes": 10})]


def _states(name, options, count, seed=0):
    """``count`` random networks and random symmetric copies of them, float64."""
    states = []
    for index in range(count):
        torch.manual_seed(seed + index)
        model = build(name, **options).double()
        for module in model.modules():  # non-trivial BatchNorm statistics
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
        state = model.state_dict()
        states.append(state if index % 2 == 0 else
                      random_symmetry(name, state, seed=100 + index, **options))
    return states


@pytest.mark.parametrize("name,options", ARCHITECTURES)
def test_batched_group_action_equals_one_checkpoint_at_a_time(name, options):
    states = _states(name, options, 3)
    structure = symmetry_structure(name, states[0], **options)
    rngs = [np.random.default_rng(seed) for seed in range(3)]
    permutations = [sample_permutations(structure, rng) for rng in rngs]
    scales = [{i: rng.uniform(0.2, 5.0, structure.spaces[structure.scales[i].space].size)
               for i in structure.scalable()} for rng in rngs]
    batch = apply_symmetry_batch(
        stack_states(states), structure,
        {i: np.stack([p[i] for p in permutations]) for i in permutations[0]},
        {i: np.stack([s[i] for s in scales]) for i in scales[0]}, np.array([0.5, -1.0, 2.0]))
    for b, state in enumerate(states):
        single = apply_symmetry(state, structure, permutations[b], scales[b],
                                [0.5, -1.0, 2.0][b])
        for key in state:
            torch.testing.assert_close(batch[key][b], single[key], rtol=0, atol=0)


@pytest.mark.parametrize("scaling", ["norm", "std", "minmass"])
@pytest.mark.parametrize("name,options", ARCHITECTURES)
def test_canonicalize_many_equals_canonicalize(name, options, scaling):
    states = _states(name, options, 4)
    batch = canonicalize_many(name, stack_states(states), scaling=scaling, **options)
    for b, state in enumerate(states):
        single = canonicalize(name, state, scaling=scaling, **options)
        for key in state:
            torch.testing.assert_close(batch[key][b], single[key].to(batch[key].dtype),
                                       rtol=1e-12, atol=1e-12)


def test_min_mass_batch_paths_agree(monkeypatch):
    """The batched dense Newton, the sparse Newton and cvxpy find the same minimum."""
    options = {"widths": (6, 30, 25, 4)}
    states = _states("mlp", options, 3)
    dense = [min_mass("mlp", state, **options) for state in states]
    monkeypatch.setattr(minmass_module, "DENSE_LIMIT", 0)
    sparse = [min_mass("mlp", state, **options) for state in states]
    reference = [min_mass("mlp", state, "cvxpy", **options) for state in states]
    for a, b, c in zip(dense, sparse, reference, strict=True):
        assert a.mass_after == pytest.approx(b.mass_after, rel=1e-12)
        assert a.mass_after == pytest.approx(c.mass_after, rel=1e-6)
        assert a.mass_after < a.mass_before
        for variable in a.scales:
            np.testing.assert_allclose(a.scales[variable], b.scales[variable], rtol=1e-8)


def _collection(path, states, diverged=()):
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=states[0]) as zoo:
        for seed, state in enumerate(states):
            zoo.append(state, seed=seed, diverged=seed in diverged)


def test_min_mass_file_matches_each_checkpoint(tmp_path):
    states = [{k: v.float() for k, v in s.items()} for s in _states("optunet", {}, 7)]
    _collection(tmp_path / "z.h5", states)
    report = min_mass_file(tmp_path / "z.h5", checkpoints_per_batch=3)
    reference = min_mass_file(tmp_path / "z.h5", solver="cvxpy", checkpoints_per_batch=7)
    np.testing.assert_allclose(report.mass_after, reference.mass_after, rtol=1e-6)
    for index, state in enumerate(states):
        single = min_mass("optunet", {k: v.double() for k, v in state.items()})
        assert report.mass_before[index] == pytest.approx(single.mass_before, rel=1e-12)
        assert report.mass_after[index] == pytest.approx(single.mass_after, rel=1e-10)
        for key, value in single.max_abs_after.items():
            assert report.max_abs_after[key][index] == pytest.approx(value, rel=1e-8)
    assert np.all(report.mass_after < report.mass_before)


def test_minmass_collection_canonical_forms_agree_across_symmetric_copies(tmp_path, capsys):
    states = [{k: v.float() for k, v in s.items()} for s in _states("optunet", {}, 3)]
    moved = [random_symmetry("optunet", s, seed=7 + i) for i, s in enumerate(states)]
    _collection(tmp_path / "a.h5", states)
    _collection(tmp_path / "b.h5", moved)
    code = main(["canonicalize", str(tmp_path / "a.h5"), "--out", str(tmp_path / "ca.h5"),
                 "--scaling", "minmass", "--n-verify", "3", "--checkpoints-per-batch", "2",
                 "--no-progress"])
    assert code == 0 and "3 verified" in capsys.readouterr().out
    summary = canonicalize_file(tmp_path / "b.h5", tmp_path / "cb.h5",
                                      scaling="minmass", solver="cvxpy")
    assert summary.checkpoints == 3
    with open_zoo(tmp_path / "ca.h5") as a, open_zoo(tmp_path / "cb.h5") as b:
        assert a.annotations["scaling"] == "minmass" and a.annotations["solver"] == "fast"
        assert b.annotations["solver"] == "cvxpy"
        for key in a.state_keys:
            np.testing.assert_allclose(a.layer(key), b.layer(key), rtol=1e-4, atol=1e-5)


def test_diverged_checkpoints_are_copied_unchanged(tmp_path):
    states = [{k: v.float() for k, v in s.items()} for s in _states("optunet", {}, 4)]
    states[2]["conv2.weight"][0, 0, 0, 0] = float("nan")
    _collection(tmp_path / "z.h5", states, diverged={2})
    summary = canonicalize_file(tmp_path / "z.h5", tmp_path / "c.h5", n_verify=4)
    assert summary.copied_unchanged == 1 and summary.verified == [0, 1, 3]
    with open_zoo(tmp_path / "c.h5") as zoo:
        assert list(zoo.metadata["diverged"]) == [False, False, True, False]
        for key in zoo.state_keys:
            np.testing.assert_array_equal(zoo.layer(key)[2], states[2][key].numpy())
        single = canonicalize("optunet", {k: v.double() for k, v in states[3].items()})
        np.testing.assert_allclose(zoo.layer("conv2.weight")[3],
                                   single["conv2.weight"].float(), rtol=1e-6)
    report = min_mass_file(tmp_path / "z.h5")
    assert np.isnan(report.mass_after[2]) and np.isfinite(np.delete(report.mass_after, 2)).all()


def test_bad_options_fail_before_anything_is_written(tmp_path, capsys):
    _collection(tmp_path / "z.h5", [s for s in _states("optunet", {}, 2)])
    before = (tmp_path / "z.h5").read_bytes()
    for extra, fragment in ((["--checkpoints-per-batch", "0"], "--checkpoints-per-batch"),
                            (["--scaling", "magic"], "invalid choice"),
                            (["--solver", "gurobi"], "invalid choice")):
        code, _, err = run(capsys, "canonicalize", tmp_path / "z.h5", "--out", tmp_path / "c.h5",
                           "--no-progress", *extra)
        assert_one_line_error(code, err, fragment)
        assert not (tmp_path / "c.h5").exists()
    assert (tmp_path / "z.h5").read_bytes() == before


@pytest.mark.parametrize("name,options", ARCHITECTURES)
def test_many_symmetric_copies_share_one_canonical_form(name, options):
    """48 random group elements (permutations, scales in [0.01, 100], softmax shifts) at
    once: every copy has the same canonical form, for every scaling method."""
    state = _states(name, options, 1)[0]
    structure = symmetry_structure(name, state, **options)
    rng = np.random.default_rng(3)
    copies = 48
    permutations = [sample_permutations(structure, rng) for _ in range(copies)]
    scales = {i: np.exp(rng.uniform(np.log(0.01), np.log(100.0), (copies, structure.spaces[
        structure.scales[i].space].size))) for i in structure.scalable()}
    moved = apply_symmetry_batch(
        {key: value.expand(copies, *value.shape) for key, value in state.items()}, structure,
        {i: np.stack([p[i] for p in permutations]) for i in permutations[0]}, scales,
        rng.standard_normal(copies))
    for scaling in ("norm", "std", "minmass"):
        canonical = canonicalize_many(name, moved, scaling=scaling, **options)
        reference = canonicalize(name, state, scaling=scaling, **options)
        for key, value in canonical.items():
            if value.is_floating_point():
                scale = float(reference[key].abs().max())
                torch.testing.assert_close(value, reference[key].expand_as(value).double(),
                                           rtol=1e-6, atol=1e-6 * scale)


def test_cli_min_mass_report(tmp_path, capsys):
    import csv
    import json

    states = [{k: v.float() for k, v in s.items()} for s in _states("optunet", {}, 3)]
    _collection(tmp_path / "z.h5", states)
    out = tmp_path / "missing" / "report"
    # a missing folder is not created silently
    code, _, err = run(capsys, "min-mass", tmp_path / "z.h5", "--out", out, "--no-progress")
    assert_one_line_error(code, err, "does not exist")
    out = tmp_path / "report"
    assert main(["min-mass", str(tmp_path / "z.h5"), "--out", str(out), "--no-progress"]) == 0
    assert "3 of 3 checkpoints" in capsys.readouterr().out
    rows = list(csv.DictReader((out / "min_mass.csv").open()))
    report = min_mass_file(tmp_path / "z.h5")
    assert [int(r["seed"]) for r in rows] == [0, 1, 2]
    for row, before, after in zip(rows, report.mass_before, report.mass_after, strict=True):
        assert float(row["mass_before"]) == before and float(row["mass_after"]) == after
        assert float(row["max_abs_after:fc.weight"]) > 0
    data = json.loads((out / "min_mass.json").read_text())
    provenance = data["provenance"]
    assert provenance["command"].startswith("posteriorzoo min-mass")
    assert len(provenance["inputs"]["source"]["sha256"]) == 64
    assert data["summary"]["solved"] == 3
    # an existing report is never overwritten
    code, _, err = run(capsys, "min-mass", tmp_path / "z.h5", "--out", out, "--no-progress")
    assert_one_line_error(code, err, "already exists")
    table = (out / "min_mass.csv").read_bytes()
    assert data["files"]["min_mass.csv"] == __import__("hashlib").sha256(table).hexdigest()
    # unless asked for: the same run gives the same table
    assert main(["min-mass", str(tmp_path / "z.h5"), "--out", str(out), "--no-progress",
                 "--overwrite"]) == 0
    assert (out / "min_mass.csv").read_bytes() == table
    assert sorted(p.name for p in out.iterdir()) == ["min_mass.csv", "min_mass.json"]
