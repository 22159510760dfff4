"""The seeds' variants as trainer methods (ECMP and Rank-1, wired like EMP): what their
collections hold, checked on the samples themselves."""

from __future__ import annotations

import numpy as np
import pytest

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
    for key in ("conv1.weight", "conv2.weight", "fc.weight"):
        ratio = (first[key] / second[key]).astype(np.float64)
        # (r1 / r2) (s1 / s2)^T on the output and input axes, constant over a kernel
        if ratio.ndim == 4:
            assert np.allclose(ratio, ratio[..., :1, :1], rtol=1e-4), key
            ratio = ratio[..., 0, 0]
        singular = np.linalg.svd(ratio, compute_uv=False)
        assert singular[1:].max(initial=0) <= 1e-4 * singular[0], key
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
