"""The paper's figures, one function each: plain arrays in, a matplotlib Figure out.

Every function builds a :class:`matplotlib.figure.Figure` with the object-oriented API
(no ``pyplot``, no global state, safe in threads and on machines without a display);
save it with :func:`analysis.figures.save.save_figure` or embed it with
:func:`analysis.figures.save.png_base64`.

- :func:`marginals_figure`: layer marginals, raw and canonical, with KS p-values between
  units (Fig. 9; Proposition 1: equal marginals while permutations are kept).
- :func:`mass_figure`: mass before and after min-mass, and each layer's largest weight
  (Fig. 2).
- :func:`collapse_figure`: pairwise mutual information in and out of distribution and
  their scatter with Pearson's r (Figs. 3 and 7).
- :func:`mmd_figure`: MMD^2 per layer and method, with the target-vs-target noise band.
- :func:`pca_figure`: cumulative explained variance of the weights' principal components.

Names that come from the user or a file (methods, layers, datasets) reach titles, ticks
and legends through :func:`posteriorzoo.text.matplotlib_text`, so a ``$`` in a name is
shown as it is rather than parsed as mathtext.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from analysis.figures.statistics import (
    ks_summary,
    pearson,
    unit_ks_pvalues,
    unit_marginals,
    unit_position,
)
from analysis.figures.styles import MethodStyle, method_style
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_choice
from posteriorzoo.text import MMD_DISPLAY_SCALE, matplotlib_text, scaled_label
from posteriorzoo.vocabulary import SYMMETRIES

__all__ = ["collapse_figure", "marginals_figure", "mass_figure", "mmd_figure", "pca_figure"]

#: Titles of the two symmetry settings of the weights.
RAW_TITLE = "raw: symmetries kept"
CANONICAL_TITLE = "canonical: symmetries removed"
NOISE_LABEL = "target vs target (noise floor)"
_BOX = {"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "edgecolor": "0.7"}


def _figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _note(ax: Axes, text: str, corner: str = "upper right") -> None:
    x, ha = (0.98, "right") if corner.endswith("right") else (0.02, "left")
    y, va = (0.97, "top") if corner.startswith("upper") else (0.03, "bottom")
    ax.text(x, y, text, transform=ax.transAxes, ha=ha, va=va, fontsize=7.5, bbox=_BOX)


def _finite(values: np.ndarray, name: str) -> tuple[np.ndarray, int]:
    values = np.asarray(values, dtype=np.float64).ravel()
    keep = np.isfinite(values)
    if not keep.any():
        raise InvalidOptionError(f"{name} holds no finite value")
    return values[keep], int((~keep).sum())


def ks_text(pvalues: np.ndarray) -> str:
    """The KS summary printed on a marginal panel."""
    summary = ks_summary(pvalues)
    if summary["pairs"] == 0:
        return "KS: one unit, no pair to compare"
    return (f"two-sample KS between units ({summary['pairs']} "
            f"pair{'' if summary['pairs'] == 1 else 's'}):\n"
            f"median p = {summary['median']:.3g}, min p = {summary['min']:.3g}")


# ----------------------------------------------------------------------------- Fig. 9
def marginals_figure(raw: Mapping[str, np.ndarray] | None,
                     canonical: Mapping[str, np.ndarray] | None = None, units: int = 4, *,
                     unit_axes: Mapping[str, int] | None = None,
                     exchangeable: Mapping[str, bool] | None = None,
                     bins: int = 40) -> Figure:
    """Layer marginals, raw and with symmetries removed, with KS p-values between units.

    One row per layer, one column per symmetry setting given (raw, canonical). A panel shows,
    for each of the first ``units`` units, the histogram over the N checkpoints of one
    weight position of that unit (:func:`~analysis.figures.statistics.unit_marginals`),
    and prints the median and minimum two-sample Kolmogorov-Smirnov p-value between the
    units shown. Proposition 1 says the raw marginals of exchangeable units are equal
    (large p-values); sorting the units (canonical form) makes them differ.

    Parameters
    ----------
    raw, canonical : mapping of str to ndarray of shape (N, *shape), optional
        Each layer's tensor across N checkpoints as stored (symmetries kept) and in
        canonical form (symmetries removed); at least one of them. Same layer names.
    units : int
        Units drawn and compared per layer.
    unit_axes : mapping of str to int, optional
        The tensor axis indexed by a layer's units (default 0: output units; 1 for a last
        layer, whose inputs are the permutable units).
    exchangeable : mapping of str to bool, optional
        Whether a layer's units may be permuted (printed on the raw panel).
    bins : int
        Histogram bins.

    Returns
    -------
    Figure
        ``layers x symmetry settings`` axes.
    """
    columns = [(title, data) for title, data in ((RAW_TITLE, raw), (CANONICAL_TITLE, canonical))
               if data is not None]
    if not columns:
        raise InvalidOptionError("give the raw layers, the canonical layers or both")
    names = list(columns[0][1])
    if not names:
        raise InvalidOptionError("no layer to draw")
    for _, data in columns[1:]:
        if list(data) != names:
            raise InvalidOptionError(f"raw and canonical layers differ: {names} and "
                                     f"{list(data)}")
    unit_axes, exchangeable = dict(unit_axes or {}), dict(exchangeable or {})
    figure = _figure(5.2 * len(columns), 2.9 * len(names))
    grid = figure.subplots(len(names), len(columns), squeeze=False)
    for row, name in enumerate(names):
        axis = unit_axes.get(name, 0)
        for column, (title, data) in enumerate(columns):
            ax = grid[row, column]
            layer = np.asarray(data[name])
            samples = unit_marginals(layer, axis, units)
            finite = samples[np.isfinite(samples)]
            edges = np.histogram_bin_edges(finite if finite.size else [0.0], bins=bins)
            for u in range(samples.shape[1]):
                ax.hist(samples[:, u][np.isfinite(samples[:, u])], bins=edges,
                        histtype="step", density=True, linewidth=1.2, label=f"unit {u}")
            ax.set_ylim(0.0, ax.get_ylim()[1] * 1.4)  # room for the legend and the note
            text = ks_text(unit_ks_pvalues(samples))
            if name in exchangeable and column == 0 and data is raw:
                text += ("\nunits exchangeable: Prop. 1 predicts equal marginals"
                         if exchangeable[name] else "\nunits fixed (not permutable)")
            _note(ax, text)
            ax.set_title(f"{matplotlib_text(name)} ({title}), N = {layer.shape[0]}",
                         fontsize=9)
            ax.set_xlabel(f"weight value, {unit_position(axis, layer.ndim - 1)}", fontsize=8)
            ax.set_ylabel("density (per unit of weight)", fontsize=8)
            ax.legend(fontsize=7, loc="upper left")
    figure.suptitle("Layer marginals of the posterior (paper Fig. 9)")
    return figure


# ----------------------------------------------------------------------------- Fig. 2
def mass_figure(mass_before: np.ndarray, mass_after: np.ndarray,
                largest_before: Mapping[str, np.ndarray] | None = None,
                largest_after: Mapping[str, np.ndarray] | None = None, *,
                bins: int = 40) -> Figure:
    """Mass before and after min-mass, and each layer's largest weight (paper Fig. 2).

    Parameters
    ----------
    mass_before, mass_after : ndarray of shape (N,)
        Each checkpoint's mass, the sum of its squared weights (biases excluded), as
        trained and after the minimum-mass rescaling (same function). Checkpoints with a
        NaN in either (diverged) are left out of both.
    largest_before, largest_after : mapping of str to ndarray of shape (N,), optional
        Each weight tensor's largest absolute value per checkpoint, before and after.
    bins : int
        Histogram bins.

    Returns
    -------
    Figure
        One axis (the masses), or two with the largest weights.
    """
    mass_before = np.asarray(mass_before, dtype=np.float64).ravel()
    mass_after = np.asarray(mass_after, dtype=np.float64).ravel()
    if mass_before.shape != mass_after.shape:
        raise InvalidOptionError(f"mass_before and mass_after must pair up: "
                                 f"{mass_before.size} and {mass_after.size} values")
    both = np.isfinite(mass_before) & np.isfinite(mass_after)
    before, _ = _finite(mass_before[both], "mass_before")
    after, _ = _finite(mass_after[both], "mass_after")
    dropped = int((~both).sum())
    with_largest = bool(largest_before) or bool(largest_after)
    figure = _figure(11.0 if with_largest else 5.5, 3.8)
    axes = figure.subplots(1, 2 if with_largest else 1, squeeze=False)[0]
    ax = axes[0]
    edges = np.histogram_bin_edges(np.concatenate([before, after]), bins=bins)
    ax.hist(before, bins=edges, alpha=0.6, label=f"as trained (median {np.median(before):.4g})")
    ax.hist(after, bins=edges, alpha=0.6,
            label=f"after min-mass (median {np.median(after):.4g})")
    ax.set_ylim(0.0, ax.get_ylim()[1] * 1.3)
    ax.set_xlabel(r"mass $\sum_l \|W_l\|^2$ (sum of squared weights, biases excluded)")
    ax.set_ylabel("checkpoints")
    ax.set_title("mass before and after min-mass (same functions)")
    ax.legend(fontsize=8, loc="upper right")
    text = f"median mass ratio after / before: {np.median(after / before):.4f}"
    if dropped:
        text += f"\n{dropped} non-finite checkpoint{'s' if dropped > 1 else ''} left out"
    _note(ax, text, "upper left")
    if with_largest:
        _draw_largest(axes[1], largest_before or {}, largest_after or {})
    figure.suptitle("Scaling symmetries: minimum-mass rescaling (paper Fig. 2)")
    return figure


def _draw_largest(ax: Axes, before: Mapping[str, np.ndarray],
                  after: Mapping[str, np.ndarray]) -> None:
    layers = list(dict.fromkeys([*before, *after]))
    positive = []
    for offset, data, label, colour in ((-0.2, before, "as trained", "C0"),
                                        (0.2, after, "after min-mass", "C1")):
        values = [(i + offset, _finite(data[name], name)[0])
                  for i, name in enumerate(layers) if name in data]
        if not values:
            continue
        positive += [v[v > 0] for _, v in values]
        parts = ax.boxplot([v for _, v in values], positions=[p for p, _ in values],
                           widths=0.35, patch_artist=True, showfliers=True,
                           flierprops={"markersize": 2})
        for box in parts["boxes"]:
            box.set_facecolor(colour)
            box.set_alpha(0.6)
        ax.plot([], [], "s", color=colour, alpha=0.6, label=label)
    values = np.concatenate(positive) if positive else np.empty(0)
    if values.size and values.max() / max(values.min(), 1e-300) > 100:
        ax.set_yscale("log")
    ax.set_xticks(range(len(layers)), [matplotlib_text(name) for name in layers], rotation=30,
                  ha="right", fontsize=8)
    ax.set_xlabel("weight tensor")
    ax.set_ylabel("largest |w| in the tensor (weight units)")
    ax.set_title("each layer's largest weight, per checkpoint")
    ax.legend(fontsize=8)


# ------------------------------------------------------------------------- Figs. 3, 7
def collapse_figure(id_mi: np.ndarray, ood_mi: np.ndarray, *,
                    id_name: str = "in-distribution", ood_name: str = "out-of-distribution",
                    bins: int = 40) -> Figure:
    """Functional collapse: pairwise mutual information in and out of distribution.

    Parameters
    ----------
    id_mi, ood_mi : ndarray of shape (P,)
        For P member pairs, the mutual information of the two-member ensemble averaged
        over the in- and out-of-distribution images, in nats (in [0, log 2]); entry p of
        both is the same pair (:func:`posteriorzoo.metrics.pairwise_mutual_information`).
    id_name, ood_name : str
        Dataset names for the titles.
    bins : int
        Histogram bins.

    Returns
    -------
    Figure
        Three axes: the ID histogram, the OOD histogram, their scatter with Pearson's r.
    """
    id_mi = np.asarray(id_mi, dtype=np.float64).ravel()
    ood_mi = np.asarray(ood_mi, dtype=np.float64).ravel()
    if id_mi.shape != ood_mi.shape:
        raise InvalidOptionError(f"id_mi and ood_mi must pair up: {id_mi.size} and "
                                 f"{ood_mi.size} values")
    r, p = pearson(id_mi, ood_mi)
    id_name, ood_name = matplotlib_text(id_name), matplotlib_text(ood_name)
    figure = _figure(14.0, 3.9)
    axes = figure.subplots(1, 3)
    for ax, values, title, colour in ((axes[0], id_mi, f"in-distribution: {id_name}", "C0"),
                                      (axes[1], ood_mi, f"out-of-distribution: {ood_name}",
                                       "C1")):
        ax.hist(values, bins=bins, color=colour, alpha=0.8)
        ax.set_xlabel("pairwise mutual information (nats)")
        ax.set_ylabel("member pairs")
        ax.set_title(title, fontsize=10)
        _note(ax, f"{values.size} pairs\nmean {values.mean():.4g}, std {values.std():.3g}")
    ax = axes[2]
    ax.scatter(id_mi, ood_mi, s=6, alpha=0.5)
    ax.set_xlabel(f"pairwise MI on {id_name} (nats)")
    ax.set_ylabel(f"pairwise MI on {ood_name} (nats)")
    ax.set_title("in- vs out-of-distribution MI, one point per pair", fontsize=10)
    _note(ax, f"Pearson r = {r:.3f} (p = {p:.2g})\n{id_mi.size} pairs", "upper left")
    figure.suptitle("Functional collapse: pairwise mutual information (paper Figs. 3, 7)")
    return figure


# -------------------------------------------------------------------------------- MMD
def _value_scale(ax: Axes, values: np.ndarray) -> str:
    """Linear, log or symlog y axis for values that may span decades or be negative."""
    values = values[np.isfinite(values)]
    magnitudes = np.abs(values[values != 0])
    if magnitudes.size == 0 or magnitudes.max() / magnitudes.min() <= 100:
        return "linear"
    if (values <= 0).any():
        threshold = float(np.quantile(magnitudes, 0.1))
        ax.set_yscale("symlog", linthresh=threshold)
        ax.axhline(0.0, color="0.5", linewidth=0.6)
        return f"symlog (linear within ±{threshold:.2g})"
    ax.set_yscale("log")
    return "log"


def mmd_figure(per_layer: Mapping[str, Mapping[str, float]],
               noise: Mapping[str, tuple[float, float]] | None = None,
               symmetries: str = "keep", *, statistic: str = "median",
               kernels: int = 20, scale: float = MMD_DISPLAY_SCALE,
               styles: Mapping[str, MethodStyle] | None = None) -> Figure:
    """MMD^2 of each method to the target, per layer, with the noise band.

    Parameters
    ----------
    per_layer : mapping of str to mapping of str to float
        ``{method: {layer: MMD^2}}``: the statistic over the kernels of each layer's
        unbiased MMD^2 (:class:`~posteriorzoo.collection.CompareResult`), raw; it may be
        slightly negative.
    noise : mapping of str to (float, float), optional
        ``{layer: (low, high)}``: the range of the same statistic between disjoint random
        halves of the target, shaded as "target vs target (noise floor)"; raw.
    symmetries : {"keep", "remove"}
        Whether the weights were compared as stored (MMD) or canonical (NS-MMD).
    statistic : str
        Which statistic over the kernels the values are (for the axis label).
    kernels : int
        Number of kernels (for the axis label).
    scale : float
        The values and the band are drawn multiplied by this, and the axis label says so
        (default :data:`~posteriorzoo.text.MMD_DISPLAY_SCALE`, as every MMD table).
    styles : mapping of str to MethodStyle, optional
        A method's style (:func:`~analysis.figures.styles.collection_style`: from what its
        file holds); a method not in it is styled by its name
        (:func:`~analysis.figures.styles.method_style`).

    Returns
    -------
    Figure
        One axis; a log or symlog scale when the values span more than two decades.
    """
    check_choice("symmetries", symmetries, tuple(SYMMETRIES))
    if not per_layer:
        raise InvalidOptionError("no method to draw")
    layers = list(dict.fromkeys(name for values in per_layer.values() for name in values))
    if noise:
        layers += [name for name in noise if name not in layers]
    figure = _figure(max(7.5, 1.2 * len(layers) + 4.5), 4.4)
    ax = figure.subplots()
    everything = []
    if noise:
        for i, name in enumerate(layers):
            if name in noise:
                low, high = (scale * bound for bound in noise[name])
                ax.fill_between([i - 0.42, i + 0.42], low, high, color="0.6", alpha=0.35,
                                linewidth=0, label=NOISE_LABEL if not everything else None)
                everything += [low, high]
    count = len(per_layer)
    for k, (method, values) in enumerate(per_layer.items()):
        offset = (k - (count - 1) / 2) * min(0.6 / max(count, 1), 0.15)
        xs = [i + offset for i, name in enumerate(layers) if name in values]
        ys = [scale * float(values[name]) for name in layers if name in values]
        everything += ys
        style = _style(method, styles)   # the same in every figure, report and plot
        ax.plot(xs, ys, linestyle="none", marker=style.marker, color=style.colour,
                markersize=6, label=matplotlib_text(method))
    axis_scale = _value_scale(ax, np.asarray(everything, dtype=np.float64))
    ax.set_xticks(range(len(layers)), [matplotlib_text(name) for name in layers], rotation=30,
                  ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(layers) - 0.4)
    ax.set_xlabel("layer (one parameter tensor)")
    name = SYMMETRIES[symmetries].statistic
    ax.set_ylabel(f"{scaled_label(name + '$^2$', scale)} to the target (unitless)\n"
                  f"{matplotlib_text(statistic)} over "
                  f"{kernels} kernels, {axis_scale.split(' ')[0]} scale", fontsize=9)
    if axis_scale.startswith("symlog"):
        _note(ax, f"y axis {axis_scale}", "lower left")
    title = RAW_TITLE if symmetries == "keep" else CANONICAL_TITLE
    ax.set_title(f"{name} per layer and method ({title})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return figure


# -------------------------------------------------------------------------------- PCA
def pca_figure(curves: Mapping[str, np.ndarray], *, threshold: float = 0.9,
               styles: Mapping[str, MethodStyle] | None = None) -> Figure:
    """Cumulative explained variance of the principal components of the weights.

    Parameters
    ----------
    curves : mapping of str to ndarray of shape (K,)
        ``{collection: cumulative ratio}``
        (:func:`~analysis.figures.statistics.pca_explained_variance`).
    threshold : float
        A horizontal line, with the components each curve needs to reach it.
    styles : mapping of str to MethodStyle, optional
        A curve's style, as in :func:`mmd_figure`.

    Returns
    -------
    Figure
        One axis.
    """
    if not curves:
        raise InvalidOptionError("no curve to draw")
    figure = _figure(8.5, 4.2)
    ax = figure.subplots()
    for name, curve in curves.items():
        curve = np.asarray(curve, dtype=np.float64).ravel()
        components = np.arange(1, curve.size + 1)
        reached = np.flatnonzero(curve >= threshold)
        needed = reached[0] + 1 if reached.size else f">{curve.size}"
        style = _style(name, styles)   # the same in every figure, report and plot
        # the legend says how many components each collection needs to reach the threshold
        ax.plot(components, curve, color=style.colour, linestyle=style.linestyle,
                marker=style.marker if curve.size <= 60 else None, markersize=4,
                label=f"{matplotlib_text(name)}: {needed} of {curve.size}")
    ax.axhline(threshold, color="0.5", linestyle="--", linewidth=0.8)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("number of principal components")
    ax.set_ylabel("cumulative explained variance (fraction of the total)")
    ax.set_title("PCA of the flattened weights")
    figure.legend(fontsize=8, loc="outside right upper",
                  title=f"components for {threshold:.0%}", title_fontsize=8)
    return figure


def _style(name: str, styles: Mapping[str, MethodStyle] | None) -> MethodStyle:
    """The style given for ``name``, else the one its name tells."""
    return (styles or {}).get(name) or method_style(name)
