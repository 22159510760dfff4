"""The trainer produces every method's samples as checkpoints of the base architecture.

Per method (on digits, tiny settings): the samples of a mode are what the method's pieces
give for that mode's base network; the torch and numba engines run the same program; a
collection holds whole modes with ``mode_id`` / ``sample_id``; a run killed between modes
resumes to the same bytes as an uninterrupted one; ResNet-18 (BatchNorm) works too.

Tolerances. Where two results come from the same program on the same values in this
process (the trainer's samples against the method's pieces re-run here; each engine's
samples against the method's program applied to that engine's phases) they are compared
bit for bit: the same floating-point operations on the same values round the same way on
any CPU. The two engines' runs differ by rounding: they are compared step by step, each
step within a bound derived from the float32 unit roundoff and the lengths of its
reductions (``tests/rounding_bounds.py``; the section "the fast engine's program, step by
step" says how, and each helper what it measured, on this host and under make
test-avx2's settings). A step whose batch holds a decision within rounding of switching
may part the runs on another CPU; the checks allow it, each being conditional on the
states the runs had.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from rounding_bounds import (
    U32,
    U64,
    cross_entropy_bound,
    cross_entropy_rounding,
    follow_sgd,
    gamma,
    model_at,
    optunet_forward_bounds,
    optunet_gradient_terms,
)
from torch.func import functional_call

from posteriorzoo.collection import verify
from posteriorzoo.data import ArrayDataset
from posteriorzoo.models import build
from posteriorzoo.zoo import open_zoo
from train_zoo import checkpoint_seeds, make_spec, train_checkpoints
from train_zoo.backends import SerialBackend
from train_zoo.data import TrainingData, load_training_data
from train_zoo.methods import bbb, dropout, laplace, sghmc, swag
from train_zoo.methods.base import generator_for
from train_zoo.methods.common import flatten, parameters_of, unflatten
from train_zoo.programs import ModeEngine
from train_zoo.run import train_collection
from train_zoo.torch_engine import initial_model, torch_batches, torch_log_posterior
from train_zoo.torch_engine import train_base as torch_train_base

TRAIN = [sys.executable, "-m", "posteriorzoo", "train"]
METHOD_OPTIONS = {
    "swag": {"epochs": 3, "iterates": 3, "ramp_epochs": 1},
    "sghmc": {"burn_in": 10, "thin": 4, "preconditioner": "none"},
}
METHODS = ["de", "mc-dropout", "swag", "laplace", "sghmc", "bbb"]


def digits_spec(method: str, modes: int = 2, samples: int = 3, **fields):
    return make_spec("optunet-mnist", dataset="digits", method=method, modes=modes,
                     samples_per_mode=1 if method == "de" else samples, base_seed=5,
                     recipe_overrides={"epochs": 1},
                     method_options=METHOD_OPTIONS.get(method, {}), **fields)


@pytest.fixture(scope="module")
def digits():
    return load_training_data("digits")


def _stack(results, key):
    return np.stack([r.state[key] for r in results])


@pytest.mark.parametrize("method", METHODS)
def test_a_mode_is_samples_of_the_base_architecture(method, digits):
    spec = digits_spec(method)
    results = train_checkpoints(spec, [1], data=digits, engine="torch")
    assert [(r.index, r.sample) for r in results] == [(1, s) for s in
                                                      range(spec.samples_per_mode)]
    base = build("optunet")  # the stored architecture: no dropout layer
    for result in results:
        base.load_state_dict({k: torch.from_numpy(v) for k, v in result.state.items()})
        assert result.seeds == checkpoint_seeds(5, 1)
        assert np.isfinite(result.metrics["test_loss"])
    if spec.samples_per_mode > 1:  # the draws differ
        assert not np.array_equal(_stack(results, "fc.weight")[0],
                                  _stack(results, "fc.weight")[1])


# ------------------------------------------------- the fast engine's program, step by step
# A method's mode is one program on both engines; an engine supplies only the base
# network's SGD steps (numba kernels or torch.optim) and the method phase's gradients
# (SWAG's SGD steps, SGHMC's log-posterior gradient, BBB's ELBO gradient). Everything else
# (Laplace's fit, SWAG's moments, the chains' and BBB's updates, the draws) is the same
# Python and torch code, and :func:`test_the_fast_engine_runs_the_same_program` checks
# that each engine's samples are it, bit for bit, applied to what that engine's phases
# produced (the same float64 arithmetic on the same values in this process).
#
# The runs are compared step by step, from what each had before the step, as
# ``rounding_bounds.compare_runs`` compares SGD runs: the step's change of the two runs'
# difference, less the part that the difference of their states explains (computed with
# torch's own program at both states, which reproduces the torch run's step), must lie
# within the rounding bound of the engine's piece at run a's state (Higham's
# ``gamma(k) = k u / (1 - k u)`` for a k-term sum in any order, ``u = 2^-24``: the
# gradient's ``gamma(k)`` of its scale, ``rounding_bounds.gradient_rtol``), plus one
# rounding of each side's update. (The SGD phases follow ``compare_runs`` exactly: there
# the state difference's part, ``lr H dw`` at rounding-sized ``dw``, is left inside the
# bound.) A step whose batch has a ReLU or max-pool decision within its bound of
# switching (``near_switch``) may route a gradient differently on another CPU: it is
# excused, and the runs continue from the states each reached. Training is chaotic
# there, so from such a step on the samples may differ by more than rounding, bit for bit
# differently on every CPU; every check here allows that, as each one is conditional on
# the states each run had (the samples' bounds on the phases' measured difference).
# Measured: no step excused, on this host (AVX-512) or under make test-avx2's settings.
# Each helper's docstring gives its largest residual over its bound, host / AVX2, and
# what a wrong gradient or seed would make of it.
class _Recorder:
    """Every step of every phase: ``(index, epoch, step, lr, phase)``, the loss, the
    weights after it, and what ``probe(info)`` reads of the stepper (or None)."""

    def __init__(self, probe=None) -> None:
        self.info: list = []
        self.weights: list[dict[str, np.ndarray]] = []
        self.probes: list = []
        self.probe = probe

    def on_step_end(self, info, weights) -> None:
        self.info.append(info)
        self.weights.append({key: value.copy() for key, value in weights.items()})
        self.probes.append(self.probe(info) if self.probe else None)

    def phase(self, name: str) -> list[int]:
        return [i for i, info in enumerate(self.info) if info.phase == name]

    def steps(self, name: str) -> list[tuple]:
        return [(i.index, i.epoch, i.step, i.lr, i.loss) for i in self.info if i.phase == name]


def _tensors(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.asarray(value)) for key, value in state.items()}


def _max(value) -> float:
    return float(np.abs(np.asarray(value, dtype=np.float64)).max())


_TERMS: dict[tuple, int] = {}


def _gradient_terms(model, images: torch.Tensor) -> int:
    """``optunet_gradient_terms`` (a function of the batch's and layers' shapes alone),
    once per shape."""
    key = (tuple(images.shape), *(tuple(value.shape) for value in model.parameters()))
    if key not in _TERMS:
        _TERMS[key] = optunet_gradient_terms(model, images)
    return _TERMS[key]


def _logits64(model, images: torch.Tensor) -> torch.Tensor:
    """The network's logits in float64 arithmetic on its float32 weights (the values
    ``optunet_forward_bounds`` takes as the exact ones)."""
    params = {name: value.detach().double() for name, value in model.named_parameters()}
    with torch.no_grad():
        return functional_call(model, params, (images.double(),))


def _loss_ratio(residual: float, model, images: torch.Tensor, delta=None,
                more: float = 0.0) -> float:
    """``residual`` over the bound on two implementations' mean cross-entropy of ``model``
    on ``images`` (weights ``delta`` apart; ``more`` added to the bound). The bound's
    second term alone (``cross_entropy_rounding`` of the float64 logits) is tried first,
    and the whole ``cross_entropy_bound`` (the float64 forward bounds, most of this
    module's time) only when the residual exceeds it: the ratio returned is at least the
    ratio to the whole bound."""
    cheap = cross_entropy_rounding(_logits64(model, images).float()) + more
    if residual <= cheap:
        return residual / cheap
    return residual / (cross_entropy_bound(model, images, delta) + more)


def _log_posterior_rounding(model, images, params: dict, grads: dict, num_data: int,
                            prior: float) -> dict[str, float]:
    """Per tensor, how far the two engines' SGHMC gradients ``-(N dL/dw + prior w)`` at
    the same float32 ``params`` may be apart (``grads``: torch's): ``N`` times the mean
    cross-entropy's gradient tolerance (``gradient_rtol``'s count, plus 2 for the scalar
    factors folded into the backward pass) of its scale, plus three roundings of the
    result (``N g``, ``prior w`` and their sum) on each side."""
    rtol = gamma(_gradient_terms(model, images) + 2)
    bound = {}
    for key, value in params.items():
        w = value.double().abs()
        ce = (-(grads[key].double()) - prior * value.double()) / num_data
        bound[key] = (num_data * rtol * float(ce.abs().max())
                      + 2 * 3 * U32 * float((num_data * ce.abs() + prior * w).max()))
    return bound


def _prior_rounding(params: dict, loss: float, num_data: int, prior: float) -> float:
    """The SGHMC steppers' loss is ``mean CE + prior ||w||^2 / (2 N)``: besides the
    cross-entropy's bound (:func:`_loss_ratio`), torch's float32 ``N CE + prior / 2
    ||w||^2`` (a product, a sum of squares over every weight and its factors, one sum),
    over ``N``; the kernels sum the squares in float64."""
    squares = sum(float(value.double().square().sum()) for value in params.values())
    size = sum(value.numel() for value in params.values())
    prior_term = 0.5 * prior * squares
    return (U32 * num_data * abs(loss) + (gamma(size + 2) + U32) * prior_term
            + U32 * (num_data * abs(loss) + prior_term)) / num_data


def _chain_batches(data, recipe, seed: int, batch_size: int, replacement: bool):
    """SGHMC's minibatches: the torch engine's, epoch after epoch."""
    source = torch_batches(data, dataclasses.replace(recipe, batch_size=batch_size), seed,
                           replacement=replacement)
    return (batch for epoch in itertools.count() for batch in source(epoch))


def _follow_plain_chain(spec, data, base_a: dict, base_b: dict, log_a: _Recorder,
                        log_b: _Recorder) -> tuple[list[int], float]:
    """The plain SGHMC chain (``v' = (1 - alpha) v + eta G + n``, ``w' = w + v'``, float32)
    of the two runs, step by step. Both draw the same noise ``n`` (the generator of the
    mode's sample seed; ``beta_hat`` is not used before ``NOISE_WARM_UP`` steps), so with
    ``D_k`` the difference of the runs' steps ``w_k - w_(k-1)`` (exact in float64; each
    within ``u |w_k|`` of its ``v_k``),

        D_k - (1 - alpha) D_(k-1) - eta [G_t(w_a) - G_t(w_b)]
            = eta [G_f(w_a) - G_t(w_a)] + roundings,

    ``G_t`` torch's gradient (the torch run's, recomputed), ``G_f`` the kernels'. The right
    side: ``eta`` times :func:`_log_posterior_rounding`, each side's ``v'`` (``3 u ((1 -
    alpha) |v| + eta |G|) + u |v'|``) and the four steps' ``u |w|``. Measured: 0.16 / 0.32
    of it (3-5e-8: float32's rounding of the weights). ``eta |G|`` is 2e-6 to 2e-5 per
    step, so a gradient wrong by its own size exceeds the bound 50-500-fold; one off by
    less than about 2% of it (the prior's ``prior w`` is 6e-4 to 6e-3 of ``N g`` here)
    hides below float32's resolution of the weights, and the loss check (the prior's 8e-4
    nats against a bound of at most 2.2e-4) is what sees such a term."""
    recipe, seeds, num_data = spec.recipe, checkpoint_seeds(spec.base_seed, 0), len(data.train)
    opts = spec.method_options
    prior = sghmc.prior_precision_from_weight_decay(num_data, recipe.weight_decay)
    eta, friction = opts["lr"] / num_data, 1 - opts["alpha"]
    gradient = torch_log_posterior(initial_model(spec, seeds.init), {}, num_data, prior)
    chain_a, chain_b = log_a.phase("sghmc"), log_b.phase("sghmc")
    assert len(chain_a) <= sghmc.NOISE_WARM_UP  # the same noise on both sides throughout
    batches = _chain_batches(data, recipe, seeds.method, opts["batch_size"]
                             if opts.get("batch_size") else recipe.batch_size, False)
    before_a, before_b = base_a, base_b
    previous = {key: np.zeros_like(value, dtype=np.float64) for key, value in base_a.items()}
    steps_prev = {key: (0.0, 0.0) for key in base_a}   # |w_k - w_(k-1)| of each run
    parting, ratio = [], 0.0
    steps = zip(chain_a, chain_b, batches, strict=False)   # batches: as many as needed
    for step, (i, j, (images, labels)) in enumerate(steps, 1):
        after_a, after_b = log_a.weights[i], log_b.weights[j]
        ta, tb = _tensors(before_a), _tensors(before_b)
        loss_ta, grad_ta = gradient(ta, (images, labels))
        loss_tb, grad_tb = gradient(tb, (images, labels))
        model = model_at(spec, 0, before_a)
        rounding = _log_posterior_rounding(model, images, ta, grad_ta, num_data, prior)
        loss_residual = abs((log_a.info[i].loss - log_b.info[j].loss) - (loss_ta - loss_tb))
        worst = _loss_ratio(loss_residual, model, images,
                            more=_prior_rounding(ta, loss_ta, num_data, prior))
        excess, change = worst > 1, {}
        for key in after_a:
            w_a = after_a[key].astype(np.float64) - before_a[key]
            w_b = after_b[key].astype(np.float64) - before_b[key]
            difference = w_a - w_b
            residual = _max(difference - friction * previous[key]
                            - eta * (grad_ta[key].double() - grad_tb[key].double()).numpy())
            sides = sum(3 * U32 * (friction * (v + U32 * _max(w)) + eta * g) + U32 * (
                _max(step_w) + U32 * _max(after))
                for v, w, g, step_w, after in (
                    (steps_prev[key][0], before_a[key], _max(grad_ta[key]) + rounding[key],
                     w_a, after_a[key]),
                    (steps_prev[key][1], before_b[key], _max(grad_tb[key]), w_b,
                     after_b[key])))
            weights = U32 * (_max(after_a[key]) + _max(after_b[key]))
            if step > 1:
                weights += friction * U32 * (_max(before_a[key]) + _max(before_b[key]))
            bound = eta * rounding[key] + sides + weights
            excess = excess or residual > bound
            worst = max(worst, residual / bound)
            change[key] = difference
            steps_prev[key] = (_max(w_a), _max(w_b))
        if excess:
            assert optunet_forward_bounds(model, images).near_switch.sum() > 0, step
            parting.append(step)
        else:
            ratio = max(ratio, worst)
        previous, before_a, before_b = change, after_a, after_b
    assert step == len(chain_a) == len(chain_b)
    return parting, ratio


def _inverse(cholesky: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(len(cholesky), dtype=torch.float64)
    return torch.linalg.solve_triangular(cholesky, eye, upper=False)


def _solve_rounding(cholesky: torch.Tensor, inverse: torch.Tensor,
                    vector: torch.Tensor) -> torch.Tensor:
    """A float64 triangular solve with ``L^T`` (or a product with it) of a vector of
    magnitude ``vector``: ``gamma(d) |L^-T| |L^T| |vector|`` (Higham, Theorem 8.5)."""
    return gamma(len(cholesky), U64) * (inverse.T.abs() @ (cholesky.T.abs() @ vector.abs()))


def _draw_bound(precision_a: torch.Tensor, precision_b: torch.Tensor,
                cholesky_b: torch.Tensor, inverse_b: torch.Tensor, z: torch.Tensor) -> float:
    """A bound on ``||L_a^-T z - L_b^-T z||_2`` for the Cholesky factors ``L`` of two
    precisions ``P_a = P_b + E`` (a Laplace draw's step from the same normals ``z``).

    The standard perturbation bound (Sun 1991; Higham section 10.1): with ``M = L_b^-1 E
    L_b^-T`` and ``L_a = L_b (I + X)``, ``X`` lower triangular, ``X + X^T = M`` to first
    order, so ``||X||_F <= ||M||_F / sqrt(2)``, and ``L_a^-T z - L_b^-T z = -L_b^-T X^T z``
    to first order: at most ``||M||_F ||z||_2 / sqrt(2 lambda_min(P_b))``. With
    ``||M||_F <= ||E||_F / lambda_min`` this is the condition number's amplification
    ``kappa(P) ||E|| / ||P||``, here computed for the values at hand. The neglected terms
    are smaller by a factor ``||M||_2`` (asserted below 1e-2), so the bound is doubled."""
    m = inverse_b @ (precision_a - precision_b) @ inverse_b.T
    m = (m + m.T) / 2
    assert float(torch.linalg.matrix_norm(m, 2)) < 1e-2
    lowest = float(torch.linalg.eigvalsh(precision_b)[0])
    return 2 * float(torch.linalg.matrix_norm(m)) * float(z.norm()) / math.sqrt(2 * lowest)


def _laplace_states(spec, data, base: dict, prior):
    """The Laplace fit the trainer makes at the base network ``base`` (``laplace.init`` on
    the unaugmented training set in batches of READ_BATCH), and the model."""
    seeds = checkpoint_seeds(spec.base_seed, 0)
    model = model_at(spec, 0, base)
    params, buffers = parameters_of(model)
    recipe = dataclasses.replace(spec.recipe, batch_size=laplace.READ_BATCH)
    state = laplace.init(model, params, buffers,
                         torch_batches(data, recipe, seeds.method, augment=False)(0),
                         len(data.train), structure="full", prior_precision=prior)
    return model, state


def _check_laplace_samples(spec, data, base_a: dict, base_b: dict, results_a: list,
                           results_b: list) -> float:
    """Laplace has no phase of its own: a sample is ``theta* + L^-T z`` (float64, then
    float32) from the base network, the same program on both engines. Each engine's
    samples are that program at its own base network, bit for bit (the same float64
    arithmetic on the same values in this process); between the engines they differ by
    the base networks' difference plus :func:`_draw_bound` (the Cholesky factor's
    amplification of the precisions' difference), the float64 solves and one float32
    rounding each. Returns the largest difference over
    its bound. Measured: 0.011 / 0.010 (``kappa(P) = 90`` at the evidence's prior; the
    bound is 5e-5 against draws' steps ``L^-T z`` of up to 1.9, so a wrong draw, prior or
    curvature exceeds it 1e4-fold)."""
    seeds = checkpoint_seeds(spec.base_seed, 0)
    count = len(results_a)
    fits = {}
    for side, base, results in (("a", base_a, results_a), ("b", base_b, results_b)):
        model, state = _laplace_states(spec, data, base, spec.method_options["prior_precision"])
        drawn = laplace.sample(model, state, generator_for(seeds.sample), count)
        for result, sample in zip(results, drawn, strict=True):
            for key, value in sample.items():
                np.testing.assert_array_equal(result.state[key], value.numpy())
        fits[side] = state
    state_a, state_b = fits["a"], fits["b"]
    cholesky_a, cholesky_b = state_a.curvature.cholesky, state_b.curvature.cholesky
    inverse_a, inverse_b = _inverse(cholesky_a), _inverse(cholesky_b)
    precision_a = laplace.posterior_precision(state_a)
    precision_b = laplace.posterior_precision(state_b)
    generator = generator_for(seeds.sample)   # laplace.draw: D normals per sample, in turn
    like = {key: torch.from_numpy(value) for key, value in results_a[0].state.items()}
    worst = 0.0
    for result_a, result_b in zip(results_a, results_b, strict=True):
        z = torch.randn(state_a.dimension, generator=generator, dtype=torch.float64)
        step_a = torch.linalg.solve_triangular(cholesky_a.T, z[:, None], upper=True)[:, 0]
        step_b = torch.linalg.solve_triangular(cholesky_b.T, z[:, None], upper=True)[:, 0]
        draw = _draw_bound(precision_a, precision_b, cholesky_b, inverse_b, z)
        solves = (_solve_rounding(cholesky_a, inverse_a, step_a)
                  + _solve_rounding(cholesky_b, inverse_b, step_b))
        bound = (state_a.mean - state_b.mean).abs() + draw + solves
        sample_a = flatten(_tensors(result_a.state)).double()
        sample_b = flatten(_tensors(result_b.state)).double()
        bound = bound + U32 * (sample_a.abs() + sample_b.abs())
        ratio = ((sample_a - sample_b).abs() / bound).max()
        assert ratio <= 1, (float(ratio), unflatten((sample_a - sample_b).abs() - bound, like))
        worst = max(worst, float(ratio))
    return worst


def _follow_whitened_chain(spec, data, base_a: dict, base_b: dict, spy_a, spy_b,
                           log_a: _Recorder, log_b: _Recorder) -> tuple[list[int], float]:
    """The Laplace-whitened SGHMC chain (``preconditioner = "laplace"``), float64 in the
    coordinates ``z = L^T w`` of the base network's Laplace precision ``P = L L^T``:

        v' = (1 - alpha) v + lr L^-1 G(w) + F xi,   z' = z + v',   w' = L^-T z' (float32)

    ``xi`` the same normals on both sides, ``F`` the noise factor (``sqrt(2 alpha lr) I``,
    then frozen from the burn-in's gradients). The chain starts from a Laplace draw
    ``z_0 = L^T w* + xi_0``: each run's start is that program bit for bit, and the two
    starts differ by the base networks' difference plus :func:`_draw_bound` (the Cholesky
    factor is what amplifies the base networks' rounding). Then every step, from the
    states (read from the steppers) each run had:

        dv' - (1 - alpha) dv - lr [L_a^-1 G_t(w_a) - L_b^-1 G_t(w_b)] - xi (F_a - F_b)^T
            = lr L_a^-1 [G_f(w_a) - G_t(w_a)] + float64 roundings,

    the right side at most ``lr |L_a^-1|`` times :func:`_log_posterior_rounding` (at
    batch 512: ``gamma(k)`` of 2e-3 of the gradient's scale) plus ``gamma_64(2 d + 8)`` of
    the terms. Returns the excused steps and the largest residual over its bound.
    Measured: the start 0.013 / 0.010 of its bound (``kappa(P) = 793``: on this host the
    starts are 1.3e-5 apart where the weights reach 5.5, and the samples end 1.7e-5 of
    their scale apart, against the 2e-2 the former tolerance allowed for a guessed
    amplification), the steps 1.0e-3 / 9e-4; a step's ``lr L^-1 G`` is 0.01-3 in ``z``
    against bounds of 2e-4 to 3e-2, so a wrong gradient exceeds them about 100-fold."""
    recipe, seeds, num_data = spec.recipe, checkpoint_seeds(spec.base_seed, 0), len(data.train)
    opts = spec.method_options
    prior = sghmc.prior_precision_from_weight_decay(num_data, recipe.weight_decay)
    lr, friction = opts["whitened_lr"], 1 - opts["alpha"]
    gradient = torch_log_posterior(initial_model(spec, seeds.init), {}, num_data, prior)
    generator = generator_for(seeds.sample)   # chain 0: the mode's sample seed
    cholesky = {"a": spy_a.whitening.cholesky, "b": spy_b.whitening.cholesky}
    inverse = {side: _inverse(value) for side, value in cholesky.items()}
    size = len(cholesky["a"])
    start = torch.randn(size, generator=generator, dtype=torch.float64)
    starts = {}
    for side, spy, base in (("a", spy_a, base_a), ("b", spy_b, base_b)):
        z0 = spy.initial[0]
        assert torch.equal(z0, spy.whitening.whiten(flatten(_tensors(base))) + start)
        starts[side] = (flatten(_tensors(base)).double(), flatten(spy.initial[3]).double())
    # the starts: Laplace draws at the two base networks
    (mean_a, w0_a), (mean_b, w0_b) = starts["a"], starts["b"]
    precision = {side: value @ value.T for side, value in cholesky.items()}
    bound = ((mean_a - mean_b).abs()
             + _draw_bound(precision["a"], precision["b"], cholesky["b"], inverse["b"], start)
             + U32 * (w0_a.abs() + w0_b.abs())
             + sum(_solve_rounding(cholesky[s], inverse[s], 2 * (w.abs() + m.abs()))
                   for s, (m, w) in starts.items()))
    assert ((w0_a - w0_b).abs() <= bound).all(), float(((w0_a - w0_b).abs() / bound).max())
    chain_a, chain_b = log_a.phase("sghmc"), log_b.phase("sghmc")
    batches = _chain_batches(data, recipe, seeds.method, opts["batch_size"],
                             opts["minibatches"] == "independent")
    before = {"a": spy_a.initial, "b": spy_b.initial}
    abs_inverse_a = inverse["a"].abs()
    abs_product = {s: inverse[s].abs() @ cholesky[s].abs() for s in cholesky}
    parting, ratio = [], 0.0
    steps = zip(chain_a, chain_b, batches, strict=False)   # batches: as many as needed
    for step, (i, j, (images, labels)) in enumerate(steps, 1):
        xi = torch.randn(size, generator=generator, dtype=torch.float64)
        after = {"a": log_a.probes[i], "b": log_b.probes[j]}
        params_a, params_b = before["a"][3], before["b"][3]
        loss_ta, grad_ta = gradient(params_a, (images, labels))
        loss_tb, grad_tb = gradient(params_b, (images, labels))
        grad_z = {"a": spy_a.whitening.gradient(flatten(grad_ta)),
                  "b": spy_b.whitening.gradient(flatten(grad_tb))}
        noise = {s: xi @ after[s][2].T for s in after}
        residual = ((after["a"][1] - after["b"][1]) - friction * (before["a"][1] - before["b"][1])
                    - lr * (grad_z["a"] - grad_z["b"]) - (noise["a"] - noise["b"])).abs()
        model = model_at(spec, 0, {k: v.numpy() for k, v in params_a.items()})
        rounding = _log_posterior_rounding(model, images, params_a, grad_ta, num_data, prior)
        per_weight = flatten({key: torch.full(value.shape, rounding[key], dtype=torch.float64)
                              for key, value in params_a.items()})
        bound = lr * (abs_inverse_a @ per_weight)
        for s in after:
            terms = (friction * before[s][1].abs() + lr * (abs_product[s] @ grad_z[s].abs())
                     + xi.abs() @ after[s][2].abs().T + after[s][1].abs())
            bound = bound + gamma(2 * size + 8, U64) * terms
        loss_residual = abs((log_a.info[i].loss - log_b.info[j].loss) - (loss_ta - loss_tb))
        worst = max(float((residual / bound).max()), _loss_ratio(
            loss_residual, model, images, more=_prior_rounding(params_a, loss_ta, num_data,
                                                                prior)))
        if worst > 1:
            assert optunet_forward_bounds(model, images).near_switch.sum() > 0, (step, worst)
            parting.append(step)
        else:
            ratio = max(ratio, worst)
        before = after
    assert step == len(chain_a) == len(chain_b)
    return parting, ratio


def _iterates(log: _Recorder, epochs: set[int]) -> list[dict[str, np.ndarray]]:
    """SWAG's collected iterates: the weights at the end of each collection epoch."""
    phase = log.phase("swag")
    last = {log.info[i].epoch: i for i in phase}
    return [log.weights[last[epoch]] for epoch in sorted(epochs)]


def _check_swag_samples(spec, iterates_a: list, iterates_b: list, results_a: list,
                        results_b: list) -> float:
    """SWAG's fit and draws (float64 moments of the collected iterates, float32 deviation
    columns) are one program: each engine's samples are it, bit for bit, applied to that
    engine's iterates. Between the engines: with ``d = max_i |theta_a,i - theta_b,i|`` per
    weight, the exact draw ``mean + sqrt(c) (std z1 + D^T z2 / sqrt(K - 1))`` moves by at
    most ``d (1 + sqrt(c) (|z1| + 2 ||z2||_1 / sqrt(K - 1)))`` (the mean and the standard
    deviation, a seminorm of the iterates, by ``d``; a deviation column by ``2 d``), the
    same ``z1``, ``z2`` on both sides (the sample seed). Each side's rounding: the float64
    variance ``E[theta^2] - E[theta]^2`` within ``gamma_64(10 n + 2) max theta^2``, so its
    square root within the square root of that (``sqrt`` is 1/2-Hoelder: 5e-8 of the
    weights, the size of float32's own rounding), the float32 deviation columns (``u
    |D|``), the float64 sum and the float32 sample (``u |theta|``). Returns the largest
    difference over its bound. Measured: 0.60 / 0.60 (the bound is 1-2e-7, mostly the
    iterates' own difference; a draw moves the weights by 4e-3 to 1e-2 from the mean, so a
    wrong draw exceeds it 2e4-fold)."""
    opts = spec.method_options
    seeds = checkpoint_seeds(spec.base_seed, 0)
    count, scale = len(results_a), opts["scale"]
    states = []
    for iterates, results in ((iterates_a, results_a), (iterates_b, results_b)):
        state = swag.init(_tensors(iterates[0]), max_rank=opts["rank"])
        for iterate in iterates:
            state = swag.update(state, _tensors(iterate))
        drawn = swag.sample(state, generator_for(seeds.sample), count, scale, buffers={})
        for result, sample in zip(results, drawn, strict=True):
            for key, value in sample.items():
                np.testing.assert_array_equal(result.state[key], value.numpy())
        states.append((state, torch.stack([flatten(_tensors(i)).double() for i in iterates])))
    (state_a, theta_a), (state_b, theta_b) = states
    n, rank = len(theta_a), state_a.deviations.shape[0]
    spread = (theta_a - theta_b).abs().max(0).values
    generator = generator_for(seeds.sample)   # swag.sample_vector: z1 (P), then z2 (K)
    root, scaled = math.sqrt(scale), 1 / math.sqrt(rank - 1)
    worst = 0.0
    for result_a, result_b in zip(results_a, results_b, strict=True):
        z1 = torch.randn(state_a.mean.shape, generator=generator, dtype=torch.float64)
        z2 = torch.randn((rank,), generator=generator, dtype=torch.float64)
        bound = spread * (1 + root * (z1.abs() + 2 * scaled * float(z2.abs().sum())))
        samples = []
        for state, theta, result in ((state_a, theta_a, result_a), (state_b, theta_b, result_b)):
            top = theta.abs().max(0).values
            std = swag.variance(state).sqrt()
            deviations = state.deviations.double().abs().T @ z2.abs()
            sample = flatten(_tensors(result.state)).double()
            bound = bound + (root * (math.sqrt(gamma(10 * n + 2, U64)) * top + U64 * std)
                             * z1.abs() + root * scaled * U32 * deviations
                             + gamma(3 * n, U64) * top
                             + gamma(rank + 4, U64) * (state.mean.abs() + root * (
                                 std * z1.abs() + scaled * deviations))
                             + U32 * sample.abs())
            samples.append(sample)
        ratio = float(((samples[0] - samples[1]).abs() / bound).max())
        assert ratio <= 1, ratio
        worst = max(worst, ratio)
    return worst


def _follow_bbb(spec, data, spy_a, spy_b, log_a: _Recorder, log_b: _Recorder
                ) -> tuple[list[int], float]:
    """BBB's phase (SGD on ``mu`` and ``rho``, no momentum, closed-form KL), step by step
    from the states (read from the steppers) each run had, as the chains: the change of
    the runs' difference less torch's ``elbo_and_grad`` at both states (the same noise
    ``eps``, replayed from the mode's noise seed) within ``lr`` times the gradient's
    rounding at run a's state plus one rounding of each side's update.

    The means' gradient ``mean_s g_s + kl_weight mu / sigma1^2`` (``g_s`` the mean
    cross-entropy's gradient at ``w_s = mu + sigma eps_s``, each within ``gamma(k)`` of
    its scale, ``k`` as ``gradient_rtol`` plus 4: ``w_s`` is formed by each engine with
    the same three float32 operations on the same values, at most two roundings apart),
    plus ``2 gamma(S + 3)`` of its terms. ``rho``'s: the same through ``eps_s`` and
    ``sigmoid(rho)``, plus ``2 gamma(S + 12)`` of its terms (the KL's ``sigma / sigma1^2
    - 1 / sigma`` and softplus' derivative). The loss: the samples' mean of
    ``cross_entropy_bound`` plus the float32 KL sum (``gamma(P + 8)`` of its terms).
    Measured: 0.09 / 0.18; the means' steps are 7e-4 to 4e-3 against bounds of 1e-7 to
    1e-6, ``rho``'s 3e-5 against 8e-7, so a wrong gradient exceeds them 40-1,000-fold."""
    recipe, seeds, num_data = spec.recipe, checkpoint_seeds(spec.base_seed, 0), len(data.train)
    assert recipe.momentum == 0
    model = initial_model(spec, seeds.init)
    model.train()
    generator = generator_for(seeds.noise)
    states_a = [spy_a.initial] + [log_a.probes[i] for i in log_a.phase("bbb")]
    states_b = [spy_b.initial] + [log_b.probes[i] for i in log_b.phase("bbb")]
    opts = states_a[0].options
    assert opts.closed_form_kl
    for spy in (spy_a, spy_b):
        assert spy.run.optimizer == spy.run.rho_optimizer == "sgd"
    samples, kl_weight = opts.elbo_samples, opts.kl_weight_for(num_data)
    prior_var = float(opts.prior_sigma) ** 2
    batches = (batch for epoch in range(recipe.epochs)
               for batch in torch_batches(data, recipe, seeds.data)(epoch))
    parting, ratio = [], 0.0
    for step, (index_a, index_b, (images, labels)) in enumerate(zip(
            log_a.phase("bbb"), log_b.phase("bbb"), batches, strict=True), 1):
        state_a, state_b = states_a[step - 1], states_b[step - 1]
        after_a, after_b = states_a[step], states_b[step]
        lr = log_a.info[index_a].lr
        rho_lr = spy_a.run.rho_lr(lr)
        eps = bbb.draw_noise(state_b.rho, generator, samples)
        terms_a, grads_a = bbb.elbo_and_grad(state_a, model, {}, (images, labels), None,
                                             num_data, noise=eps)
        terms_b, grads_b = bbb.elbo_and_grad(state_b, model, {}, (images, labels), None,
                                             num_data, noise=eps)
        sigma = state_a.sigma
        weights, cheap, ce = [], 0.0, 0.0
        for draw in eps:
            w = {key: state_a.mu[key] + sigma[key] * draw[key] for key in state_a.mu}
            net = model_at(spec, 0, {key: value.detach().numpy() for key, value in w.items()})
            loss = torch.nn.functional.cross_entropy(net(images), labels)
            grads = torch.autograd.grad(loss, list(net.parameters()))
            weights.append((net, dict(zip(w, grads, strict=True))))
            cheap += cross_entropy_rounding(_logits64(net, images).float()) / samples
            ce += float(loss.detach()) / samples
        rtol = [gamma(_gradient_terms(weights[0][0], images) + 4)] * samples
        kl_terms = sum(float((math.log(float(opts.prior_sigma)) - sigma[key].double().log()
                              + (sigma[key].double() ** 2 + state_a.mu[key].double() ** 2)
                              / (2 * prior_var) - 0.5).abs().sum()) for key in sigma)
        size = sum(value.numel() for value in sigma.values())
        more = (gamma(samples + 2) * ce + 2 * kl_weight * gamma(size + 8) * kl_terms
                + 2 * U32 * abs(terms_a.loss.item()))
        loss_residual = abs((log_a.info[index_a].loss - log_b.info[index_b].loss)
                            - float(terms_a.loss - terms_b.loss))
        worst = loss_residual / (cheap + more)
        if worst > 1:   # the whole bound: the samples' mean of cross_entropy_bound
            worst = loss_residual / (sum(cross_entropy_bound(net, images)
                                         for net, _ in weights) / samples + more)
        for key in state_a.mu:
            g = [grads[key].double() for _, grads in weights]
            e = [draw[key].double() for draw in eps]
            mu, s = state_a.mu[key].double(), sigma[key].double()
            slope = torch.sigmoid(state_a.rho[key].double())
            mu_rounding = (sum(r * float(gs.abs().max()) for r, gs in zip(rtol, g, strict=True))
                           / samples + 2 * gamma(samples + 3) * float(
                               (sum(gs.abs() for gs in g) / samples
                                + kl_weight * mu.abs() / prior_var).max()))
            rho_rounding = float((slope * (
                sum(r * float(gs.abs().max()) * es.abs() for r, gs, es in zip(
                    rtol, g, e, strict=True)) / samples
                + 2 * gamma(samples + 12) * (sum((gs * es).abs() for gs, es in zip(
                    g, e, strict=True)) / samples + kl_weight * (s / prior_var + 1 / s)))).max())
            for group, rate, group_rounding in (("mu", lr, mu_rounding),
                                                ("rho", rho_lr, rho_rounding)):
                before_a, before_b = getattr(state_a, group)[key], getattr(state_b, group)[key]
                new_a, new_b = getattr(after_a, group)[key], getattr(after_b, group)[key]
                grad_a, grad_b = getattr(grads_a, group)[key], getattr(grads_b, group)[key]
                residual = _max(((new_a.double() - before_a.double())
                                 - (new_b.double() - before_b.double())
                                 + rate * (grad_a.double() - grad_b.double())).numpy())
                bound = rate * group_rounding + U32 * (
                    _max(new_a) + _max(new_b)
                    + rate * (_max(grad_a.detach()) + group_rounding + _max(grad_b.detach())))
                worst = max(worst, residual / bound)
        if worst > 1:
            assert any(optunet_forward_bounds(net, images).near_switch.sum() > 0
                       for net, _ in weights), (step, worst)
            parting.append(step)
        else:
            ratio = max(ratio, worst)
    return parting, ratio


def _check_bbb_samples(spec, state_a, state_b, results_a: list, results_b: list) -> float:
    """BBB's samples ``mu + softplus(rho) eps`` (float32): each engine's are
    ``bbb.sample`` of its final state, bit for bit; between the engines they differ by
    ``|d mu| + |eps| (sigmoid(rho) |d rho| + 4 u (sigma_a + sigma_b))`` (softplus within 2
    ulp on each side) plus a rounding of the product and of the sum on each side.
    Returns the largest difference over its bound. Measured: 0.78 / 0.81 (the bound is
    1-3e-8, mostly the means' own difference; ``sigma eps`` is 2-9e-3, so a wrong draw
    exceeds it 1e5-fold)."""
    seeds = checkpoint_seeds(spec.base_seed, 0)
    model = initial_model(spec, seeds.init)
    count = len(results_a)
    for state, results in ((state_a, results_a), (state_b, results_b)):
        drawn = bbb.sample(model, state, generator_for(seeds.sample), count)
        for result, sample in zip(results, drawn, strict=True):
            for key, value in sample.items():
                np.testing.assert_array_equal(result.state[key], value.numpy())
    noise = bbb.draw_noise(state_a.rho, generator_for(seeds.sample), count)
    sigma_a, sigma_b = state_a.sigma, state_b.sigma
    worst = 0.0
    for eps, result_a, result_b in zip(noise, results_a, results_b, strict=True):
        for key in state_a.mu:
            e = eps[key].double().abs()
            slope = torch.sigmoid(torch.maximum(state_a.rho[key], state_b.rho[key]).double())
            s_a, s_b = sigma_a[key].double(), sigma_b[key].double()
            bound = ((state_a.mu[key].double() - state_b.mu[key].double()).abs()
                     + e * (slope * (state_a.rho[key].double() - state_b.rho[key].double()).abs()
                            + 4 * U32 * (s_a + s_b))
                     + U32 * (e * (s_a + s_b) + torch.from_numpy(np.abs(result_a.state[key]))
                              + torch.from_numpy(np.abs(result_b.state[key]))))
            difference = np.abs(result_a.state[key].astype(np.float64) - result_b.state[key])
            ratio = float((torch.from_numpy(difference) / bound).max())
            assert ratio <= 1, (key, ratio)
            worst = max(worst, ratio)
    return worst


def _spy_steppers(monkeypatch) -> list:
    """The steppers the trainer makes for SGHMC's whitened chain and for BBB, kept (with
    their state before the first step as ``initial``) so that a callback can read the
    state the weights alone do not show: the chain's ``z``, momentum and noise factor,
    BBB's ``rho``. Nothing else changes."""
    made: list = []
    whitened = sghmc.WhitenedSghmcStepper
    bbb_stepper = ModeEngine.bbb_stepper

    def make_whitened(*args, **kwargs):
        stepper = whitened(*args, **kwargs)
        stepper.initial = (stepper.z, stepper.momentum, stepper.factor, stepper.params)
        made.append(stepper)
        return stepper

    def make_bbb(self, model, start, run):
        stepper = bbb_stepper(self, model, start, run)
        stepper.initial = start
        made.append(stepper)
        return stepper

    monkeypatch.setattr(sghmc, "WhitenedSghmcStepper", make_whitened)
    monkeypatch.setattr(ModeEngine, "bbb_stepper", make_bbb)
    return made


def _probe(made: list, info):
    if info.phase == "sghmc" and made:
        stepper = made[-1]
        return stepper.z, stepper.momentum, stepper.factor, stepper.params
    if info.phase == "bbb":
        return made[-1].bbb_state()
    return None


@pytest.mark.parametrize(("method", "options"), [
    ("swag", {}), ("sghmc", {"preconditioner": "none"}), ("bbb", {}), ("laplace", {}),
    ("sghmc", {"preconditioner": "laplace"}),
])
def test_the_fast_engine_runs_the_same_program(method, options, digits, monkeypatch):
    """The fast engine's run of a method is the torch engine's program: the same
    bookkeeping (every step's phase, epoch, step and learning rate; the results' seeds
    and steps), the base network step by step (as ``compare_runs``), the method's phase
    step by step, and samples that are the method's own program of what each run's phases
    produced, bit for bit, and apart between the engines by no more than that program's
    bound for the phases' difference (the section's comment). This replaces a comparison
    of the final samples within 2e-4 of each tensor's scale (2e-2 for the whitened chain),
    numbers that no analysis gave."""
    spec = digits_spec(method, samples=2)
    spec = dataclasses.replace(spec, method_options={**spec.method_options, **options})
    opts, seeds = spec.method_options, checkpoint_seeds(spec.base_seed, 0)
    made = _spy_steppers(monkeypatch)
    runs = {}
    for engine in ("fast", "torch"):
        made.clear()
        log = _Recorder(lambda info: _probe(made, info))
        results = train_checkpoints(spec, [0], data=digits, engine=engine, callbacks=[log])
        runs[engine] = results, log, list(made)
    (fast, log_a, made_a), (reference, log_b, made_b) = runs["fast"], runs["torch"]
    assert {r.engine for r in fast} == {"fast"} and {r.engine for r in reference} == {"torch"}
    assert ([(i.index, i.epoch, i.step, i.lr, i.phase) for i in log_a.info]
            == [(i.index, i.epoch, i.step, i.lr, i.phase) for i in log_b.info])
    assert ([(r.index, r.sample, r.seeds, r.steps) for r in fast]
            == [(r.index, r.sample, r.seeds, r.steps) for r in reference])
    phases = {}
    # SGD phases step by step (rounding_bounds.follow_sgd). Measured, host / AVX2: a
    # following step's difference at most 0.23 / 0.23 of its bound (the base network,
    # 22 steps at batch 64), 0.21 / 0.21 (SWAG's 66 steps); gradient_rtol is 4.4e-5 of
    # the gradient's scale at batch 64, so a gradient wrong by 1% exceeds it 20-fold.
    if method != "bbb":   # the base network: DE member 0's SGD, step by step
        train_a, train_b = log_a.phase("train"), log_b.phase("train")
        start = {key: value.numpy() for key, value in
                 initial_model(spec, seeds.init).state_dict().items()}
        batches = (batch for epoch in range(spec.recipe.epochs)
                   for batch in torch_batches(digits, spec.recipe, seeds.data)(epoch))
        phases["train"] = follow_sgd(spec, 0, batches, start, start,
                                     [log_a.weights[i] for i in train_a], log_a.steps("train"),
                                     [log_b.weights[i] for i in train_b], log_b.steps("train"))
        base_a, base_b = log_a.weights[train_a[-1]], log_b.weights[train_b[-1]]
    if method == "swag":
        phase_a, phase_b = log_a.phase("swag"), log_b.phase("swag")
        batches = (batch for epoch in range(opts["epochs"])
                   for batch in torch_batches(digits, spec.recipe, seeds.method)(epoch))
        phases["swag"] = follow_sgd(spec, 0, batches, base_a, base_b,
                                    [log_a.weights[i] for i in phase_a], log_a.steps("swag"),
                                    [log_b.weights[i] for i in phase_b], log_b.steps("swag"))
        epochs = set(swag.collection_epochs(opts["epochs"], opts["iterates"],
                                            opts["collect_from"]))
        _check_swag_samples(spec, _iterates(log_a, epochs), _iterates(log_b, epochs), fast,
                            reference)
    elif method == "laplace":
        _check_laplace_samples(spec, digits, base_a, base_b, fast, reference)
    elif method == "sghmc":
        if opts.get("preconditioner") == "laplace":
            phases["sghmc"] = _follow_whitened_chain(spec, digits, base_a, base_b, made_a[-1],
                                                     made_b[-1], log_a, log_b)
        else:
            phases["sghmc"] = _follow_plain_chain(spec, digits, base_a, base_b, log_a, log_b)
        keep = sghmc.chain_schedule(opts["burn_in"], opts["thin"], spec.samples_per_mode)
        for results, log in ((fast, log_a), (reference, log_b)):
            kept = {log.info[i].step: log.weights[i] for i in log.phase("sghmc")}
            for result, step in zip(results, keep, strict=True):   # the chain's states
                for key, value in kept[step].items():
                    np.testing.assert_array_equal(result.state[key], value)
    else:
        phases["bbb"] = _follow_bbb(spec, digits, made_a[-1], made_b[-1], log_a, log_b)
        _check_bbb_samples(spec, log_a.probes[-1], log_b.probes[-1], fast, reference)
    for phase, (parting, _) in phases.items():   # excused steps: never all of a phase
        assert len(parting) < len(log_a.phase(phase)), (phase, parting)


def test_de_mode_is_the_deep_ensemble_member(digits):
    """A method's base network is DE member i of the same base seed (same recipe, seeds)."""
    member = train_checkpoints(digits_spec("de", modes=3), [2], data=digits, engine="torch")[0]
    model, _ = torch_train_base(digits_spec("laplace"), 2, digits)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), member.state[key])


def test_mc_dropout_samples_mask_the_last_layer_of_the_dropout_network(digits):
    """Bit for bit: the trainer's base network is ``torch_train_base``'s (the same torch
    program on the same values in this process, as ``test_de_mode_is_the_deep_ensemble_
    member`` checks), and a sample's last-layer weight is ``w * m / (1 - p)`` with ``m``
    0 or 1. ``1 / (1 - 0.2)`` is 1.25 in float64, so ``w * 1.25`` (24 + 3 significant
    bits) is exact there: the trainer's float64 product rounded to float32 and the
    float32 product ``w * 1.25`` here are the same exact value rounded once (a correctly
    rounded IEEE operation: the same bits on any CPU)."""
    spec = digits_spec("mc-dropout", samples=4)
    results = train_checkpoints(spec, [0], data=digits, engine="torch")
    trained, _ = torch_train_base(spec, 0, digits)
    assert trained.dropout.p == 0.2  # trained with dropout before the last layer
    assert 1 / (1 - 0.2) == 1.25
    masks = dropout.draw_masks(trained.fc.in_features, 0.2,
                               torch.Generator().manual_seed(checkpoint_seeds(5, 0).sample), 4)
    for result, mask in zip(results, masks, strict=True):
        for key, value in trained.state_dict().items():
            expected = value.numpy()
            if key == "fc.weight":
                expected = expected * (mask.numpy() / 0.8)[None, :].astype(np.float32)
            np.testing.assert_array_equal(result.state[key], expected, err_msg=key)


def test_laplace_samples_are_the_method_around_the_trained_network(digits):
    """Bit for bit: the trainer's Laplace samples are ``laplace.init`` and
    ``laplace.sample`` at its base network, which is ``torch_train_base``'s, on the same
    batches (unaugmented, READ_BATCH at a time, the mode's method seed) and the same
    sample seed: the same float64 program on the same values in this process, so the
    same bits (whatever a CPU's rounding, it is the same in both runs)."""
    spec = digits_spec("laplace", samples=2)
    results = train_checkpoints(spec, [0], data=digits, engine="torch")
    model, _ = torch_train_base(spec, 0, digits)
    params, buffers = parameters_of(model)
    recipe = dataclasses.replace(spec.recipe, batch_size=laplace.READ_BATCH)
    seeds = checkpoint_seeds(5, 0)
    state = laplace.init(model, params, buffers,
                         torch_batches(digits, recipe, seeds.method, augment=False)(0),
                         len(digits.train), structure="full", prior_precision="marglik")
    expected = laplace.sample(model, state, torch.Generator().manual_seed(seeds.sample), 2)
    for result, sample in zip(results, expected, strict=True):
        for key, value in sample.items():
            np.testing.assert_array_equal(result.state[key], value.numpy(), err_msg=key)


def test_collection_file_holds_whole_modes_and_says_what_it_is(tmp_path, digits):
    spec = digits_spec("swag", modes=2, samples=3)
    out = tmp_path / "swag-multi-mode.h5"
    summary = train_collection(spec, out, backend=SerialBackend(), engine="fast",
                               progress=False)
    assert (summary.checkpoints, summary.trained) == (6, 6)
    with open_zoo(out) as zoo:
        assert zoo.method == "swag"
        assert zoo.annotations == {"posterior": "multi-mode", "modes": 2,
                                   "samples_per_mode": 3}
        assert zoo.recipe["samples_per_mode"] == 3
        assert zoo.recipe["method_options"] == spec.method_options
        assert zoo.model_options == {}
        rows = zoo.metadata
        assert list(zip(rows["mode_id"], rows["sample_id"], strict=True)) == [
            (m, s) for m in range(2) for s in range(3)]
    assert verify(out).ok


def test_bbb_records_its_kl_weight(tmp_path, digits):
    spec = digits_spec("bbb", modes=1, samples=2)
    out = tmp_path / "bbb.h5"
    train_collection(spec, out, backend=SerialBackend(), progress=False)
    with open_zoo(out) as zoo:
        assert zoo.recipe["method_options"]["kl_weight"] == 1 / len(digits.train)
        assert zoo.annotations["posterior"] == "single-mode"
    # Resuming with the same spec is accepted (the recorded recipe matches).
    train_collection(spec.replace(checkpoints=4), out, backend=SerialBackend(),
                     progress=False)
    with open_zoo(out) as zoo:
        assert sorted(set(zoo.metadata["mode_id"])) == [0, 1] and len(zoo) == 4


def _digests(path):
    with open_zoo(path) as zoo:
        rows = zoo.metadata
        return {(int(m), int(s)): str(d) for m, s, d in
                zip(rows["mode_id"], rows["sample_id"], rows["sha256"], strict=True)}


def test_a_run_killed_between_modes_resumes_to_the_same_samples(tmp_path):
    spec = tmp_path / "sghmc.toml"
    spec.write_text('recipe = "optunet-mnist"\ndataset = "digits"\nmethod = "sghmc"\n'
                    "modes = 2\nsamples_per_mode = 3\nbase_seed = 2\n"
                    "[recipe_overrides]\nepochs = 1\n"
                    "[method_options]\nburn_in = 10\nthin = 4\npreconditioner = \"none\"\n")
    flags = ["--backend", "serial", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("POSTERIORZOO_KILL_AT", None)
    whole = tmp_path / "whole.h5"
    subprocess.run([*TRAIN, str(spec), "--out", str(whole), *flags], check=True,
                   capture_output=True, env=env, timeout=300)
    expected = _digests(whole)
    assert sorted(expected) == [(m, s) for m in range(2) for s in range(3)]
    out = tmp_path / "killed.h5"
    command = [*TRAIN, str(spec), "--out", str(out), *flags]
    killed = subprocess.run(command, capture_output=True, timeout=300,
                            env={**env, "POSTERIORZOO_KILL_AT": "zoo-before-commit:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    assert sorted(_digests(out)) == [(0, s) for s in range(3)]  # the first mode, whole
    subprocess.run(command, check=True, capture_output=True, env=env, timeout=300)
    assert _digests(out) == expected


# ---------------------------------------------------------------- ResNet-18 (BatchNorm)
@pytest.fixture(scope="module")
def fake_cifar():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(64, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, size=64).astype(np.int64)
    fake = ArrayDataset(images, labels, 10, "fake-cifar", "train", (0.5,) * 3, (0.25,) * 3)
    return TrainingData(fake, fake)


@pytest.mark.parametrize("method", ["mc-dropout", "swag", "laplace", "sghmc", "bbb"])
def test_resnet18_methods(method, fake_cifar):
    options = {"swag": {"epochs": 2, "iterates": 2, "ramp_epochs": 1},
               "sghmc": {"burn_in": 1, "thin": 1}}.get(method, {})
    spec = make_spec("resnet18-cifar100", dataset="fake-cifar", method=method, modes=1,
                     samples_per_mode=2, num_classes=10, model_options={"width": 4},
                     recipe_overrides={"epochs": 1, "batch_size": 32},
                     method_options=options)
    results = train_checkpoints(spec, [0], data=fake_cifar, engine="auto")
    assert len(results) == 2 and {r.engine for r in results} == {"torch"}
    base = initial_model(spec, 0, training=False)
    assert base.dropout.p == 0  # stored without dropout
    for result in results:
        base.load_state_dict({k: torch.from_numpy(v) for k, v in result.state.items()})
    first, second = (r.state for r in results)
    varying = {key for key in first if not np.array_equal(first[key], second[key])}
    if method in ("mc-dropout", "laplace"):  # last-layer methods (Laplace: KFAC by default)
        assert varying <= {"fc.weight", "fc.bias", "linear.weight", "linear.bias"}, varying
        assert varying
    else:  # whole-network methods; SWAG recomputes the BatchNorm statistics per sample
        assert any(key.endswith("running_mean") for key in varying) == (method == "swag")
        assert len(varying) > 10
