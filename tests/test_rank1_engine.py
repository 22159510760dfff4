"""Rank-1 on the fast engine: the kernel of the per-example scaled network
(train_zoo.fast.rank1_kernels) against torch autograd through the method's own forward
pass, then one training step and a trained mode against the torch engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from posteriorzoo.models import build
from train_zoo import make_spec
from train_zoo.data import load_training_data
from train_zoo.fast.layout import describe_model
from train_zoo.fast.rank1 import rank1_network
from train_zoo.methods import rank1
from train_zoo.programs import produce_mode

LAYERS = ["conv1", "conv2", "fc"]
SHAPES = {"conv1": (2, 1), "conv2": (10, 2), "fc": (10, 10)}   # (outputs, inputs)


def _relative(ours: np.ndarray, theirs: torch.Tensor) -> float:
    reference = theirs.detach().numpy()
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def test_the_kernel_equals_autograd_through_the_scaled_layers():
    """Arbitrary per-example scales of both signs (Rank-1's random-sign means) and biases:
    the loss and every gradient agree with torch to float32 rounding."""
    torch.manual_seed(0)
    model = build("optunet")
    count = 40
    images, labels = torch.randn(count, 1, 28, 28), torch.randint(10, (count,))
    r = {k: (torch.randn(count, o) * 0.7 + torch.sign(torch.randn(count, o))).requires_grad_()
         for k, (o, _) in SHAPES.items()}
    s = {k: (torch.randn(count, i) * 0.7 + 1).requires_grad_() for k, (_, i) in SHAPES.items()}
    bias = (0.3 * torch.randn(count, 10)).requires_grad_()
    weights = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()
               if k != "fc.bias"}
    out = rank1._forward(model, weights, {"fc.bias": bias}, {}, images, torch.arange(count),
                         r, s)
    loss = nn.functional.cross_entropy(out, labels)
    loss.backward()
    layout = describe_model(model, (1, 28, 28))
    network = rank1_network(layout, LAYERS)
    theta = layout.flatten({**{k: v.detach() for k, v in weights.items()},
                            "fc.bias": torch.zeros(10)})
    result = network(theta, {k: v.detach().numpy() for k, v in r.items()},
                     {k: v.detach().numpy() for k, v in s.items()}, bias.detach().numpy(),
                     images.permute(1, 2, 3, 0).numpy(), labels.numpy())
    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-6)
    start = 0
    for value in weights.values():
        size = value.numel()
        assert _relative(result.weights[start:start + size].reshape(value.shape),
                         value.grad) < 1e-5
        start += size
    for name in LAYERS:
        assert _relative(result.r[name], r[name].grad) < 1e-5
        assert _relative(result.s[name], s[name].grad) < 1e-5
    assert _relative(result.bias, bias.grad) < 1e-5


def test_the_kernel_is_offered_only_where_it_applies():
    layout = describe_model(build("optunet"), (1, 28, 28))
    assert rank1_network(layout, LAYERS) is not None
    assert rank1_network(layout, ["conv1", "fc"]) is None        # only some layers rank-1
    assert rank1_network(describe_model(build("optunet-v1"), (1, 28, 28)), LAYERS) is None


def test_a_step_on_the_kernel_equals_the_torch_step():
    """loss_and_grad with the same state and noise: the terms and the gradients of every
    location, scale, bias and weight agree."""
    torch.manual_seed(1)
    model = build("optunet")
    params = {name: value.detach() for name, value in model.named_parameters()}
    state = rank1.init(model, params, 4, torch.Generator().manual_seed(2))
    images, labels = torch.randn(16, 1, 28, 28), torch.randint(10, (16,))
    noise = rank1.draw_noise(state, 4 * 16, torch.Generator().manual_seed(3))
    args = (state, model, {}, None, None, 60_000, 1000)
    plain_terms, plain = rank1.loss_and_grad(*args[:3], (images, labels), *args[4:],
                                             noise=noise)
    network = rank1_network(describe_model(model, (1, 28, 28)), LAYERS)
    fast_batch = (images.permute(1, 2, 3, 0).contiguous().numpy(), labels.numpy())
    terms, grads = rank1.loss_and_grad(*args[:3], fast_batch, *args[4:], noise=noise,
                                       network=network)
    for field in ("loss", "nll", "kl", "l2_term"):
        assert float(getattr(terms, field)) == pytest.approx(
            float(getattr(plain_terms, field)), rel=1e-5), field
    for part, values in plain.items():
        for name, value in values.items():
            torch.testing.assert_close(grads[part][name], value, rtol=1e-4,
                                       atol=1e-5 * float(value.abs().max()) + 1e-12)


def test_a_mode_on_the_fast_engine_trains_as_on_torch():
    digits = load_training_data("digits")
    spec = make_spec(recipe="optunet-mnist", dataset="digits", method="rank-1", modes=1,
                     samples_per_mode=2, base_seed=5, recipe_overrides={"epochs": 2})
    fast = produce_mode(spec, 0, digits, "fast")
    plain = produce_mode(spec, 0, digits, "torch")
    assert fast[0].engine == "fast" and plain[0].engine == "torch"
    assert fast[0].steps == plain[0].steps > 0
    for ours, theirs in zip(fast, plain, strict=True):
        for key, value in theirs.state.items():
            np.testing.assert_allclose(ours.state[key], value, rtol=0, atol=2e-3, err_msg=key)
    assert abs(fast[0].metrics["test_accuracy"] - plain[0].metrics["test_accuracy"]) <= 0.02
