"""The figures' data read from collection files, through the collection layer.

Each function takes collection paths and returns plain arrays for
:mod:`analysis.figures.draw`; nothing here plots or writes outside a temporary folder.
Canonical forms come from :func:`posteriorzoo.collection.canonicalize` (written to a
temporary folder and deleted), masses from :func:`posteriorzoo.collection.min_mass`, MMD
from :func:`posteriorzoo.collection.compare`, predictions from
:func:`posteriorzoo.collection.evaluation.member_probabilities`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from analysis.figures.statistics import gram_explained_variance
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_choice
from posteriorzoo.vocabulary import KERNEL_STATISTICS, SYMMETRY_CHOICES

__all__ = ["CollapseData", "MarginalLayers", "canonical_copy", "collapse_data",
           "marginal_layers", "mmd_noise_band", "mmd_values", "pca_curve", "select_keys",
           "unit_layout"]

PathLike = str | os.PathLike


def select_keys(zoo, patterns: Sequence[str] | None = None) -> list[str]:
    """The parameter keys of an open collection matching ``patterns`` (fnmatch; default:
    every parameter), in state_dict order; a pattern matching nothing is an
    :class:`~posteriorzoo.errors.UnknownNameError` naming the layers."""
    from posteriorzoo.collection.comparison import parameter_keys
    from posteriorzoo.mmd.sources import group_layers, select_layers

    keys = parameter_keys(zoo)
    chosen = select_layers(group_layers(keys, zoo.shapes), patterns)
    return [key for layer in chosen for key in layer.keys]


def is_canonical(zoo) -> bool:
    """Whether an open collection was written by the canonicalizer."""
    return "canonicalized_from" in zoo.annotations


def unit_layout(zoo) -> dict[str, tuple[int, bool]]:
    """For each state key: the axis its units are on, and whether they may be permuted.

    Derived from the network's symmetry structure (:mod:`posteriorzoo.symmetry`): a
    tensor that writes a permutable unit space has its units on axis 0 (output channels
    or neurons); a tensor that only reads one (a last layer) has them on axis 1; other
    tensors (output biases) get axis 0, not exchangeable.
    """
    from posteriorzoo.symmetry import symmetry_structure

    structure = symmetry_structure(zoo.architecture, zoo.state_dict(0),
                                   num_classes=zoo.num_classes, **zoo.model_options)
    permutable = set(structure.permutable())
    writes = {axis.key for i in permutable for axis in structure.spaces[i].writers}
    reads = {axis.key for i in permutable for axis in structure.spaces[i].readers
             if axis.axis == 1 and axis.groups == 1}
    return {key: (0, True) if key in writes else (1, True) if key in reads else (0, False)
            for key in zoo.state_keys}


@contextlib.contextmanager
def canonical_copy(path: PathLike, *, permutation: str = "first", scaling: str = "norm",
                   verify: bool = True) -> Iterator[Path]:
    """The canonical form of a collection, in a temporary folder of TMPDIR deleted
    afterwards (:func:`posteriorzoo.outputs.temporary_folder`), or the collection itself
    if it is canonical already."""
    from posteriorzoo.collection import canonicalize
    from posteriorzoo.zoo import open_zoo

    with open_zoo(path) as zoo:
        already = is_canonical(zoo)
    if already:
        yield Path(path)
        return
    from posteriorzoo.outputs import temporary_folder

    # locked while in use: a later run removes the folder of a killed one
    with temporary_folder("plot") as folder:
        target = folder / "canonical.h5"
        canonicalize(path, target, permutation=permutation, scaling=scaling, verify=verify)
        yield target


# ------------------------------------------------------------------------- marginals
@dataclass
class MarginalLayers:
    """Layers across checkpoints for :func:`~analysis.figures.draw.marginals_figure`.

    ``raw``/``canonical``: ``{key: (N, *shape)}`` (None when not asked for, or ``raw`` for
    a collection that is canonical already); ``unit_axes``/``exchangeable``: from
    :func:`unit_layout`.
    """

    raw: dict[str, np.ndarray] | None
    canonical: dict[str, np.ndarray] | None
    unit_axes: dict[str, int]
    exchangeable: dict[str, bool]


def marginal_layers(path: PathLike, layers: Sequence[str] | None = None, *,
                    symmetries: str = "both", permutation: str = "first",
                    scaling: str = "norm", verify: bool = True) -> MarginalLayers:
    """Read the layers of a collection as stored and/or in canonical form.

    ``symmetries``: ``"keep"`` (as stored), ``"remove"`` (canonical) or ``"both"``. A
    collection that is canonical already has no raw form: it is shown as canonical.
    """
    from posteriorzoo.zoo import open_zoo

    check_choice("symmetries", symmetries, SYMMETRY_CHOICES)
    with open_zoo(path, verify=verify) as zoo:
        if len(zoo) < 2:
            raise InvalidOptionError(f"{path}: marginals need at least 2 checkpoints")
        keys = select_keys(zoo, layers)
        layout = unit_layout(zoo)
        stored = {key: zoo.layer(key) for key in keys}
        already = is_canonical(zoo)
    if already:
        if symmetries == "keep":
            raise InvalidOptionError(f"{path} is canonical (symmetries removed): its raw "
                                     "marginals are not in it")
        raw, canonical = None, stored
    else:
        raw = stored if symmetries in ("keep", "both") else None
        canonical = None
        if symmetries in ("remove", "both"):
            with canonical_copy(path, permutation=permutation, scaling=scaling,
                                verify=verify) as copy, open_zoo(copy) as zoo:
                canonical = {key: zoo.layer(key) for key in keys}
    return MarginalLayers(raw, canonical, {k: layout[k][0] for k in keys},
                          {k: layout[k][1] for k in keys})


# -------------------------------------------------------------------------- collapse
@dataclass
class CollapseData:
    """Pairwise mutual information (nats) of member pairs, in and out of distribution.

    ``id_mi``/``ood_mi``: (P,); ``pairs``: (P, 2) checkpoint indices; ``images``: how
    many images of each dataset were used.
    """

    id_mi: np.ndarray
    ood_mi: np.ndarray
    pairs: np.ndarray
    id_name: str
    ood_name: str
    images: dict[str, int]


def collapse_data(path: PathLike, ood_data: str, *, id_data: str | None = None,
                  images: int = 2000, pairs: int = 2000, seed: int = 0,
                  data_dir: PathLike | None = None, verify: bool = True) -> CollapseData:
    """Pairwise mutual information of random member pairs on ID and OOD test images:
    :func:`posteriorzoo.collection.evaluate` with ``n_pairs`` (the same numbers as the
    report's collapse figure).

    Parameters
    ----------
    path : path-like
        The collection.
    ood_data : str
        Out-of-distribution dataset (:func:`posteriorzoo.data.load_dataset` name).
    id_data : str, optional
        In-distribution dataset (default: the collection's). Both are normalised with the
        in-distribution dataset's mean and std, as the networks were trained.
    images : int
        The first ``images`` test images of each dataset.
    pairs : int
        At most this many member pairs, drawn with ``seed``
        (:func:`posteriorzoo.metrics.draw_pairs`).
    seed : int
        Seed of the pairs.
    data_dir : path-like, optional
        Folder searched first for the dataset files.
    verify : bool
        Check every checkpoint's SHA-256 as it is read.
    """
    from posteriorzoo.collection import evaluate

    result = evaluate(path, dataset=id_data, ood_dataset=ood_data, n_images=images,
                      n_pairs=pairs, seed=seed,
                      data_dir=None if data_dir is None else str(data_dir), verify=verify)
    if result.pairs is None:
        raise InvalidOptionError(f"{path}: pairwise MI needs at least 2 checkpoints")
    counts = result.image_counts
    return CollapseData(result.pairwise_id, result.pairwise_ood, result.pairs,
                        result.dataset, ood_data,
                        {result.dataset: counts["id"], ood_data: counts["ood"]})


# ------------------------------------------------------------------------------- MMD
def mmd_values(report, symmetries: str = "keep", statistic: str = "median"
               ) -> dict[str, dict[str, float]]:
    """``{method: {layer: value}}`` of a :class:`~posteriorzoo.collection.CompareResult`
    for one symmetry setting; ``statistic``: median, mean or max over the kernels."""
    check_choice("statistic", statistic, KERNEL_STATISTICS)
    values: dict[str, dict[str, float]] = {method: {} for method in report.methods}
    for result in report.results:
        if result.symmetries == symmetries:
            values[result.method][result.layer] = float(getattr(result, statistic))
    return {method: layers for method, layers in values.items() if layers}


def mmd_noise_band(target: PathLike, layers: Sequence[str], size: int, *, splits: int = 5,
                   seed: int = 0, verify: bool = True) -> dict[str, tuple[float, float]]:
    """The noise band of each layer's median MMD^2: the 5th to 95th percentile over
    ``splits`` random splits of the target into ``size`` held-out checkpoints and the
    rest (:func:`posteriorzoo.mmd.noise_floor`, as in the report)."""
    from posteriorzoo.mmd import noise_floor
    from posteriorzoo.zoo import open_zoo

    with open_zoo(target, verify=verify) as zoo:
        arrays = {key: zoo.layer(key) for key in layers}
    floor = noise_floor(arrays, symmetries="keep", held_out=size, splits=splits, seed=seed)
    return {key: floor.layer_band(key) for key in floor.layers}


def collection_styles(paths: Mapping[str, PathLike]) -> dict[str, Any]:
    """``{name: MethodStyle}`` of the collection each figure label ``name`` draws, from
    what its file holds (:func:`~analysis.figures.styles.collection_style`), so that
    ``plot`` draws a method as the report does, whatever the file is called."""
    from analysis.figures.styles import collection_style
    from posteriorzoo.zoo import open_zoo

    styles = {}
    for name, path in paths.items():
        with open_zoo(path) as zoo:
            styles[name] = collection_style(zoo, name)
    return styles


# ------------------------------------------------------------------------------- PCA
def pca_curve(path: PathLike, layers: Sequence[str] | None = None, *,
              verify: bool = True) -> np.ndarray:
    """Cumulative explained-variance ratio of the collection's flattened weights (N, D).

    The Gram matrix of the centred weights (N x N) is summed layer by layer, so memory is
    one layer plus N^2 values; diverged checkpoints are left out.
    """
    from posteriorzoo.zoo import open_zoo

    with open_zoo(path, verify=verify) as zoo:
        keep = ~np.asarray(zoo.metadata["diverged"], dtype=bool)
        if keep.sum() < 2:
            raise InvalidOptionError(f"{path}: PCA needs 2 checkpoints that did not diverge")
        gram = np.zeros((int(keep.sum()),) * 2)
        features = 0
        for key in select_keys(zoo, layers):
            block = zoo.layer(key)[keep].reshape(int(keep.sum()), -1).astype(np.float64)
            block -= block.mean(axis=0)
            gram += block @ block.T
            features += block.shape[1]
    return gram_explained_variance(gram, features)
