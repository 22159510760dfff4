"""The report page's details: the provenance folded away, the warning of a target too
small for its noise floor, and one colour and marker per method in every figure."""

from __future__ import annotations

import numpy as np
import pytest
from zoo_helpers import checkpoint

from analysis.figures import mmd_figure, pca_figure
from analysis.figures.styles import method_style
from analysis.report import build_report
from analysis.report.page import html_page, markdown_page, noise_floor_warning, table1_text
from posteriorzoo.errors import SampleSizeError
from posteriorzoo.mmd import held_out_size, small_target_warning
from posteriorzoo.mmd.noise import MIN_TARGET_RATIO
from posteriorzoo.zoo import create_zoo


def _collection(path, seeds, method="de"):
    states = [checkpoint(seed) for seed in seeds]
    with create_zoo(path, architecture="optunet", dataset="digits", method=method,
                    num_classes=10, template=states[0]) as zoo:
        zoo.append_many(states)
    return path


def test_small_target_is_warned_about_and_the_provenance_is_folded(tmp_path):
    # 12 target checkpoints against methods of 4: below 5 x 4 = 20
    target = _collection(tmp_path / "target.h5", range(12))
    method = _collection(tmp_path / "de.h5", range(100, 104))
    report = build_report(target, {"DE": method}, splits=3, n_images=50, figures=False)
    warning = noise_floor_warning(report)
    assert warning is not None and "12 checkpoints" in warning
    assert f"at least {MIN_TARGET_RATIO * 4} checkpoints" in warning
    page = html_page(report)
    assert '<p class="warning" id="noise-warning">' in page
    assert "<details><summary>" in page
    details = page.split("<details>", 1)[1].split("</details>", 1)[0]
    assert '<pre id="provenance">' in details and "sha256" in details
    assert "Warning." in markdown_page(report) and "warning:" in table1_text(report)


def test_a_large_enough_target_has_no_warning(tmp_path):
    target = _collection(tmp_path / "target.h5", range(22))
    method = _collection(tmp_path / "de.h5", range(100, 104))
    report = build_report(target, {"DE": method}, splits=2, n_images=50, figures=False)
    assert noise_floor_warning(report) is None
    assert 'id="noise-warning"' not in html_page(report)
    assert "Warning." not in markdown_page(report)


def test_report_labels_and_file_names_get_one_style_per_method():
    pairs = [("MM-SWAG", "optunet-fashion-mnist-swag-multi-mode"),
             ("SWAG", "optunet-fashion-mnist-swag"),
             ("Dropout", "optunet-fashion-mnist-mc-dropout"),
             ("BBB (trained-variance)", "optunet-fashion-mnist-bbb-trained-variance"),
             ("DE", "optunet-fashion-mnist-de"), ("target", "optunet-fashion-mnist-target"),
             ("MM-Laplace", "optunet-fashion-mnist-laplace-multi-mode")]
    for label, stem in pairs:
        assert method_style(label) == method_style(stem), label
    styles = {method_style(label) for label, _ in pairs}
    assert len(styles) == len(pairs)                    # every method its own
    assert method_style("SWAG").colour == method_style("MM-SWAG").colour
    assert method_style("SWAG").marker != method_style("MM-SWAG").marker
    # a name of one's own: the same style in every call
    assert method_style("my method") == method_style("my method")
    assert method_style("SWAG (canonical)").colour == method_style("SWAG (raw)").colour


def test_figures_draw_each_method_in_its_style():
    per_layer = {"SWAG": {"a": 0.1, "b": 0.2}, "MM-SWAG": {"a": 0.05, "b": 0.1}}
    figure = mmd_figure(per_layer)
    drawn = {line.get_label(): line for line in figure.axes[0].get_lines()}
    for name in per_layer:
        assert drawn[name].get_marker() == method_style(name).marker
        assert drawn[name].get_color() == method_style(name).colour
    curves = {"optunet-fashion-mnist-swag": np.linspace(0.2, 1.0, 5)}
    line = pca_figure(curves).axes[0].get_lines()[0]
    assert line.get_color() == method_style("SWAG").colour


def test_held_out_size_is_the_methods_median_capped_by_the_target():
    assert held_out_size(1000, [100, 100, 40]) == 100
    assert held_out_size(1000, [10, 30]) == 20
    assert held_out_size(8, [6, 6]) == 6
    assert held_out_size(8, [100]) == 6          # the target keeps 2
    assert held_out_size(50, [1]) == 2           # an unbiased MMD^2 needs 2
    with pytest.raises(SampleSizeError, match="at least 4 checkpoints"):
        held_out_size(3, [2])
    assert small_target_warning(1000, 100) is None
    assert small_target_warning(500, 100) is None
    assert "499 checkpoints" in small_target_warning(499, 100)


def test_plot_and_report_draw_a_file_in_the_style_of_what_it_holds(tmp_path, capsys,
                                                                     monkeypatch):
    # a SWAG collection in a file whose name says nothing of it: SWAG's colour and marker in
    # plot mmd, plot pca and the report's figures; the target's file keeps the target's
    from zoo_helpers import run

    import analysis.figures.draw as draw

    target = _collection(tmp_path / "target.h5", range(12))
    (tmp_path / "b").mkdir()
    swag = _collection(tmp_path / "b" / "zoo.h5", range(100, 104), method="swag")
    given = {}

    def capturing(name):
        drawn = getattr(draw, name)

        def capture(*args, **kwargs):
            given[name] = kwargs.get("styles")
            return drawn(*args, **kwargs)
        return capture

    for name in ("mmd_figure", "pca_figure"):
        monkeypatch.setattr(draw, name, capturing(name))
    code, _, err = run(capsys, "plot", "mmd", target, swag, "--noise-splits", "0",
                       "--out", tmp_path / "mmd")
    assert code == 0, err
    assert given["mmd_figure"] == {"zoo": method_style("SWAG")}
    assert method_style("zoo") != method_style("SWAG")       # the name alone would not tell
    code, _, err = run(capsys, "plot", "pca", target, swag, "--symmetries", "both",
                       "--out", tmp_path / "pca")
    assert code == 0, err
    swag_style = method_style("SWAG")
    assert given["pca_figure"] == {
        "target (raw)": method_style("target"), "zoo (raw)": swag_style,
        "target (canonical)": method_style("target (canonical)"),
        "zoo (canonical)": method_style("SWAG (canonical)")}
    monkeypatch.undo()
    report = build_report(target, [swag], splits=2, n_images=50, n_pairs=5)
    for figure in ("mmd", "pca"):
        lines = {line.get_label().split(":")[0]: line
                 for line in report.figures[figure].axes[0].get_lines()}
        assert lines["SWAG"].get_color() == swag_style.colour, figure
        assert lines["SWAG"].get_marker() == swag_style.marker, figure
    assert lines["target"].get_color() == method_style("target").colour
