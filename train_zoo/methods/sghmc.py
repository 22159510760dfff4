"""SGHMC (Chen et al. 2014): stochastic-gradient Hamiltonian Monte Carlo chains.

The method in four parts:

- :mod:`~train_zoo.methods.sghmc_update`: the chain's step in the `posteriors` library's
  style (:func:`init`, :func:`update`, the ``beta_hat`` correction of the minibatch noise,
  the full-data log posterior and its gradient, :func:`chain_schedule`); its docstring
  states the update and the prior;
- :mod:`~train_zoo.methods.sghmc_metric`: a chain with a constant mass matrix
  (:class:`Whitening`, the adapted and noise-equalized metrics, the dense noise
  correction, :func:`whitened_update`);
- :mod:`~train_zoo.methods.sghmc_steppers`: the steppers that run one chain for the
  trainer (:class:`SghmcStepper`, :class:`WhitenedSghmcStepper`);
- :mod:`~train_zoo.methods.sghmc_options`: the options' derived defaults and checks.

This module holds the method, :class:`Sghmc` (its chains' seeds, the adapted chain's
warm-up, cold rounds and settling, and the sampling), and re-exports every public name
of the parts, so ``from train_zoo.methods import sghmc`` reaches them all.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from posteriorzoo.errors import PosteriorZooError
from posteriorzoo.options import check_integer
from posteriorzoo.vocabulary import (
    ADAPT_ALPHA,
    ADAPT_BATCH,
    ADAPT_LR,
    ADAPT_ROUND_STEPS,
    ADAPT_STEPS,
    ADAPT_THIN,
    ROUND_DRAWS,
)
from train_zoo.loop import fit
from train_zoo.methods import laplace
from train_zoo.methods.base import (
    Collector,
    Method,
    ModeRun,
    Posterior,
    generator_for,
)
from train_zoo.methods.common import Params, flatten, parameters_of
from train_zoo.methods.sghmc_metric import (
    ADAPT_FLOOR,
    MAX_STEP,
    NOISE_QUANTILE,
    STEP_SCALE,
    DenseGradientNoise,
    Whitening,
    adapted_whitening,
    dense_noise_factor,
    dense_noise_update,
    noise_equalized_whitening,
    whitened_update,
)
from train_zoo.methods.sghmc_options import method_options
from train_zoo.methods.sghmc_steppers import (
    LogPosteriorGradient,
    SghmcStepper,
    WhitenedSghmcStepper,
)
from train_zoo.methods.sghmc_update import (
    BETA_CAP,
    GradientNoise,
    MeanNll,
    SghmcState,
    beta_hat,
    chain_schedule,
    init,
    kinetic_temperature,
    log_posterior,
    log_posterior_grad,
    noise_update,
    prior_precision_from_weight_decay,
    update,
)

__all__ = [
    "ADAPT_FLOOR", "BETA_CAP", "MAX_STEP", "NOISE_QUANTILE", "STEP_SCALE", "DenseGradientNoise",
    "GradientNoise", "LogPosteriorGradient", "MeanNll", "SghmcState", "SghmcStepper",
    "Whitening", "WhitenedSghmcStepper", "adapted_whitening", "beta_hat", "chain_schedule",
    "dense_noise_factor", "dense_noise_update", "init", "kinetic_temperature", "log_posterior",
    "log_posterior_grad", "method_options", "noise_equalized_whitening", "noise_update",
    "prior_precision_from_weight_decay", "update", "whitened_update",
]

# ---------------------------------------------------------------- the method
# The numbers of the options and their reasons: :mod:`~train_zoo.methods.sghmc_options`.
#
# The cold rounds that follow the warm-up (``adapt_rounds``, ``adapt_round_steps``): each
# chain runs at temperature 1 in the noise-equalized metric; the metric is widened from
# the rounds' draws, and sampling starts from the end of the chain with the lowest loss.
# On OptuNet / Fashion-MNIST the chains' training loss keeps falling for about 100,000
# steps after the warm-up (0.657 at the trained network, 0.63 after the warm-up, 0.59
# at the end of the third round); chains started apart in that landscape stay apart
# (R-hat 1.27 after three rounds), chains from the common end mix (median ESS 86 of
# 100, R-hat 1.033, kinetic temperatures 0.975-0.997), all measured from DE member 0.
# From the SGHMC spec's base network (seed 6) the best chain was still descending after
# three rounds (losses 0.721 -> 0.700 -> 0.689), and sampling from there gave ESS 17.6
# and R-hat 1.22; settling it first (SETTLE_STEPS: five segments, to 0.678) gave ESS 64,
# R-hat 1.045 and kinetic temperatures 0.999-1.022 (the shipped file). The settling: the
# lowest-loss chain continues in segments of ``adapt_round_steps``, in the metric
# re-equalized at each segment's start, until its mean loss falls by less than the
# posterior's own energy fluctuation, sqrt(d / 2) / N per example (2.3e-4 on OptuNet,
# d = 392, N = 60,000).

#: Minibatch gradients (at least, and 5 per parameter) that measure the noise covariance.
NOISE_BATCHES = 2000
#: The running noise estimate of a cold chain: about 1,000 steps, which a d x d
#: covariance of a few hundred parameters needs.
ADAPTED_NOISE_DECAY = 0.999
#: SGHMC steps whose gradients fill the noise estimate before beta_hat is subtracted.
NOISE_WARM_UP = 100
#: Examples per batch when the preconditioner reads the training set.
READ_BATCH = 500


def chain_seed(seed: int, chain: int) -> int:
    """Chain 0 keeps the mode's own seed (a one-chain mode is unchanged); chain c > 0 a
    word derived from (seed, c)."""
    if chain == 0:
        return seed
    return int(np.random.SeedSequence([seed, chain]).generate_state(1, np.uint32)[0])


def round_seed(seed: int, number: int, chain: int | None = None) -> int:
    """The batch order of cold round ``number`` (of chain ``chain``; None: the round's
    noise measurement)."""
    words = [seed, number, 0xC01D] + ([] if chain is None else [chain])
    return int(np.random.SeedSequence(words).generate_state(1, np.uint32)[0])


def _copy(params: Params) -> Params:
    return {name: value.detach().clone() for name, value in params.items()}


def settle_seed(seed: int, segment: int, batches: bool) -> int:
    """Settling segment ``segment``'s batch order (``batches``) or noise measurement."""
    words = [seed, segment, 0x5E77, int(batches)]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint32)[0])


def settled_loss_drop(size: int, num_data: int) -> float:
    """The fall in mean loss per example below which a chain counts as settled: one
    standard deviation of a ``size``-parameter Gaussian posterior's energy, sqrt(d / 2),
    per example of ``num_data``."""
    return math.sqrt(size / 2) / num_data


def noise_seed(seed: int, point: int) -> int:
    """The batches that measure the minibatch noise at point ``point``."""
    return int(np.random.SeedSequence([seed, point, 0x5EED]).generate_state(1, np.uint32)[0])


def adaptation_seed(seed: int, chain: int) -> int:
    """The batch order of chain ``chain``'s warm-up: a word derived from (seed, chain,
    and a tag), so that the sampling that follows does not replay its batches."""
    return int(np.random.SeedSequence([seed, chain, 0xADA]).generate_state(1, np.uint32)[0])


@dataclass(frozen=True)
class SghmcChains:
    """The kept samples of a mode's chains (state_dicts, chain-major) and the chain each
    was drawn from (stored as the metadata column ``chain``)."""

    samples: list[dict[str, torch.Tensor]]
    chains: list[int]


class Sghmc(Method):
    """SGHMC: ``chains`` independent chains from each trained base network, each keeping
    ``samples_per_mode / chains`` samples (chain-major: sample j is chain
    ``j // (samples_per_mode / chains)``).

    With ``preconditioner = "laplace"`` each chain runs in the whitened coordinates of the
    base network's Laplace precision (:class:`WhitenedSghmcStepper`) at ``whitened_lr``, on
    minibatches of ``batch_size``, and starts from its own draw of that Laplace
    approximation (so that R-hat compares chains started apart).

    With ``preconditioner = "adapted"`` every chain first warms up for ``adapt_steps`` in
    that metric at a cheap hot setting (:data:`ADAPT_LR`); the metric is then widened
    along the directions the warm-ups spread over (:func:`adapted_whitening`). On OptuNet
    the posterior spreads up to 36 times the Laplace variance along a few dozen
    directions, which a chain in the Laplace metric crosses too slowly to mix. Then
    ``adapt_rounds`` cold rounds (:meth:`_cold_rounds`): each chain runs
    ``adapt_round_steps`` at temperature 1 in the metric whose noisiest directions are
    stretched to the median's noise (:func:`noise_equalized_whitening`), at the step
    :data:`STEP_SCALE` ``/ v_ref`` with friction equal to the step, on independent
    minibatches with a running dense correction; the metric is widened from each round
    but the last. The last round's lowest-loss chain then settles alone (:meth:`_settle`,
    at most ``settle_steps``) until its loss stops falling. Sampling starts every chain
    from where it settled, in the metric re-equalized there."""

    name = "sghmc"
    summary = "stochastic-gradient HMC chains from each trained base network"
    #: The friction of the kept steps; None: the ``alpha`` option (an adapted chain's cold
    #: rounds derive their own). SGLD (:mod:`train_zoo.methods.sgld`) is this chain at 1.
    sampling_friction: float | None = None

    def _friction(self, opts: Mapping[str, Any], derived: float | None = None) -> float:
        if self.sampling_friction is not None:
            return self.sampling_friction
        return derived if derived is not None else opts["alpha"]

    def sampling_step(self, eta: float, alpha: float) -> tuple[float, float]:
        """The step and friction of the kept steps after the cold rounds derived ``eta``
        and ``alpha``. SGHMC at step ``eta`` and friction ``alpha`` moves like a Langevin
        chain of step ``eta / alpha`` (its overdamped limit), so a chain whose friction is
        fixed (:attr:`sampling_friction`; SGLD's 1) takes the step that keeps that pace,
        ``eta x friction / alpha``: at the cold rounds' own ``eta`` it would mix
        ``1 / alpha`` (about 500) times slower per step. The noise correction's share
        ``beta_hat = eta V / (2 alpha)`` is then the same as SGHMC's."""
        if self.sampling_friction is None:
            return eta, alpha
        return eta * self.sampling_friction / alpha, self.sampling_friction

    options = method_options("sghmc")

    def _whitening(self, run: ModeRun, model: nn.Module, params: Params, buffers: Params,
                   prior: float) -> Whitening:
        """The constant mass matrix of a ``preconditioner = "laplace"`` chain: the full
        Laplace posterior precision (GGN + prior, unaugmented training data) at the base
        network."""
        try:
            state = laplace.init(model, params, buffers,
                                 run.engine.read_batches(run.seeds.method, READ_BATCH),
                                 run.num_data, structure="full", prior_precision=prior)
        except PosteriorZooError as error:
            raise type(error)(f"sghmc preconditioner: {error}") from None
        curvature = state.curvature
        if not isinstance(curvature, laplace.FullCurvature):  # structure="full" above
            raise TypeError(f"sghmc preconditioner: a full curvature was asked for, not "
                            f"{type(curvature).__name__}")
        return Whitening(curvature.cholesky.double())

    def phase_steps(self, spec: Any, steps_per_epoch: int) -> int:
        """Every chain's steps up to its last kept sample; an adapted chain's settling
        (one chain's) counted at ``settle_steps``, its limit."""
        options = spec.method_options
        chains = options["chains"]
        per_chain = spec.samples_per_mode // chains
        warm_up = 0
        if options.get("preconditioner") == "adapted":
            warm_up = (options.get("adapt_steps", ADAPT_STEPS)
                       + options.get("adapt_rounds", 0)
                       * options.get("adapt_round_steps", ADAPT_ROUND_STEPS))
        settling = (options.get("settle_steps", 0) if options.get("adapt_rounds", 0)
                    and options.get("preconditioner") == "adapted" else 0)
        return settling + chains * (warm_up + chain_schedule(options["burn_in"],
                                                             options["thin"], per_chain)[-1])

    def fit(self, run: ModeRun) -> Posterior:
        spec, seeds, engine = run.spec, run.seeds, run.engine
        model, steps = engine.train_base()
        opts = spec.method_options
        num_data = run.num_data
        prior = opts["prior_precision"]
        if prior == "training":
            prior = prior_precision_from_weight_decay(num_data, spec.recipe.weight_decay)
        chains = opts["chains"]
        keep = chain_schedule(opts["burn_in"], opts["thin"], spec.samples_per_mode // chains)
        params, buffers = parameters_of(model)
        preconditioner = opts.get("preconditioner", "none")
        whitened = preconditioner in ("laplace", "adapted")
        batch_size = opts.get("batch_size") or spec.recipe.batch_size
        whitening = (self._whitening(run, model, params, buffers, prior)
                     if whitened else None)
        gradient = engine.log_posterior(model, params, buffers, num_data, prior)
        eta = opts["whitened_lr"] if whitened else opts["lr"] / num_data
        steps_per_epoch = math.ceil(num_data / batch_size)
        noise_decay = opts["noise_decay"] if opts["noise_correction"] else None
        independent = opts.get("minibatches", "epochs") == "independent"
        generators = [generator_for(chain_seed(seeds.sample, chain)) for chain in range(chains)]
        starts: Sequence[Params | None] = [None] * chains
        adaptation, alpha, running = None, self._friction(opts), False
        if preconditioner == "adapted":
            if whitening is None:  # whitened: _whitening set it above
                raise AssertionError("an adapted sghmc chain starts from the Laplace metric")
            whitening, adapted, adaptation, adapt_steps = self._adapt(
                run, model, params, gradient, whitening, generators,
                opts.get("adapt_steps", ADAPT_STEPS), noise_decay, independent)
            starts = adapted
            steps += adapt_steps
            if opts.get("adapt_rounds", 0):
                # a cold chain's running estimate spans about 1,000 steps
                noise_decay = ADAPTED_NOISE_DECAY if noise_decay is not None else None
                cold = self._cold_rounds(run, model, gradient, whitening, adapted,
                                         generators, opts, batch_size, independent,
                                         noise_decay)
                whitening, starts, eta, alpha, record = cold
                eta, alpha = self.sampling_step(eta, alpha)
                record["sampling"] = {"lr": eta, "alpha": alpha}
                adaptation["cold"] = record
                steps += (sum(sum(r["steps"]) for r in record["rounds"])
                          + record["settling"]["steps"])
                running = True
        samples, records, chain_ids = [], [], []
        for chain in range(chains):
            generator = generators[chain]
            stepper: SghmcStepper | WhitenedSghmcStepper
            begin = starts[chain]
            if begin is not None:  # from where its adaptation ended
                if whitening is None:  # only an adapted chain has a start
                    raise AssertionError("an adapted sghmc chain has its metric")
                stepper = WhitenedSghmcStepper(
                    begin, gradient, whitening, eta, alpha, generator,
                    keep[-1], noise_decay=noise_decay, warm_up=NOISE_WARM_UP,
                    record_from=opts["burn_in"], running=running)
            elif whitening is not None:
                size = whitening.cholesky.shape[0]
                start = torch.randn(size, generator=generator, dtype=torch.float64)
                stepper = WhitenedSghmcStepper(
                    params, gradient, whitening, eta, alpha, generator, keep[-1],
                    start_offset=start, noise_decay=noise_decay, warm_up=NOISE_WARM_UP,
                    record_from=opts["burn_in"])
            else:
                stepper = SghmcStepper(params, gradient, eta, alpha, generator,
                                       keep[-1], noise_decay=noise_decay,
                                       warm_up=NOISE_WARM_UP, record_from=opts["burn_in"])
            collector = Collector(list(params), steps=set(keep))
            result = fit(stepper, engine.batches(model, chain_seed(seeds.method, chain),
                                                 batch_size, replacement=independent),
                         lambda epoch: eta, math.ceil(keep[-1] / steps_per_epoch),
                         index=run.index, phase=self.name,
                         callbacks=[*run.callbacks, collector])
            kept = collector.kept
            while len(kept) < len(keep):  # a chain that diverged: its last state
                last = stepper.arrays()
                kept.append({name: torch.tensor(last[name]) for name in params})
            samples += [{**sample, **buffers} for sample in kept]
            chain_ids += [chain] * len(kept)
            records.append({"chain": chain, **stepper.record()})
            steps += result.steps
        record = {"method": self.name, "chains": records,
                  "preconditioner": preconditioner if whitened else "none",
                  "batch_size": batch_size}
        if adaptation is not None:
            record["adaptation"] = adaptation
        return Posterior(SghmcChains(samples, chain_ids), steps, engine.name, record)

    def _adapt(self, run: ModeRun, model: nn.Module, params: Params,
               gradient: LogPosteriorGradient, whitening: Whitening,
               generators: Sequence[torch.Generator], adapt_steps: int,
               noise_decay: float | None, independent: bool
               ) -> tuple[Whitening, list[Params], dict[str, Any], int]:
        """Each chain's warm-up in the Laplace metric (from its own draw of the Laplace
        approximation), then the adapted metric from all of them
        (:func:`adapted_whitening`). Returns the metric, each chain's end state, the
        adaptation's record and the steps taken."""
        half = adapt_steps // 2
        keep = set(range(half + ADAPT_THIN, adapt_steps + 1, ADAPT_THIN))
        steps_per_epoch = math.ceil(run.num_data / ADAPT_BATCH)
        trajectories, ends, temperatures, steps = [], [], [], 0
        size = whitening.cholesky.shape[0]
        for chain, generator in enumerate(generators):
            start = torch.randn(size, generator=generator, dtype=torch.float64)
            stepper = WhitenedSghmcStepper(
                params, gradient, whitening, ADAPT_LR, ADAPT_ALPHA, generator, adapt_steps,
                start_offset=start, noise_decay=noise_decay, warm_up=NOISE_WARM_UP,
                record_from=half)
            collector = Collector(list(params), steps=keep)
            batches = run.engine.batches(model, adaptation_seed(run.seeds.method, chain),
                                         ADAPT_BATCH, replacement=independent)
            result = fit(stepper, batches, lambda epoch: ADAPT_LR,
                         math.ceil(adapt_steps / steps_per_epoch), index=run.index,
                         phase=f"{self.name}-adapt", callbacks=[*run.callbacks, collector])
            steps += result.steps
            temperature = stepper.record()["kinetic_temperature"]
            if temperature is None or len(collector.kept) < 2:
                raise PosteriorZooError(f"sghmc adaptation: chain {chain}'s warm-up diverged; "
                                        f"lower whitened_lr or raise adapt_steps")
            temperatures.append(temperature)
            trajectories.append(torch.stack([flatten(state).double()
                                             for state in collector.kept]))
            ends.append(_copy(stepper.params))
        temperature = sum(temperatures) / len(temperatures)
        adapted, variances = adapted_whitening(whitening, trajectories, temperature)
        record = {"steps": adapt_steps, "kept_per_chain": len(keep),
                  "kinetic_temperatures": temperatures,
                  "widened_directions": int((variances > ADAPT_FLOOR).sum()),
                  "largest_variance_ratio": float(variances[-1]),
                  "median_variance_ratio": float(variances.median())}
        return adapted, ends, record, steps

    def _noise_gradients(self, run: ModeRun, model: nn.Module, gradient: LogPosteriorGradient,
                         points: Sequence[Params], batch_size: int, seed: int
                         ) -> torch.Tensor:
        """``(n, d)`` independent minibatch gradients, ``n / len(points)`` at each point,
        each point's centred on their mean: a sample of the minibatch noise there."""
        size = sum(value.numel() for value in points[0].values())
        per_point = math.ceil(max(NOISE_BATCHES, 5 * size) / len(points))
        centred = []
        for number, point in enumerate(points):
            source = run.engine.batches(model, noise_seed(seed, number), batch_size,
                                        replacement=True)
            batches = (batch for epoch in itertools.count() for batch in source(epoch))
            sample = torch.stack([flatten(gradient(point, next(batches))[1]).double()
                                  for _ in range(per_point)])
            centred.append(sample - sample.mean(0))
        return torch.cat(centred)

    def _equalized(self, run: ModeRun, model: nn.Module, gradient: LogPosteriorGradient,
                   base: Whitening, points: Sequence[Params], batch_size: int, seed: int
                   ) -> tuple[Whitening, float, float, float]:
        """The noise-equalized metric at ``points``, its step's ``lr`` and ``alpha``, and
        the noise reference."""
        metric, reference = noise_equalized_whitening(
            base, self._noise_gradients(run, model, gradient, points, batch_size, seed))
        step = min(STEP_SCALE / reference, MAX_STEP)
        return metric, step * step, step, reference

    def _cold_chain(self, run: ModeRun, model: nn.Module, gradient: LogPosteriorGradient,
                    metric: Whitening, lr: float, alpha: float, start: Params,
                    generator: torch.Generator, steps: int, batch_size: int, batch_seed: int,
                    independent: bool, noise_decay: float | None, phase: str,
                    keep: set[int]) -> tuple[WhitenedSghmcStepper, list[Params], int]:
        """One chain at temperature 1 from ``start`` for ``steps`` steps, with a running
        dense correction: its stepper, the states kept at ``keep`` and the steps taken.
        Raises when it diverged."""
        stepper = WhitenedSghmcStepper(start, gradient, metric, lr, alpha, generator, steps,
                                       noise_decay=noise_decay, warm_up=NOISE_WARM_UP,
                                       record_from=steps // 2, running=True)
        collector = Collector(list(start), steps=keep)
        batches = run.engine.batches(model, batch_seed, batch_size, replacement=independent)
        steps_per_epoch = math.ceil(run.num_data / batch_size)
        result = fit(stepper, batches, lambda epoch: lr, math.ceil(steps / steps_per_epoch),
                     index=run.index, phase=phase, callbacks=[*run.callbacks, collector])
        if stepper.steps < steps or not math.isfinite(stepper.loss_sum):  # stopped early
            raise PosteriorZooError(f"sghmc {phase}: the chain diverged; raise "
                                    f"adapt_round_steps or adapt_steps")
        return stepper, collector.kept, result.steps

    def _cold_rounds(self, run: ModeRun, model: nn.Module,
                     gradient: LogPosteriorGradient, base: Whitening,
                     starts: list[Params], generators: Sequence[torch.Generator],
                     opts: Mapping[str, Any], batch_size: int, independent: bool,
                     noise_decay: float | None
                     ) -> tuple[Whitening, list[Params], float, float, dict[str, Any]]:
        """The cold rounds after the warm-up, then the settling of their lowest-loss chain
        (:meth:`_settle`). Returns the sampling metric, every chain's start (the settled
        chain's end), the sampling ``lr`` and ``alpha``, and the record."""
        rounds, round_steps = opts["adapt_rounds"], opts["adapt_round_steps"]
        thin = max(1, round_steps // ROUND_DRAWS)
        keep = set(range(thin, round_steps + 1, thin))
        seed = run.seeds.method
        records: list[dict[str, Any]] = []
        losses: list[float] = []
        ends = list(starts)
        for number in range(rounds):
            metric, lr, alpha, reference = self._equalized(run, model, gradient, base, ends,
                                                           batch_size, round_seed(seed, number))
            trajectories, temperatures, losses, finished, steps = [], [], [], [], []
            for chain, generator in enumerate(generators):
                stepper, kept, taken = self._cold_chain(
                    run, model, gradient, metric, lr, alpha, ends[chain], generator,
                    round_steps, batch_size, round_seed(seed, number, chain), independent,
                    noise_decay, f"{self.name}-round-{number + 1}", keep)
                trajectories.append(torch.stack([flatten(state).double() for state in kept]))
                temperatures.append(stepper.record()["kinetic_temperature"])
                losses.append(stepper.loss_sum / stepper.record()["recorded_steps"])
                finished.append(_copy(stepper.params))
                steps.append(taken)
            ends = finished
            record = {"lr": lr, "alpha": alpha, "noise_reference": reference,
                      "kinetic_temperatures": temperatures, "mean_losses": losses,
                      "steps": steps}
            if number < rounds - 1:
                base, variances = adapted_whitening(base, trajectories)
                record["widened_directions"] = int((variances > ADAPT_FLOOR).sum())
            records.append(record)
        best = int(np.argmin(losses))
        start, settling = self._settle(run, model, gradient, base, ends[best], losses[best],
                                       generators[best], opts, batch_size, independent,
                                       noise_decay)
        metric, lr, alpha, reference = self._equalized(run, model, gradient, base, [start],
                                                       batch_size, round_seed(seed, rounds))
        record = {"rounds": records, "start_chain": best, "settling": settling, "lr": lr,
                  "alpha": alpha, "noise_reference": reference}
        return metric, [start] * len(generators), lr, alpha, record

    def _settle(self, run: ModeRun, model: nn.Module, gradient: LogPosteriorGradient,
                base: Whitening, start: Params, loss: float, generator: torch.Generator,
                opts: Mapping[str, Any], batch_size: int, independent: bool,
                noise_decay: float | None) -> tuple[Params, dict[str, Any]]:
        """The rounds' lowest-loss chain (at ``start``, mean loss ``loss`` in its last
        round) continues alone, ``adapt_round_steps`` at a time, in ``base``
        re-equalized at each segment's start, until its mean loss falls by less than
        :func:`settled_loss_drop` or ``settle_steps`` run out. Chains started from a
        point that is still descending carry the descent into the samples (on OptuNet:
        R-hat 1.22 from a chain whose loss was falling 0.01 a round). Returns its end
        and the record."""
        limit, segment = opts.get("settle_steps", 0), opts["adapt_round_steps"]
        size = sum(value.numel() for value in start.values())
        tolerance = settled_loss_drop(size, run.num_data)
        losses: list[float] = []
        temperatures: list[float | None] = []
        steps, settled = 0, False
        while not settled and steps + segment <= limit:
            number = len(losses)
            metric, lr, alpha, _ = self._equalized(
                run, model, gradient, base, [start], batch_size,
                settle_seed(run.seeds.method, number, False))
            stepper, _, taken = self._cold_chain(
                run, model, gradient, metric, lr, alpha, start, generator, segment,
                batch_size, settle_seed(run.seeds.method, number, True), independent,
                noise_decay, f"{self.name}-settle-{number + 1}", set())
            mean = stepper.loss_sum / stepper.record()["recorded_steps"]
            settled = loss - mean < tolerance
            loss, start, steps = mean, _copy(stepper.params), steps + taken
            losses.append(mean)
            temperatures.append(stepper.record()["kinetic_temperature"])
        return start, {"mean_losses": losses, "kinetic_temperatures": temperatures,
                       "steps": steps, "tolerance": tolerance, "settled": settled}

    def sample(self, state: SghmcChains, generator: torch.Generator, count: int
               ) -> list[dict[str, torch.Tensor]]:
        """The first ``count`` kept samples: a chain's randomness is drawn while it runs
        (from the mode's ``sample`` seed), so ``generator`` is not used."""
        count = check_integer("sghmc option 'count'", count, 1, len(state.samples))
        return state.samples[:count]

    def sample_chains(self, state: SghmcChains, count: int) -> list[int]:
        """The chain each of the first ``count`` samples was drawn from (what
        :meth:`sample` returns, in its order)."""
        return state.chains[:count]


METHOD = Sghmc()
