"""BYOV (seed 004): the numerical core (train_zoo.byov) and ``posteriorzoo study byov``.

Small sizes only: a few hundred images, one epoch.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from rounding_bounds import U32, U64, gamma
from torch.distributions import Normal, kl_divergence

from analysis.studies.byov import QUICK, fit_linear_probe, run_byov_study
from posteriorzoo.models import build
from posteriorzoo.zoo import open_zoo
from train_zoo import byov
from train_zoo.byov import (
    LOG_VARIANCE_INIT,
    MEAN_INIT_STD,
    PRIORS,
    TEACHER_VARIANCE_FLOOR,
    ByolNetwork,
    ByovConfig,
    ByovStepper,
    Posterior,
    Teacher,
    beta_at,
    byol_loss,
    draw_seed,
    initial_posterior,
    initial_teacher,
    keep_mask,
    prior_moments,
    prune,
    pruned_keys,
    sample_parameters,
    sigma,
    snr,
    symmetric_byol_loss,
    tau_at,
    teacher_update,
)

STUDY_MODULE = "posteriorzoo.cli.study_command"

#: beta_at / tau_at against their formula in Python floats: each side within 6 u
#: (libm's cos within 1 ulp, 2 u of values up to 1, and four sums, products and halvings)
#: plus the argument's two roundings (2 u pi, carried by |sin| <= 1); two sides.
SCHEDULE_TOLERANCE = 2 * (6 + 2 * math.pi) * U64


def _byol_bound(dim: int, batch: int) -> float:
    """How far two float64 evaluations of the BYOL loss may lie apart: a row's cosine
    within gamma(D + 8) of 1 (a D-term dot product of unit vectors, two norms with their
    sums, square roots and divisions), 2 - 2 cos within twice that, and the mean of B
    terms of at most 4 within gamma(B + 1) of 4; two sides."""
    return 2 * (2 * gamma(dim + 8, U64) + 4 * gamma(batch + 1, U64))

@pytest.fixture(scope="module")
def network():
    return ByolNetwork(widths=(4, 8), hidden=16, projection=8)


def random_posterior(network, seed: int) -> Posterior:
    """Means and log-variances spread over a wide range (not the initial ones), float64
    (so that the teacher's variances, differences of squares, are exact enough)."""
    generator = torch.Generator().manual_seed(seed)
    means = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64)
             for k, p in network.named_parameters()}
    log_variances = {k: -3 + 2 * torch.randn(p.shape, generator=generator, dtype=torch.float64)
                     for k, p in network.named_parameters()}
    return Posterior(means, log_variances)


def random_teacher(posterior: Posterior, seed: int) -> Teacher:
    """A teacher whose second moments give variances above and below the floor."""
    generator = torch.Generator().manual_seed(seed)
    means = {k: v + 0.3 * torch.randn(v.shape, generator=generator, dtype=torch.float64)
             for k, v in posterior.means.items() if k.startswith(("encoder.", "projector."))}
    spread = {k: torch.rand(v.shape, generator=generator, dtype=torch.float64) * 2e-4
              for k, v in means.items()}
    return Teacher(means, {k: v.square() + spread[k] for k, v in means.items()})


# --- the KL terms ---------------------------------------------------------------------------

@pytest.mark.parametrize("prior", PRIORS)
def test_kl_matches_torch_distributions_for_each_prior(network, prior):
    posterior = random_posterior(network, 0)
    teacher = random_teacher(posterior, 1)
    means, variances = prior_moments(prior, posterior.means, teacher)
    ours = byov.kl_divergence(posterior, means, variances)
    expected = torch.zeros((), dtype=torch.float64)
    below_floor = 0
    for key, mu in posterior.means.items():
        q = Normal(mu, torch.exp(0.5 * posterior.log_variances[key]))
        in_teacher = key in teacher.means
        if prior == "standard" or not in_teacher:          # the predictor: N(0, I) always
            p_mean, p_var = torch.zeros_like(mu), torch.ones_like(mu)
        elif prior == "teacher":
            p_mean, p_var = teacher.means[key], torch.ones_like(mu)
        else:
            raw = teacher.second_moments[key] - teacher.means[key] ** 2
            below_floor += int((raw < TEACHER_VARIANCE_FLOOR).sum())
            p_mean, p_var = teacher.means[key], raw.clamp_min(TEACHER_VARIANCE_FLOOR)
        expected += kl_divergence(q, Normal(p_mean, p_var.sqrt())).sum()
    # Each entry's KL in float64, either form (torch's (r + t - 1 - log r) / 2 with the
    # variances' square roots squared again, or the module's): 16 roundings at most of
    # the pieces' sizes |log v| + |log s^2| + (s^2 + (mu - m)^2) / v + 1 (the prior
    # variance itself is the same float64 operations on both sides: the same bits), and
    # the sum over n entries: 2 gamma(n + 16, U64) of the pieces' sum. A wrong prior
    # (floor not applied, the teacher's mean ignored) is off by O(1) or more.
    pieces, count = 0.0, 0
    for key, mu in posterior.means.items():
        log_var = posterior.log_variances[key]
        size = (variances[key].log().abs() + log_var.abs()
                + (log_var.exp() + (mu - means[key]) ** 2) / variances[key] + 1)
        pieces, count = pieces + float(size.sum()), count + size.numel()
    assert abs(float(ours) - float(expected)) <= 2 * gamma(count + 16, U64) * pieces
    if prior == "teacher-variance":
        assert below_floor > 0          # the floor was exercised


def test_teacher_priors_need_a_teacher_and_the_predictor_keeps_n01(network):
    posterior = random_posterior(network, 2)
    with pytest.raises(Exception, match="teacher"):
        prior_moments("teacher", posterior.means, None)
    teacher = random_teacher(posterior, 3)
    means, variances = prior_moments("teacher-variance", posterior.means, teacher)
    for key in posterior.means:
        if key.startswith("predictor."):
            assert (means[key] == 0).all() and (variances[key] == 1).all()
        else:
            # passed through: the same values
            torch.testing.assert_close(means[key], teacher.means[key], rtol=0, atol=0)


# --- initialisation and parameterisation -----------------------------------------------------

def test_initial_posterior_follows_the_paper():
    net = ByolNetwork()
    posterior = initial_posterior(net, seed=5)
    modules = dict(net.named_modules())
    weights = []
    for key, mean in posterior.means.items():
        assert (posterior.log_variances[key] == LOG_VARIANCE_INIT).all()
        module = modules[key.rsplit(".", 1)[0]]
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)) and key.endswith("weight"):
            assert mean.abs().max() <= 2 * MEAN_INIT_STD
            weights.append(mean.reshape(-1))
        elif key.endswith("bias"):
            assert (mean == 0).all()
        else:                                                   # norm weights
            assert (mean == 1).all()
    pooled = torch.cat(weights)
    # trunc-normal at +-2 std has std 0.02 * 0.8796
    assert float(pooled.std()) == pytest.approx(MEAN_INIT_STD * 0.8796, rel=0.03)
    # Deterministic at seed 5 (float32 uniforms from the generator, the same bits on every
    # CPU, through erfinv, whose last bits may differ: far below this): measured sd
    # 0.017569 against 0.017592: z 0.39 of its standard error sd / sqrt(2 n), n = 43,664
    # (the 3% allowed is 8.9 standard errors)
    sigmas = sigma(posterior.log_variances)
    for value in sigmas.values():
        # exp in float32 within 1 ulp (2 u) of exp(-5), the reference within u of it
        torch.testing.assert_close(value, torch.full_like(value, math.exp(-5.0)),
                                   rtol=3 * U32, atol=0)
    again = initial_posterior(net, seed=5)
    other = initial_posterior(net, seed=6)
    key = "encoder.convs.1.weight"
    assert torch.equal(again.means[key], posterior.means[key])
    assert not torch.equal(other.means[key], posterior.means[key])


def test_a_draw_is_mean_plus_exp_half_log_variance_times_noise(network):
    posterior = random_posterior(network, 4)
    noise = {k: torch.randn(v.shape, dtype=torch.float64) for k, v in posterior.means.items()}
    draw = sample_parameters(posterior, noise)
    for key, value in draw.items():
        spread = torch.sqrt(torch.exp(posterior.log_variances[key])) * noise[key]
        expected = posterior.means[key] + spread
        # exp(lv / 2) against sqrt(exp(lv)): each within 2 ulp (4 u) of sigma, the
        # product and the sum one rounding each: 10 u of |mu| + |sigma eps| for two sides
        size = posterior.means[key].abs() + spread.abs()
        assert ((value - expected).abs() <= 10 * U64 * size).all()


# --- the EMA teacher and the schedules -------------------------------------------------------

def test_teacher_update_is_the_ema_formula(network):
    posterior = random_posterior(network, 7)
    teacher = random_teacher(posterior, 8)
    student = random_posterior(network, 9).means
    tau = 0.97
    updated = teacher_update(teacher, student, tau)
    # the module's own elementwise float64 operations in its order (each correctly
    # rounded, x ** 2 is x * x): the same bits on every CPU
    for key, value in teacher.means.items():
        torch.testing.assert_close(updated.means[key], tau * value + (1 - tau) * student[key],
                                   rtol=0, atol=0)
        torch.testing.assert_close(updated.second_moments[key],
                                   tau * teacher.second_moments[key]
                                   + (1 - tau) * student[key] ** 2, rtol=0, atol=0)
    assert not any(k.startswith("predictor.") for k in updated.means)


def test_a_training_step_moves_the_teacher_by_the_ema_of_the_new_means(network):
    config = ByovConfig(widths=(4, 8), hidden=16, projection=8, epochs=1, batch_size=4)
    posterior = initial_posterior(network, 0)
    stepper = ByovStepper(network, posterior, "teacher-variance", config, total_steps=10,
                          num_images=100, generator=torch.Generator().manual_seed(0))
    before = initial_teacher(posterior)
    views = torch.randn(8, 1, 12, 12, generator=torch.Generator().manual_seed(1))
    loss = stepper.step((views, torch.zeros(4)), config.lr)
    assert math.isfinite(loss) and stepper.beta == 0.0          # beta at step 0
    tau = tau_at(1, 10, config.tau_base)
    new_means = stepper.posterior().means
    for key, value in before.means.items():
        assert not torch.equal(new_means[key], posterior.means[key])   # the student moved
        # teacher_update's elementwise operations on the same tau and means: bit-identical
        torch.testing.assert_close(stepper.teacher.means[key],
                                   tau * value + (1 - tau) * new_means[key], rtol=0, atol=0)
    # the log-variances are trained too
    assert not torch.equal(stepper.posterior().log_variances["encoder.convs.0.weight"],
                           posterior.log_variances["encoder.convs.0.weight"])


def test_beta_is_a_single_cycle_cosine_from_zero_to_one():
    total = 200
    assert beta_at(0, total) == 0.0
    assert beta_at(total, total) == pytest.approx(1.0, rel=0, abs=SCHEDULE_TOLERANCE)
    assert beta_at(total // 2, total) == pytest.approx(0.5, rel=0, abs=SCHEDULE_TOLERANCE)
    values = [beta_at(step, total) for step in range(total + 1)]
    assert all(b >= a for a, b in zip(values, values[1:], strict=False))
    for step in (13, 50, 150, 199):
        assert beta_at(step, total) == pytest.approx((1 - math.cos(math.pi * step / total)) / 2,
                                                     rel=0, abs=SCHEDULE_TOLERANCE)
    # slow at both ends: the first and last quarters each rise by less than 0.15
    assert beta_at(total // 4, total) < 0.15 and beta_at(3 * total // 4, total) > 0.85
    assert beta_at(100, total, 0.0, 0.3) == pytest.approx(0.15, rel=0, abs=SCHEDULE_TOLERANCE)
    assert tau_at(0, total, 0.99) == pytest.approx(0.99, rel=0, abs=SCHEDULE_TOLERANCE)
    assert tau_at(total, total, 0.99) == pytest.approx(1.0, rel=0, abs=SCHEDULE_TOLERANCE)


# --- the BYOL loss -----------------------------------------------------------------------------

def test_byol_loss_against_a_direct_computation():
    rng = np.random.default_rng(0)
    p1, p2, z1, z2 = (rng.normal(size=(6, 5)) for _ in range(4))

    def direct(p, z):
        cos = (p * z).sum(1) / np.linalg.norm(p, axis=1) / np.linalg.norm(z, axis=1)
        return float(np.mean(2 - 2 * cos))

    tensors = [torch.tensor(a) for a in (p1, p2, z1, z2)]
    bound = _byol_bound(5, 6)     # 3.3e-15; a wrong loss (no normalisation) is off by O(1)
    assert float(byol_loss(tensors[0], tensors[2])) == pytest.approx(direct(p1, z1), rel=0,
                                                                       abs=bound)
    # the sum adds one rounding of a value at most 8
    assert float(symmetric_byol_loss(*tensors)) == pytest.approx(
        direct(p1, z2) + direct(p2, z1), rel=0, abs=2 * bound + 16 * U64)
    # exact answers 0 and 4: one side's rounding
    assert float(byol_loss(tensors[0], 3 * tensors[0])) == pytest.approx(0.0, abs=bound / 2)
    assert float(byol_loss(tensors[0], -tensors[0])) == pytest.approx(4.0, rel=0,
                                                                       abs=bound / 2)
    # no gradient flows into the targets (the teacher)
    p = torch.tensor(p1, requires_grad=True)
    z = torch.tensor(z1, requires_grad=True)
    byol_loss(p, z).backward()
    assert p.grad is not None and z.grad is None


# --- pruning -----------------------------------------------------------------------------------

@pytest.mark.parametrize("size, sparsity", [(10, 0.25), (37, 0.5), (144, 0.9), (7, 0.0),
                                            (9, 0.95), (1000, 0.333)])
def test_keep_mask_keeps_exactly_the_requested_fraction_of_the_largest(size, sparsity):
    scores = torch.randn(size, generator=torch.Generator().manual_seed(size))
    mask = keep_mask(scores.reshape(-1, 1) if size % 2 else scores, sparsity).reshape(-1)
    assert int(mask.sum()) == size - round(sparsity * size)
    if 0 < mask.sum() < size:
        assert scores[mask].min() >= scores[~mask].max()


def test_snr_pruning_keeps_the_highest_snr_weights_of_each_layer(network):
    posterior = random_posterior(network, 11)
    ratios = snr(posterior)
    for key, value in ratios.items():
        # snr's own elementwise float64 operations in its order: the same bits everywhere
        torch.testing.assert_close(value, posterior.means[key].abs()
                                   / torch.exp(0.5 * posterior.log_variances[key]),
                                   rtol=0, atol=0)
    keys = pruned_keys(posterior.means)
    assert keys == ["encoder.convs.0.weight", "encoder.convs.1.weight"]
    pruned, masks = prune(posterior.means, ratios, 0.75, keys)
    for key in posterior.means:
        if key not in keys:
            assert torch.equal(pruned[key], posterior.means[key])
            continue
        mask = masks[key]
        assert int(mask.sum()) == mask.numel() - round(0.75 * mask.numel())
        assert ratios[key][mask].min() >= ratios[key][~mask].max()
        assert (pruned[key][~mask] == 0).all()
        assert torch.equal(pruned[key][mask], posterior.means[key][mask])
    # SNR and magnitude disagree on these weights (the variances differ)
    magnitude, _ = prune(posterior.means, {k: v.abs() for k, v in posterior.means.items()},
                         0.75, keys)
    assert not torch.equal(magnitude[keys[1]], pruned[keys[1]])


# --- the linear probe ----------------------------------------------------------------------------

def test_linear_probe_separates_separable_classes_and_is_deterministic():
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(3, 4)) * 4
    labels = np.repeat(np.arange(3), 50)
    features = centres[labels] + rng.normal(size=(150, 4))
    probe = fit_linear_probe(features, labels, 3)
    p = probe.probabilities(features)
    # a float64 softmax of K = 3: each entry within (K + 8) u of its share, the sum gamma(2)
    np.testing.assert_allclose(p.sum(1), 1.0, rtol=0, atol=gamma(3 + 8 + 2, U64))
    assert (p.argmax(1) == labels).mean() > 0.97
    again = fit_linear_probe(features, labels, 3)
    np.testing.assert_array_equal(again.weight, probe.weight)


def test_recalibration_undoes_a_per_feature_shift_and_scale():
    rng = np.random.default_rng(4)
    labels = np.repeat(np.arange(3), 40)
    features = rng.normal(size=(3, 5))[labels] * 3 + rng.normal(size=(120, 5))
    probe = fit_linear_probe(features, labels, 3)
    scale, shift = rng.uniform(0.2, 5, size=5), rng.normal(size=5) * 10
    moved = features * scale + shift
    wrong = probe.probabilities(moved)
    right = probe.recalibrated(moved).probabilities(moved)
    # Standardising: each side's standardised feature within gamma(2 n + 8) of (its
    # largest |value| plus |mean|) over its sd (the mean's n terms, the variance's n
    # squares and sums, the square root, the subtraction and division; plus the two
    # roundings of moved's scale and shift), the logits within |W| of that (plus their
    # own D + 2 roundings), and probabilities within 2 E of the logits' change E, plus
    # a float64 softmax's K + 8 roundings a side. A wrong recalibration is off by > 0.1.
    # Measured 3.5e-17 against 3.5e-12 (was atol 1e-10).
    def spread(values):
        scale = np.abs(values).max(0) + np.abs(values.mean(0))
        return gamma(2 * len(values) + 8, U64) * scale / values.std(0)

    standardised = (features - probe.feature_mean) / probe.feature_std
    logit_error = (np.abs(probe.weight).T @ (spread(moved) + spread(features))
                   + 2 * gamma(5 + 2, U64) * (np.abs(standardised) @ np.abs(probe.weight)
                                              + np.abs(probe.bias)).max(0))
    allowed = 2 * float(logit_error.max()) + 2 * gamma(3 + 8, U64)
    np.testing.assert_allclose(right, probe.probabilities(features), rtol=0, atol=allowed)
    assert np.abs(wrong - right).max() > 0.1
    np.testing.assert_array_equal(probe.recalibrated(moved).weight, probe.weight)


# --- the study: samples in the zoo, the command line ---------------------------------------------

@pytest.fixture(scope="module")
def small_study():
    return run_byov_study(("teacher-variance",), seed=2, train_images=192, test_images=64,
                          epochs=1, batch_size=64, samples=3, sparsities=(0.5,))


def test_written_samples_load_into_the_zoo_and_reproduce_the_encoder(small_study, tmp_path):
    paths = small_study.write(tmp_path / "study")
    assert {"byov-teacher-variance.h5", "byol.h5", "study-byov.json"} <= set(paths)
    posterior = small_study.posteriors["byov-teacher-variance"]
    seeds = small_study.provenance["seeds"]
    images = torch.randn(5, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with open_zoo(paths["byov-teacher-variance.h5"]) as zoo:
        assert len(zoo) == 3 and zoo.architecture == "small-cnn" and zoo.method == "byov"
        metadata = zoo.metadata
        model = build(zoo.architecture, zoo.num_classes, **zoo.model_options).eval()
        outputs = []
        for index in range(len(zoo)):
            # draw i again from its own seed: mu + exp(log_var / 2) * eps, encoder key order
            seed = draw_seed(seeds["draws"], index)
            assert int(metadata["seed"][index]) == seed
            generator = torch.Generator().manual_seed(seed)
            expected = {}
            for key in model.state_dict():
                full = f"encoder.{key}"
                eps = torch.randn(posterior.means[full].shape, generator=generator)
                expected[key] = (posterior.means[full]
                                 + torch.exp(0.5 * posterior.log_variances[full]) * eps)
            stored = zoo.state_dict(index)
            for key, value in expected.items():
                torch.testing.assert_close(stored[key], value, rtol=0, atol=0)
            model.load_state_dict(stored)
            with torch.no_grad():
                out = model(images)
            reference = build("small-cnn", **zoo.model_options)
            with torch.no_grad():
                direct = torch.func.functional_call(reference, expected, (images,))
            # the same float32 network on the same weights (checked equal above) and inputs
            # in one process: the same kernels, the same bits
            torch.testing.assert_close(out, direct, rtol=0, atol=0)
            outputs.append(out)
        assert not torch.allclose(outputs[0], outputs[1])        # different draws
        assert metadata["test_accuracy"].min() >= 0 and metadata["sample_id"].tolist() == [0, 1, 2]
        records = zoo.training_records()
        assert records[0]["prior"] == "teacher-variance"
    with open_zoo(paths["byol.h5"]) as zoo:
        assert len(zoo) == 1 and zoo.method == "byol"
        means = small_study.posteriors["byol"].means
        for key, value in zoo.state_dict(0).items():
            torch.testing.assert_close(value, means[f"encoder.{key}"], rtol=0, atol=0)
    data = json.loads(paths["study-byov.json"].read_text())
    assert data["collections"]["byov-teacher-variance.h5"]["checkpoints"] == 3
    with open_zoo(paths["byov-teacher-variance.h5"]) as zoo:
        assert zoo.digests == data["collections"]["byov-teacher-variance.h5"][
            "checkpoint_sha256"]


def test_study_tables_hold_every_model_and_the_same_probe_numbers(small_study):
    probe = small_study.summary["probe"]
    models = {(row["model"], row["inference"], row["input"]) for row in probe}
    assert models == {("byov-teacher-variance", i, x) for i in ("mean", "mc")
                      for x in ("clean", "noisy")} | {("byol", "point", x)
                                                      for x in ("clean", "noisy")}
    for row in probe:
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["ece"] <= 1 and 0 <= row["brier"] <= 2
    pruning = small_study.summary["pruning"]
    assert {(r["model"], r["criterion"]) for r in pruning} == {
        ("byov-teacher-variance", "snr"), ("byov-teacher-variance", "magnitude"),
        ("byol", "magnitude")}
    # whole weights: round(0.5 n) of n pruned, within 1 / (2 n) of 0.5 (counts, not
    # rounding; abs 1e-3 allows n >= 500)
    assert all(r["achieved_sparsity"] == pytest.approx(0.5, abs=1e-3) for r in pruning)
    history = small_study.summary["history"]["byov-teacher-variance"]
    assert len(history) == 1 and history[0]["beta"] == beta_at(2, 3)  # the same call


def test_cli_quick_run_writes_its_files(study_cli, capsys, tmp_path):
    out = tmp_path / "byov"
    code = study_cli(["study", "byov", "--quick", "--priors", "standard", "teacher",
                      "--seed", "4", "--no-recalibration", "--out", str(out),
                      "--no-progress", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "study-byov"
    assert data["provenance"]["seeds"]["seed"] == 4
    assert data["provenance"]["options"]["train_images"] == QUICK["train_images"]
    assert data["provenance"]["options"]["recalibrate"] is False
    assert "study byov" in data["provenance"]["command"]
    names = {p.name for p in out.iterdir()}
    assert names == {"study-byov.json", "byov_probe.csv", "byov_pruning.csv",
                     "byov_training.csv", "byov.png", "byov.pdf", "byov-standard.h5",
                     "byov-teacher.h5", "byol.h5"}
    rows = list(csv.DictReader((out / "byov_probe.csv").read_text().splitlines()))
    assert len(rows) == 2 * 4 + 2
    assert (out / "byov.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "byov.pdf").read_bytes()[:5] == b"%PDF-"
    with open_zoo(out / "byov-teacher.h5") as zoo:
        assert len(zoo) == QUICK["samples"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("argv, fragment", [
    (["--epochs", "0"], "--epochs"),
    (["--noise-std", "0"], "--noise-std"),
    (["--noise-std", "nan"], "--noise-std"),
    (["--priors", "laplace"], "--priors"),
    (["--samples", "1.5"], "--samples"),
    (["--train-images", "100", "--batch-size", "200"], "batch size 200"),
    (["--dataset", "cifar10"], "--dataset"),
])
def test_cli_bad_options_are_one_line(study_cli, capsys, tmp_path, argv, fragment):
    out = tmp_path / "byov"
    try:
        code = study_cli(["study", "byov", *argv, "--out", str(out), "--no-progress"])
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in captured.err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_cli_refuses_an_existing_output(study_cli, capsys, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code = study_cli(["study", "byov", "--quick", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def test_byov_help_imports_nothing_heavy():
    code = ("import contextlib, io, json, sys\n"
            "import posteriorzoo.cli as cli\n"
            f"if {STUDY_MODULE!r} not in cli._SUBCOMMAND_MODULES:\n"
            f"    cli._SUBCOMMAND_MODULES = (*cli._SUBCOMMAND_MODULES, {STUDY_MODULE!r})\n"
            "with contextlib.redirect_stdout(io.StringIO()) as text:\n"
            "    try:\n"
            "        cli.main(['study', 'byov', '--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "heavy = ('torch', 'numpy', 'matplotlib', 'train_zoo', 'analysis')\n"
            "print(json.dumps([[m for m in heavy if m in sys.modules], text.getvalue()]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    loaded, text = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == []
    assert "--quick" in text and "minutes" in text
