"""Min-mass scaling: the fast solver against cvxpy, optimality, and the function kept.

Tolerances (issue 30 section 1): float64 rounding from ``rounding_bounds`` (gamma of the
roundings, u64); the solvers' own stops: Newton's radius
(``test_canonicalize_batch.newton_radius``), Clarabel's duality gap 1e-8.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rounding_bounds import U64, forward_terms, gamma
from test_canonicalize_batch import NEWTON_TOLERANCE, newton_radius

from posteriorzoo.models import build
from posteriorzoo.symmetry import apply_symmetry, min_mass, random_symmetry, symmetry_structure

CASES = [("optunet", {}), ("optunet-v1", {}), ("mlp", {"widths": (5, 7, 6, 4, 3)}),
         ("resnet18", {"width": 4, "num_classes": 10})]


def _state(name, options, seed=0):
    torch.manual_seed(seed)
    return {k: v.double() for k, v in build(name, **options).state_dict().items()}


@pytest.mark.parametrize("name,options", CASES)
def test_fast_agrees_with_cvxpy_and_is_a_true_minimum(name, options):
    state = _state(name, options)
    fast = min_mass(name, state, "fast", **options)
    reference = min_mass(name, state, "cvxpy", **options)
    # Clarabel stops at a relative duality gap of 1e-8 (tol_gap_rel, tol_gap_abs); 1e-6
    # keeps a factor of 100 for the mass (measured at most 7.6e-14 in this project's
    # cases). A missed scale variable or a wrong pair mass changes the minimum by far more.
    assert abs(fast.mass_after - reference.mass_after) <= 1e-6 * reference.mass_after
    assert fast.mass_after <= fast.mass_before
    # perturbing any single unit's log-scale raises the mass, summed over the weights
    # themselves (not through the solver's aggregated objective)
    structure = symmetry_structure(name, state, **options)

    def mass(scales):
        moved = apply_symmetry(state, structure, scales=scales)
        return sum(float((moved[key] ** 2).sum()) for key in fast.max_abs_before)

    # The same float64 scaling applied one checkpoint at a time and by the batch path:
    # each entry's two products and the N squares summed in any order, 2 gamma(N + 8)
    # (N weight entries: 2e-12 for the ResNet, 1e-13 for OptuNet).
    entries = sum(state[key].numel() for key in fast.max_abs_before)
    assert mass(fast.scales) == pytest.approx(fast.mass_after,
                                              rel=2 * gamma(entries + 8, U64), abs=0)
    for variable, scales in fast.scales.items():
        for unit in range(scales.size):
            for factor in (np.exp(-1e-3), np.exp(1e-3)):
                moved = {**fast.scales, variable: scales.copy()}
                moved[variable][unit] *= factor
                assert mass(moved) > fast.mass_after


@pytest.mark.parametrize("name,options", CASES[:3])
def test_min_mass_keeps_the_function_and_forgets_the_scaling(name, options):
    state = _state(name, options)
    model = build(name, **options).double().eval()
    result = min_mass(name, state, **options)
    shape = (4, 1, 28, 28) if name.startswith("optunet") else (4, 5)
    x = torch.randn(*shape, dtype=torch.float64)
    model.load_state_dict(state)
    before = model(x)
    model.load_state_dict(result.state)
    # Two float64 passes whose weights agree in exact arithmetic up to the rescaling:
    # each within gamma(k) of the logits' scale (k the longest path's roundings,
    # forward_terms, plus the rescaled weights' two products), as deep_rtol in float64.
    # Measured 0.8-1.9e-16 of the largest logit (bound 6e-15 to 1.7e-14); a scale not pushed
    # into the next layer changes the logits by O(1).
    scale = float(before.detach().abs().max())
    bound = 2 * gamma(forward_terms(model, x) + 2, U64) * scale
    assert float((model(x) - before).detach().abs().max()) <= bound
    # a rescaled copy has the same minimum mass (the scaling orbit has one optimum): the
    # copy's entries are rounded once per scale product (pair masses within 4 u, so the
    # minimum within 4 u), each solver stops within its Newton radius r (the mass is flat
    # there: 2 r NEWTON_TOLERANCE), and each mass is a sum of N scaled squares,
    # 2 gamma(N + 8). Measured 0 to 1.1e-16; a copy whose minimum was not the orbit's differs by
    # its scaling's change of mass, O(1).
    moved = random_symmetry(name, state, seed=5, softmax=False, **options)
    entries = sum(state[key].numel() for key in result.max_abs_before)
    rel = (4 * U64 + 2 * gamma(entries + 8, U64)
           + 2 * newton_radius(name, result.state, options) * NEWTON_TOLERANCE)
    assert min_mass(name, moved, **options).mass_after == pytest.approx(result.mass_after,
                                                                        rel=rel, abs=0)
    assert set(result.max_abs_before) == set(result.max_abs_after)


def test_dead_unit_is_left_at_scale_one_and_reported():
    options = {"widths": (5, 7, 6, 3)}
    state = _state("mlp", options)
    state["layers.0.weight"][3] = 0.0
    result = min_mass("mlp", state, **options)
    reference = min_mass("mlp", state, "cvxpy", **options)
    assert len(result.dead_units) == 1
    variable, unit = result.dead_units[0]
    assert unit == 3 and result.scales[variable][3] == 1.0
    # Clarabel's stop, 1e-8 of the mass (see above), with a factor of 100
    assert result.mass_after == pytest.approx(reference.mass_after, rel=1e-6)
    assert all(torch.isfinite(v).all() for v in result.state.values())


def test_unit_without_outgoing_weights_is_left_at_scale_one():
    # Its incoming weights could shrink forever (the infimum is not attained): dead.
    options = {"widths": (5, 7, 6, 3)}
    state = _state("mlp", options)
    state["layers.1.weight"][:, 4] = 0.0
    result = min_mass("mlp", state, **options)
    reference = min_mass("mlp", state, "cvxpy", **options)
    assert [unit for _, unit in result.dead_units] == [4]
    variable = result.dead_units[0][0]
    assert result.scales[variable][4] == 1.0
    # Clarabel's stop, 1e-8 of the mass (see above), with a factor of 100
    assert result.mass_after == pytest.approx(reference.mass_after, rel=1e-6)


def test_bad_input_is_refused():
    from posteriorzoo.errors import InvalidOptionError, NonFiniteWeightsError, UnknownNameError

    state = _state("optunet", {})
    with pytest.raises(InvalidOptionError, match="solver"):
        min_mass("optunet", state, solver="newton")
    with pytest.raises(UnknownNameError):
        min_mass("no-such-net", state)
    state["fc.weight"][0, 0] = float("inf")
    with pytest.raises(NonFiniteWeightsError, match="fc.weight"):
        min_mass("optunet", state)
