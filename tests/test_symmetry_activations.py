"""Activations beyond ReLU: LeakyReLU, PReLU, odd activations and their sign flips, the
functional forms, and the warning about unsupported operations."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from rounding_bounds import U32, U64, gamma
from torch import fx, nn

from posteriorzoo.symmetry import (
    SymmetryCoverageWarning,
    apply_symmetry,
    canonicalize,
    canonicalize_many,
    operation_properties,
    random_symmetry,
    stack_states,
    symmetry_structure,
)
from posteriorzoo.symmetry.canonical import canonicalize_state


# ---------------------------------------------------------------- test-only architectures
class Fn(nn.Module):
    """A functional form inlined by torch.fx (this module has no parameters of its own)."""

    def __init__(self, function) -> None:
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function(x)


class FunctionalPReLU(nn.Module):
    """``F.prelu`` with one slope per channel, read straight from a parameter."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.slope = nn.Parameter(torch.full((width,), 0.25))

    def forward(self, x):
        return F.prelu(x, self.slope)


class MLP(nn.Module):
    def __init__(self, act, widths=(4, 6, 5, 3), last=None) -> None:
        super().__init__()
        pairs = zip(widths, widths[1:], strict=False)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairs)
        self.acts = nn.ModuleList(act(width) for width in widths[1:-1])
        self.last = last

    def forward(self, x):
        for layer, act in zip(self.layers[:-1], self.acts, strict=True):
            x = act(layer(x))
        x = self.layers[-1](x)
        return self.last(x) if self.last is not None else x


class CNN(nn.Module):
    """BatchNorm, a grouped convolution, average pooling and a C x H x W flatten."""

    def __init__(self, act) -> None:
        super().__init__()
        self.c1, self.bn, self.a1 = nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), act(4)
        self.c2, self.a2 = nn.Conv2d(4, 6, 3, groups=2), act(6)
        self.c3, self.a3, self.pool = nn.Conv2d(6, 3, 1), act(3), nn.AvgPool2d(2)
        self.fc = nn.Linear(3 * 2 * 2, 5)

    def forward(self, x):
        x = self.a2(self.c2(self.a1(self.bn(self.c1(x)))))
        return self.fc(self.pool(self.a3(self.c3(x))).flatten(1))


class ResidualTanh(nn.Module):
    """Two layers writing one stream: they share one sign variable."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.out = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x):
        y = torch.tanh(self.l1(x))
        return self.out(torch.tanh(self.l2(y) + y))


class LayerNormNet(nn.Module):
    def __init__(self, on_input: bool = False) -> None:
        super().__init__()
        self.on_input = on_input
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 6), nn.LayerNorm(6 if not on_input else 4), \
            nn.Linear(6, 3)

    def forward(self, x):
        if self.on_input:
            return self.fc2(torch.relu(self.fc1(self.norm(x))))
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


def _shared_prelu(width):
    return nn.PReLU()


MLP_SHAPE, CNN_SHAPE = (4,), (2, 8, 8)
CASES = {
    "leaky": (lambda: MLP(lambda w: nn.LeakyReLU(0.1)), MLP_SHAPE),
    "leaky-negative-slope": (lambda: MLP(lambda w: nn.LeakyReLU(-0.4)), MLP_SHAPE),
    "leaky-functional": (lambda: MLP(lambda w: Fn(lambda x: F.leaky_relu(x, 0.1))), MLP_SHAPE),
    "prelu-shared": (lambda: MLP(_shared_prelu), MLP_SHAPE),
    "prelu-channel": (lambda: MLP(nn.PReLU), MLP_SHAPE),
    "prelu-functional": (lambda: MLP(FunctionalPReLU), MLP_SHAPE),
    "tanh": (lambda: MLP(lambda w: nn.Tanh()), MLP_SHAPE),
    "tanh-function": (lambda: MLP(lambda w: Fn(torch.tanh)), MLP_SHAPE),
    "tanh-method": (lambda: MLP(lambda w: Fn(lambda x: x.tanh())), MLP_SHAPE),
    "hardtanh": (lambda: MLP(lambda w: nn.Hardtanh(-2.0, 2.0)), MLP_SHAPE),
    "sin": (lambda: MLP(lambda w: Fn(torch.sin)), MLP_SHAPE),
    "identity": (lambda: MLP(lambda w: nn.Identity()), MLP_SHAPE),
    "tanh-cnn": (lambda: CNN(lambda c: nn.Tanh()), CNN_SHAPE),
    "prelu-cnn": (lambda: CNN(nn.PReLU), CNN_SHAPE),
    "leaky-cnn": (lambda: CNN(lambda c: nn.LeakyReLU(0.2)), CNN_SHAPE),
    "tanh-residual": (ResidualTanh, (3,)),
    "sigmoid-output": (lambda: MLP(lambda w: nn.Tanh(), last=nn.Sigmoid()), MLP_SHAPE),
}
ODD = ["tanh", "tanh-function", "tanh-method", "hardtanh", "sin", "identity", "tanh-cnn",
       "tanh-residual", "sigmoid-output"]


def _model(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    factory, shape = CASES[name]
    torch.manual_seed(0)
    model = factory().double().eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
            module.weight.data.uniform_(0.5, 1.5)
        if isinstance(module, nn.PReLU | FunctionalPReLU):  # negative slopes: still homogeneous
            next(module.parameters()).data.uniform_(-0.5, 0.5)
    return model, shape


def _outputs(model, shape, state):
    twin = copy.deepcopy(model)
    twin.load_state_dict(state)
    x = torch.randn(8, *shape, dtype=next(model.parameters()).dtype,
                    generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return twin(x)


def _change(model, shape, state) -> float:
    """Largest change of the outputs, centred (the softmax shift), relative."""
    before, after = _outputs(model, shape, model.state_dict()), _outputs(model, shape, state)
    before, after = before - before.mean(1, keepdim=True), after - after.mean(1, keepdim=True)
    return float((before - after).abs().max() / before.abs().max())


def _structure(model, shape):
    return symmetry_structure(model, model.state_dict(), input_shape=shape)


def _roundings(model: nn.Module, shape) -> int:
    """The roundings on the longest path of one forward pass and :func:`_change`'s centring
    (an upper bound): a Linear / Conv2d output sums its kernel over a group plus the bias
    (and its weights carry a symmetry's factors, at most 2 roundings each); BatchNorm
    8 (``rounding_bounds.BATCHNORM_ROUNDINGS``), LayerNorm 2 n + 8; an average pool its
    window plus the division; any other leaf 2 (an activation: a product, a clamp, or a
    libm tanh / sin / sigmoid within 1 ulp); a module with children 4 (its functional
    tanh and residual sums); the centring over K outputs K + 2."""
    terms = 0

    def count(module, args, output):
        nonlocal terms
        if isinstance(module, nn.Conv2d | nn.Linear):
            kernel = int(np.prod(getattr(module, "kernel_size", (1,))))
            fan_in = getattr(module, "in_features", None) or module.in_channels // module.groups
            terms += fan_in * kernel + 1 + 2
        elif isinstance(module, nn.BatchNorm2d):
            terms += 8
        elif isinstance(module, nn.LayerNorm):   # a mean and a variance, then BN's 8
            terms += 2 * args[0].shape[-1] + 8
        elif isinstance(module, nn.AvgPool2d):
            terms += args[0].shape[-1] * args[0].shape[-2] // output[0, 0].numel() + 1
        elif isinstance(module, nn.ModuleList):
            pass
        else:
            terms += 4 if len(list(module.children())) > 0 else 2

    handles = [module.register_forward_hook(count) for module in model.modules()]
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, *shape, dtype=next(model.parameters()).dtype))
    finally:
        for handle in handles:
            handle.remove()
    return terms + out.shape[1] + 2


def _tolerance(model: nn.Module, shape) -> float:
    """How far :func:`_change` of a function-preserving move may be from 0: both passes
    (the weights and their moved copy) within gamma(k) of the exact function on the
    outputs' scale (k :func:`_roundings`; the convention of ``rounding_bounds.deep_rtol``),
    in the model's precision. 7e-15-2e-14 in float64, 4e-6-1.1e-5 in float32. Measured
    (every case, host and AVX2 settings): 0.03-0.17 of it in float64 (largest 2.5e-15,
    tanh-cnn), 0-0.12 in float32 (1.3e-6, prelu-cnn), whose inputs are float32 normals:
    other bits on another instruction set, the same bound. A wrong move changes the
    function by O(1) (the refusals below: > 1e-3)."""
    single = next(model.parameters()).dtype == torch.float32
    return 2 * gamma(_roundings(model, shape), U32 if single else U64)


# ---------------------------------------------------------------- (a) the function is kept
@pytest.mark.parametrize("name", CASES)
def test_random_group_elements_keep_the_function(name):
    model, shape = _model(name)
    for seed in range(4):
        moved = random_symmetry(model, model.state_dict(), seed, input_shape=shape)
        assert _change(model, shape, moved) <= _tolerance(model, shape)
        assert any(not torch.equal(moved[k], v) for k, v in model.state_dict().items())
    # and in float32, to the precision the issue asks for
    single = copy.deepcopy(model).float()
    moved = random_symmetry(single, single.state_dict(), 9, input_shape=shape)
    assert _change(single, shape, moved) <= _tolerance(single, shape)


@pytest.mark.parametrize("name", ODD)
def test_sign_flips_keep_the_function_of_odd_networks(name):
    model, shape = _model(name)
    structure = _structure(model, shape)
    assert structure.flippable()
    everything = {i: -np.ones(structure.spaces[structure.signs[i].space].size)
                  for i in structure.flippable()}
    flipped = apply_symmetry(model.state_dict(), structure, signs=everything)
    # negation is exact; tanh, sin and hardtanh are odd to within their ulp (measured 0)
    assert _change(model, shape, flipped) <= _tolerance(model, shape)
    first = structure.signs[structure.flippable()[0]].writers[0].key
    torch.testing.assert_close(flipped[first], -model.state_dict()[first], rtol=0, atol=0)


@pytest.mark.parametrize("name,writer,reader", [("leaky", "layers.0", "layers.1"),
                                                ("prelu-channel", "layers.0", "layers.1"),
                                                ("leaky-cnn", "c2", "c3")])
def test_sign_flips_are_refused_where_they_change_the_function(name, writer, reader):
    # Flipping units before a non-odd activation anyway must change the function, or the
    # test above would prove nothing.
    model, shape = _model(name)
    assert _structure(model, shape).flippable() == []
    state = dict(model.state_dict())
    for key in (f"{writer}.weight", f"{writer}.bias", f"{reader}.weight"):
        state[key] = -state[key]
    assert _change(model, shape, state) > 1e-3


def test_scalings_are_refused_where_they_change_the_function():
    model, shape = _model("tanh")
    assert _structure(model, shape).scalable() == []
    state = dict(model.state_dict())
    for key, factor in (("layers.0.weight", 3.0), ("layers.0.bias", 3.0),
                        ("layers.1.weight", 1 / 3.0)):
        state[key] = factor * state[key]
    assert _change(model, shape, state) > 1e-3


def test_no_softmax_shift_through_a_sigmoid_output():
    model, shape = _model("sigmoid-output")
    assert _structure(model, shape).output_bias is None
    moved = random_symmetry(model, model.state_dict(), 3, input_shape=shape)
    expected = _outputs(model, shape, model.state_dict())
    # not centred: the sigmoid keeps no shift; sigmoid's 1 ulp is in _roundings
    torch.testing.assert_close(_outputs(model, shape, moved), expected, rtol=0,
                               atol=_tolerance(model, shape) * float(expected.abs().max()))


# ---------------------------------------------------------------- (b) canonical forms
def _canonical_roundings(state, classes: int) -> int:
    """Roundings of one float64 canonical form (an upper bound; as
    ``test_canonicalize_batch.canonical_roundings``): a scale variable's factor comes from
    its k rows' entries (std: k squares and a mean, 2 k + 6 with the root, reciprocal and
    products), every weight lies in at most two variables' rows (its unit's and its
    input's), so 4 entries + 6 units; the softmax shift's mean of K biases K + 1; a moved
    input's entries carry 2 more (the symmetry's factors). Permutations and flips are
    exact."""
    entries = sum(v.numel() for v in state.values() if v.is_floating_point())
    units = sum(v.shape[0] for v in state.values() if v.is_floating_point() and v.dim() > 0)
    return 4 * entries + 6 * units + classes + 1 + 2


def _close(a, b, scaling: str = "norm") -> bool:
    """Two canonical forms of one function agree: each within gamma(R) of the exact form
    (R :func:`_canonical_roundings`), on each tensor's largest entry (2e-13-1e-12; measured
    up to 6.6e-16). min-mass adds its Newton solver's stop (a gradient below 1e-11 of the
    mass: log-scales within ~1e-6 of the optimum for these small, flat problems; the
    number kept from the solver, measured 5.7e-16)."""
    classes = next(v.shape[0] for k, v in reversed(list(a.items())) if k.endswith("bias"))
    rtol = 4 * gamma(_canonical_roundings(a, classes), U64) + (1e-6 if scaling == "minmass"
                                                                else 0.0)
    return all(torch.allclose(a[k], b[k], rtol=0, atol=rtol * float(a[k].abs().max()))
               for k in a if a[k].is_floating_point())


@pytest.mark.parametrize("scaling", ["norm", "std", "minmass", "none"])
@pytest.mark.parametrize("name", CASES)
def test_transformed_networks_have_one_canonical_form(name, scaling):
    model, shape = _model(name)
    state = model.state_dict()
    canonical = canonicalize(model, state, input_shape=shape, scaling=scaling)
    assert _change(model, shape, canonical) <= _tolerance(model, shape)   # measured 7.5e-16
    wide = (0.1, 10.0) if scaling != "none" else (1.0, 1.0)
    for seed in range(3):
        moved = random_symmetry(model, state, seed, input_shape=shape, scale_range=wide)
        assert _close(canonicalize(model, moved, input_shape=shape, scaling=scaling),
                      canonical, scaling)


def test_canonical_signs_make_incoming_sums_positive():
    model, shape = _model("tanh")
    moved = random_symmetry(model, model.state_dict(), 5, input_shape=shape)
    for state in (model.state_dict(), moved):
        canonical = canonicalize(model, state, input_shape=shape, scaling="none")
        for layer in ("layers.0", "layers.1"):
            sums = canonical[f"{layer}.weight"].sum(1) + canonical[f"{layer}.bias"]
            assert torch.all(sums > 0)
    # without the sign pass, a flipped copy keeps a different form
    kept = [canonicalize(model, state, input_shape=shape, signs=False)
            for state in (model.state_dict(), moved)]
    assert not _close(*kept)


def test_the_batch_path_flips_like_the_single_one():
    model, shape = _model("tanh-cnn")
    states = [random_symmetry(model, model.state_dict(), seed, input_shape=shape)
              for seed in range(3)]
    batch = canonicalize_many(model, stack_states(states), input_shape=shape)
    for b, state in enumerate(states):
        single = canonicalize(model, state, input_shape=shape)
        # two implementations (norm scaling): each within gamma(R) of the exact form on
        # each tensor's largest entry (_close; measured 0)
        assert _close({k: v[b] for k, v in batch.items()}, single)


def test_undecidable_signs_are_reported_and_kept():
    model, shape = _model("tanh")
    state = model.state_dict()
    state["layers.0.weight"][2] = torch.tensor([0.5, -0.5, 0.25, -0.25], dtype=torch.float64)
    state["layers.0.bias"][2] = 0.0  # every odd moment of this unit's row is zero
    structure = symmetry_structure(model, state, input_shape=shape)
    canonical, report = canonicalize_state(state, structure, "none", "none")
    assert report.sign_ties == [(structure.flippable()[0], 2)]
    # kept: copied, not computed (scaling and permutation "none")
    assert torch.equal(canonical["layers.0.weight"][2], state["layers.0.weight"][2])


# ---------------------------------------------------------------- (c) the structure
def test_leaky_relu_and_prelu_are_homogeneous_tanh_is_odd():
    relu = _structure(MLP(lambda w: nn.ReLU()), MLP_SHAPE)
    for name in ("leaky", "leaky-negative-slope", "prelu-shared", "prelu-channel",
                 "prelu-functional"):
        structure = _structure(*_model(name))
        assert len(structure.scalable()) == len(relu.scalable()) == 2, name
        assert structure.flippable() == [] and structure.notes == [], name
    tanh = _structure(*_model("tanh"))
    assert tanh.scalable() == [] and len(tanh.flippable()) == 2
    assert all("odd but not positively homogeneous" in note for note in tanh.notes)
    linear = _structure(*_model("identity"))  # a linear activation: any nonzero factor
    assert len(linear.scalable()) == len(linear.flippable()) == 2


def _axes(structure):
    return ([(s.size, s.fixed, s.writers, s.readers) for s in structure.spaces],
            structure.scales, structure.signs, structure.output_bias)


@pytest.mark.parametrize("forms", [("tanh", "tanh-function", "tanh-method"),
                                   ("leaky", "leaky-functional")])
def test_functional_and_module_forms_have_one_structure(forms):
    structures = [_structure(*_model(name)) for name in forms]
    for other in structures[1:]:
        assert _axes(other) == _axes(structures[0])


def test_per_channel_prelu_slopes_are_permuted_shared_ones_are_not():
    channel = _structure(*_model("prelu-channel"))
    writers = {axis.key for space in channel.spaces for axis in space.writers}
    assert {"acts.0.weight", "acts.1.weight"} <= writers
    functional = _structure(*_model("prelu-functional"))
    assert {"acts.0.slope", "acts.1.slope"} <= {axis.key for space in functional.spaces
                                                for axis in space.writers}
    shared = _structure(*_model("prelu-shared"))
    assert not any(axis.key.startswith("acts.") for space in shared.spaces
                   for axis in space.writers)
    model, shape = _model("prelu-channel")
    state = model.state_dict()
    space = next(i for i, s in enumerate(channel.spaces)
                 if any(axis.key == "layers.0.weight" for axis in s.writers))
    order = np.array([3, 0, 5, 1, 4, 2])
    moved = apply_symmetry(state, channel, permutations={space: order})
    for key in ("acts.0.weight", "layers.0.bias"):  # the slope moves with its unit
        torch.testing.assert_close(moved[key], state[key][order], rtol=0, atol=0)
    assert _change(model, shape, moved) <= _tolerance(model, shape)   # measured 0
    # a slope left in place would change the function: the test above can fail
    wrong = {**moved, "acts.0.weight": state["acts.0.weight"]}
    assert _change(model, shape, wrong) > 1e-3


def _node(module: nn.Module) -> tuple[fx.Node, nn.Module | None]:
    traced = fx.symbolic_trace(nn.Sequential(module) if not isinstance(module, Fn)
                               else module)
    node = next(n for n in traced.graph.nodes if n.op not in ("placeholder", "output"))
    return node, dict(traced.named_modules()).get(node.target)


TABLE_CASES = [nn.ReLU(), nn.LeakyReLU(0.1), nn.LeakyReLU(-0.3), nn.LeakyReLU(1.0),
               nn.PReLU(3, init=-0.7), nn.Tanh(), nn.Hardtanh(), nn.Hardtanh(-1.0, 2.0),
               nn.ReLU6(), nn.Softsign(), nn.Tanhshrink(), nn.Hardshrink(), nn.Softshrink(),
               nn.Sigmoid(), nn.GELU(), nn.ELU(), nn.SiLU(), nn.Softplus(), nn.Mish(),
               nn.Identity(), nn.MaxPool2d(2), nn.AvgPool2d(2), nn.Dropout(0.0),
               Fn(F.relu), Fn(torch.relu), Fn(lambda x: x.relu()), Fn(F.tanh),
               Fn(lambda x: F.leaky_relu(x, negative_slope=0.2)),
               Fn(lambda x: F.hardtanh(x, -3.0, 3.0)), Fn(torch.sin), Fn(torch.sigmoid),
               Fn(F.gelu), Fn(lambda x: x.sigmoid())]


@pytest.mark.parametrize("module", TABLE_CASES, ids=lambda m: repr(m)[:40])
def test_the_table_is_true(module):
    """Every claimed property holds numerically, and every property not claimed fails."""
    node, target = _node(module)
    properties = operation_properties(node, target)
    assert properties is not None
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    f = module.double().eval()
    # A claimed property holds to rounding: each side at most 8 roundings (the product by
    # 2.5, a slope's product, an average pool's 4-term sum and division, a libm call
    # within 1 ulp) of values no larger than the input's or the output's scale, so they
    # agree within 2 gamma(8) of it (~2e-14); one not claimed fails by O(1).
    with torch.no_grad():
        scale = max(float(f(2.5 * x).abs().max()), 2.5 * float(x.abs().max()))
        agree = 2 * gamma(8, U64) * scale
        homogeneous = torch.allclose(f(2.5 * x), 2.5 * f(x), rtol=0, atol=agree)
        odd = torch.allclose(f(-x), -f(x), rtol=0, atol=agree)
    assert (properties.homogeneous, properties.odd) == (homogeneous, odd)


def test_unknown_operations_are_not_in_the_table():
    node, target = _node(nn.LayerNorm(3))
    assert operation_properties(node, target) is None
    node, target = _node(Fn(torch.exp))  # elementwise but neither: permuted only
    assert operation_properties(node, target) == operation_properties(*_node(nn.Sigmoid()))


# ---------------------------------------------------------------- (d) the warning
def test_layernorm_is_named_in_a_warning():
    model = LayerNormNet().double()
    with pytest.warns(SymmetryCoverageWarning) as caught:
        canonical = canonicalize(model, model.state_dict(), input_shape=(4,))
    warning = caught[0].message
    assert str(warning) == ("symmetries not removed: norm (LayerNorm) is not supported, so "
                            "the units of fc1 are neither permuted, scaled nor sign-flipped")
    assert warning.gaps == _structure(model, (4,)).gaps
    assert _change(model, (4,), canonical) <= _tolerance(model, (4,))
    with pytest.warns(SymmetryCoverageWarning, match="LayerNorm"):
        canonicalize_many(model, stack_states([model.state_dict()]), input_shape=(4,))


@pytest.mark.parametrize("model,shape", [(MLP(lambda w: nn.ReLU()), MLP_SHAPE),
                                         (CNN(lambda c: nn.Tanh()), CNN_SHAPE),
                                         (LayerNormNet(on_input=True), (4,))])
def test_no_warning_where_nothing_is_left(model, shape):
    # A LayerNorm on the input loses nothing: the input's units are fixed anyway.
    model = model.double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SymmetryCoverageWarning)
        canonicalize(model, model.state_dict(), input_shape=shape)
    structure = _structure(model, shape)
    assert structure.gaps == []
