"""SVGD (Liu & Wang 2016): Stein variational gradient descent, particles that repel.

``samples_per_mode`` networks (the particles ``x_1 .. x_n``, each from its own
initialisation) move together along::

    phi(x_i) = (1 / n) sum_j [ k(x_j, x_i) grad log p(x_j | D) + grad_{x_j} k(x_j, x_i) ]

the first term pulling each particle up the log posterior (the full-data one: ``N`` times
the minibatch mean log-likelihood plus the Gaussian prior of the recipe's weight decay),
weighted by its neighbours, the second pushing neighbours apart. The kernel is the RBF
``k(x, y) = exp(-|x - y|^2 / l)`` over all weights, with **BlackJAX's median rule**
``l = median_{i<j} |x_i - x_j|^2 / log n`` recomputed at every step (Liu and Wang's code
takes ``median / (2 log(n + 1))`` with the zero diagonal in the median; METHODS_NOTES).

The step is SGD's on the mean loss, with ``phi`` taken as a sum over the particles, not a
mean: ``x_i <- x_i + (n lr_t / N) phi(x_i)`` with ``lr_t`` the recipe's learning rate
schedule. One particle is then exactly the recipe's SGD (its kernel with itself is 1 and
has no gradient), and so is each of ``n`` particles whose kernel matrix is the identity.
Why the factor ``n``: the median rule sets the kernel of a typical pair of particles to
``1 / n``, so the kernel rows sum to about 2 and ``phi`` as a mean moves every particle at
about ``2 / n`` of its own gradient: at ``lr_t / N`` the 100 particles of an OptuNet
collection, each from its own initialisation, stayed near chance accuracy after an epoch
(93 of 100, measured 2026-11-28). Liu and Wang's code and BlackJAX's examples hide that
scale behind AdaGrad or Adam, which the recipe's SGD does not use; the direction, and so
the fixed point, is theirs.
All particles see the same minibatch. A sample is a particle at the end of the recipe's
epochs. Networks with BatchNorm are refused for now (their running statistics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from posteriorzoo.vocabulary import SVGD_BANDWIDTH
from train_zoo.loop import fit
from train_zoo.methods.base import Method, ModeRun, Posterior, declared_options
from train_zoo.methods.common import flatten, parameters_of, unflatten, untrained_parameters
from train_zoo.methods.sghmc_update import prior_precision_from_weight_decay

#: The bandwidth rule (the vocabulary's only one: named so a collection records which it
#: used).
BANDWIDTH = SVGD_BANDWIDTH


def median_bandwidth(particles: torch.Tensor) -> float:
    """BlackJAX's rule: the median squared distance between distinct particles over
    ``log n`` (1 for a single particle, whose kernel is constant)."""
    n = particles.shape[0]
    if n < 2:
        return 1.0
    squared = torch.cdist(particles, particles).square()
    upper = squared[torch.triu_indices(n, n, offset=1).unbind()]
    return float(upper.median()) / math.log(n)


def stein_direction(particles: torch.Tensor, gradients: torch.Tensor, bandwidth: float
                    ) -> torch.Tensor:
    """``phi(x_i)`` for every particle (rows), from the particles ``(n, d)`` and the
    gradients of the log density at them ``(n, d)``."""
    n = particles.shape[0]
    squared = torch.cdist(particles, particles).square()
    kernel = torch.exp(-squared / bandwidth)                 # k(x_j, x_i), symmetric
    repulsion = (2 / bandwidth) * (kernel.sum(1, keepdim=True) * particles - kernel @ particles)
    return (kernel @ gradients + repulsion) / n


@dataclass
class SvgdParticles:
    """The particles at the end (state_dicts) and the BatchNorm-free model's buffers."""

    samples: list[dict[str, torch.Tensor]]


class SvgdStepper:
    """One SVGD step of every particle on a batch (module docstring)."""

    def __init__(self, particles: list[dict[str, torch.Tensor]], gradient, num_data: int
                 ) -> None:
        self.like = particles[0]
        self.x = torch.stack([flatten(p).double() for p in particles])
        self.gradient, self.num_data = gradient, num_data
        self.bandwidths: list[float] = []
        self.stopped = False

    def step(self, batch: tuple, lr: float) -> float:
        losses, rows = [], []
        for row in self.x:
            loss, grads = self.gradient(unflatten(row.float(), self.like), batch)
            losses.append(loss)
            rows.append(flatten(grads).double())
        bandwidth = median_bandwidth(self.x)
        self.bandwidths.append(bandwidth)
        count = self.x.shape[0]   # phi as a sum over the particles (module docstring)
        self.x = self.x + (count * lr / self.num_data) * stein_direction(
            self.x, torch.stack(rows), bandwidth)
        loss = float(np.mean(losses))
        self.stopped = not math.isfinite(loss)
        return loss

    def arrays(self) -> dict[str, np.ndarray]:
        """The first particle's weights (what the loop's callbacks see)."""
        return {name: value.numpy() for name, value in
                unflatten(self.x[0].float(), self.like).items()}

    def particles(self) -> list[dict[str, torch.Tensor]]:
        return [unflatten(row.float(), self.like) for row in self.x]


def particle_seed(init_seed: int, particle: int) -> int:
    """Particle 0 keeps the mode's init seed; particle j > 0 a word derived from both."""
    if particle == 0:
        return init_seed
    return int(np.random.SeedSequence([init_seed, particle]).generate_state(1)[0])


class Svgd(Method):
    """SVGD: ``samples_per_mode`` interacting particles per mode (module docstring)."""

    name = "svgd"
    summary = "Stein variational gradient descent: samples_per_mode particles that repel"
    trains_base = False
    options = declared_options("svgd")

    def phase_steps(self, spec: Any, steps_per_epoch: int) -> int:
        return spec.recipe.epochs * steps_per_epoch

    def fit(self, run: ModeRun) -> Posterior:
        from train_zoo.torch_engine import initial_model

        spec, seeds, engine = run.spec, run.seeds, run.engine
        model = engine.initial_model()
        params, buffers = untrained_parameters(model, self.name, spec.architecture)
        particles = [params] + [parameters_of(initial_model(spec, particle_seed(
            seeds.init, j)))[0] for j in range(1, spec.samples_per_mode)]
        num_data = run.num_data
        prior = prior_precision_from_weight_decay(num_data, spec.recipe.weight_decay)
        gradient = engine.log_posterior(model, params, buffers, num_data, prior)
        stepper = SvgdStepper(particles, gradient, num_data)
        recipe = spec.recipe
        result = fit(stepper, engine.batches(model, seeds.data), recipe.learning_rate,
                     recipe.epochs, index=run.index, phase="svgd", callbacks=run.callbacks)
        bandwidths = stepper.bandwidths
        record = {"method": "svgd", "bandwidth": BANDWIDTH, "particles": len(particles),
                  "step": "n lr_t / N x phi (phi the mean over the particles)",
                  "bandwidth_start": bandwidths[0] if bandwidths else None,
                  "bandwidth_end": bandwidths[-1] if bandwidths else None}
        steps = result.steps * len(particles)
        return Posterior(SvgdParticles(stepper.particles()), steps, engine.name, record)

    def sample(self, state: SvgdParticles, generator: torch.Generator, count: int
               ) -> list[dict[str, torch.Tensor]]:
        return state.samples[:count]


METHOD = Svgd()
