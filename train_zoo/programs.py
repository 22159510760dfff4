"""One mode of any method: the engine it runs on, its phases, its samples, their evaluation.

:func:`produce_mode` is the unit of work of every backend. For mode ``i`` of a spec it

1. looks the spec's method up in the registry (:mod:`train_zoo.methods.registry`);
2. runs the method's phases (:meth:`~train_zoo.methods.base.Method.fit`) on a
   :class:`ModeEngine`: a method that ``trains_base`` first trains the base network with
   the recipe (:func:`train_zoo.loop.fit` on the chosen engine; MC Dropout's with its
   dropout layer) from the seeds of :func:`train_zoo.seeds.checkpoint_seeds`
   ``(base_seed, i)``, exactly as DE member ``i``; then its own phase, again
   :func:`~train_zoo.loop.fit` around a stepper (SWAG's continued SGD with a collector,
   the SGHMC chains; Laplace fits the curvature at the trained weights). BBB and EMP
   train their own distribution from the mode's initial weights instead;
3. draws ``samples_per_mode`` samples with the method's
   :meth:`~train_zoo.methods.base.Method.sample` from a generator seeded with the mode's
   ``sample`` seed: state_dicts of the *base* architecture;
4. evaluates each sample on both splits (:func:`train_zoo.torch_engine.finish`).

The engines stay here, out of the methods: a method asks :class:`ModeEngine` for a base
network, an SGD stepper, batches or a gradient, and gets the numba kernels' version where
they cover the network and torch's otherwise.

The samples of a mode come back together and are appended in one commit, so a collection
holds whole modes only, and a killed run resumes with the next mode.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from train_zoo.data import TrainingData
from train_zoo.device import CPU, TrainingDevice
from train_zoo.fast.bbb import FastBBB, FastBBBStepper
from train_zoo.fast.engine import FastNet, batches_for, layout_for
from train_zoo.fast.engine import evaluate as fast_evaluate
from train_zoo.fast.engine import train_base as fast_train_base
from train_zoo.fast.gradients import LossGradient, fast_log_posterior, fast_loss_gradient
from train_zoo.fast.rank1 import Rank1Network, rank1_network
from train_zoo.methods.base import ModeRun, generator_for
from train_zoo.methods.bbb import METHOD as BBB
from train_zoo.methods.bbb import BBBRun, BBBState, BBBStepper, BBBTrainingRun
from train_zoo.methods.registry import get_method
from train_zoo.methods.sghmc import LogPosteriorGradient
from train_zoo.result import CheckpointResult
from train_zoo.seeds import CheckpointSeeds, checkpoint_seeds
from train_zoo.spec import ZooSpec
from train_zoo.torch_engine import (
    TorchSGD,
    evaluate,
    finish,
    initial_model,
    torch_batches,
    torch_log_posterior,
)
from train_zoo.torch_engine import train_base as torch_train_base

__all__ = ["READ_BATCH", "BBBTrainingRun", "ModeEngine", "mode_progress", "produce_mode",
           "train_bbb"]

StateDict = dict[str, torch.Tensor]
#: Examples per batch when a method reads the training set without training on it.
READ_BATCH = 500


class ModeEngine:
    """What the methods of one mode may ask of the engine (``fast`` or ``torch``): the
    numba kernels where they cover the network (:func:`train_zoo.fast.engine.layout_for`),
    torch otherwise. :attr:`name` is the engine that ran the last piece asked for."""

    def __init__(self, spec: ZooSpec, index: int, data: TrainingData, engine: str,
                 callbacks: Sequence[object] = (), device: TrainingDevice = CPU) -> None:
        self.spec, self.index, self.data, self.requested = spec, index, data, engine
        self.callbacks = callbacks
        self.device = device
        self.seeds = checkpoint_seeds(spec.base_seed, index)
        self.name = "torch"

    def _layout(self, model: nn.Module):  # noqa: ANN202 -- a NetLayout or None
        return layout_for(model, self.data) if self.requested == "fast" else None

    def train_base(self) -> tuple[nn.Module, int]:
        """Mode ``index``'s base network trained with the recipe, and the steps taken."""
        if self.requested == "fast":
            model, steps, self.name = fast_train_base(self.spec, self.index, self.data,
                                                      self.callbacks)
            return model, steps
        model, steps = torch_train_base(self.spec, self.index, self.data, self.callbacks,
                                        self.device)
        self.name = "torch"
        return model, steps

    def initial_model(self) -> nn.Module:
        """The untrained base network of the mode (its ``init`` seed)."""
        return initial_model(self.spec, self.seeds.init)

    def sgd_stepper(self, model: nn.Module) -> object:
        """The recipe's SGD continued from ``model``'s weights."""
        layout = self._layout(model)
        if layout is not None:
            return FastNet(layout, model.state_dict(), self.spec.recipe)
        return TorchSGD(model, self.spec.recipe, self.seeds.noise)

    def load_stepper_weights(self, model: nn.Module, stepper: object) -> None:
        """``model`` given the weights an :meth:`sgd_stepper` ended with (a torch stepper
        trains the module itself)."""
        if isinstance(stepper, FastNet):
            model.load_state_dict(stepper.state_dict())

    def batches(self, model: nn.Module, seed: int, batch_size: int | None = None, *,
                torch_only: bool = False, replacement: bool = False
                ) -> Callable[[int], object]:
        """``batches(epoch)``: the augmented training set in seeded order, in the layout
        of the stepper this engine gives ``model`` (torch's with ``torch_only``, for a
        stepper of the method's own); with ``replacement``, independent minibatches
        (each epoch's examples drawn with replacement)."""
        recipe = self.spec.recipe
        if batch_size is not None and batch_size != recipe.batch_size:
            recipe = dataclasses.replace(recipe, batch_size=batch_size)
        if not torch_only and self._layout(model) is not None:
            return batches_for(self.data, recipe, seed, replacement=replacement)
        return torch_batches(self.data, recipe, seed, replacement=replacement)

    def read_batches(self, seed: int, batch_size: int | None = None) -> object:
        """One pass over the training set, unaugmented, as torch batches."""
        recipe = self.spec.recipe
        if batch_size is not None:
            recipe = dataclasses.replace(recipe, batch_size=batch_size)
        return torch_batches(self.data, recipe, seed, augment=False)(0)

    def loss_gradient(self, model: nn.Module) -> LossGradient | None:
        """The batch mean cross-entropy's gradient on the kernels where they cover
        ``model`` (batches from :meth:`batches`), else None: the method differentiates
        with torch autograd (and :meth:`batches` with ``torch_only``)."""
        layout = self._layout(model)
        self.name = "fast" if layout is not None else "torch"
        if layout is None:
            return None
        return fast_loss_gradient(layout, {name: value.detach()
                                           for name, value in model.named_parameters()})

    def rank1_network(self, model: nn.Module, layers: dict) -> Rank1Network | None:
        """Rank-1's network part on the kernels where they cover ``model`` with rank-1
        ``layers`` (module name -> module; batches from :meth:`batches`), else None (torch
        autograd, and :meth:`batches` with ``torch_only``)."""
        layout = self._layout(model)
        network = None if layout is None else rank1_network(layout, list(layers))
        self.name = "fast" if network is not None else "torch"
        return network

    def log_posterior(self, model: nn.Module, params: dict, buffers: dict, num_data: int,
                      prior_precision: float) -> LogPosteriorGradient:
        """SGHMC's gradient of the full-data log posterior."""
        layout = self._layout(model)
        if layout is not None:
            return fast_log_posterior(layout, params, num_data, prior_precision)
        return torch_log_posterior(model, buffers, num_data, prior_precision)

    def bbb_stepper(self, model: nn.Module, start: BBBState, run: BBBRun) -> object:
        """BBB's ELBO steps from ``start``."""
        layout = self._layout(model)
        self.name = "fast" if layout is not None else "torch"
        if layout is not None:
            return FastBBBStepper(FastBBB(layout, start), run)
        return BBBStepper(start, model, run)


def mode_progress(progress: Path, index: int) -> Path:
    """Mode ``index``'s own folder under a collection's ``progress`` folder, where its
    method may keep state between runs (:attr:`ModeRun.progress`)."""
    return Path(progress) / f"mode-{index}"


def _mode_run(spec: ZooSpec, index: int, data: TrainingData, engine: str,
              callbacks: Sequence[object], device: TrainingDevice = CPU,
              progress: Path | None = None) -> ModeRun:
    modes = ModeEngine(spec, index, data, engine, callbacks, device)
    return ModeRun(spec, index, modes.seeds, data, modes, callbacks,
                   None if progress is None else mode_progress(progress, index))


def train_bbb(spec: ZooSpec, index: int, data: TrainingData, engine: str,
              callbacks: Sequence[object] = ()) -> BBBTrainingRun:
    """Train mode ``index`` of a BBB spec: the variational posterior and its record."""
    return BBB.fit(_mode_run(spec, index, data, engine, callbacks)).state


def produce_mode(spec: ZooSpec, index: int, data: TrainingData, engine: str,
                 callbacks: Sequence[object] = (), device: TrainingDevice = CPU,
                 progress: Path | None = None) -> list[CheckpointResult]:
    """The ``samples_per_mode`` checkpoints of mode ``index`` of ``spec``.

    Parameters
    ----------
    spec : ZooSpec
    index : int
        The mode (0 .. modes-1).
    data : TrainingData
    engine : {"torch", "fast"}
        A resolved engine (:func:`train_zoo.job.resolve_engine`); the fast engine falls
        back to torch for a phase its kernels do not cover.
    callbacks : sequence
        Called in every phase (:class:`~train_zoo.callbacks.StepInfo` says which).
    device : TrainingDevice
        Where the torch engine trains the base network and evaluates the samples
        (:mod:`train_zoo.device`); the method's own phases run on CPU.
    progress : Path, optional
        The collection's progress folder: the mode's phases may keep their state in its
        ``mode-<index>`` folder (:func:`mode_progress`) and resume from it.

    Returns
    -------
    list of CheckpointResult
        ``sample`` 0 .. samples_per_mode-1, each loadable into the base architecture.
    """
    started = time.perf_counter()
    method = get_method(spec.method)
    run = _mode_run(spec, index, data, engine, callbacks, device, progress)
    posterior = method.fit(run)
    samples = method.sample(posterior.state, generator_for(run.seeds.sample),
                            spec.counts()[1])
    results = _evaluate(spec, index, samples, run.seeds, posterior.steps, started,
                        posterior.engine, data, posterior.record, device)
    chains = method.sample_chains(posterior.state, len(samples))
    if chains is not None:  # a method with chains: each sample's (metadata ``chain``)
        for result, chain in zip(results, chains, strict=True):
            result.chain = int(chain)
    return results


def _evaluate(spec: ZooSpec, index: int, samples: Sequence[StateDict], seeds: CheckpointSeeds,
              steps: int, started: float, engine: str, data: TrainingData,
              record: dict | None = None, device: TrainingDevice = CPU
              ) -> list[CheckpointResult]:
    """Each sample loaded into the base architecture and evaluated; the mode's shared time
    is split evenly over its samples, and every sample carries the mode's ``record``."""
    share = (time.perf_counter() - started) / len(samples)
    base = device.place(initial_model(spec, seeds.init, training=False))
    results = []
    for number, sample in enumerate(samples):
        base.load_state_dict(sample)
        result = finish(spec, index, base, seeds, steps, time.perf_counter() - share,
                        engine, data, sample=number,
                        measure=fast_evaluate if engine == "fast"
                        else functools.partial(evaluate, device=device))
        result.record = record
        results.append(result)
    return results
