"""SGLD (``train_zoo.methods.sgld``): SGHMC's chain at friction 1.

- Oracle: the `posteriors` library's ``sgmcmc.sgld`` (temperature 1) gives the same
  trajectory from the same start, gradients and normal draws.
- Known answer: on a Gaussian target with full-data gradients the chain is an AR(1)
  process per coordinate, ``x' = (1 - lr a) x + sqrt(2 lr) z``, whose stationary variance
  is ``1 / (a (1 - lr a / 2))`` exactly (the discretisation's, which tends to the
  posterior's ``1 / a`` as ``lr -> 0``); mean and variance are held to it within Monte
  Carlo error.
- The method object: its options are SGHMC's less the friction, and a digits mode trains
  chains recorded as SGLD's.

Tolerances: the oracle and the chain compute ``theta + lr g + s z`` with the same
float64 values; ``s`` is ``sqrt(2 (1 - beta_hat) lr)`` here and
``sqrt(lr (2 - lr beta))`` there (a few ulps apart), so each step differs by a few
roundings of the largest term, 8 u |theta| at most, and the differences are carried on
by ``(1 - lr a) <= 1``: after ``k`` steps at most ``8 k u`` of the largest |theta|.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from rounding_bounds import U64

from posteriorzoo.errors import UnknownNameError
from train_zoo.methods import sghmc, sgld

SCALE = torch.tensor([1.0, 4.0, 0.25], dtype=torch.float64)   # precisions a
MEAN = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)


def _log_posterior(params, batch):
    return -0.5 * (SCALE * (params["w"] - MEAN) ** 2).sum(), torch.tensor([])


def _gradient(theta: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"w": -SCALE * (theta - MEAN)}


def test_the_trajectory_is_the_posteriors_librarys():
    """200 steps of posteriors' SGLD (its gradient by autograd, its normals from torch's
    global generator) against our chain's (the gradient in closed form, the same normals
    from a generator with the same seed), with a noise estimate beta."""
    sgld_lib = pytest.importorskip("posteriors.sgmcmc.sgld")
    lr, beta_p, steps = 0.05, 1.5, 200
    start = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    torch.manual_seed(3)
    theirs = sgld_lib.init({"w": start.clone()})
    generator = torch.Generator().manual_seed(3)
    ours = sghmc.init({"w": start.clone()})
    beta = {"w": torch.full((3,), lr * beta_p / 2, dtype=torch.float64)}
    largest = 0.0
    for step in range(1, steps + 1):
        theirs, _ = sgld_lib.update(theirs, None, _log_posterior, lr=lr, beta=beta_p)
        ours = sghmc.update(ours, _gradient(ours.params["w"]), lr,
                            sgld.METHOD.sampling_friction, generator, beta)
        largest = max(largest, float(theirs.params["w"].abs().max()))
        bound = 8 * step * U64 * largest
        assert torch.allclose(ours.params["w"], theirs.params["w"], rtol=0, atol=bound), step
    assert float((ours.params["w"] - start).abs().max()) > 0.1   # it moved


@pytest.mark.parametrize("lr", [0.05, 0.2])
def test_the_stationary_moments_are_the_discretised_chains(lr):
    """Mean ``MEAN`` and variance ``1 / (a (1 - lr a / 2))`` per coordinate, within 5
    standard errors (each from the AR(1)'s own effective sample size); a noise scale off
    by sqrt(2), or the posteriors-vs-Welling-Teh step confusion, fails by far more."""
    steps, burn = 60_000, 2_000
    generator = torch.Generator().manual_seed(1)
    state = sghmc.init({"w": MEAN.clone()})
    draws = np.empty((steps, 3))
    for step in range(steps + burn):
        state = sghmc.update(state, _gradient(state.params["w"]), lr,
                             sgld.METHOD.sampling_friction, generator)
        if step >= burn:
            draws[step - burn] = state.params["w"].numpy()
    a = SCALE.numpy()
    rho = 1 - lr * a                                   # the AR(1) coefficient
    variance = 1 / (a * (1 - lr * a / 2))
    ess_mean = steps * (1 - rho) / (1 + rho)
    ess_square = steps * (1 - rho**2) / (1 + rho**2)
    mean_error = np.abs(draws.mean(axis=0) - MEAN.numpy())
    assert (mean_error < 5 * np.sqrt(variance / ess_mean)).all(), mean_error
    variance_error = np.abs(draws.var(axis=0) - variance)
    assert (variance_error < 5 * variance * np.sqrt(2 / ess_square)).all(), variance_error
    # the exact chain's variance is not the continuous posterior's 1 / a where lr a is
    # large: the test can tell the two apart at lr = 0.2 (a = 4: 1.67x)
    if lr == 0.2:
        assert abs(draws[:, 1].var() - 1 / a[1]) > 5 * variance[1] * math.sqrt(2 / ess_square[1])


def test_the_options_are_sghmcs_without_the_friction():
    from train_zoo.method_options import option_table
    from train_zoo.spec import make_spec

    names = [option.name for option in option_table("sgld")]
    assert names == [option.name for option in option_table("sghmc") if option.name != "alpha"]
    with pytest.raises(UnknownNameError, match="alpha"):
        make_spec("optunet-mnist", dataset="digits", method="sgld", modes=1,
                  samples_per_mode=4, base_seed=0, method_options={"alpha": 0.5})


def test_an_sgld_mode_trains_its_chains():
    """A digits mode, two plain chains: each keeps its samples at the schedule's steps,
    records SGLD's chain records, and the samples move apart."""
    from train_zoo import make_spec, train_checkpoints

    spec = make_spec("optunet-mnist", dataset="digits", base_seed=5,
                     recipe_overrides={"epochs": 1}, method="sgld", modes=1,
                     samples_per_mode=4,
                     method_options={"preconditioner": "none", "burn_in": 60, "thin": 20,
                                     "chains": 2})
    results = train_checkpoints(spec, [0], engine="auto")
    result = results[0]
    assert result.record["method"] == "sgld"
    last = sghmc.chain_schedule(60, 20, 2)[-1]          # burn-in, then 2 x thin
    assert last == 100
    assert [chain["steps"] for chain in result.record["chains"]] == [last, last]
    assert [r.sample for r in results] == [0, 1, 2, 3]
    first, final = (np.concatenate([value.ravel() for key, value in r.state.items()
                                    if value.dtype.kind == "f" and "running" not in key])
                    for r in (results[0], results[3]))
    assert np.isfinite(first).all() and np.abs(first - final).max() > 0


def test_after_the_cold_rounds_sgld_keeps_sghmcs_pace():
    """SGHMC at step eta and friction alpha moves like Langevin at step eta / alpha (its
    overdamped limit): SGLD samples there, SGHMC at its own pair; the noise correction's
    share beta_hat = eta V / (2 alpha) stays SGHMC's."""
    from train_zoo.methods import sghmc as sghmc_method
    from train_zoo.methods import sgld

    eta, alpha = 4.37e-6, 2.09e-3
    assert sghmc_method.METHOD.sampling_step(eta, alpha) == (eta, alpha)
    lr, friction = sgld.METHOD.sampling_step(eta, alpha)
    assert friction == 1.0 and lr == pytest.approx(eta / alpha, rel=4 * np.finfo(float).eps)
    noise = 270.0                                     # V in the whitened coordinates
    assert lr * noise / (2 * friction) == pytest.approx(eta * noise / (2 * alpha))


def test_an_adapted_sgld_mode_samples_at_the_langevin_step():
    """Through the trainer on digits (a short adapted chain with one cold round): the
    record's sampling step is the cold round's step over its friction, at friction 1."""
    from train_zoo import make_spec, train_checkpoints

    spec = make_spec("optunet-mnist", dataset="digits", base_seed=5,
                     recipe_overrides={"epochs": 1}, method="sgld", modes=1,
                     samples_per_mode=4,
                     method_options={"preconditioner": "adapted", "chains": 2,
                                     "burn_in": 50, "thin": 20, "adapt_steps": 400,
                                     "adapt_rounds": 1, "adapt_round_steps": 150,
                                     "settle_steps": 0})
    record = train_checkpoints(spec, [0], engine="auto")[0].record
    cold = record["adaptation"]["cold"]
    assert cold["sampling"]["alpha"] == 1.0
    assert cold["sampling"]["lr"] == pytest.approx(cold["lr"] / cold["alpha"],
                                                   rel=4 * np.finfo(float).eps)
    assert cold["sampling"]["lr"] > 10 * cold["lr"]    # the friction is far below 1
