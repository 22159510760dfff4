"""The trainer produces every method's samples as checkpoints of the base architecture.

Per method (on digits, tiny settings): the samples of a mode are what the method's pieces
give for that mode's base network; the torch and numba engines run the same program; a
collection holds whole modes with ``mode_id`` / ``sample_id``; a run killed between modes
resumes to the same bytes as an uninterrupted one; ResNet-18 (BatchNorm) works too.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from posteriorzoo.collection import verify
from posteriorzoo.data import ArrayDataset
from posteriorzoo.models import build
from posteriorzoo.zoo import open_zoo
from train_zoo import checkpoint_seeds, make_spec, train_checkpoints
from train_zoo.backends import SerialBackend
from train_zoo.data import TrainingData, load_training_data
from train_zoo.methods import dropout, laplace
from train_zoo.methods.common import parameters_of
from train_zoo.run import train_collection
from train_zoo.torch_engine import initial_model, torch_batches
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


@pytest.mark.parametrize(("method", "options", "tolerance"), [
    ("swag", {}, 2e-4), ("sghmc", {"preconditioner": "none"}, 2e-4), ("bbb", {}, 2e-4),
    ("laplace", {}, 2e-4),
    # The whitened chain's coordinates come from the Cholesky factor of the Laplace
    # precision at the base network (condition number about 1e5 on digits): the two
    # engines' base networks differ by float32 rounding, which that factor amplifies to
    # about 1e-2 of the chain's steps.
    ("sghmc", {"preconditioner": "laplace"}, 2e-2),
])
def test_the_fast_engine_runs_the_same_program(method, options, tolerance, digits):
    spec = digits_spec(method, samples=2)
    spec = dataclasses.replace(spec, method_options={**spec.method_options, **options})
    fast = train_checkpoints(spec, [0], data=digits, engine="fast")
    reference = train_checkpoints(spec, [0], data=digits, engine="torch")
    assert {r.engine for r in fast} == {"fast"} and {r.engine for r in reference} == {"torch"}
    for a, b in zip(fast, reference, strict=True):
        for key, value in b.state.items():
            scale = float(np.abs(value).max())
            np.testing.assert_allclose(a.state[key], value, rtol=0, atol=tolerance * scale,
                                       err_msg=f"{method} {key}")


def test_de_mode_is_the_deep_ensemble_member(digits):
    """A method's base network is DE member i of the same base seed (same recipe, seeds)."""
    member = train_checkpoints(digits_spec("de", modes=3), [2], data=digits, engine="torch")[0]
    model, _ = torch_train_base(digits_spec("laplace"), 2, digits)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), member.state[key])


def test_mc_dropout_samples_mask_the_last_layer_of_the_dropout_network(digits):
    spec = digits_spec("mc-dropout", samples=4)
    results = train_checkpoints(spec, [0], data=digits, engine="torch")
    trained, _ = torch_train_base(spec, 0, digits)
    assert trained.dropout.p == 0.2  # trained with dropout before the last layer
    masks = dropout.draw_masks(trained.fc.in_features, 0.2,
                               torch.Generator().manual_seed(checkpoint_seeds(5, 0).sample), 4)
    for result, mask in zip(results, masks, strict=True):
        for key, value in trained.state_dict().items():
            expected = value.numpy()
            if key == "fc.weight":
                expected = expected * (mask.numpy() / 0.8)[None, :].astype(np.float32)
            np.testing.assert_allclose(result.state[key], expected, rtol=1e-6, atol=0)


def test_laplace_samples_are_the_method_around_the_trained_network(digits):
    spec = digits_spec("laplace", samples=2)
    results = train_checkpoints(spec, [0], data=digits, engine="torch")
    model, _ = torch_train_base(spec, 0, digits)
    params, buffers = parameters_of(model)
    recipe = dataclasses.replace(spec.recipe, batch_size=500)
    seeds = checkpoint_seeds(5, 0)
    state = laplace.init(model, params, buffers,
                         torch_batches(digits, recipe, seeds.method, augment=False)(0),
                         len(digits.train), structure="full", prior_precision="marglik")
    expected = laplace.sample(model, state, torch.Generator().manual_seed(seeds.sample), 2)
    for result, sample in zip(results, expected, strict=True):
        for key, value in sample.items():
            np.testing.assert_allclose(result.state[key], value.numpy(), rtol=1e-5, atol=1e-6)


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
