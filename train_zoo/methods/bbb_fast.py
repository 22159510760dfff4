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
from train_zoo.methods.bbb import _HALF_LOG_2PI, BBBGrads, BBBState, draw_noise
from train_zoo.methods.common import Params

__all__ = ["FastBBB"]


def _flat(values: Mapping[str, Tensor], keys: Sequence[str]) -> np.ndarray:
    return torch.cat([values[key].detach().reshape(-1) for key in keys]).numpy()


class FastBBB:
    """A :class:`BBBState` of an OptuNet-shaped network, stepped by the numba kernels.

    Holds ``mu`` and ``rho`` in one flat float32 vector ``params`` ``(2P,)`` (``mu`` then
    ``rho``, each in state_dict order) with SGD's momentum buffer. Each step draws its
    noise with :func:`draw_noise` exactly as :func:`~train_zoo.methods.bbb.loss_and_grad`
    does and takes one kernel call per ELBO sample; the loss is cross-entropy.

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
        The last step's gradient and SGD's momentum buffer.
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
        self.has_buffer = state.momentum is not None
        if self.has_buffer:
            self.momentum_buffer[:] = np.concatenate([_flat(state.momentum.mu, keys),
                                                      _flat(state.momentum.rho, keys)])
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
        return float(np.float32(data / count + kl_weight * kl))

    def step(self, x: np.ndarray, labels: np.ndarray, generator: torch.Generator,
             num_data: int, lr: float, *, momentum: float = 0.0, nesterov: bool = False
             ) -> float:
        """:meth:`loss_and_grad` then the SGD step of :func:`~train_zoo.methods.bbb.update`
        (bit-identical to it given the same gradient); returns the loss before the update."""
        if nesterov and momentum == 0:
            raise InvalidOptionError("nesterov needs momentum > 0")
        loss = self.loss_and_grad(x, labels, generator, num_data)
        sgd_update(self.params, self.grad, self.momentum_buffer, lr, 0.0, momentum, nesterov,
                   self.has_buffer)
        self.has_buffer = self.has_buffer or momentum != 0
        return loss

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
        """A copy as a :class:`BBBState` (momentum buffers included once used)."""
        def tensors(flat: np.ndarray) -> Params:
            return {key: torch.from_numpy(value.copy())
                    for key, value in self.layout.views(flat).items()}
        momentum = None
        if self.has_buffer:
            momentum = BBBGrads(mu=tensors(self.momentum_buffer[:self.size]),
                                rho=tensors(self.momentum_buffer[self.size:]))
        return BBBState(mu=tensors(self.mu), rho=tensors(self.rho), options=self.options,
                        momentum=momentum)
