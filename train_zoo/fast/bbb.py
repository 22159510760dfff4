"""The numba fast path of Bayes by Backprop: :class:`FastBBB`.

:class:`FastBBB` takes the step of :func:`train_zoo.methods.bbb.loss_and_grad` and
:func:`train_zoo.methods.bbb.update` for OptuNet-shaped networks on the numba kernels
(:mod:`train_zoo.fast`), with ``mu`` and ``rho`` held in one flat float32 vector. Per step::

    dL/dmu  = mean_s g_s + dKL/dmu
    dL/drho = (mean_s g_s eps_s + dKL/dsigma) sigmoid(rho)

with ``g_s = dNLL/dw`` at ``w_s = mu + sigma * eps_s``, one kernel call per ELBO sample.
The noise comes from :func:`~train_zoo.methods.bbb.draw_noise` in the same order as the
torch.func path, so with the same generator both take the same step up to float32
rounding. The method itself (prior, KL, initialisation) is described in
:mod:`train_zoo.methods.bbb`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from posteriorzoo.errors import InvalidOptionError
from train_zoo.fast.gradients import fast_loss_and_grad
from train_zoo.fast.kernels import sgd_update
from train_zoo.fast.layout import NetLayout
from train_zoo.methods.bbb import (
    _HALF_LOG_2PI,
    OPTIMIZERS,
    BBBRun,
    BBBState,
    ElboLog,
    OptimizerState,
    _adam,
    draw_noise,
)
from train_zoo.methods.common import Params

__all__ = ["FastBBB", "FastBBBStepper"]


def _flat(values: Mapping[str, Tensor], keys: Sequence[str]) -> np.ndarray:
    return torch.cat([values[key].detach().reshape(-1) for key in keys]).numpy()


class FastBBB:
    """A :class:`BBBState` of an OptuNet-shaped network, stepped by the numba kernels.

    Holds ``mu`` and ``rho`` in one flat float32 vector ``params`` ``(2P,)`` (``mu`` then
    ``rho``, each in state_dict order) with the optimisers' buffers (SGD's momentum, or
    Adam's two moments; one optimiser for ``mu``, one for ``rho``). Each step draws its
    noise with :func:`draw_noise` exactly as
    :func:`~train_zoo.methods.bbb.loss_and_grad` does and takes one kernel call per ELBO
    sample; the loss is cross-entropy.

    Parameters
    ----------
    layout : NetLayout
        The network (:func:`~train_zoo.fast.layout.describe_model`).
    state : BBBState
        float32, every parameter variational (true for OptuNet), keys in ``layout.keys``
        order. Copied.

    Attributes
    ----------
    params : float32 array ``(2 P,)``
    mu, rho : float32 arrays ``(P,)``
        Views into ``params``.
    grad, momentum_buffer : float32 arrays ``(2 P,)``
        The last step's gradient and SGD's momentum buffers.
    adam_first, adam_second : float32 arrays ``(2 P,)``
        Adam's moments (zeros where Adam has not stepped).
    buffers : dict
        ``{"mu": (kind, steps) or None, "rho": ...}``: which optimiser's buffers each
        half holds and its steps (None: none yet, or SGD without momentum).
    nll, kl : float
        The last step's terms of the loss (:class:`~train_zoo.methods.bbb.ElboTerms`):
        the expected NLL per example and the KL in nats.
    """

    def __init__(self, layout: NetLayout, state: BBBState) -> None:
        keys = list(layout.keys)
        if list(state.mu) != keys or list(state.rho) != keys:
            raise ValueError(f"the state must have every parameter variational, in the order "
                             f"{keys}; it has means {list(state.mu)}, rho {list(state.rho)}")
        if any(value.dtype != torch.float32 for value in (*state.mu.values(),
                                                           *state.rho.values())):
            raise ValueError("the fast path needs a float32 state")
        self.layout = layout
        self.options = state.options
        self.size = layout.num_params
        self.params = np.ascontiguousarray(np.concatenate([_flat(state.mu, keys),
                                                           _flat(state.rho, keys)]))
        self.mu = self.params[:self.size]
        self.rho = self.params[self.size:]
        self.grad = np.zeros_like(self.params)
        self.momentum_buffer = np.zeros_like(self.params)
        self.adam_first = np.zeros_like(self.params)
        self.adam_second = np.zeros_like(self.params)
        self.nll, self.kl = math.nan, math.nan
        self._parts = {"mu": slice(0, self.size), "rho": slice(self.size, 2 * self.size)}
        self.buffers: dict[str, tuple[str, int] | None] = {}
        for group, old in (("mu", state.mu_buffers), ("rho", state.rho_buffers)):
            self.buffers[group] = None if old is None else (old.kind, old.steps)
            if old is None:
                continue
            part = self._parts[group]
            if old.kind == "sgd":
                self.momentum_buffer[part] = _flat(old.first, keys)
            else:
                if old.second is None:
                    raise ValueError(f"BBB's {group} Adam state has no second moments")
                self.adam_first[part] = _flat(old.first, keys)
                self.adam_second[part] = _flat(old.second, keys)
        self._like = {key: torch.empty(value.shape, dtype=torch.float32)
                      for key, value in state.rho.items()}
        self._wgrad = np.empty(self.size, dtype=np.float32)

    def loss_and_grad(self, x: np.ndarray, labels: np.ndarray, generator: torch.Generator,
                      num_data: int) -> float:
        """The loss of :func:`~train_zoo.methods.bbb.loss_and_grad` on a batch in the
        kernels' layout.

        ``x`` float32 ``(C, H, W, B)``, ``labels`` int64 ``(B,)``. Leaves d loss / d mu and
        d loss / d rho in ``grad`` (``[:P]`` and ``[P:]``) and returns the loss.
        """
        opts = self.options
        kl_weight = opts.kl_weight_for(num_data)
        mu, rho = self.mu, self.rho
        z = np.exp(rho)
        sigma = nn.functional.softplus(torch.from_numpy(rho)).numpy()
        dsigma_drho = z / (z + np.float32(1))  # torch's softplus backward
        noise = draw_noise(self._like, generator, opts.elbo_samples)
        count = len(noise)
        grad_mu = np.zeros(self.size, dtype=np.float32)
        grad_sigma = np.zeros(self.size, dtype=np.float32)
        data, kl = 0.0, 0.0
        s1, s2, pi = (float(opts.prior_sigma), float(opts.prior_sigma2),
                      float(opts.prior_pi))
        for draws in noise:
            eps = torch.cat([value.reshape(-1) for value in draws.values()]).numpy()
            weights = mu + sigma * eps
            loss, g = fast_loss_and_grad(self.layout, weights, x, labels, grad=self._wgrad)
            data += loss
            if not opts.closed_form_kl:
                # MC KL at w: log q(w) - log p(w); d/dw of -log p(w) joins the data term.
                w2 = weights.astype(np.float64) ** 2
                first = -w2 / (2 * s1 * s1) - math.log(s1) + math.log(pi)
                second = -w2 / (2 * s2 * s2) - math.log(s2) + math.log1p(-pi)
                log_p = np.logaddexp(first, second) - _HALF_LOG_2PI
                kl += float(np.sum(-np.log(sigma.astype(np.float64)) - 0.5 * eps.astype(
                    np.float64) ** 2 - _HALF_LOG_2PI) - np.sum(log_p))
                r1 = np.exp(first - np.logaddexp(first, second))
                dlogp = -weights * (r1 / (s1 * s1) + (1 - r1) / (s2 * s2)).astype(np.float32)
                g = g - np.float32(kl_weight) * dlogp
            grad_mu += g
            grad_sigma += g * eps
        inv = np.float32(1.0 / count)
        grad_mu *= inv
        grad_sigma *= inv
        if opts.closed_form_kl:
            p2 = np.float32(s1 * s1)
            kl = float(np.sum(math.log(s1) - np.log(sigma.astype(np.float64))
                              + (sigma.astype(np.float64) ** 2 + mu.astype(np.float64) ** 2)
                              / (2 * s1 * s1) - 0.5))
            grad_mu += np.float32(kl_weight) * (mu / p2)
            grad_sigma += np.float32(kl_weight) * (sigma / p2 - np.float32(1) / sigma)
        else:
            kl /= count
            grad_sigma -= np.float32(kl_weight) / sigma
        self.grad[:self.size] = grad_mu
        self.grad[self.size:] = grad_sigma * dsigma_drho
        self.nll, self.kl = data / count, kl
        return float(np.float32(data / count + kl_weight * kl))

    def step(self, x: np.ndarray, labels: np.ndarray, generator: torch.Generator,
             num_data: int, lr: float, *, momentum: float = 0.0, nesterov: bool = False,
             optimizer: str = "sgd", rho_lr: float | None = None,
             rho_optimizer: str | None = None) -> float:
        """:meth:`loss_and_grad` then the step of :func:`~train_zoo.methods.bbb.update`
        (SGD: bit-identical to it given the same gradient; Adam: the same function on the
        flat halves); returns the loss before the update."""
        if nesterov and momentum == 0:
            raise InvalidOptionError("nesterov needs momentum > 0")
        rho_optimizer = optimizer if rho_optimizer is None else rho_optimizer
        kinds = {"mu": optimizer, "rho": rho_optimizer}
        for (group, kind), option in zip(kinds.items(), ("optimizer", "rho_optimizer"),
                                         strict=True):
            if kind not in OPTIMIZERS:
                raise InvalidOptionError(f"{option} must be one of {', '.join(OPTIMIZERS)}, "
                                         f"not {kind!r}")
            held = self.buffers[group]
            if held is not None and held[0] != kind:
                raise InvalidOptionError(f"{option} is {kind}, but the state holds the "
                                         f"buffers of {held[0]}")
        loss = self.loss_and_grad(x, labels, generator, num_data)
        rates = {"mu": lr, "rho": lr if rho_lr is None else rho_lr}
        if kinds == {"mu": "sgd", "rho": "sgd"} and rates["mu"] == rates["rho"] \
                and self.buffers["mu"] == self.buffers["rho"]:
            # the paper's step: one call, as before each half had its own optimiser
            sgd_update(self.params, self.grad, self.momentum_buffer, lr, 0.0, momentum,
                       nesterov, self.buffers["mu"] is not None)
        else:
            for group, part in self._parts.items():
                if kinds[group] == "adam":
                    self._adam_step(part, rates[group], self._steps(group) + 1)
                else:
                    sgd_update(self.params[part], self.grad[part], self.momentum_buffer[part],
                               rates[group], 0.0, momentum, nesterov,
                               self.buffers[group] is not None)
        for group, kind in kinds.items():
            if kind == "adam" or momentum != 0:
                self.buffers[group] = (kind, self._steps(group) + 1)
        return loss

    def _steps(self, group: str) -> int:
        held = self.buffers[group]
        return 0 if held is None else held[1]

    def _adam_step(self, part: slice, lr: float, steps: int) -> None:
        """:func:`~train_zoo.methods.bbb._adam` on one flat half."""
        value, first, second = _adam(
            torch.from_numpy(self.params[part]), torch.from_numpy(self.grad[part]),
            torch.from_numpy(self.adam_first[part]), torch.from_numpy(self.adam_second[part]),
            steps, lr)
        self.params[part] = value.numpy()
        self.adam_first[part] = first.numpy()
        self.adam_second[part] = second.numpy()

    def arrays(self) -> dict[str, np.ndarray]:
        """The current means in state_dict layout, without copying.

        Returns
        -------
        dict of str to float32 array
            ``{key: view}`` into :attr:`mu`, shaped like the parameters (keys in
            ``layout.keys`` order); the views follow every later :meth:`step`, so copy
            them to keep a snapshot. Lets the trainer's callbacks read the weights.
        """
        return self.layout.views(self.mu)

    def state(self) -> BBBState:
        """A copy as a :class:`BBBState` (the optimisers' buffers included once used)."""
        def tensors(flat: np.ndarray) -> Params:
            return {key: torch.from_numpy(value.copy())
                    for key, value in self.layout.views(flat).items()}

        buffers: dict[str, OptimizerState | None] = {}
        for group, part in self._parts.items():
            held = self.buffers[group]
            if held is None:
                buffers[group] = None
            elif held[0] == "sgd":
                buffers[group] = OptimizerState("sgd", held[1],
                                                tensors(self.momentum_buffer[part]))
            else:
                buffers[group] = OptimizerState("adam", held[1], tensors(self.adam_first[part]),
                                                tensors(self.adam_second[part]))
        return BBBState(mu=tensors(self.mu), rho=tensors(self.rho), options=self.options,
                        mu_buffers=buffers["mu"], rho_buffers=buffers["rho"])


class FastBBBStepper:
    """BBB's SGD or Adam on the numba kernels
    (:class:`~train_zoo.methods.bbb_fast.FastBBB`)."""

    def __init__(self, fast: FastBBB, run: BBBRun) -> None:
        self.fast = fast
        self.run = run
        self.stopped = False
        self.log = ElboLog(fast.options.kl_weight_for(run.num_data))

    def step(self, batch: tuple, lr: float) -> float:
        x, labels = batch
        loss = self.fast.step(x, labels, self.run.generator, self.run.num_data, lr,
                              momentum=self.run.momentum, nesterov=self.run.nesterov,
                              optimizer=self.run.optimizer, rho_lr=self.run.rho_lr(lr),
                              rho_optimizer=self.run.rho_optimizer)
        self.log.add(self.fast.nll, self.fast.kl)
        self.stopped = not math.isfinite(loss)
        return loss

    def arrays(self) -> dict[str, np.ndarray]:
        return self.fast.arrays()

    def bbb_state(self) -> BBBState:
        return self.fast.state()
