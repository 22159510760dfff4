"""The report's figures, drawn by :mod:`analysis.figures` from the report's numbers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from posteriorzoo.mmd.noise import NoiseFloor
from posteriorzoo.vocabulary import SYMMETRIES


def report_figures(target: Path, targets: Mapping[str, Any],
                   per_layer: Mapping[str, Mapping[str, Mapping[str, float]]],
                   noise: Mapping[str, NoiseFloor], collapse: Any, collapse_name: str,
                   entries: Sequence[Mapping[str, Any]],
                   distances: Mapping[str, str] | None = None
                   ) -> tuple[dict[str, Any], dict[str, str]]:
    """Name -> Figure, and name -> a sentence of numbers for its caption.

    ``targets``: the target's sample sources by symmetry setting (``"keep"``, and ``"remove"``
    when drawn; :class:`~posteriorzoo.collection.comparison.ZooSource`), read in blocks:
    the marginals read a few weights per layer, the PCA curves come from the squared
    distances between checkpoints (summed over layers; the target's through the distance
    cache the noise floor filled), so no figure holds a collection's weights in memory.
    """
    from analysis.figures.draw import (
        collapse_figure,
        marginals_figure,
        mass_figure,
        mmd_figure,
        pca_figure,
    )
    from analysis.figures.sources import unit_layout
    from analysis.figures.statistics import pearson
    from analysis.figures.styles import collection_style, method_style
    from posteriorzoo.collection import min_mass
    from posteriorzoo.collection.comparison import ZooSource
    from posteriorzoo.zoo import open_zoo

    figures: dict[str, Any] = {}
    notes: dict[str, str] = {}
    with open_zoo(target) as zoo:
        layout = unit_layout(zoo)
    raw = targets["keep"]
    axes = {key: layout[key][0] for key in raw.shapes}
    shown = {setting: _unit_weights(source, axes, UNITS_SHOWN)
             for setting, source in targets.items()}
    figures["marginals"] = marginals_figure(
        shown["keep"], shown.get("remove"), UNITS_SHOWN, unit_axes=axes,
        exchangeable={key: layout[key][1] for key in raw.shapes})
    masses = min_mass(target)
    figures["mass"] = mass_figure(masses.mass_before, masses.mass_after,
                                  masses.max_abs_before, masses.max_abs_after)
    ratio = masses.mass_after / masses.mass_before
    notes["mass"] = (f"Min-mass lowers the mass of {100 * np.mean(ratio < 1):.1f}% of the "
                     f"{len(ratio)} checkpoints (median {np.nanmedian(masses.mass_before):.3g}"
                     f" -> {np.nanmedian(masses.mass_after):.3g}; largest ratio after / "
                     f"before {np.nanmax(ratio):.4f}).")
    if collapse is not None and collapse.pairwise_id is not None \
            and collapse.pairwise_ood is not None:
        figures["collapse"] = collapse_figure(collapse.pairwise_id, collapse.pairwise_ood,
                                              id_name=collapse.dataset,
                                              ood_name=collapse.ood_dataset)
        r, _ = pearson(collapse.pairwise_id, collapse.pairwise_ood)
        notes["collapse"] = (f"{collapse_name}: {len(collapse.pairs)} pairs, Pearson r = "
                             f"{r:.2f}.")
    # each method drawn in the style of what its file holds, as posteriorzoo plot draws it
    styles = {"target": method_style("target")}
    distances = dict(distances or {})   # precision and device, as the noise floor's
    curves = {"target": _explained_variance(raw, **distances)}
    for entry in entries:
        with open_zoo(Path(entry["path"]), verify=True) as zoo:
            styles[entry["name"]] = collection_style(zoo, entry["name"])
            curves[entry["name"]] = _explained_variance(
                ZooSource(entry["name"], zoo, keys=list(raw.shapes)), **distances)
    for word, setting in SYMMETRIES.items():
        name = setting.statistic.lower()
        if word in per_layer and word in noise:
            floor = noise[word]
            figures[name] = mmd_figure(per_layer[word],
                                       {layer: floor.layer_band(layer)
                                        for layer in floor.layers}, word, styles=styles)
    figures["pca"] = pca_figure(curves, styles=styles)
    return figures, notes


#: Units per layer whose marginals the figure draws (marginals_figure's default).
UNITS_SHOWN = 4


def _unit_weights(source: Any, axes: Mapping[str, int], units: int) -> dict[str, np.ndarray]:
    """Per layer, the hyperslab of the first ``units`` units along its unit axis and index
    0 on every other axis: all that :func:`~analysis.figures.statistics.unit_marginals`
    reads, so the figure equals the one drawn from the whole arrays."""
    shown = {}
    for key, shape in source.shapes.items():
        index = tuple(slice(0, units) if axis == axes[key] else slice(0, 1)
                      for axis in range(len(shape)))
        kept = tuple(min(units, size) if axis == axes[key] else min(1, size)
                     for axis, size in enumerate(shape))
        shown[key] = source.read(key, index).reshape(source.rows, *kept)
    return shown


def _explained_variance(source: Any, **distances: str) -> np.ndarray:
    """The PCA curve of a source's flattened checkpoints, from their squared distances.

    With H the centring matrix, ``-H D H / 2`` is the Gram matrix of the centred weights
    (D: squared Euclidean distances, summed over the layers), whose eigenvalues are the
    squared singular values :func:`~analysis.figures.statistics.pca_explained_variance`
    takes; memory is one block and the (N, N) matrices. ``distances``: the precision and
    device of :func:`~posteriorzoo.mmd.self_distances` (the noise floor's, so that the
    target's come from the distance cache).
    """
    from analysis.figures.statistics import gram_explained_variance
    from posteriorzoo.mmd import self_distances
    from posteriorzoo.mmd.sources import group_layers

    layers = group_layers(list(source.shapes), source.shapes)
    squared = sum(self_distances(source, layer, getattr(source, "row_digests", None),
                                 **distances)[1] for layer in layers)
    centred = squared - squared.mean(axis=0) - squared.mean(axis=1, keepdims=True) \
        + squared.mean()
    return gram_explained_variance(-centred / 2, sum(layer.size for layer in layers))
