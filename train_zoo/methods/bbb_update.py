"""Bayes by Backprop's optimiser step: SGD or Adam on ``mu`` and ``rho``, out of place.

:func:`update` takes one ``torch.optim.SGD`` or ``torch.optim.Adam`` step (no weight
decay) on each group, the means and ``rho``, each with its own optimiser and learning rate
(:class:`~train_zoo.methods.bbb_options.BBBTraining`), and returns a new
:class:`~train_zoo.methods.bbb_state.BBBState` holding the buffers; :func:`step` is
:func:`~train_zoo.methods.bbb_elbo.loss_and_grad` then :func:`update`. ``_adam`` is
shared with the numba path (:mod:`train_zoo.fast.bbb`), which applies it to its flat
vectors. It is apart from the loss (:mod:`~train_zoo.methods.bbb_elbo`) because it is
not the method's formula but ``torch.optim``'s update rules, written out of place so that
a state is never modified. Every name is re-exported by :mod:`train_zoo.methods.bbb`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_bool, check_choice, check_number
from train_zoo.methods.bbb_elbo import NLL, loss_and_grad
from train_zoo.methods.bbb_options import ADAM_BETAS, ADAM_EPS, OPTIMIZERS
from train_zoo.methods.bbb_state import BBBGrads, BBBState, OptimizerState
from train_zoo.methods.common import Params, mean_nll

__all__ = ["step", "update"]

def _sgd(value: Tensor, grad: Tensor, buf: Tensor | None, lr: float, momentum: float,
         nesterov: bool) -> tuple[Tensor, Tensor | None]:
    """``torch.optim.SGD``'s update of one tensor (no weight decay, no dampening), out of
    place: returns the new value and momentum buffer."""
    if momentum != 0:
        buf = grad.clone() if buf is None else buf.mul(momentum).add(grad)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    return value.add(grad, alpha=-lr), buf


def _adam(value: Tensor, grad: Tensor, first: Tensor | None, second: Tensor | None,
          steps: int, lr: float) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.optim.Adam``'s update of one tensor (its single-tensor path, no weight
    decay, no amsgrad) at step ``steps`` (1 for the first), out of place: returns the new
    value and moments. The numba path calls it on its flat vectors too."""
    beta1, beta2 = ADAM_BETAS
    first = torch.zeros_like(value) if first is None else first
    second = torch.zeros_like(value) if second is None else second
    first = first.lerp(grad, 1 - beta1)
    second = second.mul(beta2).addcmul(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** steps)
    denom = (second.sqrt() / (1 - beta2 ** steps) ** 0.5).add(ADAM_EPS)
    return value.addcdiv(first, denom, value=-step_size), first, second


def _group_step(option: str, values: Params, grads: Params, buffers: OptimizerState | None,
                kind: str, lr: float, momentum: float, nesterov: bool
                ) -> tuple[Params, OptimizerState | None]:
    """One group's (the means' or rho's) step: new values and buffers."""
    if buffers is not None and buffers.kind != kind:
        raise InvalidOptionError(f"{option} is {kind}, but the state holds the buffers of "
                                 f"{buffers.kind}")
    steps = (buffers.steps if buffers else 0) + 1
    seconds = buffers.second if buffers else None
    if kind == "adam" and buffers and seconds is None:
        raise InvalidOptionError(f"{option}: the state's Adam buffers have no second moments")
    new, first, second = {}, {}, {}
    for name, value in values.items():
        old_first = buffers.first[name] if buffers else None
        if kind == "adam":
            new[name], first[name], second[name] = _adam(
                value, grads[name], old_first, seconds[name] if seconds is not None else None,
                steps, lr)
        else:
            new[name], buf = _sgd(value, grads[name], old_first, lr, momentum, nesterov)
            if buf is not None:
                first[name] = buf
    if kind == "adam":
        return new, OptimizerState("adam", steps, first, second)
    return new, OptimizerState("sgd", steps, first) if momentum != 0 else None


def update(state: BBBState, grads: BBBGrads, lr: float, *, momentum: float = 0.0,
           nesterov: bool = False, optimizer: str = "sgd", rho_lr: float | None = None,
           rho_optimizer: str | None = None) -> BBBState:
    """One optimiser step on ``mu`` and ``rho`` (no weight decay), as ``torch.optim.SGD``
    or ``torch.optim.Adam`` takes it.

    Parameters
    ----------
    state : BBBState
    grads : BBBGrads
        From :func:`elbo_and_grad`.
    lr : float
        Learning rate of the means (for the current epoch).
    momentum : float, default 0
        SGD's heavy-ball momentum (Adam ignores it); the buffers live in the returned
        state.
    nesterov : bool, default False
        Nesterov momentum (needs ``momentum > 0``; SGD only).
    optimizer : {"sgd", "adam"}, default "sgd"
        The means' optimiser; Adam with :data:`ADAM_BETAS` and :data:`ADAM_EPS`.
    rho_lr : float, optional
        Learning rate of ``rho`` (default ``lr``).
    rho_optimizer : {"sgd", "adam"}, optional
        ``rho``'s optimiser (default ``optimizer``).

    Returns
    -------
    BBBState
        A new state (the input is not modified).
    """
    check_number("lr", lr, 0)
    rho_lr = lr if rho_lr is None else check_number("rho_lr", rho_lr, 0)
    check_number("momentum", momentum, 0)
    if check_bool("nesterov", nesterov) and momentum == 0:
        raise InvalidOptionError("nesterov needs momentum > 0")
    check_choice("optimizer", optimizer, OPTIMIZERS)
    rho_optimizer = optimizer if rho_optimizer is None else check_choice(
        "rho_optimizer", rho_optimizer, OPTIMIZERS)
    mu, mu_buffers = _group_step("optimizer", state.mu, grads.mu, state.mu_buffers,
                                 optimizer, lr, momentum, nesterov)
    rho, rho_buffers = _group_step("rho_optimizer", state.rho, grads.rho, state.rho_buffers,
                                   rho_optimizer, rho_lr, momentum, nesterov)
    return BBBState(mu=mu, rho=rho, options=state.options, mu_buffers=mu_buffers,
                    rho_buffers=rho_buffers)


def step(state: BBBState, model: nn.Module, buffers: Mapping[str, Tensor],
         batch: tuple[Tensor, Tensor], generator: torch.Generator, num_data: int, lr: float,
         *, momentum: float = 0.0, nesterov: bool = False, optimizer: str = "sgd",
         rho_lr: float | None = None, rho_optimizer: str | None = None, nll: NLL = mean_nll
         ) -> tuple[BBBState, Tensor]:
    """:func:`loss_and_grad` then :func:`update`; returns the new state and the loss."""
    loss, grads = loss_and_grad(state, model, buffers, batch, generator, num_data, nll=nll)
    return update(state, grads, lr, momentum=momentum, nesterov=nesterov,
                  optimizer=optimizer, rho_lr=rho_lr, rho_optimizer=rho_optimizer), loss
