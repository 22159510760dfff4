"""Bayes by Backprop (train_zoo.methods.bbb, .bbb_fast): known answers, gradients, init,
samples, fast path.

Tolerances (why, in short):

* Known answer (linear-Gaussian regression, the mean-field optimum in closed form): the
  trained means and variances carry the Monte Carlo noise of SGD at the end of its
  decaying learning rate, reduced by averaging the last quarter of the iterates. Over 12
  seeds of this exact set-up the largest errors measured were 0.03 posterior standard
  deviations for the means and 4.2% for the variances; the test allows 0.1 and 12%. The
  wrong answers are far outside: the marginal variances of the exact (full-covariance)
  posterior are 37-58% larger than the mean-field ones here, which the test checks.
* Closed-form KL vs Monte Carlo, and the reparameterised gradient vs the analytic
  gradient of the expected loss: the Monte Carlo side is an average of independent terms
  whose standard error is known; the test allows 5 standard errors per entry.
* Fast path vs torch path: both compute in float32 and sum in different orders; as in
  ``test_fast_engine.py``, every tensor is compared on its own scale
  (``|fast - torch| <= 1e-5 * max|torch|``), the loss to ``1e-5`` relative.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.models import ResNet18, build
from train_zoo.fast.gradients import fast_loss_and_grad
from train_zoo.fast.layout import describe_model
from train_zoo.methods import bbb
from train_zoo.methods.bbb_fast import FastBBB
from train_zoo.methods.common import logits, mean_nll

RTOL = 1e-5  # of each tensor's largest |entry|; see the module docstring


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- known answers
def _regression() -> dict[str, torch.Tensor | float]:
    """10 points, 2 correlated inputs and a bias; noise variance 2, prior N(0, 1)."""
    g = _generator(0)
    n, noise_var, prior_sigma = 10, 2.0, 1.0
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    x[:, 1] = 0.6 * x[:, 0] + 0.8 * x[:, 1] + 0.5
    y = (x @ torch.tensor([0.7, -0.4], dtype=torch.float64) + 0.3
         + math.sqrt(noise_var) * torch.randn(n, generator=g, dtype=torch.float64))
    features = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
    precision = features.T @ features / noise_var + torch.eye(3, dtype=torch.float64)
    return {"x": x, "y": y, "noise_var": noise_var, "prior_sigma": prior_sigma,
            "precision": precision,
            "mean": torch.linalg.solve(precision, features.T @ y / noise_var)}


def test_known_answer_linear_gaussian_regression():
    """The mean-field Gaussian VI optimum for a linear-Gaussian model: exact posterior
    means, variances 1 / diag(posterior precision)."""
    problem = _regression()
    x, y, noise_var = problem["x"], problem["y"], problem["noise_var"]
    precision, mean = problem["precision"], problem["mean"]
    mf_var = 1 / torch.diag(precision)
    marginal_var = torch.diag(torch.linalg.inv(precision))
    assert (marginal_var / mf_var - 1).min() > 0.3  # the two answers are far apart

    model = nn.Linear(2, 1, dtype=torch.float64)

    def gaussian_nll(model, params, buffers, batch):  # mean over the batch, up to a constant
        inputs, targets = batch
        return ((logits(model, params, buffers, inputs)[:, 0] - targets) ** 2).mean() / (
            2 * noise_var)

    state = bbb.init(model, _generator(1), prior_sigma=problem["prior_sigma"],
                     elbo_samples=16, mean_std=1.0, rho_linear=-1.0)
    noise = _generator(2)
    steps, means, rhos = 800, [], []
    for i in range(steps):  # lr 1 for 20% of the steps, then geometric decay to 0.003
        lr = 1.0 * 0.003 ** max(0.0, (i - 0.2 * steps) / (0.8 * steps))
        state, _ = bbb.step(state, model, {}, (x, y), noise, len(y), lr, momentum=0.9,
                            nll=gaussian_nll)
        if i >= 0.75 * steps:
            means.append(torch.cat([state.mu["weight"][0], state.mu["bias"]]))
            rhos.append(torch.cat([state.rho["weight"][0], state.rho["bias"]]))
    fitted_mean = torch.stack(means).mean(0)
    fitted_var = nn.functional.softplus(torch.stack(rhos).mean(0)) ** 2
    assert ((fitted_mean - mean) / mf_var.sqrt()).abs().max() < 0.1
    assert (fitted_var / mf_var - 1).abs().max() < 0.12


def test_closed_form_kl_matches_monte_carlo():
    model = nn.Linear(5, 3, dtype=torch.float64)
    state = bbb.init(model, _generator(3), prior_sigma=0.3, mean_std=0.2, rho_linear=-1.5,
                     rho_std=0.5)
    exact = float(bbb.kl_divergence(state))
    count, g = 20000, _generator(33)
    q_terms = 0.0
    for name, mu in state.mu.items():
        q = torch.distributions.Normal(mu, state.sigma[name])
        prior = torch.distributions.Normal(torch.zeros_like(mu), 0.3)
        w = mu + state.sigma[name] * torch.randn((count, *mu.shape), generator=g,
                                                 dtype=mu.dtype)
        q_terms = q_terms + (q.log_prob(w) - prior.log_prob(w)).reshape(count, -1).sum(1)
    estimate, error = float(q_terms.mean()), float(q_terms.std() / math.sqrt(count))
    assert exact > 0.5  # a KL well away from 0
    assert abs(estimate - exact) < 5 * error, (estimate, exact, error)
    # The closed form against torch's own Gaussian KL.
    reference = sum(torch.distributions.kl_divergence(
        torch.distributions.Normal(state.mu[k], state.sigma[k]),
        torch.distributions.Normal(torch.zeros_like(state.mu[k]),
                                   torch.full_like(state.mu[k], 0.3))).sum() for k in state.mu)
    assert float(reference) == pytest.approx(exact, rel=1e-12)


def test_mixture_prior_with_equal_scales_is_the_gaussian_prior():
    model = nn.Linear(4, 2)
    gaussian = bbb.init(model, _generator(4), prior_sigma=0.2)
    mixture = bbb.init(model, _generator(4), prior_sigma=0.2, prior_sigma2=0.2, prior_pi=0.3)
    weights = bbb.sample_weights(gaussian, bbb.draw_noise(gaussian.rho, _generator(5), 1)[0])
    assert float(bbb.log_prior(mixture, weights)) == pytest.approx(
        float(bbb.log_prior(gaussian, weights)), rel=1e-6)
    expected = sum(torch.distributions.Normal(0.0, 0.2).log_prob(w).sum()
                   for w in weights.values())
    assert float(bbb.log_prior(gaussian, weights)) == pytest.approx(float(expected), rel=1e-6)


# ---------------------------------------------------------------- the reparameterised gradient
def _quadratic(model: nn.Module):
    """``nll = 1/2 sum a (p - c)^2`` over every parameter (the batch is ignored), with
    ``E_q[nll] = 1/2 sum a ((mu - c)^2 + sigma^2)``."""
    g = _generator(6)
    a = {k: 0.5 + torch.rand(v.shape, generator=g, dtype=torch.float64)
         for k, v in model.named_parameters()}
    c = {k: torch.randn(v.shape, generator=g, dtype=torch.float64)
         for k, v in model.named_parameters()}

    def nll(model, params, buffers, batch):
        return sum(0.5 * (a[k] * (params[k] - c[k]) ** 2).sum() for k in params)

    return a, c, nll


def test_reparameterised_gradient_for_given_noise():
    """For fixed eps the estimator is mean_s dnll/dw (w_s) (times eps_s sigmoid(rho))."""
    model = nn.Linear(3, 2, dtype=torch.float64)
    a, c, nll = _quadratic(model)
    state = bbb.init(model, _generator(7), mean_std=0.5, rho_linear=-1.0, kl_weight=0.0)
    noise = bbb.draw_noise(state.rho, _generator(8), 5)
    loss, grads = bbb.loss_and_grad(state, model, {}, (None, None), None, 1, nll=nll,
                                    noise=noise)
    for k, mu in state.mu.items():
        sigma, slope = state.sigma[k], torch.sigmoid(state.rho[k])
        ws = [mu + sigma * eps[k] for eps in noise]
        expect_mu = sum(a[k] * (w - c[k]) for w in ws) / len(ws)
        expect_rho = sum(a[k] * (w - c[k]) * eps[k] for w, eps in zip(ws, noise,
                                                                      strict=True)) / len(ws)
        torch.testing.assert_close(grads.mu[k], expect_mu, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grads.rho[k], expect_rho * slope, rtol=1e-12, atol=1e-12)
    expect_loss = sum(float(nll(model, bbb.sample_weights(state, eps), {}, None))
                      for eps in noise) / len(noise)
    assert float(loss) == pytest.approx(expect_loss, rel=1e-12)


@pytest.mark.parametrize("prior", ["gaussian", "mixture"])
def test_reparameterised_gradient_is_the_gradient_of_the_expected_loss(prior):
    """Averaged over many eps, the gradient is that of E_q[nll] + kl_weight * KL (closed
    form; with a mixture of two equal components, the Monte Carlo KL has the same
    expectation)."""
    model = nn.Linear(3, 2, dtype=torch.float64)
    a, c, nll = _quadratic(model)
    s0, kl_weight, count = 0.7, 0.3, 1000
    options = {"prior_sigma": s0, "kl_weight": kl_weight, "elbo_samples": count,
               "mean_std": 0.5, "rho_linear": -0.5}
    if prior == "mixture":
        options.update(prior_sigma2=s0, prior_pi=0.4)
    state = bbb.init(model, _generator(9), **options)
    _, grads = bbb.loss_and_grad(state, model, {}, (None, None), _generator(10), 1, nll=nll)
    prec = kl_weight / s0 ** 2
    for k, mu in state.mu.items():
        sigma, slope = state.sigma[k], torch.sigmoid(state.rho[k])
        expect_mu = a[k] * (mu - c[k]) + prec * mu
        expect_rho = (a[k] * sigma + prec * sigma - kl_weight / sigma) * slope
        # Standard errors of the average of the per-sample terms.
        b = a[k] + (prec if prior == "mixture" else 0.0)
        d = a[k] * (mu - c[k]) + (prec * mu if prior == "mixture" else 0.0)
        se_mu = b * sigma / math.sqrt(count)
        se_rho = slope * torch.sqrt(d ** 2 + 2 * b ** 2 * sigma ** 2) / math.sqrt(count)
        assert ((grads.mu[k] - expect_mu).abs() / se_mu).max() < 5
        assert ((grads.rho[k] - expect_rho).abs() / se_rho).max() < 5


# ---------------------------------------------------------------- init and samples
def test_init_statistics_by_layer_type():
    model = build("optunet")
    state = bbb.init(model, _generator(11))
    assert list(state.mu) == list(state.rho) == [k for k, _ in model.named_parameters()]
    mu = torch.cat([v.reshape(-1) for v in state.mu.values()])
    assert abs(float(mu.mean())) < 0.02 and abs(float(mu.std()) - 0.1) < 0.015
    conv = torch.cat([state.rho["conv1.weight"].reshape(-1),
                      state.rho["conv2.weight"].reshape(-1)])
    linear = torch.cat([state.rho["fc.weight"].reshape(-1), state.rho["fc.bias"]])
    assert abs(float(conv.mean()) + 6) < 0.03 and abs(float(conv.std()) - 0.1) < 0.02
    assert abs(float(linear.mean()) + 7) < 0.05 and abs(float(linear.std()) - 0.1) < 0.03
    assert abs(float(state.rho["fc.bias"].mean()) + 7) < 0.15  # the bias takes its layer's
    assert state.momentum is None
    assert state.options.record(60000)["kl_weight"] == 1 / 60000

    resnet = ResNet18(num_classes=10, width=4)
    kinds = bbb.layer_kinds(resnet)
    rstate = bbb.init(resnet, _generator(12))
    for name, value in resnet.named_parameters():
        if ".bn" in name or name.startswith("bn") or "shortcut.1" in name:
            assert kinds[name] == "point" and name not in rstate.rho
            torch.testing.assert_close(rstate.mu[name], value.detach(), rtol=0, atol=0)
        else:
            expected = "linear" if name.startswith("fc.") else "conv"
            assert kinds[name] == expected, name
            centre = -7.0 if expected == "linear" else -6.0
            assert abs(float(rstate.rho[name].mean()) - centre) < 0.3, name

    from_model = bbb.init(model, _generator(11), mean_init="model")
    for name, value in model.named_parameters():
        torch.testing.assert_close(from_model.mu[name], value.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("make", [lambda: build("optunet"), lambda: build("optunet-v1"),
                                  lambda: ResNet18(num_classes=10, width=4)])
def test_samples_load_and_are_reproducible(make):
    model = make()
    state = bbb.init(model, _generator(13))
    first = bbb.sample(model, state, _generator(14), 3)
    again = bbb.sample(model, state, _generator(14), 3)
    other = bbb.sample(model, state, _generator(15), 3)
    assert len(first) == 3
    for sd, sd_again, sd_other in zip(first, again, other, strict=True):
        assert list(sd) == list(model.state_dict())
        model.load_state_dict(sd)  # strict: every key, every shape
        for key in sd:
            assert sd[key].dtype == model.state_dict()[key].dtype
            assert torch.equal(sd[key], sd_again[key])
        name = next(iter(state.rho))
        assert not torch.equal(sd[name], sd_other[name])
    assert not torch.equal(first[0][name], first[1][name])


def test_sample_distribution_is_q():
    model = build("optunet")
    state = bbb.init(model, _generator(16))
    draws = bbb.sample(model, state, _generator(17), 400)
    z = torch.stack([torch.cat([(d[k] - state.mu[k]).reshape(-1) / state.sigma[k].reshape(-1)
                                for k in state.mu]) for d in draws])
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01  # 156,800 values


def test_point_estimates_are_trained_without_noise():
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 4))
    state = bbb.init(model, _generator(18))
    assert set(state.rho) == {"0.weight", "0.bias", "5.weight", "5.bias"}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    batch = (torch.randn(8, 1, 6, 6, generator=_generator(19)),
             torch.randint(0, 4, (8,), generator=_generator(20)))
    new, loss = bbb.step(state, model, buffers, batch, _generator(21), 100, 0.1)
    assert math.isfinite(float(loss))
    assert not torch.equal(new.mu["1.weight"], state.mu["1.weight"])  # BN gamma moved
    assert "1.weight" not in new.rho
    assert not torch.equal(buffers["1.running_mean"], model.get_buffer("1.running_mean"))
    samples = bbb.sample(model, new, _generator(22), 2, buffers)
    assert torch.equal(samples[0]["1.weight"], new.mu["1.weight"])
    assert torch.equal(samples[0]["1.running_mean"], buffers["1.running_mean"])


# ---------------------------------------------------------------- SGD
def test_update_is_torch_sgd_without_weight_decay():
    model = nn.Linear(4, 3)
    state = bbb.init(model, _generator(23))
    params = [nn.Parameter(v.clone()) for v in (*state.mu.values(), *state.rho.values())]
    optimiser = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)
    g = _generator(24)
    for _ in range(3):
        grads = bbb.BBBGrads(mu={k: torch.randn(v.shape, generator=g) for k, v in state.mu.items()},
                             rho={k: torch.randn(v.shape, generator=g)
                                  for k, v in state.rho.items()})
        for p, gr in zip(params, (*grads.mu.values(), *grads.rho.values()), strict=True):
            p.grad = gr.clone()
        optimiser.step()
        state = bbb.update(state, grads, 0.05, momentum=0.9, nesterov=True)
    for p, value in zip(params, (*state.mu.values(), *state.rho.values()), strict=True):
        assert torch.equal(p.detach(), value)


# ---------------------------------------------------------------- the fast path
def _batch(seed: int, count: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = _generator(seed)
    return torch.randn(count, 1, 28, 28, generator=g), torch.randint(0, 10, (count,), generator=g)


def _close(fast: torch.Tensor | np.ndarray, reference: torch.Tensor, what: str) -> None:
    fast = torch.as_tensor(fast)
    scale = float(reference.abs().max())
    assert float((fast - reference).abs().max()) <= RTOL * scale, what


@pytest.mark.parametrize("prior", [{}, {"prior_pi": 0.5, "prior_sigma2": 0.002}])
@pytest.mark.parametrize("architecture", ["optunet", "optunet-v1"])
def test_fast_step_equals_torch_step(prior, architecture):
    model = build(architecture)
    layout = describe_model(model, (1, 28, 28))
    state = bbb.init(model, _generator(25), **prior)
    fast = FastBBB(layout, state)
    torch_noise, fast_noise = _generator(26), _generator(26)
    size = layout.num_params
    for i, (lr, momentum, nesterov) in enumerate([(0.04, 0.9, True), (0.02, 0.9, True)]):
        images, labels = _batch(27 + i)
        loss, grads = bbb.loss_and_grad(state, model, {}, (images, labels), torch_noise, 60000)
        x = np.ascontiguousarray(images.permute(1, 2, 3, 0).numpy())
        fast_loss = fast.step(x, labels.numpy(), fast_noise, 60000, lr, momentum=momentum,
                              nesterov=nesterov)
        assert fast_loss == pytest.approx(float(loss), rel=RTOL)
        for key, value in layout.views(fast.grad[:size]).items():
            _close(value, grads.mu[key], f"step {i} dmu {key}")
        for key, value in layout.views(fast.grad[size:]).items():
            _close(value, grads.rho[key], f"step {i} drho {key}")
        state = bbb.update(state, grads, lr, momentum=momentum, nesterov=nesterov)
        after = fast.state()
        for key in state.mu:
            _close(after.mu[key], state.mu[key], f"step {i} mu {key}")
            _close(after.rho[key], state.rho[key], f"step {i} rho {key}")
            _close(after.momentum.rho[key], state.momentum.rho[key], f"step {i} buffer {key}")
        # Both consumed the generator alike.
        assert torch.equal(torch.randn(3, generator=torch_noise),
                           torch.randn(3, generator=fast_noise))


def test_fast_arrays_are_live_views_of_the_means():
    model = build("optunet")
    layout = describe_model(model, (1, 28, 28))
    fast = FastBBB(layout, bbb.init(model, _generator(30)))
    arrays = fast.arrays()
    assert list(arrays) == list(layout.keys)
    for key, value in fast.state().mu.items():
        assert np.array_equal(arrays[key], value.numpy())
    before = {key: value.copy() for key, value in arrays.items()}
    images, labels = _batch(31, 8)
    fast.step(np.ascontiguousarray(images.permute(1, 2, 3, 0).numpy()), labels.numpy(),
              _generator(32), 60000, 0.05)
    # The same dict, read again after the step: views, not copies, so it moved.
    assert any(not np.array_equal(arrays[key], before[key]) for key in arrays)
    for key, value in fast.state().mu.items():
        assert np.array_equal(arrays[key], value.numpy())


def test_fast_path_refuses_what_it_cannot_run():
    model = ResNet18(num_classes=10, width=4)
    optunet = build("optunet")
    layout = describe_model(optunet, (1, 28, 28))
    with pytest.raises(ValueError, match="variational"):
        FastBBB(layout, bbb.init(model, _generator(28)))
    theta = layout.flatten(optunet.state_dict())
    x, labels = _batch(29, 4)
    with pytest.raises(ValueError, match="x has shape"):
        fast_loss_and_grad(layout, theta, x.numpy(), labels.numpy())
    loss, gradient = fast_loss_and_grad(layout, theta, x.permute(1, 2, 3, 0).numpy(),
                                        labels.numpy())
    with torch.no_grad():
        reference = mean_nll(optunet, dict(optunet.named_parameters()), {}, (x, labels))
    assert loss == pytest.approx(float(reference), rel=RTOL)
    assert gradient.shape == (layout.num_params,)


# ---------------------------------------------------------------- options
@pytest.mark.parametrize(("option", "value"), [
    ("prior_sigma", 0.0), ("prior_sigma2", -1.0), ("prior_pi", 1.5), ("prior_pi", 0.0),
    ("elbo_samples", 0), ("elbo_samples", 2.5), ("kl_weight", -1e-3),
    ("kl_weight", float("nan")), ("mean_init", "zeros"), ("mean_std", -0.1),
    ("rho_linear", float("inf")), ("rho_conv", "a"), ("rho_std", True)])
def test_bad_options_name_the_option(option, value):
    with pytest.raises(InvalidOptionError) as info:
        bbb.init(nn.Linear(2, 2), _generator(30), **{option: value})
    message = str(info.value)
    assert message.startswith(option) and "\n" not in message


def test_bad_step_options():
    model = nn.Linear(2, 2)
    state = bbb.init(model, _generator(31))
    batch = (torch.randn(4, 2), torch.randint(0, 2, (4,)))
    with pytest.raises(InvalidOptionError, match="^num_data"):
        bbb.loss_and_grad(state, model, {}, batch, _generator(32), 0)
    _, grads = bbb.loss_and_grad(state, model, {}, batch, _generator(32), 4)
    with pytest.raises(InvalidOptionError, match="^nesterov"):
        bbb.update(state, grads, 0.1, nesterov=True)
    with pytest.raises(InvalidOptionError, match="^lr"):
        bbb.update(state, grads, -0.1)
