"""IVON (``train_zoo.methods.ivon``): the ivon-opt optimiser driven by the engine's
gradient.

- Oracle: the package's ``IVON`` trained the plain way (``loss.backward()`` inside
  ``sampled_params(train=True)``, then ``step()``) gives the same trajectory bit for bit
  as the method's stepper, which hands it ``-g / N`` from a full-data log-likelihood
  gradient ``g = -N dL``: with ``N`` a power of two both scalings are exact.
- Known answer: on a quadratic loss ``L = mean_n a (w - x_n)^2 / 2`` per coordinate the
  Hessian is ``a``, and IVON's estimate ``h`` (Price's estimator, unbiased there) must
  converge to it, the mean to the posterior mean ``mean(x) a / (a + delta)``; the
  posterior standard deviation is then ``1 / sqrt(N (a + delta))``.
- The method: a digits run records its scales, and ``diagnose`` says whether they moved.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from train_zoo.methods import ivon as ivon_method

ivon = pytest.importorskip("ivon")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def test_the_stepper_is_the_package_trained_plainly():
    num_data, steps = 64, 25
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 5, generator=generator, dtype=torch.float64),
             torch.randint(0, 3, (16,), generator=generator)) for _ in range(steps)]
    options = {"hess_init": 0.5, "beta1": 0.9, "beta2": 0.99}

    plain = _model(1)
    optimizer = ivon.IVON(plain.parameters(), lr=0.05, ess=num_data, hess_init=0.5,
                          beta1=0.9, beta2=0.99, weight_decay=1e-3)
    torch.manual_seed(7)
    for x, y in data:
        with optimizer.sampled_params(train=True):
            optimizer.zero_grad()
            nn.functional.cross_entropy(plain(x), y).backward()
        optimizer.step()

    ours = _model(1)

    def gradient(params, batch):   # the engine's: of N x the mean log-likelihood
        x, y = batch
        params = {name: value.detach().requires_grad_() for name, value in params.items()}
        loss = nn.functional.cross_entropy(torch.func.functional_call(ours, params, (x,)), y)
        grads = torch.autograd.grad(loss, list(params.values()))
        return float(loss.detach()), {name: -num_data * g for name, g in zip(params, grads,
                                                                    strict=True)}

    torch.manual_seed(7)
    stepper = ivon_method.IvonStepper(ours, gradient, num_data, 0.05, options, 1e-3)
    for batch in data:
        stepper.step(batch, 0.05)
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(stepper.hess(), torch.cat([g["hess"] for g in optimizer.param_groups]))


def test_the_hessian_estimate_and_the_mean_converge_on_a_quadratic():
    """4 coordinates with curvatures 0.5 .. 8, full-batch gradients of N = 1,024 targets,
    beta2 = 0.9999, 60,000 steps. Price's estimate of one step is ``a z^2`` (z standard
    normal): relative spread sqrt(2); the running average keeps sqrt(2 (1 - beta2) /
    (1 + beta2)) = 1% of it, and what is left of the start (h = 1) is e^-6 of its
    distance. h within 5 of those spreads plus that remainder of a; the mean within 5
    posterior standard deviations of the posterior mean."""
    curvature = torch.tensor([0.5, 1.0, 3.0, 8.0], dtype=torch.float64)
    num_data, delta, beta2, steps = 1024, 0.01, 0.9999, 60_000
    generator = torch.Generator().manual_seed(2)
    targets = 1.0 + torch.randn(num_data, 4, generator=generator, dtype=torch.float64)
    model = nn.Linear(1, 4, bias=False).double()   # w is its weight column
    with torch.no_grad():
        model.weight.zero_()

    def gradient(params, batch):
        w = params["weight"][:, 0]
        g = curvature * (w - batch).mean(0)        # d mean-loss / dw, the whole data set
        return 0.0, {"weight": (-num_data * g)[:, None]}

    options = {"hess_init": 1.0, "beta1": 0.9, "beta2": beta2}
    torch.manual_seed(3)
    stepper = ivon_method.IvonStepper(model, gradient, num_data, 0.05, options, delta)
    for _ in range(steps):
        stepper.step(targets, 0.05)
    hess = stepper.hess()
    spread = math.sqrt(2) * math.sqrt(2 * (1 - beta2) / (1 + beta2))
    remainder = (curvature - 1).abs() * beta2 ** steps
    assert ((hess - curvature).abs() <= 5 * spread * curvature + remainder).all(), hess
    posterior_mean = targets.mean(0) * curvature / (curvature + delta)
    std = 1 / torch.sqrt(num_data * (curvature + delta))
    assert (model.weight[:, 0].detach() - posterior_mean).abs().le(5 * std).all()


def test_a_digits_run_records_scales_that_diagnose_reads(tmp_path):
    """With beta2 = 0.99 the Hessian estimate, hence the posterior's scales, moves in a
    short run and diagnose raises no variance flag; the package's default 0.99999 barely
    moves in 90 steps, and diagnose says so."""
    from posteriorzoo.collection import diagnose
    from train_zoo import make_spec
    from train_zoo.run import train_collection

    for beta2, flagged in ((0.99, False), (0.99999, True)):
        spec = make_spec("optunet-mnist", dataset="digits", base_seed=5,
                         recipe_overrides={"epochs": 4}, method="ivon", modes=1,
                         samples_per_mode=4, method_options={"beta2": beta2})
        path = tmp_path / f"ivon-{beta2}.h5"
        train_collection(spec, path)
        result = diagnose(path, predictions=False)
        moved = [row["moved_factor"] for row in result.variational]
        assert len(moved) == 4 and all(math.isfinite(m) for m in moved)
        assert any("variance did not train" in flag for flag in result.flags) == flagged
