"""SVGD (``train_zoo.methods.svgd``).

- The update against an independent NumPy statement of Liu and Wang's ``phi`` (a double
  loop over particle pairs with the RBF kernel's gradient written out), within the
  rounding of sums of ``n`` terms of size up to the largest term (gamma(2n + 8), float64).
- BlackJAX's median rule, by its definition.
- One particle is the recipe's SGD: its kernel with itself is 1 with no gradient.
- Known answer: 300 particles on a 2-D Gaussian with full gradients end with the target's
  mean and covariance within the Monte Carlo error of as many independent draws
  (5 standard errors); SVGD's deterministic particles should do at least as well.
- A digits run trains ``samples_per_mode`` particles and records the bandwidth.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from rounding_bounds import U64, gamma

from posteriorzoo.errors import InvalidOptionError
from train_zoo.methods import svgd


def _phi_by_pairs(x: np.ndarray, g: np.ndarray, bandwidth: float) -> np.ndarray:
    n = len(x)
    phi = np.zeros_like(x)
    for i in range(n):
        for j in range(n):
            diff = x[j] - x[i]
            k = math.exp(-float(diff @ diff) / bandwidth)
            phi[i] += k * g[j] + k * (-2.0 / bandwidth) * diff      # d k(x_j, x_i) / d x_j
    return phi / n


def test_the_direction_is_liu_and_wangs():
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((7, 5)), rng.standard_normal((7, 5))
    bandwidth = 3.0
    ours = svgd.stein_direction(torch.from_numpy(x), torch.from_numpy(g), bandwidth).numpy()
    theirs = _phi_by_pairs(x, g, bandwidth)
    scale = (np.abs(g).max() + 2 / bandwidth * np.abs(x).max() * 2)
    assert np.abs(ours - theirs).max() <= gamma(2 * 7 + 8, U64) * scale


def test_the_bandwidth_is_blackjaxs_median_rule():
    x = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
    # squared distances of distinct pairs: 9, 16, 25 -> median 16, over log 3
    assert svgd.median_bandwidth(x) == pytest.approx(16 / math.log(3), rel=4 * U64)
    assert svgd.median_bandwidth(x[:1]) == 1.0


def test_one_particle_is_sgd():
    x = torch.tensor([[0.3, -1.2, 2.0]], dtype=torch.float64)
    g = torch.tensor([[1.0, 2.0, -0.5]], dtype=torch.float64)
    assert torch.equal(svgd.stein_direction(x, g, 1.0), g)


def test_particles_on_a_gaussian_have_its_mean_and_covariance():
    mean = torch.tensor([1.0, -2.0], dtype=torch.float64)
    covariance = torch.tensor([[2.0, 0.6], [0.6, 0.5]], dtype=torch.float64)
    precision = torch.linalg.inv(covariance)
    n = 300
    x = torch.randn(n, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for _ in range(3000):
        gradients = -(x - mean) @ precision
        x = x + 0.05 * svgd.stein_direction(x, gradients, svgd.median_bandwidth(x))
    sd = torch.sqrt(torch.diagonal(covariance))
    assert ((x.mean(0) - mean).abs() <= 5 * sd / math.sqrt(n)).all(), x.mean(0)
    empirical = torch.cov(x.T)
    # the standard error of a sample covariance entry: sqrt((s_ii s_jj + s_ij^2) / n)
    error = torch.sqrt((torch.outer(torch.diagonal(covariance), torch.diagonal(covariance))
                        + covariance**2) / n)
    assert ((empirical - covariance).abs() <= 5 * error).all(), empirical


def test_a_digits_run_trains_its_particles():
    from train_zoo import make_spec, train_checkpoints

    spec = make_spec("optunet-mnist", dataset="digits", base_seed=5,
                     recipe_overrides={"epochs": 2}, method="svgd", modes=1,
                     samples_per_mode=3)
    results = train_checkpoints(spec, [0], engine="auto")
    record = results[0].record
    assert record["bandwidth"] == "median-blackjax" and record["particles"] == 3
    assert record["bandwidth_start"] > 0 and record["bandwidth_end"] > 0
    states = [np.concatenate([v.ravel() for v in r.state.values()]) for r in results]
    assert len(states) == 3
    assert np.abs(states[0] - states[1]).max() > 0.01      # different initialisations
    with pytest.raises(InvalidOptionError, match="median-blackjax"):
        make_spec("optunet-mnist", dataset="digits", method="svgd", modes=1,
                  samples_per_mode=3, method_options={"bandwidth": "mean"})


def test_many_particles_train_as_fast_as_one_network():
    """phi is a mean over the particles and the median rule gives a typical pair the
    kernel 1 / n, so at the recipe's step each of n particles would move at about 2 / n of
    its gradient; the step's factor n (module docstring) makes each train at the recipe's
    pace. Ten particles after 20 epochs on digits (420 steps) reach at least half of one network's
    gain over chance (at lr_t / N they stay near chance: 0.10)."""
    from train_zoo import make_spec, train_checkpoints

    common = {"dataset": "digits", "base_seed": 7, "recipe_overrides": {"epochs": 20, "lr": 0.2}}
    particles = train_checkpoints(make_spec("optunet-mnist", method="svgd", modes=1,
                                            samples_per_mode=10, **common), [0], engine="auto")
    network = train_checkpoints(make_spec("optunet-mnist", method="de", checkpoints=1,
                                          **common), [0], engine="auto")[0]
    chance = 0.1
    gain = network.metrics["test_accuracy"] - chance
    assert gain > 0.3, network.metrics          # the recipe trains in 20 epochs
    accuracies = sorted(r.metrics["test_accuracy"] for r in particles)
    assert accuracies[len(accuracies) // 2] >= chance + gain / 2, (accuracies, network.metrics)

