"""Full-batch HMC (``train_zoo.methods.hmc``, ``train_zoo.methods.hmc_sampler``).

- The leapfrog integrator, directly: reversible (flip the momentum, integrate again, land
  on the start within float64 rounding that grows with the step count) and volume
  preserving (its Jacobian determinant is 1: exactly computable for a Gaussian, whose map
  is linear, and by central differences on a non-quadratic potential).
- Known posteriors: a correlated 2-D Gaussian, and Bayesian logistic regression against
  an independent reference (self-normalised importance sampling from an inflated Laplace
  approximation, 400,000 independent draws), agree in mean and covariance within Monte
  Carlo error (the chain's ESS from ``posteriorzoo._ess_rhat``).
- Dual averaging brings the burn-in's mean acceptance to the target, and the frozen
  step's near it, on a 50-D Gaussian.
- Kill and resume: a chain SIGKILLed in a subprocess after a few iterations, resumed from
  its state file, ends bit-identical to an uninterrupted chain; so does a chain stopped
  and reloaded in process.
- A digits run through the trainer gives every sample its mode's chain id and records
  acceptance, and the collection run removes its progress folder once modes commit.
- An independent sampler: NumPyro's NUTS (a test-only dependency, skipped without it) on
  a small tanh network gives the same posterior predictive within Monte Carlo error.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from rounding_bounds import U64, gamma

from posteriorzoo._ess_rhat import _ess
from train_zoo.methods.hmc_sampler import (
    DualAveraging,
    HmcOptions,
    chain_summary,
    e_bfmi,
    leapfrog,
    load_state,
    run_chain,
)

ROOT = Path(__file__).resolve().parent.parent


def _gaussian(cov: np.ndarray):
    precision = np.linalg.inv(cov)

    def potential(theta: np.ndarray) -> tuple[float, np.ndarray]:
        return 0.5 * float(theta @ precision @ theta), precision @ theta

    return potential


def _quartic(theta: np.ndarray) -> tuple[float, np.ndarray]:
    """A non-quadratic potential: log cosh plus a quartic."""
    return (float(np.log(np.cosh(theta)).sum() + 0.25 * (theta ** 4).sum()),
            np.tanh(theta) + theta ** 3)


# ------------------------------------------------------------------ the integrator
@pytest.mark.parametrize("steps", [1, 10, 100])
def test_leapfrog_is_reversible(steps):
    rng = np.random.default_rng(steps)
    theta, momentum = rng.standard_normal(5), rng.standard_normal(5)
    _, grad = _quartic(theta)
    end, end_momentum, _, end_grad, taken = leapfrog(theta, momentum, grad, 0.05, steps,
                                                     _quartic)
    assert taken == steps
    back, back_momentum, _, _, _ = leapfrog(end, -end_momentum, end_grad, 0.05, steps,
                                            _quartic)
    # each step rounds a few operations on values of the trajectory's size; a stable
    # integrator carries earlier roundings along without growing them much
    scale = max(np.abs(theta).max(), np.abs(momentum).max(), np.abs(end).max(),
                np.abs(end_momentum).max(), 1.0)
    bound = 16 * 2 * steps * U64 * scale
    assert np.abs(back - theta).max() <= bound
    assert np.abs(-back_momentum - momentum).max() <= bound
    # and the trajectory went somewhere (a no-op would pass the checks above)
    assert np.abs(end - theta).max() > 1000 * bound


def _flow(potential, steps, step_size):
    def flow(state: np.ndarray) -> np.ndarray:
        d = state.size // 2
        theta, momentum = state[:d], state[d:]
        _, grad = potential(theta)
        end, end_momentum, _, _, _ = leapfrog(theta, momentum, grad, step_size, steps,
                                              potential)
        return np.concatenate([end, end_momentum])
    return flow


def test_leapfrog_preserves_volume_exactly_on_a_gaussian():
    """On a Gaussian the leapfrog map is linear: its matrix's columns are the images of
    the unit vectors, and its determinant must be 1 (not merely near 1 for small steps:
    a wrong half step gives 1 - eps^2 A / 4 per step)."""
    cov = np.array([[2.0, 0.6, 0.0], [0.6, 1.0, -0.3], [0.0, -0.3, 0.5]])
    flow = _flow(_gaussian(cov), 25, 0.3)
    matrix = np.column_stack([flow(unit) for unit in np.eye(6)])
    assert abs(np.linalg.det(matrix) - 1) < 1e-10
    assert np.abs(matrix - np.eye(6)).max() > 0.1


def test_leapfrog_preserves_volume_on_a_nonlinear_potential():
    rng = np.random.default_rng(3)
    point = rng.standard_normal(6) * 0.7
    flow = _flow(_quartic, 20, 0.05)
    h = 1e-5
    jacobian = np.column_stack([(flow(point + h * unit) - flow(point - h * unit)) / (2 * h)
                                for unit in np.eye(6)])
    # central differences err by O(h^2 f''') and O(U64 / h): ~1e-9 here
    assert abs(np.linalg.det(jacobian) - 1) < 1e-6
    assert np.abs(jacobian - np.eye(6)).max() > 0.1


def test_a_trajectory_that_diverges_is_rejected():
    def steep(theta):
        with np.errstate(over="ignore", invalid="ignore"):
            value = float(np.exp(theta @ theta))
            return value, 2 * theta * value

    options = HmcOptions(burn_in=0, thin=1, samples=3, trajectory_length=50.0, step_size=5.0)
    state = run_chain(steep, np.full(2, 0.5), options, seed=0)
    assert state.divergences == 3 and not state.accepted.any()
    assert np.array_equal(state.samples, np.full((3, 2), 0.5))


# ------------------------------------------------------------------ known posteriors
def _mean_and_cov_agree(draws: np.ndarray, mean: np.ndarray, cov: np.ndarray,
                        reference_error: float = 0.0, z: float = 4.5) -> None:
    """Mean and every covariance entry within ``z`` Monte Carlo standard errors (the
    chain's ESS of each functional; plus the reference's own error)."""
    d = draws.shape[1]
    centred = draws - mean
    functionals = [draws[:, i] for i in range(d)]
    targets = list(mean)
    for i in range(d):
        for j in range(i, d):
            functionals.append(centred[:, i] * centred[:, j])
            targets.append(cov[i, j])
    values = np.stack(functionals)
    ess = _ess(values[:, None, :])
    assert (ess > 50).all(), ess
    estimates = values.mean(axis=1)
    errors = np.sqrt(values.var(axis=1) / ess + reference_error ** 2)
    assert (np.abs(estimates - np.array(targets)) <= z * errors).all(), (estimates, targets)


def test_samples_of_a_correlated_gaussian():
    cov = np.array([[1.0, 0.8], [0.8, 1.5]])
    mean = np.array([1.0, -2.0])
    centred = _gaussian(cov)

    def potential(theta):
        return centred(theta - mean)

    options = HmcOptions(burn_in=200, thin=1, samples=3000, trajectory_length=1.5)
    state = run_chain(potential, np.zeros(2), options, seed=11)
    assert state.samples.shape == (3000, 2)
    _mean_and_cov_agree(state.samples, mean, cov)


def _logistic_problem():
    rng = np.random.default_rng(7)
    n, d, prior = 60, 3, 1.0
    x = np.column_stack([np.ones(n), rng.standard_normal((n, d - 1))])
    y = (rng.random(n) < 1 / (1 + np.exp(-(x @ np.array([0.5, 1.5, -1.0]))))).astype(float)

    def potential(theta):
        z = x @ theta
        value = float(np.logaddexp(0, z).sum() - y @ z + 0.5 * prior * theta @ theta)
        return value, x.T @ (1 / (1 + np.exp(-z)) - y) + prior * theta

    return potential, x, y, prior


def _importance_reference(potential, x, y, prior, draws=400_000):
    """Mean and covariance of the logistic posterior by self-normalised importance
    sampling from its Laplace approximation, covariance inflated 1.5x (independent draws,
    exact in the limit); and a standard error of the estimates."""
    theta = np.zeros(x.shape[1])
    for _ in range(50):  # Newton to the mode
        _, grad = potential(theta)
        p = 1 / (1 + np.exp(-(x @ theta)))
        hessian = x.T @ (x * (p * (1 - p))[:, None]) + prior * np.eye(x.shape[1])
        theta = theta - np.linalg.solve(hessian, grad)
    proposal = 1.5 * np.linalg.inv(hessian)
    rng = np.random.default_rng(99)
    points = rng.multivariate_normal(theta, proposal, size=draws)
    z = points @ x.T
    log_target = -(np.logaddexp(0, z).sum(1) - z @ y
                   + 0.5 * prior * (points ** 2).sum(1))
    delta = points - theta
    log_proposal = -0.5 * np.einsum("ni,ij,nj->n", delta, np.linalg.inv(proposal), delta)
    log_w = log_target - log_proposal
    w = np.exp(log_w - log_w.max())
    w /= w.sum()
    mean = w @ points
    cov = (points - mean).T @ ((points - mean) * w[:, None])
    ess = 1 / (w ** 2).sum()
    return mean, cov, ess


def test_samples_of_bayesian_logistic_regression():
    potential, x, y, prior = _logistic_problem()
    mean, cov, ess = _importance_reference(potential, x, y, prior)
    assert ess > 100_000  # the proposal covers the posterior
    options = HmcOptions(burn_in=200, thin=1, samples=3000, trajectory_length=1.0)
    state = run_chain(potential, np.zeros(3), options, seed=5)
    reference_error = float(np.sqrt(np.diag(cov)).max() / math.sqrt(ess))
    _mean_and_cov_agree(state.samples, mean, cov, reference_error)
    # a chain from the wrong distribution fails the same check (the test can fail)
    with pytest.raises(AssertionError):
        _mean_and_cov_agree(state.samples * 1.3, mean, cov, reference_error)


def test_dual_averaging_reaches_the_target_acceptance():
    sd = np.linspace(0.5, 1.0, 50)
    precision = 1 / sd ** 2

    def potential(theta):
        return 0.5 * float(theta @ (precision * theta)), precision * theta

    for target in (0.65, 0.8):
        options = HmcOptions(burn_in=400, thin=1, samples=600, trajectory_length=1.5,
                             target_accept=target)
        state = run_chain(potential, np.zeros(50), options, seed=3)
        summary = chain_summary(state, options)
        assert abs(summary["burn_in_acceptance_rate"] - target) < 0.05, summary
        # the frozen step is the iterates' average, a little below their spread:
        # Stan's known overshoot of a few hundredths
        assert target - 0.05 < summary["acceptance_rate"] < target + 0.12, summary
        assert np.all(state.step_sizes[options.burn_in:] == state.step_size)


def test_dual_averaging_moves_the_step_the_right_way():
    adaptation = DualAveraging.start(0.1, 0.8)
    adaptation.update(0.0)
    low = adaptation.log_step
    adaptation = DualAveraging.start(0.1, 0.8)
    adaptation.update(1.0)
    assert adaptation.log_step > low


def test_e_bfmi_is_betancourts_ratio():
    energies = np.array([1.0, 3.0, 2.0, 5.0])
    expected = (4 + 1 + 9) / float(((energies - energies.mean()) ** 2).sum())
    assert e_bfmi(energies) == pytest.approx(expected, rel=8 * U64)
    assert math.isnan(e_bfmi(np.ones(5)))


# ------------------------------------------------------------------ kill and resume
_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_method_hmc import _logistic_problem
    from train_zoo.methods.hmc_sampler import HmcOptions, run_chain
    potential, *_ = _logistic_problem()

    def slow(theta):
        time.sleep(0.002)
        return potential(theta)

    options = HmcOptions(burn_in=5, thin=2, samples=6, trajectory_length=1.0)
    run_chain(slow, np.zeros(3), options, seed=21, path={path!r}, key="k")
""")

_OPTIONS = HmcOptions(burn_in=5, thin=2, samples=6, trajectory_length=1.0)


def _assert_same(a, b) -> None:
    for name in ("theta", "grad", "samples", "accept_probs", "accepted", "energies",
                 "leapfrog_steps", "step_sizes"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert (a.iteration, a.step_size, a.rng_state, a.potential) == (
        b.iteration, b.step_size, b.rng_state, b.potential)
    assert a.adaptation == b.adaptation


def test_a_chain_killed_midway_resumes_bit_identically(tmp_path):
    potential, *_ = _logistic_problem()
    whole = run_chain(potential, np.zeros(3), _OPTIONS, seed=21)
    path = tmp_path / "chain.npz"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(
        tests=str(ROOT / "tests"), path=str(path))], env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if path.exists():
                try:
                    if load_state(path).iteration >= 3:
                        break
                except (OSError, ValueError, KeyError):
                    pass  # not there yet
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    killed_at = load_state(path).iteration
    assert 3 <= killed_at < _OPTIONS.iterations
    resumed = run_chain(potential, np.zeros(3), _OPTIONS, seed=21, path=path, key="k")
    _assert_same(resumed, whole)
    assert not list(tmp_path.glob(".chain.npz.*.tmp"))  # no leftover half-written file


def test_a_chain_stopped_and_reloaded_continues_bit_identically(tmp_path):
    potential, *_ = _logistic_problem()
    whole = run_chain(potential, np.zeros(3), _OPTIONS, seed=21)
    path = tmp_path / "chain.npz"
    for _ in range(6):  # 3 iterations at a time, a fresh load each time
        part = run_chain(potential, np.zeros(3), _OPTIONS, seed=21, path=path, key="k",
                         stop_after=3)
    _assert_same(part, whole)
    _assert_same(load_state(path), whole)
    # a state of another problem (another key) is started over, not resumed
    other = run_chain(potential, np.ones(3), _OPTIONS, seed=21, path=path, key="other")
    assert not np.array_equal(other.samples, whole.samples)


def test_the_state_file_holds_no_pickle(tmp_path):
    potential, *_ = _logistic_problem()
    path = tmp_path / "chain.npz"
    run_chain(potential, np.zeros(3), _OPTIONS, seed=1, path=path, stop_after=2)
    with np.load(path, allow_pickle=False) as stored:
        assert all(stored[name].dtype != object for name in stored.files)


# ------------------------------------------------------------------ through the trainer
def _digits_spec():
    from train_zoo import make_spec

    return make_spec("optunet-mnist", dataset="digits", base_seed=3, method="hmc", modes=2,
                     samples_per_mode=3, recipe_overrides={"epochs": 2},
                     method_options={"burn_in": 3, "thin": 1, "trajectory_length": 0.004,
                                     "step_size": 4e-4, "start": "base"})


def test_a_digits_run_records_its_chains(tmp_path):
    from train_zoo import train_checkpoints

    spec = _digits_spec()
    results = train_checkpoints(spec, [0, 1], progress=tmp_path)
    assert [r.chain for r in results] == [0, 0, 0, 1, 1, 1]
    assert [r.index for r in results] == [0, 0, 0, 1, 1, 1]
    record = results[0].record
    (chain,) = record["chains"]
    assert chain["chain"] == 0 and chain["samples"] == 3 and chain["iterations"] == 6
    assert 0 <= chain["acceptance_rate"] <= 1 and chain["leapfrog_steps"] >= 1
    assert record["prior_precision"] == pytest.approx(spec.recipe.weight_decay
                                                      * _train_size(spec))
    states = [np.concatenate([np.ravel(v) for v in r.state.values()])
              for r in results]
    assert all(np.isfinite(s).all() for s in states)
    assert np.abs(states[0] - states[3]).max() > 0.01  # different modes
    assert (tmp_path / "mode-0" / "hmc-chain.npz").exists()
    # the chain's saved state is resumed: the same samples again, without sampling
    again = train_checkpoints(spec, [0], progress=tmp_path)
    for first, second in zip(results[:3], again, strict=True):
        for name, value in first.state.items():
            assert np.array_equal(value, second.state[name])


def _train_size(spec) -> int:
    from train_zoo.data import load_training_data

    return len(load_training_data(spec.dataset).train)


def test_the_collection_run_removes_its_progress_folder(tmp_path):
    from posteriorzoo.zoo import open_zoo
    from train_zoo.backends import SerialBackend
    from train_zoo.run import progress_folder, train_collection

    spec = _digits_spec()
    out = tmp_path / "hmc.h5"
    train_collection(spec, out, backend=SerialBackend(), progress=False)
    assert not progress_folder(out).exists()
    assert progress_folder(out) == tmp_path / ".hmc.h5.progress"
    with open_zoo(out) as zoo:
        assert list(np.asarray(zoo.metadata["chain"])) == [0, 0, 0, 1, 1, 1]
        assert set(zoo.training_records()) == {0, 1}


# ------------------------------------------------------------------ the dry run's estimate
def _spec_with(**options):
    from train_zoo import make_spec

    return make_spec("optunet-mnist", dataset="digits", base_seed=3, method="hmc", modes=2,
                     samples_per_mode=4, recipe_overrides={"epochs": 1},
                     method_options={"burn_in": 3, "thin": 2, "start": "base", **options})


def test_phase_steps_are_each_iterations_leapfrog_gradients():
    from train_zoo.methods import hmc
    from train_zoo.methods.hmc import ASSUMED_LEAPFROG_STEPS, METHOD

    # 1 start + 3 burn-in + 4 x 2 kept iterations of ceil(0.5 / 0.0625) = 8 steps
    spec = _spec_with(trajectory_length=0.5, step_size=0.0625)
    assert METHOD.phase_steps(spec, 22) == 1 + (3 + 8) * 8
    spec = _spec_with(trajectory_length=0.5, step_size=0.0625, max_leapfrog_steps=5)
    assert METHOD.phase_steps(spec, 22) == 1 + (3 + 8) * 5
    # a step far below the trajectory: the burn-in's cap of 1,024, then L itself
    spec = _spec_with(trajectory_length=3_000.0, step_size=1.0)
    assert METHOD.phase_steps(spec, 22) == 1 + 3 * 1_024 + 8 * 3_000
    # no step size: the assumption, under the caps
    assert ASSUMED_LEAPFROG_STEPS == HmcOptions.burn_in_leapfrog_steps == 1_024
    assert METHOD.phase_steps(_spec_with(mass="identity"), 22) == 1 + 11 * 1_024
    spec = _spec_with(max_leapfrog_steps=300, mass="identity")
    assert METHOD.phase_steps(spec, 22) == 1 + 11 * 300
    # the default trajectory with the identity, pi / 2 / sqrt(N weight_decay), with
    # N = 22 x 64 = 1,408
    for step in (0.01, 0.001):
        spec = _spec_with(step_size=step, mass="identity")
        length = math.pi / 2 / math.sqrt(1_408 * spec.recipe.weight_decay)
        steps = math.ceil(length / step)
        assert METHOD.phase_steps(spec, 22) == 1 + 3 * min(steps, 1_024) + 8 * steps
    assert steps > 1_024  # the second: the burn-in's cap applies
    # with the diagonal Laplace mass: pi / 2 in the chain's coordinates
    spec = _spec_with(step_size=0.1, mass="laplace-diag")
    assert METHOD.phase_steps(spec, 22) == 1 + 11 * math.ceil(math.pi / 2 / 0.1)
    # no step size: the reference recipe's adapted step under that mass
    spec = _spec_with(mass="laplace-diag")
    assert METHOD.phase_steps(spec, 22) == 1 + 11 * math.ceil(
        math.pi / 2 / hmc.ASSUMED_PRECONDITIONED_STEP)
    # the MAP search's budget comes first
    spec = _spec_with(step_size=0.1, start="map", map_iterations=50)
    assert METHOD.phase_steps(spec, 22) == 52 + 1 + 11 * math.ceil(math.pi / 2 / 0.1)


def test_every_full_data_gradient_is_a_reported_step():
    """Without burn-in and with a given step size the chain's gradients are exactly
    phase_steps: each reported as a step of phase ``hmc`` with U / N as its loss."""
    from train_zoo.data import load_training_data
    from train_zoo.methods.hmc import METHOD
    from train_zoo.programs import produce_mode

    spec = _spec_with(burn_in=0, thin=1, trajectory_length=0.003, step_size=5e-4)
    data = load_training_data(spec.dataset)

    class Steps:
        def __init__(self):
            self.infos: list = []
            self.weights: list = []

        def on_step_end(self, info, weights):
            if info.phase == "hmc":
                self.infos.append(info)
                self.weights.append({k: np.array(v) for k, v in weights.items()})

    steps = Steps()
    results = produce_mode(spec, 0, data, "auto", [steps])
    per_epoch = math.ceil(len(data.train) / spec.recipe.batch_size)
    (chain,) = results[0].record["chains"]
    assert chain["divergences"] == 0
    assert len(steps.infos) == METHOD.phase_steps(spec, per_epoch) == 1 + 4 * 6
    assert len(steps.infos) == 1 + chain["gradient_evaluations"]
    assert [info.step for info in steps.infos] == list(range(1, len(steps.infos) + 1))
    assert all(info.index == 0 and math.isfinite(info.loss) for info in steps.infos)
    # each sample is the state its iteration ended in: one of the reported points
    for result in results:
        assert any(all(np.array_equal(w[k], result.state[k]) for k in w)
                   for w in steps.weights)


def test_the_dry_run_times_a_few_gradients_and_counts_the_chains(tmp_path, capsys,
                                                                monkeypatch):
    """The dry run times some of the chain's gradients and stops (a burn-in of 10,000
    iterations is not run), then extrapolates to modes x phase_steps."""
    from zoo_helpers import run as run_cli

    from posteriorzoo.cli import train_command
    from train_zoo.methods import hmc

    calls = []
    original = hmc.kernel_potential

    def counted(*args, **kwargs):
        potential = original(*args, **kwargs)
        return lambda theta: calls.append(1) or potential(theta)

    monkeypatch.setattr(hmc, "kernel_potential", counted)
    spec = tmp_path / "hmc.toml"
    spec.write_text('recipe = "optunet-mnist"\ndataset = "digits"\nmethod = "hmc"\n'
                    'modes = 2\nsamples_per_mode = 5\n\n[recipe_overrides]\nepochs = 1\n'
                    '\n[method_options]\nburn_in = 10000\nthin = 3\n'
                    'trajectory_length = 0.01\nstep_size = 0.001\n')
    code, stdout, err = run_cli(capsys, "train", spec, "--dry-run", "--json",
                                "--backend", "serial")
    assert code == 0, err
    part = {p["phase"]: p for p in json.loads(stdout)["estimate"]["parts"]}["hmc"]
    # the MAP search's budget (the default 10,000 iterations and the potential before and
    # after), the start's gradient, then the iterations
    assert part["steps"] == 2 * (10_002 + 1 + (10_000 + 15) * 10)
    assert 1 <= part["timed_steps"] <= train_command.TIMED_STEPS
    assert part["seconds_per_step"] > 0
    assert part["seconds"] == part["steps"] * part["seconds_per_step"]
    # the method's own timing run, and the base network's, which ends at the first
    # gradient of the phase after it
    assert len(calls) <= train_command.WARM_UP_STEPS + train_command.TIMED_STEPS + 2


# ------------------------------------------------------------------ NUTS oracle
_HIDDEN = 3


def _mlp_problem():
    """A tanh network 2-3-1 on 20 points with a N(0, 1) prior: 13 weights."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((20, 2))
    y = (np.sin(2 * x[:, 0]) + x[:, 1] > 0).astype(float)
    grid = rng.standard_normal((6, 2))
    h = _HIDDEN

    def unpack(t):
        return t[:2 * h].reshape(2, h), t[2 * h:3 * h], t[3 * h:4 * h], t[4 * h]

    def logits(t, inputs):
        w, b, v, c = unpack(t)
        return np.tanh(inputs @ w + b) @ v + c

    def potential(t):
        w, b, v, c = unpack(t)
        hidden = np.tanh(x @ w + b)
        z = hidden @ v + c
        dz = 1 / (1 + np.exp(-z)) - y
        dh = np.outer(dz, v) * (1 - hidden ** 2)
        grad = np.concatenate([(x.T @ dh).ravel(), dh.sum(0), hidden.T @ dz, [dz.sum()]])
        return float(np.logaddexp(0, z).sum() - y @ z + 0.5 * t @ t), grad + t

    return x, y, grid, logits, potential


def test_a_small_network_agrees_with_numpyros_nuts():
    """The posterior predictive of a small tanh network (its weights' moments are not
    identifiable: sign flips and permutations of the hidden units give the same function)
    from 10 HMC chains and 10 NUTS chains, each chain's mean an independent replicate:
    the two means agree within 5 standard errors of their difference."""
    pytest.importorskip("numpyro")
    import jax
    import jax.numpy as jnp
    import numpyro
    from numpyro.infer import MCMC, NUTS

    numpyro.enable_x64()
    x, y, grid, logits, potential = _mlp_problem()
    size, chains = 4 * _HIDDEN + 1, 10

    def model():
        t = numpyro.sample("t", numpyro.distributions.Normal(0, 1).expand([size]).to_event(1))
        h = _HIDDEN
        z = jnp.tanh(x @ t[:2 * h].reshape(2, h) + t[2 * h:3 * h]) @ t[3 * h:4 * h] + t[4 * h]
        numpyro.sample("y", numpyro.distributions.Bernoulli(logits=z), obs=y)

    mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=1000, num_chains=chains,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0))
    nuts = np.asarray(mcmc.get_samples(group_by_chain=True)["t"])

    def predictive(samples):
        return (1 / (1 + np.exp(-np.stack([logits(t, grid) for t in samples])))).mean(0)

    start = np.random.default_rng(4).standard_normal(size) * 0.5
    options = HmcOptions(burn_in=300, thin=1, samples=1000, trajectory_length=1.5)
    ours = np.stack([predictive(run_chain(
        potential, start + 0.1 * np.random.default_rng(k).standard_normal(size), options,
        seed=k).samples) for k in range(chains)])
    theirs = np.stack([predictive(chain) for chain in nuts])
    error = np.sqrt(ours.var(0, ddof=1) / chains + theirs.var(0, ddof=1) / chains)
    assert (np.abs(ours.mean(0) - theirs.mean(0)) <= 5 * error).all(), (ours.mean(0),
                                                                        theirs.mean(0))
    assert (error < 0.01).all()  # precise enough to tell a wrong sampler


# ------------------------------------------------------------------ start and mass matrix
def test_the_map_start_is_the_mode_of_a_gaussian(tmp_path):
    """On U = (x - m)' A (x - m) / 2 the search ends at m (L-BFGS on a quadratic: to its
    gradient tolerance, far below the posterior's sd), and a saved start is reused."""
    from train_zoo.methods.hmc_start import chain_start

    rng = np.random.default_rng(4)
    q = rng.normal(size=(6, 6))
    precision, mean = q @ q.T + 6 * np.eye(6), rng.normal(size=6)
    calls = []

    def potential(theta):
        calls.append(1)
        delta = theta - mean
        return 0.5 * float(delta @ precision @ delta), precision @ delta

    def diagonal(theta):
        return np.diag(precision).copy()

    found, scales, info = chain_start(potential, np.zeros(6), map_iterations=200,
                                      precision=diagonal, path=tmp_path / "s.npz", key="k")
    sd = np.sqrt(np.diag(np.linalg.inv(precision)))
    assert np.abs(found - mean).max() < 1e-4 * sd.min()
    search = info["map_search"]
    assert search["potential_map"] < 1e-8 < search["potential_start"]
    assert search["evaluations"] == len(calls)
    np.testing.assert_array_equal(scales, 1 / np.sqrt(np.diag(precision)))
    again, same_scales, same = chain_start(potential, np.zeros(6), map_iterations=200,
                                           precision=diagonal, path=tmp_path / "s.npz",
                                           key="k")
    assert np.array_equal(again, found) and np.array_equal(same_scales, scales)
    assert same == info and len(calls) == search["evaluations"]   # read back
    chain_start(potential, np.ones(6), map_iterations=200, precision=None,
                path=tmp_path / "s.npz", key="j")
    assert len(calls) > search["evaluations"]    # another key: searched again
    with pytest.raises(ValueError, match="positive and finite"):
        chain_start(potential, np.zeros(6), map_iterations=None,
                    precision=lambda theta: -np.ones(6))


def test_the_map_start_never_starts_higher_than_the_network():
    from train_zoo.methods.hmc_start import map_start

    def upside_down(theta):     # no minimum: the search can only make things worse
        return -float(theta @ theta), -2 * theta

    start = np.full(3, 0.5)
    found, search = map_start(upside_down, start, 5)
    assert search["potential_map"] <= search["potential_start"]
    assert upside_down(found)[0] <= upside_down(start)[0]


def test_a_diagonal_mass_is_a_change_of_variables():
    """Identity-mass leapfrog on z = theta / s is leapfrog with M = diag(1 / s^2) on theta:
    the same trajectory as the mass-matrix equations written out here."""
    from train_zoo.methods.hmc_start import preconditioned

    rng = np.random.default_rng(7)
    a = rng.normal(size=(4, 4))
    precision = a @ a.T + np.diag([100.0, 1.0, 0.01, 5.0])

    def potential(theta):
        return 0.5 * float(theta @ precision @ theta), precision @ theta

    scales = np.array([0.1, 1.0, 7.0, 0.5])
    theta0, p0 = rng.normal(size=4), rng.normal(size=4)   # p0: z's momentum
    step, steps = 0.05, 9
    z_end, pz_end, value, _, _ = leapfrog(theta0 / scales, p0, scales * potential(theta0)[1],
                                          step, steps, preconditioned(potential, scales))
    # the same with the mass M = diag(1 / s^2) on theta: momentum p = p0 / s, velocity
    # M^-1 p = s^2 p
    theta, p = theta0.copy(), p0 / scales
    grad = potential(theta)[1]
    for _ in range(steps):
        p = p - 0.5 * step * grad
        theta = theta + step * scales ** 2 * p
        grad = potential(theta)[1]
        p = p - 0.5 * step * grad
    # both: 9 steps of O(1) arithmetic in float64 on O(10) values (gamma(100, U64))
    np.testing.assert_allclose(scales * z_end, theta, rtol=0, atol=gamma(100, U64) * 1e3)
    np.testing.assert_allclose(pz_end, scales * p, rtol=0, atol=gamma(100, U64) * 1e3)
    assert value == pytest.approx(potential(theta)[0], rel=1e-12)


def test_samples_with_a_diagonal_mass_have_the_posteriors_moments():
    """A Gaussian whose scales differ by 100: the preconditioned chain's samples, scaled
    back, have its mean and variances within Monte Carlo error."""
    from train_zoo.methods.hmc_start import preconditioned

    variances = np.array([1e-4, 1e-2, 1.0])
    mean = np.array([0.3, -1.0, 2.0])

    def potential(theta):
        delta = theta - mean
        return 0.5 * float(delta @ (delta / variances)), delta / variances

    scales = np.sqrt(variances) * np.array([1.3, 0.8, 1.1])   # a rough diagonal
    options = HmcOptions(burn_in=200, thin=1, samples=3000, trajectory_length=np.pi / 2,
                         step_size=0.3, target_accept=0.8)
    state = run_chain(preconditioned(potential, scales), mean / scales, options, seed=11)
    samples = state.samples * scales
    assert state.leapfrog_steps[-1] <= 12    # a unit-scale trajectory: a few steps
    ess = 3000 / 3            # conservative: leapfrog on a Gaussian mixes within ~3 draws
    # Each of the six checks is 5 standard errors wide: under a normal approximation of
    # the estimators a correct sampler fails one with probability below 6 x 5.7e-7 (the
    # seed is fixed, so the run is deterministic: this bounds how unlucky it may be).
    error = np.sqrt(variances / ess)
    assert np.all(np.abs(samples.mean(0) - mean) < 5 * error)
    assert np.all(np.abs(samples.var(0) / variances - 1) < 5 * np.sqrt(2 / ess))


def test_a_digits_chain_starts_at_its_networks_nearest_mode(tmp_path):
    from train_zoo import make_spec, train_checkpoints
    from train_zoo.methods import hmc_start

    spec = make_spec("optunet-mnist", dataset="digits", base_seed=3, method="hmc", modes=1,
                     samples_per_mode=2, recipe_overrides={"epochs": 2},
                     method_options={"burn_in": 1, "thin": 1, "trajectory_length": 0.004,
                                     "step_size": 4e-4, "map_iterations": 300})
    assert spec.method_options["start"] == "map"              # the defaults
    assert spec.method_options["mass"] == "laplace-diag"
    results = train_checkpoints(spec, [0], progress=tmp_path)
    record = results[0].record
    search = record["map_search"]
    assert record["start"] == "map" and record["mass"]["scales"]["min"] > 0
    # the mode lies below the trained network: the network's loss plus its prior, far
    # above what a few hundred full-batch L-BFGS steps reach on 1,400 digits
    assert search["potential_map"] < 0.9 * search["potential_start"]
    assert 0 < search["iterations"] <= 300
    assert search["evaluations"] <= 300 + hmc_start.MAP_LINE_SEARCH + 2
    # the scales are the diagonal Laplace precision's: no weight looser than the prior
    prior = record["prior_precision"]
    assert record["mass"]["scales"]["max"] <= 1 / np.sqrt(prior) * (1 + 1e-12)
    assert (tmp_path / "mode-0" / "hmc-start.npz").exists()
    again = train_checkpoints(spec, [0], progress=tmp_path)      # resumed, same start
    for name, value in results[0].state.items():
        assert np.array_equal(value, again[0].state[name])
