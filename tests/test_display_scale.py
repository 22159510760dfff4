"""One display scale for MMD^2: ``mmd``, ``report`` and ``plot mmd`` show the same value
multiplied by :data:`posteriorzoo.text.MMD_DISPLAY_SCALE`, each header says so, and CSV and
JSON keep the raw value (the JSON records the factor as ``display_scale``)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from zoo_helpers import checkpoint, run

from analysis.figures.draw import mmd_figure
from posteriorzoo.collection import compare
from posteriorzoo.text import MMD_DISPLAY_SCALE, scaled_label
from posteriorzoo.zoo import create_zoo

SCALE = MMD_DISPLAY_SCALE
FACTOR = f"(x {SCALE:g})"


def _collection(path, seeds, method="de"):
    states = [checkpoint(seed) for seed in seeds]
    with create_zoo(path, architecture="optunet", dataset="digits", method=method,
                    num_classes=10, template=states[0]) as zoo:
        zoo.append_many(states, [{"seed": seed} for seed in seeds])
    return path


@pytest.fixture(scope="module")
def zoos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scale")
    target = _collection(folder / "target.h5", range(12))
    method = _collection(folder / "method.h5", range(100, 105))
    # the raw figures every command must show scaled
    direct = compare(target, {"M": method}, symmetries="both")
    return {"target": target, "method": method, "direct": direct}


def _row(text: str, first: str) -> list[str]:
    """The cells of the Markdown table row whose first cell is ``first``."""
    line = next(line for line in text.splitlines() if line.startswith(f"| {first} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def _header(text: str) -> list[str]:
    return _row(text, "Method")


def test_the_scale_is_the_papers():
    assert SCALE == 100                    # Table 1 of the paper shows MMD^2 x 100
    assert scaled_label("MMD") == "MMD (x 100)" and scaled_label("MMD", 1) == "MMD"


def test_mmd_command_shows_the_scale_and_keeps_raw_values(zoos, tmp_path, capsys):
    out = tmp_path / "mmd"
    code, printed, err = run(capsys, "mmd", zoos["target"], f"M={zoos['method']}",
                             "--out", out, "--no-progress")
    assert code == 0, err
    direct = zoos["direct"]
    header = _header(printed)
    mmd_columns = [cell for cell in header if "MMD" in cell]
    assert len(mmd_columns) == 6 and all(cell.endswith(FACTOR) for cell in mmd_columns)
    cells = dict(zip(header, _row(printed, "M"), strict=True))
    for treatment, name in (("keep", "MMD"), ("remove", "NS-MMD")):
        raw = direct.summary("M", treatment).median
        assert cells[scaled_label(f"{name} median")] == f"{raw * SCALE:.4f}"
    # the written Markdown: every MMD header of both tables carries the factor
    markdown = (out / "mmd_report.md").read_text()
    headers = [line for line in markdown.splitlines() if line.startswith("| Method |")]
    assert len(headers) == 2
    for line in headers:
        assert all(cell.strip().endswith(FACTOR) for cell in line.split("|") if "MMD" in cell)
    # CSV and JSON: raw values, the same floats compare() returns
    data = json.loads((out / "mmd_report.json").read_text())
    assert data["display_scale"] == SCALE
    summary = {(s["symmetries"]): s for s in data["summary"]}
    rows = {r["symmetries"]: r for r in
            csv.DictReader((out / "mmd_summary.csv").read_text().splitlines())}
    for treatment in ("keep", "remove"):
        raw = direct.summary("M", treatment)
        assert summary[treatment]["median"] == raw.median
        assert float(rows[treatment]["median"]) == raw.median
        assert float(rows[treatment]["max"]) == raw.max
    layers = list(csv.DictReader((out / "mmd_layers.csv").read_text().splitlines()))
    assert [float(r["median"]) for r in layers] == [r.median for r in direct.results]


def test_report_shows_the_scale_and_keeps_raw_values(zoos, tmp_path, capsys):
    out = tmp_path / "report"
    code, printed, err = run(capsys, "report", zoos["target"], f"M={zoos['method']}",
                             "--out", out, "--n-images", "30", "--splits", "2",
                             "--n-pairs", "0", "--no-figures", "--no-progress")
    assert code == 0, err
    direct = zoos["direct"]
    header = _header(printed)
    assert scaled_label("MMD") in header and scaled_label("NS-MMD") in header
    cells = dict(zip(header, _row(printed, "M"), strict=True))
    raw = {"keep": direct.summary("M", "keep").median,
           "remove": direct.summary("M", "remove").median}
    assert cells[scaled_label("MMD")] == f"{raw['keep'] * SCALE:.2f}"
    assert cells[scaled_label("NS-MMD")] == f"{raw['remove'] * SCALE:.2f}"
    markdown = (out / "report.md").read_text()
    detail = next(line for line in markdown.splitlines() if line.startswith("| Method | n |"))
    assert all(cell.strip().endswith(FACTOR) for cell in detail.split("|") if "MMD" in cell)
    detail_header = [cell.strip() for cell in detail.strip("|").split("|")]
    detail_cells = dict(zip(detail_header, _row(markdown.split(detail)[1], "M"), strict=True))
    largest = direct.summary("M", "keep").max
    assert detail_cells[scaled_label("MMD max")] == f"{largest * SCALE:.4f}"
    # CSV and JSON raw
    data = json.loads((out / "report.json").read_text())
    assert data["display_scale"] == SCALE
    assert data["rows"][0]["mmd"] == raw["keep"] and data["rows"][0]["ns_mmd"] == raw["remove"]
    table1 = next(csv.DictReader((out / "table1.csv").read_text().splitlines()))
    assert float(table1["mmd"]) == raw["keep"] and float(table1["ns_mmd"]) == raw["remove"]


def test_plot_mmd_shows_the_scale_and_keeps_raw_values(zoos, tmp_path, capsys):
    direct = zoos["direct"]
    raw = direct.summary("M", "keep").median
    code, printed, err = run(capsys, "plot", "mmd", zoos["target"], f"M={zoos['method']}",
                             "--noise-splits", "2", "--out", tmp_path / "figure")
    assert code == 0, err
    assert f"{scaled_label('MMD^2')} (median, weighted over layers): M {raw * SCALE:.4g}" \
        in printed
    code, printed, err = run(capsys, "plot", "mmd", zoos["target"], f"M={zoos['method']}",
                             "--noise-splits", "2", "--out", tmp_path / "numbers", "--json")
    assert code == 0, err
    numbers = json.loads(printed)["numbers"]
    assert numbers["display_scale"] == SCALE
    assert numbers["model_level"] == {"M": raw}
    assert numbers["per_layer"]["M"] == {r.layer: r.median for r in direct.results
                                         if r.symmetries == "keep"}


def test_the_mmd_figure_draws_scaled_values_and_says_so():
    values = {"DE": {"w": 2e-4, "b": 3e-3}}
    band = {"w": (-1e-4, 4e-4), "b": (1e-4, 5e-3)}
    ax = mmd_figure(values, band, "keep").axes[0]
    assert scaled_label("MMD$^2$") in ax.get_ylabel()
    points = ax.lines[0].get_ydata()
    # the figure draws the same float64 products it is given: exact
    np.testing.assert_array_equal(points, [SCALE * 2e-4, SCALE * 3e-3])
    shaded = ax.collections[0].get_paths()[0].vertices[:, 1]
    np.testing.assert_array_equal([shaded.min(), shaded.max()], [SCALE * -1e-4, SCALE * 4e-4])
    ax = mmd_figure(values, None, "remove", scale=1).axes[0]
    np.testing.assert_array_equal(ax.lines[0].get_ydata(), [2e-4, 3e-3])
    assert "(x " not in ax.get_ylabel() and "NS-MMD$^2$" in ax.get_ylabel()
