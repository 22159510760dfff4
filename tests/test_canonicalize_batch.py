"""The vectorised paths: batches of checkpoints give the per-checkpoint answers.

Tolerances (issue 30 section 1): a batch and a single checkpoint run the same float64 code
on tensors of other shapes, whose reductions may be blocked differently on another CPU;
each result lies within the bounds below of the exact one (``rounding_bounds``), and the
min-mass optimum within the Newton solver's own stopping radius (:func:`newton_radius`).
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from rounding_bounds import U32, U64, gamma
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
from posteriorzoo.symmetry.canonical import _unit_rows
from posteriorzoo.zoo import create_zoo, open_zoo

ARCHITECTURES = [("optunet", {}), ("mlp", {"widths": (5, 7, 6, 4, 3)}),
                 ("resnet18", {"width": 4, "num_classes": 10})]


#: minmass._newton's stops: the gradient's norm below NEWTON_TOLERANCE of the mass, or a
#: step that lowers the mass by at most NEWTON_PROGRESS of it.
NEWTON_TOLERANCE = inspect.signature(minmass_module._newton).parameters["tolerance"].default
NEWTON_PROGRESS = 1e-15


def canonical_roundings(name, state, options, scaling="norm") -> int:
    """Roundings on the longest path of one float64 canonicalization (an upper bound: the
    sum over every scale variable). A variable's factor comes from its rows (k entries):
    ``norm`` sums k squares, takes a root and a reciprocal, and multiplies it into its rows
    and pushes it forward (k + 4); ``std`` also subtracts the mean (2 k + 6). An input
    whose entries carry relative error d gives a norm within d: the errors add up
    variable by variable, they do not multiply. The softmax shift adds the mean of K
    biases (K + 1). Sign flips and permutations are exact."""
    structure = symmetry_structure(name, state, **options)
    total = 0
    for index in structure.scalable():
        variable = structure.scales[index]
        rows = _unit_rows({k: v[None] for k, v in state.items()}, variable,
                          structure.spaces[variable.space].size)
        if rows is not None:
            total += 2 * rows.shape[2] + 6 if scaling == "std" else rows.shape[2] + 4
    output = structure.output_bias
    return total + (state[output].numel() + 1 if output is not None else 0)


def newton_radius(name, state, options, relative_error: float = 0.0) -> float:
    """How far (2-norm of log-scales u) the fast min-mass solver may stop from the exact
    optimum of ``state`` (float64, at or near its minimum mass M), to first order.

    At the gradient stop, |u - u*| <= |g| / lambda_min <= NEWTON_TOLERANCE M / lambda_min
    (lambda_min the Hessian's smallest eigenvalue on the live units). At the no-progress
    stop (or a stuck line search), the mass above its minimum is at most NEWTON_PROGRESS M
    plus both evaluations' rounding, 2 gamma(P + 1) M for P unit pairs, and strong
    convexity gives |u - u*| <= sqrt(2 (M - M*) / lambda_min). ``relative_error``: the pair
    masses' relative perturbation (rounding of the input), which moves the optimum by at
    most |dg| / lambda_min <= 4 relative_error M / lambda_min."""
    total, smallest, pairs = _curvature(name, state, options)
    floor = (NEWTON_PROGRESS + 4 * gamma(pairs + 1, U64)) * total
    return (max(NEWTON_TOLERANCE * total / smallest, math.sqrt(2 * floor / smallest))
            + 4 * relative_error * total / smallest)


def _curvature(name, state, options) -> tuple[float, float, int]:
    """The mass M of ``state``, its Hessian's smallest eigenvalue in the log-scales of the
    live units, and the number of unit pairs."""
    structure = symmetry_structure(name, state, **options)
    problem = minmass_module.mass_problem(structure, state)
    mass = problem.pair_mass({k: v[None] for k, v in state.items()})
    values = problem.values(mass, torch.zeros(1, problem.size, dtype=torch.float64))[0]
    n = problem.size + 1
    rows, cols, signs = minmass_module._hessian_entries(problem)
    hessian = torch.zeros(n * n, dtype=torch.float64).index_add_(
        0, rows * n + cols, values.repeat(4) * signs).reshape(n, n)[:-1, :-1]
    live = minmass_module._active(problem, mass)[0]
    smallest = float(torch.linalg.eigvalsh(hessian[live][:, live])[0])
    return float(values.sum()), smallest, len(problem.rows)


def cvxpy_radius(name, state, options) -> float:
    """How far (2-norm of u) cvxpy may stop from the optimum: Clarabel stops at a duality
    gap of 1e-8 (1 + M) (its tol_gap_abs and tol_gap_rel defaults; the status must be
    "optimal"), so the mass lies within that of its minimum, and strong convexity gives
    |u - u*| <= sqrt(2 gap / lambda_min)."""
    total, smallest, _ = _curvature(name, state, options)
    return math.sqrt(2 * CLARABEL_GAP * (1 + total) / smallest)


CLARABEL_GAP = 1e-8


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
        # Each side's scale factors are within gamma(R) of the exact ones (R the roundings
        # along the network, canonical_roundings), an entry carries its row's and its
        # column's: 2 gamma(R) per side of each tensor's largest entry, 4 gamma(R)
        # between the sides (1.6e-14 to 1.9e-12). Min-mass adds the Newton solver's stopping
        # radius on each side (newton_radius, its input perturbed by the norm step's
        # 4 gamma(R)): 2 radius per entry and side (1.5e-6 to 1.8e-5). Measured (host and
        # AVX2 settings): 0 for norm and std, 2.9e-16 for the MLP's min-mass. A batch
        # mixed up, a factor or a permutation applied to the wrong checkpoint moves
        # entries by O(1).
        roundings = canonical_roundings(name, state, options, scaling)
        rtol = 4 * gamma(roundings, U64)
        if scaling == "minmass":
            rtol += 4 * newton_radius(name, single, options, 4 * gamma(roundings, U64))
        for key in state:
            if not batch[key].is_floating_point():
                assert torch.equal(batch[key][b], single[key])
                continue
            scale = float(single[key].abs().max())
            difference = float((batch[key][b] - single[key].double()).abs().max())
            assert difference <= rtol * scale, (key, difference, rtol * scale)


def test_min_mass_batch_paths_agree(monkeypatch):
    """The batched dense Newton, the sparse Newton and cvxpy find the same minimum."""
    options = {"widths": (6, 30, 25, 4)}
    states = _states("mlp", options, 3)
    dense = [min_mass("mlp", state, **options) for state in states]
    monkeypatch.setattr(minmass_module, "DENSE_LIMIT", 0)
    sparse = [min_mass("mlp", state, **options) for state in states]
    reference = [min_mass("mlp", state, "cvxpy", **options) for state in states]
    entries = sum(states[0][key].numel() for key in a_keys(dense[0]))
    for a, b, c in zip(dense, sparse, reference, strict=True):
        # Dense and sparse Newton each stop within newton_radius r of the optimum (u); at
        # the optimum the mass is flat, so the two masses differ by at most the gradient
        # stop's first-order term 2 r NEWTON_TOLERANCE and the rounding of the scaled
        # weights (exp and two products, then squared: 8 roundings) and of the N-term sum:
        # 2 gamma(N + 8) (2.4e-13). Measured 2.6e-16. The scales exp(u) differ by at most
        # 2 r (r = 4e-6 here); measured 7.3e-11.
        radius = newton_radius("mlp", a.state, options)
        rel = 2 * gamma(entries + 8, U64) + 2 * radius * NEWTON_TOLERANCE
        assert a.mass_after == pytest.approx(b.mass_after, rel=rel, abs=0)
        # cvxpy (Clarabel) stops at a relative duality gap of 1e-8 (its tol_gap_rel and
        # tol_gap_abs defaults): the objective within 1e-8 (1 + M) of the minimum. This
        # keeps 1e-6, 100 times that; measured 7.6e-14.
        assert a.mass_after == pytest.approx(c.mass_after, rel=1e-6)
        assert a.mass_after < a.mass_before
        for variable in a.scales:
            np.testing.assert_allclose(a.scales[variable], b.scales[variable],
                                       rtol=2 * radius + 2 * gamma(2, U64), atol=0)


def a_keys(result):
    """The weight tensors that count as mass."""
    return list(result.max_abs_before)


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
    # Clarabel's stop: relative duality gap 1e-8 (see test_min_mass_batch_paths_agree);
    # 1e-6 keeps a factor of 100. Measured 1.7e-9.
    np.testing.assert_allclose(report.mass_after, reference.mass_after, rtol=1e-6)
    for index, state in enumerate(states):
        single = min_mass("optunet", {k: v.double() for k, v in state.items()})
        # The file's batches of 3 against one checkpoint, both in float64 (measured equal
        # on the host and under the AVX2 settings; the batch's reductions may still be
        # blocked otherwise). Mass before: N squares of float32 values, exact in float64,
        # summed in any order: 2 gamma(N). Mass after: as in
        # test_min_mass_batch_paths_agree, 2 gamma(N + 8) + 2 r NEWTON_TOLERANCE. Largest
        # entries: an entry carries two scales, each within r of the optimum's on either
        # side (4 r), and two products and an exp (2 gamma(4)).
        entries = sum(state[key].numel() for key in a_keys(single))
        radius = newton_radius("optunet", single.state, {})
        assert report.mass_before[index] == pytest.approx(
            single.mass_before, rel=2 * gamma(entries, U64), abs=0)
        assert report.mass_after[index] == pytest.approx(
            single.mass_after, rel=2 * gamma(entries + 8, U64) + 2 * radius * NEWTON_TOLERANCE,
            abs=0)
        for key, value in single.max_abs_after.items():
            assert report.max_abs_after[key][index] == pytest.approx(
                value, rel=4 * radius + 2 * gamma(4, U64), abs=0)
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
        # Side a: the fast solver from the stored float32 weights; side b: cvxpy from
        # float32 copies moved by random group elements (each entry rounded: at most 3 u,
        # two products and the cast). Canonicalization computes in float64: an input
        # error e per entry gives norm factors within e per scale variable, adding up
        # along the network (L of them: (2 L + 1) e per entry), pair masses within twice
        # that, moving the min-mass optimum (newton_radius's relative_error). Each side
        # stops within its solver's radius (Newton's, cvxpy_radius: 4e-4 here, which
        # dominates), an entry carries two scales (2 radius each), and both outputs are
        # stored in float32 (u each). Of each tensor's largest entry, 1.7e-3 to 1.8e-3;
        # measured 3.7e-5 to 3.9e-5 (host and AVX2 settings: margin 44). A canonical
        # form that depended on the copy (a sign, a permutation, a scale) moves entries
        # by O(1).
        for index in range(3):
            single = {key: torch.as_tensor(a.layer(key)[index]).double()
                      for key in a.state_keys}
            layers = len(symmetry_structure("optunet", single).scalable())
            moved_error = 3 * (2 * layers + 1) * U32
            radius = (newton_radius("optunet", single, {}, 2 * moved_error)
                      + cvxpy_radius("optunet", single, {}))
            rtol = 2 * U32 + moved_error + 4 * radius
            for key in a.state_keys:
                first, second = a.layer(key)[index], b.layer(key)[index]
                difference = float(np.abs(first - second).max())
                assert difference <= rtol * float(np.abs(first).max()), (key, difference, rtol)


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
        state = {k: v.double() for k, v in states[3].items()}
        single = canonicalize("optunet", state)
        # The file's float64 canonical form (a batch) and this one (one checkpoint) are
        # within 4 gamma(R) of each other (test_canonicalize_many_equals_canonicalize);
        # each is then rounded to float32 (u of each entry). Measured: equal.
        stored, expected = zoo.layer("conv2.weight")[3], single["conv2.weight"].float()
        scale = float(expected.abs().max())
        bound = 2 * U32 * scale + 4 * gamma(canonical_roundings("optunet", state, {}), U64) * scale
        assert float(np.abs(stored - expected.numpy()).max()) <= bound
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
    shifts = rng.standard_normal(copies)
    moved = apply_symmetry_batch(
        {key: value.expand(copies, *value.shape) for key, value in state.items()}, structure,
        {i: np.stack([p[i] for p in permutations]) for i in permutations[0]}, scales,
        shifts)
    # The copies are float64: each entry rounded by its two scale products (2 u), the
    # output biases also by the shift's sum (u of |b| + |shift|: gamma(2) max|shift|
    # absolute). Canonicalization carries an input error e per entry to (2 L + 1) e (L
    # scale variables, canonical_roundings' docstring) and adds 2 gamma(R) on each side;
    # min-mass adds each side's Newton radius (2 radius per entry and side), its pair
    # masses perturbed by twice the entries' error. Measured (host and AVX2 settings):
    # 1e-15 of each tensor's largest entry for norm and std (bound 1.6e-14 to 1.9e-12);
    # 9.4e-11 and 1.5e-9 for min-mass (bound 1.5e-6 to 1.8e-5), its Newton stops. A copy
    # whose canonical form kept its permutation or scales is O(1) away.
    layers = len(structure.scalable())
    copy_error = 2 * (2 * layers + 1) * U64
    shift_error = gamma(2, U64) * float(np.abs(shifts).max())
    for scaling in ("norm", "std", "minmass"):
        canonical = canonicalize_many(name, moved, scaling=scaling, **options)
        reference = canonicalize(name, state, scaling=scaling, **options)
        rtol = 4 * gamma(canonical_roundings(name, state, options, scaling), U64) + copy_error
        if scaling == "minmass":
            rtol += 4 * newton_radius(name, reference, options, 2 * rtol)
        for key, value in canonical.items():
            if value.is_floating_point():
                scale = float(reference[key].abs().max())
                difference = float((value - reference[key].double()).abs().max())
                assert difference <= rtol * scale + shift_error, (key, difference, rtol)


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


@pytest.mark.parametrize("name,options", ARCHITECTURES)
def test_batched_results_share_no_memory_with_their_inputs(name, options):
    """The passes chain without copying the tensors they leave alone
    (symmetry.transform.transformed_batch); the public results must still be new tensors,
    so that writing into them never changes the caller's checkpoints, and the inputs are
    left as they were."""
    from posteriorzoo.symmetry import canonicalize_batch

    batch = stack_states(_states(name, options, 2))
    before = {key: value.clone() for key, value in batch.items()}
    structure = symmetry_structure(name, _states(name, options, 1)[0], **options)
    canonical, _ = canonicalize_batch(batch, structure, scaling="norm")
    moved = apply_symmetry_batch(batch, structure, scales={})  # the identity element
    for result in (canonical, moved):
        for key, value in result.items():
            assert value.untyped_storage().data_ptr() != batch[key].untyped_storage().data_ptr()
    for key, value in batch.items():
        assert torch.equal(value, before[key])
