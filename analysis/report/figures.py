"""The report's figures, drawn by :mod:`analysis.figures` from the report's numbers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from posteriorzoo.mmd.noise import NoiseFloor


def report_figures(target: Path, target_arrays: Mapping[str, Mapping[str, np.ndarray]],
                   per_layer: Mapping[str, Mapping[str, Mapping[str, float]]],
                   noise: Mapping[str, NoiseFloor], collapse: Any, collapse_name: str,
                   entries: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any],
                                                                  dict[str, str]]:
    """Name -> Figure, and name -> a sentence of numbers for its caption."""
    from analysis.figures.draw import (
        collapse_figure,
        marginals_figure,
        mass_figure,
        mmd_figure,
        pca_figure,
    )
    from analysis.figures.sources import unit_layout
    from analysis.figures.statistics import pca_explained_variance, pearson
    from analysis.figures.styles import collection_style, method_style
    from posteriorzoo.collection import min_mass
    from posteriorzoo.zoo import open_zoo

    figures: dict[str, Any] = {}
    notes: dict[str, str] = {}
    with open_zoo(target) as zoo:
        layout = unit_layout(zoo)
    raw = target_arrays["keep"]
    figures["marginals"] = marginals_figure(
        raw, target_arrays.get("remove"),
        unit_axes={key: layout[key][0] for key in raw},
        exchangeable={key: layout[key][1] for key in raw})
    masses = min_mass(target)
    figures["mass"] = mass_figure(masses.mass_before, masses.mass_after,
                                  masses.max_abs_before, masses.max_abs_after)
    ratio = masses.mass_after / masses.mass_before
    notes["mass"] = (f"Min-mass lowers the mass of {100 * np.mean(ratio < 1):.1f}% of the "
                     f"{len(ratio)} checkpoints (median {np.nanmedian(masses.mass_before):.3g}"
                     f" -> {np.nanmedian(masses.mass_after):.3g}; largest ratio after / "
                     f"before {np.nanmax(ratio):.4f}).")
    if collapse.pairwise_id is not None and collapse.pairwise_ood is not None:
        figures["collapse"] = collapse_figure(collapse.pairwise_id, collapse.pairwise_ood,
                                              id_name=collapse.dataset,
                                              ood_name=collapse.ood_dataset)
        r, _ = pearson(collapse.pairwise_id, collapse.pairwise_ood)
        notes["collapse"] = (f"{collapse_name}: {len(collapse.pairs)} pairs, Pearson r = "
                             f"{r:.2f}.")
    # each method drawn in the style of what its file holds, as posteriorzoo plot draws it
    styles = {"target": method_style("target")}
    curves = {"target": pca_explained_variance(_flat(raw))}
    for entry in entries:
        with open_zoo(Path(entry["path"])) as zoo:
            styles[entry["name"]] = collection_style(zoo, entry["name"])
            curves[entry["name"]] = pca_explained_variance(
                _flat({key: zoo.layer(key) for key in raw}))
    for treatment, name in (("keep", "mmd"), ("remove", "ns-mmd")):
        if treatment in per_layer and treatment in noise:
            floor = noise[treatment]
            figures[name] = mmd_figure(per_layer[treatment],
                                       {layer: floor.layer_band(layer)
                                        for layer in floor.layers}, treatment, styles=styles)
    figures["pca"] = pca_figure(curves, styles=styles)
    return figures, notes


def _flat(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """``(N, D)``: every layer of each checkpoint in one row."""
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(len(a), -1)
                           for a in arrays.values()], axis=1)
