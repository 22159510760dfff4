"""``resnet20-frn-silu``: the layout, FRN against its formula, one SGD step, the release's
``model.`` keys imported with no key map, and the symmetries (permutations, FRN's
scale and sign, nothing through SiLU) removed with the function kept.

Tolerances. Every function check runs in float64. Two networks equal in exact arithmetic
differ by rounding only: ``2 gamma(R)`` of the largest logit, R the roundings on the
longest path (:func:`_roundings`, the convention of ``rounding_bounds.deep_rtol``; it
does not count SiLU's slope, at most 1.1, nor FRN's carrying of a relative error, so it
is the repository's convention, not a worst case: the measured differences are about
1e-15 against bounds of about 1e-12).

FRN's eps is the one inexact part of the symmetry: ``FRN_eps(a x) = FRN_(eps/a^2)(x)``
exactly, so a network moved by scales ``a`` *is* the original with each channel's eps
divided by ``a_c^2``. The tests check that identity to rounding, and the logits' change
it makes against its first-order size ``sum |d logit / d eps_c| |eps'_c - eps|`` (in
float64 autograd), doubled: the second-order remainder is within ``delta`` of the first
order term, ``delta = max eps |1 - a^-2| / nu2``, asserted below 1e-2.
"""

from __future__ import annotations

import copy
import io
import math
import tarfile

import numpy as np
import pytest
import torch
from rounding_bounds import U64, forward_terms, gamma
from safetensors.torch import save as save_safetensors_bytes
from safetensors.torch import save_file
from test_canonicalize_batch import canonical_roundings
from torch import nn

from posteriorzoo.collection import import_checkpoints
from posteriorzoo.errors import InvalidOptionError, ZooSchemaError
from posteriorzoo.models import FilterResponseNorm2d, build, parameter_count
from posteriorzoo.symmetry import (
    apply_symmetry,
    canonicalize,
    min_mass,
    random_symmetry,
    sample_permutations,
    sample_signs,
    symmetry_structure,
)
from posteriorzoo.zoo import open_zoo

NAME = "resnet20-frn-silu"
OPTIONS = {"width": 4}
EPS = 1e-6


# ------------------------------------------------------------------ helpers
def _model(seed: int = 0, **options) -> nn.Module:
    """A width-4 network in float64 whose FRN parameters are not at their initial values:
    gamma of both signs, a threshold tau that cuts part of every channel."""
    torch.manual_seed(seed)
    model = build(NAME, **{**OPTIONS, **options}).double().eval()
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, FilterResponseNorm2d):
            for tensor, low, high in ((module.gamma, 0.5, 1.5), (module.beta, -0.5, 0.5),
                                      (module.tau, -1.0, 0.3)):
                tensor.data = low + (high - low) * torch.rand(
                    tensor.shape, generator=generator, dtype=torch.float64)
            signs = torch.randint(0, 2, module.gamma.shape, generator=generator)
            module.gamma.data *= 2.0 * signs - 1.0
    return model


def _inputs(n: int = 4, size: int = 16) -> torch.Tensor:
    return torch.randn(n, 3, size, size, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))


def _frns(model: nn.Module) -> dict[str, FilterResponseNorm2d]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FilterResponseNorm2d)}


def _twin(model: nn.Module, state: dict | None = None,
          eps: dict[str, torch.Tensor | float] | float = EPS) -> nn.Module:
    """A copy of ``model`` (with ``state``) whose FRN layers use ``eps``: one number, or a
    per-layer number or (1, C, 1, 1) tensor, which FRN's ``nu2 + eps`` broadcasts."""
    twin = copy.deepcopy(model)
    if state is not None:
        twin.load_state_dict(state)
    for name, frn in _frns(twin).items():
        frn.eps = eps[name] if isinstance(eps, dict) else eps
    return twin


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return out - out.mean(1, keepdim=True)  # the softmax shift moves every logit alike


#: one FRN output's roundings: x^2, the mean over P positions (P - 1 sums, a division),
#: + eps, rsqrt, x * r, gamma *, + beta (the max is exact): P + 6
def _frn_roundings(positions: int) -> int:
    return positions + 6


SILU_ROUNDINGS = 4  # exp, 1 +, the division, x *


def _roundings(model: nn.Module, x: torch.Tensor) -> int:
    """forward_terms of ``model`` with every FRN and SiLU call counted as above (both then
    replaced by an identity: forward_terms knows torch's layers only), plus each weight's
    two scale products, the logits' mean and its subtraction (K + 2) and the difference."""
    counted, extra = copy.deepcopy(model), 0

    def count(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        nonlocal extra
        extra += (SILU_ROUNDINGS if isinstance(module, nn.SiLU)
                  else _frn_roundings(out[0, 0].numel()))

    hooks = [m.register_forward_hook(count) for m in counted.modules()
             if isinstance(m, FilterResponseNorm2d | nn.SiLU)]
    with torch.no_grad():
        classes = counted(x).shape[1]
    for hook in hooks:
        hook.remove()
    for module in list(counted.modules()):
        for child, value in list(module.named_children()):
            if isinstance(value, FilterResponseNorm2d | nn.SiLU):
                setattr(module, child, nn.Identity())
    return forward_terms(counted, x) + extra + 2 + classes + 2 + 1


def _rounding_bound(model: nn.Module, x: torch.Tensor, more: int = 0) -> float:
    return 2 * gamma(_roundings(model, x) + more, U64)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _frn_of(conv_key: str) -> str:
    """The FRN after a convolution, by the layout: ``X.convK`` -> ``X.bnK``,
    ``X.shortcut.0`` -> ``X.shortcut.1``."""
    layer = conv_key.rsplit(".", 1)[0]
    if layer.endswith("shortcut.0"):
        return layer[:-1] + "1"
    head, _, conv = layer.rpartition(".")
    return (head + "." if head else "") + conv.replace("conv", "bn")


def _scaled_eps(structure, scales: dict[int, np.ndarray]) -> dict[str, torch.Tensor]:
    """Each FRN's per-channel eps that makes the original network equal to the one moved
    by ``scales`` (in the original's channel order): eps / a^2."""
    eps = {}
    for index, factors in scales.items():
        conv = structure.scales[index].writers[0].key
        eps[_frn_of(conv)] = EPS / torch.as_tensor(factors).reshape(1, -1, 1, 1) ** 2
    return eps


def _input_mean_squares(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """(N, C) mean square of every FRN's input channels on ``x``."""
    found: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(
        lambda module, args, out, name=name: found.__setitem__(
            name, args[0].square().mean(dim=(2, 3))))
        for name, m in _frns(model).items()]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return found


def _first_order(model: nn.Module, x: torch.Tensor, new_eps: dict[str, torch.Tensor]
                 ) -> torch.Tensor:
    """(N, K) ``sum over FRN channels |d logit / d eps_c| |new eps_c - eps|`` at eps (the
    logits centred as :func:`_logits` does), in float64 autograd."""
    twin = _twin(model)
    leaves = {}
    for name, frn in _frns(twin).items():
        frn.eps = leaves[name] = torch.full_like(frn.gamma, EPS, requires_grad=True)
    steps = {name: (new_eps[name] - EPS).abs() for name in leaves}
    out = twin(x)
    out = out - out.mean(1, keepdim=True)
    total = torch.zeros_like(out)
    for b in range(out.shape[0]):
        for k in range(out.shape[1]):
            grads = torch.autograd.grad(out[b, k], list(leaves.values()), retain_graph=True)
            total[b, k] = sum((g.abs() * steps[n]).sum() for n, g in zip(leaves, grads,
                                                                          strict=True))
    return total.detach()


def _delta(model: nn.Module, x: torch.Tensor, new_eps: dict[str, torch.Tensor]) -> float:
    """max over FRN channels and examples of |new eps - eps| / nu2."""
    squares = _input_mean_squares(_twin(model), x)
    return max(float(((new_eps[n].reshape(1, -1) - EPS).abs() / squares[n]).max())
               for n in new_eps)


# ------------------------------------------------------------------ the model
def test_layout_and_forward():
    """torch-uncertainty's keys and shapes (FRN as ``bn*`` with tau, beta, gamma of shape
    (1, C, 1, 1), ``shortcut.0/1``, ``linear``), the parameter count from the layer
    sizes, and a forward pass."""
    model = build(NAME)
    state = model.state_dict()
    assert list(state)[:5] == ["conv1.weight", "conv1.bias", "bn1.tau", "bn1.beta",
                               "bn1.gamma"]
    assert state["layer2.0.shortcut.0.weight"].shape == (32, 16, 1, 1)
    assert state["layer3.2.bn2.gamma"].shape == (1, 64, 1, 1)
    assert list(state)[-2:] == ["linear.weight", "linear.bias"]
    assert not any("layer4" in key or "fc" in key for key in state)
    # conv kxk from c to d with bias: (c k^2 + 1) d; FRN 3 d; linear (64 + 1) 10
    convs = [(3, 16, 3)] + [(16, 16, 3)] * 6 + [(16, 32, 3), (32, 32, 3), (16, 32, 1)] + \
        [(32, 32, 3)] * 4 + [(32, 64, 3), (64, 64, 3), (32, 64, 1)] + [(64, 64, 3)] * 4
    expected = sum((c * k * k + 1) * d + 3 * d for c, d, k in convs) + 65 * 10
    assert parameter_count(NAME) == expected == 274_042
    assert parameter_count(NAME, conv_bias=False) == expected - sum(d for _, d, _ in convs)
    assert "conv1.bias" not in build(NAME, conv_bias=False).state_dict()
    assert build(NAME, in_channels=1).conv1.weight.shape == (16, 1, 3, 3)
    with torch.no_grad():
        logits = model.eval()(torch.randn(3, 3, 32, 32, generator=torch.Generator()
                                          .manual_seed(0)))
    assert logits.shape == (3, 10) and torch.isfinite(logits).all()
    with pytest.raises(InvalidOptionError, match="conv_bias must be true or false"):
        build(NAME, conv_bias="yes")


def test_frn_matches_its_formula():
    """FRN against numpy: nu2 = mean x^2 over H, W; y = gamma x / sqrt(nu2 + eps) + beta;
    max(y, tau). One float64 expression each side, a few roundings: within 16 gamma(P)."""
    rng = np.random.default_rng(0)
    frn = FilterResponseNorm2d(5, eps=1e-3).double()
    for tensor in (frn.tau, frn.beta, frn.gamma):
        tensor.data = torch.from_numpy(rng.normal(size=(1, 5, 1, 1)))
    x = rng.normal(size=(2, 5, 7, 7)) * rng.uniform(0.01, 3, size=(1, 5, 1, 1))
    nu2 = (x ** 2).mean(axis=(2, 3), keepdims=True)
    gamma_, beta, tau = (t.detach().numpy() for t in (frn.gamma, frn.beta, frn.tau))
    expected = np.maximum(gamma_ * x / np.sqrt(nu2 + 1e-3) + beta, tau)
    with torch.no_grad():
        got = frn(torch.from_numpy(x)).numpy()
    scale = np.abs(gamma_) * np.abs(x) / np.sqrt(nu2 + 1e-3) + np.abs(beta)
    assert (np.abs(got - expected) <= 16 * gamma(49, U64) * scale).all()
    assert (got == tau).any() and (got > tau).any()   # the threshold cuts, and not all


def test_one_sgd_step_through_the_trainers_model():
    """The trainer builds it like any registered model: one SGD step of the CIFAR recipe
    on a batch moves every parameter and keeps the loss finite."""
    from train_zoo import make_spec
    from train_zoo.torch_engine import initial_model

    spec = make_spec("resnet18-cifar100", architecture=NAME, num_classes=10,
                     model_options={"width": 2}, checkpoints=1, base_seed=3)
    model = initial_model(spec, 0)
    assert isinstance(model.bn1, FilterResponseNorm2d)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(8, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (8,), generator=generator)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = nn.functional.cross_entropy(model.train()(images), labels)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert all(not torch.equal(before[name], value) for name, value in
               model.named_parameters())


def _torch_uncertainty_state(seed: int, **options) -> dict[str, torch.Tensor]:
    """What the release holds: the network's state under the training routine's attribute
    ``model``, in float16."""
    torch.manual_seed(seed)
    return {f"model.{key}": value.half().contiguous()
            for key, value in build(NAME, **options).state_dict().items()}


def _release_archive(path, states: list[dict[str, torch.Tensor]]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for index, state in enumerate(states):
            data = save_safetensors_bytes(state)
            info = tarfile.TarInfo(f"cifar10-resnet20-frn-silu/model_{index}.safetensors")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.filterwarnings("ignore:.* input checkpoint.s. record no SHA-256")
def test_release_keys_import_with_no_key_map(tmp_path):
    """A release-format archive of ``model.``-prefixed float16 states imports through the
    normal path with no key map and no attributes (the archive's name implies them), and
    a loose file of the same kind appends to it; every tensor as saved."""
    states = [_torch_uncertainty_state(seed) for seed in range(3)]
    archive = tmp_path / "cifar10-resnet20-frn-silu-0-1.tgz"
    _release_archive(archive, states[:2])
    result = import_checkpoints(tmp_path / "z.h5", [archive])
    assert result.indices == range(2)
    assert result.provenance["options"]["key_map"]["rules"] == [("^model\\.", "")]
    save_file(states[2], str(tmp_path / "model_2.safetensors"))
    assert import_checkpoints(tmp_path / "z.h5", [tmp_path / "model_2.safetensors"]
                              ).indices == range(2, 3)
    with open_zoo(tmp_path / "z.h5") as zoo:
        assert (zoo.architecture, zoo.dataset, zoo.num_classes) == (NAME, "cifar10", 10)
        for index, state in enumerate(states):
            stored = zoo.state_dict(index)
            assert zoo.metadata_dict(index)["source"].endswith(f"model_{index}.safetensors")
            assert set(stored) == {key[len("model."):] for key in state}
            assert all(torch.equal(stored[key[len("model."):]], value)
                       for key, value in state.items())
    # convolutions without biases (torch-uncertainty's default since 2025): the option
    biasless = tmp_path / "cifar10-resnet20-frn-silu-0-0.tgz"
    _release_archive(biasless, [_torch_uncertainty_state(0, conv_bias=False)])
    with pytest.raises(ZooSchemaError, match="does not fit model 'resnet20-frn-silu'"):
        import_checkpoints(tmp_path / "refused.h5", [biasless])
    assert not (tmp_path / "refused.h5").exists()
    assert import_checkpoints(tmp_path / "biasless.h5", [biasless],
                              model_options={"conv_bias": False}).indices == range(1)


# ------------------------------------------------------------------ the symmetries
def test_structure_permutations_frn_scales_and_no_silu_scaling():
    """Residual streams tie their convolutions; every convolution's output gets a scale
    variable that its FRN absorbs (no reader, eps recorded) and a sign that gamma absorbs;
    nothing is scaled through SiLU. The same network with ReLU in place of SiLU does get
    FRN's output scale (tau, beta, gamma) read by the next convolution: the check fails
    where a scale passes."""
    model = _model()
    structure = symmetry_structure(model, model.state_dict(), input_shape=(3, 32, 32))
    assert structure.gaps == []
    writers = [{axis.key.rsplit(".", 1)[0] for axis in space.writers}
               for space in structure.spaces]
    stream1 = {"conv1", "bn1"} | {f"layer1.{b}.{m}" for b in range(3) for m in ("conv2", "bn2")}
    assert stream1 in writers
    assert {"layer2.0.shortcut.0", "layer2.0.shortcut.1", "layer2.2.conv2"} <= next(
        w for w in writers if "layer2.0.shortcut.0" in w)
    assert len(structure.permutable()) == 12   # 3 streams, 9 blocks' inner channels
    convs = [key[:-len(".weight")] for key in model.state_dict()
             if key.endswith(".weight") and model.state_dict()[key].dim() == 4]
    scalable = [structure.scales[i] for i in structure.scalable()]
    assert sorted(v.writers[0].key[:-len(".weight")] for v in scalable) == sorted(convs)
    for variable in scalable:
        layer = variable.writers[0].key[:-len(".weight")]
        assert [a.key for a in variable.writers] == [f"{layer}.weight", f"{layer}.bias"]
        assert variable.readers == [] and variable.through_batchnorm
        assert variable.epsilon == EPS
    flippable = [structure.signs[i] for i in structure.flippable()]
    assert sorted(v.readers[0].key for v in flippable) == sorted(
        f"{_frn_of(c + '.weight')}.gamma" for c in convs)
    # FRN outputs (tau, beta, gamma) meet SiLU: fixed; no scale reaches a next layer
    for variable in structure.scales:
        if any(axis.key.endswith(".tau") for axis in variable.writers):
            assert variable.fixed
        assert not any(axis.power == -1 for axis in variable.readers) or variable.fixed
    silu = [n for n in structure.notes if "(SiLU): neither positively homogeneous nor odd" in n]
    assert len(silu) == 1 + 2 * 9
    assert any("eps = 1e-06" in n and "FilterResponseNorm2d" in n for n in structure.notes)

    relu = copy.deepcopy(model)
    for module in relu.modules():
        if hasattr(module, "activation"):
            module.activation = nn.ReLU()
    passed = symmetry_structure(relu, relu.state_dict(), input_shape=(3, 32, 32))
    through = [passed.scales[i] for i in passed.scalable()
               if any(a.key.endswith(".tau") for a in passed.scales[i].writers)]
    assert through and all(any(a.power == -1 for a in v.readers) for v in through)


def test_frn_absorbs_a_scale_up_to_its_eps():
    """One FRN layer: FRN_eps(a x) = FRN_(eps/a^2)(x) to rounding, and the difference to
    FRN_eps(x) within |gamma| |x_hat| eps / nu2 |1 - a^-2| per entry (module docstring of
    posteriorzoo.symmetry.structure), half reached on a loud channel."""
    rng = np.random.default_rng(2)
    frn = FilterResponseNorm2d(6, eps=1e-4).double()
    frn.gamma.data = torch.from_numpy(rng.normal(size=(1, 6, 1, 1)))
    frn.beta.data = torch.from_numpy(rng.normal(size=(1, 6, 1, 1)))
    frn.tau.data = torch.full((1, 6, 1, 1), -10.0)   # below everything: the affine part
    x = torch.from_numpy(rng.normal(size=(3, 6, 5, 5)) * np.geomspace(1e-2, 1, 6)
                         .reshape(1, 6, 1, 1))
    a = torch.from_numpy(np.array([0.1, 0.5, 2.0, 10.0, 1.0, 0.3]).reshape(1, 6, 1, 1))
    nu2 = x.square().mean(dim=(2, 3), keepdim=True)
    with torch.no_grad():
        moved, original = frn(a * x), frn(x)
        other = copy.deepcopy(frn)
        other.eps = 1e-4 / a ** 2
        same = other(x)
    scale = (frn.gamma.abs() * (x.abs() / (nu2 + 1e-4).sqrt()) + frn.beta.abs()).detach()
    assert ((moved - same).abs() <= 16 * gamma(25, U64) * scale).all()
    x_hat = x / (nu2 + 1e-4).sqrt()
    bound = frn.gamma.detach().abs() * x_hat.abs() * 1e-4 / nu2 * (1 - a ** -2).abs()
    rounding = 16 * gamma(25, U64) * scale
    assert ((moved - original).abs() <= bound + rounding).all()
    # a loud channel (nu2 >> eps / a^2) reaches 1 / (1 + r), about half of the bound
    loud = (moved - original)[:, 5].abs().max() / bound[:, 5].max()
    assert 0.4 < float(loud) <= 1


def _moved(model: nn.Module, seed: int, low: float, high: float):
    """A random group element (permutations, FRN scales in [low, high], signs, a softmax
    shift) applied to the float64 state; returns the new state and the scales."""
    structure = symmetry_structure(model, model.state_dict(), input_shape=(3, 32, 32))
    rng = np.random.default_rng(seed)
    scales = {i: np.exp(rng.uniform(math.log(low), math.log(high),
                                    structure.spaces[structure.scales[i].space].size))
              for i in structure.scalable()}
    state = apply_symmetry(model.state_dict(), structure, sample_permutations(structure, rng),
                           scales, float(rng.standard_normal()), sample_signs(structure, rng))
    return state, structure, scales


@pytest.mark.parametrize("seed", [0, 1])
def test_a_random_symmetry_keeps_the_logits(seed):
    """With eps = 0 the group element keeps the logits to rounding; with eps = 1e-6 the
    moved network equals the original with eps / a^2 to rounding, and differs from the
    original by at most twice the first-order change (module docstring)."""
    model, x = _model(seed), _inputs()
    state, structure, scales = _moved(model, seed, 0.5, 2.0)
    bound = _rounding_bound(model, x)
    exact = _relative(_logits(_twin(model, state, 0.0), x), _logits(_twin(model, eps=0.0), x))
    assert exact <= bound
    moved = _logits(_twin(model, state), x)
    new_eps = _scaled_eps(structure, scales)
    assert _relative(moved, _logits(_twin(model, eps=new_eps), x)) <= bound
    assert _delta(model, x, new_eps) < 1e-2
    original = _logits(_twin(model), x)
    limit = 2 * _first_order(model, x, new_eps) + bound * float(original.abs().max())
    change = (moved - original).abs()
    assert (change <= limit).all()
    assert float(change.max()) > 1e3 * bound * float(original.abs().max())  # eps matters


def test_canonical_forms_agree_and_keep_the_function():
    """Two moved copies (scales in [0.1, 10]) and the original share one canonical form to
    the bound of test_symmetry_structure's _canonical_rtol; the canonical network is the
    original with each FRN channel's eps times the squared norm of its convolution's
    weights and bias (to rounding), and within twice that first-order change of it."""
    model, x = _model(3), _inputs()
    state = model.state_dict()
    canonical = canonicalize(model, state, input_shape=(3, 32, 32))
    structure = symmetry_structure(model, state, input_shape=(3, 32, 32))
    extra = {"input_shape": (3, 32, 32)}
    layers = len(structure.scalable())
    rtol = 4 * gamma(canonical_roundings(model, state, extra), U64) + 2 * (2 * layers + 1) * U64
    for seed in (4, 5):
        moved = random_symmetry(model, state, seed, scale_range=(0.1, 10.0),
                                input_shape=(3, 32, 32))
        again = canonicalize(model, moved, input_shape=(3, 32, 32))
        absolute = gamma(12, U64) * float(moved["linear.bias"].abs().max())
        for key, value in canonical.items():
            assert float((again[key] - value).abs().max()) <= (
                rtol * float(value.abs().max()) + (absolute if key == "linear.bias" else 0))
    # the function: exact with eps = 0; with eps, the original at eps |(w_c, b_c)|^2
    more = canonical_roundings(model, state, extra)
    bound = _rounding_bound(model, x, more)
    assert _relative(_logits(_twin(model, canonical, 0.0), x),
                     _logits(_twin(model, eps=0.0), x)) <= bound
    norms = {}
    for index in structure.scalable():
        keys = [axis.key for axis in structure.scales[index].writers]
        rows = torch.cat([state[k].reshape(state[k].shape[0], -1) for k in keys], dim=1)
        norms[_frn_of(keys[0])] = EPS * rows.square().sum(1).reshape(1, -1, 1, 1)
    kept = _logits(_twin(model, canonical), x)
    assert _relative(kept, _logits(_twin(model, eps=norms), x)) <= bound
    original = _logits(_twin(model), x)
    limit = 2 * _first_order(model, x, norms) + bound * float(original.abs().max())
    assert ((kept - original).abs() <= limit).all()


def test_frn_output_scale_has_a_mass_minimum_under_relu():
    """With ReLU in place of SiLU, FRN's output scale (tau, beta, gamma, laid out (1, C,
    1, 1)) passes to the next convolution: min-mass moves it, lowers the mass and keeps
    the function (exactly with eps = 0; FRN's own input scale is left to ``norm``)."""
    model, x = _model(6), _inputs()
    for module in model.modules():
        if hasattr(module, "activation"):
            module.activation = nn.ReLU()
    state = model.state_dict()
    result = min_mass(model, state, input_shape=(3, 32, 32))
    assert result.mass_after < 0.9 * result.mass_before
    moved = [i for i, factors in result.scales.items()
             if np.abs(np.log(factors)).max() > 1e-3]
    structure = symmetry_structure(model, state, input_shape=(3, 32, 32))
    assert moved and all(any(a.key.endswith(".tau") for a in structure.scales[i].writers)
                         for i in moved)
    canonical = canonicalize(model, state, scaling="minmass", input_shape=(3, 32, 32))
    more = canonical_roundings(model, state, {"input_shape": (3, 32, 32)}, "minmass")
    assert _relative(_logits(_twin(model, canonical, 0.0), x),
                     _logits(_twin(model, eps=0.0), x)) <= _rounding_bound(model, x, more)
