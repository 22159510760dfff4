"""Symmetry structure traced with torch.fx, and random group elements that keep the function."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from rounding_bounds import U64, forward_terms, gamma
from test_canonicalize_batch import canonical_roundings, newton_radius
from torch import nn

from posteriorzoo.errors import NonFiniteWeightsError, UnknownNameError, ZooSchemaError
from posteriorzoo.models import build, input_shape
from posteriorzoo.symmetry import random_symmetry, symmetry_structure


# ---------------------------------------------------------------- test-only architectures
class TinyVGG(nn.Module):
    """Conv-BN-ReLU blocks with padding and a max-pool, global pooling, a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.c2, self.b2 = nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool, self.gap = nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = self.pool(torch.relu(self.b1(self.c1(x))))
        x = torch.relu(self.b2(self.c2(x)))
        return self.head(torch.flatten(self.gap(x), 1))


class OddResidual(nn.Module):
    """A skip connection around one dense layer in the middle, and a flatten of C x H x W."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.l1 = nn.Linear(3 * 4 * 4, 6)
        self.l2 = nn.Linear(6, 6)
        self.out = nn.Linear(6, 4)

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        y = torch.relu(self.l1(h))
        z = torch.relu(self.l2(y) + y)
        return self.out(z)


class GroupedNet(nn.Module):
    """A grouped convolution with several input channels per group."""

    def __init__(self, pooled: bool = False) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 6, 3)
        self.c2 = nn.Conv2d(6, 9, 3, groups=3)
        self.head = nn.Linear(9, 3)
        # x.mean is not traced as a pooling, which fixes c2's outputs: then the groups
        # may not be swapped, only permuted inside
        self.pool = nn.AdaptiveAvgPool2d(1) if pooled else None

    def forward(self, x):
        x = torch.relu(self.c2(torch.relu(self.c1(x))))
        pooled = self.pool(x).flatten(1) if self.pool is not None else x.mean(dim=(2, 3))
        return self.head(pooled)


class TanhNet(nn.Module):
    """A non-homogeneous activation: its units may be permuted but not scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.act, self.l2, self.l3 = nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), \
            nn.Linear(4, 2)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(self.act(self.l1(x)))))


class CatNet(nn.Module):
    """Concatenated branches: an operation the tracer does not handle."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(3, 2), nn.Linear(6, 2)

    def forward(self, x):
        return self.c(torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], dim=1))


CUSTOM = {"tiny-vgg": (TinyVGG, (3, 8, 8)), "grouped": (GroupedNet, (2, 7, 7)),
          "grouped-pooled": (lambda: GroupedNet(pooled=True), (2, 7, 7)),
          "odd-residual": (OddResidual, (1, 6, 6)),
          "tanh": (TanhNet, (3,)), "cat": (CatNet, (3,))}
REGISTERED = [("optunet", {}), ("optunet-v1", {}), ("mlp", {"widths": (5, 7, 6, 4, 3)}),
              ("resnet18", {"width": 4, "num_classes": 10}),
              ("resnet18-tiny", {"width": 4, "num_classes": 7})]


def _randomise_batchnorm(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.5, 0.5)


def _model(name: str, options: dict) -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(0)
    if name in CUSTOM:
        factory, shape = CUSTOM[name]
        model = factory()
    else:
        model = build(name, **options)
        shape = input_shape(name, **{k: v for k, v in options.items() if k != "num_classes"})
    model = model.double().eval()
    _randomise_batchnorm(model)
    return model, shape


#: roundings that forward_terms' module hooks do not see: GroupedNet's x.mean over 3 x 3
#: positions (9 terms and the division); Tanh's own rounding (1-Lipschitz, so it carries
#: its input's error unchanged)
FUNCTIONAL_ROUNDINGS = {"grouped": 10, "tanh": 1}


def _roundings(model: nn.Module, x: torch.Tensor, name: str = "") -> int:
    """forward_terms of ``model`` (Tanh counted as above), plus each weight's two scale
    products (the symmetry's, and BatchNorm's prescaled variance: 4 more), the logits'
    mean and its subtraction (K + 2) and the final difference."""
    counted = copy.deepcopy(model)
    for module in list(counted.modules()):
        for child, value in list(module.named_children()):
            if isinstance(value, nn.Tanh):
                setattr(module, child, nn.Identity())
    with torch.no_grad():
        classes = counted(x).shape[1]
        return (forward_terms(counted, x) + FUNCTIONAL_ROUNDINGS.get(name, 0) + 2 + 4
                + classes + 2 + 1)


def _function_bound(model, shape, name: str = "") -> float:
    """Two float64 passes of networks equal in exact arithmetic (the second's weights
    rounded once per scale product): each within gamma(R) of the logits' scale (R the
    roundings on the longest path, :func:`_roundings`), as deep_rtol in float64; the
    differences are relative to the largest logit (2 gamma(R): 1e-14 to 1e-12 here). A
    lost symmetry (a scale not pushed on, a wrong permutation) changes the logits by O(1)."""
    return 2 * gamma(_roundings(model, _inputs(shape), name), U64)


def _inputs(shape) -> torch.Tensor:
    # float64 normals from a seeded generator: the same bits on every CPU
    return torch.randn(6, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _relative_change(model, shape, new_state) -> float:
    x = _inputs(shape)
    twin = copy.deepcopy(model)  # float64 already, so loading does not round
    twin.load_state_dict(new_state)
    with torch.no_grad():
        reference, output = model(x), twin(x)
    # the softmax shift moves every logit by the same constant
    difference = (reference - reference.mean(1, keepdim=True)) - (
        output - output.mean(1, keepdim=True))
    return float(difference.abs().max() / reference.abs().max())


def _symmetry(name, model, shape, options, seed, **kwargs):
    if name in CUSTOM:
        return random_symmetry(model, model.state_dict(), seed, input_shape=shape, **kwargs)
    return random_symmetry(name, model.state_dict(), seed, **options, **kwargs)


# ---------------------------------------------------------------- structure
def test_optunet_structure():
    structure = symmetry_structure("optunet", build("optunet").state_dict())
    assert [s.size for s in structure.spaces] == [1, 2, 10, 10]
    assert [s.fixed for s in structure.spaces] == [True, False, False, True]
    assert structure.spaces[1].group_constraints == [("conv2", "in", 2)]
    assert structure.spaces[2].group_constraints == [("conv2", "out", 2)]
    assert structure.output_bias == "fc.bias"
    assert len(structure.scalable()) == 2 and not structure.notes


def test_resnet_residual_streams_are_tied():
    options = {"width": 4, "num_classes": 10}
    structure = symmetry_structure("resnet18", build("resnet18", **options).state_dict(),
                                   **options)
    assert len(structure.permutable()) == 12  # 4 streams + 8 block-internal spaces

    def space_of(key):
        return next(s for s in structure.spaces if any(w.key == key for w in s.writers))

    stem = space_of("conv1.weight")
    assert stem is space_of("layer1.0.conv2.weight") is space_of("layer1.1.bn2.weight")
    last = space_of("layer4.0.shortcut.1.weight")
    assert last is space_of("layer4.1.conv2.weight")
    assert any(r.key == "fc.weight" for r in last.readers)
    prescales = [v for v in structure.scales if v.through_batchnorm]
    assert len(prescales) == 20  # one per BatchNorm: 17 in the blocks and stem, 3 shortcuts


def test_unsupported_operations_are_reported():
    tanh = symmetry_structure(TanhNet(), TanhNet().state_dict(), input_shape=(3,))
    assert any("Tanh" in note for note in tanh.notes)
    assert [s.size for s in tanh.spaces if not s.fixed] == [5, 4]  # both permutable
    assert len(tanh.scalable()) == 1  # only the ReLU units
    assert tanh.gaps == []  # tanh has no scalings to lose: nothing is left in place
    cat = symmetry_structure(CatNet(), CatNet().state_dict(), input_shape=(3,))
    assert any("cat" in note for note in cat.notes)
    assert cat.gaps == ["cat (cat) is not supported, so the units of a, b are neither "
                        "permuted, scaled nor sign-flipped"]
    assert cat.permutable() == []


def test_bad_input():
    state = build("optunet").state_dict()
    with pytest.raises(UnknownNameError):
        random_symmetry("no-such-net", state, seed=0)
    with pytest.raises(ZooSchemaError):
        random_symmetry("optunet", {**state, "fc.bias": torch.zeros(3)}, seed=0)
    state["conv1.weight"][0, 0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightsError):
        random_symmetry("optunet", state, seed=0)


# ---------------------------------------------------------------- function preserved
@pytest.mark.parametrize("name,options", REGISTERED + [(n, {}) for n in CUSTOM])
def test_random_symmetry_keeps_the_function(name, options):
    model, shape = _model(name, options)
    bound = _function_bound(model, shape, name)
    for seed in range(4):
        new = _symmetry(name, model, shape, options, seed, batchnorm_prescale=False)
        assert _relative_change(model, shape, new) <= bound
        assert any(not torch.equal(new[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name,options", [("resnet18", {"width": 4, "num_classes": 10}),
                                          ("tiny-vgg", {})])
def test_batchnorm_prescaling_is_exact(name, options):
    # The running variance maps to lambda**2 (var + eps) - eps, so BatchNorm's epsilon
    # does not break the symmetry. Without the epsilon term the change would be about
    # eps / var, here 1e-6 to 1e-5.
    model, shape = _model(name, options)
    bound = _function_bound(model, shape, name)
    for seed in range(3):
        new = _symmetry(name, model, shape, options, seed)
        assert _relative_change(model, shape, new) <= bound


def test_grouped_convolution_swaps_whole_groups():
    model, shape = _model("optunet", {})
    bound = _function_bound(model, shape)
    swapped = 0
    for seed in range(20):
        new = random_symmetry("optunet", model.state_dict(), seed, scale_range=(1.0, 1.0))
        # conv1's two channels feed conv2's two groups; a swap moves both together
        old_conv1, new_conv1 = model.state_dict()["conv1.weight"], new["conv1.weight"]
        if torch.equal(new_conv1[0], old_conv1[1]):
            swapped += 1
            # conv2's first group now holds the old second group's filters, in some order
            first_group = np.sort(new["conv2.weight"][:5].flatten().numpy())
            old_second = np.sort(model.state_dict()["conv2.weight"][5:].flatten().numpy())
            np.testing.assert_array_equal(first_group, old_second)
        assert _relative_change(model, shape, new) <= bound
    assert 0 < swapped < 20


# ---------------------------------------------------------------- canonical forms
def _canonical(name, model, options, state, **kwargs):
    from posteriorzoo.symmetry import canonicalize

    if name in CUSTOM:
        return canonicalize(model, state, input_shape=CUSTOM[name][1], **kwargs)
    return canonicalize(name, state, **options, **kwargs)


def _close(a, b, rtol: float, absolute: float) -> bool:
    return all(float((a[k] - b[k]).abs().max()) <= rtol * float(b[k].abs().max()) + absolute
               for k in a if a[k].is_floating_point())


def _canonical_rtol(target, extra, state, scaling, reference) -> float:
    """As in test_canonicalize_batch's test_many_symmetric_copies_share_one_canonical_form:
    a copy's entries carry 2 u (two scale products), which canonicalization carries to
    (2 L + 1) times that (L scale variables); each side adds 2 gamma(R) (R:
    canonical_roundings); min-mass adds each side's Newton radius. Relative to each
    tensor's largest entry."""
    layers = len(symmetry_structure(target, state, **extra).scalable())
    rtol = 4 * gamma(canonical_roundings(target, state, extra, scaling), U64)
    rtol += 2 * (2 * layers + 1) * U64
    if scaling == "minmass" and layers:  # no scale variables: nothing to solve
        rtol += 4 * newton_radius(target, reference, extra, 2 * rtol)
    return rtol


@pytest.mark.filterwarnings("ignore::posteriorzoo.symmetry.SymmetryCoverageWarning")
@pytest.mark.parametrize("scaling", ["norm", "std", "minmass", "none"])
@pytest.mark.parametrize("name,options", REGISTERED + [(n, {}) for n in CUSTOM])
def test_symmetric_copies_have_one_canonical_form(name, options, scaling):
    model, shape = _model(name, options)
    state = model.state_dict()
    canonical = _canonical(name, model, options, state, scaling=scaling)
    # canonicalization's scale products on top of the symmetry's: canonical_roundings more
    target, extra = (model, {"input_shape": shape}) if name in CUSTOM else (name, options)
    bound = _function_bound(model, shape, name) + 2 * gamma(
        canonical_roundings(target, state, extra, scaling), U64)
    assert _relative_change(model, shape, canonical) <= bound
    wide = (0.1, 10.0) if scaling != "none" else (1.0, 1.0)
    rtol = _canonical_rtol(target, extra, state, scaling, canonical)
    output = symmetry_structure(target, state, **extra).output_bias
    for seed in range(3):
        moved = _symmetry(name, model, shape, options, seed, scale_range=wide)
        # the softmax shift: the moved output bias b + s (one rounding) and its mean's
        # subtraction (K + 1 roundings) on the scale of |b + s|, absolute
        absolute = (gamma(moved[output].numel() + 2, U64) * float(moved[output].abs().max())
                    if output is not None else 0.0)
        assert _close(_canonical(name, model, options, moved, scaling=scaling), canonical,
                      rtol, absolute)


@pytest.mark.parametrize("key", ["first", "max"])
def test_canonical_units_are_sorted(key):
    model, _ = _model("mlp", {"widths": (5, 7, 6, 4, 3)})
    canonical = _canonical("mlp", model, {"widths": (5, 7, 6, 4, 3)}, model.state_dict(),
                           permutation=key)
    for layer in ("layers.0.weight", "layers.1.weight", "layers.2.weight"):
        rows = canonical[layer].reshape(canonical[layer].shape[0], -1)
        keys = rows[:, 0] if key == "first" else rows.max(dim=1).values
        assert torch.all(keys[1:] >= keys[:-1])
        norms = torch.linalg.norm(torch.cat([rows, canonical[layer.replace("weight", "bias")]
                                             [:, None]], dim=1), dim=1)
        # each entry within gamma(R) (R: canonical_roundings, the errors add variable by
        # variable), then k squares summed and a root: gamma(R + k + 1) of 1
        rtol = gamma(canonical_roundings("mlp", model.state_dict(), {"widths": (5, 7, 6, 4, 3)})
                     + rows.shape[1] + 2, U64)
        assert float((norms - 1).abs().max()) <= rtol
    # b - mean(b): the mean within gamma(K + 1) of sum |b|, K subtractions (2 u of sum |b|)
    # and the check's sum of K terms (gamma(K) of 2 sum |b|)
    bias = model.state_dict()["layers.3.bias"]
    size = float(bias.abs().sum())
    bound = (gamma(len(bias) + 1, U64) + 2 * U64 + 2 * gamma(len(bias), U64)) * size
    assert abs(float(canonical["layers.3.bias"].sum())) <= bound


def test_dead_units_are_reported_and_left_unscaled():
    from posteriorzoo.symmetry import symmetry_structure
    from posteriorzoo.symmetry.canonical import canonicalize_state

    options = {"widths": (5, 7, 6, 3)}
    model, shape = _model("mlp", options)
    state = model.state_dict()
    state["layers.0.weight"][2] = 0.0  # a dead unit: no incoming weights, no bias
    state["layers.0.bias"][2] = 0.0
    model.load_state_dict(state)
    structure = symmetry_structure("mlp", state, **options)
    canonical, report = canonicalize_state(state, structure, "first", "norm", True)
    assert len(report.dead_units) == 1
    assert all(torch.isfinite(v).all() for v in canonical.values())
    bound = _function_bound(model, shape) + 2 * gamma(
        canonical_roundings("mlp", state, options), U64)
    assert _relative_change(model, shape, canonical) <= bound
