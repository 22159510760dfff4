"""Rank-1 BNNs' training objective and step: the KL, its annealing, the loss and SGD.

:func:`kl_divergence` and :func:`kl_scale` (the KL and its linear annealing),
:class:`Rank1Terms` and :func:`loss_and_grad` (the loss on the batch tiled ``K`` times and
its gradients: by ``torch.func`` autograd, or with the network part from an engine's kernel,
:func:`train_zoo.fast.rank1.rank1_network`), :func:`update` (SGD with the reference's
Nesterov momentum, :data:`MOMENTUM`, :data:`NESTEROV`) and :func:`step` (both). The loss
is written out in :mod:`train_zoo.methods.rank1`'s docstring; this module is the code of
that formula, apart from the factors it evaluates (:mod:`~train_zoo.methods.rank1_factors`)
and from the stepper that calls it once per batch (:class:`~train_zoo.methods.rank1.Rank1Stepper`,
which looks :func:`loss_and_grad` up in :mod:`train_zoo.methods.rank1`, where every public
name here is re-exported).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import grad_and_value

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_bool, check_integer, check_number
from train_zoo.methods.common import Params
from train_zoo.methods.rank1_factors import (
    Rank1State,
    _factors,
    _forward,
    _key,
    _tile,
    draw_noise,
)
from train_zoo.methods.rank1_options import Rank1Options

if TYPE_CHECKING:
    from train_zoo.fast.rank1 import Rank1Network

__all__ = [
    "MOMENTUM",
    "NESTEROV",
    "Rank1Terms",
    "kl_divergence",
    "kl_scale",
    "loss_and_grad",
    "step",
    "update",
]

#: The reference's optimiser: SGD with Nesterov momentum 0.9.
MOMENTUM = 0.9
NESTEROV = True


# ----------------------------------------------------------------------------- KL
def _entry_kl(loc: Tensor, rho: Tensor, opts: Rank1Options) -> Tensor:
    scale = nn.functional.softplus(rho)
    mean, scale0 = float(opts.prior_mean), float(opts.prior_scale)
    if opts.distribution == "gaussian":
        return (math.log(scale0) - torch.log(scale)
                + (scale * scale + (loc - mean) ** 2) / (2 * scale0 ** 2) - 0.5)
    return torch.log(((scale + scale0) ** 2 + (loc - mean) ** 2) / (4 * scale * scale0))


def _kl(group: Mapping[str, Params], opts: Rank1Options) -> Tensor:
    total = sum((_entry_kl(group[loc][name], group[rho][name], opts).sum()
                 for loc, rho in (("r_loc", "r_rho"), ("s_loc", "s_rho"))
                 for name in group[loc]), start=torch.zeros(()))
    return total / opts.components if opts.component_kl == "mean" else total


def kl_divergence(state: Rank1State) -> Tensor:
    """The KL term in nats (a 0-d tensor): the closed-form KL of every factor entry of every
    component to the prior, summed (``component_kl="sum"``) or divided by ``K``
    (``"mean"``); see :mod:`train_zoo.methods.rank1`'s docstring."""
    return _kl(state.trainable(), state.options)


def kl_scale(step: int, total_steps: int, annealing: float) -> float:
    """The KL's factor at update ``step`` (0-based) of ``total_steps``: rises linearly to 1
    at ``annealing * total_steps`` updates, ``min(1, (step + 1) / (annealing *
    total_steps))`` (1 throughout when that product is below one update)."""
    check_integer("step", step, 0)
    check_integer("total_steps", total_steps, 1)
    check_number("annealing", annealing, 0, maximum=1)
    ramp = annealing * total_steps
    return 1.0 if ramp < 1 else min(1.0, (step + 1) / ramp)


# --------------------------------------------------------------------------- loss
@dataclass(frozen=True)
class Rank1Terms:
    """One step's loss and its terms (detached 0-d tensors, ``kl_scale`` a float).

    ``loss = nll + kl_scale * kl / num_data + l2_term``: ``nll`` the average
    per-component mean cross-entropy, ``kl`` in nats (:func:`kl_divergence`), ``l2_term``
    ``l2 * sum(theta^2)``.
    """

    loss: Tensor
    nll: Tensor
    kl: Tensor
    kl_scale: float
    l2_term: Tensor


def _squares(group: Mapping[str, Params]) -> Tensor:
    return sum(((value * value).sum() for part in ("weights", "biases")
                for value in group[part].values()), start=torch.zeros(()))


def _loss(group: dict[str, Params], model: nn.Module, buffers: Mapping[str, Tensor],
          batch: tuple[Tensor, Tensor], noise: tuple[Params, Params], opts: Rank1Options,
          num_data: int, scale: float) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    images, labels = batch
    tiled, which = _tile(images, opts.components)
    clip = float(opts.clip)
    r = _factors(group["r_loc"], group["r_rho"], noise[0], which, clip)
    s = _factors(group["s_loc"], group["s_rho"], noise[1], which, clip)
    out = _forward(model, group["weights"], group["biases"], buffers, tiled, which, r, s)
    # The mean over the tiled batch is the average of the K per-component mean NLLs.
    nll = nn.functional.cross_entropy(out, labels.repeat(opts.components))
    kl = _kl(group, opts)
    l2_term = float(opts.l2) * _squares(group)
    loss = nll + scale * kl / num_data + l2_term
    return loss, (nll.detach(), kl.detach(), l2_term.detach())


def loss_and_grad(state: Rank1State, model: nn.Module, buffers: Mapping[str, Tensor],
                  batch: tuple[Tensor, Tensor], generator: torch.Generator | None,
                  num_data: int, total_steps: int, *,
                  noise: tuple[Params, Params] | None = None,
                  network: Rank1Network | None = None
                  ) -> tuple[Rank1Terms, dict[str, Params]]:
    """The loss on ``batch`` (tiled ``K`` times), its terms and its gradients.

    Parameters
    ----------
    state : Rank1State
    model : nn.Module
        The base architecture (its mode decides dropout and BatchNorm's behaviour).
    buffers : dict of str to tensor
        BatchNorm statistics (updated in place in training mode).
    batch : (images ``(B, ...)``, int64 labels ``(B,)``)
    generator : torch.Generator
        Source of the draws: :func:`draw_noise` for ``K B`` examples.
    num_data : int
        Training-set size ``N`` (the KL is divided by it).
    total_steps : int
        Updates of the whole training (the annealing's length, :func:`kl_scale`).
    noise : (eps_r, eps_s), optional
        The draws' ``eps`` for the ``K B`` tiled examples, instead of drawing.
    network : Rank1Network, optional
        The engine's kernel for the network part (:func:`train_zoo.fast.rank1.rank1_network`;
        ``batch`` then in the kernels' layout, numpy ``(C, H, W, B)`` and ``(B,)``): the
        same terms and gradients up to float32 rounding, without autograd through the
        network.

    Returns
    -------
    terms : Rank1Terms
    grads : dict
        d loss / d tensor, shaped like :meth:`Rank1State.trainable`.
    """
    opts = state.options
    check_integer("num_data", num_data, 1)
    scale = kl_scale(state.steps, total_steps, float(opts.kl_annealing))
    if noise is None:
        if generator is None:
            raise ValueError("loss_and_grad needs a generator (or the noise itself)")
        noise = draw_noise(state, opts.components * len(batch[1]), generator)
    if network is not None:
        return _loss_and_grad_on(network, state, batch, noise, num_data, scale)
    grads, (loss, (nll, kl, l2_term)) = grad_and_value(_loss, has_aux=True)(
        {part: dict(values) for part, values in state.trainable().items()}, model, buffers,
        batch, noise, opts, num_data, scale)
    return Rank1Terms(loss.detach(), nll, kl, scale, l2_term), grads


def _loss_and_grad_on(network: Rank1Network, state: Rank1State, batch: tuple,
                      noise: tuple[Params, Params], num_data: int, scale: float
                      ) -> tuple[Rank1Terms, dict[str, Params]]:
    """:func:`loss_and_grad` with the network's cross-entropy and its gradients from an
    engine's kernel. The factors, the KL and the L2 term stay torch's: the kernel's
    gradients of each example's ``r``, ``s`` and bias enter through the surrogate
    ``sum(r * dL/dr) + ...``, whose gradient with respect to the locations, scales and
    biases is the chain rule's."""
    opts = state.options
    images, labels = batch
    count = opts.components
    tiled = np.tile(images, (1, 1, 1, count))           # component-major, as _tile
    which = torch.arange(count).repeat_interleave(len(labels))
    group = {part: {name: value.detach().requires_grad_(True) for name, value in values.items()}
             for part, values in state.trainable().items()}
    clip = float(opts.clip)
    r = _factors(group["r_loc"], group["r_rho"], noise[0], which, clip)
    s = _factors(group["s_loc"], group["s_rho"], noise[1], which, clip)
    head = _key(state.layers[-1], "bias")
    bias = group["biases"][head][which]
    shared = {**group["weights"], head: torch.zeros_like(group["biases"][head][0])}
    theta = torch.cat([value.detach().reshape(-1) for value in shared.values()]).numpy()
    result = network(theta, {name: value.detach().numpy() for name, value in r.items()},
                     {name: value.detach().numpy() for name, value in s.items()},
                     bias.detach().numpy(), tiled, np.tile(labels, count))
    kl = _kl(group, opts)
    l2_term = float(opts.l2) * _squares(group)
    surrogate = scale * kl / num_data + l2_term + (bias * torch.from_numpy(result.bias)).sum()
    for factors, gradients in ((r, result.r), (s, result.s)):
        for name, value in factors.items():
            surrogate = surrogate + (value * torch.from_numpy(gradients[name])).sum()
    leaves = [(part, name, value) for part, values in group.items()
              for name, value in values.items()]
    found = torch.autograd.grad(surrogate, [value for _, _, value in leaves],
                                allow_unused=True)
    grads: dict[str, Params] = {part: {} for part in group}
    for (part, name, value), gradient in zip(leaves, found, strict=True):
        grads[part][name] = torch.zeros_like(value) if gradient is None else gradient
    start = 0
    for name, value in shared.items():
        size = value.numel()
        if name in grads["weights"]:
            kernel = torch.from_numpy(result.weights[start:start + size]).reshape(value.shape)
            grads["weights"][name] = grads["weights"][name] + kernel
        start += size
    nll = torch.tensor(result.loss, dtype=torch.float32)
    kl, l2_term = kl.detach(), l2_term.detach()
    loss = nll + scale * kl / num_data + l2_term
    return Rank1Terms(loss, nll, kl, scale, l2_term), grads


def _sgd(value: Tensor, grad: Tensor, buf: Tensor | None, lr: float, momentum: float,
         nesterov: bool) -> tuple[Tensor, Tensor | None]:
    """``torch.optim.SGD``'s update of one tensor (no weight decay or dampening), out of
    place: the new value and momentum buffer."""
    if momentum != 0:
        buf = grad.clone() if buf is None else buf.mul(momentum).add(grad)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    return value.add(grad, alpha=-lr), buf


def update(state: Rank1State, grads: Mapping[str, Params], lr: float, *,
           momentum: float = MOMENTUM, nesterov: bool = NESTEROV) -> Rank1State:
    """One SGD step on every trainable tensor (:meth:`Rank1State.trainable`); returns a new
    state with ``steps + 1`` (the input is not modified)."""
    check_number("lr", lr, 0)
    check_number("momentum", momentum, 0, maximum=1, strict_maximum=True)
    if check_bool("nesterov", nesterov) and momentum == 0:
        raise InvalidOptionError("nesterov needs momentum > 0")
    new: dict[str, Any] = {}  # Params by trainable field of Rank1State, for replace()
    buffers: dict[str, Params] = {}
    for part, values in state.trainable().items():
        new[part], buffers[part] = {}, {}
        for name, value in values.items():
            old = state.momentum[part][name] if state.momentum is not None else None
            new[part][name], buf = _sgd(value, grads[part][name], old, lr, momentum, nesterov)
            if buf is not None:
                buffers[part][name] = buf
    return replace(state, **new, steps=state.steps + 1,
                   momentum=buffers if momentum != 0 else None)


def step(state: Rank1State, model: nn.Module, buffers: Mapping[str, Tensor],
         batch: tuple[Tensor, Tensor], generator: torch.Generator, num_data: int,
         total_steps: int, lr: float, *, momentum: float = MOMENTUM,
         nesterov: bool = NESTEROV) -> tuple[Rank1State, Rank1Terms]:
    """:func:`loss_and_grad` then :func:`update`: the new state and the step's terms."""
    terms, grads = loss_and_grad(state, model, buffers, batch, generator, num_data,
                                 total_steps)
    return update(state, grads, lr, momentum=momentum, nesterov=nesterov), terms
