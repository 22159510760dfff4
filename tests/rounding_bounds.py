"""Rounding-error bounds that hold on any CPU, for the numerical tests' tolerances.

Two float32 implementations of one computation (torch's kernels and the numba ones, or
one library's AVX-512 and AVX2 code paths) sum in different orders, with or without FMA,
in differently sized blocks: their results differ, but both lie within the classical
worst-case bound of the exact result (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., section 3.1). A sum or dot product of ``k`` terms, computed in any
order, with or without FMA, has

    |fl(sum t_i) - sum t_i| <= gamma(k) * sum |t_i|,   gamma(k) = k u / (1 - k u),

with ``u`` the unit roundoff: :data:`U32` = 2^-24 in float32, :data:`U64` = 2^-53 in
float64. For a network the bound follows layer by layer: a layer adds
``gamma(k) * |W| |x|`` and carries its input's error through ``|W|``; ReLU, max pooling
and averaging are 1-Lipschitz. :func:`optunet_forward_bounds` evaluates it for the values
at hand (to first order in ``u``), so a tolerance built from it is the analysis itself,
with no CPU's rounding in it. These bounds are loose (the observed differences are
100-10,000 times smaller, because roundings partly cancel) but far below what a wrong
formula changes.

Weight gradients are the exception (:func:`gradient_rtol`): their reductions over a
batch cancel so strongly that the worst case is half the result's scale. Their tolerance
is ``gamma(k)`` of the result's scale instead (the reduction's length times the unit
roundoff), with the measured margin stated. A training run adds one such rounding per
step (:func:`step_bound`, :func:`compare_runs`).

A ReLU input or a max-pool arg-max that lies within the bound of its switching point may
legitimately be decided differently by two implementations; the bounds hold only while
both take the same branches. :func:`optunet_forward_bounds` counts the decisions that
are that close (``near_switch``).

Defaults. ``pytest.approx``'s and ``torch.testing.assert_close``'s default tolerances
(1e-6 relative; 1e-7 in float64) are kept only where both sides are float64 results of a
handful of operations on the same values (a rescaling by the data set's size, a
schedule's formula, a product of options): their rounding is a few u64, 1e-15 of the
value, eight orders of magnitude below the default, and a wrong formula misses by far
more. Every other comparison states its bound where it is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.modules.utils import _pair

U32 = 2.0 ** -24   # float32 unit roundoff
U64 = 2.0 ** -53   # float64 unit roundoff


def gamma(k: int, u: float = U32) -> float:
    """Higham's ``gamma_k = k u / (1 - k u)``: the relative bound of a ``k``-term sum."""
    if k * u >= 1:
        raise ValueError(f"gamma({k}) is unbounded at u = {u}")
    return k * u / (1 - k * u)


def _conv_terms(conv: nn.Conv2d) -> int:
    """Terms of one output of ``conv``: its kernel over one group, plus the bias."""
    kh, kw = conv.kernel_size
    return conv.in_channels // conv.groups * kh * kw + (conv.bias is not None)


def _conv(conv: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor,
          bias: torch.Tensor | None) -> torch.Tensor:
    return F.conv2d(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def _pool(pool: nn.MaxPool2d, x: torch.Tensor, indices: bool = False):
    return F.max_pool2d(x, pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                        pool.ceil_mode, return_indices=indices)


def _head(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The Linear layers after the trunk: OptuNet's ``fc``; OptuNet-v1's ``fc1``, ``fc2``."""
    return [("fc", model.fc)] if hasattr(model, "fc") else [("fc1", model.fc1),
                                                             ("fc2", model.fc2)]


@dataclass
class ForwardBounds:
    """The float64 forward pass of an OptuNet-shaped network and its rounding bounds.

    ``logits`` ``(B, K)`` are the network's values (float64 arithmetic on the float32
    weights: exact to float64 rounding); ``error`` bounds ``|logits_1 - logits_2|``
    elementwise between the two sides :func:`optunet_forward_bounds` describes, and
    ``absolute`` is the network with ``|W|`` on ``|x|`` (the scale of the terms).
    ``near_switch`` ``(B,)`` counts each example's decisions that lie within their bound
    of switching: ReLU inputs ``0 < |c| <= error(c)`` and max-pool windows whose two
    largest values differ, by at most the sum of their bounds. (An exact tie is routed
    to the window's first maximum by both sides: identical patches give identical values
    in an implementation that sums every output in the same order.)
    """

    logits: torch.Tensor
    error: torch.Tensor
    absolute: torch.Tensor
    near_switch: torch.Tensor


def optunet_forward_bounds(model: nn.Module, images: torch.Tensor,
                           delta: dict[str, torch.Tensor] | None = None,
                           implementations: int = 2,
                           head_mask: torch.Tensor | None = None) -> ForwardBounds:
    """Bounds on two float32 forward passes of an OptuNet-shaped ``model`` (conv1, ReLU,
    max pool, conv2, ReLU, global average pool, one or two Linear layers; dropout off)
    on the same ``images``, each by its own implementation, with weights that differ by
    ``delta`` (``{name: w_1 - w_2}``; none: the same weights).

    Each side rounds by at most ``gamma(k_l) * A_l`` at layer ``l`` (``A`` the network
    with ``|W|`` on ``|x|``, ``k_l`` the layer's terms: conv1's and conv2's kernels over
    a group, the average pool's positions, the head's inputs; each plus its bias), and a
    layer carries its input's error through ``|W|``; ``delta`` adds ``|dW| A`` at its
    layer. ``implementations`` counts the sides that round (2: two implementations
    against each other; 1: one against the exact result). First order in ``u`` and in
    ``delta``; valid while both sides take the same branches (``near_switch`` all 0).

    ``head_mask`` ``(B, features)``: a training pass's dropout, the same mask (its
    ``0`` and ``1 / (1 - p)`` entries) multiplying the last Linear layer's input on both
    sides; the product is one more rounding (``u`` of ``|m| A``).
    """
    delta = delta or {}
    weights = {name: value.detach().double() for name, value in model.named_parameters()}
    if (head_mask is None and model.training
            and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())):
        raise ValueError("the bound is for the deterministic forward pass (eval mode) or "
                         "a training pass with its dropout mask (head_mask)")
    near = torch.zeros(len(images), dtype=torch.int64)

    def layer(name: str, terms: int, apply, value, a, e):
        weight, bias = weights[f"{name}.weight"], weights.get(f"{name}.bias")
        out = apply(value, weight, bias)
        a_out = apply(a, weight.abs(), None if bias is None else bias.abs())
        e_out = implementations * gamma(terms) * a_out + apply(e, weight.abs(), None)
        if f"{name}.weight" in delta:
            d_bias = delta.get(f"{name}.bias")
            e_out = e_out + apply(a, delta[f"{name}.weight"].detach().double().abs(),
                                  None if d_bias is None else d_bias.detach().double().abs())
        return out, a_out, e_out

    def relu(value, e):
        nonlocal near
        near += ((value != 0) & (value.abs() <= e)).flatten(1).sum(1)
        return torch.relu(value)

    x = images.detach().double()
    a, e = x.abs(), torch.zeros_like(x)
    conv1, conv2, pool = model.conv1, model.conv2, model.pool1
    value, a, e = layer("conv1", _conv_terms(conv1),
                        lambda v, w, b: _conv(conv1, v, w, b), x, a, e)
    value = relu(value, e)
    # max pool: the two largest of each window must be apart by more than their bounds
    (kh, kw), (sh, sw) = _pair(pool.kernel_size), _pair(pool.stride or pool.kernel_size)
    if _pair(pool.padding) == (0, 0) and _pair(pool.dilation) == (1, 1):
        top, where = value.unfold(2, kh, sh).unfold(3, kw, sw).flatten(-2).topk(2, dim=-1)
        bounds = e.unfold(2, kh, sh).unfold(3, kw, sw).flatten(-2).gather(-1, where)
        gap = top[..., 0] - top[..., 1]
        near += ((gap > 0) & (gap <= bounds.sum(-1))).flatten(1).sum(1)
    value, a, e = _pool(pool, value), _pool(pool, a), _pool(pool, e)
    value, a, e = layer("conv2", _conv_terms(conv2),
                        lambda v, w, b: _conv(conv2, v, w, b), value, a, e)
    value = relu(value, e)
    positions = value.shape[2] * value.shape[3]   # the average pool: P terms, one division
    value, a, e = value.mean((2, 3)), a.mean((2, 3)), e.mean((2, 3))
    e = e + implementations * gamma(positions + 1) * a
    head = _head(model)
    for i, (name, linear) in enumerate(head):
        if i == len(head) - 1 and head_mask is not None:
            value, a, e = _masked(value, a, e, head_mask, implementations)
        value, a, e = layer(name, linear.in_features + (linear.bias is not None),
                            lambda v, w, b: F.linear(v, w, b), value, a, e)
        if i < len(head) - 1:
            value = relu(value, e)
    return ForwardBounds(value, e, a, near)


def _masked(value: torch.Tensor, a: torch.Tensor, e: torch.Tensor, mask: torch.Tensor,
            implementations: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dropout mask's product: exact values times ``mask``, the error carried by
    ``|mask|`` plus one rounding per side."""
    mask = mask.detach().double()
    a = a * mask.abs()
    return value * mask, a, e * mask.abs() + implementations * U32 * a


def mlp_forward_bounds(model: nn.Module, images: torch.Tensor,
                       delta: dict[str, torch.Tensor] | None = None,
                       implementations: int = 2,
                       head_mask: torch.Tensor | None = None) -> ForwardBounds:
    """:func:`optunet_forward_bounds` for ``posteriorzoo``'s MLP (``layers.i`` Linear
    layers, ReLU after each but the last, dropout on the last one's input: ``head_mask``):
    layer ``l`` rounds by at most ``gamma(in_l + 1) |W| |x| + |b|`` per side, carried
    through ``|W|``."""
    delta = delta or {}
    if (head_mask is None and model.training
            and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())):
        raise ValueError("the bound is for the deterministic forward pass (eval mode) or "
                         "a training pass with its dropout mask (head_mask)")
    value = images.detach().double().flatten(1)
    a, e = value.abs(), torch.zeros_like(value)
    near = torch.zeros(len(images), dtype=torch.int64)
    layers = list(model.layers)
    for i, linear in enumerate(layers):
        if i == len(layers) - 1 and head_mask is not None:
            value, a, e = _masked(value, a, e, head_mask, implementations)
        weight = linear.weight.detach().double()
        bias = None if linear.bias is None else linear.bias.detach().double()
        out = F.linear(value, weight, bias)
        a_out = F.linear(a, weight.abs(), None if bias is None else bias.abs())
        e_out = (implementations * gamma(linear.in_features + (bias is not None)) * a_out
                 + F.linear(e, weight.abs()))
        key = f"layers.{i}"
        if f"{key}.weight" in delta:
            d_bias = delta.get(f"{key}.bias")
            e_out = e_out + F.linear(a, delta[f"{key}.weight"].detach().double().abs(),
                                     None if d_bias is None else d_bias.detach().double().abs())
        value, a, e = out, a_out, e_out
        if i < len(layers) - 1:
            near += ((value != 0) & (value.abs() <= e)).sum(1)
            value = torch.relu(value)
    return ForwardBounds(value, e, a, near)


def mlp_gradient_terms(model: nn.Module, images: torch.Tensor) -> int:
    """:func:`optunet_gradient_terms` for the MLP: the forward reductions (each layer's
    inputs and bias), the softmax (K + 8), the backward sums over the later layers'
    outputs, and the first layer's weight gradient over the batch's ``B`` examples."""
    layers = list(model.layers)
    forward = sum(linear.in_features + 1 for linear in layers)
    softmax = layers[-1].out_features + 8
    backward = sum(linear.out_features for linear in layers[1:]) + len(images)
    return forward + softmax + backward


def forward_bounds(model: nn.Module, images: torch.Tensor,
                   delta: dict[str, torch.Tensor] | None = None, implementations: int = 2,
                   head_mask: torch.Tensor | None = None) -> ForwardBounds:
    """:func:`mlp_forward_bounds` for an MLP, else :func:`optunet_forward_bounds`."""
    bounds = mlp_forward_bounds if hasattr(model, "layers") else optunet_forward_bounds
    return bounds(model, images, delta, implementations, head_mask)


def gradient_terms(model: nn.Module, images: torch.Tensor) -> int:
    """:func:`mlp_gradient_terms` for an MLP, else :func:`optunet_gradient_terms`."""
    terms = mlp_gradient_terms if hasattr(model, "layers") else optunet_gradient_terms
    return terms(model, images)


def cross_entropy_rounding(logits: torch.Tensor, implementations: int = 2) -> float:
    """A bound on the difference between implementations' float32 mean cross-entropy of
    the *same* float32 ``logits`` ``(B, K)``, from their rounding alone.

    Per example ``log sum_k exp(z_k - m) + m - z_y``: K exponentials (each within
    2 ulp = 4u of exact, what libm, SLEEF and torch's vectorised ``exp`` promise in
    float32), their K-term sum, one logarithm (4u of its value) and two subtractions (u
    of ``|m|`` and of ``|z_y|``): at most ``(K + 8) u + 4 u (max |z| + log K)``; the mean
    over B examples adds ``gamma(B)`` of the largest loss, ``2 max |z| + log K``.
    """
    b, k = logits.shape
    z = float(logits.detach().abs().max())
    per_example = (k + 8) * U32 + 4 * U32 * (z + math.log(k))
    return implementations * (per_example + gamma(b) * (2 * z + math.log(k)))


def cross_entropy_bound(model: nn.Module, images: torch.Tensor,
                        delta: dict[str, torch.Tensor] | None = None) -> float:
    """A bound on the difference between two implementations' float32 mean
    cross-entropy of an OptuNet-shaped ``model`` (or an MLP) on a batch (weights differing by
    ``delta``): the logits' bound carried by the loss (its gradient in the logits is
    ``p - e_y``, of 1-norm at most 2: ``|dL| <= mean_n 2 max_k |dz_nk|``) plus the
    loss's own rounding (:func:`cross_entropy_rounding`)."""
    bounds = forward_bounds(model, images, delta)
    return (2 * float(bounds.error.max(1).values.mean())
            + cross_entropy_rounding(bounds.logits.float()))


def optunet_gradient_terms(model: nn.Module, images: torch.Tensor) -> int:
    """The roundings on the longest path to a weight gradient of an OptuNet-shaped
    network's mean cross-entropy on a batch of ``B`` images.

    conv1's weight gradient sums one product per example and pooled position (the
    arg-max of each window: ``B * Hp * Wp`` terms; the other positions add exact zeros),
    after the forward reductions (conv1's and conv2's kernels, the average pool, the
    head), the softmax (K + 8) and the backward ones before it (the head's sums over its
    outputs, conv2's input gradient over its output channels and kernel, the max pool's
    overlapping windows).
    """
    conv1, conv2, pool = model.conv1, model.conv2, model.pool1
    with torch.no_grad():
        c1 = conv1(images)
        pooled = pool(c1)
        c2 = conv2(pooled)
    batch, _, hp, wp = pooled.shape
    kh2, kw2 = conv2.kernel_size
    (kh, kw), (sh, sw) = _pair(pool.kernel_size), _pair(pool.stride or pool.kernel_size)
    head = [linear for _, linear in _head(model)]
    forward = (_conv_terms(conv1) + _conv_terms(conv2) + c2.shape[2] * c2.shape[3] + 1
               + sum(linear.in_features + 1 for linear in head))
    softmax = head[-1].out_features + 8
    backward = (sum(linear.out_features for linear in head)
                + conv2.out_channels // conv2.groups * kh2 * kw2
                + math.ceil(kh / sh) * math.ceil(kw / sw) + batch * hp * wp)
    return forward + softmax + backward


def evaluation_bounds(model: nn.Module, dataset, delta: dict[str, torch.Tensor] | None = None
                      ) -> tuple[float, int]:
    """How far two implementations' ``(mean loss, correct examples)`` of an OptuNet-shaped
    ``model`` (or an MLP: :func:`forward_bounds`) on a whole ``dataset`` (normalised,
    unaugmented: the trainer's evaluation) may be apart, their weights differing by
    ``delta``: the loss by the logits' bound carried by the cross-entropy, its own
    rounding and float32 sums over evaluation batches (``gamma(len(dataset))`` of the
    mean loss); the number of correct examples by the examples whose two largest logits
    lie within the sum of their bounds (only those can change their arg-max)."""
    from posteriorzoo.data import iterate_batches
    from train_zoo.data import eval_transform

    images, labels = next(iter(iterate_batches(dataset, len(dataset), seed=0, epoch=0,
                                               transform=eval_transform(dataset),
                                               shuffle=False)))
    bounds = forward_bounds(model, images, delta)
    top, where = bounds.logits.topk(2, dim=1)
    close = (top[:, 0] - top[:, 1]) <= bounds.error.gather(1, where).sum(1)
    mean_loss = float(F.cross_entropy(bounds.logits, labels))
    loss = (2 * float(bounds.error.max(1).values.mean())
            + cross_entropy_rounding(bounds.logits.float()) + gamma(len(labels)) * mean_loss)
    return loss, int(close.sum())


# ------------------------------------------------------------------ training runs
def gradient_rtol(model: nn.Module, images: torch.Tensor) -> float:
    """The tolerance of two implementations' float32 weight gradients (mean
    cross-entropy of an OptuNet-shaped ``model`` on a batch), relative to each tensor's
    largest entry: ``gamma(k)``, ``k`` the roundings on the longest path to a weight
    gradient (:func:`optunet_gradient_terms`: 4,319 for a batch of 64, of which conv1's
    weight gradient sums ``64 * 8 * 8`` products), 2.6e-4 at batch 64, 4.4e-5 at batch 8.

    The strict worst case is ``gamma(k)`` of the sum of the terms' *absolute values*,
    about 100 times the tensor's largest entry here (the batch's contributions cancel):
    a bound of half the scale, which would test nothing. Taken on the result's scale it
    is the reduction's length times the unit roundoff; the roundings of blocked sums
    partly cancel, and the measured difference (the kernels against torch, AVX-512 and
    AVX2 alike) is 2.9e-6 of the scale at most, 1/89 of this tolerance.
    """
    return gamma(optunet_gradient_terms(model, images))


def step_bound(lr: float, rtol: float, grads: dict, weights: dict, factor: float = 1.0
               ) -> dict[str, float]:
    """Per tensor, how far two implementations' weights after one SGD step from the same
    weights may be apart: their gradients differ by ``rtol`` of the gradients' scale
    (``grads``: either side's), the update scales that by ``factor * lr`` (``1 +
    momentum`` with Nesterov), and each side rounds its result once (``u |w|``, with
    ``weights`` the result; the update's arithmetic is IEEE operations in a fixed order,
    bit-identical given the same gradient)."""
    return {key: factor * lr * rtol * float(np.abs(grads[key]).max())
            + 2 * U32 * float(np.abs(weights[key]).max()) for key in grads}


def model_at(spec, index: int, state: dict[str, np.ndarray]) -> nn.Module:
    """Checkpoint ``index``'s architecture of ``spec`` with the weights ``state``."""
    from train_zoo import checkpoint_seeds
    from train_zoo.torch_engine import initial_model

    model = initial_model(spec, checkpoint_seeds(spec.base_seed, index).init)
    model.load_state_dict({key: torch.from_numpy(np.asarray(value))
                           for key, value in state.items()})
    return model


def follow_sgd(spec, index: int, batches, start_a: dict, start_b: dict,
               weights_a: list[dict], steps_a: list[tuple], weights_b: list[dict],
               steps_b: list[tuple]) -> tuple[list[int], float]:
    """Compare two implementations' SGD runs of checkpoint ``index`` of ``spec`` (an
    OptuNet-shaped network) step by step, from weights ``start_a``, ``start_b`` on
    ``batches`` (``(images, labels)`` in order), given what their callbacks saw: the
    weights after each step (``weights_*``) and ``(index, epoch, step, lr, loss)``
    (``steps_*``). Returns the steps at which they legitimately part and the largest
    ratio of a following step's difference to its bound.

    Before each step the runs' weights differ by ``delta``. The step's loss may differ by
    :func:`cross_entropy_bound` at that ``delta`` (the loss is continuous across a ReLU
    or max-pool switch: no step is excused; the bound's rounding term alone is tried
    first, the float64 forward bounds only when the difference exceeds it). The step's
    *change* of the weights' difference may be at most :func:`step_bound` with
    :func:`gradient_rtol` (the update ``w_before - w_after`` standing for ``lr`` times the
    gradient, weight decay included), unless the batch has a decision within its bound of
    switching at those weights (``near_switch``), which may route a gradient
    differently: then the runs part, and later steps start from the weights each run
    reached.
    """
    before_a, before_b, parting, ratio = start_a, start_b, [], 0.0
    terms: dict[tuple, int] = {}
    steps = zip(batches, weights_a, weights_b, steps_a, steps_b, strict=True)
    for step, ((images, _), after_a, after_b, info_a, info_b) in enumerate(steps, 1):
        assert tuple(info_a[:4]) == tuple(info_b[:4]), (step, info_a, info_b)
        model = model_at(spec, index, before_b)
        delta = {key: torch.from_numpy(before_a[key].astype(np.float64) - value)
                 for key, value in before_b.items()}
        residual = abs(info_a[4] - info_b[4])
        with torch.no_grad():
            logits = model.double()(images.double()).float()
        model.float()
        loss_bound = cross_entropy_rounding(logits)
        if residual > loss_bound:
            loss_bound = cross_entropy_bound(model, images, delta)
        assert residual <= loss_bound, (step, info_a, info_b, loss_bound)
        shape = (tuple(images.shape), *(tuple(p.shape) for p in model.parameters()))
        if shape not in terms:   # a function of the shapes alone
            terms[shape] = optunet_gradient_terms(model, images)
        updates = {key: before_b[key] - after_b[key] for key in after_b}
        bound = step_bound(1.0, gamma(terms[shape]), updates, after_b)
        change = {key: float(np.abs((after_a[key].astype(np.float64) - after_b[key])
                                    - delta[key].numpy()).max()) for key in after_b}
        if any(change[key] > bound[key] for key in bound):
            near = optunet_forward_bounds(model, images, delta).near_switch
            assert near.sum() > 0, (step, change, bound)
            parting.append(step)
        else:
            ratio = max(ratio, residual / loss_bound, *(change[key] / bound[key]
                                                        for key in bound))
        before_a, before_b = after_a, after_b
    return parting, ratio


def compare_runs(spec, index: int, data, weights_a: list[dict], steps_a: list[tuple],
                 weights_b: list[dict], steps_b: list[tuple]) -> list[int]:
    """:func:`follow_sgd` for two whole runs of checkpoint ``index`` of ``spec`` (an
    OptuNet-shaped Deep-Ensemble spec) on ``data``: from its initial weights, on the
    recipe's batches. Returns the steps at which they legitimately part. Measured (the
    fast engine against torch on digits, 20 runs of 338 steps at batch 8): a step of a
    run that follows changes the difference by at most 0.44 of its bound; a switching
    step by 14-2,000 times its bound, and every such step had a decision that close.
    """
    from posteriorzoo.data import iterate_batches
    from train_zoo import checkpoint_seeds
    from train_zoo.data import train_transform
    from train_zoo.torch_engine import initial_model

    recipe, seeds = spec.recipe, checkpoint_seeds(spec.base_seed, index)
    start = {key: value.numpy() for key, value in
             initial_model(spec, seeds.init).state_dict().items()}
    batches = (batch for epoch in range(recipe.epochs) for batch in iterate_batches(
        data.train, recipe.batch_size, seed=seeds.data, epoch=epoch,
        transform=train_transform(recipe, data.train)))
    return follow_sgd(spec, index, batches, start, start, weights_a, steps_a, weights_b,
                      steps_b)[0]


# ------------------------------------------------------------------ Rank-1 networks
def _window_near(value: torch.Tensor, e: torch.Tensor, pool: nn.MaxPool2d) -> torch.Tensor:
    """Per example, the max-pool windows of ``value`` whose two largest entries differ by
    at most the sum of their bounds ``e`` (without padding or dilation; else none)."""
    (kh, kw), (sh, sw) = _pair(pool.kernel_size), _pair(pool.stride or pool.kernel_size)
    if _pair(pool.padding) != (0, 0) or _pair(pool.dilation) != (1, 1):
        return torch.zeros(len(value), dtype=torch.int64)
    top, where = value.unfold(2, kh, sh).unfold(3, kw, sw).flatten(-2).topk(2, dim=-1)
    bounds = e.unfold(2, kh, sh).unfold(3, kw, sw).flatten(-2).gather(-1, where)
    gap = top[..., 0] - top[..., 1]
    return ((gap > 0) & (gap <= bounds.sum(-1))).flatten(1).sum(1)


def rank1_forward_bounds(model: nn.Module, images: torch.Tensor, r: dict[str, torch.Tensor],
                         s: dict[str, torch.Tensor], bias: torch.Tensor,
                         delta: dict[str, torch.Tensor] | None = None,
                         implementations: int = 2) -> ForwardBounds:
    """:func:`optunet_forward_bounds` for a Rank-1 OptuNet (``train_zoo.methods.rank1``):
    example ``n`` runs every layer as ``y = r_n * (W (s_n * x)) + b_n``, with ``r``,
    ``s`` ``{layer: (B, channels)}`` for ``conv1``, ``conv2`` and ``fc`` and ``bias``
    ``(B, classes)`` the head's per-example bias (the model's own ``fc.bias`` unused).

    A layer's output is a ``k``-term sum (its kernel over a group, or the head's inputs)
    scaled twice (``s`` on the input and ``r`` on the output, or ``r s`` on the
    unscaled sum as the fast engine's kernel does), the head's plus one bias: each side
    rounds by at most ``gamma(k + 3) * A`` with ``A = |r| (|W| (|s| |x|)) + |b|``, and a
    layer carries its input's error through ``|r| |W| |s|``. ``delta`` (side 1 minus
    side 2) may hold the weights' differences (``"conv1.weight"``, ...), the factors'
    (``"r.conv1"``, ``"s.conv1"``, ...: ``(B, channels)``) and the bias's (``"bias"``),
    each entering to first order as ``|dr| |W| |s| A_in`` etc. ``near_switch`` as in
    :func:`optunet_forward_bounds`.
    """
    delta = delta or {}
    weights = {name: value.detach().double() for name, value in model.named_parameters()}
    count = len(images)
    near = torch.zeros(count, dtype=torch.int64)

    def per_example(factor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return factor.detach().double().reshape(count, -1, *([1] * (like.dim() - 2)))

    def layer(name: str, terms: int, apply, value, a, e, head_bias=None):
        weight = weights[f"{name}.weight"]
        s_in, r_out = per_example(s[name], value), None
        out = apply(s_in * value, weight)
        r_out = per_example(r[name], out)
        out = r_out * out
        inner = apply(s_in.abs() * a, weight.abs())
        a_out = r_out.abs() * inner
        e_out = r_out.abs() * apply(s_in.abs() * e, weight.abs())
        if f"{name}.weight" in delta:
            e_out = e_out + r_out.abs() * apply(s_in.abs() * a,
                                                delta[f"{name}.weight"].detach().double().abs())
        if f"r.{name}" in delta:
            e_out = e_out + per_example(delta[f"r.{name}"], out).abs() * inner
        if f"s.{name}" in delta:
            e_out = e_out + r_out.abs() * apply(per_example(delta[f"s.{name}"], value).abs()
                                                * a, weight.abs())
        if head_bias is not None:
            out = out + head_bias.detach().double()
            a_out = a_out + head_bias.detach().double().abs()
            if "bias" in delta:
                e_out = e_out + delta["bias"].detach().double().abs()
        e_out = e_out + implementations * gamma(terms + 3) * a_out
        return out, a_out, e_out

    def relu(value, e):
        nonlocal near
        near += ((value != 0) & (value.abs() <= e)).flatten(1).sum(1)
        return torch.relu(value)

    if not (hasattr(model, "fc") and hasattr(model, "conv1")) or model.fc.bias is None:
        raise ValueError("the bound is for OptuNet's Rank-1 network (conv1, conv2, fc)")
    conv1, conv2, pool, fc = model.conv1, model.conv2, model.pool1, model.fc
    x = images.detach().double()
    a, e = x.abs(), torch.zeros_like(x)
    value, a, e = layer("conv1", _conv_terms(conv1),
                        lambda v, w: _conv(conv1, v, w, None), x, a, e)
    value = relu(value, e)
    near += _window_near(value, e, pool)
    value, a, e = _pool(pool, value), _pool(pool, a), _pool(pool, e)
    value, a, e = layer("conv2", _conv_terms(conv2),
                        lambda v, w: _conv(conv2, v, w, None), value, a, e)
    value = relu(value, e)
    positions = value.shape[2] * value.shape[3]
    value, a, e = value.mean((2, 3)), a.mean((2, 3)), e.mean((2, 3))
    e = e + implementations * gamma(positions + 1) * a
    value, a, e = layer("fc", fc.in_features, lambda v, w: F.linear(v, w), value, a, e,
                        head_bias=bias)
    return ForwardBounds(value, e, a, near)


def rank1_cross_entropy_bound(bounds: ForwardBounds) -> float:
    """The mean cross-entropy's bound for :func:`rank1_forward_bounds` (as
    :func:`cross_entropy_bound`: the logits' bound carried by the loss, plus its own
    rounding)."""
    return (2 * float(bounds.error.max(1).values.mean())
            + cross_entropy_rounding(bounds.logits.float()))


def rank1_gradient_rtol(model: nn.Module, images: torch.Tensor) -> float:
    """:func:`gradient_rtol` for a Rank-1 OptuNet on ``images`` (the tiled batch): the
    roundings on the longest path to a gradient (:func:`optunet_gradient_terms`) plus,
    for each of the three layers, its two scalings forward and two backward, and the
    factors' own chain rule (``eps`` and softplus' derivative): 14 more."""
    return gamma(optunet_gradient_terms(model, images) + 14)


# ------------------------------------------------------------------ softmax outputs
#: Below float32's normal range a probability is absolute, not relative, rounding: the
#: report's kernels stop their exponential at exp(-87) ~ 1.6e-38, torch's underflows to
#: subnormals; 2^-124 (4.7e-38) covers either side's difference there.
UNDERFLOW = 2.0 ** -124


def softmax_rounding(logits: torch.Tensor, spread: torch.Tensor | float = 0.0
                     ) -> torch.Tensor:
    """One float32 softmax's relative rounding per entry (``(B, K)``), of logits whose
    exact values are ``logits`` (float64) and which may be off by ``spread`` more: the
    shift ``z_k - m`` (``u |z_k - m|``), the exponential (2 ulp, ``4 u``, what libm, SLEEF
    and torch promise; the report's kernels' Cephes ``expf`` measured 1.4 u), the sum of
    K positive terms (``gamma(K - 1)`` plus the terms' errors weighted by ``p``) and the
    division (``u``)."""
    k = logits.shape[1]
    shift = (logits.max(1, keepdim=True).values - logits) + spread
    p = torch.softmax(logits, 1)
    weighted = (p * shift).sum(1, keepdim=True)
    return (4 * U32 + U32 * shift) + (4 * U32 + U32 * weighted + gamma(k - 1)) + U32


def softmax_bounds(bounds: ForwardBounds) -> torch.Tensor:
    """A bound ``(B, K)`` on ``|p_1 - p_2|`` between two implementations' float32 softmax
    outputs of the logits :func:`optunet_forward_bounds` describes (two sides, logits
    ``E = max_k error`` apart at most: each within ``E / 2`` of the exact ``z``).

    Each side's softmax of its own logits, in exact arithmetic, is within
    ``p (e^E - 1)`` of the exact ``p`` (``p_k(z + d) / p_k(z)`` lies in
    ``[e^(-2 max|d|), e^(2 max|d|)]``), and its float32 softmax within
    ``p e^E r (1 + r)`` of that (:func:`softmax_rounding` ``r``); plus
    :data:`UNDERFLOW` absolute. The forward bound holds whichever way a ReLU or max-pool
    decision near its switch goes (both are 1-Lipschitz), so no example is left out.
    """
    spread = bounds.error.max(1, keepdim=True).values
    p = torch.softmax(bounds.logits, 1)
    r = softmax_rounding(bounds.logits, spread)
    return 2 * p * (torch.expm1(spread) + torch.exp(spread) * r * (1 + r)) + 2 * UNDERFLOW


def softmax_sum_bound(bounds: ForwardBounds) -> torch.Tensor:
    """Per example (``(B,)``), how far one side's float32 softmax outputs may sum from 1:
    its exact-arithmetic softmax sums to 1, its rounding is ``r`` of each entry
    (:func:`softmax_rounding`), each entry at most ``p e^E``, plus :data:`UNDERFLOW` per
    entry."""
    spread = bounds.error.max(1, keepdim=True).values
    p = torch.softmax(bounds.logits, 1)
    r = softmax_rounding(bounds.logits, spread)
    return (p * torch.exp(spread) * r * (1 + r)).sum(1) + bounds.logits.shape[1] * UNDERFLOW


def assert_metrics_within_bounds(ours, theirs, data, model: nn.Module | None = None) -> None:
    """Two engines' stored metrics of one produced checkpoint (``.state``: numpy arrays,
    ``.metrics``: ``{split}_loss`` and ``{split}_accuracy``) on the train and test splits of
    ``data``: the losses within :func:`evaluation_bounds` at ``theirs``' weights (``model``
    holding them; default an OptuNet loaded with them) with the weights' difference, the
    accuracies apart by at most the examples whose decision lies within rounding."""
    if model is None:
        from posteriorzoo.models import build

        model = build("optunet")
        model.load_state_dict({k: torch.from_numpy(v) for k, v in theirs.state.items()})
    delta = {key: torch.from_numpy(ours.state[key].astype(np.float64) - value)
             for key, value in theirs.state.items()}
    for split in ("train", "test"):
        dataset = getattr(data, split)
        loss, flips = evaluation_bounds(model, dataset, delta)
        assert abs(ours.metrics[f"{split}_loss"] - theirs.metrics[f"{split}_loss"]) <= loss
        assert abs(ours.metrics[f"{split}_accuracy"]
                   - theirs.metrics[f"{split}_accuracy"]) * len(dataset) <= flips + 1e-9


# ------------------------------------------------------------------ deep networks
#: Roundings of one BatchNorm output in evaluation mode: ``var + eps``, its reciprocal
#: square root (2 ulp), the product with the weight, ``mean * scale``, ``bias - that``,
#: ``x * scale`` and the final sum.
BATCHNORM_ROUNDINGS = 8


def forward_terms(model: nn.Module, inputs: torch.Tensor) -> int:
    """An upper bound on the roundings along the longest path of ``model``'s forward pass
    on ``inputs`` (evaluation mode), for any network built from torch's layers: the sum,
    over every module the pass runs, of one output's roundings. A convolution or Linear
    layer sums its kernel over a group plus the bias; BatchNorm
    (:data:`BATCHNORM_ROUNDINGS`, plus two sums over the batch and positions per output
    in training mode); an average pool its window plus the division; ReLU, max pooling,
    flattening and dropout in evaluation mode are exact. Every module with children may
    add its branches once (a residual block's sum; a ``Sequential`` adds nothing).
    Parallel branches (a shortcut convolution) are counted too, so this exceeds the
    longest path. A leaf module of another kind raises: its roundings are unknown here.

    Its ``gamma`` is the relative tolerance of two float32 implementations of the pass on
    the *result's* scale (:func:`deep_rtol`), as :func:`gradient_rtol` is for gradients.
    """
    exact = (nn.ReLU, nn.MaxPool2d, nn.Flatten, nn.Identity, nn.Dropout)
    terms = 0

    def count(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        nonlocal terms
        x = args[0]
        if isinstance(module, nn.modules.conv._ConvNd):
            kernel = math.prod(module.kernel_size)
            terms += module.in_channels // module.groups * kernel + (module.bias is not None)
        elif isinstance(module, nn.Linear):
            terms += module.in_features + (module.bias is not None)
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            terms += BATCHNORM_ROUNDINGS
            if module.training or not module.track_running_stats:
                terms += 2 * x.numel() // x.shape[1]
        elif isinstance(module, (nn.AdaptiveAvgPool2d, nn.AvgPool2d)):
            terms += x.shape[-1] * x.shape[-2] // (output.shape[-1] * output.shape[-2]) + 1
        elif isinstance(module, nn.Sequential):
            pass   # composes its children (an empty one is an identity shortcut)
        elif len(list(module.children())) > 0:
            terms += 1
        elif not isinstance(module, exact):
            raise ValueError(f"forward_terms: no rounding count for {type(module).__name__}")

    handles = [module.register_forward_hook(count) for module in model.modules()]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return terms


def deep_rtol(model: nn.Module, inputs: torch.Tensor, extra: int = 0) -> float:
    """The tolerance of two float32 implementations' outputs of a deep ``model`` (a
    ResNet) on ``inputs``, relative to the output's largest entry: ``gamma(k)`` with ``k``
    the roundings on the longest path (:func:`forward_terms`; ``extra`` for what follows
    the pass, e.g. a sum over the data set). ``2 * deep_rtol`` bounds the difference of
    two implementations, each within it of the exact result.

    The worst-case bound of :func:`optunet_forward_bounds` (``gamma(k) |W| |x|``, layer
    by layer) holds here too but tests nothing: through the 20 layers of a ResNet-18 the
    absolute-value network ``|W_L| ... |W_1| |x|`` exceeds the logits by a factor of
    10^11 (width 4, measured), because each layer's sum cancels. On the result's scale it
    is the longest reduction's length times the unit roundoff, the convention of
    :func:`gradient_rtol`; each test states its measured margin.
    """
    return gamma(forward_terms(model, inputs) + extra)


# ------------------------------------------------------------------ MMD noise floor
def noise_floor_bound(m: int, n: int) -> float:
    """How far the noise floor's MMD^2 of a split (X: m, Y: n checkpoints) may be from
    compare_arrays' on the same arrays, in float64.

    Both read every kernel sum from the same distances; the floor's X-X sum is the table
    of all P = (m + n)(m + n - 1) / 2 pairs less the X-Y and Y-Y sums, compare_arrays'
    a direct sum. Each of these sums of positive terms (kernel values at most 1, so each
    at most P) is within ``e gamma(P + 2 TERMS + 8)`` of itself in float64 (a bin's
    moments: up to P terms; its Taylor polynomial: 2 TERMS roundings, whose terms' sum
    of absolute values is at most e^(1/2) times its value each way; the exponential, the
    product, the compensated sum over bins; truncation below 4e-17), four such sums enter
    the difference, and the statistic weighs the X-X sum by 2 / (m (m - 1)). The median
    over kernels is 1-Lipschitz and the summary a weighted mean over layers."""
    from posteriorzoo.mmd.pair_sums import TERMS

    pairs = (m + n) * (m + n - 1) // 2
    return 2 / (m * (m - 1)) * 4 * pairs * math.e * gamma(pairs + 2 * TERMS + 8, U64)
