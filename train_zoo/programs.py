"""What each method does with one mode: train, run its phase, draw samples, evaluate them.

:func:`produce_mode` is the unit of work of every backend. For mode ``i`` of a spec it

1. trains the base network with the recipe (:func:`train_zoo.loop.fit` on the chosen
   engine; MC Dropout's with its dropout layer), from the seeds of
   :func:`train_zoo.seeds.checkpoint_seeds` ``(base_seed, i)``, exactly as DE member ``i``
   (BBB trains its variational posterior instead, from the same seeds);
2. runs the method's own phase, again :func:`~train_zoo.loop.fit` around a stepper:
   SWAG's continued SGD with a collector, the SGHMC chain, BBB's ELBO steps (Laplace
   has no phase: it fits the curvature at the trained weights);
3. draws ``samples_per_mode`` samples with the method's ``sample`` piece from a generator
   seeded with the mode's ``sample`` seed: state_dicts of the *base* architecture;
4. evaluates each sample on both splits (:func:`train_zoo.torch_engine.finish`).

The samples of a mode come back together and are appended in one commit, so a collection
holds whole modes only, and a killed run resumes with the next mode.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from posteriorzoo.errors import PosteriorZooError
from train_zoo.data import TrainingData
from train_zoo.fast.engine import FastNet, batches_for, layout_for
from train_zoo.fast.engine import evaluate as fast_evaluate
from train_zoo.fast.engine import train_base as fast_train_base
from train_zoo.loop import fit
from train_zoo.method_options import resolve_kl_weight
from train_zoo.methods import bbb, dropout, laplace, sghmc, swag
from train_zoo.methods.bbb_fast import FastBBB
from train_zoo.methods.common import parameters_of
from train_zoo.result import CheckpointResult
from train_zoo.seeds import CheckpointSeeds, checkpoint_seeds
from train_zoo.spec import ZooSpec
from train_zoo.steppers import (
    BBBRun,
    BBBStepper,
    FastBBBStepper,
    SghmcStepper,
    WhitenedSghmcStepper,
    fast_log_posterior,
    torch_log_posterior,
)
from train_zoo.torch_engine import TorchSGD, evaluate, finish, initial_model, torch_batches
from train_zoo.torch_engine import train_base as torch_train_base

__all__ = ["BBBTrainingRun", "produce_mode", "train_bbb"]

StateDict = dict[str, torch.Tensor]
#: Examples per batch when a method reads the training set without training on it.
READ_BATCH = 500
#: SGHMC steps whose gradients fill the noise estimate before beta_hat is subtracted.
NOISE_WARM_UP = 100


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _batches(engine: str, layout, data: TrainingData, spec: ZooSpec, seed: int
             ) -> Callable[[int], object]:
    if engine == "fast" and layout is not None:
        return batches_for(data, spec.recipe, seed)
    return torch_batches(data, spec.recipe, seed)


def _train_base(spec: ZooSpec, index: int, data: TrainingData, engine: str,
                callbacks: Sequence[object]) -> tuple[nn.Module, int, str]:
    if engine == "fast":
        return fast_train_base(spec, index, data, callbacks)
    model, steps = torch_train_base(spec, index, data, callbacks)
    return model, steps, "torch"


class _Collector:
    """Keeps copies of the weights at chosen epochs (SWAG) or steps (SGHMC)."""

    def __init__(self, names: Sequence[str], epochs: set[int] = frozenset(),
                 steps: set[int] = frozenset()) -> None:
        self.names, self.epochs, self.steps = list(names), epochs, steps
        self.kept: list[dict[str, torch.Tensor]] = []

    def _keep(self, weights) -> None:
        self.kept.append({name: torch.tensor(weights[name]) for name in self.names})

    def on_epoch_end(self, info, weights) -> None:
        if info.epoch in self.epochs:
            self._keep(weights)

    def on_step_end(self, info, weights) -> None:
        if info.step in self.steps:
            self._keep(weights)


def _swag(spec, index, data, engine, callbacks, model, seeds):
    opts = spec.method_options
    recipe = spec.recipe
    layout = layout_for(model, data) if engine == "fast" else None
    if layout is not None:
        stepper = FastNet(layout, model.state_dict(), recipe)
    else:
        stepper = TorchSGD(model, recipe, seeds.noise)
    start_lr = recipe.learning_rate(max(0, recipe.epochs - 1))

    def schedule(epoch: int) -> float:
        return swag.swag_learning_rate(epoch, opts["lr"], opts["ramp_epochs"], start_lr)

    names = [name for name, _ in model.named_parameters()]
    collector = _Collector(names, epochs=set(swag.collection_epochs(
        opts["epochs"], opts["iterates"], opts["collect_from"])))
    result = fit(stepper, _batches(engine, layout, data, spec, seeds.method), schedule,
                 opts["epochs"], index=index, phase="swag", callbacks=[*callbacks, collector])
    if layout is not None:
        model.load_state_dict(stepper.state_dict())
    params, buffers = parameters_of(model)
    state = swag.init(params, max_rank=opts["rank"])
    for iterate in collector.kept:
        state = swag.update(state, iterate)
    record = {"method": "swag", "iterates": state.count, "rank": int(state.deviations.shape[0]),
              "scale": opts["scale"], "epochs": opts["epochs"]}
    if state.count < 2:  # the phase stopped early (diverged): keep the last weights
        return [model.state_dict()] * spec.samples_per_mode, result.steps, record
    samples = swag.sample(state, _generator(seeds.sample), spec.samples_per_mode,
                          opts["scale"], buffers=buffers)
    if buffers:  # BatchNorm statistics of every sample, from the training data
        for sample in samples:
            params = {name: sample[name] for name in names}
            sample.update(swag.recompute_batchnorm(
                model, params, buffers, torch_batches(data, recipe, seeds.method,
                                                      augment=False)(0)))
    return samples, result.steps, record


def _laplace(spec, index, data, engine, callbacks, model, seeds):
    opts = spec.method_options
    params, buffers = parameters_of(model)
    prior = opts["prior_precision"]
    try:
        state = laplace.init(
            model, params, buffers,
            torch_batches(data, dataclasses.replace(spec.recipe, batch_size=READ_BATCH),
                          seeds.method, augment=False)(0),
            len(data.train), structure=opts["structure"], prior_precision=prior,
            weight_decay=spec.recipe.weight_decay if prior == "training" else None)
    except PosteriorZooError as error:  # a diverged base network, a too small prior
        raise type(error)(f"laplace mode {index}: {error}") from None
    evidence = float(state.log_evidence)
    record = {"method": "laplace", "structure": state.structure,
              "prior_precision": float(state.prior_precision),
              "prior_source": state.prior_source,
              "log_evidence": evidence if math.isfinite(evidence) else None}
    return (laplace.sample(model, state, _generator(seeds.sample), spec.samples_per_mode), 0,
            record)


def _chain_seed(seed: int, chain: int) -> int:
    """Chain 0 keeps the mode's own seed (a one-chain mode is unchanged); chain c > 0 a
    word derived from (seed, c)."""
    if chain == 0:
        return seed
    return int(np.random.SeedSequence([seed, chain]).generate_state(1, np.uint32)[0])


def _sghmc_whitening(spec, data, model, params, buffers, prior, seeds) -> sghmc.Whitening:
    """The constant mass matrix of a ``preconditioner = "laplace"`` chain: the full
    Laplace posterior precision (GGN + prior, unaugmented training data) at the base
    network."""
    try:
        state = laplace.init(
            model, params, buffers,
            torch_batches(data, dataclasses.replace(spec.recipe, batch_size=READ_BATCH),
                          seeds.method, augment=False)(0),
            len(data.train), structure="full", prior_precision=prior)
    except PosteriorZooError as error:
        raise type(error)(f"sghmc preconditioner: {error}") from None
    return sghmc.Whitening(state.curvature.cholesky.double())


def _sghmc(spec, index, data, engine, callbacks, model, seeds):
    """``chains`` independent chains from the trained base network, each keeping
    ``samples_per_mode / chains`` samples (chain-major: sample j is chain
    ``j // (samples_per_mode / chains)``).

    With ``preconditioner = "laplace"`` each chain runs in the whitened coordinates of the
    base network's Laplace precision (:class:`~train_zoo.steppers.WhitenedSghmcStepper`)
    at ``whitened_lr``, on minibatches of ``batch_size``, and starts from its own draw of
    that Laplace approximation (so that R-hat compares chains started apart)."""
    opts = spec.method_options
    num_data = len(data.train)
    prior = opts["prior_precision"]
    if prior == "training":
        prior = sghmc.prior_precision_from_weight_decay(num_data, spec.recipe.weight_decay)
    chains = opts["chains"]
    keep = sghmc.chain_schedule(opts["burn_in"], opts["thin"],
                                spec.samples_per_mode // chains)
    params, buffers = parameters_of(model)
    whitened = opts.get("preconditioner", "none") == "laplace"
    batch_size = opts.get("batch_size") or spec.recipe.batch_size
    chain_spec = dataclasses.replace(
        spec, recipe=dataclasses.replace(spec.recipe, batch_size=batch_size))
    whitening = (_sghmc_whitening(spec, data, model, params, buffers, prior, seeds)
                 if whitened else None)
    layout = layout_for(model, data) if engine == "fast" else None
    if layout is not None:
        gradient = fast_log_posterior(layout, params, num_data, prior)
    else:
        gradient = torch_log_posterior(model, buffers, num_data, prior)
    eta = opts["whitened_lr"] if whitened else opts["lr"] / num_data
    steps_per_epoch = math.ceil(num_data / batch_size)
    noise_decay = opts["noise_decay"] if opts["noise_correction"] else None
    samples, records, steps = [], [], 0
    for chain in range(chains):
        generator = _generator(_chain_seed(seeds.sample, chain))
        if whitening is not None:
            size = whitening.cholesky.shape[0]
            start = torch.randn(size, generator=generator, dtype=torch.float64)
            stepper = WhitenedSghmcStepper(
                params, gradient, whitening, eta, opts["alpha"], generator, keep[-1],
                start_offset=start, noise_decay=noise_decay, warm_up=NOISE_WARM_UP,
                record_from=opts["burn_in"])
        else:
            stepper = SghmcStepper(params, gradient, eta, opts["alpha"], generator, keep[-1],
                                   noise_decay=noise_decay, warm_up=NOISE_WARM_UP,
                                   record_from=opts["burn_in"])
        collector = _Collector(list(params), steps=set(keep))
        result = fit(stepper, _batches(engine, layout, data, chain_spec,
                                       _chain_seed(seeds.method, chain)),
                     lambda epoch: eta, math.ceil(keep[-1] / steps_per_epoch), index=index,
                     phase="sghmc", callbacks=[*callbacks, collector])
        kept = collector.kept
        while len(kept) < len(keep):  # a chain that diverged: its last state
            last = stepper.arrays()
            kept.append({name: torch.tensor(last[name]) for name in params})
        samples += [{**sample, **buffers} for sample in kept]
        records.append({"chain": chain, **stepper.record()})
        steps += result.steps
    return samples, steps, {"method": "sghmc", "chains": records,
                            "preconditioner": "laplace" if whitened else "none",
                            "batch_size": batch_size}


@dataclasses.dataclass(frozen=True)
class BBBTrainingRun:
    """One mode's trained BBB posterior (:func:`train_bbb`).

    Attributes
    ----------
    model : nn.Module
        The base architecture (its own weights unused).
    state : bbb.BBBState
        The variational posterior at the end.
    buffers : dict of str to tensor or None
        BatchNorm statistics (torch engine), None on the fast engine.
    steps : int
    engine : str
        The engine that ran it (``fast`` or ``torch``).
    record : dict
        What the diagnostics need, JSON-able: ``{"method": "bbb", "layers": {name:
        {"sigma_median_start", "sigma_median_end", "rho_max_change"}}, "elbo":
        {"first_epoch": {...}, "last_epoch": {...}}}``
        (:func:`train_zoo.methods.bbb.variance_record`,
        :meth:`train_zoo.steppers.ElboLog.record`).
    """

    model: nn.Module
    state: bbb.BBBState
    buffers: dict[str, torch.Tensor] | None
    steps: int
    engine: str
    record: dict[str, object]


def train_bbb(spec: ZooSpec, index: int, data: TrainingData, engine: str,
              callbacks: Sequence[object] = ()) -> BBBTrainingRun:
    """Train mode ``index`` of a BBB spec: the variational posterior and its record."""
    recipe = spec.recipe
    seeds = checkpoint_seeds(spec.base_seed, index)
    num_data = len(data.train)
    options, training = bbb.split_options(resolve_kl_weight(spec.method_options, num_data),
                                          recipe.lr)
    model = initial_model(spec, seeds.init)
    start = bbb.init(model, _generator(seeds.init), **options)
    noise = _generator(seeds.noise)
    layout = layout_for(model, data) if engine == "fast" else None
    run = BBBRun(noise, num_data, recipe.momentum, recipe.nesterov, training.optimizer,
                 training.rho_optimizer, training.rho_lr_factor)
    if layout is not None:
        stepper = FastBBBStepper(FastBBB(layout, start), run)
    else:
        stepper = BBBStepper(start, model, run)
    result = fit(stepper, _batches(engine, layout, data, spec, seeds.data),
                 training.schedule(recipe.learning_rate, recipe.lr), recipe.epochs,
                 index=index, phase="bbb", callbacks=[*callbacks, stepper.log])
    state = stepper.bbb_state()
    record = {"method": "bbb", "layers": bbb.variance_record(start, state),
              "elbo": stepper.log.record()}
    return BBBTrainingRun(model, state, getattr(stepper, "buffers", None), result.steps,
                          "fast" if layout is not None else "torch", record)


def _bbb(spec, index, data, engine, callbacks, seeds):
    run = train_bbb(spec, index, data, engine, callbacks)
    samples = bbb.sample(run.model, run.state, _generator(seeds.sample),
                         spec.samples_per_mode, buffers=run.buffers)
    return samples, run.steps, run.engine, run.record


def produce_mode(spec: ZooSpec, index: int, data: TrainingData, engine: str,
                 callbacks: Sequence[object] = ()) -> list[CheckpointResult]:
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

    Returns
    -------
    list of CheckpointResult
        ``sample`` 0 .. samples_per_mode-1, each loadable into the base architecture.
    """
    started = time.perf_counter()
    seeds = checkpoint_seeds(spec.base_seed, index)
    record = None
    if spec.method == "bbb":
        samples, steps, used, record = _bbb(spec, index, data, engine, callbacks, seeds)
    else:
        model, steps, used = _train_base(spec, index, data, engine, callbacks)
        if spec.method == "de":
            samples = [model.state_dict()]
        elif spec.method == "mc-dropout":
            samples = dropout.sample(model, model.state_dict(), spec.method_options["p"],
                                     _generator(seeds.sample), spec.samples_per_mode)
        else:
            program = {"swag": _swag, "laplace": _laplace, "sghmc": _sghmc}[spec.method]
            samples, extra, record = program(spec, index, data, engine, callbacks, model,
                                             seeds)
            steps += extra
    return _evaluate(spec, index, samples, seeds, steps, started, used, data, record)


def _evaluate(spec: ZooSpec, index: int, samples: Sequence[StateDict], seeds: CheckpointSeeds,
              steps: int, started: float, engine: str, data: TrainingData,
              record: dict | None = None) -> list[CheckpointResult]:
    """Each sample loaded into the base architecture and evaluated; the mode's shared time
    is split evenly over its samples, and every sample carries the mode's ``record``."""
    share = (time.perf_counter() - started) / len(samples)
    base = initial_model(spec, seeds.init, training=False)
    results = []
    for number, sample in enumerate(samples):
        base.load_state_dict(sample)
        result = finish(spec, index, base, seeds, steps, time.perf_counter() - share,
                        engine, data, sample=number,
                        measure=fast_evaluate if engine == "fast" else evaluate)
        result.record = record
        results.append(result)
    return results
