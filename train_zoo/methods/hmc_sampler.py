"""Full-batch Hamiltonian Monte Carlo on a flat float64 vector: the sampler, free of torch.

The target is ``exp(-U(theta))`` for a potential the caller gives as one callable,
``potential(theta) -> (U, grad U)`` (float64 in, a float and a float64 array out: the
network's version sums float32 kernel gradients in float64, :mod:`train_zoo.methods.hmc`).
One iteration (Neal 2011, identity mass matrix):

1. draw the momentum ``p ~ N(0, I)`` from the chain's numpy Generator;
2. ``L = ceil(trajectory_length / step_size)`` leapfrog steps (at most
   ``max_leapfrog_steps``, and during burn-in at most ``burn_in_leapfrog_steps``):
   ``p -= eps/2 grad U; theta += eps p; p -= eps/2 grad U``;
3. accept the end with probability ``min(1, exp(H0 - H1))``, ``H = U + |p|^2 / 2``, in
   float64; a trajectory whose potential stops being finite is rejected (a divergence).

The leapfrog map is reversible and preserves volume for *any* deterministic gradient
field (each half step is a shear), so the float32 gradient costs acceptance, never
correctness: the chain targets ``exp(-U)`` for the ``U`` that ``potential`` computes.

The step size is adapted during the ``burn_in`` iterations by dual averaging (Hoffman &
Gelman 2014, Algorithm 5: ``gamma = 0.05, t0 = 10, kappa = 0.75, mu = log(10 eps0)``) to a
target mean acceptance probability, then frozen at the averaged value ``eps_bar``. The
first step size is the caller's or Hoffman & Gelman's heuristic (Algorithm 4: halve or
double from ``trajectory_length`` until one leapfrog step's acceptance crosses 1/2).

**Resumable at every iteration.** Everything the next iteration depends on (theta, the
potential and gradient there, the adaptation, the Generator's ``bit_generator.state``, the
counters, the kept samples, the per-iteration statistics) is a :class:`ChainState` of plain
arrays and JSON, written after each iteration by :func:`save_state` (temporary file, fsync,
``os.replace``) and read back with ``np.load(allow_pickle=False)``. A process killed at any
moment leaves the last complete iteration on disk, and :func:`run_chain` continues from it
bit-identically (floats go through JSON by ``repr``, which round-trips exactly).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ChainState", "DualAveraging", "HmcOptions", "Potential", "chain_summary",
           "e_bfmi", "find_step_size", "hmc_iteration", "leapfrog", "load_state",
           "run_chain", "save_state"]

#: ``potential(theta) -> (U, grad U)`` for a float64 vector ``theta``.
Potential = Callable[[np.ndarray], tuple[float, np.ndarray]]

#: Hoffman & Gelman's dual-averaging constants (their Algorithm 5, as Stan uses them).
GAMMA, T0, KAPPA = 0.05, 10.0, 0.75
#: The state file's layout version (a file of another version is not resumed).
STATE_VERSION = 1


@dataclass(frozen=True)
class HmcOptions:
    """One chain's settings.

    Attributes
    ----------
    burn_in : int
        Iterations whose step size is adapted; none is kept.
    thin : int
        Iterations between kept samples after burn-in (the sample is the state after
        iteration ``burn_in + k * thin``).
    samples : int
        Samples kept, so the chain runs ``burn_in + thin * samples`` iterations.
    trajectory_length : float
        ``step_size * L``, the integration time per iteration.
    step_size : float or None
        The first step size (None: :func:`find_step_size`).
    target_accept : float
        The mean acceptance probability the adaptation aims at.
    max_leapfrog_steps : int
        A cap on ``L`` (a step size adapted very small would otherwise stall the chain).
    burn_in_leapfrog_steps : int
        A lower cap on ``L`` during burn-in, where the dual-averaging iterate swings
        over orders of magnitude (after a few rejections it is often 100 times too
        small, and ``L`` as many times too large): NUTS's guard, Stan's default tree
        depth of 10. For a stable step size the energy error stays bounded along the
        trajectory, so a shorter trajectory barely changes the acceptance it adapts to.
    """

    burn_in: int
    thin: int
    samples: int
    trajectory_length: float
    step_size: float | None = None
    target_accept: float = 0.8
    max_leapfrog_steps: int = 10_000
    burn_in_leapfrog_steps: int = 1_024

    @property
    def iterations(self) -> int:
        return self.burn_in + self.thin * self.samples

    def leapfrog_steps(self, step_size: float, burn_in: bool = False) -> int:
        """``ceil(trajectory_length / step_size)``, between 1 and the cap (the burn-in's
        lower cap during burn-in)."""
        cap = (min(self.max_leapfrog_steps, self.burn_in_leapfrog_steps) if burn_in
               else self.max_leapfrog_steps)
        return int(min(cap, max(1, math.ceil(self.trajectory_length / step_size))))


def leapfrog(theta: np.ndarray, momentum: np.ndarray, grad: np.ndarray, step_size: float,
             steps: int, potential: Potential
             ) -> tuple[np.ndarray, np.ndarray, float, np.ndarray, int]:
    """``steps`` leapfrog steps from ``(theta, momentum)`` with ``grad = grad U(theta)``.

    Returns
    -------
    theta, momentum : float64 arrays
        The end point (new arrays; the inputs are not changed).
    potential, grad
        ``U`` and ``grad U`` at the end.
    taken : int
        Steps taken: fewer than ``steps`` when the potential stopped being finite (the
        end is then not a valid proposal).
    """
    theta = np.array(theta, dtype=np.float64)
    momentum = momentum - 0.5 * step_size * grad
    value = math.nan
    for taken in range(1, steps + 1):
        theta = theta + step_size * momentum
        value, grad = potential(theta)
        if not (math.isfinite(value) and np.isfinite(grad).all()):
            return theta, momentum, math.inf, grad, taken - 1
        if taken < steps:
            momentum = momentum - step_size * grad
    momentum = momentum - 0.5 * step_size * grad
    return theta, momentum, float(value), grad, steps


@dataclass
class DualAveraging:
    """Hoffman & Gelman's dual averaging of ``log step_size`` (Algorithm 5)."""

    mu: float
    target: float
    log_step: float
    log_step_bar: float = 0.0
    h_bar: float = 0.0
    count: int = 0

    @classmethod
    def start(cls, step_size: float, target: float) -> DualAveraging:
        return cls(mu=math.log(10 * step_size), target=target, log_step=math.log(step_size))

    def update(self, accept_prob: float) -> None:
        """One iteration's acceptance probability: the next ``log_step`` and the average."""
        self.count += 1
        eta = 1.0 / (self.count + T0)
        self.h_bar = (1 - eta) * self.h_bar + eta * (self.target - accept_prob)
        self.log_step = self.mu - math.sqrt(self.count) / GAMMA * self.h_bar
        weight = self.count ** -KAPPA
        self.log_step_bar = weight * self.log_step + (1 - weight) * self.log_step_bar

    def to_json(self) -> dict[str, Any]:
        return {"mu": self.mu, "target": self.target, "log_step": self.log_step,
                "log_step_bar": self.log_step_bar, "h_bar": self.h_bar, "count": self.count}


@dataclass
class ChainState:
    """Everything the chain's next iteration depends on, and what it has produced.

    ``iteration`` counts completed iterations; the per-iteration arrays hold one entry per
    completed iteration: ``accept_probs`` (``min(1, exp(H0 - H1))``), ``accepted``,
    ``energies`` (the Hamiltonian at the state the iteration ended in: the proposal's if
    accepted, the start's otherwise), ``leapfrog_steps`` and ``step_sizes`` (used).
    """

    theta: np.ndarray
    potential: float
    grad: np.ndarray
    step_size: float
    adaptation: DualAveraging
    rng_state: dict[str, Any]
    key: str = ""
    iteration: int = 0
    samples: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))
    accept_probs: np.ndarray = field(default_factory=lambda: np.empty(0))
    accepted: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=bool))
    energies: np.ndarray = field(default_factory=lambda: np.empty(0))
    leapfrog_steps: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    step_sizes: np.ndarray = field(default_factory=lambda: np.empty(0))
    divergences: int = 0

    def generator(self) -> np.random.Generator:
        """The chain's Generator, at the state this iteration starts from."""
        generator = np.random.Generator(np.random.PCG64())
        generator.bit_generator.state = self.rng_state
        return generator


def save_state(path: str | os.PathLike, state: ChainState) -> None:
    """Write ``state`` to ``path`` atomically (:func:`save_arrays`)."""
    meta = {"version": STATE_VERSION, "key": state.key, "potential": state.potential,
            "step_size": state.step_size, "adaptation": state.adaptation.to_json(),
            "rng_state": state.rng_state, "iteration": state.iteration,
            "divergences": state.divergences}
    save_arrays(path, {"theta": state.theta, "grad": state.grad, "samples": state.samples,
                       "accept_probs": state.accept_probs, "accepted": state.accepted,
                       "energies": state.energies, "leapfrog_steps": state.leapfrog_steps,
                       "step_sizes": state.step_sizes}, meta)


def save_arrays(path: str | os.PathLike, arrays: dict[str, np.ndarray],
                meta: dict[str, Any]) -> None:
    """Write ``arrays`` and ``meta`` (JSON, as the array ``meta``) to ``path`` atomically:
    a temporary file beside it, fsync, ``os.replace``, fsync of the folder. No pickle."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {**arrays, "meta": np.array(json.dumps(meta))}
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                         dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            np.savez(stream, **arrays)  # type: ignore[arg-type]
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def load_state(path: str | os.PathLike) -> ChainState:
    """The state :func:`save_state` wrote (``np.load(allow_pickle=False)``)."""
    with np.load(path, allow_pickle=False) as stored:
        meta = json.loads(str(stored["meta"]))
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"{path}: state version {meta.get('version')}, expected "
                             f"{STATE_VERSION}")
        return ChainState(
            theta=stored["theta"], potential=float(meta["potential"]), grad=stored["grad"],
            step_size=float(meta["step_size"]),
            adaptation=DualAveraging(**meta["adaptation"]), rng_state=meta["rng_state"],
            key=meta["key"], iteration=int(meta["iteration"]), samples=stored["samples"],
            accept_probs=stored["accept_probs"], accepted=stored["accepted"],
            energies=stored["energies"], leapfrog_steps=stored["leapfrog_steps"],
            step_sizes=stored["step_sizes"], divergences=int(meta["divergences"]))


def find_step_size(theta: np.ndarray, potential_value: float, grad: np.ndarray,
                   potential: Potential, generator: np.random.Generator, start: float,
                   max_rounds: int = 60) -> float:
    """Hoffman & Gelman's heuristic (Algorithm 4): from ``start``, double (or halve) the
    step size until one leapfrog step's acceptance ratio crosses 1/2."""
    step = start

    def log_ratio(step: float) -> float:
        momentum = generator.standard_normal(theta.shape)
        _, end, value, _, taken = leapfrog(theta, momentum, grad, step, 1, potential)
        if taken < 1:
            return -math.inf
        return (potential_value + 0.5 * float(momentum @ momentum)
                - value - 0.5 * float(end @ end))

    ratio = log_ratio(step)
    direction = 1 if ratio > math.log(0.5) else -1
    for _ in range(max_rounds):
        if not direction * ratio > direction * math.log(0.5):
            break
        step = step * 2.0 ** direction
        ratio = log_ratio(step)
    return step


def _start(theta: np.ndarray, potential: Potential, options: HmcOptions, seed: int,
           key: str) -> ChainState:
    theta = np.array(theta, dtype=np.float64)
    value, grad = potential(theta)
    if not math.isfinite(value):
        raise ValueError("the potential is not finite at the chain's start")
    generator = np.random.Generator(np.random.PCG64(seed))
    step = options.step_size
    if step is None:
        step = find_step_size(theta, value, grad, potential, generator,
                              options.trajectory_length)
    size = theta.size
    return ChainState(theta=theta, potential=float(value), grad=np.asarray(grad, np.float64),
                      step_size=float(step),
                      adaptation=DualAveraging.start(step, options.target_accept),
                      rng_state=dict(generator.bit_generator.state), key=key,
                      samples=np.empty((0, size)))


def hmc_iteration(state: ChainState, potential: Potential, options: HmcOptions) -> None:
    """One iteration of the chain (module docstring), ``state`` updated in place."""
    generator = state.generator()
    momentum = generator.standard_normal(state.theta.shape)
    steps = options.leapfrog_steps(state.step_size, state.iteration < options.burn_in)
    theta, end, value, grad, taken = leapfrog(state.theta, momentum, state.grad,
                                              state.step_size, steps, potential)
    start_energy = state.potential + 0.5 * float(momentum @ momentum)
    if taken == steps:
        end_energy = value + 0.5 * float(end @ end)
        log_accept = start_energy - end_energy
    else:
        end_energy, log_accept = math.inf, -math.inf
        state.divergences += 1
    accept_prob = 1.0 if log_accept >= 0 else math.exp(log_accept)
    accepted = bool(generator.random() < accept_prob)
    if accepted:
        state.theta, state.potential, state.grad = theta, value, np.asarray(grad, np.float64)
    used = state.step_size
    if state.iteration < options.burn_in:
        state.adaptation.update(accept_prob)
        last = state.iteration == options.burn_in - 1
        state.step_size = math.exp(state.adaptation.log_step_bar if last
                                   else state.adaptation.log_step)
    state.iteration += 1
    state.rng_state = dict(generator.bit_generator.state)
    state.accept_probs = np.append(state.accept_probs, accept_prob)
    state.accepted = np.append(state.accepted, accepted)
    state.energies = np.append(state.energies, end_energy if accepted else start_energy)
    state.leapfrog_steps = np.append(state.leapfrog_steps, np.int64(taken))
    state.step_sizes = np.append(state.step_sizes, used)
    after = state.iteration - options.burn_in
    if after > 0 and after % options.thin == 0:
        state.samples = np.concatenate([state.samples.reshape(-1, state.theta.size),
                                        state.theta[None]])


def run_chain(potential: Potential, theta: np.ndarray, options: HmcOptions, seed: int, *,
              path: str | os.PathLike | None = None, key: str = "",
              stop_after: int | None = None,
              on_iteration: Callable[[ChainState], None] | None = None) -> ChainState:
    """Run (or continue) one chain to ``options.iterations`` iterations.

    Parameters
    ----------
    potential : Potential
    theta : float64 array
        The start (ignored when a state is resumed).
    options : HmcOptions
    seed : int
        Seeds the chain's Generator (momenta, accept draws, the step-size heuristic).
    path : path-like, optional
        The state file: resumed when it exists and holds ``key``, and rewritten after the
        start and after every iteration.
    key : str
        What the state belongs to (the problem, its options and start); a file with
        another key is not resumed but started over.
    stop_after : int, optional
        Stop after this many iterations of this call (a test's stand-in for a kill).
    on_iteration : callable, optional
        Called with the state after each iteration (after it is saved).
    """
    state = None
    if path is not None and Path(path).exists():
        try:
            state = load_state(path)
        except (ValueError, KeyError, OSError):
            state = None
        if state is not None and state.key != key:
            state = None
    if state is None:
        state = _start(theta, potential, options, seed, key)
        if path is not None:
            save_state(path, state)
    done = 0
    while state.iteration < options.iterations and (stop_after is None or done < stop_after):
        hmc_iteration(state, potential, options)
        done += 1
        if path is not None:
            save_state(path, state)
        if on_iteration is not None:
            on_iteration(state)
    return state


def e_bfmi(energies: np.ndarray) -> float:
    """Betancourt's energy Bayesian fraction of missing information: the sum of squared
    successive energy differences over the sum of squared deviations from their mean
    (NaN for fewer than 3 energies or constant ones). Below 0.3 the momentum resampling
    explores the energy levels poorly."""
    energies = np.asarray(energies, dtype=np.float64)
    if energies.size < 3:
        return math.nan
    spread = float(np.square(energies - energies.mean()).sum())
    return float(np.square(np.diff(energies)).sum()) / spread if spread > 0 else math.nan


def chain_summary(state: ChainState, options: HmcOptions) -> dict[str, Any]:
    """What the collection records of a chain (JSON-able): acceptance after burn-in (mean
    probability and share accepted), the frozen step size and its leapfrog steps, the
    adaptation's last acceptance, E-BFMI and the energies' summary, divergences."""
    kept = slice(min(options.burn_in, state.iteration), state.iteration)
    energies = state.energies[kept]
    probs, accepted = state.accept_probs[kept], state.accepted[kept]

    bfmi = e_bfmi(energies)

    def mean(values: np.ndarray) -> float | None:
        return float(values.mean()) if values.size else None

    return {
        "iterations": int(state.iteration), "burn_in": options.burn_in,
        "thin": options.thin, "samples": int(state.samples.shape[0]),
        "trajectory_length": options.trajectory_length,
        "step_size": state.step_size,
        "leapfrog_steps": options.leapfrog_steps(state.step_size),
        "target_accept": options.target_accept,
        "acceptance_rate": mean(probs), "accepted_share": mean(accepted.astype(float)),
        "burn_in_acceptance_rate": mean(state.accept_probs[:kept.start]),
        "gradient_evaluations": int(state.leapfrog_steps.sum()),
        "divergences": state.divergences,
        "e_bfmi": None if math.isnan(bfmi) else bfmi,
        "energy": {"mean": mean(energies),
                   "std": float(energies.std(ddof=1)) if energies.size > 1 else None,
                   "min": float(energies.min()) if energies.size else None,
                   "max": float(energies.max()) if energies.size else None},
    }
