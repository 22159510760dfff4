"""The report's function-space columns and its gold standard (issue 33 sections 2 and 3).

Known answers: the report calls the collection layer (``compare``, ``evaluate``) and the
pure cores (``agreement``, ``total_variation``) on the same collections and images in one
process, so its numbers are theirs bit for bit; a collection scored against its own
predictive agrees everywhere with TV 0; the answers are checked on rows whose ordering is
known by construction.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from zoo_helpers import assert_one_line_error, method_collection, run

from analysis.report import build_report
from analysis.report.reference import answers, choose_reference
from posteriorzoo.collection import compare, evaluate
from posteriorzoo.data import load_dataset
from posteriorzoo.errors import InvalidOptionError, PosteriorZooError
from posteriorzoo.metrics import agreement, total_variation

IMAGES = 120


@pytest.fixture(scope="module")
def collections(tmp_path_factory):
    """A 40-checkpoint target, a 10-member ensemble like it, a method with three times
    larger weights and an 'HMC' collection of the target's distribution."""
    folder = tmp_path_factory.mktemp("reference")
    return {"target": method_collection(folder / "target.h5", range(40)),
            "de": method_collection(folder / "de.h5", range(100, 110)),
            "wide": method_collection(folder / "wide.h5", range(200, 210), method="swag",
                                scale=3.0),
            "hmc": method_collection(folder / "hmc.h5", range(400, 412), method="hmc")}


@pytest.fixture(scope="module")
def gold_report(collections):
    methods = {"DE": collections["de"], "Wide": collections["wide"],
               "HMC": collections["hmc"]}
    return build_report(collections["target"], methods, splits=4, n_images=IMAGES,
                        n_pairs=0, figures=False)


def test_the_hmc_collection_is_the_gold_standard_and_every_number_is_the_layers(
        collections, gold_report):
    rows = {row["name"]: row for row in gold_report.rows}
    assert rows["HMC"]["group"] == "reference"
    assert gold_report.reference["name"] == "HMC" and \
        gold_report.reference["kind"] == "collection"
    others = {"target": collections["target"], "DE": collections["de"],
              "Wide": collections["wide"]}
    direct = compare(collections["hmc"], others)
    for name in ("DE", "Wide"):
        assert rows[name]["mmd_ref"] == direct.summary(name, "keep").median
        assert rows[name]["ns_mmd_ref"] == direct.summary(name, "remove").median
    assert gold_report.reference["target"]["mmd_ref"] == direct.summary("target",
                                                                         "keep").median
    assert gold_report.reference["target"]["ns_mmd_ref"] == direct.summary(
        "target", "remove").median
    assert "mmd_ref" not in rows["HMC"]     # not against itself
    predictives = {name: evaluate(path, n_images=IMAGES).predictive
                   for name, path in {**others, "HMC": collections["hmc"]}.items()}
    for name in ("DE", "Wide", "HMC"):
        assert rows[name]["agreement"] == agreement(predictives[name], predictives["target"])
        assert rows[name]["tv"] == total_variation(predictives[name], predictives["target"])
    for name in ("DE", "Wide"):
        assert rows[name]["agreement_ref"] == agreement(predictives[name],
                                                        predictives["HMC"])
        assert rows[name]["tv_ref"] == total_variation(predictives[name], predictives["HMC"])
    assert gold_report.reference["target"]["tv_ref"] == total_variation(
        predictives["target"], predictives["HMC"])
    # three-times-larger weights are farther from both references, in weights and function
    assert rows["Wide"]["mmd_ref"] > rows["DE"]["mmd_ref"]
    assert rows["Wide"]["tv"] > rows["DE"]["tv"]


def test_the_function_band_is_the_targets_held_out_draws(collections, gold_report):
    from posteriorzoo.collection.evaluation import member_probabilities, normalized_images
    from posteriorzoo.metrics import predictive_noise

    band = gold_report.function_noise
    held_out = gold_report.provenance["options"]["held_out"]
    images = normalized_images(load_dataset("digits", "test"))[:IMAGES]
    draws = predictive_noise(member_probabilities(collections["target"], images), held_out,
                             4, 0)
    assert band["held_out"] == held_out and band["splits"] == 4
    assert band["tv"]["median"] == pytest.approx(float(np.median(draws["total_variation"])),
                                                 rel=1e-12)
    low, high = band["agreement"]["band"]
    assert 0 <= low <= band["agreement"]["median"] <= high <= 1


def test_the_report_files_show_the_reference(gold_report, tmp_path):
    gold_report.write(tmp_path / "out")
    header = (tmp_path / "out" / "table1.csv").read_text().splitlines()[0].split(",")
    assert header[-6:] == ["agreement", "tv", "mmd_ref", "ns_mmd_ref", "agreement_ref",
                           "tv_ref"]
    page = (tmp_path / "out" / "report.html").read_text()
    assert "Agree HMC" in page and 'id="reference"' in page
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "How far is the target from HMC?" in markdown
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["reference"]["answers"] == gold_report.reference["answers"]


def test_the_reference_is_named_or_refused(collections):
    entries = [{"name": "A", "method": "hmc", "path": "a", "group": "single-mode"},
               {"name": "B", "method": "hmc", "path": "b", "group": "single-mode"},
               {"name": "C", "method": "de", "path": "c", "group": "multi-mode"}]
    with pytest.raises(InvalidOptionError, match="name the one"):
        choose_reference([dict(e) for e in entries], None, None)
    chosen = [dict(e) for e in entries]
    assert choose_reference(chosen, "B", None).path == "b" and chosen[1]["group"] == \
        "reference" and chosen[0]["group"] == "single-mode"
    with pytest.raises(InvalidOptionError, match="must name a method"):
        choose_reference([dict(e) for e in entries], "Z", None)
    with pytest.raises(InvalidOptionError, match="not both"):
        choose_reference([dict(e) for e in entries], "B", "probs.csv")
    assert choose_reference([dict(entries[2])], None, None) is None


def test_a_reference_predictive_file(collections, tmp_path):
    # a predictive on the whole split, as the competition writes it: the untrained DE's
    # (at chance, which the file check refuses) pulled half-way to the labels
    labels = load_dataset("digits", "test").labels
    de = evaluate(collections["de"], dataset="digits").predictive
    own = 0.5 * de + 0.5 * np.eye(10)[labels]
    path = tmp_path / "probs.csv"
    np.savetxt(path, own, delimiter=",")
    report = build_report(collections["target"], {"DE": collections["de"],
                                                  "Wide": collections["wide"]},
                          splits=2, n_images=IMAGES, n_pairs=0, figures=False,
                          reference_predictive=path)
    rows = {row["name"]: row for row in report.rows}
    assert report.reference["kind"] == "predictive" and report.reference["name"] == "probs"
    # savetxt's %.18e gives every float64 back exactly
    for name, path_ in (("DE", collections["de"]), ("Wide", collections["wide"])):
        predictive = evaluate(path_, n_images=IMAGES).predictive
        assert rows[name]["tv_ref"] == total_variation(predictive, own[:IMAGES])
        assert rows[name]["agreement_ref"] == agreement(predictive, own[:IMAGES])
    assert "mmd_ref" not in rows["Wide"]   # no samples, no weights to compare
    assert [key for key, *_ in report.columns()][-4:] == ["agreement", "tv",
                                                         "agreement_ref", "tv_ref"]
    assert report.provenance["inputs"]["reference predictive"]["sha256"]


def test_the_cli_refuses_a_bad_reference_predictive(collections, tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("0.5,0.5\n0.5,0.5\n")
    out = tmp_path / "report"
    code, _, err = run(capsys, "report", collections["target"], collections["de"],
                       "--reference-predictive", bad, "--out", out, "--splits", "2",
                       "--n-images", "50", "--no-figures", "--no-progress")
    assert_one_line_error(code, err, "bad.csv")
    assert not out.exists()
    with pytest.raises(PosteriorZooError, match="weights-only"):
        build_report(collections["target"], [collections["de"]], predictions=False,
                     reference_predictive=bad, figures=False, splits=2)


class _Band:
    def __init__(self, low: float, high: float) -> None:
        self.band = (low, high)

    def contains(self, value: float) -> bool:
        return self.band[0] <= value <= self.band[1]


def test_the_answers_follow_the_numbers():
    rows = [{"name": "HMC", "method": "hmc", "group": "reference"},
            {"name": "DE", "method": "de", "group": "multi-mode", "mmd": 0.001,
             "mmd_ref": 0.02, "ns_mmd": 0.001, "ns_mmd_ref": 0.01, "tv": 0.01, "tv_ref": 0.03},
            {"name": "MM-X", "method": "x", "group": "multi-mode", "mmd": 0.05,
             "mmd_ref": 0.03, "ns_mmd": 0.04, "ns_mmd_ref": 0.02, "tv": 0.02, "tv_ref": 0.04},
            {"name": "X", "method": "x", "group": "single-mode", "mmd": 0.3,
             "mmd_ref": 0.2, "ns_mmd": 0.2, "ns_mmd_ref": 0.1, "tv": 0.05, "tv_ref": 0.08}]
    reference = {"name": "HMC", "target": {"mmd_ref": 0.02, "ns_mmd_ref": 0.0004,
                                           "agreement_ref": 0.97, "tv_ref": 0.03},
                 "function_band": {"held_out": 10, "agreement": {"band": [0.98, 1.0]},
                                   "tv": {"band": [0.005, 0.02]}}}
    noise = {"keep": _Band(0.0, 0.001), "remove": _Band(0.0, 0.001)}
    lines = answers(reference, rows, noise)
    assert "MMD (x 100) 2.00 (outside the target's noise band [0.00, 0.10])" in lines[0]
    assert "NS-MMD (x 100) 0.04 (inside" in lines[0] and "TV (x 100) 3.00 (outside" in lines[0]
    assert "by MMD (x 100), DE (2.00)" in lines[1] and "by TV (x 100), DE (3.00)" in lines[1]
    assert lines[2].count("holds") == 6   # both references, three statistics
    assert "explain the gap" in lines[3] and "do not" not in lines[3]
    rows[3]["mmd_ref"] = 0.001            # single-mode closest to the reference
    assert "does not hold" in answers(reference, rows, noise)[2]


def test_the_diagnostics_line_of_an_hmcmethod_collection(tmp_path):
    # the report's line reads what diagnose gives for a Metropolis-corrected chain
    from analysis.report.build import diagnosis_row
    from posteriorzoo.collection import diagnose
    from train_zoo import make_spec
    from train_zoo.backends import SerialBackend
    from train_zoo.run import train_collection

    spec = make_spec("optunet-mnist", dataset="digits", base_seed=3, method="hmc", modes=2,
                     samples_per_mode=8, recipe_overrides={"epochs": 1},
                     method_options={"burn_in": 2, "thin": 1, "trajectory_length": 0.004,
                                     "step_size": 4e-4})
    path = tmp_path / "hmc.h5"
    train_collection(spec, path, backend=SerialBackend(), progress=False)
    diagnosis = diagnose(path)
    line = diagnosis_row("HMC", diagnosis)["summary"]
    for chain in diagnosis.chains:
        assert f"acceptance {chain['acceptance_rate'][0]:.2f}" in line
        assert f"E-BFMI {chain['e_bfmi'][0]:.2f}" in line
        assert f"test log-likelihood ESS {chain['log_likelihood']['ess']:.1f}" in line
    assert "kinetic temperature" not in line
    assert diagnosis.between_chains["sentence"] in line
