"""The vectorised engine (torch.func over stacked parameters) against the torch engine.

Tolerances: the vectorised engine feeds each model exactly the same batches, dropout masks,
learning rates and SGD rule as the torch engine, but under ``vmap`` a convolution becomes
one grouped convolution over all models and a linear layer a batched matrix product, so
the gradients are summed in another order and differ by rounding; on another CPU both
round differently again. The runs are therefore compared step by step with the bounds of
``tests/rounding_bounds.py`` (Higham's ``gamma(k) = k u / (1 - k u)``, ``u = 2^-24``),
which hold on any x86-64 CPU (:func:`_compare`), not by their final weights:

* every step's batch and learning rate are the same (exact);
* the update: given a step's gradient, the vectorised engine's SGD rule (weight decay,
  momentum, Nesterov) gives what ``torch.optim.SGD``'s single-tensor path gives, bit for
  bit (the same elementwise ATen operations in the same order);
* every step's loss within the forward pass's worst-case bound at the two runs' weights
  (``cross_entropy_bound``'s analysis, with the step's dropout mask: one more rounding);
* every step's gradient differs from the other run's by what their weights' difference
  explains (float64 gradients at both, with the same mask) plus ``gamma(k)`` of each
  tensor's largest entry, ``k`` the roundings on the longest path to a weight gradient
  (OptuNet at a batch of 64: 4,321, 2.6e-4; the MLP: 896, 5.3e-5), unless the step's
  batch has a ReLU input or max-pool arg-max within one pass's rounding of switching at
  either run's weights (``near_switch`` without the weights' difference, which the
  exact gradients at each run's own weights account for), where the runs may part;
  no count of such steps is promised, and the test asserts that some steps have none;
* the final metrics within ``evaluation_bounds`` at the final weights' difference.

Measured (22 steps per checkpoint; AVX-512 / ``make test-avx2``'s AVX2 settings): the
updates bit-identical; losses at most 0.23% / 0.22% of their bounds, gradients at most
3.9% / 4.0% (a margin of 25); no step parting; the final weights 4.5e-8 / 3.0e-8 (OptuNet)
and 1.8e-7 / 2.1e-7 (MLP) apart. Steps with a decision within rounding of switching: 14-21
of 22 (OptuNet), 6-10 (MLP). A vectorised gradient times 1 + 1e-3 exceeds the bound 3.9-40
fold at every run's steps without one; a weight decay times
1 + 1e-3 changes the update's bits at the first step. Replaying the dropout masks from
another noise seed moves the MC-dropout weights by 7e-3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from rounding_bounds import (
    assert_metrics_within_bounds,
    cross_entropy_rounding,
    forward_bounds,
    gamma,
    gradient_terms,
    model_at,
)
from torch import nn

from posteriorzoo.errors import InvalidOptionError
from train_zoo import torch_engine, vectorised
from train_zoo.data import load_training_data
from train_zoo.job import resolve_engine, train_checkpoints
from train_zoo.seeds import checkpoint_seeds
from train_zoo.spec import ZooSpec, make_spec
from train_zoo.torch_engine import initial_model, train_torch
from train_zoo.vectorised import supports, train_vectorised

INDICES = [0, 1, 2]

SPECS = {
    # The paper's OptuNet recipe (crop augmentation, weight decay), one epoch.
    "optunet": make_spec("optunet-mnist", dataset="digits", checkpoints=3,
                         recipe_overrides={"epochs": 1}),
    # Dropout: per-model dropout masks replayed from each checkpoint's noise seed.
    "optunet-mc-dropout": make_spec("optunet-mnist", dataset="digits", checkpoints=3,
                                    model_options={"dropout": 0.2},
                                    recipe_overrides={"epochs": 1}),
    # An MLP with Nesterov momentum and weight decay, no augmentation.
    "mlp-nesterov": make_spec("optunet-mnist", dataset="digits", architecture="mlp",
                              checkpoints=3, model_options={"widths": (784, 16, 10)},
                              recipe_overrides={"epochs": 1, "crop_padding": 0,
                                                "momentum": 0.9, "nesterov": True}),
}


@dataclass
class _Step:
    """One model's SGD step: its weights before and after, the batch, the dropout mask
    on the head's input (the vectorised engine's; None without dropout), the learning
    rate, the loss, the cross-entropy's gradient (before weight decay) and the momentum
    buffers after the step."""

    before: dict[str, torch.Tensor]
    images: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor | None
    lr: float
    loss: float
    grads: dict[str, torch.Tensor]
    after: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor] | None


def _clone(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in values.items()}


def _train_recorded(spec: ZooSpec, data) -> tuple[list, list, list[list[_Step]],
                                                  list[list[_Step]]]:
    """Both engines' results and every step each model took."""
    torch_runs: list[list[_Step]] = []
    vector_runs: list[list[_Step]] = []
    torch_step, vector_step = torch_engine.TorchSGD.step, vectorised._StackedStepper.step

    def recorded_torch(self, batch, lr):
        named = dict(self.model.named_parameters())
        before = _clone(named)
        loss = torch_step(self, batch, lr)
        state = self.optimizer.state
        buffers = {name: state[p]["momentum_buffer"].clone() for name, p in named.items()
                   if state[p].get("momentum_buffer") is not None} or None
        torch_runs[-1].append(_Step(before, batch[0].clone(), batch[1].clone(), None, lr,
                                    loss, {n: p.grad.detach().clone() for n, p in
                                           named.items()}, _clone(named), buffers))
        return loss

    def recorded_vector(self, batches, lr):
        seen, inner, before = {}, self.batched_step, _clone(self.params)

        def spy(params, images, labels, masks):
            grads, losses = inner(params, images, labels, masks)
            seen.update(images=images.clone(), labels=labels.clone(), masks=masks,
                        grads=_clone(grads), losses=losses.detach().clone())
            return grads, losses

        self.batched_step = spy
        try:
            value = vector_step(self, batches, lr)
        finally:
            self.batched_step = inner
        after, buffers = _clone(self.params), _clone(self.optimizer.buffers)
        for m, run in enumerate(vector_runs):
            pick = {k: v[m] for k, v in buffers.items()} if buffers else None
            mask = seen["masks"][0][m].clone() if seen["masks"] else None
            run.append(_Step({k: v[m] for k, v in before.items()}, seen["images"][m],
                             seen["labels"][m], mask, lr, float(seen["losses"][m]),
                             {k: v[m] for k, v in seen["grads"].items()},
                             {k: v[m] for k, v in after.items()}, pick))
        return value

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_engine.TorchSGD, "step", recorded_torch)
        patch.setattr(vectorised._StackedStepper, "step", recorded_vector)
        reference = []
        for index in INDICES:
            torch_runs.append([])
            reference.append(train_torch(spec, index, data))
        vector_runs.extend([] for _ in INDICES)
        results = train_vectorised(spec, INDICES, data)
    return reference, results, torch_runs, vector_runs


@pytest.fixture(scope="module")
def data():
    return load_training_data("digits")


@pytest.fixture(scope="module")
def trained(data):
    """Per case: (torch results, vectorised results, torch steps, vectorised steps)."""
    cache: dict[str, tuple] = {}

    def get(case: str) -> tuple:
        if case not in cache:
            cache[case] = _train_recorded(SPECS[case], data)
        return cache[case]

    return get


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _model(spec: ZooSpec, index: int, weights: dict[str, torch.Tensor], dtype=torch.float32,
           mask: torch.Tensor | None = None) -> nn.Module:
    """Checkpoint ``index``'s network with ``weights`` in ``dtype``, training mode; with
    ``mask`` its dropout replays that mask."""
    model = initial_model(spec, checkpoint_seeds(spec.base_seed, index).init).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
    if mask is not None:
        tape = vectorised._MaskTape(masks=[mask.to(dtype)])
        model = vectorised._replay_skeleton(model, tape)
    return model.train()


def _exact_gradient(spec: ZooSpec, index: int, step: _Step, weights: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """The step's mean cross-entropy gradient at ``weights`` in float64 arithmetic."""
    model = _model(spec, index, weights, torch.float64, step.mask)
    loss = nn.functional.cross_entropy(model(step.images.double()), step.labels)
    names = [name for name, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in model.named_parameters()])
    return dict(zip(names, grads, strict=True))


def _compare(spec: ZooSpec, index: int, vector: list[_Step], reference: list[_Step]
             ) -> dict[str, object]:
    """One checkpoint's two runs step by step (see the module docstring); returns the
    parting steps and the largest ratios of the differences to their bounds."""
    recipe = spec.recipe
    assert len(vector) == len(reference) > 0
    parting: list[int] = []
    ratios = {"loss": 0.0, "gradient": 0.0}
    previous, rounding_near = None, 0
    for number, (v, r) in enumerate(zip(vector, reference, strict=True), 1):
        assert torch.equal(v.images, r.images) and torch.equal(v.labels, r.labels), number
        assert v.lr == r.lr
        # the update: torch.optim.SGD's single-tensor rule on the vectorised gradient
        params = [v.before[k].clone() for k in v.before]
        buffers = [None if previous is None else previous[k] for k in v.before]
        torch.optim._functional.sgd(
            params, [v.grads[k] for k in v.before], buffers, foreach=False,
            weight_decay=recipe.weight_decay, momentum=recipe.momentum, lr=v.lr,
            dampening=0.0, nesterov=recipe.nesterov, maximize=False)
        for key, value in zip(v.before, params, strict=True):
            assert torch.equal(value, v.after[key]), (number, key)
        previous = v.buffers
        # the loss, at the two runs' weights with the step's mask
        model = _model(spec, index, r.before, mask=None)
        delta = {k: v.before[k].double() - r.before[k].double() for k in r.before}
        bounds = forward_bounds(model, r.images, delta, head_mask=v.mask)
        loss_bound = (2 * float(bounds.error.max(1).values.mean())
                      + cross_entropy_rounding(bounds.logits.float()))
        assert abs(v.loss - r.loss) <= loss_bound, (number, v.loss, r.loss, loss_bound)
        ratios["loss"] = max(ratios["loss"], abs(v.loss - r.loss) / loss_bound)
        # the gradient: the weights' difference explains G(w_v) - G(w_r); the rest is
        # rounding, gamma(k) of the tensor's scale (k: the longest path, plus the mask's
        # product forward and backward)
        exact_v = _exact_gradient(spec, index, v, v.before)
        exact_r = _exact_gradient(spec, index, v, r.before)
        rtol = gamma(gradient_terms(model, r.images) + 2)
        worst = 0.0
        for key, grad in r.grads.items():
            change = ((v.grads[key].double() - grad.double())
                      - (exact_v[key] - exact_r[key])).abs().max()
            worst = max(worst, float(change) / (rtol * float(exact_r[key].abs().max())))
        # The exact gradients are taken at each run's own weights, so a decision that
        # the weights' difference moves is accounted for; what is left can only come
        # from a decision that one run's float32 pass takes otherwise than the exact
        # pass at its own weights: one within that pass's rounding of switching.
        near = sum(int(forward_bounds(_model(spec, index, weights, mask=None), r.images,
                                      head_mask=v.mask).near_switch.sum())
                   for weights in (v.before, r.before))
        rounding_near += near > 0
        if worst > 1:
            assert near > 0, (number, worst)
            parting.append(number)
        else:
            ratios["gradient"] = max(ratios["gradient"], worst)
    return {"parting": parting, "rounding_near": rounding_near, **ratios}


@pytest.mark.parametrize("case", list(SPECS))
def test_matches_torch_engine(case, trained, data):
    spec = SPECS[case]
    assert supports(spec)
    reference, vectorised_results, torch_runs, vector_runs = trained(case)
    steps_per_epoch = math.ceil(len(data.train) / spec.recipe.batch_size)
    assert len(data.train) % spec.recipe.batch_size != 0  # the last batch is smaller
    for m, (ref, vec) in enumerate(zip(reference, vectorised_results, strict=True)):
        assert vec.index == ref.index
        assert vec.engine == "vectorised"
        assert vec.seeds == ref.seeds
        assert vec.steps == ref.steps == steps_per_epoch * spec.recipe.epochs
        assert vec.steps == len(vector_runs[m]) == len(torch_runs[m])
        assert vec.diverged == ref.diverged
        for key, value in ref.state.items():
            assert vec.state[key].shape == value.shape
            assert vec.state[key].dtype == value.dtype
            assert np.array_equal(vec.state[key], vector_runs[m][-1].after[key].numpy())
        result = _compare(spec, ref.index, vector_runs[m], torch_runs[m])
        print(f"{case} checkpoint {ref.index}: {result}, max |w_vec - w_torch| = "
              f"{max_difference(ref.state, vec.state):.2e}")
        # The check has teeth only at steps without such a decision: some must be left
        # (4-16 of 22 here).
        assert result["rounding_near"] < vec.steps, result
        assert_metrics_within_bounds(vec, ref, data,
                                     model_at(spec, ref.index, ref.state).eval())


def test_weights_moved(trained):
    """Training changed the weights, so the comparison above is not vacuous."""
    spec = SPECS["optunet-mc-dropout"]
    _, results, _, _ = trained("optunet-mc-dropout")
    start = initial_model(spec, checkpoint_seeds(spec.base_seed, 0).init).state_dict()
    initial = {key: value.numpy() for key, value in start.items()}
    assert max_difference(initial, results[0].state) > 1e-2


def test_group_order_does_not_matter(trained, data):
    spec = SPECS["optunet"]
    _, full, _, _ = trained("optunet")
    by_index = {result.index: result for result in full}
    subset = train_vectorised(spec, [2, 0], data)
    assert [result.index for result in subset] == [2, 0]
    for result in subset:
        # Each model is an independent slice of every batched kernel: on CPU the result
        # is bit-identical whatever the group's size and order.
        for key, value in result.state.items():
            np.testing.assert_array_equal(value, by_index[result.index].state[key])
        assert result.steps == by_index[result.index].steps


def test_divergence_stops_each_model_like_torch(data):
    # lr = 50 blows each MLP up after a different number of steps (13 to 15 here): a
    # non-finite loss freezes that model only, as the torch engine stops that checkpoint.
    spec = make_spec("optunet-mnist", dataset="digits", architecture="mlp", checkpoints=4,
                     model_options={"widths": (784, 16, 10)},
                     recipe_overrides={"epochs": 1, "lr": 50.0, "momentum": 0.9})
    indices = [0, 1, 2, 3]
    reference = [train_torch(spec, i, data) for i in indices]
    vectorised = train_vectorised(spec, indices, data)
    steps = [r.steps for r in reference]
    assert len(set(steps)) > 1 and max(steps) < math.ceil(len(data.train) / 64)
    assert [r.steps for r in vectorised] == steps
    assert [r.diverged for r in vectorised] == [r.diverged for r in reference] == [True] * 4


def test_engine_dispatch(data):
    spec = SPECS["mlp-nesterov"]
    assert resolve_engine(spec, "vectorised") == "vectorised"
    assert resolve_engine(SPECS["optunet"], "vectorised") == "vectorised"
    resnet: ZooSpec = make_spec("resnet18-cifar100", checkpoints=2)
    assert not supports(resnet)
    with pytest.raises(InvalidOptionError, match="vectorised"):
        resolve_engine(resnet, "vectorised")
    with pytest.raises(InvalidOptionError, match="buffers|not one of"):
        train_vectorised(resnet, [0], data)
    small = spec.replace(model_options={"widths": (784, 4, 10)})
    results = train_checkpoints(small, [1, 0], data, engine="vectorised")
    assert [r.index for r in results] == [1, 0]
    assert all(r.engine == "vectorised" for r in results)
    assert train_vectorised(small, [], data) == []
