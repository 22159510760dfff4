"""EMP and ECMP on the fast engine: the kernels' cross-entropy gradient at the folded draw,
scattered to the drawn components, gives the gradients torch autograd gives through
:func:`train_zoo.methods.emp.fold`, and a trained mode's samples keep EMP's structure.

Tolerances: both engines run the method's own draw, L2 term and ``torch.optim.Adam``; they
differ only in the cross-entropy's gradient (the numba kernels against torch's float32
kernels), and so only by rounding. Runs are compared step by step, with the bounds of
``tests/rounding_bounds.py`` (Higham's ``gamma(k) = k u / (1 - k u)``, ``u = 2^-24``),
which hold on any x86-64 CPU (:func:`_compare_emp_runs`):

* every step's draw, batch and learning rate are the same (exact);
* every step's loss within the forward pass's worst-case bound at the folded draws the two
  runs had (``cross_entropy_bound`` with their difference), plus the L2 term's float32
  sums over the parameters (``gamma(n)`` of it) and the loss's last three roundings;
* every step's gradient: Adam is not linear in its gradient, so the step's *gradient* is
  what is compared, not the weights it makes. The two runs' gradients differ by what
  their weights' difference explains (the float64 gradients at both runs' weights,
  ``G(theta_a) - G(theta_b)``) plus rounding, elementwise: ``gradient_rtol`` of each
  tensor's largest cross-entropy gradient entry where the tensor gets one (``gamma(k)``,
  ``k`` the roundings on the longest path to a weight gradient: 3,295 at a batch of 48,
  4,319 at 64: 2.0e-4 and 2.6e-4), and on each side the L2 term's three roundings (the
  factor, the product, the sum: ``gamma(3)`` of ``2 lambda |theta| + |g|``). A step whose
  batch holds a ReLU input or max-pool arg-max within one pass's rounding of switching
  at either run's weights (``near_switch``; the weights' difference is accounted for by
  the exact gradients at each) may route an example's gradient differently: there the
  runs may part (later steps compare each run's own weights); no count is promised.

Measured, with AVX-512 and under ``make test-avx2``'s AVX2 settings alike: every loss at
most 0.19% of its bound; every gradient at most 16% of it, the largest being single-ulp
differences of the L2 term on undrawn components (the analysis allows six roundings
there: a margin of 6), the elements with a cross-entropy gradient at most 2.0% (a
margin of 49, measured with AVX-512); no step parting. A kernel gradient times 1 + 1e-3
exceeds the bound 5 times at the first step, an L2 term of the wrong sign 2.8 million
times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from rounding_bounds import (
    U32,
    assert_metrics_within_bounds,
    cross_entropy_bound,
    gamma,
    gradient_rtol,
    optunet_forward_bounds,
)

from posteriorzoo.models import build
from train_zoo import checkpoint_seeds, make_spec
from train_zoo.data import load_training_data
from train_zoo.fast.gradients import fast_loss_gradient
from train_zoo.fast.layout import NetLayout, describe_model
from train_zoo.methods import emp
from train_zoo.methods.base import generator_for
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


# ------------------------------------------------------------ step-by-step comparison
@dataclass
class _Step:
    """What one :meth:`EmpStepper.step` saw and did: the state before it, its draw,
    batch (``(B, C, H, W)`` images), learning rate, loss, and the gradients it gave Adam."""

    state: emp.EmpState
    indices: dict[str, torch.Tensor]
    images: torch.Tensor
    labels: torch.Tensor
    lr: float
    loss: float
    grads: dict[str, torch.Tensor]
    weight_decay: float
    after: emp.EmpState


def _record_steps(monkeypatch) -> list[list[_Step]]:
    """Make every :class:`EmpStepper` record its steps; returns the list of runs (one
    list of steps per stepper, in the order the steppers first step)."""
    runs: dict[int, list[_Step]] = {}
    original = emp.EmpStepper.step

    def step(self, batch, lr):
        before = self.state()
        replay = torch.Generator()
        replay.set_state(self.generator.get_state())
        indices = emp.draw(before, before.variant, replay)   # the draw step will take
        images, labels = batch
        if isinstance(images, np.ndarray):                  # the kernels' (C, H, W, B)
            images = torch.from_numpy(np.ascontiguousarray(images.transpose(3, 0, 1, 2)))
            labels = torch.from_numpy(np.asarray(labels))
        loss = original(self, batch, lr)
        current = self._state
        grads = {name: value.grad.detach().clone() for name, value in
                 [*current.shared.items(), *current.components.items()]}
        runs.setdefault(id(self), []).append(_Step(before, indices, images.clone(),
                                                   labels.clone(), lr, loss, grads,
                                                   self.weight_decay, self.state()))
        return loss

    monkeypatch.setattr(emp.EmpStepper, "step", step)
    return runs  # type: ignore[return-value]


def _tensors(state: emp.EmpState) -> dict[str, torch.Tensor]:
    return {**state.shared, **state.components}


def _folded_model(state: emp.EmpState, indices: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = build("optunet")
    model.load_state_dict(emp.fold(state, indices))
    return model


def _exact_gradients(state: emp.EmpState, indices: dict[str, torch.Tensor],
                     images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mean cross-entropy's gradient at ``state``'s folded draw with respect to every
    shared tensor and component stack, in float64 arithmetic (exact to float64 rounding;
    autograd through :func:`emp.fold` sends each element's gradient to its component)."""
    leaves = {name: value.detach().double().requires_grad_(True)
              for name, value in _tensors(state).items()}
    exact = emp.EmpState({n: leaves[n] for n in state.shared},
                         {n: leaves[n] for n in state.components}, {}, state.variant,
                         state.order)
    emp.loss(build("optunet").double(), exact, (images.double(), labels), indices,
             0.0).backward()
    return {name: value.grad for name, value in leaves.items()}


def _drawn(state: emp.EmpState, indices: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """1 where tensor ``name`` receives a cross-entropy gradient at the draw ``indices``
    (a shared tensor everywhere, a component stack at its drawn elements), else 0."""
    if name in state.shared:
        return torch.ones_like(state.shared[name])
    stack, index = state.components[name], indices[name]
    mask = torch.zeros_like(stack)
    if index.dim() == 0:
        mask[index] = 1
    else:
        mask.scatter_(0, index.unsqueeze(0), 1.0)
    return mask


def _penalty64(state: emp.EmpState) -> float:
    return sum(float(value.double().square().sum()) for value in _tensors(state).values())


def _compare_emp_runs(run_a: list[_Step], run_b: list[_Step]) -> dict[str, object]:
    """Two runs of one EMP/ECMP training by two implementations of the cross-entropy's
    gradient, step by step (see the module docstring). Returns the steps at which they
    legitimately part (a decision within rounding of switching), the largest ratios of
    the observed differences to their bounds, and how many steps had no decision that
    close (their gradients are held to the bound without exception)."""
    assert len(run_a) == len(run_b) > 0
    parting: list[int] = []
    loss_ratio = grad_ratio = 0.0
    clear = 0   # steps with no decision within rounding of switching: never excused
    for number, (a, b) in enumerate(zip(run_a, run_b, strict=True), 1):
        assert a.indices.keys() == b.indices.keys()
        assert all(torch.equal(a.indices[k], b.indices[k]) for k in a.indices), number
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels), number
        assert a.lr == b.lr and a.weight_decay == b.weight_decay
        model = _folded_model(b.state, b.indices)
        fold_a, fold_b = emp.fold(a.state, a.indices), emp.fold(b.state, b.indices)
        delta = {key: fold_a[key].double() - fold_b[key].double() for key in fold_b}
        factor = b.weight_decay / len(b.labels)
        # the loss: cross-entropy within its bound at the two folded draws; the L2 term's
        # float32 sum of n squares (gamma(n + tensors) of it on each side) times the
        # factor; the loss's last roundings (the factor, its product, the sum): 3 u
        tensors = _tensors(b.state)
        terms = sum(value.numel() for value in tensors.values()) + len(tensors)
        penalty_a, penalty_b = _penalty64(a.state), _penalty64(b.state)
        loss_bound = (cross_entropy_bound(model, b.images, delta)
                      + factor * (abs(penalty_a - penalty_b)
                                  + 2 * gamma(terms) * max(penalty_a, penalty_b))
                      + 3 * U32 * max(abs(a.loss), abs(b.loss)))
        assert abs(a.loss - b.loss) <= loss_bound, (number, a.loss, b.loss, loss_bound)
        loss_ratio = max(loss_ratio, abs(a.loss - b.loss) / loss_bound)
        # the gradient: the difference the weights' difference explains (float64
        # gradients at both runs' weights, L2 term 2 lambda theta included), plus rounding
        exact_a = _exact_gradients(a.state, a.indices, a.images, a.labels)
        exact_b = _exact_gradients(b.state, b.indices, b.images, b.labels)
        rtol = gradient_rtol(model, b.images)
        worst = 0.0
        for name, value in tensors.items():
            theta_a, theta_b = _tensors(a.state)[name].double(), value.double()
            explained = ((exact_a[name] + 2 * factor * theta_a)
                         - (exact_b[name] + 2 * factor * theta_b))
            change = ((a.grads[name].double() - b.grads[name].double()) - explained).abs()
            # the cross-entropy gradient's rounding on its scale, where it has one (the
            # drawn elements of a component stack; the others get exactly 0 from both);
            # on each side, elementwise, the L2 term 2 lambda theta (the factor's
            # rounding, the product) and the sum: 3 u
            drawn = _drawn(b.state, b.indices, name).double()
            largest = torch.maximum(a.grads[name].abs(), b.grads[name].abs()).double()
            bound = (rtol * float(exact_b[name].abs().max()) * drawn
                     + 2 * gamma(3) * (2 * factor * torch.maximum(theta_a.abs(),
                                                                  theta_b.abs()) + largest))
            worst = max(worst, float((change / bound).max()))
        # The exact gradients are taken at each run's own weights, so a decision that the
        # weights' difference moves is accounted for; what is left can only come from a
        # decision that one run's float32 pass takes otherwise than the exact pass at its
        # own weights: one within that pass's rounding of switching.
        near = sum(int(optunet_forward_bounds(_folded_model(x.state, x.indices), b.images)
                       .near_switch.sum()) for x in (a, b))
        clear += near == 0
        if worst > 1:
            assert near > 0, (number, worst)
            parting.append(number)
        else:
            grad_ratio = max(grad_ratio, worst)
    return {"parting": parting, "loss": loss_ratio, "gradient": grad_ratio, "clear": clear}


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("variant", ["emp", "ecmp"])
def test_kernel_gradients_equal_autograd_through_the_fold(variant: str, monkeypatch) -> None:
    """Three steps from the same start on random images (the examples within rounding of a
    ReLU or max-pool switch at the step's weights left out: 0-6 of 48), free-running:
    every step within its bound, none parting."""
    runs = _record_steps(monkeypatch)
    layout = describe_model(build("optunet"), (1, 28, 28))
    plain, kernel = _stepper(variant, None), _stepper(variant, layout)
    kept = []
    for step in range(3):
        images, labels = _batch(step)
        replay = torch.Generator()
        replay.set_state(plain.generator.get_state())
        state_a, state_b = kernel.state(), plain.state()
        indices = emp.draw(state_b, variant, replay)
        fold_a, fold_b = emp.fold(state_a, indices), emp.fold(state_b, indices)
        delta = {key: fold_a[key].double() - fold_b[key].double() for key in fold_b}
        clear = optunet_forward_bounds(_folded_model(state_b, indices), images,
                                       delta).near_switch == 0
        kept.append(int(clear.sum()))
        if kept[-1] < 0.85 * len(labels):
            break   # the runs are apart beyond rounding: the steps so far say where
        images, labels = images[clear], labels[clear]
        fast_batch = (images.permute(1, 2, 3, 0).contiguous().numpy(), labels.numpy())
        plain.step((images, labels), emp.ADAM_LR)
        kernel.step(fast_batch, emp.ADAM_LR)
    run_plain, run_kernel = runs[id(plain)], runs[id(kernel)]
    result = _compare_emp_runs(run_kernel, run_plain)
    print(f"{variant}: {result}, examples kept {kept}")
    assert result["parting"] == []
    assert len(run_kernel) == 3, kept


@pytest.mark.parametrize("variant", ["emp", "ecmp"])
def test_a_mode_on_the_fast_engine_trains_as_on_torch(variant: str, monkeypatch) -> None:
    """The same spec on both engines: the same draws and batches, every step of the two
    runs within its rounding bound (:func:`_compare_emp_runs`; a step may part only
    where a decision lies within rounding of switching: measured none of 44), and the
    samples are the runs' final states folded at the same draws, whose metrics agree
    within the evaluation's bounds at the samples' difference."""
    runs = _record_steps(monkeypatch)
    digits = load_training_data("digits")
    spec = make_spec(recipe="optunet-mnist", dataset="digits", method=variant, modes=1,
                     samples_per_mode=3, base_seed=5, recipe_overrides={"epochs": 2})
    fast = produce_mode(spec, 0, digits, "fast")
    [run_fast] = runs.values()
    plain = produce_mode(spec, 0, digits, "torch")
    [run_plain] = [run for run in runs.values() if run is not run_fast]
    assert [r.engine for r in fast] == ["fast"] * 3 and plain[0].engine == "torch"
    assert fast[0].steps == plain[0].steps == len(run_fast) == len(run_plain) > 0
    assert len(run_plain) == 2 * math.ceil(len(digits.train) / 64)
    result = _compare_emp_runs(run_fast, run_plain)
    print(f"{variant}: {result}")
    # A step may part only where a decision lies within rounding of switching
    # (_compare_emp_runs asserts it); how many do is not promised (measured none). Steps
    # without one (2-3 of 44 here) hold the gradients to their bound; the check of every
    # step is test_kernel_gradients_equal_autograd_through_the_fold (the examples near a
    # switch left out).
    # each sample is its run's final state folded at the sample's draw (the same draws)
    for run, results in ((run_fast, fast), (run_plain, plain)):
        samples = emp.sample(build("optunet"), run[-1].after,
                             generator_for(checkpoint_seeds(spec.base_seed, 0).sample), 3)
        for sample, produced in zip(samples, results, strict=True):
            for key, value in sample.items():
                assert np.array_equal(produced.state[key], value.numpy()), key
    for ours, theirs in zip(fast, plain, strict=True):
        assert_metrics_within_bounds(ours, theirs, digits)
