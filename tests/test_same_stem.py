"""Collections with the same file name (``a/zoo.h5``, ``b/zoo.h5``) compare: ``compare``
names its canonical copies by the inputs' unique display names and returns them, and
``report`` and ``plot mmd`` use those instead of guessing file names."""

from __future__ import annotations

import json

import pytest
from rounding_bounds import noise_floor_bound
from zoo_helpers import checkpoint, run

from analysis.figures.sources import mmd_noise_band
from posteriorzoo.collection import compare
from posteriorzoo.collection.comparison import canonical_copy_names
from posteriorzoo.zoo import create_zoo, open_zoo


def _collection(path, seeds, method="de"):
    path.parent.mkdir(parents=True, exist_ok=True)
    states = [checkpoint(seed) for seed in seeds]
    with create_zoo(path, architecture="optunet", dataset="digits", method=method,
                    num_classes=10, template=states[0]) as zoo:
        zoo.append_many(states, [{"seed": seed} for seed in seeds])
    return path


@pytest.fixture(scope="module")
def zoos(tmp_path_factory):
    """Three collections named m.h5 in three folders, and the same target and method
    under different names (the reference numbers)."""
    folder = tmp_path_factory.mktemp("stems")
    target = _collection(folder / "t" / "m.h5", range(12))
    first = _collection(folder / "x" / "m.h5", range(100, 105))
    second = _collection(folder / "y" / "m.h5", range(200, 205), method="swag")
    reference = compare(target, {"A": first, "B": second}, symmetries="remove")
    return {"target": target, "A": first, "B": second, "reference": reference,
            "folder": folder}


def _numbers(result):
    return [(r.method, r.symmetries, r.layer, r.mmd.values.tolist()) for r in result.results]


def test_compare_files_with_the_same_stem(zoos, tmp_path):
    # the brief's case: the target and the method are both zoo.h5 (the copies used to be
    # both <stem>-canonical.h5: OutputExistsError)
    result = compare(zoos["target"], [zoos["A"], zoos["B"]], symmetries="remove")
    assert result.methods == ["m", "m-2"]
    reference = zoos["reference"]
    assert [n for _, *n in _numbers(result)] == [n for _, *n in _numbers(reference)]
    kept = tmp_path / "canonical"
    kept.mkdir()
    result = compare(zoos["target"], {"A": zoos["A"], "B": zoos["B"]}, symmetries="both",
                     canonical_dir=kept)
    assert result.canonical_target == kept / "target-canonical.h5"
    assert result.canonical_copies == {"A": kept / "A-canonical.h5",
                                       "B": kept / "B-canonical.h5"}
    # each copy is the canonical form of its own input (told apart by the seeds)
    seeds = {"target": list(range(12)), "A": list(range(100, 105)),
             "B": list(range(200, 205))}
    copies = {"target": result.canonical_target, **result.canonical_copies}
    for name, copy in copies.items():
        with open_zoo(copy) as zoo:
            assert "canonicalized_from" in zoo.annotations
            assert zoo.metadata["seed"].tolist() == seeds[name], name
    assert _numbers(result)[-8:] == _numbers(reference)            # NS-MMD rows alike
    assert result.provenance["canonicalizer"]["copies"] == {
        "target": "target-canonical.h5", "method A": "A-canonical.h5",
        "method B": "B-canonical.h5"}


def test_copies_without_a_kept_folder_are_not_returned(zoos):
    result = compare(zoos["target"], [zoos["A"]], symmetries="remove")
    assert result.canonical_target is None and result.canonical_copies == {}


def test_canonical_copy_names_are_unique_and_safe():
    names = canonical_copy_names(["target", "target", "a/b", "a_b", "../up", "A", "a",
                                  "\n", "$\\frob{$"])
    assert len(set(name.lower() for name in names)) == len(names)
    for name in names:
        assert "/" not in name and "\n" not in name and not name.startswith(".")
        assert name.endswith("-canonical.h5")
    assert names[:2] == ["target-canonical.h5", "target-2-canonical.h5"]


def test_report_with_methods_of_the_same_stem(zoos, tmp_path, capsys):
    out = tmp_path / "report"
    code, _, err = run(capsys, "report", zoos["target"], f"A={zoos['A']}", f"B={zoos['B']}",
                       "--out", out, "--n-images", "30", "--splits", "2", "--n-pairs", "0",
                       "--no-figures", "--no-progress")
    assert code == 0, err
    rows = {row["name"]: row for row in json.loads((out / "report.json").read_text())["rows"]}
    reference = zoos["reference"]
    for name in ("A", "B"):
        assert rows[name]["ns_mmd"] == reference.summary(name, "remove").median
    # the NS-MMD noise floor is of the target's canonical form, not of its stored weights
    floor = json.loads((out / "report.json").read_text())["noise_floor"]
    assert floor["remove"] != floor["keep"]


def test_plot_mmd_with_the_same_stem_uses_the_canonical_target(zoos, tmp_path, capsys):
    code, printed, err = run(capsys, "plot", "mmd", zoos["target"], f"A={zoos['A']}",
                             "--symmetries", "remove", "--noise-splits", "2",
                             "--out", tmp_path / "figure", "--json")
    assert code == 0, err
    numbers = json.loads(printed)["numbers"]
    # The target's own kernel sums come from one table per layer made for the smallest
    # bandwidth of the methods compared at once (mmd.comparison.score_layer): with A alone
    # or with A and B, two expansions of the same X-X sums, each within e gamma(P + 2 TERMS
    # + 8) of it in float64 (mmd.pair_sums); two of the four sums noise_floor_bound allows.
    summary = zoos["reference"].summary("A")
    assert numbers["model_level"]["A"] == pytest.approx(
        summary.median, rel=0, abs=noise_floor_bound(summary.m, summary.n))
    # the band is drawn from compare's canonical copy of the target
    kept = tmp_path / "canonical"
    kept.mkdir()
    copy = compare(zoos["target"], {"A": zoos["A"]}, symmetries="remove",
                   canonical_dir=kept).canonical_target
    layers = list(numbers["noise_band"])
    size = 5
    expected = mmd_noise_band(copy, layers, size, splits=2, seed=0)
    raw = mmd_noise_band(zoos["target"], layers, size, splits=2, seed=0)
    assert numbers["noise_band"] == {k: list(v) for k, v in expected.items()}
    assert expected != raw
