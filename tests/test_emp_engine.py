"""EMP and ECMP on the fast engine: the kernels' cross-entropy gradient at the folded draw,
scattered to the drawn components, gives the gradients torch autograd gives through
:func:`train_zoo.methods.emp.fold`, and a trained mode's samples keep EMP's structure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posteriorzoo.models import build
from train_zoo import make_spec
from train_zoo.data import load_training_data
from train_zoo.fast.gradients import fast_loss_gradient
from train_zoo.fast.layout import NetLayout, describe_model
from train_zoo.methods import emp
from train_zoo.programs import produce_mode


def _batch(seed: int, size: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(size, 1, 28, 28, generator=generator)
    return images, torch.randint(10, (size,), generator=generator)


def _stepper(variant: str, layout: NetLayout | None) -> emp.EmpStepper:
    torch.manual_seed(0)
    model = build("optunet")
    options = emp.EmpOptions(variant=variant)
    start = emp.init_model(model, torch.Generator().manual_seed(1), options)
    gradient = None
    if layout is not None:
        gradient = fast_loss_gradient(layout, {n: p.detach() for n, p in
                                               model.named_parameters()})
    return emp.EmpStepper(model, start, torch.Generator().manual_seed(2),
                          weight_decay=options.weight_decay, lr=options.lr, gradient=gradient)


@pytest.mark.parametrize("variant", ["emp", "ecmp"])
def test_kernel_gradients_equal_autograd_through_the_fold(variant: str) -> None:
    layout = describe_model(build("optunet"), (1, 28, 28))
    plain, kernel = _stepper(variant, None), _stepper(variant, layout)
    for step in range(3):
        images, labels = _batch(step)
        fast_batch = (images.permute(1, 2, 3, 0).contiguous().numpy(), labels.numpy())
        loss_plain = plain.step((images, labels), emp.ADAM_LR)
        loss_kernel = kernel.step(fast_batch, emp.ADAM_LR)
        assert loss_kernel == pytest.approx(loss_plain, rel=1e-5)
        for which in ("shared", "components"):
            for name, value in getattr(plain._state, which).items():
                other = getattr(kernel._state, which)[name]
                # undrawn components get only the L2 term: the same in both
                torch.testing.assert_close(other.grad, value.grad, rtol=1e-4, atol=1e-6)
                torch.testing.assert_close(other, value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("variant", ["emp", "ecmp"])
def test_a_mode_on_the_fast_engine_trains_as_on_torch(variant: str) -> None:
    """The same spec on both engines: the same draws and batches, so the trained
    components agree up to float32 rounding, and the engine is recorded."""
    digits = load_training_data("digits")
    spec = make_spec(recipe="optunet-mnist", dataset="digits", method=variant, modes=1,
                     samples_per_mode=3, base_seed=5, recipe_overrides={"epochs": 2})
    fast = produce_mode(spec, 0, digits, "fast")
    plain = produce_mode(spec, 0, digits, "torch")
    assert [r.engine for r in fast] == ["fast"] * 3 and plain[0].engine == "torch"
    assert fast[0].steps == plain[0].steps > 0
    for ours, theirs in zip(fast, plain, strict=True):
        for key, value in theirs.state.items():
            np.testing.assert_allclose(ours.state[key], value, rtol=0, atol=2e-4, err_msg=key)
    assert abs(fast[0].metrics["test_accuracy"] - plain[0].metrics["test_accuracy"]) <= 0.01
