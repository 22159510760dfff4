"""Full-batch HMC (Neal 2011; Izmailov et al. 2021): the posterior the recipe defines,
sampled with a Metropolis correction, one chain per mode.

The density, over the network's weights ``theta`` (every parameter, flat)::

    p(theta | D) ∝ exp(-U(theta)),
    U(theta) = sum_{n=1}^{N} CE(f_theta(x_n), y_n) + (lambda / 2) |theta|^2,

the cross-entropy summed over the **whole** training set, unaugmented (a fixed data set,
so the posterior is well defined), and the Gaussian prior ``N(0, I / lambda)`` that the
recipe's weight decay implies, ``lambda = N x weight_decay``
(:func:`~train_zoo.methods.sghmc_update.prior_precision_from_weight_decay`), at
temperature 1. A Deep Ensemble member minimises something else: the mean loss over
randomly augmented minibatches, by SGD stopped after the recipe's epochs, whose noise and
early stop regularise implicitly.

A mode is one chain from its own trained base network (:meth:`Engine.train_base`, as
Laplace and SGHMC start): different modes' networks sit in different modes of the
posterior, so the chains do too. With ``start = "map"`` (the default) the chain starts at
the posterior mode nearest the network, found by full-batch L-BFGS on ``U``; with
``mass = "laplace-diag"`` (the default) its mass matrix is the diagonal Laplace precision
there (:mod:`train_zoo.methods.hmc_start` says why both). The sampler
(:mod:`train_zoo.methods.hmc_sampler`) runs leapfrog with the identity on
``z = theta / scales`` (the mass matrix as a change of variables) and a float64
Metropolis-Hastings test; the step size is adapted by dual averaging over ``burn_in``
iterations, then frozen; each iteration takes ``ceil(trajectory_length / step_size)``
leapfrog steps, ``trajectory_length`` by default Izmailov et al.'s quarter period of the
prior's own Hamiltonian flow (``pi/2`` under the Laplace mass, ``pi/2`` times the prior
standard deviation ``1 / sqrt(lambda)`` under the identity). After burn-in every
``thin``-th state is kept until ``samples_per_mode`` are.

The gradient is float32, from the fast engine's numba kernels where they cover the network
(flat weights in state_dict order, the training set cut into the kernels' 128-example
chunks), torch autograd otherwise; the loss is summed over the chunks in float64, and the
prior and the kinetic energy are float64.

Every full-data gradient is reported to the mode's callbacks as a step of phase ``hmc``
(``loss`` = ``U / N``), so ``train --dry-run`` times a few of them and extrapolates to
:meth:`Hmc.phase_steps` (``(burn_in + samples x thin)`` iterations x the leapfrog steps of
one, plus the start's gradient).

The chain's state is written after every iteration to the mode's progress folder
(:attr:`ModeRun.progress`, set by the collection run), so a chain killed at any moment
resumes bit-identically (the MAP start is saved there too, and not searched again);
without a folder the chain runs in memory. The record keeps, for
the mode's chain (``chain`` = the mode index, as every sample's ``chain`` column),
acceptance, the frozen step size and leapfrog steps, E-BFMI and the energies' summary.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from posteriorzoo.errors import InvalidOptionError
from train_zoo.methods.base import Method, ModeRun, Posterior, declared_options
from train_zoo.methods.common import flatten, parameters_of, unflatten
from train_zoo.methods.hmc_sampler import (
    HmcOptions,
    Potential,
    chain_summary,
    run_chain,
)
from train_zoo.methods.hmc_start import chain_start, preconditioned
from train_zoo.methods.sghmc_update import prior_precision_from_weight_decay

__all__ = ["ASSUMED_LEAPFROG_STEPS", "ASSUMED_PRECONDITIONED_STEP", "METHOD", "Hmc", "HmcChain",
           "default_trajectory_length", "kernel_potential", "reporting_potential",
           "torch_potential"]

#: Examples per torch chunk of the full-data gradient (the kernels take 128 at a time).
TORCH_CHUNK = 1_000
#: The state file in a mode's progress folder.
STATE_FILE = "hmc-chain.npz"
#: The chain's start and mass matrix (:func:`~train_zoo.methods.hmc_start.chain_start`),
#: in the same folder: a resumed chain does not search or measure again.
START_FILE = "hmc-start.npz"
#: Leapfrog steps per iteration that ``train --dry-run`` assumes when the spec gives no
#: ``step_size``: the step size is then found by Hoffman & Gelman's heuristic and adapted
#: during burn-in, so it is unknown before the run. The burn-in's cap
#: (``HmcOptions.burn_in_leapfrog_steps``): the reference recipe's chains (OptuNet,
#: Fashion-MNIST, trajectory 0.45) took 110-1,024 steps per burn-in iteration, most often
#: the cap, at adapted step sizes of 1e-4 to 2e-3.
ASSUMED_LEAPFROG_STEPS = HmcOptions.burn_in_leapfrog_steps
#: The step size the estimate assumes under the diagonal Laplace mass, where every weight's
#: scale is about 1: the reference recipe's chain adapted to 0.088 from its mode (measured
#: 2026-11-28, 18 leapfrog steps of a pi/2 trajectory).
ASSUMED_PRECONDITIONED_STEP = 0.088


def default_trajectory_length(prior_precision: float, mass: str = "identity") -> float:
    """Izmailov et al.'s trajectory length, a quarter period of the prior's own dynamics:
    ``pi/2`` times the prior standard deviation ``1 / sqrt(prior_precision)`` with the
    identity mass; ``pi/2`` with the diagonal Laplace mass, whose entry is the prior
    precision wherever the prior alone constrains a weight
    (:mod:`train_zoo.methods.hmc_start`)."""
    if mass == "identity":
        return math.pi / 2 / math.sqrt(prior_precision)
    return math.pi / 2


def kernel_potential(layout: Any, chunks: Sequence[tuple[np.ndarray, np.ndarray]],
                     prior_precision: float) -> Potential:
    """``U`` and its gradient from the numba kernels: ``chunks`` are the training set in
    the kernels' layout (``x`` ``(C, H, W, B)`` float32, labels int64), ``B <= 128``."""
    from train_zoo.fast.gradients import fast_loss_and_grad

    buffer = np.empty(layout.num_params, dtype=np.float32)

    def potential(theta: np.ndarray) -> tuple[float, np.ndarray]:
        weights = theta.astype(np.float32)
        loss, grad = 0.0, np.zeros(theta.size, dtype=np.float64)
        for x, labels in chunks:
            mean, _ = fast_loss_and_grad(layout, weights, x, labels, grad=buffer)
            loss += labels.size * float(mean)
            grad += labels.size * buffer
        return (loss + 0.5 * prior_precision * float(theta @ theta),
                grad + prior_precision * theta)

    return potential


def torch_potential(model: nn.Module, like: dict[str, torch.Tensor],
                    chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    prior_precision: float) -> Potential:
    """``U`` and its gradient by torch autograd in float32 (the loss summed in float64),
    for networks the kernels do not cover."""
    from torch.func import functional_call

    model.eval()

    def potential(theta: np.ndarray) -> tuple[float, np.ndarray]:
        flat = torch.from_numpy(theta.astype(np.float32)).requires_grad_(True)
        params = unflatten(flat, like)
        loss, grad = 0.0, np.zeros(theta.size, dtype=np.float64)
        for images, labels in chunks:
            logits = functional_call(model, params, (images,))
            total = nn.functional.cross_entropy(logits, labels, reduction="sum")
            (part,) = torch.autograd.grad(total, flat)
            loss += float(total)
            grad += part.numpy()
        return (loss + 0.5 * prior_precision * float(theta @ theta),
                grad + prior_precision * theta)

    return potential


def reporting_potential(potential: Potential, like: dict[str, torch.Tensor], index: int,
                        num_data: int, callbacks: Sequence[object], phase: str = "hmc"
                        ) -> Potential:
    """``potential`` that reports each evaluation (one full-data gradient) to
    ``callbacks`` as a step of ``phase``: ``StepInfo(index, 0, k, 0.0, U / num_data,
    phase)`` for the ``k``-th evaluation of this process, with the weights it was taken
    at. This is what ``train --dry-run`` times (HMC has no learning rate: ``lr`` is 0).
    Without callbacks, ``potential`` itself."""
    from train_zoo.callbacks import StepInfo, notify

    if not callbacks:
        return potential
    count = 0

    def reported(theta: np.ndarray) -> tuple[float, np.ndarray]:
        nonlocal count
        value, grad = potential(theta)
        count += 1
        weights = unflatten(torch.from_numpy(theta.astype(np.float32)), like)
        notify(callbacks, "on_step_end",
               StepInfo(index, 0, count, 0.0, value / num_data, phase),
               {name: tensor.numpy() for name, tensor in weights.items()})
        return value, grad

    return reported


@dataclass
class HmcChain:
    """A mode's chain: its kept samples (flat, float64), the parameters they unflatten
    like, and the chain's id (the mode index)."""

    samples: np.ndarray
    like: dict[str, torch.Tensor]
    chain: int


def _options(spec: Any, prior_precision: float) -> HmcOptions:
    opts = spec.method_options
    length = opts.get("trajectory_length")
    return HmcOptions(
        burn_in=int(opts["burn_in"]), thin=int(opts["thin"]),
        samples=int(spec.counts()[1]),
        trajectory_length=float(length if length is not None
                                else default_trajectory_length(prior_precision,
                                                               opts.get("mass", "identity"))),
        step_size=opts.get("step_size"), target_accept=float(opts["target_accept"]),
        max_leapfrog_steps=int(opts["max_leapfrog_steps"]))


def _key(run: ModeRun, options: HmcOptions, prior_precision: float, start: np.ndarray,
         engine: str) -> str:
    """What a saved chain belongs to: the mode, the options, the prior, the engine and
    the start's digest (a state of another problem is started over, never resumed)."""
    described = {"mode": run.index, "options": options.__dict__, "prior": prior_precision,
                 "num_data": run.num_data, "engine": engine,
                 "start": hashlib.sha256(start.tobytes()).hexdigest()}
    return json.dumps(described, sort_keys=True, default=str)


class Hmc(Method):
    """Full-batch HMC: one chain per mode from its trained base network (module
    docstring)."""

    name = "hmc"
    summary = ("full-batch HMC: one Metropolis-corrected chain from each trained base "
               "network")
    options = declared_options("hmc")

    def phase_steps(self, spec: Any, steps_per_epoch: int) -> int:
        """Full-data gradients of one chain: the start's, then ``burn_in + samples x
        thin`` iterations of ``L`` leapfrog steps (one gradient each).

        ``L = ceil(trajectory_length / step_size)`` (capped at ``max_leapfrog_steps``,
        during burn-in also at ``HmcOptions.burn_in_leapfrog_steps``) with the spec's
        ``step_size``, the adaptation's start, held fixed; without one it is
        :data:`ASSUMED_LEAPFROG_STEPS` with the identity mass, ``trajectory_length /``
        :data:`ASSUMED_PRECONDITIONED_STEP` under the Laplace mass (the step size is only
        known after the run), and
        the heuristic's few gradients that find the first step size are not counted. The
        default trajectory length needs ``N``, taken as ``steps_per_epoch x batch_size``
        (at most a batch above it, so ``L`` is off by at most one step in ``N /
        batch_size``).
        """
        opts = spec.method_options
        length = opts.get("trajectory_length")
        if length is None:
            prior = prior_precision_from_weight_decay(
                max(1, steps_per_epoch * spec.recipe.batch_size), spec.recipe.weight_decay)
            length = (default_trajectory_length(prior, opts.get("mass", "identity"))
                      if prior > 0 else 0.0)
        search = (int(opts.get("map_iterations", 0)) + 2
                  if opts.get("start", "base") == "map" else 0)
        options = HmcOptions(burn_in=int(opts["burn_in"]), thin=int(opts["thin"]),
                             samples=int(spec.counts()[1]), trajectory_length=float(length),
                             max_leapfrog_steps=int(opts["max_leapfrog_steps"]))
        step = opts.get("step_size")
        if step is None and opts.get("mass", "identity") != "identity":
            sampling = options.leapfrog_steps(ASSUMED_PRECONDITIONED_STEP)
            burn_in = options.leapfrog_steps(ASSUMED_PRECONDITIONED_STEP, burn_in=True)
        elif step is None:
            sampling = min(ASSUMED_LEAPFROG_STEPS, options.max_leapfrog_steps)
            burn_in = min(sampling, options.burn_in_leapfrog_steps)
        else:
            sampling = options.leapfrog_steps(float(step))
            burn_in = options.leapfrog_steps(float(step), burn_in=True)
        return (search + 1 + options.burn_in * burn_in
                + options.thin * options.samples * sampling)

    def fit(self, run: ModeRun) -> Posterior:
        spec, engine = run.spec, run.engine
        model, steps = engine.train_base()
        params, buffers = parameters_of(model)
        if buffers:
            raise InvalidOptionError(f"hmc: {spec.architecture} has BatchNorm buffers, "
                                     "which a sample would carry from the base network; "
                                     "not supported yet")
        prior = prior_precision_from_weight_decay(run.num_data, spec.recipe.weight_decay)
        if prior <= 0:
            raise InvalidOptionError("hmc: the recipe's weight decay is 0, so its prior is "
                                     "improper; give the recipe a weight decay")
        options = _options(spec, prior)
        potential, used = self._potential(run, model, params, prior)
        potential = reporting_potential(potential, params, run.index, run.num_data,
                                        run.callbacks, self.name)
        opts = spec.method_options
        trained = flatten(params).double().numpy()
        prepared = {"start": opts.get("start", "base"), "mass": opts.get("mass", "identity"),
                    "map_iterations": opts.get("map_iterations")}
        start, scales, prepared_info = chain_start(
            potential, trained,
            map_iterations=(int(opts["map_iterations"]) if prepared["start"] == "map"
                            else None),
            precision=(self._precision(run, model, params, buffers, prior)
                       if prepared["mass"] == "laplace-diag" else None),
            path=None if run.progress is None else run.progress / START_FILE,
            key=_key(run, options, prior, trained, used) + json.dumps(prepared))
        # the chain runs on z = theta / scales with the identity (hmc_start.preconditioned)
        chain_potential = potential if scales is None else preconditioned(potential, scales)
        origin = start if scales is None else start / scales
        path = None if run.progress is None else run.progress / STATE_FILE
        state = run_chain(chain_potential, origin, options, run.seeds.noise, path=path,
                          key=_key(run, options, prior, origin, used))
        samples = state.samples if scales is None else state.samples * scales
        summary = chain_summary(state, options)
        record = {"method": self.name, "prior_precision": prior,
                  "potential": "sum of cross-entropies over the unaugmented training set "
                               "+ prior_precision / 2 |theta|^2, temperature 1",
                  **prepared, **prepared_info,
                  "coordinates": "the chain's step size and trajectory are in z = theta / "
                                 "scales" if scales is not None else "theta",
                  "chains": [{"chain": run.index, **summary}]}
        like = {name: value.detach().clone() for name, value in params.items()}
        steps += (summary["gradient_evaluations"]
                  + ((prepared_info["map_search"] or {}).get("evaluations", 0)))
        return Posterior(HmcChain(samples, like, run.index), steps, used, record)

    def _precision(self, run: ModeRun, model: nn.Module, params: dict[str, torch.Tensor],
                   buffers: dict[str, torch.Tensor], prior: float
                   ) -> Callable[[np.ndarray], np.ndarray]:
        """The diagonal Laplace precision at a point: the diagonal GGN of the whole
        unaugmented training set plus the prior precision."""
        from train_zoo.methods.laplace_curvature import diag_ggn

        def precision(theta: np.ndarray) -> np.ndarray:
            weights = unflatten(torch.from_numpy(theta.astype(np.float32)), params)
            diagonal, _, count = diag_ggn(
                model, weights, buffers, run.engine.read_batches(run.seeds.data, TORCH_CHUNK))
            return diagonal.numpy() * (run.num_data / count) + prior

        return precision

    def _potential(self, run: ModeRun, model: nn.Module, params: dict[str, torch.Tensor],
                   prior: float) -> tuple[Potential, str]:
        """The network's potential on the kernels where the engine has them, else torch;
        and the engine used."""
        from train_zoo.fast.engine import layout_for
        from train_zoo.fast.gradients import KERNEL_CHUNK

        kernels = run.engine.loss_gradient(model) is not None
        layout = layout_for(model, run.data) if kernels else None
        size = KERNEL_CHUNK if layout is not None else TORCH_CHUNK
        batches: Any = run.engine.read_batches(run.seeds.data, size)
        if layout is not None:
            if not np.array_equal(layout.flatten(model.state_dict()),
                                  flatten(params).numpy()):
                raise RuntimeError("hmc: the kernels' weight order is not the parameters'")
            chunks = [(np.ascontiguousarray(images.permute(1, 2, 3, 0).numpy()),
                       np.ascontiguousarray(labels.numpy(), dtype=np.int64))
                      for images, labels in batches]
            return kernel_potential(layout, chunks, prior), "fast"
        chunks_t = [(images, labels) for images, labels in batches]
        return torch_potential(model, params, chunks_t, prior), "torch"

    def sample(self, state: HmcChain, generator: torch.Generator, count: int
               ) -> list[dict[str, torch.Tensor]]:
        return [unflatten(torch.from_numpy(row.astype(np.float32)), state.like)
                for row in state.samples[:count]]

    def sample_chains(self, state: HmcChain, count: int) -> list[int]:
        """Every sample's chain is its mode's (one chain per mode)."""
        return [state.chain] * min(count, len(state.samples))


METHOD = Hmc()
