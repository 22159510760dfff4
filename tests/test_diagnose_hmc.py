"""``posteriorzoo diagnose`` on full-batch HMC collections (issue 33 section 1).

- A tiny digits HMC collection (2 modes, one chain of 8 draws each, as
  tests/test_method_hmc.py trains them): each chain's recorded acceptance, step, leapfrog
  steps and E-BFMI reach the result; the weight statistics are those of each chain alone
  (its two halves), on the stored and on the canonical weights; each sample's test
  log-likelihood is the mean log p(y | x) of its own predictions; the spread between
  the chains is that of :func:`chain_spread` on the canonical weights.
- The sampler flags fire on a crafted record (E-BFMI 0.1, acceptance 0.2) and not on a
  healthy one, at the thresholds' edges too.
- The pure functions: within-chain split R-hat of two chains in two far-apart Gaussians
  is about 1 where R-hat across them is not; the spread's distances and modes have a
  closed form; the ESS of an AR(1) series has one too.

Tolerances: where diagnose and the test compute the same function of the same values
in one process they are compared exactly; closed forms within the rounding of the few
float64 operations between them (``gamma(k, U64)``), or within Monte Carlo error where
the values are random (stated at each).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from rounding_bounds import U64, gamma

from posteriorzoo.cli import main
from posteriorzoo.collection import diagnose
from posteriorzoo.diagnostics import (
    ACCEPTANCE_BAND,
    E_BFMI_LIMIT,
    FLAGS,
    SEPARATE_MODES,
    chain_spread,
    chain_statistics,
    sampler_flags,
    series_statistics,
)
from posteriorzoo.errors import InvalidOptionError, SampleSizeError

DRAWS = 8
E_BFMI_FLAG = "E-BFMI below 0.3"
ACCEPTANCE_FLAG = "acceptance far from its target (outside 0.5 .. 0.99)"


@pytest.fixture(scope="module")
def hmc_zoo(tmp_path_factory):
    """Two modes of one HMC chain each, 8 draws per chain (5 s here)."""
    from train_zoo import make_spec
    from train_zoo.backends import SerialBackend
    from train_zoo.run import train_collection

    spec = make_spec("optunet-mnist", dataset="digits", base_seed=3, method="hmc", modes=2,
                     samples_per_mode=DRAWS, recipe_overrides={"epochs": 2},
                     method_options={"burn_in": 3, "thin": 1, "trajectory_length": 0.004,
                                     "step_size": 4e-4})
    path = tmp_path_factory.mktemp("hmc") / "hmc.h5"
    train_collection(spec, path, backend=SerialBackend(), progress=False)
    return path


def _stored(path):
    """``(weights (N, d) float64 in state order, states, records, metadata)``."""
    from posteriorzoo.zoo import open_zoo

    with open_zoo(path) as zoo:
        states = {key: zoo.layer(key) for key in zoo.state_keys}
        records = zoo.training_records()
        metadata = zoo.metadata
        weights = np.concatenate([states[key].reshape(len(zoo), -1).astype(np.float64)
                                  for key in zoo.state_keys], axis=1)
        extra = (zoo.architecture, zoo.num_classes, zoo.model_options)
    return weights, states, records, metadata, extra


# ------------------------------------------------------------------ the collection
def test_each_chains_record_reaches_the_result(hmc_zoo):
    result = diagnose(hmc_zoo, predictions=False)
    _, _, records, metadata, _ = _stored(hmc_zoo)
    assert list(metadata["chain"]) == [0] * DRAWS + [1] * DRAWS
    assert [entry["mode"] for entry in result.chains] == [0, 1]
    for entry in result.chains:
        (recorded,) = records[entry["mode"]]["chains"]
        # one chain per mode, its own id: R-hat of its halves, never across modes
        assert (entry["chains"], entry["draws"], entry["chain_ids"]) == (
            1, DRAWS, [entry["mode"]])
        for name in ("acceptance_rate", "e_bfmi", "step_size", "leapfrog_steps",
                     "divergences"):
            assert entry[name] == [recorded[name]]
        assert entry["target_accept"] == recorded["target_accept"] == 0.8
        # HMC records no kinetic temperature: none is shown or asked for
        assert entry["kinetic_temperature"] is None and entry["exact_temperature"] is None
        assert entry["log_likelihood"] is None  # no predictions
    assert not any("kinetic temperature" in line for line in result.unknown)
    assert "chain too hot" not in " ".join(result.flags)
    between = result.between_chains
    assert between["chains"] == [{"mode": 0, "chain": 0}, {"mode": 1, "chain": 1}]
    assert between["symmetries"] == "remove" and between["log_likelihood"] is None
    assert len(between["pairs"]) == 1


def test_weight_statistics_are_each_chains_own_on_stored_and_canonical_weights(hmc_zoo):
    """The same float64 values into the same functions in one process: bit for bit. The
    canonical weights are computed here through the model's name (diagnose goes through
    the module): the same structure, the same arithmetic."""
    from posteriorzoo.symmetry import canonicalize_many

    result = diagnose(hmc_zoo, predictions=False)
    weights, states, _, _, (architecture, classes, options) = _stored(hmc_zoo)
    canonical = canonicalize_many(architecture, states, num_classes=classes, **options)
    flat = np.concatenate([canonical[key].reshape(2 * DRAWS, -1).numpy() for key in states],
                          axis=1)
    lags = (1, 5)  # the default lags below the chains' 8 draws
    for entry in result.chains:
        rows = slice(entry["mode"] * DRAWS, (entry["mode"] + 1) * DRAWS)
        stored = chain_statistics(weights[rows][None], lags)
        assert entry["r_hat"]["median"] == stored.r_hat.median
        assert entry["ess"]["median"] == stored.ess.median
        removed = chain_statistics(flat[rows][None], lags)
        assert entry["symmetries_removed"]["r_hat"]["median"] == removed.r_hat.median
        assert entry["symmetries_removed"]["ess"]["median"] == removed.ess.median
        assert entry["symmetries_removed"]["r_hat_above_1_01"] == \
            removed.r_hat_above_strict
    spread = chain_spread([flat[:DRAWS], flat[DRAWS:]])
    assert result.between_chains["pairs"][0]["weights"] == spread.distance[0, 1]
    assert result.between_chains["weights"]["modes"] == spread.count
    assert result.between_chains["sentence"].startswith(spread.sentence())


def test_each_samples_test_log_likelihood_is_its_own_predictions(hmc_zoo, monkeypatch):
    """Each sample's mean log p(y | x) over the digits test split, computed plainly here
    by torch, against diagnose's (predicted by torch too, so that both take the same
    float32 probabilities): only the float64 sum of the n logs may differ in order,
    ``gamma(n, U64)`` of the sum of their magnitudes."""
    import functools

    import torch

    from posteriorzoo.collection import evaluation
    from posteriorzoo.data import load_dataset
    from posteriorzoo.models import build
    from posteriorzoo.zoo import open_zoo

    monkeypatch.setattr(evaluation, "member_probabilities",
                        functools.partial(evaluation.member_probabilities, engine="torch"))
    result = diagnose(hmc_zoo)
    data = load_dataset("digits", "test")
    images = evaluation.normalized_images(data)
    labels = np.asarray(data.labels)
    expected, bounds = [], []
    with open_zoo(hmc_zoo) as zoo, torch.no_grad():
        model = build(zoo.architecture, num_classes=zoo.num_classes,
                      **zoo.model_options).eval()
        for index in range(len(zoo)):
            model.load_state_dict(zoo.state_dict(index))
            probabilities = torch.softmax(model(images), dim=1).numpy().astype(np.float64)
            logs = np.log(np.clip(probabilities[np.arange(len(labels)), labels], 1e-12,
                                  None))
            expected.append(logs.mean())
            bounds.append(gamma(len(labels), U64) * np.abs(logs).mean())
    expected, bounds = np.array(expected), np.array(bounds)
    for entry in result.chains:
        rows = slice(entry["mode"] * DRAWS, (entry["mode"] + 1) * DRAWS)
        series = expected[rows]
        # each chain's mean of its samples' log-likelihoods (DRAWS more additions)
        assert entry["log_likelihood"]["mean"][0] == pytest.approx(
            series.mean(), abs=bounds[rows].max() + gamma(DRAWS, U64) * np.abs(series).mean())
        assert entry["log_likelihood"]["draws"] == DRAWS
        assert entry["log_likelihood"]["mean"][0] < 0
    between = result.between_chains
    assert between["log_likelihood"]["chains"] == 2
    assert "in test log-likelihood" in between["sentence"]


def test_the_predictive_statistics_reuse_the_members_predictions(hmc_zoo):
    """Diagnose's per-sample log-likelihoods are evaluate's member NLLs (the predictions
    IDMI uses, computed once): the ESS and R-hat of them, bit for bit."""
    from posteriorzoo.collection import evaluate

    result = diagnose(hmc_zoo)
    log_likelihood = -np.asarray(evaluate(hmc_zoo).member_nll)
    for entry in result.chains:
        rows = slice(entry["mode"] * DRAWS, (entry["mode"] + 1) * DRAWS)
        direct = series_statistics(log_likelihood[rows][None], (1, 5))
        assert entry["log_likelihood"]["ess"] == direct.ess
        assert entry["log_likelihood"]["r_hat"] == direct.r_hat
    spread = chain_spread([log_likelihood[:DRAWS, None], log_likelihood[DRAWS:, None]])
    assert result.between_chains["pairs"][0]["log_likelihood"] == spread.distance[0, 1]


def _with_records(source, path, records):
    """``source`` copied with other training records (everything else as it is)."""
    from posteriorzoo.zoo import create_zoo, open_zoo

    with open_zoo(source) as zoo, create_zoo(
            path, architecture=zoo.architecture, dataset=zoo.dataset, method=zoo.method,
            num_classes=zoo.num_classes, model_options=zoo.model_options,
            template=zoo.tensor_layout, recipe=zoo.recipe) as out:
        rows = []
        for index in range(len(zoo)):
            meta = zoo.metadata_dict(index)
            rows.append({name: meta[name] for name in (
                "seed", "mode_id", "sample_id", "chain", "test_accuracy", "test_loss")})
        out.append_many([zoo.arrays(index) for index in range(len(zoo))], rows,
                        records=records)
    return path


def _record(mode, acceptance, e_bfmi):
    return {"method": "hmc", "chains": [{"chain": mode, "acceptance_rate": acceptance,
                                         "e_bfmi": e_bfmi, "target_accept": 0.8,
                                         "step_size": 1e-3, "leapfrog_steps": 4,
                                         "divergences": 0}]}


def test_the_sampler_flags_fire_on_a_bad_record_and_not_on_a_healthy_one(hmc_zoo, tmp_path,
                                                                          capsys):
    path = _with_records(hmc_zoo, tmp_path / "crafted.h5",
                         {0: _record(0, 0.2, 0.1), 1: _record(1, 0.8, 0.9)})
    result = diagnose(path, predictions=False)
    assert f"{E_BFMI_FLAG} (mode 0)" in result.flags
    assert f"{ACCEPTANCE_FLAG} (mode 0)" in result.flags
    assert not any("E-BFMI" in flag or "acceptance" in flag for flag in result.flags
                   if "mode 1" in flag or "modes" in flag)
    assert result.chains[0]["acceptance_rate"] == [0.2]
    assert result.chains[0]["e_bfmi"] == [0.1]
    assert main(["diagnose", str(path), "--no-predictions"]) == 0
    out = capsys.readouterr().out
    assert "sampler: acceptance 0.2 (target 0.8), E-BFMI 0.1, step 0.001 x 4" in out
    assert f"FLAG {E_BFMI_FLAG} (mode 0)" in out
    assert "between chains: 2 chains in " in out
    healthy = _with_records(hmc_zoo, tmp_path / "healthy.h5",
                            {0: _record(0, 0.8, 0.9), 1: _record(1, 0.7, 0.5)})
    assert not any("E-BFMI" in flag or "acceptance" in flag
                   for flag in diagnose(healthy, predictions=False).flags)


def test_sampler_flags_at_their_thresholds():
    low, high = ACCEPTANCE_BAND
    assert E_BFMI_LIMIT == 0.3 and (low, high) == (0.5, 0.99)
    assert {E_BFMI_FLAG, ACCEPTANCE_FLAG} <= set(FLAGS)
    assert sampler_flags(0.8, 0.9) == []
    assert sampler_flags(low, E_BFMI_LIMIT) == [] and sampler_flags(high, 1.0) == []
    assert sampler_flags(0.2, 0.1) == [E_BFMI_FLAG, ACCEPTANCE_FLAG]
    assert sampler_flags(np.nextafter(low, 0), 0.9) == [ACCEPTANCE_FLAG]
    assert sampler_flags(np.nextafter(high, 1), 0.9) == [ACCEPTANCE_FLAG]
    assert sampler_flags(0.8, np.nextafter(E_BFMI_LIMIT, 0)) == [E_BFMI_FLAG]
    assert sampler_flags(None, None) == []
    with pytest.raises(InvalidOptionError):
        sampler_flags(float("nan"), 0.5)


# ------------------------------------------------------------------ the pure functions
def test_within_chain_r_hat_of_two_far_apart_gaussians_is_one_across_it_is_not():
    """Two chains of 500 independent draws, N(0, I_5) and N(50, I_5). Each chain's own
    split R-hat: for independent draws the two halves' means differ by chance only, and
    R-hat - 1 is about F / (2 x 250) with F ~ F(1, 498): F > 20 (R-hat > 1.04) has
    probability 1e-5. Across the two chains rank normalisation caps R-hat: fully
    separated chains split into four halves give normal scores whose half means are
    +-E|Z| = +-sqrt(2 / pi), so R-hat tends to sqrt(1 + (4 / 3)(2 / pi) / (1 - 2 / pi))
    = 1.827, far above the 1.05 flag; the draws' Monte Carlo error moves it by about
    0.004 (the halves' means of 250 scores each), so 0.02 is 5 of it."""
    rng = np.random.default_rng(1)
    draws = np.stack([rng.standard_normal((500, 5)), 50 + rng.standard_normal((500, 5))])
    for chain in draws:
        within = chain_statistics(chain[None])
        assert abs(within.r_hat.median - 1) < 0.04 and within.flags() == []
    across = chain_statistics(draws)
    share = 2 / math.pi
    assert across.r_hat.median == pytest.approx(math.sqrt(1 + 4 / 3 * share / (1 - share)),
                                                abs=0.02)
    assert "chains disagree (R-hat > 1.05)" in across.flags()
    # said as modes instead: means 50 sqrt(5) apart, each chain's sd sqrt(5): 50 sd. The
    # sd's Monte Carlo error is sqrt(1 / (2 x 5 x 499)) = 1.4% per chain (1% pooled), the
    # means' 0.1%: 5% is 5 of it.
    spread = chain_spread(list(draws))
    assert spread.count == 2 and spread.distance[0, 1] == pytest.approx(50, rel=0.05)
    assert spread.sentence().startswith("2 chains in 2 separate modes (between-chain "
                                        "distance 5")


def test_chain_spread_closed_form():
    """Chains ``m + s [e1, -e1, e2, -e2]``: mean ``m``, per-coordinate variance (ddof 1)
    ``2 s^2 / 3``, so within-chain sd ``sqrt(4 s^2 / 3)``; integers keep the means and
    variances exact, and a distance is then a square root, a quotient and a square root
    of exact numbers (a few roundings: ``gamma(4, U64)``)."""
    def chain(mean, s):
        steps = np.array([[1, 0], [-1, 0], [0, 1], [0, -1]], dtype=np.float64)
        return np.asarray(mean, dtype=np.float64) + s * steps

    spread = chain_spread([chain((0, 0), 3), chain((30, 40), 6), chain((3, 4), 3)])
    bound = gamma(4, U64)
    assert spread.within == pytest.approx([math.sqrt(12), math.sqrt(48), math.sqrt(12)],
                                          rel=bound, abs=0)
    assert spread.distance[0, 1] == pytest.approx(50 / math.sqrt(30), rel=bound, abs=0)
    assert spread.distance[0, 2] == pytest.approx(5 / math.sqrt(12), rel=bound, abs=0)
    assert spread.distance[1, 2] == pytest.approx(45 / math.sqrt(30), rel=bound, abs=0)
    assert np.array_equal(spread.distance, spread.distance.T)
    assert np.all(np.diag(spread.distance) == 0)
    # 1.44 <= 2 joins the first and the third; 9.1 and 8.2 separate the second
    assert SEPARATE_MODES == 2 and spread.modes.tolist() == [0, 1, 0] and spread.count == 2
    assert spread.sentence() == ("3 chains in 2 separate modes (between-chain distance "
                                 "1.4 to 9.1 within-chain sd)")
    # a chain joined through another (single linkage): 1.44 + 1.44 apart, one mode
    linked = chain_spread([chain((0, 0), 3), chain((3, 4), 3), chain((6, 8), 3)],
                          separation=1.5)
    assert linked.distance[0, 2] > 1.5 and linked.count == 1
    assert linked.sentence().startswith("3 chains in 1 mode (")


def test_chain_spread_refuses_bad_chains():
    with pytest.raises(SampleSizeError):
        chain_spread([np.zeros((1, 3)), np.zeros((4, 3))])
    with pytest.raises(InvalidOptionError):
        chain_spread([np.zeros((4, 3)), np.zeros((4, 2))])
    with pytest.raises(InvalidOptionError):
        chain_spread([np.full((4, 3), np.nan)])
    with pytest.raises(InvalidOptionError):
        chain_spread([np.zeros((4, 3))], separation=0.0)


def test_predictive_ess_of_an_ar1_series_matches_its_closed_form():
    """A stationary AR(1) series ``x_t = phi x_(t-1) + sqrt(1 - phi^2) e_t`` has lag-k
    autocorrelation ``phi^k`` and ESS ``n (1 - phi) / (1 + phi)`` (n / (1 + 2 sum_k (1 -
    k / n) phi^k) exactly: 333.8 here, against 333.3 in the limit). 200 independent series
    of n = 1000 at phi = 0.5: their mean ESS is compared with the closed form within 4
    standard errors of that mean, the errors measured from the series themselves (one
    series' ESS spreads by about 14%, Sokal's sqrt(2 (2M + 1) / n) for a window M near 10),
    which also holds the estimator's own bias, O(tau / n) of it (0.3%). The lag-1
    autocorrelation likewise, its estimator's bias -(1 + 3 phi) / n = -0.0025 inside its
    4 standard errors (0.0076)."""
    rng = np.random.default_rng(7)
    phi, n, count = 0.5, 1000, 200
    series = np.empty((count, n))
    series[:, 0] = rng.standard_normal(count)
    for t in range(1, n):
        series[:, t] = phi * series[:, t - 1] + math.sqrt(1 - phi**2) * rng.standard_normal(
            count)
    stats = [series_statistics(one[None], lags=(1, 2)) for one in series]
    ess = np.array([s.ess for s in stats])
    error = ess.std(ddof=1) / math.sqrt(count)
    closed = n / (1 + 2 * sum((1 - k / n) * phi**k for k in range(1, n)))
    assert closed == pytest.approx(n * (1 - phi) / (1 + phi), rel=0.002)
    assert abs(ess.mean() - closed) < 4 * error
    lag1 = np.array([s.autocorrelation[1] for s in stats])
    assert abs(lag1.mean() - phi) < 4 * lag1.std(ddof=1) / math.sqrt(count)
    assert stats[0].chains == 1 and stats[0].draws == n
    with pytest.raises(InvalidOptionError):
        series_statistics(series[0])
