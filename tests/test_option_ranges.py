"""Numbers out of their ranges are refused before any work; successful results hold no NaN.

- Every numeric field of a zoo spec (counts, seed, classes), of its recipe and of its
  method options has a range: a value outside is refused when ``posteriorzoo train``
  reads the spec (exit 2, one line naming the field, no file created). Hypothesis draws
  the values, below and above each range; the method options' ranges are read from
  their declarations in the vocabulary.
- Bounds that depend on the data are checked as soon as the data are known and before
  any training: ``study permutation-stability --every`` against one epoch's steps,
  ``study toy`` networks x points.
- The quick paths of ``study toy``, ``mmd`` and ``report`` on tiny inputs write JSON and
  CSV without a NaN or an infinity (an unavailable value is ``null`` in the JSON, an
  empty cell in the CSV, as documented).
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zoo_helpers import assert_one_line_error, checkpoint, run

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.vocabulary import METHODS, Interval
from posteriorzoo.zoo import create_zoo

# (table, field, low, high, integer, method): the numeric fields of a spec. None for high:
# no upper bound (a diverging value is detected and reported), only finiteness.
FIELDS = [
    ("", "checkpoints", 1, 1_000_000, True, "de"),
    ("", "modes", 1, 1_000_000, True, "swag"),
    ("", "samples_per_mode", 1, 1_000_000, True, "swag"),
    ("", "base_seed", 0, 2**32 - 1, True, "de"),
    ("", "num_classes", 1, 100_000, True, "de"),
    ("recipe_overrides", "epochs", 0, 10_000, True, "de"),
    ("recipe_overrides", "batch_size", 1, 65_536, True, "de"),
    ("recipe_overrides", "crop_padding", 0, 64, True, "de"),
    ("recipe_overrides", "lr", 0, None, False, "de"),
    ("recipe_overrides", "momentum", 0, 1, False, "de"),
    ("recipe_overrides", "gamma", 0, 1, False, "de"),
    ("recipe_overrides", "weight_decay", 0, None, False, "de"),
]
# The method options' ranges are read from their declarations (posteriorzoo.vocabulary),
# not copied: every numeric bound of every method (a bound that names another option,
# SWAG's "0 to epochs", is left to tests/test_option_vocabulary.py).
FIELDS += [("method_options", option.name, constraint.low, constraint.high,
            constraint.kind == "integer", method)
           for method, info in METHODS.items() for option in info.options
           for constraint in option.constraints
           if isinstance(constraint, Interval) and not isinstance(constraint.low, str)
           and not isinstance(constraint.high, str)
           and not (constraint.kind == "integer" and constraint.high is None)]


def _outside(low: float, high: float | None, integer: bool) -> st.SearchStrategy:
    """TOML source of values outside [low, high] (low itself is outside where the field
    must be strictly positive: lr, gamma; momentum's 1 is outside too)."""
    if integer:
        below = st.integers(max_value=low - 1)
        above = st.integers(min_value=high + 1, max_value=2**63 - 1)
        return st.one_of(below, above).map(str)
    below = st.floats(max_value=low, exclude_max=True, allow_nan=False, allow_infinity=False)
    choices = [below.map(repr), st.sampled_from(["nan", "inf", "-inf"])]
    if high is not None:
        choices.append(st.floats(min_value=high, exclude_min=True, allow_nan=False,
                                 allow_infinity=False).map(repr))
    return st.one_of(*choices)


def _spec_text(table: str, field: str, value: str, method: str) -> str:
    top = {"recipe": '"optunet-mnist"', "dataset": '"digits"', "method": f'"{method}"',
           "base_seed": "7"}
    if method != "de":
        top.update(modes="1", samples_per_mode="2")
    else:
        top["checkpoints"] = "2"
    tables = {"recipe_overrides": {"epochs": "1"}, "method_options": {}}
    if table:
        tables[table][field] = value
    else:
        top[field] = value
        if field in ("modes", "samples_per_mode"):
            top.pop("checkpoints", None)
    lines = [f"{key} = {text}" for key, text in top.items()]
    for name, entries in tables.items():
        lines += ["", f"[{name}]", *(f"{key} = {text}" for key, text in entries.items())]
    return "\n".join(lines) + "\n"


def _log(command: str, ok: bool, kind: str = "bad option", refused: bool = True) -> None:
    """One probe line (tests/probe_table.py): each generated case counts as one probe."""
    path = os.environ.get("POSTERIORZOO_PROBE_LOG")
    if path:
        with open(path, "a") as log:
            log.write(json.dumps({"suite": "options", "command": command, "class": kind,
                                  "refused": refused, "ok": ok}) + "\n")


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_spec_numbers_out_of_range_are_refused_when_the_spec_is_read(tmp_path, capsys, data):
    table, field, low, high, integer, method = data.draw(st.sampled_from(FIELDS), label="field")
    value = data.draw(_outside(low, high, integer), label="value")
    folder = Path(tempfile.mkdtemp(dir=tmp_path))       # one folder per example
    spec = folder / "spec.toml"
    spec.write_text(_spec_text(table, field, value, method))
    ok = False
    try:
        code, _, err = run(capsys, "train", spec, "--out", folder / "zoo.h5", "--backend",
                           "serial", "--no-progress")
        assert_one_line_error(code, err, field)
        assert sorted(p.name for p in folder.iterdir()) == ["spec.toml"]
        ok = True
    finally:
        _log("train", ok)


def test_the_spec_ranges_accept_their_bounds():
    """The bounds themselves are valid (a range is not stricter than it says)."""
    from train_zoo import make_spec

    make_spec(checkpoints=1_000_000, base_seed=2**32 - 1, num_classes=100_000,
              recipe_overrides={"epochs": 10_000, "batch_size": 65_536, "crop_padding": 64,
                                "momentum": 0.99, "gamma": 1.0})
    # (the method options' bounds: tests/test_option_vocabulary.py, from their declarations)
    with pytest.raises(InvalidOptionError, match="modes' x 'samples_per_mode'"):
        make_spec(method="swag", modes=1_000, samples_per_mode=1_001)


# ------------------------------------------------------------- bounds known from the data
def test_every_beyond_one_epoch_is_refused_before_training(tmp_path, capsys):
    """digits: 1347 training images, batch 64: 22 steps per epoch."""
    out = tmp_path / "stability"
    code, _, err = run(capsys, "study", "permutation-stability", "--dataset", "digits",
                       "--epochs", "1", "--runs", "1", "--every", "23", "--out", out,
                       "--no-progress")
    assert_one_line_error(code, err, "every (23)", "22 SGD steps")
    assert list(tmp_path.iterdir()) == []
    code, _, err = run(capsys, "study", "permutation-stability", "--dataset", "digits",
                       "--epochs", "1", "--runs", "1", "--every", "22", "--engine", "torch",
                       "--out", out, "--no-progress")
    assert code == 0, err


def test_snapshots_per_run_are_bounded():
    from analysis.studies.permutation_stability import MAX_SNAPSHOTS, check_snapshots

    check_snapshots(1, 60, 938, "fashion-mnist")             # the paper's: 56,281
    with pytest.raises(InvalidOptionError, match="snapshots per run"):
        check_snapshots(1, 1_000, 938, "fashion-mnist")
    assert MAX_SNAPSHOTS < 1_000 * 938 + 1


def test_toy_networks_times_points_and_norm_are_bounded(tmp_path, capsys):
    from analysis.studies.toy import run_toy_study

    code, _, err = run(capsys, "study", "toy", "--networks", "100000", "--points", "10000",
                       "--out", tmp_path / "toy", "--no-progress")
    assert_one_line_error(code, err, "networks x points per class")
    assert list(tmp_path.iterdir()) == []
    for options in ({"norm": 1e308}, {"norm": 1e-308}, {"networks": 10**12},
                    {"points_per_class": 10**11}, {"epochs": 10**6}):
        with pytest.raises(InvalidOptionError, match=next(iter(options))):
            run_toy_study(**{"networks": 2, **options})


def test_report_library_bounds_match_the_command_line():
    from analysis.report import build as report_build
    from analysis.studies import permutation_stability, toy
    from posteriorzoo.cli import report_command, study_command

    assert report_command.BINS.high == report_build.MAX_BINS
    assert report_command.SPLITS.high == report_build.MAX_SPLITS
    assert report_command.PAIRS.high == report_build.MAX_PAIRS
    assert study_command.NETWORKS.high == toy.MAX_NETWORKS
    assert study_command.POINTS.high == toy.MAX_POINTS_PER_CLASS
    assert (study_command.NORM.low, study_command.NORM.high) == toy.NORM_RANGE
    assert study_command.RUNS.high == permutation_stability.MAX_RUNS
    assert study_command.EPOCHS.high == permutation_stability.MAX_EPOCHS
    assert study_command.EVERY.high == permutation_stability.MAX_EVERY
    with pytest.raises(InvalidOptionError, match="bins"):
        report_build.build_report("absent.h5", ["absent.h5"], bins=10**14)


# ------------------------------------------------------------------ no unreported NaN
def _strict_json(path: Path) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{path.name} holds {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _finite_csv(path: Path) -> int:
    """Every cell that is a number is finite; returns how many numbers were seen."""
    numbers = 0
    with open(path, newline="") as table:
        for row in csv.reader(table):
            for cell in row:
                try:
                    value = float(cell)
                except ValueError:
                    continue
                assert math.isfinite(value), (path.name, row)
                numbers += 1
    return numbers


def _check_folder(folder: Path) -> None:
    jsons = list(folder.glob("*.json"))
    csvs = list(folder.glob("*.csv"))
    assert jsons and csvs
    for path in jsons:
        _strict_json(path)
    assert sum(_finite_csv(path) for path in csvs) > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    paths = {}
    for name, seeds in (("target", range(6)), ("method", range(100, 103))):
        states = [checkpoint(seed) for seed in seeds]
        with create_zoo(folder / f"{name}.h5", architecture="optunet", dataset="digits",
                        method="de", num_classes=10, template=states[0]) as zoo:
            zoo.append_many(states)
        paths[name] = folder / f"{name}.h5"
    return paths


@pytest.mark.parametrize("argv", [
    ["study", "toy", "--networks", "3", "--points", "2"],
    ["study", "toy", "--networks", "1", "--points", "1", "--norm", "0.001"],
    ["mmd", "TARGET", "METHOD", "--test", "--b1", "20", "--b2", "20"],
    ["report", "TARGET", "METHOD", "--n-images", "2", "--splits", "1", "--n-pairs", "1",
     "--no-figures", "--test"],
], ids=["toy", "toy-smallest", "mmd", "report"])
def test_successful_results_hold_no_unreported_nan(tiny, tmp_path, capsys, argv):
    argv = [str(tiny["target"]) if a == "TARGET" else str(tiny["method"]) if a == "METHOD"
            else a for a in argv]
    out = tmp_path / "out"
    ok = False
    try:
        code, _, err = run(capsys, *argv, "--out", out, "--no-progress")
        assert code == 0, err
        _check_folder(out)
        ok = True
    finally:
        _log(argv[0], ok, "no NaN", refused=False)
