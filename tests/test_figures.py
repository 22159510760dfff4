"""The paper's figures: their numbers, their drawings, their files and ``posteriorzoo plot``.

Tolerances (issue 30 section 1): the statistics are scipy's and numpy's own functions on
the same float64 numbers (compared exactly) or another implementation of the same
quantity (scikit-learn's PCA, numpy's correlation), bounded by Higham's ``gamma(k, U64)``
of the terms and, for a spectrum, by the backward error of the SVD or eigensolver
(Weyl's inequality). The draws are numpy Generators' at fixed seeds, the same bits on
every CPU: the statistical checks are deterministic, with the values measured stated.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from PIL import Image
from rounding_bounds import U64, gamma
from scipy import stats
from sklearn.decomposition import PCA
from zoo_helpers import assert_one_line_error, run

import posteriorzoo.cli
from analysis.figures import (
    collapse_figure,
    figure_paths,
    gram_explained_variance,
    ks_summary,
    marginals_figure,
    mass_figure,
    mmd_figure,
    pca_explained_variance,
    pca_figure,
    pearson,
    png_base64,
    save_figure,
    unit_ks_pvalues,
    unit_marginals,
)
from analysis.figures.draw import NOISE_LABEL
from posteriorzoo.errors import InvalidOptionError, OutputExistsError
from posteriorzoo.models import build
from posteriorzoo.zoo import create_zoo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOT_MODULE = "posteriorzoo.cli.plot_command"


# ------------------------------------------------------------------------- statistics
def test_unit_ks_pvalues_are_scipys_two_sample_tests():
    rng = np.random.default_rng(0)
    samples = rng.normal(size=(300, 4)) + np.array([0.0, 0.0, 0.3, 1.0])
    pvalues = unit_ks_pvalues(samples)
    assert pvalues.shape == (4, 4)
    np.testing.assert_array_equal(pvalues, pvalues.T)
    np.testing.assert_array_equal(np.diag(pvalues), 1.0)
    for a in range(4):
        for b in range(a + 1, 4):
            # scipy's function on the same values (a copy of the column): bit for bit
            expected = stats.ks_2samp(samples[:, a], samples[:, b]).pvalue
            assert pvalues[a, b] == expected


def test_ks_pvalues_are_large_for_iid_units_and_tiny_for_shifted_ones():
    # Deterministic draws (seed 1; p-values of scipy's exact or asymptotic KS, which a
    # CPU changes by rounding only). Measured: iid median p 0.29 (limit 0.1), smallest of
    # the 15 pairs 0.017 (limit 1e-3, which over seeds it would cross with probability at
    # most 15 x 1e-3); shifted by 1 sd, 1,000 draws: median 2e-70, smallest 8e-225
    # (limit 1e-20).
    rng = np.random.default_rng(1)
    iid = unit_ks_pvalues(rng.normal(size=(1000, 6)))
    summary = ks_summary(iid)
    assert summary["pairs"] == 15 and summary["median"] > 0.1 and summary["min"] > 1e-3
    shifted = unit_ks_pvalues(rng.normal(size=(1000, 3)) + np.array([0.0, 1.0, 2.0]))
    assert ks_summary(shifted)["min"] < 1e-20 and ks_summary(shifted)["median"] < 1e-20
    assert ks_summary(np.ones((1, 1))) == {"pairs": 0, "median": None, "min": None}


def test_ks_leaves_out_non_finite_values():
    rng = np.random.default_rng(2)
    samples = rng.normal(size=(200, 2))
    with_nan = samples.copy()
    with_nan[5, 0] = np.nan
    expected = stats.ks_2samp(np.delete(samples[:, 0], 5), samples[:, 1]).pvalue
    assert unit_ks_pvalues(with_nan)[0, 1] == expected       # the same call, bit for bit


def test_unit_marginals_take_one_weight_position_per_unit():
    layer = np.arange(3 * 4 * 2 * 5, dtype=float).reshape(3, 4, 2, 5)  # N=3, shape (4, 2, 5)
    np.testing.assert_array_equal(unit_marginals(layer), layer[:, :, 0, 0])
    np.testing.assert_array_equal(unit_marginals(layer, axis=1), layer[:, 0, :, 0])
    assert unit_marginals(layer, units=2).shape == (3, 2)
    with pytest.raises(InvalidOptionError):
        unit_marginals(layer, axis=3)


def test_pca_of_a_rank_two_dataset():
    """Bounds: LAPACK's SVD and symmetric eigensolver are backward stable, the computed
    spectrum exact for a matrix within ``gamma(p)`` of the input's norm (Higham, chapters
    19-20; ``p`` taken as the matrix's entries): by Weyl's inequality each singular value
    of the centred ``m x d`` weights C moves by ``delta = gamma(m d) |C|``, each variance
    ``sigma^2`` by ``2 sigma delta``, the cumulative ratio by at most ``2 sqrt(d)
    gamma(m d)`` (sum sigma <= sqrt(d) |C|), and its sums and division by ``gamma(d + 2)``."""
    rng = np.random.default_rng(3)
    weights = rng.normal(size=(50, 2)) @ rng.normal(size=(2, 30)) + rng.normal(size=30)
    count, features = weights.shape
    curve = pca_explained_variance(weights)
    assert curve.shape == (30,)
    # Rank 2 up to rounding: the variances past the second are squares of the rounding
    # errors' singular values (the data's product, the centring, the SVD: at most d
    # gamma(m d) of |C| each, squared: 3e-23), plus the cumulative sum's rounding
    # (gamma(d + 1)). Measured: exactly 1 (the curve is clipped at 1).
    rank_two = gamma(features + 1, U64) + (features * gamma(count * features, U64)) ** 2
    assert curve[0] < 0.999 and abs(curve[1] - 1.0) <= rank_two
    # a cumulative sum of non-negative variances over a fixed total, clipped at 1: rounding
    # is monotone, so the curve never decreases
    assert np.all(np.diff(curve) >= 0)
    # scikit-learn's SVD of the same centred data (its own centring and ratios): each
    # side within 2 sqrt(d) gamma(m d) + gamma(d + 2) (docstring). Measured 3e-5 of it.
    spectrum = 2 * math.sqrt(features) * gamma(count * features, U64) + gamma(features + 2, U64)
    reference = np.cumsum(PCA().fit(weights).explained_variance_ratio_)
    np.testing.assert_allclose(curve, reference, rtol=0, atol=2 * spectrum)
    # The Gram matrix's eigenvalues: its float64 product is within gamma(d) of |C| |C|^T,
    # the eigensolver within gamma(m^2) of |G|; each of the (at most m) eigenvalues
    # summed into an entry moves by that, over the trace; plus its own sums' rounding and
    # the SVD side's. Measured 1e-4 of the bound.
    centred = weights - weights.mean(axis=0)
    gram = centred @ centred.T
    perturbation = (gamma(features, U64) * np.linalg.norm(np.abs(centred) @ np.abs(centred).T)
                    + gamma(count * count, U64) * np.linalg.norm(gram))
    gram_bound = count * perturbation / np.trace(gram) + gamma(count + 2, U64) + spectrum
    np.testing.assert_allclose(gram_explained_variance(gram, 30), curve, rtol=0,
                               atol=gram_bound)
    with pytest.raises(InvalidOptionError):
        pca_explained_variance(np.ones((5, 3)))


def test_pearson_is_numpys_correlation():
    rng = np.random.default_rng(4)
    x = rng.normal(size=200)
    y = 0.3 * x + rng.normal(size=200)
    r, p = pearson(x, y)
    # scipy's r against numpy's: on each side every rounding (the mean's n, the
    # centring, the product, the n-term sum, the norms, their roots and the division:
    # 2 n + 8 on the longest path) is at most u of a term of
    # sum (|x| + |mean x|)(|y| + |mean y|), over sqrt(Sxx Syy). Measured 9e-4 of it.
    n = len(x)
    scale = (((np.abs(x) + abs(x.mean())) * (np.abs(y) + abs(y.mean()))).sum()
             / math.sqrt(((x - x.mean()) ** 2).sum() * ((y - y.mean()) ** 2).sum()))
    assert abs(r - np.corrcoef(x, y)[0, 1]) <= 2 * gamma(2 * n + 8, U64) * scale
    # the test's p-value, deterministic (seed 4): 1.1e-4 measured
    assert 0 <= p < 1e-3
    assert np.isnan(pearson(x, np.ones(200))[0])
    with pytest.raises(InvalidOptionError):
        pearson(x, y[:10])


def test_random_pairs_are_distinct_and_seeded():
    from posteriorzoo.metrics import draw_pairs as random_pairs

    pairs = random_pairs(30, 100, seed=5)
    assert pairs.shape == (100, 2) and np.all(pairs[:, 0] < pairs[:, 1])
    assert pairs.max() < 30 and len({tuple(p) for p in pairs}) == 100
    np.testing.assert_array_equal(pairs, random_pairs(30, 100, seed=5))
    assert not np.array_equal(pairs, random_pairs(30, 100, seed=6))
    everything = random_pairs(5, 100, seed=0)
    assert len(everything) == 10 and len({tuple(p) for p in everything}) == 10


# ---------------------------------------------------------------------------- drawing
def _labelled(figure: Figure, count: int) -> None:
    assert isinstance(figure, Figure)
    assert len(figure.axes) == count
    for ax in figure.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()


def _texts(figure: Figure) -> str:
    return "\n".join(t.get_text() for ax in figure.axes for t in ax.texts)


def test_marginals_figure():
    rng = np.random.default_rng(6)
    raw = {"conv.weight": rng.normal(size=(200, 5, 1, 3, 3)), "fc.weight": rng.normal(
        size=(200, 10, 5))}
    canonical = {key: np.sort(value, axis=1) for key, value in raw.items()}
    figure = marginals_figure(raw, canonical, units=3, unit_axes={"fc.weight": 1},
                              exchangeable={"conv.weight": True, "fc.weight": True})
    _labelled(figure, 4)
    titles = [ax.get_title() for ax in figure.axes]
    assert sum("raw: symmetries kept" in t for t in titles) == 2
    assert sum("canonical: symmetries removed" in t for t in titles) == 2
    expected = ks_summary(unit_ks_pvalues(unit_marginals(raw["conv.weight"], 0, 3)))
    assert f"median p = {expected['median']:.3g}" in figure.axes[0].texts[0].get_text()
    assert "Prop. 1" in _texts(figure)
    assert len(figure.axes[0].get_legend().get_texts()) == 3
    _labelled(marginals_figure(None, canonical), 2)
    with pytest.raises(InvalidOptionError):
        marginals_figure(None, None)


def test_mass_figure():
    rng = np.random.default_rng(7)
    before = rng.uniform(5, 8, 100)
    after = before * rng.uniform(0.6, 0.9, 100)
    after[3] = np.nan  # a diverged checkpoint
    largest = {"a.weight": rng.uniform(0.1, 1, 100), "b.weight": rng.uniform(1, 2, 100)}
    figure = mass_figure(before, after, largest, {k: v * 2 for k, v in largest.items()})
    _labelled(figure, 2)
    assert "1 non-finite" in _texts(figure)
    _labelled(mass_figure(before, after), 1)


def test_collapse_figure_prints_pearson_r():
    rng = np.random.default_rng(8)
    id_mi = rng.uniform(0, 0.1, 300)
    ood_mi = id_mi + rng.normal(0, 0.02, 300)
    figure = collapse_figure(id_mi, ood_mi, id_name="digits", ood_name="noise")
    _labelled(figure, 3)
    r = np.corrcoef(id_mi, ood_mi)[0, 1]
    assert f"Pearson r = {r:.3f}" in figure.axes[2].texts[0].get_text()
    assert "nats" in figure.axes[0].get_xlabel()
    assert len(figure.axes[2].collections[0].get_offsets()) == 300


def test_mmd_figure_band_and_scales():
    values = {"DE": {"w": 1e-4, "b": 2e-3}, "SWAG": {"w": 0.5, "b": 0.8}}
    figure = mmd_figure(values, {"w": (-1e-3, 2e-3), "b": (-5e-4, 1e-3)}, "keep")
    _labelled(figure, 1)
    ax = figure.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [NOISE_LABEL, "DE", "SWAG"]
    assert ax.get_yscale() == "symlog"  # negative noise values, four decades
    assert "symmetries kept" in ax.get_title()
    positive = mmd_figure({"DE": {"w": 1e-4, "b": 0.5}}, symmetries="remove").axes[0]
    assert positive.get_yscale() == "log" and "symmetries removed" in positive.get_title()
    assert mmd_figure({"DE": {"w": 0.1, "b": 0.2}}).axes[0].get_yscale() == "linear"


def test_pca_figure():
    curves = {"a": np.array([0.5, 0.8, 0.95, 1.0]), "b": np.linspace(0.1, 1.0, 10)}
    figure = pca_figure(curves)
    _labelled(figure, 1)
    assert len(figure.axes[0].get_lines()) == 3  # two curves and the 90% line
    labels = [t.get_text() for legend in figure.legends for t in legend.get_texts()]
    assert labels == ["a: 3 of 4", "b: 9 of 10"]   # components reaching 90% of the variance


# ----------------------------------------------------------------------------- saving
def test_save_figure_writes_png_and_pdf_atomically(tmp_path):
    figure = pca_figure({"a": np.array([0.6, 1.0])})
    written = save_figure(figure, tmp_path / "curve")
    assert written == {"png": tmp_path / "curve.png", "pdf": tmp_path / "curve.pdf"}
    png = written["png"].read_bytes()
    assert png.startswith(PNG_MAGIC)
    with Image.open(io.BytesIO(png)) as image:
        image.load()
        assert image.format == "PNG" and image.size[0] > 100
    assert written["pdf"].read_bytes().startswith(b"%PDF")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.pdf", "curve.png"]

    before = {kind: path.read_bytes() for kind, path in written.items()}
    with pytest.raises(OutputExistsError):
        save_figure(figure, tmp_path / "curve.pdf")
    assert {kind: path.read_bytes() for kind, path in written.items()} == before
    written["pdf"].unlink()
    with pytest.raises(OutputExistsError):  # the PNG exists: the PDF is not written either
        save_figure(figure, tmp_path / "curve")
    assert not written["pdf"].exists()
    save_figure(figure, tmp_path / "curve.png", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.pdf", "curve.png"]

    with pytest.raises(InvalidOptionError, match="does not exist"):
        save_figure(figure, tmp_path / "missing" / "curve")
    assert not (tmp_path / "missing").exists()
    source = tmp_path / "in.png"
    source.write_bytes(b"input")
    with pytest.raises(InvalidOptionError, match="input"):
        save_figure(figure, tmp_path / "in", overwrite=True, inputs=[source])
    assert source.read_bytes() == b"input"


def test_png_base64_and_figure_paths():
    decoded = base64.b64decode(png_base64(pca_figure({"a": np.array([1.0])})))
    assert decoded.startswith(PNG_MAGIC)
    assert figure_paths("out/fig.v2")["png"].name == "fig.v2.png"
    assert figure_paths("out/fig.PDF")["pdf"].name == "fig.pdf"


# -------------------------------------------------------------------------------- CLI
@pytest.fixture(autouse=True)
def _plot_registered(monkeypatch):
    if PLOT_MODULE not in posteriorzoo.cli._SUBCOMMAND_MODULES:
        monkeypatch.setattr(posteriorzoo.cli, "_SUBCOMMAND_MODULES",
                            (*posteriorzoo.cli._SUBCOMMAND_MODULES, PLOT_MODULE))


def _collection(path, seeds):
    states = []
    for seed in seeds:
        torch.manual_seed(seed)
        states.append(build("optunet").state_dict())
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=states[0]) as zoo:
        for seed, state in zip(seeds, states, strict=True):
            zoo.append(state, seed=seed, test_accuracy=0.5)
    return path


@pytest.fixture(scope="module")
def zoos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoos")
    return (_collection(folder / "target.h5", range(12)),
            _collection(folder / "method.h5", range(100, 106)))


def _plot_json(capsys, *argv):
    code, out, err = run(capsys, "plot", *argv, "--json")
    assert code == 0, err
    result = json.loads(out)
    for kind in ("png", "pdf"):
        assert os.path.getsize(result["files"][kind]) > 1000
    return result


def test_cli_marginals(zoos, tmp_path, capsys):
    target, _ = zoos
    result = _plot_json(capsys, "marginals", target, "--layers", "conv*", "--units", "3",
                        "--out", tmp_path / "marginals")
    assert result["figure"] == "marginals"
    assert result["files"]["png"] == str(tmp_path / "marginals.png")
    layers = result["numbers"]["layers"]
    assert list(layers) == ["conv1.weight", "conv2.weight"]
    conv2 = layers["conv2.weight"]
    assert conv2["exchangeable"] and conv2["unit_axis"] == 0 and conv2["checkpoints"] == 12
    assert conv2["raw"]["pairs"] == 3 and np.shape(conv2["canonical"]["ks_pvalues"]) == (3, 3)
    Image.open(tmp_path / "marginals.png").verify()

    code, out, err = run(capsys, "plot", "marginals", target, "--out", tmp_path / "marginals")
    assert_one_line_error(code, err, "already exists")
    code, _, err = run(capsys, "plot", "marginals", target, "--layers", "nope",
                       "--out", tmp_path / "other")
    assert_one_line_error(code, err, "nope")
    assert not (tmp_path / "other.png").exists()
    code, _, err = run(capsys, "plot", "marginals", tmp_path / "absent.h5",
                       "--out", tmp_path / "other")
    assert_one_line_error(code, err)
    code, _, err = run(capsys, "plot", "marginals", target, "--units", "0")
    assert_one_line_error(code, err, "--units")


def test_cli_last_layer_units_are_its_inputs(zoos, tmp_path, capsys):
    target, _ = zoos
    result = _plot_json(capsys, "marginals", target, "--layers", "fc.*", "--symmetries",
                        "keep", "--out", tmp_path / "fc.png")
    layers = result["numbers"]["layers"]
    assert layers["fc.weight"]["unit_axis"] == 1 and layers["fc.weight"]["exchangeable"]
    assert not layers["fc.bias"]["exchangeable"] and "canonical" not in layers["fc.bias"]


def test_cli_mass(zoos, tmp_path, capsys):
    target, _ = zoos
    result = _plot_json(capsys, "mass", target, "--out", tmp_path / "mass")
    numbers = result["numbers"]
    assert numbers["checkpoints"] == 12
    assert numbers["mass_after_median"] <= numbers["mass_before_median"]
    assert set(numbers["largest_abs_weight"]) == {"conv1.weight", "conv2.weight", "fc.weight"}


def test_cli_mmd(zoos, tmp_path, capsys):
    target, method = zoos
    result = _plot_json(capsys, "mmd", target, f"M={method}", "--noise-splits", "2",
                        "--out", tmp_path / "mmd")
    numbers = result["numbers"]
    assert set(numbers["per_layer"]["M"]) == {"conv1.weight", "conv2.weight", "fc.weight",
                                               "fc.bias"}
    low, high = numbers["noise_band"]["fc.weight"]
    assert low <= high
    code, _, err = run(capsys, "plot", "mmd", target, "M=", "--out", tmp_path / "x")
    assert_one_line_error(code, err, "NAME=PATH")
    code, _, err = run(capsys, "plot", "mmd", target, method, "--out", target.with_suffix(""),
                       "--overwrite")
    assert code == 0, err  # target.png/.pdf beside target.h5 are no inputs
    code, _, err = run(capsys, "plot", "mmd", target, method, "--out", target.parent / "no" /
                       "mmd")
    assert_one_line_error(code, err, "does not exist")


def test_cli_mmd_band_of_a_target_no_larger_than_the_methods_is_the_reports(zoos, tmp_path,
                                                                            capsys):
    # the 6-checkpoint collection as the target of the 12: the band's n is capped at 6 - 2
    # (held_out_size), as in the report, with the report's warning as one stderr line
    from analysis.report import build_report
    from posteriorzoo.mmd import small_target_warning

    method, target = zoos
    code, out, err = run(capsys, "plot", "mmd", target, f"M={method}", "--noise-splits", "3",
                         "--seed", "4", "--out", tmp_path / "mmd", "--json")
    assert code == 0, err
    numbers = json.loads(out)["numbers"]
    assert numbers["noise_held_out"] == 4
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "warning: The target holds 6 checkpoints" in lines[0]
    assert small_target_warning(6, 4) in lines[0]
    report = build_report(target, {"M": method}, splits=3, seed=4, n_images=20,
                          figures=False)
    floor = report.noise["keep"]
    assert floor.held_out == 4
    # the same noise_floor on the same arrays with the same seed in one process (its
    # kernels give every row to one task in a fixed order), written as repr: bit for bit
    for layer, band in numbers["noise_band"].items():
        assert tuple(band) == floor.layer_band(layer)


def test_cli_mmd_band_of_a_target_of_three_is_refused_in_one_line(zoos, tmp_path, capsys):
    _, method = zoos
    target = _collection(tmp_path / "three.h5", range(3))
    code, _, err = run(capsys, "plot", "mmd", target, method, "--noise-splits", "2",
                       "--out", tmp_path / "mmd")
    assert_one_line_error(code, err, "at least 4 checkpoints")
    assert not list(tmp_path.glob("mmd*"))
    code, _, err = run(capsys, "plot", "mmd", target, method, "--noise-splits", "0",
                       "--out", tmp_path / "mmd")
    assert code == 0, err          # without a band, 3 target checkpoints are enough


def test_cli_pca(zoos, tmp_path, capsys):
    target, method = zoos
    result = _plot_json(capsys, "pca", f"T={target}", method, "--symmetries", "both",
                        "--out", tmp_path / "pca")
    curves = result["numbers"]["curves"]
    assert set(curves) == {"T (raw)", "T (canonical)", "method (raw)", "method (canonical)"}
    assert len(curves["T (raw)"]["cumulative_ratio"]) == 12
    # the cumulative sum of the 12 variances over their sum, each within gamma(11) of the
    # exact total, one division: gamma(2 d + 1) (measured: exactly 1)
    assert curves["T (raw)"]["cumulative_ratio"][-1] == pytest.approx(
        1.0, rel=0, abs=gamma(2 * 12 + 1, U64))


def test_cli_collapse(zoos, tmp_path, capsys):
    target, _ = zoos
    result = _plot_json(capsys, "collapse", target, "--ood-data", "digits", "--n-images", "40",
                        "--n-pairs", "10", "--seed", "3", "--out", tmp_path / "collapse")
    numbers = result["numbers"]
    assert numbers["pairs"] == 10 and numbers["images"] == {"digits": 40}
    assert 0 <= numbers["id"]["min"] <= numbers["id"]["max"] <= np.log(2)
    code, _, err = run(capsys, "plot", "collapse", target, "--ood-data", "no-such-set",
                       "--out", tmp_path / "c2")
    assert_one_line_error(code, err, "no-such-set")


def test_plot_help_imports_nothing_heavy():
    code = ("import contextlib, io, json, sys\n"
            "import posteriorzoo.cli as cli\n"
            f"if {PLOT_MODULE!r} not in cli._SUBCOMMAND_MODULES:\n"
            f"    cli._SUBCOMMAND_MODULES = (*cli._SUBCOMMAND_MODULES, {PLOT_MODULE!r})\n"
            "for argv in (['plot', '--help'], ['plot', 'mmd', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            cli.main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "heavy = ('matplotlib', 'numpy', 'torch', 'scipy', 'h5py', 'analysis')\n"
            "print(json.dumps([m for m in heavy if m in sys.modules]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
