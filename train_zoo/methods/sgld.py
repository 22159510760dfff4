"""SGLD (Welling & Teh 2011): stochastic-gradient Langevin dynamics chains.

The update, in the `posteriors` library's form (temperature 1)::

    theta <- theta + lr * grad log p(theta | D) + N(0, lr (2 - lr V_hat))

is SGHMC's (:mod:`train_zoo.methods.sghmc`) with friction ``alpha = 1``: the momentum is
forgotten at every step, ``v' = lr * grad + N(0, 2 (1 - beta_hat) lr)`` and
``theta' = theta + v'``, where ``beta_hat = lr V_hat / 2`` is the share of the noise the
minibatch gradient already brings (Chen et al.'s correction; the `posteriors` library's
``beta`` is ``V_hat``). Note the step: ``lr`` is the Euler step of
``d theta = grad log p dt + sqrt(2) dW``, so the injected variance is ``2 lr``, not
Welling and Teh's ``lr / 2`` drift with variance ``lr`` (the same chain at twice their
step size).

After an adapted chain's cold rounds, which derive SGHMC's step ``eta`` and friction
``alpha`` from the gradient noise, SGLD samples at the Langevin step ``eta / alpha``:
SGHMC's overdamped limit, the same distance per step and the same share of noise
correction (:meth:`~train_zoo.methods.sghmc.Sghmc.sampling_step`; at ``eta`` itself the
chain moved ``1 / alpha``, about 500, times slower and did not mix: ESS 7.7 of 100).

So SGLD is the SGHMC chain machinery with the friction fixed: the same chains per mode,
burn-in, thinning, minibatch noise correction and preconditioners (``laplace``: a
constant mass matrix, under which Langevin dynamics stays exact; ``adapted``: the same
warm-up and cold rounds to find the metric and the start, then Langevin steps). Its
options are SGHMC's without ``alpha``. Welling and Teh's decreasing step size is not
used: like SGHMC's, the chain runs at a constant step, whose bias ``diagnose`` and the
closed-form tests measure.
"""

from __future__ import annotations

from train_zoo.methods.sghmc import Sghmc
from train_zoo.methods.sghmc_options import method_options


class Sgld(Sghmc):
    """SGLD chains from each trained base network: :class:`Sghmc` whose kept steps have
    friction 1 (the chain's options, schedule and preconditioners are SGHMC's)."""

    name = "sgld"
    summary = "stochastic-gradient Langevin dynamics chains from each trained base network"
    sampling_friction = 1.0
    options = method_options("sgld")  # the vocabulary's SGLD_OPTIONS: SGHMC's without alpha


METHOD = Sgld()
