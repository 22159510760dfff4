"""Last-layer MC Dropout folded into checkpoints (train_zoo.methods.dropout)."""

from __future__ import annotations

import math

import pytest
import torch
from rounding_bounds import U64, gamma

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.models import build, input_shape
from train_zoo.methods import dropout

NETWORKS = [
    ("optunet", {}, "fc"),
    ("optunet-v1", {}, "fc2"),
    ("resnet18", {"num_classes": 10, "width": 4}, "fc"),
    ("mlp", {"widths": (5, 7, 3)}, "layers.1"),
]


def _images(name: str, options: dict, n: int = 6) -> torch.Tensor:
    shape = input_shape(name, **{k: v for k, v in options.items() if k != "num_classes"})
    if name.startswith("resnet"):
        shape = (shape[0], 16, 16)  # the global pool accepts small images
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("name", "options", "layer"), NETWORKS)
def test_last_linear_is_found_by_tracing(name, options, layer):
    assert dropout.last_linear(build(name, dropout=0.3, **options)) == layer
    assert dropout.last_linear(build(name, **options)) == layer


@pytest.mark.parametrize(("name", "options", "layer"), NETWORKS)
def test_sample_equals_dropout_forward_with_the_same_mask(name, options, layer):
    p = 0.3
    torch.manual_seed(0)
    trained = build(name, dropout=p, **options).double()
    state = trained.state_dict()
    count = 8
    draws = dropout.sample(trained, state, p, torch.Generator().manual_seed(5), count)
    masks = dropout.draw_masks(dict(trained.named_modules())[layer].in_features, p,
                               torch.Generator().manual_seed(5), count)
    images = _images(name, options).double()
    base = build(name, **options).double().eval()  # no dropout module active
    trained.eval()
    for module in trained.modules():  # dropout on, BatchNorm in eval (inference)
        if isinstance(module, torch.nn.Dropout):
            module.train()
    last = dict(trained.named_modules())[layer]
    weight, bias = last.weight.detach().abs(), last.bias.detach().abs()
    for draw, mask in zip(draws, masks, strict=True):
        # Training-mode dropout with the mask imposed explicitly on the features that
        # enter the last layer (one mask for the whole batch).
        features = {}
        hook = trained.dropout.register_forward_hook(
            lambda _module, inputs, _output, m=mask: inputs[0] * m / (1 - p))
        seen = trained.dropout.register_forward_pre_hook(
            lambda _module, inputs, seen=features: seen.setdefault("x", inputs[0]))
        try:
            expected = trained(images)
        finally:
            hook.remove()
            seen.remove()
        base.load_state_dict(draw)  # strict: every key of the architecture without dropout
        # Float64 throughout. The layers before the last are the same computation on both
        # sides (same weights, kernels and images: identical features x); the last layer is
        # (W m / c) x here against W (x m / c) there, c = 1 - p: an F-term dot product
        # plus its bias on each side (gamma(F + 1)), with two more roundings here
        # (m / c, then times W) and one there (x m / c). So per output at most
        # 2 gamma(F + 3) (|W| |x m / c| + |b|) in float64's unit roundoff. Measured (host
        # and AVX2 alike): at most 0.15 of it (optunet-v1; 0.02-0.09 for the others).
        # Forgetting the 1 / (1 - p) scaling exceeds it by 1e13.
        scaled = features["x"] * mask / (1 - p)
        bound = 2 * gamma(last.in_features + 3, U64) * (scaled.abs() @ weight.T + bias)
        assert ((base(images) - expected).abs() <= bound).all()


def test_weight_columns_and_bias():
    p = 0.2
    model = build("optunet", dropout=p)
    state = model.state_dict()
    draws = dropout.sample(model, state, p, torch.Generator().manual_seed(3), 50)
    for draw in draws:
        assert list(draw) == list(state)
        assert draw["fc.weight"].dtype == state["fc.weight"].dtype
        torch.testing.assert_close(draw["fc.bias"], state["fc.bias"], rtol=0, atol=0)
        for key in ("conv1.weight", "conv2.weight"):
            torch.testing.assert_close(draw[key], state[key], rtol=0, atol=0)
        ratio = draw["fc.weight"] / state["fc.weight"]
        # Every column is scaled by one factor: 0 (dropped) or 1 / (1 - p) (kept).
        # apply_mask computes 1 - p, f = m / (1 - p) and w f in float64 (three roundings
        # of 2^-53) and rounds w f to float32 once; the ratio is one float32 division:
        # within 2 u + 3 u64 < gamma(3) of 1 / (1 - p), so two entries of a column are
        # within 2 gamma(3) of each other, relatively (0 / w is exactly 0). Measured
        # (host and AVX2; the initialisation is unseeded): kept entries at most 1 ulp
        # either side of 1.25, up to 0.53 of either tolerance; a column scaled by 1
        # instead of 1 / (1 - p) is 20% off.
        tolerance = gamma(3)
        torch.testing.assert_close(ratio, ratio[:1].expand_as(ratio), rtol=2 * tolerance,
                                   atol=0)
        assert all(r == 0 or r == pytest.approx(1 / (1 - p), rel=tolerance, abs=0)
                   for r in ratio[0].tolist())
    # The sample is a different object from the input: the trained weights are untouched.
    assert draws[0]["fc.weight"].data_ptr() != state["fc.weight"].data_ptr()


def test_masks_follow_bernoulli_statistics_and_differ():
    p, count, width = 0.2, 4000, 10
    masks = dropout.draw_masks(width, p, torch.Generator().manual_seed(11), count)
    assert masks.shape == (count, width)
    assert set(masks.unique().tolist()) <= {0.0, 1.0}
    keep = masks.mean().item()
    standard_error = math.sqrt(p * (1 - p) / masks.numel())
    assert abs(keep - (1 - p)) < 5 * standard_error
    per_feature = masks.mean(0)
    assert (per_feature - (1 - p)).abs().max() < 5 * math.sqrt(p * (1 - p) / count)
    # Independence across features: the correlation matrix is near the identity.
    correlation = torch.corrcoef(masks.T)
    off = correlation - torch.eye(width, dtype=correlation.dtype)
    assert off.abs().max() < 5 / math.sqrt(count)
    # Samples differ: with 10 features, 2^10 masks; 4000 draws show many distinct ones.
    assert len({tuple(row.tolist()) for row in masks}) > 200


def test_generator_is_the_only_randomness():
    model = build("optunet", dropout=0.2)
    state = model.state_dict()
    torch.manual_seed(0)
    global_state = torch.random.get_rng_state()
    first = dropout.sample(model, state, 0.2, torch.Generator().manual_seed(9), 5)
    torch.manual_seed(123)  # the global generator plays no part
    second = dropout.sample(model, state, 0.2, torch.Generator().manual_seed(9), 5)
    other = dropout.sample(model, state, 0.2, torch.Generator().manual_seed(10), 5)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a["fc.weight"], b["fc.weight"], rtol=0, atol=0)
    assert any(not torch.equal(a["fc.weight"], b["fc.weight"])
               for a, b in zip(first, other, strict=True))
    torch.manual_seed(0)
    dropout.sample(model, state, 0.2, torch.Generator().manual_seed(9), 5)
    assert torch.equal(torch.random.get_rng_state(), global_state)


def test_p_zero_returns_the_trained_network():
    model = build("optunet")
    state = model.state_dict()
    for draw in dropout.sample(model, state, 0.0, torch.Generator().manual_seed(0), 3):
        for key in state:
            torch.testing.assert_close(draw[key], state[key], rtol=0, atol=0)


def test_explicit_layer():
    model = build("optunet-v1", dropout=0.5)
    state = model.state_dict()
    draws = dropout.sample(model, state, 0.5, torch.Generator().manual_seed(0), 20,
                           layer="fc1")
    assert any(not torch.equal(d["fc1.weight"], state["fc1.weight"]) for d in draws)
    assert all(torch.equal(d["fc2.weight"], state["fc2.weight"]) for d in draws)


@pytest.mark.parametrize(("option", "kwargs"), [
    ("'p'", {"p": 1.0}),
    ("'p'", {"p": -0.1}),
    ("'p'", {"p": True}),
    ("'p'", {"p": "0.2"}),
    ("'count'", {"count": 0}),
    ("'count'", {"count": 2.5}),
    ("'layer'", {"layer": "conv1"}),
    ("'layer'", {"layer": "nope"}),
])
def test_bad_options(option, kwargs):
    model = build("optunet", dropout=0.2)
    arguments = {"p": 0.2, "count": 2, "layer": None, **kwargs}
    with pytest.raises(InvalidOptionError, match=option) as caught:
        dropout.sample(model, model.state_dict(), arguments["p"],
                       torch.Generator().manual_seed(0), arguments["count"],
                       layer=arguments["layer"])
    assert "\n" not in str(caught.value)


def test_mismatched_state_dict():
    model = build("optunet")
    state = build("optunet-v1").state_dict()
    with pytest.raises(InvalidOptionError, match="'state_dict'"):
        dropout.sample(model, state, 0.2, torch.Generator().manual_seed(0), 2)


def test_untraceable_network_needs_an_explicit_layer():
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow cannot be traced
                x = -x
            return self.fc(x)

    model = Branchy()
    with pytest.raises(InvalidOptionError, match="'layer'"):
        dropout.last_linear(model)
    draws = dropout.sample(model, model.state_dict(), 0.5, torch.Generator().manual_seed(0),
                           2, layer="fc")
    assert len(draws) == 2
