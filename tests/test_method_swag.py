"""SWAG: moments, deviations, sampling covariance, BatchNorm recompute, schedule."""

from __future__ import annotations

import math

import pytest
import torch
from rounding_bounds import U64, gamma

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.models import build
from train_zoo.methods import swag
from train_zoo.methods.common import flatten, parameters_of


def _iterates(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Small two-tensor parameter dicts (P = 6), float64."""
    generator = torch.Generator().manual_seed(seed)
    return [{"a.weight": torch.randn(2, 2, generator=generator, dtype=torch.float64),
             "a.bias": torch.randn(2, generator=generator, dtype=torch.float64) * 0.5 + 1}
            for _ in range(count)]


def _collect(iterates, max_rank: int = swag.RANK) -> swag.SwagState:
    state = swag.init(iterates[0], max_rank=max_rank)
    for params in iterates:
        state = swag.update(state, params)
    return state


def test_moments_and_deviations_match_the_iterates():
    iterates = _iterates(27)
    state = _collect(iterates)
    vectors = torch.stack([flatten(p) for p in iterates])
    assert state.count == 27
    # float64 running means against one mean over 27 iterates, each within gamma(n + 2)
    # of the values' largest size (a running mean adds a product and a division a step)
    tolerance = 2 * gamma(27 + 2, U64) * float(vectors.abs().max())
    torch.testing.assert_close(state.mean, vectors.mean(0), rtol=0, atol=tolerance)
    # Population variance (divisor n), as SWAG's E[theta^2] - E[theta]^2.
    # E[theta^2] - E[theta]^2 cancels: each moment within gamma(n + 2) of max theta^2
    torch.testing.assert_close(swag.variance(state), vectors.var(0, correction=0),
                               rtol=0, atol=4 * tolerance * float(vectors.abs().max()))
    # The last K = 20 deviations, each from the running mean *after* its iterate.
    expected = torch.stack([vectors[i] - vectors[:i + 1].mean(0) for i in range(7, 27)])
    assert state.deviations.shape == (20, 6)
    torch.testing.assert_close(state.deviations, expected, rtol=0, atol=2 * tolerance)


def test_fewer_iterates_than_the_rank_and_a_small_rank():
    iterates = _iterates(5, seed=1)
    vectors = torch.stack([flatten(p) for p in iterates])
    state = _collect(iterates)
    assert state.deviations.shape == (5, 6)
    small = _collect(iterates, max_rank=2)
    expected = torch.stack([vectors[i] - vectors[:i + 1].mean(0) for i in (3, 4)])
    # deviations from running means of at most 5 iterates (see above)
    tolerance = 4 * gamma(5 + 2, U64) * float(vectors.abs().max())
    torch.testing.assert_close(small.deviations, expected, rtol=0, atol=tolerance)


def test_state_is_functional():
    iterates = _iterates(3)
    first = swag.update(swag.init(iterates[0]), iterates[0])
    mean = first.mean.clone()
    second = swag.update(first, iterates[1])
    assert first.count == 1 and second.count == 2
    torch.testing.assert_close(first.mean, mean, rtol=0, atol=0)


def test_float32_parameters_keep_small_variances():
    # Weights near 1 with a spread of 1e-4: a float32 E[x^2] - E[x]^2 would lose it.
    generator = torch.Generator().manual_seed(0)
    iterates = [{"w": (1 + 1e-4 * torch.randn(50, generator=generator)).float()}
                for _ in range(20)]
    state = _collect(iterates)
    vectors = torch.stack([p["w"].double() for p in iterates])
    # SWAG's float64 running moments, per iterate: the mean's recursion rounds
    # theta - m, its division by n and the sum, at most u64 of 2M, M and M (M = max
    # |theta|); the squares' also theta^2: 4 n u64 M and 5 n u64 M^2 after n iterates
    # (an old error is carried by 1 - 1/n); then E[theta^2] - m^2 (2 M times the mean's
    # error, two roundings): (13 n + 2) u64 M^2. The reference's float64 variance, any
    # algorithm: gamma(n + 3) M^2. Measured: 0.022 of it (host and AVX2); a float32
    # E[x^2] - E[x]^2 misses by 1.1e7 times it.
    n, square = len(iterates), float(vectors.abs().max()) ** 2
    bound = ((13 * n + 2) * U64 + gamma(n + 3, U64)) * square
    torch.testing.assert_close(swag.variance(state), vectors.var(0, correction=0),
                               rtol=0, atol=bound)
    draw = swag.sample(state, torch.Generator().manual_seed(0), 1)[0]
    assert draw["w"].dtype == torch.float32


def test_sample_mean_and_covariance():
    state = _collect(_iterates(25, seed=2))
    scale, count = 0.1, 20000
    generator = torch.Generator().manual_seed(3)
    draws = torch.stack([swag.sample_vector(state, generator, scale) for _ in range(count)])
    truth = swag.covariance(state, scale)
    # The formula itself, written out.
    deviations = state.deviations
    torch.testing.assert_close(
        truth, scale * (torch.diag(swag.variance(state)) + deviations.T @ deviations / 19))
    # Mean: standard error sqrt(Sigma_ii / n).
    error = (draws.mean(0) - state.mean).abs()
    assert (error < 5 * torch.sqrt(truth.diagonal() / count)).all()
    # Covariance: for Gaussian draws, Var(S_ij) = (Sigma_ii Sigma_jj + Sigma_ij^2) / n.
    empirical = torch.cov(draws.T)
    standard = torch.sqrt((truth.diagonal()[:, None] * truth.diagonal()[None, :]
                           + truth**2) / count)
    assert ((empirical - truth).abs() < 5 * standard).all()
    # The check has power: the covariance without the low-rank part fails it.
    diagonal_only = scale * torch.diag(swag.variance(state))
    assert not ((empirical - diagonal_only).abs() < 5 * standard).all()


def test_sample_of_the_dicts_equals_the_vector_draws():
    iterates = _iterates(25, seed=4)
    state = _collect(iterates)
    buffers = {"bn.running_mean": torch.arange(3.0)}
    draws = swag.sample(state, torch.Generator().manual_seed(8), 3, buffers=buffers)
    generator = torch.Generator().manual_seed(8)
    for draw in draws:
        assert list(draw) == ["a.weight", "a.bias", "bn.running_mean"]
        assert draw["a.weight"].shape == (2, 2)
        vector = swag.sample_vector(state, generator)
        torch.testing.assert_close(flatten({k: draw[k] for k in iterates[0]}), vector,
                                   rtol=0, atol=0)
        assert torch.equal(draw["bn.running_mean"], buffers["bn.running_mean"])  # a copy
        assert draw["bn.running_mean"].data_ptr() != buffers["bn.running_mean"].data_ptr()


def test_cross_tensor_correlation_is_kept():
    # Two tensors moving together: a[i] = c_i * u, b[i] = c_i * w with one scalar c_i per
    # iterate. With z2 drawn once over the network, a and b are strongly correlated in the
    # samples; a z2 drawn per tensor would make them independent.
    generator = torch.Generator().manual_seed(5)
    u = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    w = torch.tensor([0.7, 1.5], dtype=torch.float64)
    iterates = []
    for _ in range(20):
        c = torch.randn((), generator=generator, dtype=torch.float64)
        iterates.append({"first.weight": c * u, "second.weight": c * w})
    state = _collect(iterates)
    draws = torch.stack([swag.sample_vector(state, generator) for _ in range(5000)])
    empirical = torch.corrcoef(draws.T)[0, 3]  # first.weight[0] against second.weight[0]
    truth = swag.covariance(state)
    expected = truth[0, 3] / torch.sqrt(truth[0, 0] * truth[3, 3])
    assert expected > 0.45
    # Standard error of a correlation coefficient: (1 - rho^2) / sqrt(n).
    assert abs(empirical - expected) < 5 * (1 - expected**2) / math.sqrt(5000)


def test_generator_is_the_only_randomness():
    state = _collect(_iterates(22))
    torch.manual_seed(0)
    global_state = torch.random.get_rng_state()
    first = swag.sample(state, torch.Generator().manual_seed(1), 4)
    torch.manual_seed(99)
    second = swag.sample(state, torch.Generator().manual_seed(1), 4)
    for a, b in zip(first, second, strict=True):
        for key in a:
            assert torch.equal(a[key], b[key])
    assert not torch.equal(first[0]["a.weight"], first[1]["a.weight"])
    torch.manual_seed(0)
    swag.sample(state, torch.Generator().manual_seed(1), 4)
    assert torch.equal(torch.random.get_rng_state(), global_state)


def test_scale_zero_gives_the_mean():
    state = _collect(_iterates(4))
    vector = swag.sample_vector(state, torch.Generator().manual_seed(0), scale=0.0)
    torch.testing.assert_close(vector, state.mean, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "options"), [
    ("optunet", {}),
    ("optunet-v1", {}),
    ("mlp", {"widths": (4, 3, 2)}),
    ("resnet18", {"num_classes": 10, "width": 4}),
])
def test_samples_load_into_the_base_architecture(name, options):
    torch.manual_seed(0)
    model = build(name, **options)
    params, buffers = parameters_of(model)
    state = swag.init(params)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        noisy = {k: v + 0.01 * torch.randn(v.shape, generator=generator)
                 for k, v in params.items()}
        state = swag.update(state, noisy)
    for draw in swag.sample(state, torch.Generator().manual_seed(1), 2, buffers=buffers):
        fresh = build(name, **options)
        fresh.load_state_dict(draw)  # strict
        for key, value in fresh.state_dict().items():
            assert value.dtype == model.state_dict()[key].dtype


def _manual_batchnorm_statistics(model, params, batches):
    """Per BN layer: the average over batches of the batch mean and unbiased variance of
    the layer's input, with every BN normalising by its batch statistics; in float64 from
    the float32 inputs (exact to float64 rounding), with the bound on a float32
    computation of them (:func:`_statistics_bounds`). Returns ``{name: (mean, variance,
    mean bound, variance bound, batches)}``."""
    reference = build("resnet18", num_classes=10, width=4)
    reference.load_state_dict({**params, **dict(reference.named_buffers())}, strict=True)
    reference.train()
    captured: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            def hook(_module, inputs, name=name):
                x = inputs[0].double().transpose(0, 1).reshape(inputs[0].shape[1], -1)
                captured.setdefault(name, []).append(x)
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for images, _labels in batches:
            reference(images)
    for handle in hooks:
        handle.remove()
    return {name: _statistics_bounds(values) for name, values in captured.items()}


def _statistics_bounds(batches: list[torch.Tensor]):
    """The exact average over ``batches`` (each ``(C, n)``) of each channel's mean and
    unbiased variance, and bounds on a float32 computation's error: torch's BatchNorm
    kernel, two-pass (the mean, then the sum of squared deviations from it) with sums in
    any order, then the cumulative average over the ``K`` batches
    (``r_k = (1 - f) r_(k-1) + f s_k``, ``f = 1 / k``).

    Per batch of ``n`` values: the mean within ``dm = gamma(n + 1) mean |x|`` (the sum and
    the division); the variance of ``d_i = fl(x_i - m')`` squared, summed and divided by
    ``n - 1``: ``gamma(n + 3)`` of ``sum (x_i - m')^2 / (n - 1) = v + n dm^2 / (n - 1)``,
    which is itself ``n dm^2 / (n - 1)`` from ``v``. The cumulative average: each step
    rounds f (u), 1 - f (2 u relative to 1 - 1 / k), two products, a sum and a float32
    store: every batch's statistic carries at most 5 K roundings, ``gamma(5 K)`` of the
    average of their magnitudes.
    """
    means, variances, mean_bounds, variance_bounds = [], [], [], []
    for x in batches:
        n = x.shape[1]
        mean_bound = gamma(n + 1) * x.abs().mean(1)
        shift = n * mean_bound**2 / (n - 1)
        variance = x.var(1, correction=1)
        means.append(x.mean(1))
        variances.append(variance)
        mean_bounds.append(mean_bound)
        variance_bounds.append(gamma(n + 3) * (variance + shift) + shift)
    means, variances, mean_bounds, variance_bounds = map(
        torch.stack, (means, variances, mean_bounds, variance_bounds))
    averaging = gamma(5 * len(batches))
    return (means.mean(0), variances.mean(0),
            averaging * (means.abs() + mean_bounds).mean(0) + mean_bounds.mean(0),
            averaging * (variances + variance_bounds).mean(0) + variance_bounds.mean(0),
            len(batches))


def test_recompute_batchnorm_matches_a_manual_computation():
    torch.manual_seed(0)
    model = build("resnet18", num_classes=10, width=4, dropout=0.5)
    params, buffers = parameters_of(model)
    generator = torch.Generator().manual_seed(2)
    sampled = {k: v + 0.05 * torch.randn(v.shape, generator=generator)
               for k, v in params.items()}
    # Unequal batches (the last is smaller): every batch weighs the same.
    batches = [(torch.randn(n, 3, 16, 16, generator=generator) * 2 + 1,
                torch.zeros(n, dtype=torch.long)) for n in (8, 8, 8, 5)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    new = swag.recompute_batchnorm(model, sampled, buffers, batches)
    assert list(new) == list(buffers)
    expected = _manual_batchnorm_statistics(model, sampled, batches)
    assert len(expected) == sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    # Each BN layer's input is the same on both sides (the same weights, kernels and
    # batch-statistics normalisation; dropout comes after the last BN), so the float32
    # statistics differ from the exact ones by their own rounding alone
    # (_statistics_bounds). Measured: at most 0.038 of the bound for the means and 0.057
    # for the variances on the host (AVX-512), 0.045 and 0.062 under the AVX2 settings
    # (torch sums in float64; the bound allows float32 sums). Batches weighed by their
    # size instead exceed it at least 12-fold, a biased (divisor n) variance at least
    # 5-fold, in every layer.
    for name, (mean, var, mean_bound, var_bound, count) in expected.items():
        assert ((new[f"{name}.running_mean"].double() - mean).abs() <= mean_bound).all()
        assert ((new[f"{name}.running_var"].double() - var).abs() <= var_bound).all()
        assert int(new[f"{name}.num_batches_tracked"]) == count == 4
    # The statistics moved away from the base network's (fresh: mean 0, variance 1).
    assert not torch.allclose(new["bn1.running_mean"], buffers["bn1.running_mean"])
    # The model itself is untouched: weights, buffers, modes and momenta.
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert not any(m.training for m in model.modules())
    assert all(m.momentum == 0.1 for m in model.modules()
               if isinstance(m, torch.nn.BatchNorm2d))
    # Deterministic (dropout stays off during the pass) and the result loads.
    again = swag.recompute_batchnorm(model, sampled, buffers, batches)
    for key in new:
        assert torch.equal(new[key], again[key])
    build("resnet18", num_classes=10, width=4).load_state_dict({**sampled, **new})


def test_recompute_batchnorm_without_batchnorm_and_with_no_batches():
    model = build("optunet")
    params, buffers = parameters_of(model)
    assert swag.recompute_batchnorm(model, params, buffers, []) == {}
    resnet = build("resnet18", num_classes=10, width=4)
    params, buffers = parameters_of(resnet)
    with pytest.raises(InvalidOptionError, match="'batches'"):
        swag.recompute_batchnorm(resnet, params, buffers, [])
    # Bare image tensors are accepted as batches too.
    new = swag.recompute_batchnorm(resnet, params, buffers, [torch.randn(4, 3, 8, 8)])
    assert int(new["bn1.num_batches_tracked"]) == 1


def test_collection_epochs():
    epochs = swag.collection_epochs(120)
    assert epochs == list(range(5, 120, 6))
    uneven = swag.collection_epochs(150)
    assert len(uneven) == 20 and uneven[-1] == 149 and uneven == sorted(set(uneven))
    assert set(b - a for a, b in zip(uneven, uneven[1:], strict=False)) == {7, 8}
    assert swag.collection_epochs(30, iterates=20, start=10) == list(range(10, 30))
    assert swag.collection_epochs(5, iterates=1) == [4]


def test_swag_learning_rate():
    rates = [swag.swag_learning_rate(e, 0.04, ramp_epochs=4, start_lr=0.01) for e in range(8)]
    assert rates[3:] == [0.04] * 5
    differences = [b - a for a, b in zip([0.01, *rates[:3]], rates[:4], strict=True)]
    assert all(d == pytest.approx(0.0075) for d in differences)  # a linear ramp
    assert swag.swag_learning_rate(0, 0.1, ramp_epochs=0) == 0.1
    assert swag.swag_learning_rate(0, 0.1) == pytest.approx(0.01)  # default ramp of 10


@pytest.mark.parametrize(("option", "call"), [
    ("'epochs'", lambda: swag.collection_epochs(0)),
    ("'iterates'", lambda: swag.collection_epochs(10, iterates=11)),
    ("'iterates'", lambda: swag.collection_epochs(10, iterates=0)),
    ("'start'", lambda: swag.collection_epochs(10, start=-1)),
    ("'swag_lr'", lambda: swag.swag_learning_rate(0, 0.0)),
    ("'swag_lr'", lambda: swag.swag_learning_rate(0, float("nan"))),
    ("'ramp_epochs'", lambda: swag.swag_learning_rate(0, 0.1, ramp_epochs=1.5)),
    ("'start_lr'", lambda: swag.swag_learning_rate(0, 0.1, start_lr=-1)),
    ("'epoch'", lambda: swag.swag_learning_rate(-1, 0.1)),
    ("'max_rank'", lambda: swag.init({"w": torch.zeros(2)}, max_rank=0)),
    ("'params'", lambda: swag.init({})),
    ("'params'", lambda: swag.update(swag.init({"w": torch.zeros(2)}), {"w": torch.zeros(3)})),
    ("'params'", lambda: swag.update(swag.init({"w": torch.zeros(2)}), {"v": torch.zeros(2)})),
    ("'state'", lambda: swag.sample(_collect(_iterates(1)), torch.Generator(), 1)),
    ("'count'", lambda: swag.sample(_collect(_iterates(3)), torch.Generator(), 0)),
    ("'scale'", lambda: swag.sample(_collect(_iterates(3)), torch.Generator(), 1, scale=-1)),
])
def test_bad_options(option, call):
    with pytest.raises(InvalidOptionError, match=option) as caught:
        call()
    assert "\n" not in str(caught.value)
