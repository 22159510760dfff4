"""The seeds' variants as trainer methods (ECMP and Rank-1, wired like EMP): what their
collections hold, checked on the samples themselves."""

from __future__ import annotations

import numpy as np
import pytest
from rounding_bounds import U64, gamma

from train_zoo import make_spec
from train_zoo.data import load_training_data
from train_zoo.methods import emp, rank1, registry
from train_zoo.programs import produce_mode


@pytest.fixture(scope="module")
def digits():
    return load_training_data("digits")


def _spec(method: str, epochs: int, samples: int = 4, **options):
    return make_spec(recipe="optunet-mnist", dataset="digits", method=method, modes=1,
                     samples_per_mode=samples, base_seed=5, method_options=options,
                     recipe_overrides={"epochs": epochs})


def test_registry_holds_ecmp_and_rank1_as_their_modules_objects():
    assert registry.REGISTRY["ecmp"] is emp.ECMP and emp.ECMP.name == "ecmp"
    assert registry.REGISTRY["rank-1"] is rank1.METHOD


def test_ecmp_samples_draw_each_element_from_one_of_the_components(digits):
    results = produce_mode(_spec("ecmp", 2, samples=6), 0, digits, "auto")
    assert {r.record["variant"] for r in results} == {"ecmp"} and results[0].engine == "torch"
    patched = results[0].record["patched"]
    assert patched == ["conv1.weight", "fc.bias", "fc.weight"]  # OptuNet: in+out
    states = [r.state for r in results]
    for key in states[0]:
        stack = np.stack([s[key] for s in states])
        if key not in patched:  # outside the patch layers every sample is the same
            assert (stack == stack[0]).all(), key
            continue
        # per element: two samples agree on some elements and differ on others (one
        # component per layer, EMP's draw, would make them agree everywhere or nowhere)
        same = stack[0] == stack[1:]
        assert same.any() and (~same).any(), key
        # each element takes at most K = 5 values across the samples
        assert max(len(np.unique(column)) for column in stack.reshape(len(states), -1).T) <= 5


def test_rank1_samples_of_a_mode_differ_by_an_outer_product_on_every_weight(digits):
    results = produce_mode(_spec("rank-1", 1), 0, digits, "auto")
    assert len(results) == 4 and results[0].engine == "torch"
    assert results[0].record["layers"] == ["conv1", "conv2", "fc"]
    first, second = results[0].state, results[1].state
    # A sample's weight is fold's float32 (W r) s: two roundings of W r s (at most 2 u64
    # more if a factor is float64); the ratio of two samples is one more float32
    # division: each entry is rho (1 + theta), |theta| <= gamma(5), with the exact
    # rho = (r1 / r2) (s1 / s2) (the shared W cancels).
    # So two entries of one kernel are within 2 gamma(5) |rho| <= t |ratio| of each other,
    # t = 2 gamma(5) / (1 - gamma(5)). And the matrix is rank one up to E = rho * theta,
    # ||E||_2 <= ||E||_F <= gamma(5) ||rho||_F = gamma(5) sigma_1(rho): by Weyl,
    # sigma_2 <= gamma(5) / (1 - gamma(5)) sigma_1 of the computed matrix, plus the
    # float64 SVD's own error (backward stable: gamma(size) in u64 of sigma_1). Measured
    # (host and AVX2): 0.21-0.38 of the first tolerance, 0.11 of the second (fc).
    # Per-element noise, or a factor on a kernel axis, is off by O(1).
    rounding = gamma(5)
    for key in ("conv1.weight", "conv2.weight", "fc.weight"):
        ratio = (first[key] / second[key]).astype(np.float64)
        # (r1 / r2) (s1 / s2)^T on the output and input axes, constant over a kernel
        if ratio.ndim == 4:
            assert np.allclose(ratio, ratio[..., :1, :1],
                               rtol=2 * rounding / (1 - rounding), atol=0), key
            ratio = ratio[..., 0, 0]
        singular = np.linalg.svd(ratio, compute_uv=False)
        tolerance = rounding / (1 - rounding) + gamma(ratio.size, U64)
        assert singular[1:].max(initial=0) <= tolerance * singular[0], key
        assert not np.allclose(ratio, 1.0)  # the draws differ


def test_rank1_trains_with_the_references_momentum(digits):
    """Plain SGD (OptuNet's recipe) leaves the mixture at chance on digits; Nesterov 0.9
    learns: the last epoch's NLL is well below log(10), and the KL has fallen."""
    result = produce_mode(_spec("rank-1", 30, samples=1), 0, digits, "auto")[0]
    loss = result.record["loss"]
    assert loss["last_epoch"]["nll"] < 0.75 * np.log(10)
    assert loss["last_epoch"]["kl"] < 0.1 * loss["first_epoch"]["kl"]
    assert not result.diverged and result.metrics["test_accuracy"] > 0.25  # chance: 0.1
    # the recorded scales: every factor starts at init_std; its rho moves, though little
    # (the KL's gradient on rho is about sigmoid(rho) / (sigma N), 2e-2 per step on digits:
    # at lr 0.04 over 660 steps, rho moves by about 0.03, as BBB's under plain SGD)
    scales = result.record["scales"]
    assert list(scales) == [f"{layer}.{factor}" for layer in ("conv1", "conv2", "fc")
                            for factor in "rs"]
    for moved in scales.values():
        assert moved["scale_median_start"] == pytest.approx(rank1.INIT_STD, rel=0.1)
        assert 0 < moved["rho_max_change"] < 1
        assert moved["scale_median_end"] != moved["scale_median_start"]
