"""The studies with their own runs: the toy example (Fig. 1) and permutation stability (Fig. 4).

Small sizes only: a few networks, digits, 2 runs x 2 epochs.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from analysis.studies import toy
from analysis.studies.permutation_stability import (
    kendall_tau,
    run_permutation_stability,
    sorting_permutations,
    successive_taus,
)
from analysis.studies.toy import (
    KEYS,
    epoch_orders,
    initial_parameters,
    make_blobs,
    network_outputs,
    remove_symmetries,
    rescale_direct,
    run_toy_study,
    sort_direct,
    study_seeds,
    train_networks,
)
from posteriorzoo.symmetry import (
    apply_symmetry_batch,
    canonicalize_batch,
    canonicalize_many,
    symmetry_structure,
)

STUDY_MODULE = "posteriorzoo.cli.study_command"

@pytest.fixture(scope="module")
def trained():
    """A few toy networks trained in float64, with the data they saw."""
    seeds = study_seeds(3)
    x, y, _ = make_blobs(seeds["data"])
    training = train_networks(x, y, 40, seeds["init"], seeds["order"], dtype=torch.float64)
    return x, y, training.params


def random_params(count: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"0.weight": rng.normal(size=(count, 2, 2)), "0.bias": rng.normal(size=(count, 2)),
            "2.weight": rng.normal(size=(count, 1, 2)), "2.bias": rng.normal(size=(count, 1))}


# --- the toy example -------------------------------------------------------------------------

def test_toy_data_and_recipe_match_the_paper():
    assert toy.MEANS == ((-2.0, -2.0), (2.0, 2.0))
    assert (toy.POINTS_PER_CLASS, toy.EPOCHS, toy.BATCH_SIZE, toy.LEARNING_RATE) == (
        200, 10, 10, 2.0)
    x, y, redrawn = make_blobs(0)
    assert x.shape == (400, 2) and y.tolist() == [0.0] * 200 + [1.0] * 200
    # Fully separable by the bisector of the means.
    assert (x[y == 0].sum(axis=1) < 0).all() and (x[y == 1].sum(axis=1) > 0).all()
    assert redrawn >= 0
    for label, mean in enumerate(toy.MEANS):
        # 4 standard errors of a mean of 200 unit-variance points.
        assert np.abs(x[y == label].mean(axis=0) - mean).max() < 4 / np.sqrt(200)
    # Identity covariance (the separability cut changes it by far less than this).
    big, labels, _ = make_blobs(1, points_per_class=20_000)
    for label, mean in enumerate(toy.MEANS):
        points = big[labels == label]
        assert np.abs(points.mean(axis=0) - mean).max() < 0.03
        assert np.abs(np.cov(points, rowvar=False) - np.eye(2)).max() < 0.05
    # Deterministic in the seed.
    assert np.array_equal(make_blobs(0)[0], x) and not np.array_equal(make_blobs(2)[0], x)


def test_initialisation_is_pytorchs_default_range():
    params = initial_parameters(5000, 0)
    bound = 1 / np.sqrt(2)
    for key in KEYS:
        values = params[key].numpy()
        assert values.dtype == np.float32 and np.abs(values).max() <= bound
        assert np.abs(values).max() > 0.95 * bound
    assert torch.equal(initial_parameters(3, 7)["0.weight"], initial_parameters(3, 7)["0.weight"])


def test_batched_training_equals_a_plain_loop_per_network():
    seeds = study_seeds(5)
    x, y, _ = make_blobs(seeds["data"])
    networks, epochs = 6, 10
    batched = train_networks(x, y, networks, seeds["init"], seeds["order"], epochs=epochs,
                             dtype=torch.float64)
    start = initial_parameters(networks, seeds["init"], torch.float64)
    next_order = epoch_orders(networks, len(x), seeds["order"])
    orders = [next_order() for _ in range(epochs)]
    inputs, targets = torch.as_tensor(x), torch.as_tensor(y)
    for r in range(networks):
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)).double()
        model.load_state_dict({key: value[r] for key, value in start.items()})
        optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
        loss_fn = nn.BCEWithLogitsLoss()
        last_epoch = []
        for epoch in range(epochs):
            losses = []
            for begin in range(0, len(x), 10):
                index = orders[epoch][r, begin:begin + 10]
                optimizer.zero_grad()
                loss = loss_fn(model(inputs[index]), targets[index].unsqueeze(1))
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            last_epoch = losses
        for key, value in model.state_dict().items():
            np.testing.assert_allclose(batched.params[key][r], value.numpy(), rtol=1e-9,
                                       atol=1e-10, err_msg=f"network {r} {key}")
        assert batched.epoch_loss[-1, r] == pytest.approx(np.mean(last_epoch), rel=1e-9,
                                                         abs=1e-12)


def test_float32_training_stays_close_to_float64():
    seeds = study_seeds(0)
    x, y, _ = make_blobs(seeds["data"])
    single = train_networks(x, y, 50, seeds["init"], seeds["order"])
    double = train_networks(x, y, 50, seeds["init"], seeds["order"], dtype=torch.float64)
    out32, out64 = network_outputs(single.params, x), network_outputs(double.params, x)
    # The same networks (float32 rounding only): predictions agree on every point.
    assert (np.sign(out32) == np.sign(out64)).mean() > 0.99


@pytest.mark.parametrize("norm", [1.0, 3.0])
def test_rescaling_keeps_every_function_and_sets_the_norms(trained, norm):
    x, _, params = trained
    for case in (params, random_params(200, 1)):
        rescaled = rescale_direct(case, norm)
        np.testing.assert_allclose(network_outputs(rescaled, x), network_outputs(case, x),
                                   rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(np.linalg.norm(rescaled["0.weight"], axis=2), norm,
                                   rtol=1e-12)
        # The scale only moves: signs of the output weights are unchanged.
        assert np.array_equal(np.sign(rescaled["2.weight"]), np.sign(case["2.weight"]))


def test_sorting_keeps_every_function_and_sorts_the_keys(trained):
    x, _, params = trained
    for case in (params, random_params(200, 2)):
        ordered = sort_direct(case)
        np.testing.assert_allclose(network_outputs(ordered, x), network_outputs(case, x),
                                   rtol=1e-12, atol=1e-12)
        assert (ordered["2.weight"][:, 0, 0] <= ordered["2.weight"][:, 0, 1]).all()
        swapped = case["2.weight"][:, 0, 0] > case["2.weight"][:, 0, 1]
        assert swapped.any() and not np.array_equal(ordered["0.weight"], case["0.weight"])
        np.testing.assert_array_equal(ordered["0.weight"][swapped],
                                      case["0.weight"][swapped][:, ::-1])


def test_canonicalizer_agrees_with_the_direct_computation(trained):
    x, _, params = trained
    for case in (params, random_params(300, 3)):
        rescaled, ordered = remove_symmetries(case, 3.0)
        direct_rescaled = rescale_direct(case, 3.0)
        direct_sorted = sort_direct(direct_rescaled)
        for key in KEYS:
            np.testing.assert_allclose(rescaled[key], direct_rescaled[key], rtol=1e-12,
                                       atol=1e-12)
            np.testing.assert_allclose(ordered[key], direct_sorted[key], rtol=1e-12,
                                       atol=1e-12)
        np.testing.assert_allclose(network_outputs(ordered, x), network_outputs(case, x),
                                   rtol=1e-10, atol=1e-10)


def test_canonicalizer_canonical_form_of_the_toy_network_matches_numpy():
    """The canonicalizer's own convention on the traced toy network (unit norm over the
    incoming weights and bias, units sorted by their first incoming weight)."""
    case = random_params(100, 4)
    canonical = canonicalize_many(toy.toy_model(), case, permutation="first",
                                  scaling="norm", softmax=False, input_shape=(2,))
    w1, b1, w2, b2 = (case[key] for key in KEYS)
    length = np.sqrt((w1 ** 2).sum(axis=2) + b1 ** 2)
    w1, b1, w2 = w1 / length[:, :, None], b1 / length, w2 * length[:, None, :]
    order = np.argsort(w1[:, :, 0], axis=1, kind="stable")
    expected = {"0.weight": np.take_along_axis(w1, order[:, :, None], axis=1),
                "0.bias": np.take_along_axis(b1, order, axis=1),
                "2.weight": np.take_along_axis(w2, order[:, None, :], axis=2), "2.bias": b2}
    for key in KEYS:
        np.testing.assert_allclose(canonical[key].numpy(), expected[key], rtol=1e-12,
                                   atol=1e-12)


def test_toy_study_writes_its_files(tmp_path):
    result = run_toy_study(networks=300, seed=1)
    checks = result.summary["symmetry_removal"]["checks"]
    assert checks["max_relative_output_change_rescaled"] < 1e-12
    assert checks["max_relative_output_change_sorted"] < 1e-12
    assert checks["max_incoming_norm_error"] < 1e-12 and checks["all_sorted"]
    assert checks["max_difference_canonicalizer_vs_numpy"] < 1e-12
    selection = result.summary["selection"]
    assert selection["kept"] + selection["dropped"] == 300
    assert selection["dropped_fraction"] < 0.05   # the paper: fewer than 1% of 10,000
    assert result.summary["output_weights"]["sorted"]["fraction_w1_le_w2"] == 1.0
    paths = result.write(tmp_path / "toy")
    assert set(paths) == {"study-toy.json", "toy_output_weights.csv", "toy_data.csv",
                          "toy_output_weights.png", "toy_output_weights.pdf"}
    data = json.loads(paths["study-toy.json"].read_text())
    assert data["kind"] == "study-toy"
    assert data["provenance"]["seeds"]["seed"] == 1
    assert data["provenance"]["options"]["networks"] == 300
    assert set(data["files"]) == set(paths) - {"study-toy.json"}
    rows = _read_csv(paths["toy_output_weights.csv"])
    assert len(rows) == 300
    assert {row["kept"] for row in rows} <= {"True", "False"}
    sorted_rows = [row for row in rows if row["kept"] == "True"]
    assert all(float(r["sorted_w1"]) <= float(r["sorted_w2"]) for r in sorted_rows)
    assert len(_read_csv(paths["toy_data.csv"])) == 400
    _check_images(paths["toy_output_weights.png"], paths["toy_output_weights.pdf"])


# --- permutation stability -------------------------------------------------------------------

def test_kendall_tau_of_identical_and_reversed_permutations():
    order = np.array([3, 0, 4, 1, 2])
    assert kendall_tau(order, order) == pytest.approx(1.0)
    assert kendall_tau(order, order[::-1]) == pytest.approx(-1.0)
    assert kendall_tau([0, 1, 2, 3], [1, 0, 2, 3]) == pytest.approx(1 - 2 / 6)
    # Units 1 and 2 swap places: one discordant pair of units out of 10.
    assert kendall_tau(order, [3, 0, 4, 2, 1]) == pytest.approx(1 - 2 / 10)
    taus = successive_taus(np.array([[0, 1, 2], [0, 1, 2], [2, 1, 0], [2, 1, 0]]))
    np.testing.assert_allclose(taus, [1.0, -1.0, 1.0])


def test_sorting_permutations_are_the_canonicalizers():
    from posteriorzoo.models import build

    model = build("optunet")
    structure = symmetry_structure("optunet", model.state_dict())
    rng = np.random.default_rng(0)
    states = {key: torch.as_tensor(rng.normal(size=(12, *value.shape)))
              for key, value in model.state_dict().items()}
    for key in ("max", "first"):
        orders = sorting_permutations(states, structure, key)
        assert set(orders) == set(structure.permutable())
        for index, order in orders.items():
            size = structure.spaces[index].size
            assert (np.sort(order, axis=1) == np.arange(size)).all()
        scaled, _ = canonicalize_batch(states, structure, permutation="none", softmax=False)
        canonical, _ = canonicalize_batch(states, structure, permutation=key, softmax=False)
        rebuilt = apply_symmetry_batch(scaled, structure, permutations=orders)
        for name in canonical:
            torch.testing.assert_close(rebuilt[name], canonical[name], rtol=0, atol=0)
        # conv2 (10 units) is not left in its original order.
        assert (orders[2] != np.arange(10)).any()


def test_permutation_stability_study_on_digits_writes_its_files(tmp_path):
    result = run_permutation_stability(runs=2, epochs=2, dataset="digits", seed=0)
    steps_per_epoch = result.summary["steps_per_epoch"]
    assert set(result.taus) == {"conv1", "conv2"}
    for values in result.taus.values():
        assert values.shape == (2, 2 * steps_per_epoch)
        assert (values >= -1 - 1e-12).all() and (values <= 1 + 1e-12).all()
    assert result.epoch[-1] == pytest.approx(2.0)
    assert [run["engine"] for run in result.summary["runs"]] == ["fast", "fast"]
    paths = result.write(tmp_path / "stability")
    assert set(paths) == {"study-permutation-stability.json", "tau_by_step.csv",
                          "tau_binned.csv", "permutation_stability.png",
                          "permutation_stability.pdf"}
    data = json.loads(paths["study-permutation-stability.json"].read_text())
    assert data["kind"] == "study-permutation-stability"
    assert data["provenance"]["options"]["dataset"] == "digits"
    assert set(data["provenance"]["seeds"]["runs"]) == {"0", "1"}
    by_step = _read_csv(paths["tau_by_step.csv"])
    assert len(by_step) == 2 * steps_per_epoch
    assert set(by_step[0]) == {"step", "epoch", "conv1_run0", "conv1_run1", "conv2_run0",
                               "conv2_run1"}
    assert [int(row["step"]) for row in by_step] == list(range(1, 2 * steps_per_epoch + 1))
    # The figure's bins summarise exactly these values.
    binned = [row for row in _read_csv(paths["tau_binned.csv"]) if row["layer"] == "conv2"]
    assert sum(int(row["steps"]) for row in binned) == len(by_step)
    first = binned[0]
    taus = [float(row[f"conv2_run{run}"]) for row in by_step[:int(first["steps"])]
            for run in (0, 1)]
    assert float(first["mean"]) == pytest.approx(np.mean(taus))
    assert float(first["min"]) == pytest.approx(min(taus))
    assert float(first["epoch_start"]) == 0.0
    assert float(binned[-1]["epoch_end"]) == pytest.approx(2.0)
    _check_images(paths["permutation_stability.png"], paths["permutation_stability.pdf"])


def test_permutation_stability_refuses_bad_options():
    from posteriorzoo.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="key"):
        run_permutation_stability(runs=1, epochs=1, dataset="digits", key="none")
    with pytest.raises(InvalidOptionError, match="runs"):
        run_permutation_stability(runs=0, epochs=1, dataset="digits")


# --- the command line ------------------------------------------------------------------------

@pytest.mark.parametrize("study", ["toy", "permutation-stability"])
def test_cli_refuses_an_existing_output(study_cli, capsys, tmp_path, study):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code = study_cli(["study", study, "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"posteriorzoo study: error: {out}")
    assert (out / "keep.txt").read_text() == "mine"


def test_cli_toy_writes_the_folder_and_overwrites_only_when_asked(study_cli, capsys, tmp_path):
    out = tmp_path / "toy"
    assert study_cli(["study", "toy", "--networks", "60", "--out", str(out),
                      "--no-progress", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "study-toy" and data["selection"]["networks"] == 60
    assert "study toy" in data["provenance"]["command"]
    assert (out / "toy_output_weights.png").exists()
    assert study_cli(["study", "toy", "--networks", "30", "--out", str(out),
                      "--no-progress", "--overwrite"]) == 0
    assert "kept" in capsys.readouterr().out
    assert json.loads((out / "study-toy.json").read_text())["selection"]["networks"] == 30
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_permutation_stability_passes_its_options(study_cli, capsys, tmp_path):
    out = tmp_path / "stability"
    assert study_cli(["study", "permutation-stability", "--runs", "1", "--epochs", "1",
                      "--dataset", "digits", "--key", "first", "--every", "2", "--seed", "3",
                      "--engine", "torch", "--out", str(out), "--no-progress"]) == 0
    assert "conv2: mean tau" in capsys.readouterr().out
    data = json.loads((out / "study-permutation-stability.json").read_text())
    options = data["provenance"]["options"]
    assert (options["key"], options["every"], options["engine"]) == ("first", 2, "torch")
    assert data["provenance"]["seeds"]["base_seed"] == 3
    steps = [int(row["step"]) for row in _read_csv(out / "tau_by_step.csv")]
    assert steps and all(step % 2 == 0 for step in steps)


def test_cli_bad_values_are_usage_errors(study_cli, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        study_cli(["study", "permutation-stability", "--runs", "0", "--out",
                   str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_study_help_imports_nothing_heavy():
    code = ("import contextlib, io, json, sys\n"
            "import posteriorzoo.cli as cli\n"
            f"if {STUDY_MODULE!r} not in cli._SUBCOMMAND_MODULES:\n"
            f"    cli._SUBCOMMAND_MODULES = (*cli._SUBCOMMAND_MODULES, {STUDY_MODULE!r})\n"
            "for argv in (['study', '--help'], ['study', 'toy', '--help'],\n"
            "             ['study', 'permutation-stability', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            cli.main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "heavy = ('torch', 'numpy', 'scipy', 'matplotlib', 'train_zoo', 'analysis')\n"
            "print(json.dumps([m for m in heavy if m in sys.modules]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


# --- helpers ---------------------------------------------------------------------------------

def _read_csv(path) -> list[dict[str, str]]:
    text = path.read_text()
    assert not any(line.startswith("#") for line in text.splitlines())
    rows = list(csv.DictReader(text.splitlines()))
    try:
        import pandas
    except ImportError:
        return rows
    assert len(pandas.read_csv(path)) == len(rows)
    return rows


def _check_images(png, pdf) -> None:
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5_000
