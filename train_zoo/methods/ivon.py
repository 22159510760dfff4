"""IVON (Shen et al. 2024): variational learning at Adam's cost, through the ``ivon-opt``
package.

IVON learns a diagonal Gaussian posterior ``N(mu, 1 / (ess (h + delta)))`` over every
parameter: at each step it draws the weights from it, takes the gradient of the minibatch
mean loss there, and updates ``mu`` with momentum and ``h``, its running estimate of the
loss's Hessian diagonal, from the product of the draw's noise and the gradient
(``hess_approx = "price"``). ``ess`` is the training-set size and ``delta`` the weight
decay, so the posterior is the one the recipe's prior implies. A sample is ``mu + eps /
sqrt(ess (h + delta))``.

The optimiser is the package's own ``ivon.IVON`` (its update, untouched); only the
gradient comes from the trainer's engine (the fast engine's numba kernels on OptuNet,
torch elsewhere), handed to it at the weights it drew, so each step costs one gradient
like SGD's. IVON draws its noise from torch's global generator: the run forks that
generator and seeds it with the mode's noise seed, so a mode is reproducible and nothing
outside it changes.

The learning rate follows the recipe's schedule, scaled so that it starts at ``lr``.
The record keeps, per parameter tensor, the median posterior standard deviation at the
start and the end of training (``scales``): ``diagnose`` flags a posterior whose scales
did not move (BBB's lesson: a variance that never trains is not a posterior).
Networks with BatchNorm are refused for now (their running statistics at a draw).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from posteriorzoo.vocabulary import IVON_BETA1, IVON_BETA2, IVON_HESS_INIT
from train_zoo.loop import fit
from train_zoo.methods.base import (
    Context,
    Method,
    ModeRun,
    Posterior,
    Resolved,
    declared_options,
)
from train_zoo.methods.common import untrained_parameters

#: The package's defaults where the paper gives no other: hess_init, beta1, beta2 (the
#: vocabulary's, as IVON_LR, the learning rate on the reference recipe).
HESS_INIT, BETA1, BETA2 = IVON_HESS_INIT, IVON_BETA1, IVON_BETA2


@dataclass
class IvonPosterior:
    """What a trained mode keeps: the mean, the Hessian estimate, ``ess`` and ``delta``,
    flat in the order of ``names`` (the model's parameters), and the buffers."""

    names: list[str]
    shapes: list[torch.Size]
    mean: torch.Tensor
    hess: torch.Tensor
    ess: float
    weight_decay: float
    buffers: dict[str, torch.Tensor]

    def std(self) -> torch.Tensor:
        return 1 / torch.sqrt(self.ess * (self.hess + self.weight_decay))


def _scales(names: list[str], shapes: list[torch.Size], std: torch.Tensor
            ) -> dict[str, float]:
    """Median standard deviation per parameter tensor."""
    out, offset = {}, 0
    for name, shape in zip(names, shapes, strict=True):
        size = math.prod(shape)
        out[name] = float(std[offset:offset + size].median())
        offset += size
    return out


class IvonStepper:
    """One IVON step per batch: draw, gradient at the draw (the engine's), update."""

    def __init__(self, model: nn.Module, gradient, num_data: int, lr: float,
                 options: Mapping[str, object], weight_decay: float) -> None:
        import ivon

        self.model = model
        self.names = [name for name, _ in model.named_parameters()]
        self.parameters = [p for _, p in model.named_parameters()]
        self.gradient, self.num_data, self.base_lr = gradient, num_data, lr
        self.optimizer = ivon.IVON(self.parameters, lr=lr, ess=float(num_data),
                                   hess_init=options["hess_init"], beta1=options["beta1"],
                                   beta2=options["beta2"], weight_decay=weight_decay,
                                   mc_samples=1, hess_approx="price")
        self.stopped = False

    def step(self, batch: tuple, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.optimizer.sampled_params(train=True):
            drawn = {name: p.data for name, p in zip(self.names, self.parameters,
                                                     strict=True)}
            loss, grads = self.gradient(drawn, batch)   # of the full-data log likelihood
            for name, p in zip(self.names, self.parameters, strict=True):
                p.grad = (-grads[name] / self.num_data).to(p.dtype).reshape(p.shape)
        self.optimizer.step()
        self.stopped = not math.isfinite(loss)
        return loss

    def hess(self) -> torch.Tensor:
        return torch.cat([group["hess"] for group in self.optimizer.param_groups])

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: p.detach().numpy() for name, p in zip(self.names, self.parameters,
                                                           strict=True)}


def _epochs_default(context: Context) -> Resolved:
    return Resolved(context.recipe.epochs, "derived from the recipe (its epochs)")


def _weight_decay_default(context: Context) -> Resolved:
    return Resolved(context.recipe.weight_decay, "derived from the recipe (its weight_decay)")


class Ivon(Method):
    """IVON: one variational run per mode from the network's initialisation (module
    docstring)."""

    name = "ivon"
    summary = "IVON: a diagonal Gaussian learnt at Adam's cost (the ivon-opt optimizer)"
    trains_base = False

    options = declared_options("ivon", defaults={"epochs": _epochs_default,
                                                 "weight_decay": _weight_decay_default})

    def phase_steps(self, spec: Any, steps_per_epoch: int) -> int:
        return spec.method_options["epochs"] * steps_per_epoch

    def fit(self, run: ModeRun) -> Posterior:
        spec, seeds, engine = run.spec, run.seeds, run.engine
        opts = spec.method_options
        model = engine.initial_model()
        params, buffers = untrained_parameters(model, self.name, spec.architecture)
        num_data = run.num_data
        gradient = engine.log_posterior(model, params, buffers, num_data, 0.0)
        recipe = spec.recipe
        scale = opts["lr"] / recipe.lr
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeds.noise)
            stepper = IvonStepper(model, gradient, num_data, opts["lr"], opts,
                                  opts["weight_decay"])
            shapes = [p.shape for p in stepper.parameters]
            start = _scales(stepper.names, shapes, 1 / torch.sqrt(
                num_data * (stepper.hess() + opts["weight_decay"])))
            result = fit(stepper, engine.batches(model, seeds.data),
                         lambda epoch: scale * recipe.learning_rate(epoch), opts["epochs"],
                         index=run.index, phase="ivon", callbacks=run.callbacks)
        mean = torch.cat([p.detach().flatten() for p in stepper.parameters])
        state = IvonPosterior(stepper.names, shapes, mean.clone(), stepper.hess().clone(),
                              float(num_data), float(opts["weight_decay"]), buffers)
        end = _scales(stepper.names, shapes, state.std())
        record = {"method": "ivon", "scales": {
            name: {"scale_median_start": start[name], "scale_median_end": end[name]}
            for name in stepper.names}}
        return Posterior(state, result.steps, engine.name, record)

    def sample(self, state: IvonPosterior, generator: torch.Generator, count: int
               ) -> list[dict[str, torch.Tensor]]:
        std = state.std()
        samples = []
        for _ in range(count):
            flat = state.mean + std * torch.randn(state.mean.shape, generator=generator,
                                                  dtype=state.mean.dtype)
            sample, offset = {}, 0
            for name, shape in zip(state.names, state.shapes, strict=True):
                size = math.prod(shape)
                sample[name] = flat[offset:offset + size].reshape(shape).clone()
                offset += size
            samples.append({**sample, **state.buffers})
        return samples


METHOD = Ivon()
