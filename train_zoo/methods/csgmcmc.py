"""Cyclical SG-MCMC (Zhang et al. 2020): cSGLD and cSGHMC, one run through several modes.

The recipe's training budget (``epochs``, by default the recipe's) is cut into ``cycles``
cycles of ``L`` steps. Step ``k`` (0-based) runs at the cosine step size::

    lr_k = lr / 2 * (cos(pi * (k mod L) / L) + 1)

falling from ``lr`` to about 0 within every cycle, then jumping back (``lr`` by default
``alpha`` times the recipe's ``lr / (1 - momentum)``: the step the recipe's momentum SGD
takes, which the update below takes at friction ``alpha``): the large steps at a
cycle's start leave the mode the last cycle found, the small ones at its end settle into
the next. Each cycle has two stages:

- **exploration** (the first ``1 - sampling_fraction`` of the cycle): SGD with momentum
  ``1 - alpha`` on the log posterior, without noise;
- **sampling** (its last ``sampling_fraction``): the SGHMC update of
  :mod:`train_zoo.methods.sghmc` at temperature 1, ``v <- (1 - alpha) v + eta_k g +
  N(0, 2 alpha eta_k)``, ``theta <- theta + v``, with ``eta_k = lr_k / N`` and ``g`` the
  gradient of the full-data log posterior (``N`` times the minibatch mean log-likelihood
  plus the Gaussian prior of the recipe's weight decay), so that ``eta_k g`` is SGD's
  step ``lr_k`` on the mean loss with weight decay.

``alpha = 1`` is cSGLD (no momentum), ``alpha < 1`` cSGHMC (the authors' code uses 0.9).
``samples_per_mode / cycles`` samples are kept at the end of every cycle, evenly spaced
over its last ``keep_fraction`` (the last at the cycle's last step); the authors keep 3 in
the last 6% of each of 4 cycles. As in their code the run starts from the network's
initialisation (no base network): the whole budget is the method's.

Differences from the authors' code, each deliberate: the sampling stage targets the
posterior at temperature 1 (theirs defaults to a cold ``1 / N``), the prior is the
recipe's weight decay as for every method here, and a sample is the network's state (no
re-estimated BatchNorm statistics: a network with BatchNorm is refused for now).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import show
from posteriorzoo.vocabulary import (
    CSGHMC_ALPHA,
    CSGMCMC_CYCLES,
    CSGMCMC_KEEP_FRACTION,
    CSGMCMC_SAMPLING_FRACTION,
)
from train_zoo.loop import fit
from train_zoo.methods.base import (
    Collector,
    Context,
    Method,
    ModeRun,
    Posterior,
    Resolved,
    declared_options,
    generator_for,
)
from train_zoo.methods.common import Params, untrained_parameters
from train_zoo.methods.sghmc_steppers import LogPosteriorGradient
from train_zoo.methods.sghmc_update import prior_precision_from_weight_decay

# The numbers of the options, the vocabulary's (with their reasons): the default cycles
# (100 samples are 10 of each of 10 modes visited), the shares of each cycle with noise and
# whose samples are kept, cSGHMC's friction.
CYCLES, SAMPLING_FRACTION = CSGMCMC_CYCLES, CSGMCMC_SAMPLING_FRACTION
KEEP_FRACTION = CSGMCMC_KEEP_FRACTION


def cyclical_lr(lr: float, step: int, cycle_steps: int) -> float:
    """``lr / 2 * (cos(pi * (step mod L) / L) + 1)`` (Zhang et al.'s eq. 1, 0-based)."""
    return lr / 2 * (math.cos(math.pi * (step % cycle_steps) / cycle_steps) + 1)


def kept_steps(cycles: int, cycle_steps: int, per_cycle: int, keep_fraction: float
               ) -> list[int]:
    """The 1-based steps whose states are kept: ``per_cycle`` per cycle, evenly spaced over
    its last ``keep_fraction`` and ending at its last step."""
    window = max(per_cycle, int(keep_fraction * cycle_steps))
    spacing = window / per_cycle
    return [cycle * cycle_steps + cycle_steps - round(spacing * j)
            for cycle in range(cycles) for j in reversed(range(per_cycle))]


@dataclass
class CyclicalState:
    """The run's kept samples (state_dicts, in step order) and the cycle of each."""

    samples: list[dict[str, torch.Tensor]]
    cycles: list[int]


class CyclicalStepper:
    """The run's steps (module docstring): the cosine step size and the stage come from
    the step count; ``lr`` of :meth:`step` (the loop's per-epoch rate) is ignored."""

    def __init__(self, params: Params, gradient: LogPosteriorGradient, lr: float,
                 num_data: int, alpha: float, cycle_steps: int, sampling_fraction: float,
                 total_steps: int, generator: torch.Generator) -> None:
        self.params = {name: value.clone() for name, value in params.items()}
        self.momentum = {name: torch.zeros_like(value) for name, value in params.items()}
        self.gradient, self.lr, self.num_data, self.alpha = gradient, lr, num_data, alpha
        self.cycle_steps, self.total_steps = cycle_steps, total_steps
        self.sampling_from = (1 - sampling_fraction) * cycle_steps
        self.generator = generator
        self.steps = 0
        self.stopped = total_steps == 0

    def step(self, batch: tuple, lr: float) -> float:
        loss, grads = self.gradient(self.params, batch)
        eta = cyclical_lr(self.lr, self.steps, self.cycle_steps) / self.num_data
        sampling = self.steps % self.cycle_steps >= self.sampling_from
        std = math.sqrt(2 * self.alpha * eta)
        for name, theta in self.params.items():
            velocity = (1 - self.alpha) * self.momentum[name] + eta * grads[name].to(theta.dtype)
            if sampling:
                velocity = velocity + std * torch.randn(theta.shape, generator=self.generator,
                                                        dtype=theta.dtype)
            self.momentum[name] = velocity
            self.params[name] = theta + velocity
        self.steps += 1
        self.stopped = self.steps >= self.total_steps or not math.isfinite(loss)
        return loss

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: value.numpy() for name, value in self.params.items()}


def _cycles(what: str, value: int, context: Context) -> int:
    per_mode = context.samples_per_mode
    if per_mode is not None and per_mode % value:
        raise InvalidOptionError(f"{what} must divide samples_per_mode ({per_mode}), not "
                                 f"{show(value)}")
    return value


def _cycles_default(context: Context) -> Resolved:
    per_mode = context.samples_per_mode or CYCLES
    cycles = max(c for c in range(1, CYCLES + 1) if per_mode % c == 0)
    return Resolved(cycles) if cycles == CYCLES else Resolved(
        cycles, f"derived from samples_per_mode={per_mode}",
        note=f"{context.method}: cycles {cycles} (the largest count up to {CYCLES} "
             f"dividing samples_per_mode={per_mode})")


def _lr_default(context: Context) -> Resolved:
    # The recipe's SGD takes lr / (1 - momentum) steps once its momentum has built up;
    # the SGHMC form takes eta / alpha (v = (1 - alpha) v + eta g): so lr = alpha x that
    # keeps the recipe's effective step at each cycle's start.
    recipe = context.recipe
    alpha = context.resolved.get("alpha", 1.0)
    return Resolved(alpha * recipe.lr / (1 - recipe.momentum),
                    f"derived from the recipe (lr {recipe.lr:g}, momentum "
                    f"{recipe.momentum:g}) and alpha {alpha:g}")


def _epochs_default(context: Context) -> Resolved:
    return Resolved(context.recipe.epochs, "derived from the recipe (its epochs)")


class CyclicalSgmcmc(Method):
    """cSGLD (``alpha = 1``) or cSGHMC: one run of ``cycles`` cycles per mode, from the
    network's initialisation (module docstring)."""

    trains_base = False
    uses_fast_kernels = True

    def __init__(self, name: str, summary: str, alpha: float | None) -> None:
        self.name, self.summary, self.alpha = name, summary, alpha
        # The vocabulary's CSGLD_OPTIONS (CSGHMC_OPTIONS: with alpha first), with the rules
        # of the derived defaults and the cycles dividing samples_per_mode.
        self.options = declared_options(
            name, checks={"cycles": _cycles},
            defaults={"lr": _lr_default, "epochs": _epochs_default,
                      "cycles": _cycles_default})

    def phase_steps(self, spec: Any, steps_per_epoch: int) -> int:
        return spec.method_options["epochs"] * steps_per_epoch

    def fit(self, run: ModeRun) -> Posterior:
        spec, seeds, engine = run.spec, run.seeds, run.engine
        opts: Mapping[str, Any] = spec.method_options  # checked by the options above
        model = engine.initial_model()
        params, buffers = untrained_parameters(model, self.name, spec.architecture)
        num_data = run.num_data
        prior = opts["prior_precision"]
        if prior == "training":
            prior = prior_precision_from_weight_decay(num_data, spec.recipe.weight_decay)
        steps_per_epoch = math.ceil(num_data / spec.recipe.batch_size)
        total = opts["epochs"] * steps_per_epoch
        cycles = opts["cycles"]
        cycle_steps = total // cycles
        per_cycle = spec.samples_per_mode // cycles
        keep = kept_steps(cycles, cycle_steps, per_cycle, opts["keep_fraction"])
        if cycle_steps < 2 or len(set(keep)) != len(keep) or keep[0] < 1:
            raise InvalidOptionError(
                f"{self.name}: {total} steps in {cycles} cycles cannot keep {per_cycle} "
                "distinct samples per cycle; raise epochs or keep_fraction")
        alpha = 1.0 if self.alpha is None else opts["alpha"]
        gradient = engine.log_posterior(model, params, buffers, num_data, prior)
        stepper = CyclicalStepper(params, gradient, opts["lr"], num_data, alpha,
                                  cycle_steps, opts["sampling_fraction"], keep[-1],
                                  generator_for(seeds.sample))
        collector = Collector(list(params), steps=set(keep))
        result = fit(stepper, engine.batches(model, seeds.data), lambda epoch: opts["lr"],
                     math.ceil(keep[-1] / steps_per_epoch), index=run.index, phase=self.name,
                     callbacks=[*run.callbacks, collector])
        kept = collector.kept
        while len(kept) < len(keep):  # a run that diverged: its last state
            kept.append({name: torch.tensor(value) for name, value in stepper.arrays().items()})
        record = {"method": self.name, "cycles": cycles, "cycle_steps": cycle_steps,
                  "kept_steps": keep, "alpha": alpha, "temperature": 1.0}
        state = CyclicalState([{**sample, **buffers} for sample in kept],
                              [step // cycle_steps if step % cycle_steps else
                               step // cycle_steps - 1 for step in keep])
        return Posterior(state, result.steps, engine.name, record)

    def sample(self, state: CyclicalState, generator: torch.Generator, count: int
               ) -> list[dict[str, torch.Tensor]]:
        return state.samples[:count]

    def sample_chains(self, state: CyclicalState, count: int) -> list[int]:
        """One trajectory: every sample is of chain 0 (its cycle is in the record's
        ``kept_steps``); a chain that visits several modes on purpose disagrees with
        itself, which ``diagnose``'s split R-hat shows."""
        return [0] * min(count, len(state.samples))


CSGLD = CyclicalSgmcmc("csgld", "cyclical SGLD: one run through several modes by a cosine "
                       "step size", None)
CSGHMC = CyclicalSgmcmc("csghmc", "cyclical SGHMC: one run through several modes by a "
                        "cosine step size", CSGHMC_ALPHA)
