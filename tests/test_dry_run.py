"""``posteriorzoo train --dry-run`` and ``--list-options``: the resolved spec and every
method's options before any training, writing nothing.

- The dry run prints every recipe field and method option with where it came from
  (given, default, derived), the checkpoints, the engine and an estimated time from a few
  timed steps; ``--json`` the same as JSON. It writes nothing (not the output, not a
  temporary file, not the data cache) and refuses what ``train`` would refuse, in one
  line.
- The listing is read from the table the validation reads: it covers every method and
  every option a spec may give, and an option outside it is refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from zoo_helpers import assert_one_line_error, run

from posteriorzoo.errors import UnknownNameError
from train_zoo import get_recipe
from train_zoo.method_options import METHODS, option_table, resolve_method_options

SWAG_SPEC = ('recipe = "optunet-mnist"\ndataset = "digits"\nmethod = "swag"\nmodes = 2\n'
             'samples_per_mode = 3\nbase_seed = 7\n\n[recipe_overrides]\nepochs = 2\n')
#: Training examples of the digits set and steps per epoch at the recipe's batch 64.
DIGITS_TRAIN, STEPS_PER_EPOCH = 1_347, math.ceil(1_347 / 64)


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder`` with its size and modification time."""
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(folder.rglob("*"))}


@pytest.fixture
def swag_spec(tmp_path):
    spec = tmp_path / "swag.toml"
    spec.write_text(SWAG_SPEC)
    return spec


def test_dry_run_prints_the_resolved_spec_and_writes_nothing(swag_spec, tmp_path, capsys,
                                                             monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("POSTERIORZOO_CACHE", str(cache))
    # the digits as a fresh process has them (not yet prepared), whatever ran before
    from posteriorzoo.data import datasets
    datasets._digits_arrays.cache_clear()
    before = _tree(tmp_path)
    out = tmp_path / "swag.h5"
    code, stdout, err = run(capsys, "train", swag_spec, "--dry-run", "--out", out,
                            "--backend", "serial")
    assert code == 0, err
    assert _tree(tmp_path) == before  # no output, no temporary file, no cache folder
    lines = stdout.splitlines()

    def line(start: str) -> str:
        found = [text.strip() for text in lines if text.strip().startswith(start)]
        assert len(found) == 1, (start, stdout)
        return found[0]

    assert "6 checkpoints = 2 modes x 3 samples per mode" in stdout
    assert line("epochs = 2 ").endswith("given")
    assert line("milestones = [1]").endswith("derived from epochs=2 ([15, 30] at 60 epochs)")
    assert line("batch_size = 64").endswith("default")
    assert line("iterates = 2").endswith("derived from epochs=4")
    assert line("rank = 2").endswith("derived from iterates=2")
    assert line("scale = 0.1").endswith("default")
    learning_rates = sorted(text.strip().split("  ")[-1].strip() for text in lines
                            if text.strip().startswith("lr = 0.04 "))
    assert learning_rates == ["default", "derived from the recipe (its lr)"]  # recipe, SWAG
    assert line("engine:") == "engine: fast"
    assert line("output:") == f"output: {out} (new)"
    assert "estimated time:" in stdout and "an estimate" in stdout
    assert line("train:").startswith(f"train: {2 * 2 * STEPS_PER_EPOCH} steps x")
    assert line("swag:").startswith(f"swag: {2 * 4 * STEPS_PER_EPOCH} steps x")
    # what was derived, one line each, on stderr
    assert "posteriorzoo train: swag: iterates 2 (derived from epochs=4; default 20 at 60 " \
           "epochs)" in err.splitlines()
    assert "posteriorzoo train: recipe: milestones [1] (derived from epochs=2; [15, 30] at " \
           "60 epochs)" in err.splitlines()


def test_dry_run_json_extrapolates_the_measured_steps(swag_spec, tmp_path, capsys):
    before = _tree(tmp_path)
    code, stdout, err = run(capsys, "train", swag_spec, "--dry-run", "--json",
                            "--backend", "local", "--workers", "2")
    assert code == 0, err
    assert _tree(tmp_path) == before
    report = json.loads(stdout)
    assert report["written"] is False and report["out"] is None
    assert (report["checkpoints"], report["modes"], report["samples_per_mode"]) == (6, 2, 3)
    options = report["method_options"]
    assert options["iterates"] == {"value": 2, "source": "derived from epochs=4"}
    assert options["scale"] == {"value": 0.1, "source": "default"}
    assert report["recipe"]["epochs"] == {"value": 2, "source": "given"}
    assert report["recipe"]["milestones"]["value"] == [1]
    assert "swag: rank 2" in " ".join(report["derived"])
    estimate = report["estimate"]
    parts = {part["phase"]: part for part in estimate["parts"]}
    assert set(parts) == {"train", "swag", "evaluation"}
    assert parts["train"]["steps"] == 2 * 2 * STEPS_PER_EPOCH
    assert parts["swag"]["steps"] == 2 * 4 * STEPS_PER_EPOCH
    for phase in ("train", "swag"):
        part = parts[phase]
        assert part["timed_steps"] >= 1 and part["seconds_per_step"] > 0
        # the same product as the estimate's, and JSON keeps a float's every bit: exact
        assert part["seconds"] == part["steps"] * part["seconds_per_step"]
    assert parts["evaluation"]["seconds"] > 0
    total = sum(part["seconds"] for part in estimate["parts"])
    assert estimate["cpu_seconds"] == total  # the same sum in the same order: exact
    assert estimate["parallel"] == 2  # two modes, two workers
    assert estimate["seconds"] == total / 2  # one division by 2 of the same sum: exact
    assert "estimate" in estimate["note"]


def test_dry_run_times_an_adapted_sghmc_without_running_its_warm_up(tmp_path, capsys,
                                                                    monkeypatch):
    """An adapted SGHMC's first steps are its warm-up's (phase ``sghmc-adapt``): the dry
    run times a few of them and stops, and counts every phase's steps (the settling at
    its limit)."""
    from posteriorzoo.cli import train_command
    from train_zoo.methods import sghmc

    steps = []
    original = sghmc.WhitenedSghmcStepper.step
    monkeypatch.setattr(sghmc.WhitenedSghmcStepper, "step",
                        lambda self, *args: steps.append(1) or original(self, *args))
    options = ('\n[method_options]\nchains = 2\npreconditioner = "adapted"\n'
               'adapt_steps = 3000\nadapt_rounds = 1\nadapt_round_steps = 100\n'
               'settle_steps = 250\nburn_in = 10\nthin = 5\n')
    spec = tmp_path / "sghmc.toml"
    spec.write_text(SWAG_SPEC.replace('"swag"', '"sghmc"').replace("samples_per_mode = 3",
                                                                   "samples_per_mode = 4")
                    + options)
    code, stdout, err = run(capsys, "train", spec, "--dry-run", "--json")
    assert code == 0, err
    part = {p["phase"]: p for p in json.loads(stdout)["estimate"]["parts"]}["sghmc"]
    assert 1 <= part["timed_steps"] <= train_command.TIMED_STEPS
    assert len(steps) <= train_command.WARM_UP_STEPS + train_command.TIMED_STEPS + 1
    assert part["steps"] == 2 * (250 + 2 * (3000 + 100 + 20))   # modes x (settle + chains)


def test_dry_run_without_an_estimate_needs_no_data(tmp_path, capsys):
    spec = tmp_path / "laplace.toml"
    spec.write_text('recipe = "optunet-mnist"\ndataset = "tinyimagenet"\nmethod = "laplace"\n'
                    'architecture = "mlp"\ncheckpoints = 4\n\n[model_options]\n'
                    "widths = [12288, 32, 200]\n")
    before = _tree(tmp_path)
    code, stdout, err = run(capsys, "train", spec, "--dry-run", "--no-estimate", "--json")
    assert code == 0, err
    assert _tree(tmp_path) == before
    report = json.loads(stdout)
    assert report["estimate"] is None
    assert report["method_options"]["structure"]["value"] == "last-layer-kfac"
    assert report["method_options"]["structure"]["source"].startswith("auto: mlp has")
    assert report["derived"] == [line.removeprefix("posteriorzoo train: ")
                                 for line in err.splitlines()]


def test_dry_run_says_when_the_data_are_not_here(tmp_path, capsys, monkeypatch):
    """The dry run never downloads: missing data leave the estimate out, with the reason."""
    from posteriorzoo.data import load_dataset
    from posteriorzoo.errors import DataNotFoundError

    cache = tmp_path / "cache"
    monkeypatch.setenv("POSTERIORZOO_CACHE", str(cache))
    try:
        load_dataset("mnist", "test", download=False)
        pytest.skip("mnist is on this machine")
    except DataNotFoundError:
        pass
    spec = tmp_path / "de.toml"
    spec.write_text('recipe = "optunet-mnist"\nmethod = "de"\ncheckpoints = 3\n')
    code, stdout, err = run(capsys, "train", spec, "--dry-run")
    assert code == 0, err
    assert "estimated time: unavailable (the data are not here yet (train downloads them)" \
        in stdout
    assert not cache.exists()


@pytest.mark.parametrize(("extra", "spec_text", "fragment"), [
    (["--engine", "vectorised"], SWAG_SPEC, "vectorised engine trains Deep Ensembles only"),
    (["--engine", "fast"], SWAG_SPEC.replace('method = "swag"', 'method = "swag"\n'
                                             'architecture = "mlp"'), "fast engine"),
    (["--out", "missing-folder/zoo.h5"], SWAG_SPEC, "does not exist"),
    ([], SWAG_SPEC + "\n[method_options]\nrank = 0\n", "swag option 'rank'"),
    ([], SWAG_SPEC + "\n[method_options]\nrnak = 2\n", "unknown swag option(s) ['rnak']"),
    (["--no-estimate"], SWAG_SPEC.replace("epochs = 2", "epochs = 0"), "swag option 'epochs'"),
], ids=["vectorised-swag", "fast-mlp", "no-folder", "rank-0", "typo", "no-epochs"])
def test_dry_run_refuses_what_train_refuses(tmp_path, capsys, extra, spec_text, fragment):
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text)
    before = _tree(tmp_path)
    extra = [str(tmp_path / word) if word.startswith("missing-folder") else word
             for word in extra]
    code, _, err = run(capsys, "train", spec, "--dry-run", *extra)
    assert_one_line_error(code, err, fragment)
    assert _tree(tmp_path) == before


def test_train_needs_an_output_or_a_dry_run(swag_spec, tmp_path, capsys):
    before = _tree(tmp_path)
    code, _, err = run(capsys, "train", swag_spec)
    assert_one_line_error(code, err, "--out")
    code, _, err = run(capsys, "train", "--dry-run")
    assert_one_line_error(code, err, "spec")
    code, _, err = run(capsys, "train", swag_spec, "--out", tmp_path / "z.h5", "--no-estimate")
    assert_one_line_error(code, err, "--no-estimate")
    assert _tree(tmp_path) == before


# ---------------------------------------------------------------- --list-options
def test_the_listing_covers_every_method_and_every_option(capsys):
    code, stdout, err = run(capsys, "train", "--list-options", "--json")
    assert code == 0, err
    rows = json.loads(stdout)
    listed = {(row["method"], row["option"]) for row in rows}
    declared = {(method, option.name) for method in METHODS for option in option_table(method)}
    assert listed == declared
    assert all(row["default"] and row["help"] for row in rows)
    code, text, _ = run(capsys, "train", "--list-options")
    assert code == 0
    for method in METHODS:
        assert f"\n{method}:" in f"\n{text}"
    for method, option in declared:
        assert f"\n  {option} " in text, (method, option)
    assert "de: no options" in text
    code, swag_only, _ = run(capsys, "train", "--list-options", "swag", "--json")
    assert {row["method"] for row in json.loads(swag_only)} == {"swag"}


@pytest.mark.parametrize("method", METHODS)
def test_validation_accepts_exactly_the_listed_options(method):
    """Every listed option is accepted (given its resolved value, the result is the
    same), and a name outside the table is refused with the table's names."""
    recipe = get_recipe("optunet-mnist")
    resolved = resolve_method_options(method, {}, "optunet", recipe)
    names = [option.name for option in option_table(method)]
    assert set(resolved) <= set(names)
    for name in names:
        if name in resolved:
            again = resolve_method_options(method, {name: resolved[name]}, "optunet", recipe)
            assert again == resolved, name
    with pytest.raises(UnknownNameError) as info:
        resolve_method_options(method, {"not_an_option": 1}, "optunet", recipe)
    message = str(info.value)
    assert "not_an_option" in message and "\n" not in message
    assert all(name in message for name in names)


def test_bbb_options_outside_the_record_are_listed_and_accepted():
    """BBB's training options (optimizer, lr, ...) are recorded only when they are not
    the paper's, yet they are listed and accepted."""
    recipe = get_recipe("optunet-mnist")
    names = {option.name for option in option_table("bbb")}
    assert {"preset", "optimizer", "lr", "rho_optimizer", "rho_lr"} <= names
    options = resolve_method_options("bbb", {"optimizer": "adam"}, "optunet", recipe)
    assert options["optimizer"] == "adam" and options["lr"] == 1e-3  # the default, stored as given


def test_an_unknown_method_in_the_listing_is_one_line(capsys):
    code, _, err = run(capsys, "train", "--list-options", "swg")
    assert_one_line_error(code, err, "--list-options", "swag")


def test_train_help_names_the_new_options():
    from posteriorzoo.cli import build_parser

    parser = build_parser()
    train = next(a for a in parser._actions if a.dest == "command").choices["train"]
    text = train.format_help()
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for option in ("--dry-run", "--list-options", "--no-estimate"):
        assert option in text and option in readme
