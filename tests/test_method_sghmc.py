"""SGHMC: a sampler of the full-data posterior (train_zoo.methods.sghmc)."""

from __future__ import annotations

import math

import pytest
import torch
from rounding_bounds import U64, gamma
from torch import nn

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.models import build
from train_zoo.methods import sghmc, sghmc_update
from train_zoo.methods.common import mean_nll, parameters_of

# A correlated 2-D Gaussian target with an exact, noise-free gradient.
MEAN = torch.tensor([1.0, -2.0], dtype=torch.float64)
COVARIANCE = torch.tensor([[1.0, 0.8], [0.8, 1.0]], dtype=torch.float64)
PRECISION = torch.linalg.inv(COVARIANCE)
LR, ALPHA = 0.02, 0.2
CHAINS, BURN_IN, THIN, KEPT = 4000, 300, 50, 5


def _gaussian_draws(seed: int = 0) -> torch.Tensor:
    """SGHMC on the Gaussian target: ``CHAINS`` independent chains run side by side (the
    update is elementwise, so a ``(CHAINS, 2)`` tensor is ``CHAINS`` chains), started far
    from the mean, kept at the steps of ``chain_schedule``. Returns ``(CHAINS * KEPT, 2)``.
    """
    generator = torch.Generator().manual_seed(seed)
    start = torch.tensor([4.0, 3.0], dtype=torch.float64).expand(CHAINS, 2)
    state = sghmc.init({"theta": start})
    kept = set(sghmc.chain_schedule(BURN_IN, THIN, KEPT))
    draws = []
    while state.step < max(kept):
        gradient = {"theta": -(state.params["theta"] - MEAN) @ PRECISION}
        state = sghmc.update(state, gradient, LR, ALPHA, generator)
        if state.step in kept:
            draws.append(state.params["theta"])
    return torch.cat(draws)


def _moments_match(draws: torch.Tensor) -> bool:
    """Sample mean and covariance within 5 standard errors of the target's, the standard
    errors for (nearly) independent draws: a chain's kept states are ``THIN`` = 50 steps
    apart while its correlation time at these settings is about 10 steps (largest
    eigenvalue modulus of the linear recursion: 0.9), and the chains are independent.
    The discretisation bias of the stationary covariance at lr 0.02 is 0.006 (exact,
    from the discrete Lyapunov equation), well inside the tolerance of about 0.045."""
    n = draws.shape[0]
    variances = COVARIANCE.diagonal()
    mean_ok = ((draws.mean(0) - MEAN).abs() < 5 * torch.sqrt(variances / n)).all()
    standard = torch.sqrt((variances[:, None] * variances[None, :] + COVARIANCE**2) / n)
    covariance_ok = ((torch.cov(draws.T) - COVARIANCE).abs() < 5 * standard).all()
    return bool(mean_ok and covariance_ok)


def test_gaussian_target_mean_and_covariance():
    draws = _gaussian_draws()
    assert draws.shape == (CHAINS * KEPT, 2)
    assert _moments_match(draws)
    correlation = torch.corrcoef(draws.T)[0, 1]
    assert abs(correlation - 0.8) < 0.02


@pytest.mark.parametrize("factor", [0.01, 1 / math.sqrt(2), 1.5])
def test_a_wrong_noise_scale_fails_the_check(monkeypatch, factor):
    """Mutation check: the moment check has the power to reject a broken sampler. 0.01 is
    torch-uncertainty's factor on the noise; 1/sqrt(2) is N(0, alpha lr) for N(0, 2 alpha lr)."""
    right = sghmc_update._noise_std
    monkeypatch.setattr(sghmc_update, "_noise_std", lambda lr, alpha: factor * right(lr, alpha))
    assert not _moments_match(_gaussian_draws())


def test_the_noise_is_what_the_update_says():
    params = {"w": torch.zeros(200000, dtype=torch.float64)}
    state = sghmc.init(params, momentum={"w": torch.ones(200000)})
    gradient = {"w": torch.full((200000,), 3.0, dtype=torch.float64)}
    new = sghmc.update(state, gradient, 0.01, 0.3, torch.Generator().manual_seed(0))
    noise = new.momentum["w"] - (0.7 * 1.0 + 0.01 * 3.0)
    assert abs(noise.mean()) < 5 * math.sqrt(2 * 0.3 * 0.01 / 200000)
    assert noise.var().item() == pytest.approx(2 * 0.3 * 0.01, rel=0.02)
    assert torch.equal(new.params["w"], new.momentum["w"])  # theta = 0: 0 + v is v exactly
    assert new.step == 1 and state.step == 0
    assert torch.equal(state.params["w"], params["w"])  # the old state is unchanged


def test_same_seed_same_chain():
    torch.manual_seed(0)
    global_state = torch.random.get_rng_state()

    def run(seed: int) -> sghmc.SghmcState:
        generator = torch.Generator().manual_seed(seed)
        state = sghmc.init({"a": torch.zeros(3), "b": torch.ones(2, 2)})
        for _ in range(20):
            gradient = {name: -value for name, value in state.params.items()}
            state = sghmc.update(state, gradient, 0.1, 0.5, generator)
        return state

    first, second, other = run(4), run(4), run(5)
    for name in first.params:
        assert torch.equal(first.params[name], second.params[name])
        assert torch.equal(first.momentum[name], second.momentum[name])
        assert not torch.equal(first.params[name], other.params[name])
    assert torch.equal(torch.random.get_rng_state(), global_state)


# ------------------------------------------------------------ linear-Gaussian regression
SIGMA, PRIOR_PRECISION, NUM_DATA, BATCH = 0.5, 2.0, 256, 32


def _gaussian_nll(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((outputs[:, 0] - targets) ** 2).mean() / SIGMA**2


def _regression():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(NUM_DATA, 3, generator=generator, dtype=torch.float64)
    truth = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    targets = inputs @ truth + 0.3 + SIGMA * torch.randn(NUM_DATA, generator=generator,
                                                         dtype=torch.float64)
    model = build("mlp", widths=(3, 1)).double()  # one Linear layer: weight (1, 3), bias
    design = torch.cat([inputs, torch.ones(NUM_DATA, 1, dtype=torch.float64)], 1)
    precision = design.T @ design / SIGMA**2 + PRIOR_PRECISION * torch.eye(4,
                                                                           dtype=torch.float64)
    posterior_mean = torch.linalg.solve(precision, design.T @ targets / SIGMA**2)
    return model, inputs, targets, design, precision, posterior_mean


def _vector(params) -> torch.Tensor:
    return torch.cat([params["layers.0.weight"].reshape(-1), params["layers.0.bias"]])


def test_log_posterior_grad_is_the_full_data_gradient():
    model, inputs, targets, design, _precision, _mean = _regression()
    params, buffers = parameters_of(model)
    gradient = sghmc.log_posterior_grad(model, params, buffers, (inputs, targets), NUM_DATA,
                                        PRIOR_PRECISION, nll=_gaussian_nll)
    theta = _vector(params)
    expected = design.T @ (targets - design @ theta) / SIGMA**2 - PRIOR_PRECISION * theta
    # float64 both ways: the design's products summed over NUM_DATA rows in other orders,
    # gamma(n + 4) of the terms' sizes (|x| |y - x theta| / sigma^2 and the prior's)
    terms = (design.abs().T @ (targets - design @ theta).abs() / SIGMA**2
             + PRIOR_PRECISION * theta.abs())
    torch.testing.assert_close(_vector(gradient), expected, rtol=0,
                               atol=float(2 * gamma(len(targets) + 4, U64) * terms.max()))
    assert gradient["layers.0.weight"].shape == (1, 3)


def test_log_posterior_grad_for_classification():
    torch.manual_seed(0)
    model = build("optunet")
    params, buffers = parameters_of(model)
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 1, 28, 28, generator=generator),
             torch.randint(0, 10, (8,), generator=generator))
    precision = sghmc.prior_precision_from_weight_decay(60000, 2e-4)
    assert precision == pytest.approx(12.0)
    gradient = sghmc.log_posterior_grad(model, params, buffers, batch, 60000, precision)
    leaves = {name: value.clone().requires_grad_() for name, value in params.items()}
    value = (-60000 * mean_nll(model, leaves, buffers, batch)
             - 0.5 * precision * sum((v**2).sum() for v in leaves.values()))
    expected = torch.autograd.grad(value, list(leaves.values()))
    # Exact equality, on any CPU: log_posterior builds the same graph in the same order
    # (-N * nll first, then 0.5 * precision * sum of squares, a Python sum from 0), and
    # torch.func.grad runs the same backward kernels as torch.autograd.grad in one
    # process. The one difference, v * v there against v**2 here, rounds alike: pow's
    # backward is fl(g * 2v), mul's fl(g v) + fl(g v) = 2 fl(g v), the same number (a
    # doubling is exact). A wrong factor (N, the prior's 1/2, a sign) changes the
    # gradients by their own size, 1e3-6e3 here.
    for name, reference in zip(leaves, expected, strict=True):
        assert torch.equal(gradient[name], reference), name


def test_log_posterior_leaves_batchnorm_buffers_alone():
    model = build("resnet18", num_classes=10, width=4).train()
    params, buffers = parameters_of(model)
    before = {name: value.clone() for name, value in buffers.items()}
    batch = (torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))
    sghmc.log_posterior_grad(model, params, buffers, batch, 100, 1.0)
    for name, value in buffers.items():
        assert torch.equal(value, before[name])


def test_stochastic_gradients_give_the_posterior_mean():
    """Minibatch gradients on a linear-Gaussian regression: the stationary mean is the exact
    posterior mean (the gradient noise inflates the spread, not the mean)."""
    model, inputs, targets, design, precision, posterior_mean = _regression()
    params, buffers = parameters_of(model)
    generator = torch.Generator().manual_seed(7)
    lr = 0.1 / torch.linalg.eigvalsh(precision).max().item()
    state = sghmc.init(params)
    burn_in, steps = 300, 3000
    kept = []
    for index in sghmc.chain_schedule(0, 1, burn_in + steps):
        batch = torch.randint(0, NUM_DATA, (BATCH,), generator=generator)
        gradient = sghmc.log_posterior_grad(model, state.params, buffers,
                                            (inputs[batch], targets[batch]), NUM_DATA,
                                            PRIOR_PRECISION, nll=_gaussian_nll)
        state = sghmc.update(state, gradient, lr, 0.2, generator)
        if index > burn_in:
            kept.append(_vector(state.params))
    chain = torch.stack(kept)
    # Standard error of the chain mean from batch means (30 batches of 100 steps; the
    # correlation time is about 10 steps).
    batch_means = chain.reshape(30, -1, 4).mean(1)
    standard_error = batch_means.std(0) / math.sqrt(30)
    error = (chain.mean(0) - posterior_mean).abs()
    posterior_std = torch.linalg.inv(precision).diagonal().sqrt()
    assert (standard_error < 0.2 * posterior_std).all()  # the check is meaningful
    assert (error < 5 * standard_error).all()
    # Power: the chain's mean tells the full-data posterior from one that forgets the
    # factor N (the likelihood of a single example against the prior).
    eye = torch.eye(4, dtype=torch.float64)
    shrunk = torch.linalg.solve(design.T @ design / SIGMA**2 / NUM_DATA + PRIOR_PRECISION * eye,
                                design.T @ targets / SIGMA**2 / NUM_DATA)
    assert ((chain.mean(0) - shrunk).abs() > 5 * standard_error).any()


def test_chain_schedule():
    assert sghmc.chain_schedule(1000, 100, 3) == [1100, 1200, 1300]
    assert sghmc.chain_schedule(0, 1, 4) == [1, 2, 3, 4]


@pytest.mark.parametrize(("option", "call"), [
    ("'lr'", lambda s, g: sghmc.update(s, g, 0.0, 0.1, torch.Generator())),
    ("'lr'", lambda s, g: sghmc.update(s, g, float("inf"), 0.1, torch.Generator())),
    ("'alpha'", lambda s, g: sghmc.update(s, g, 0.1, 0.0, torch.Generator())),
    ("'alpha'", lambda s, g: sghmc.update(s, g, 0.1, 1.5, torch.Generator())),
    ("'grad_log_posterior'", lambda s, g: sghmc.update(s, {"x": torch.zeros(2)}, 0.1, 0.1,
                                                       torch.Generator())),
    ("'momentum'", lambda s, g: sghmc.init({"w": torch.zeros(2)}, {"w": torch.zeros(3)})),
    ("'params'", lambda s, g: sghmc.init({})),
    ("'burn_in'", lambda s, g: sghmc.chain_schedule(-1, 1, 1)),
    ("'thin'", lambda s, g: sghmc.chain_schedule(0, 0, 1)),
    ("'samples'", lambda s, g: sghmc.chain_schedule(0, 1, 0)),
    ("'num_data'", lambda s, g: sghmc.prior_precision_from_weight_decay(0, 1e-4)),
    ("'weight_decay'", lambda s, g: sghmc.prior_precision_from_weight_decay(10, -1.0)),
])
def test_bad_options(option, call):
    state = sghmc.init({"w": torch.zeros(2)})
    gradient = {"w": torch.zeros(2)}
    with pytest.raises(InvalidOptionError, match=option) as caught:
        call(state, gradient)
    assert "\n" not in str(caught.value)


def test_bad_log_posterior_options():
    model = nn.Linear(2, 2)
    params, buffers = parameters_of(model)
    batch = (torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))
    with pytest.raises(InvalidOptionError, match="'num_data'"):
        sghmc.log_posterior_grad(model, params, buffers, batch, 0, 1.0)
    with pytest.raises(InvalidOptionError, match="'prior_precision'"):
        sghmc.log_posterior_grad(model, params, buffers, batch, 10, -1.0)


# --- the minibatch-noise correction (Chen et al. section 3.2) --------------------------------

def _noisy_gaussian_chain(correct: bool, noise_std: float, seed: int = 0, chains: int = 2000,
                          steps: int = 3000, lr: float = 0.01, alpha: float = 0.2):
    """SGHMC on the 2-D Gaussian target whose exact gradient gets N(0, noise_std^2) added per
    step, as a minibatch would; ``correct`` subtracts beta_hat from the running estimate.
    Returns the draws of the last step of ``chains`` parallel chains and the mean kinetic
    temperature over the second half."""
    generator = torch.Generator().manual_seed(seed)
    noise_generator = torch.Generator().manual_seed(seed + 1)
    state = sghmc.init({"theta": MEAN.expand(chains, 2).clone()})
    estimate, temperatures = None, []
    for step in range(steps):
        exact = -(state.params["theta"] - MEAN) @ PRECISION
        noisy = exact + noise_std * torch.randn(exact.shape, generator=noise_generator,
                                                dtype=exact.dtype)
        beta = None
        if correct:
            estimate = sghmc.noise_update(estimate, {"theta": noisy}, 0.99)
            if step >= 200:
                beta, capped = sghmc.beta_hat(estimate, lr, alpha)
                assert capped < 0.01   # the estimate's own noise, rarely past the cap
        state = sghmc.update(state, {"theta": noisy}, lr, alpha, generator, beta)
        if step >= steps // 2:
            temperatures.append(sghmc.kinetic_temperature(state, lr))
    return state.params["theta"], sum(temperatures) / len(temperatures)


def test_exact_chain_has_the_discretisations_kinetic_temperature():
    _, temperature = _noisy_gaussian_chain(correct=False, noise_std=0.0)
    assert temperature == pytest.approx(1 / (1 - 0.2 / 2), rel=0.02)


def test_gradient_noise_heats_the_chain_and_the_correction_cools_it():
    # Noise variance V = 16 at lr 0.01: lr V / 2 = 0.08 of alpha = 0.2, so an uncorrected
    # chain's covariance is inflated by about 1 + lr V / (2 alpha) = 1.4.
    hot, hot_temperature = _noisy_gaussian_chain(correct=False, noise_std=4.0)
    assert not _moments_match(hot)
    assert hot_temperature > 1.3
    draws, temperature = _noisy_gaussian_chain(correct=True, noise_std=4.0)
    assert _moments_match(draws)
    assert temperature == pytest.approx(1 / (1 - 0.2 / 2), rel=0.02)


def test_noise_estimate_is_the_gradient_variance():
    generator = torch.Generator().manual_seed(5)
    estimate = None
    for _ in range(3000):
        estimate = sghmc.noise_update(
            estimate, {"g": 3.0 + 2.0 * torch.randn(1000, generator=generator,
                                                    dtype=torch.float64)}, 0.99)
    assert float(estimate.variance["g"].mean()) == pytest.approx(4.0, rel=0.05)
    beta, capped = sghmc.beta_hat(estimate, 0.01, 0.5)
    assert float(beta["g"].mean()) == pytest.approx(0.01 * 4.0 / 2, rel=0.05)
    _, capped = sghmc.beta_hat(estimate, 1.0, 0.5)     # lr V / 2 = 2 > 0.95 alpha
    assert capped == 1.0


def test_one_step_equals_the_posteriors_library():
    """posteriors 0.1.3's SGHMC (sigma = 1, temperature 1): m' = m + eps g - eps alpha_p m +
    N(0, eps (2 alpha_p - eps beta_p)), theta' = theta + eps m. With v = eps m, alpha =
    eps alpha_p, lr = eps^2 and beta_hat = eps^2 beta_p / 2 its momentum step is ours; its
    position moves with the old momentum, ours with the new one."""
    sghmc_lib = pytest.importorskip("posteriors.sgmcmc.sghmc")
    eps, alpha_p, beta_p = 0.1, 1.0, 2.0
    theta = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    m = torch.tensor([0.5, 0.1, -0.4], dtype=torch.float64)
    scale = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)

    def log_posterior(params, batch):
        return -0.5 * (scale * params["w"] ** 2).sum(), torch.tensor([])

    torch.manual_seed(11)
    theirs, _ = sghmc_lib.update(sghmc_lib.init({"w": theta}, momenta={"w": m}), None,
                                 log_posterior, lr=eps, alpha=alpha_p, beta=beta_p)
    state = sghmc.init({"w": theta}, momentum={"w": eps * m})
    beta = {"w": torch.full((3,), eps**2 * beta_p / 2, dtype=torch.float64)}
    ours = sghmc.update(state, {"w": -scale * theta}, eps**2, eps * alpha_p,
                        torch.Generator().manual_seed(11), beta)
    torch.testing.assert_close(ours.momentum["w"], eps * theirs.momenta["w"])
    torch.testing.assert_close(ours.params["w"], theirs.params["w"] - eps * m
                               + eps * theirs.momenta["w"])
