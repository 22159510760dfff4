"""Rank-1 BNNs (train_zoo.methods.rank1): folding, KL, reduction, samples, training.

Tolerances (why, in short):

* Folding is exact in real arithmetic: ``(W (x * s)) * r`` and ``(diag(r) W diag(s)) x``
  differ only in the order of float64 roundings, ~1e-16 of the outputs' scale; the tests
  allow 1e-10 of it. A wrong fold (r and s swapped, a grouped conv's channels mixed up,
  the bias scaled by r) is off by O(1).
* Rank one: the second singular value of ``W'_1 / W'_2`` over the first is ~1e-16 for an
  outer product; the test allows 1e-9, and checks that a random (BBB-like) perturbation
  of the same size is far above that.
* Monte Carlo checks (the Cauchy KL, the draws' quantiles, the uniform component choice,
  init's sign share) allow 5 standard errors of an average of independent terms. They are
  deterministic checks at their fixed seeds, not new draws: their random numbers are
  float64 uniforms and normals (``rank1.draw`` and ``init`` draw in the state's dtype,
  float64 here) or integers (``torch.randint``) from seeded torch.Generators, the same
  bits on every CPU (float32 normals are not: ATen's vectorised Box-Muller), moved by
  float64 arithmetic. Measured: the Cauchy KL's z 0.51, the quartiles' 0.18, 0.02, 0.10
  (of 5). (As new draws, 5 sd two-sided is 5.7e-7 per check.)
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.distributions import Cauchy, Normal, kl_divergence
from torch.func import functional_call

from posteriorzoo.errors import InvalidOptionError, ShapeMismatchError, UnknownNameError
from posteriorzoo.models import ResNet18, build
from posteriorzoo.symmetry import canonicalize, canonicalize_many
from train_zoo.loop import fit
from train_zoo.methods import rank1
from train_zoo.methods.common import parameters_of

TIGHT = 1e-10  # of the outputs' largest |entry|; see the module docstring


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _optunet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build("optunet").double()


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build("mlp", widths=(6, 5, 4, 3)).double()


def _resnet(seed: int = 0) -> nn.Module:
    """A small ResNet-18 whose BatchNorms have non-trivial statistics and affine maps, so
    folding a conv that a BN follows is really tested."""
    torch.manual_seed(seed)
    model = ResNet18(num_classes=3, width=2, in_channels=1).double()
    g = _generator(seed + 100)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                size = module.num_features
                module.running_mean.copy_(torch.randn(size, generator=g, dtype=torch.float64))
                module.running_var.copy_(
                    0.5 + torch.rand(size, generator=g, dtype=torch.float64))
                module.weight.copy_(1 + 0.3 * torch.randn(size, generator=g,
                                                          dtype=torch.float64))
                module.bias.copy_(0.3 * torch.randn(size, generator=g, dtype=torch.float64))
    return model


MODELS = {"optunet": (_optunet, (1, 28, 28)), "mlp": (_mlp, (6,)),
          "resnet": (_resnet, (1, 12, 12))}


def _state(model: nn.Module, seed: int = 1, components: int = 4, **options) -> rank1.Rank1State:
    """A state with distinct per-component biases (so a fold that ignores them fails)."""
    params, _ = parameters_of(model)
    state = rank1.init(model, params, components, _generator(seed), **options)
    g = _generator(seed + 50)
    biases = {key: torch.randn(value.shape, generator=g, dtype=value.dtype)
              for key, value in state.biases.items()}
    return dataclasses.replace(state, biases=biases)


def _row(factors: rank1.Draw, index: int) -> tuple[dict, dict]:
    return ({name: value[index] for name, value in factors.r.items()},
            {name: value[index] for name, value in factors.s.items()})


def _folded_output(model: nn.Module, state, factors: rank1.Draw, index: int,
                   inputs: torch.Tensor, buffers: dict) -> torch.Tensor:
    r, s = _row(factors, index)
    params = rank1.fold(rank1.component_params(state, int(factors.components[index])), r, s)
    return functional_call(model, (params, buffers), (inputs[index:index + 1],))


def _close(actual: torch.Tensor, expected: torch.Tensor, relative: float = TIGHT) -> None:
    actual, expected = actual.detach(), expected.detach()
    scale = float(expected.abs().max())
    assert float((actual - expected).abs().max()) <= relative * max(scale, 1e-30), (
        float((actual - expected).abs().max()), scale)


# -------------------------------------------------------------- folding is exact
def _layer_input(layer: nn.Module, count: int, g: torch.Generator) -> torch.Tensor:
    if isinstance(layer, nn.Linear):
        return torch.randn(count, layer.in_features, generator=g, dtype=torch.float64)
    return torch.randn(count, layer.in_channels, 9, 9, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_layers_rank1_forward_equals_its_folded_layer(name):
    """Every Conv2d / Linear layer on its own: the training-time forward pass (x * s, the
    layer, * r, + b_k) of each example under its own draw equals the folded layer."""
    model = MODELS[name][0]()
    layers = rank1.rank1_layers(model)
    assert layers, name
    g = _generator(3)
    for layer_name, original in layers.items():
        layer = copy.deepcopy(original).train()
        state = _state(layer, components=3)
        assert state.layers == [""]
        components = torch.tensor([0, 1, 2, 2, 0])
        factors = rank1.draw(state, components, g)
        inputs = _layer_input(layer, 5, g)
        out = rank1.forward(layer, state, inputs, factors)
        for index in range(5):
            expected = _folded_output(layer, state, factors, index, inputs, {})
            _close(out[index:index + 1], expected)
        assert layer_name in rank1.rank1_layers(model)


@pytest.mark.parametrize("name", ["optunet", "mlp"])
def test_network_forward_equals_its_folded_checkpoint(name):
    """Without BatchNorm, the training-mode forward pass of the whole network, one draw
    per example, equals each example's folded checkpoint."""
    build_model, shape = MODELS[name]
    model = build_model().train()
    state = _state(model)
    g = _generator(4)
    components = torch.tensor([3, 0, 1, 2, 1, 3])
    factors = rank1.draw(state, components, g)
    inputs = torch.randn(6, *shape, generator=g, dtype=torch.float64)
    out = rank1.forward(model, state, inputs, factors)
    for index in range(6):
        _close(out[index:index + 1], _folded_output(model, state, factors, index, inputs, {}))


def test_resnet_with_batchnorm_folds_exactly_in_evaluation_mode():
    """Convs followed by BatchNorm: in evaluation mode (fixed statistics) each example's
    output under its draw equals its folded checkpoint's, examples batched together."""
    model = _resnet().eval()
    state = _state(model)
    _, buffers = parameters_of(model)
    g = _generator(5)
    components = torch.tensor([0, 1, 2, 3, 0])
    factors = rank1.draw(state, components, g)
    inputs = torch.randn(5, 1, 12, 12, generator=g, dtype=torch.float64)
    out = rank1.forward(model, state, inputs, factors, buffers)
    for index in range(5):
        _close(out[index:index + 1],
               _folded_output(model, state, factors, index, inputs, buffers))


def test_batchnorm_in_training_mode_is_exact_for_one_example_only():
    """In training mode BN normalises over the batch it sees: one example under one draw
    still equals its folded checkpoint; a batch of several draws does not (the module
    docstring's statement), because the statistics pool every draw of the batch."""
    model = _resnet().train()
    state = _state(model)
    _, buffers = parameters_of(model)
    g = _generator(6)
    inputs = torch.randn(4, 1, 12, 12, generator=g, dtype=torch.float64)
    factors = rank1.draw(state, torch.tensor([2, 0, 1, 3]), g)
    single = dataclasses.replace(factors, components=factors.components[:1],
                                 r={k: v[:1] for k, v in factors.r.items()},
                                 s={k: v[:1] for k, v in factors.s.items()})
    alone = rank1.forward(model, state, inputs[:1], single, dict(buffers))
    _close(alone, _folded_output(model, state, factors, 0, inputs, dict(buffers)))
    pooled = rank1.forward(model, state, inputs, factors, dict(buffers))
    folded = _folded_output(model, state, factors, 0, inputs, dict(buffers))
    assert float((pooled[:1] - folded).abs().max()) > 1e-3


def test_grouped_conv_folds_per_group():
    """OptuNet's conv2 has two groups: input channel c feeds only its group's outputs, so
    s must be laid out per group (a fold that assumes one group fails here)."""
    conv = nn.Conv2d(4, 6, 3, groups=2, bias=False).double()
    weight = conv.weight.detach()
    r = torch.arange(1.0, 7.0, dtype=torch.float64)
    s = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    folded = rank1.fold({"weight": weight}, {"": r}, {"": s})["weight"]
    for out in range(6):
        group = out // 3
        for j in range(2):
            expected = weight[out, j] * r[out] * s[2 * group + j]
            assert torch.equal(folded[out, j], expected)


def test_fold_refuses_factors_that_do_not_fit():
    weight = torch.ones(3, 2, dtype=torch.float64)
    with pytest.raises(ShapeMismatchError, match="r has 4 entries"):
        rank1.fold({"fc.weight": weight}, {"fc": torch.ones(4)}, {"fc": torch.ones(2)})
    with pytest.raises(ShapeMismatchError, match="s has 5 entries"):
        rank1.fold({"fc.weight": weight}, {"fc": torch.ones(3)}, {"fc": torch.ones(5)})
    with pytest.raises(ShapeMismatchError, match="different layers"):
        rank1.fold({"fc.weight": weight}, {"fc": torch.ones(3)}, {"other": torch.ones(2)})
    with pytest.raises(ShapeMismatchError, match="holds no"):
        rank1.fold({"fc.weight": weight}, {"head": torch.ones(3)}, {"head": torch.ones(2)})


# ------------------------------------------------------------- r = s = 1 reduces
@pytest.mark.parametrize("name", sorted(MODELS))
def test_unit_factors_reduce_to_the_base_network(name):
    """r = s = 1 with the model's own bias (every component starts with it) is the base
    network: explicitly given, and drawn from a posterior concentrated at 1."""
    build_model, shape = MODELS[name]
    model = build_model().eval()
    params, buffers = parameters_of(model)
    state = rank1.init(model, params, 3, _generator(7))
    g = _generator(8)
    inputs = torch.randn(4, *shape, generator=g, dtype=torch.float64)
    expected = model(inputs)
    ones = rank1.Draw(torch.tensor([0, 1, 2, 0]),
                      {k: torch.ones(4, v.shape[1], dtype=v.dtype) for k, v in state.r_loc.items()},
                      {k: torch.ones(4, v.shape[1], dtype=v.dtype) for k, v in state.s_loc.items()})
    _close(rank1.forward(model, state, inputs, ones, buffers), expected)
    at_one = dataclasses.replace(
        state, r_loc={k: torch.ones_like(v) for k, v in state.r_loc.items()},
        s_loc={k: torch.ones_like(v) for k, v in state.s_loc.items()},
        r_rho={k: torch.full_like(v, -80.0) for k, v in state.r_rho.items()},
        s_rho={k: torch.full_like(v, -80.0) for k, v in state.s_rho.items()})
    tiled = rank1.logits(model, at_one, inputs, None, g, buffers)
    for component in range(3):
        _close(tiled[component], expected)
    folded = rank1.fold(params, {k: torch.ones(v.shape[1], dtype=v.dtype)
                                 for k, v in state.r_loc.items()},
                        {k: torch.ones(v.shape[1], dtype=v.dtype)
                         for k, v in state.s_loc.items()})
    assert all(torch.equal(folded[key], params[key]) for key in params)


# ---------------------------------------------------------------------------- KL
def _factor_distributions(state, family):
    for loc_name, rho_name in (("r_loc", "r_rho"), ("s_loc", "s_rho")):
        for layer in state.layers:
            loc = getattr(state, loc_name)[layer]
            yield family(loc, nn.functional.softplus(getattr(state, rho_name)[layer]))


def _spread_state(model, distribution, **options):
    """A state whose locations and scales vary (not only +/-1 and ~0.03)."""
    state = _state(model, distribution=distribution, **options)
    g = _generator(9)

    def jitter(values, spread):
        return {k: v + spread * torch.randn(v.shape, generator=g, dtype=v.dtype)
                for k, v in values.items()}

    return dataclasses.replace(state, r_loc=jitter(state.r_loc, 0.5),
                               s_loc=jitter(state.s_loc, 0.5),
                               r_rho=jitter(state.r_rho, 1.0), s_rho=jitter(state.s_rho, 1.0))


def test_gaussian_kl_is_torch_distributions_closed_form():
    options = {"prior_mean": 0.7, "prior_scale": 0.3}
    state = _spread_state(_optunet(), "gaussian", **options)
    prior = Normal(torch.tensor(0.7, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64))
    expected = sum(kl_divergence(q, prior).sum() for q in _factor_distributions(state, Normal))
    _close(rank1.kl_divergence(state), expected, 1e-12)
    mean_state = dataclasses.replace(
        state, options=dataclasses.replace(state.options, component_kl="mean"))
    _close(rank1.kl_divergence(mean_state), expected / state.components, 1e-12)


def test_cauchy_kl_closed_form_matches_monte_carlo_log_q_minus_log_p():
    """The reference estimates the Cauchy KL by Monte Carlo (one draw of log q - log p);
    the module uses its expectation in closed form. An average of log q - log p over
    independent draws (torch.distributions) agrees within 5 standard errors."""
    layer = nn.Linear(3, 2).double()
    state = _spread_state(layer, "cauchy", prior_mean=0.9, prior_scale=0.4, components=2)
    prior = Cauchy(torch.tensor(0.9, dtype=torch.float64), torch.tensor(0.4, dtype=torch.float64))
    g = _generator(10)
    draws = 20_000
    totals = torch.zeros(draws, dtype=torch.float64)
    for q in _factor_distributions(state, Cauchy):
        uniform = torch.rand(draws, *q.loc.shape, generator=g, dtype=torch.float64)
        x = q.icdf(uniform.clamp(1e-12, 1 - 1e-12))
        totals += (q.log_prob(x) - prior.log_prob(x)).reshape(draws, -1).sum(1)
    estimate, error = float(totals.mean()), float(totals.std() / math.sqrt(draws))
    closed = float(rank1.kl_divergence(state))
    assert abs(estimate - closed) < 5 * error, (estimate, closed, error)
    assert error < 0.05 * closed  # the check has power: the error bar is small


def test_cauchy_draws_are_cauchy():
    """Draws of a Cauchy component: quartiles at loc -/+ scale, median at loc."""
    layer = nn.Linear(1, 1).double()
    state = rank1.init(layer, dict(layer.named_parameters()), 1, _generator(11),
                       distribution="cauchy", init_std=0.5, clip=1e6)
    loc, scale = float(state.r_loc[""][0, 0]), float(nn.functional.softplus(state.r_rho[""][0, 0]))
    count = 40_000
    values = rank1.draw(state, torch.zeros(count, dtype=torch.long), _generator(12)).r[""][:, 0]
    for point, probability in ((loc - scale, 0.25), (loc, 0.5), (loc + scale, 0.75)):
        below = float((values < point).double().mean())
        assert abs(below - probability) < 5 * math.sqrt(probability * (1 - probability) / count)


def test_draws_are_clipped():
    layer = nn.Linear(2, 2).double()
    state = rank1.init(layer, dict(layer.named_parameters()), 1, _generator(13),
                       distribution="cauchy", init_std=5.0, clip=3.0)
    factors = rank1.draw(state, torch.zeros(2000, dtype=torch.long), _generator(14))
    values = torch.cat([factors.r[""].reshape(-1), factors.s[""].reshape(-1)])
    assert float(values.abs().max()) == 3.0


# ------------------------------------------------------------ samples and modes
def _rank_one_blocks(ratio: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """``ratio`` as the matrices that must be rank one: a conv's kernel axes must be
    constant (the factors do not depend on them), then one block per group."""
    if ratio.dim() > 2:
        flat = ratio.reshape(ratio.shape[0], ratio.shape[1], -1)
        assert float((flat - flat[..., :1]).abs().max()) <= 1e-9 * float(flat.abs().max())
        ratio = flat[..., 0]
    rows = ratio.shape[0] // groups
    return [ratio[g * rows:(g + 1) * rows] for g in range(groups)]


def _second_singular_ratio(matrix: torch.Tensor) -> float:
    values = torch.linalg.svdvals(matrix)
    return float(values[1] / values[0]) if values.numel() > 1 else 0.0


@pytest.mark.parametrize("name", ["optunet", "resnet"])
def test_two_samples_of_a_mode_differ_by_an_outer_product(name):
    """Every factored weight tensor of two samples of one trained network (any
    components): W'_1 / W'_2 = (r1 / r2)(s1 / s2)^T is rank one; the other tensors
    (BatchNorm's) are equal. A BBB-like perturbation of the same size is not rank one."""
    model = MODELS[name][0]().eval()
    state = _state(model)
    samples = rank1.sample(model, state, _generator(15), 4)
    layers = rank1.rank1_layers(model)
    weight_keys = {f"{layer}.weight" for layer in layers}
    g = _generator(16)
    for first, second in ((0, 1), (1, 2), (2, 3)):
        a, b = samples[first], samples[second]
        for layer, module in layers.items():
            key = f"{layer}.weight"
            groups = getattr(module, "groups", 1)
            blocks = _rank_one_blocks(a[key] / b[key], groups)
            assert not torch.equal(a[key], b[key])
            for block in blocks:
                assert _second_singular_ratio(block) < 1e-9, (key, _second_singular_ratio(block))
            noisy = a[key] * (1 + 0.03 * torch.randn(a[key].shape, generator=g,
                                                     dtype=a[key].dtype))
            if min(a[key].shape[:2]) > 1:
                unstructured = (noisy / b[key]).reshape(a[key].shape[0], -1)
                assert _second_singular_ratio(unstructured) > 1e-3
        for key in a:
            if key not in weight_keys and not key.endswith("bias"):
                assert torch.equal(a[key], b[key]), key


def test_samples_choose_components_uniformly_and_are_reproducible():
    model = _optunet()
    state = _state(model)
    count = 800
    samples = rank1.sample(model, state, _generator(17), count)
    again = rank1.sample(model, state, _generator(17), 3)
    assert all(torch.equal(samples[0][k], again[0][k]) for k in samples[0])
    bias_rows = state.biases["fc.bias"]
    chosen = [int(torch.argmin((bias_rows - sample["fc.bias"]).abs().sum(1)))
              for sample in samples]
    for component in range(4):
        share = chosen.count(component) / count
        assert abs(share - 0.25) < 5 * math.sqrt(0.25 * 0.75 / count)
    assert set(samples[0]) == set(model.state_dict())
    assert all(samples[0][k].dtype == v.dtype for k, v in model.state_dict().items())


def test_canonicalizer_keeps_the_function_of_folded_samples():
    """Folded samples are ordinary checkpoints: the canonicalizer (one at a time, and
    batched) returns checkpoints that compute the same function."""
    torch.manual_seed(0)
    model = build("optunet").eval()
    state = _state(model)
    samples = rank1.sample(model, state, _generator(18), 3)
    images = torch.randn(16, 1, 28, 28, generator=_generator(19))
    batched = canonicalize_many("optunet", {k: torch.stack([s[k] for s in samples])
                                            for k in samples[0]}, num_classes=10)
    for index, sample in enumerate(samples):
        expected = functional_call(model, sample, (images,))
        canonical = canonicalize("optunet", sample, num_classes=10)
        assert any(not torch.equal(canonical[k], sample[k]) for k in sample)
        expected_probs = torch.softmax(expected.double(), -1)
        for candidate in (canonical, {k: v[index].float() for k, v in batched.items()}):
            out = functional_call(model, candidate, (images,))
            _close(torch.softmax(out.double(), -1), expected_probs, 1e-4)


def test_canonicalizer_keeps_the_function_of_a_folded_resnet_sample():
    model = _resnet().eval()
    sample = rank1.sample(model, _state(model), _generator(20), 1)[0]
    images = torch.randn(4, 1, 12, 12, generator=_generator(21), dtype=torch.float64)
    canonical = canonicalize(model, sample, input_shape=(1, 12, 12))
    expected = torch.softmax(functional_call(model, sample, (images,)), -1)
    _close(torch.softmax(functional_call(model, canonical, (images,)), -1), expected, 1e-8)


# --------------------------------------------------------- forward pass and loss
def test_tiled_logits_and_the_log_mixture():
    """With the scales at ~0, row k of the tiled output is component k's folded network at
    its locations, and the evaluation's log-mixture is log mean_k p_k(y | x)."""
    model = _optunet().eval()
    state = _state(model)
    state = dataclasses.replace(
        state, r_rho={k: torch.full_like(v, -80.0) for k, v in state.r_rho.items()},
        s_rho={k: torch.full_like(v, -80.0) for k, v in state.s_rho.items()})
    g = _generator(22)
    images = torch.randn(5, 1, 28, 28, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 3, 9, 1, 1])
    tiled = rank1.logits(model, state, images, None, g)
    assert tiled.shape == (4, 5, 10)
    per_component = []
    for k in range(4):
        params = rank1.fold(rank1.component_params(state, k),
                            {n: v[k] for n, v in state.r_loc.items()},
                            {n: v[k] for n, v in state.s_loc.items()})
        out = functional_call(model, params, (images,))
        _close(tiled[k], out)
        per_component.append(torch.softmax(out, -1)[torch.arange(5), labels])
    expected = torch.log(torch.stack(per_component).mean(0))
    _close(rank1.mixture_log_likelihood(model, state, (images, labels), g, samples=3),
           expected, 1e-12)
    picked = rank1.logits(model, state, images, torch.tensor([2, 2, 0, 1, 3]), g)
    _close(picked[0], tiled[2, 0])
    _close(picked[4], tiled[3, 4])


def test_kl_scale_anneals_linearly_to_one():
    assert rank1.kl_scale(0, 100, 0.8) == pytest.approx(1 / 80)
    assert rank1.kl_scale(39, 100, 0.8) == pytest.approx(0.5)
    assert rank1.kl_scale(79, 100, 0.8) == 1.0
    assert rank1.kl_scale(99, 100, 0.8) == 1.0
    assert rank1.kl_scale(0, 100, 0.0) == 1.0


def test_loss_is_mean_component_nll_plus_annealed_kl_over_n_plus_l2():
    """Recomputed from its definition: each tiled row folded and run on its own (component
    k sees every example), averaged; the KL from torch.distributions; the L2 by hand."""
    model = _optunet().train()
    state = dataclasses.replace(_state(model, l2=1e-2), steps=9)
    _, buffers = parameters_of(model)
    g = _generator(23)
    images = torch.randn(3, 1, 28, 28, generator=g, dtype=torch.float64)
    labels = torch.tensor([4, 0, 7])
    noise = rank1.draw_noise(state, 4 * 3, g)
    terms, grads = rank1.loss_and_grad(state, model, buffers, (images, labels), None, 500,
                                       50, noise=noise)
    components = torch.arange(4).repeat_interleave(3)
    nll = 0.0
    for row in range(12):
        k = int(components[row])
        r = {n: (state.r_loc[n][k] + nn.functional.softplus(state.r_rho[n][k])
                 * noise[0][n][row]) for n in state.layers}
        s = {n: (state.s_loc[n][k] + nn.functional.softplus(state.s_rho[n][k])
                 * noise[1][n][row]) for n in state.layers}
        params = rank1.fold(rank1.component_params(state, k), r, s)
        out = functional_call(model, params, (images[row % 3:row % 3 + 1],))
        nll += float(nn.functional.cross_entropy(out, labels[row % 3:row % 3 + 1]))
    nll /= 12
    prior = Normal(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64))
    kl = float(sum(kl_divergence(q, prior).sum() for q in _factor_distributions(state, Normal)))
    squares = sum(float((v * v).sum()) for v in [*state.weights.values(),
                                                 *state.biases.values()])
    scale = 10 / (0.8 * 50)
    assert terms.kl_scale == pytest.approx(scale)
    assert float(terms.nll) == pytest.approx(nll, rel=1e-12)
    assert float(terms.kl) == pytest.approx(kl, rel=1e-12)
    assert float(terms.loss) == pytest.approx(nll + scale * kl / 500 + 1e-2 * squares,
                                              rel=1e-12)
    assert set(grads) == {"weights", "biases", "r_loc", "r_rho", "s_loc", "s_rho"}
    # One gradient entry of a factor location by central differences.
    step = 1e-6

    def loss_at(shift):
        moved = dict(state.r_loc)
        moved["conv2"] = state.r_loc["conv2"].clone()
        moved["conv2"][1, 3] += shift
        shifted = dataclasses.replace(state, r_loc=moved)
        return float(rank1.loss_and_grad(shifted, model, buffers, (images, labels), None,
                                         500, 50, noise=noise)[0].loss)

    numeric = (loss_at(step) - loss_at(-step)) / (2 * step)
    assert float(grads["r_loc"]["conv2"][1, 3]) == pytest.approx(numeric, rel=1e-5, abs=1e-9)


def test_update_is_torch_sgd_with_nesterov_momentum():
    model = _mlp()
    state = _state(model)
    g = _generator(24)
    reference = {part: {name: value.clone().requires_grad_(True) for name, value in group.items()}
                 for part, group in state.trainable().items()}
    optimizer = torch.optim.SGD([v for group in reference.values() for v in group.values()],
                                lr=0.05, momentum=0.9, nesterov=True)
    for _ in range(3):
        grads = {part: {name: torch.randn(v.shape, generator=g, dtype=v.dtype)
                        for name, v in group.items()} for part, group in reference.items()}
        for part, group in reference.items():
            for name, value in group.items():
                value.grad = grads[part][name].clone()
        optimizer.step()
        state = rank1.update(state, grads, 0.05)
    assert state.steps == 3
    for part, group in state.trainable().items():
        for name, value in group.items():
            _close(value, reference[part][name].detach(), 1e-12)


# ---------------------------------------------------------------------- init
def test_init_random_signs_scales_and_biases():
    layer = nn.Linear(300, 200).double()
    params = {k: v.detach().clone() for k, v in layer.named_parameters()}
    state = rank1.init(layer, params, 4, _generator(25))
    again = rank1.init(layer, params, 4, _generator(25))
    assert torch.equal(state.r_loc[""], again.r_loc[""])
    assert torch.equal(state.s_rho[""], again.s_rho[""])
    locs = torch.cat([state.r_loc[""].reshape(-1), state.s_loc[""].reshape(-1)])
    assert set(locs.unique().tolist()) == {-1.0, 1.0}
    share = float((locs > 0).double().mean())
    assert abs(share - 0.5) < 5 * math.sqrt(0.25 / locs.numel())
    rho = torch.cat([state.r_rho[""].reshape(-1), state.s_rho[""].reshape(-1)])
    centre = math.log(math.expm1(rank1.INIT_STD))
    assert float((rho - centre).abs().max()) <= 2 * rank1.RHO_SPREAD
    assert abs(float(rho.mean()) - centre) < 0.01
    assert 0.06 < float(rho.std()) < 0.1  # a normal of 0.1 cut at 2 sd has sd 0.088
    assert float(nn.functional.softplus(torch.tensor(centre))) == pytest.approx(0.0316, abs=1e-4)
    assert state.biases["bias"].shape == (4, 200)
    assert all(torch.equal(row, params["bias"]) for row in state.biases["bias"])
    assert torch.equal(state.weights["weight"], params["weight"])
    assert "bias" not in state.weights
    positive = rank1.init(layer, params, 2, _generator(26), sign_probability=1.0,
                          distribution="cauchy")
    assert bool((positive.r_loc[""] == 1).all())
    assert bool((positive.s_rho[""] == centre).all())


def test_rank1_layers_default_to_all_and_can_be_chosen():
    model = _resnet()
    every = rank1.rank1_layers(model)
    assert list(every) == [name for name, m in model.named_modules()
                           if isinstance(m, (nn.Conv2d, nn.Linear))]
    state = _state(model, layers=["conv1", "fc"])
    assert state.layers == ["conv1", "fc"]
    samples = rank1.sample(model, state, _generator(27), 2)
    assert torch.equal(samples[0]["layer1.0.conv1.weight"], samples[1]["layer1.0.conv1.weight"])
    with pytest.raises(InvalidOptionError, match="layers: .*'bn1'"):
        _state(model, layers=["bn1"])
    with pytest.raises(InvalidOptionError, match="no Conv2d or Linear"):
        rank1.rank1_layers(nn.Sequential(nn.ReLU()))


def test_init_refuses_parameters_of_another_network():
    model = _optunet()
    params, _ = parameters_of(model)
    with pytest.raises(ShapeMismatchError, match="missing"):
        rank1.init(model, {k: v for k, v in params.items() if k != "fc.bias"}, 4, _generator(0))
    params["fc.weight"] = torch.zeros(3, 3)
    with pytest.raises(ShapeMismatchError, match="fc.weight"):
        rank1.init(model, params, 4, _generator(0))


# ------------------------------------------------------------------- options
@pytest.mark.parametrize(("option", "value"), [
    ("components", 0), ("components", 65), ("components", 2.5), ("components", True),
    ("distribution", "laplace"), ("prior_mean", float("nan")), ("prior_scale", 0),
    ("prior_scale", -1.0), ("init_std", 0.0), ("sign_probability", 1.5),
    ("kl_annealing", -0.1), ("kl_annealing", 1.1), ("l2", -1e-4),
    ("component_kl", "max"), ("clip", 0), ("layers", "fc"), ("layers", []),
    ("layers", ["fc", "fc"]), ("layers", [""]),
])
def test_bad_options_are_one_clear_error(option, value):
    with pytest.raises(InvalidOptionError, match=f"^{option}"):
        rank1.Rank1Options(**{option: value})
    with pytest.raises(InvalidOptionError, match=f"^{option}"):
        rank1.resolve_options({option: value})


def test_resolve_options_records_every_option():
    record = rank1.resolve_options({"distribution": "cauchy", "layers": ("fc",)})
    assert set(record) == set(rank1.OPTION_HELP)
    assert {f.name for f in dataclasses.fields(rank1.Rank1Options)} == set(rank1.OPTION_HELP)
    assert record["distribution"] == "cauchy" and record["layers"] == ["fc"]
    assert record["components"] == 4 and record["prior_mean"] == 1.0
    assert record["prior_scale"] == 0.1 and record["l2"] == 1e-4
    with pytest.raises(UnknownNameError, match="unknown rank1 option"):
        rank1.resolve_options({"ensemble_size": 4})


def test_run_and_update_validate_their_numbers():
    with pytest.raises(InvalidOptionError, match="total_steps"):
        rank1.Rank1Run(_generator(0), 100, 0)
    with pytest.raises(InvalidOptionError, match="nesterov"):
        rank1.Rank1Run(_generator(0), 100, 10, momentum=0.0)
    state = _state(_mlp())
    with pytest.raises(InvalidOptionError, match="components must be in"):
        rank1.draw(state, torch.tensor([4]), _generator(0))


# ------------------------------------------------------------------ training
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's 8x8 digits, flattened to 64 standardised features."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32)
    images = (images - images.mean(0)) / (images.std(0) + 1e-3)
    return images, torch.tensor(digits.target, dtype=torch.long)


def test_short_training_on_digits_lowers_the_loss_and_the_test_nll():
    """A few epochs of the stepper under :func:`train_zoo.loop.fit` on sklearn digits (an
    MLP 64-32-10, every layer rank-1): the training loss, its NLL term and the
    log-mixture NLL of held-out digits go down."""
    images, labels = _digits()
    train_x, train_y, test_x, test_y = images[:1500], labels[:1500], images[1500:], labels[1500:]
    torch.manual_seed(0)
    model = build("mlp", widths=(64, 32, 10))
    params, _ = parameters_of(model)
    state = rank1.init(model, params, 4, _generator(28), kl_annealing=0.0)
    batch, epochs = 50, 2
    steps_per_epoch = len(train_x) // batch
    run = rank1.Rank1Run(_generator(29), len(train_x), epochs * steps_per_epoch)
    stepper = rank1.Rank1Stepper(state, model, run)
    losses = []

    class Record:
        def on_step_end(self, info, weights):
            losses.append(info.loss)

    def batches(epoch):
        order = torch.randperm(len(train_x), generator=_generator(100 + epoch))
        for start in range(0, steps_per_epoch * batch, batch):
            index = order[start:start + batch]
            yield train_x[index], train_y[index]

    before = -float(rank1.mixture_log_likelihood(model, state, (test_x, test_y),
                                                 _generator(30)).mean())
    result = fit(stepper, batches, lambda epoch: 0.05, epochs,
                 callbacks=[Record(), stepper.log])
    assert result.steps == epochs * steps_per_epoch and not result.stopped
    after = -float(rank1.mixture_log_likelihood(model, stepper.rank1_state(), (test_x, test_y),
                                                _generator(30)).mean())
    first, last = (sum(losses[:steps_per_epoch]) / steps_per_epoch,
                   sum(losses[-steps_per_epoch:]) / steps_per_epoch)
    record = stepper.log.record()
    assert record["last_epoch"]["loss"] == pytest.approx(last, rel=1e-9)
    assert last < first - 0.3, (first, last)
    assert record["last_epoch"]["nll"] < record["first_epoch"]["nll"] - 0.3
    assert after < before - 0.5, (before, after)
    assert set(stepper.arrays()) == set(model.state_dict())
