"""Cyclical SG-MCMC (``train_zoo.methods.csgmcmc``): the schedule, the kept steps, the
samples on a known posterior and a digits run.

Known answer: on a Gaussian target ``N(MEAN, 1 / a)`` with full-data gradients and noise
in the whole cycle, the state at a cycle's end has relaxed for dozens of relaxation times
``1 / a`` at steps that shrink to 0, so it is a draw of the posterior itself (the
discretisation's excess variance, ``lr_k a / 2``, vanishes with the step). Over 200
cycles the draws at the cycles' ends are independent: means within 5 standard errors of
``MEAN``, the variance pooled over 40 coordinates within 5 standard errors of ``1 / a``
(a noise scale off by sqrt(2) is 41% off, 8x the bound).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from posteriorzoo.errors import InvalidOptionError
from train_zoo.methods import csgmcmc

A, DIM = 4.0, 40
MEAN = torch.linspace(-1, 1, DIM, dtype=torch.float64)


def test_the_step_size_is_the_cosine_of_the_cycle():
    lr, length = 0.2, 100
    assert csgmcmc.cyclical_lr(lr, 0, length) == lr
    assert csgmcmc.cyclical_lr(lr, 50, length) == pytest.approx(lr / 2, rel=1e-15)
    assert csgmcmc.cyclical_lr(lr, 100, length) == lr            # the next cycle restarts
    steps = [csgmcmc.cyclical_lr(lr, k, length) for k in range(length)]
    assert all(a > b for a, b in zip(steps, steps[1:], strict=False)) and steps[-1] < 1e-3 * lr


def test_kept_steps_end_each_cycle_within_its_last_share():
    keep = csgmcmc.kept_steps(cycles=3, cycle_steps=1000, per_cycle=4, keep_fraction=0.06)
    assert len(keep) == len(set(keep)) == 12 and keep == sorted(keep)
    for cycle in range(3):
        mine = keep[4 * cycle: 4 * cycle + 4]
        assert mine[-1] == (cycle + 1) * 1000
        assert all((cycle + 1) * 1000 - 60 <= step for step in mine)


def _gaussian(params, batch):
    return 0.0, {"w": -A * (params["w"] - MEAN)}


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_the_ends_of_cycles_are_draws_of_the_posterior(alpha):
    cycles, length = 200, 1000
    lr = 0.5 / A      # lr a = 0.5 at a cycle's start (num_data 1: eta = lr_k)
    stepper = csgmcmc.CyclicalStepper({"w": MEAN.clone()}, _gaussian, lr, 1, alpha, length,
                                      1.0, cycles * length, torch.Generator().manual_seed(4))
    draws = []
    for step in range(1, cycles * length + 1):
        stepper.step(None, float("nan"))
        if step % length == 0:
            draws.append(stepper.params["w"].numpy().copy())
    draws = np.array(draws)
    variance = 1 / A
    assert (np.abs(draws.mean(axis=0) - MEAN.numpy())
            < 5 * math.sqrt(variance / cycles)).all()
    pooled = draws.var(axis=0, ddof=1).mean()
    assert abs(pooled - variance) < 5 * variance * math.sqrt(2 / (cycles - 1) / DIM), pooled


def test_exploration_has_no_noise():
    """With a sampling stage of a tenth, the first 90% of a cycle is noise-free descent:
    from the mean it does not move."""
    stepper = csgmcmc.CyclicalStepper({"w": MEAN.clone()}, _gaussian, 0.1, 1, 1.0, 100, 0.1,
                                      1000, torch.Generator().manual_seed(0))
    for _ in range(90):
        stepper.step(None, float("nan"))
    assert torch.equal(stepper.params["w"], MEAN)
    stepper.step(None, float("nan"))
    assert not torch.equal(stepper.params["w"], MEAN)


def test_a_digits_run_keeps_its_samples_at_the_ends_of_cycles():
    from train_zoo import make_spec, train_checkpoints

    spec = make_spec("optunet-mnist", dataset="digits", base_seed=5,
                     recipe_overrides={"epochs": 2}, method="csghmc", modes=1,
                     samples_per_mode=4, method_options={"cycles": 2, "keep_fraction": 0.3})
    assert spec.method_options["alpha"] == csgmcmc.CSGHMC_ALPHA
    results = train_checkpoints(spec, [0], engine="auto")
    record = results[0].record
    assert record["method"] == "csghmc" and record["cycles"] == 2
    length = record["cycle_steps"]
    assert record["kept_steps"][1] == length and record["kept_steps"][3] == 2 * length
    states = [np.concatenate([v.ravel() for v in r.state.values()]) for r in results]
    assert np.abs(states[0] - states[3]).max() > 0
    with pytest.raises(InvalidOptionError, match="must divide samples_per_mode"):
        make_spec("optunet-mnist", dataset="digits", method="csgld", modes=1,
                  samples_per_mode=4, method_options={"cycles": 3})


def test_a_network_with_batchnorm_is_refused():
    from train_zoo import make_spec, train_checkpoints

    spec = make_spec("optunet-mnist", dataset="digits", method="csgld", modes=1,
                     samples_per_mode=2, architecture="resnet18",
                     model_options={"width": 4, "in_channels": 1},
                     recipe_overrides={"epochs": 1}, method_options={"cycles": 1})
    with pytest.raises(InvalidOptionError, match="BatchNorm"):
        train_checkpoints(spec, [0], engine="auto")
