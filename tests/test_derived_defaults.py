"""Defaults that follow the recipe and the model (train_zoo.method_options, recipes).

- A shortened recipe scales SWAG's ramp, iterates and rank and the lr milestones, saying
  so one line per derived value; the full 60-epoch recipe keeps the paper's values.
- Laplace's ``structure = "auto"`` takes the full GGN up to 5,000 parameters and
  last-layer KFAC above; a ``full`` structure the method cannot fit is refused when the
  spec is read.
- The shipped specs resolve to exactly the recipes their reference collections record.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from zoo_helpers import run

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.models import parameter_count
from train_zoo import get_recipe, make_spec
from train_zoo.method_options import (
    AUTO_FULL_LAPLACE_PARAMETERS,
    SWAG_ITERATES,
    SWAG_RAMP_EPOCHS,
    SWAG_RANK,
    SWAG_REFERENCE_EPOCHS,
    SWAG_SCALE,
)
from train_zoo.recipes import scale_milestones

ROOT = Path(__file__).resolve().parent.parent


def _swag(epochs: int, **options):
    return make_spec("optunet-mnist", dataset="digits", method="swag", modes=1,
                     samples_per_mode=2, recipe_overrides={"epochs": epochs},
                     method_options=options)


# ---------------------------------------------------------------- swag
def test_a_two_epoch_swag_spec_is_accepted_with_scaled_defaults():
    spec = _swag(2)
    assert spec.method_options == {"lr": 0.04, "epochs": 4, "ramp_epochs": 1,
                                   "collect_from": 0, "iterates": 2, "rank": 2,
                                   "scale": 0.1}
    assert "swag: iterates 2 (derived from epochs=4; default 20 at 60 epochs)" in spec.derived
    assert any(line.startswith("swag: rank 2 (derived from iterates=2") for line in spec.derived)
    assert any(line.startswith("swag: ramp_epochs 1 (derived from epochs=4")
               for line in spec.derived)
    assert spec.sources["method_options"]["iterates"] == "derived from epochs=4"
    assert spec.sources["method_options"]["scale"] == "default"


@pytest.mark.parametrize("epochs", [1, 2, 3, 7, 10, 30, 45, 59])
def test_swag_defaults_scale_with_the_phase(epochs):
    options = _swag(epochs).method_options
    phase = 2 * epochs
    assert options["epochs"] == phase
    assert options["iterates"] == min(SWAG_ITERATES,
                                      max(2, round(SWAG_ITERATES * phase / 120)))
    assert 2 <= options["iterates"] <= phase
    assert options["rank"] == min(SWAG_RANK, options["iterates"])
    assert 1 <= options["ramp_epochs"] <= min(SWAG_RAMP_EPOCHS, phase)


@pytest.mark.parametrize("epochs", [60, 61, 200])
def test_the_full_recipe_keeps_the_papers_swag_values(epochs):
    spec = _swag(epochs)
    assert {k: spec.method_options[k] for k in ("ramp_epochs", "iterates", "rank", "scale")} \
        == {"ramp_epochs": 10, "iterates": 20, "rank": 20, "scale": 0.1}
    assert not [line for line in spec.derived
                if line.startswith(("swag: ramp_epochs", "swag: iterates", "swag: rank"))]


def test_given_iterates_set_the_rank_and_a_given_rank_stays():
    spec = _swag(2, iterates=3)
    assert spec.method_options["rank"] == 3
    assert spec.sources["method_options"]["iterates"] == "given"
    assert any(line.startswith("swag: rank 3 (derived from iterates=3") for line in spec.derived)
    given = _swag(2, iterates=3, rank=20)
    assert given.method_options["rank"] == 20
    assert not any(line.startswith("swag: rank") for line in given.derived)


def test_iterates_fit_the_collection_window():
    spec = make_spec("optunet-mnist", dataset="digits", method="swag", checkpoints=2,
                     method_options={"collect_from": 110})
    assert spec.method_options["iterates"] == 10 and spec.method_options["rank"] == 10
    assert any("from collect_from=110 to epochs=120" in line for line in spec.derived)
    with pytest.raises(InvalidOptionError, match="'iterates' \\(2\\) exceeds the 1 epochs"):
        _swag(60, collect_from=119)
    with pytest.raises(InvalidOptionError, match="'iterates' \\(5\\) exceeds the 4 epochs"):
        _swag(2, iterates=5)


def test_the_swag_numbers_are_the_method_modules():
    from train_zoo.methods import swag

    assert (SWAG_ITERATES, SWAG_RANK, SWAG_RAMP_EPOCHS, SWAG_SCALE) == (
        swag.ITERATES, swag.RANK, swag.RAMP_EPOCHS, swag.SCALE)
    assert swag.LENGTH_FACTOR * get_recipe("optunet-mnist").epochs == SWAG_REFERENCE_EPOCHS


def test_a_shortened_swag_spec_trains(tmp_path, capsys, monkeypatch):
    """The spec that was refused ("iterates (20) exceeds the 4 epochs") trains, and the
    collection records the derived options. train says what was derived on stderr, one
    line each: at a terminal before the progress bar, in a log (stderr is no terminal
    here) once training succeeded; the JSON summary lists it too."""
    spec = tmp_path / "swag.toml"
    spec.write_text('recipe = "optunet-mnist"\ndataset = "digits"\nmethod = "swag"\n'
                    "modes = 1\nsamples_per_mode = 2\nbase_seed = 3\n\n"
                    "[recipe_overrides]\nepochs = 2\n")
    code, out, err = run(capsys, "train", spec, "--out", tmp_path / "swag.h5", "--backend",
                         "serial", "--json")
    assert code == 0, err
    lines = err.splitlines()
    assert lines[:5] == [
        "posteriorzoo train: recipe: milestones [1] (derived from epochs=2; [15, 30] at 60 "
        "epochs)",
        "posteriorzoo train: swag: epochs 4 (derived: twice the recipe's 2 epochs; 120 at 60 "
        "epochs)",
        "posteriorzoo train: swag: ramp_epochs 1 (derived from epochs=4; default 10 at 60 "
        "epochs)",
        "posteriorzoo train: swag: iterates 2 (derived from epochs=4; default 20 at 60 "
        "epochs)",
        "posteriorzoo train: swag: rank 2 (derived from iterates=2: one deviation column per "
        "iterate; default 20 with 20 iterates)"]
    summary = json.loads(out)
    assert summary["checkpoints"] == 2
    assert "swag: iterates 2 (derived from epochs=4; default 20 at 60 epochs)" in \
        summary["derived"]
    from posteriorzoo.zoo import open_zoo

    with open_zoo(tmp_path / "swag.h5") as zoo:
        assert zoo.recipe["method_options"]["iterates"] == 2
        assert zoo.recipe["method_options"]["rank"] == 2
        assert zoo.recipe["milestones"] == [1]
        records = zoo.training_records()
    assert [record["iterates"] for record in records.values()] == [2]
    # at a terminal, the same lines come before the progress bar
    import posteriorzoo.progress

    monkeypatch.setattr(posteriorzoo.progress, "stderr_is_terminal", lambda: True)
    code, _, err = run(capsys, "train", spec, "--out", tmp_path / "again.h5", "--backend",
                       "serial")
    assert code == 0, err
    assert err.startswith("\n".join(lines[:5]))


# ---------------------------------------------------------------- milestones
@pytest.mark.parametrize("name", ["optunet-mnist", "resnet18-cifar100"])
def test_scaled_milestones_stay_strictly_increasing_inside_the_run(name):
    recipe = get_recipe(name)
    for epochs in range(0, 2 * recipe.epochs + 1):
        milestones = get_recipe(name, epochs=epochs).milestones
        assert list(milestones) == sorted(set(milestones)), (epochs, milestones)
        assert all(1 <= m < epochs for m in milestones), (epochs, milestones)
        # as many as fit: the paper's two decays whenever the run has 3 epochs or more
        assert len(milestones) == min(len(recipe.milestones), max(0, epochs - 1))
    assert get_recipe(name, epochs=recipe.epochs).milestones == recipe.milestones


def test_milestones_of_short_recipes():
    assert scale_milestones((15, 30), 60, 1) == ()
    assert scale_milestones((15, 30), 60, 2) == (1,)
    assert scale_milestones((15, 30), 60, 4) == (1, 2)
    assert scale_milestones((15, 30), 60, 10) == (2, 5)
    assert scale_milestones((15, 30), 60, 120) == (30, 60)
    recipe = get_recipe("optunet-mnist", epochs=2)
    # one decay at epoch 1, not two on the same epoch as before
    assert recipe.learning_rate(1) == recipe.lr * recipe.gamma  # one product: exact
    spec = make_spec("optunet-mnist", dataset="digits", recipe_overrides={"epochs": 2})
    assert spec.derived == ("recipe: milestones [1] (derived from epochs=2; [15, 30] at 60 "
                            "epochs)",)
    assert spec.sources["recipe"]["milestones"].startswith("derived from epochs=2")
    assert spec.sources["recipe"]["epochs"] == "given"
    given = make_spec("optunet-mnist", dataset="digits",
                      recipe_overrides={"epochs": 2, "milestones": [1, 1]})
    assert given.recipe.milestones == (1, 1) and given.derived == ()


# ---------------------------------------------------------------- laplace
def _laplace(architecture: str, **fields):
    return make_spec("optunet-mnist", dataset="digits", method="laplace", checkpoints=2,
                     architecture=architecture, **fields)


@pytest.mark.parametrize(("architecture", "widths", "structure"), [
    ("optunet", None, "full"),
    ("optunet-v1", None, "full"),
    ("mlp", [784, 6, 10], "full"),              # 4,780 parameters
    ("mlp", [784, 7, 10], "last-layer-kfac"),   # 5,575
    ("mlp", [784, 32, 10], "last-layer-kfac"),  # 25,450: 'full' failed after training
    ("resnet18", None, "last-layer-kfac"),
])
def test_laplace_auto_takes_full_where_the_ggn_fits(architecture, widths, structure):
    model_options = {} if widths is None else {"widths": widths}
    spec = _laplace(architecture, model_options=model_options)
    count = parameter_count(architecture, **model_options)
    assert (count <= AUTO_FULL_LAPLACE_PARAMETERS) == (structure == "full")
    assert spec.method_options["structure"] == structure
    assert spec.sources["method_options"]["structure"].startswith(
        f"auto: {architecture} has {count:,} parameters")
    notes = [line for line in spec.derived if line.startswith("laplace:")]
    assert notes == ([] if structure == "full" else [
        f"laplace: structure last-layer-kfac (auto: {architecture} has {count:,} parameters, "
        f"above the {AUTO_FULL_LAPLACE_PARAMETERS:,} up to which the full GGN is used)"])
    explicit = _laplace(architecture, model_options=model_options,
                        method_options={"structure": "auto"})
    assert explicit.method_options == spec.method_options  # the choice is recorded


def test_a_full_laplace_the_method_cannot_fit_is_refused_when_the_spec_is_read():
    with pytest.raises(InvalidOptionError) as info:
        _laplace("mlp", model_options={"widths": [784, 32, 10]},
                 method_options={"structure": "full"})
    message = str(info.value)
    assert "\n" not in message and "25,450" in message and "last-layer-kfac" in message
    kfac = _laplace("mlp", model_options={"widths": [784, 32, 10]},
                    method_options={"structure": "last-layer-kfac"})
    assert kfac.method_options["structure"] == "last-layer-kfac" and kfac.derived == ()


# ---------------------------------------------------------------- the shipped specs
@pytest.mark.parametrize("path", sorted((ROOT / "specs").glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_specs_resolve_to_the_recorded_recipes(path):
    from posteriorzoo.zoo import open_zoo
    from train_zoo import load_spec

    spec = load_spec(path)
    reference = ROOT / "posteriorzoo" / "reference" / f"{path.stem}.h5"
    with open_zoo(reference) as zoo:
        recorded = zoo.recipe
    num_data = 60_000 if spec.method == "bbb" else None  # BBB records kl_weight 1 / N
    assert spec.collection_recipe(num_data) == recorded
    assert spec.derived == ()  # nothing is derived from a full recipe
