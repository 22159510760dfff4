"""The MMD noise floor: the same statistic between disjoint draws of the target itself.

A method's MMD to the target is only meaningful next to what "another draw of the
target" scores. Two references, both computed with the MMD engine of the report
(:func:`posteriorzoo.mmd.compare_arrays`, the same 20 kernels and layer weights):

- **halves**: the target split once into two disjoint halves (m/2 against m/2);
- **splits**: ``splits`` random disjoint splits into a held-out part of ``n`` checkpoints
  (the methods' sample size) and the remaining m - n, each scored like a method. Their
  5th to 95th percentile is the noise band: a method inside it cannot be told from
  another draw of the target with n samples.

Every split derives from ``seed``. The statistic is the unbiased MMD^2, so values near 0
can be negative.

The target's pairwise distances are computed once per layer; each split gathers its rows
from them (a distance does not depend on which block or sample computes it:
:mod:`posteriorzoo.mmd.distances`). Each split's X and Y together hold all of the
target's pairs, so the kernel sums over them are read from one table per layer for any
bandwidth (:class:`~posteriorzoo.mmd.pair_sums.KernelPairSums`); a split sums its X-Y and
Y-Y pairs itself and X's are the rest. Every split's statistics are those of
:func:`posteriorzoo.mmd.compare_arrays` on the split's arrays to rounding (1e-10
relative, tested), at a fraction of the cost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.errors import InvalidOptionError, SampleSizeError
from posteriorzoo.mmd.cache import (
    DistanceCache,
    DistanceKey,
    array_row_hashes,
    precision_key,
)
from posteriorzoo.mmd.comparison import Comparison, LayerResult, check_symmetry_setting
from posteriorzoo.mmd.distances import (
    DEFAULT_PRECISION,
    Distances,
    SharedTargetDistances,
    unpack,
)
from posteriorzoo.mmd.pair_sums import KernelPairSums
from posteriorzoo.mmd.sources import (
    DEFAULT_BLOCK_BYTES,
    ArraySource,
    Layer,
    features_per_block,
    group_layers,
    layer_blocks,
    select_layers,
)
from posteriorzoo.mmd.statistics import (
    BANDWIDTH_ROWS,
    bandwidths_from_distances,
    check_number_bandwidths,
    kernel_mmds_from_distances,
    kernel_names,
)
from posteriorzoo.options import check_integer

#: Percentiles of the split statistics that bound the noise band.
BAND_PERCENTILES = (5.0, 95.0)
#: The noise floor says little when the target holds fewer than this many times the n of
#: its splits: a split then keeps less than 80% of the target, and the splits overlap
#: heavily (:func:`small_target_warning`).
MIN_TARGET_RATIO = 5


@public
def held_out_size(target_count: int, method_counts: Sequence[int]) -> int:
    """n of the noise floor's splits for methods of ``method_counts`` checkpoints.

    The methods' median sample size, at least 2 (an unbiased MMD^2 needs 2), and at
    most ``target_count - 2``, so that a target no larger than the methods still gets a
    band (one :func:`small_target_warning` names as too narrow). The report and
    ``posteriorzoo plot mmd`` size their bands with it.

    Raises
    ------
    SampleSizeError
        If the target holds fewer than 4 checkpoints (2 held out, 2 kept).
    """
    if target_count < 4:
        raise SampleSizeError(f"the noise floor needs a target of at least 4 checkpoints "
                              f"(2 held out, 2 kept), not {target_count}")
    if not method_counts:
        raise InvalidOptionError("held_out_size() needs the methods' sample sizes")
    return int(min(max(int(np.median(method_counts)), 2), target_count - 2))


@public
def small_target_warning(target_count: int, held_out: int) -> str | None:
    """A sentence when a target of ``target_count`` checkpoints is too small for splits of
    ``held_out`` (fewer than :data:`MIN_TARGET_RATIO` times it), else None."""
    if target_count >= MIN_TARGET_RATIO * held_out:
        return None
    return (f"The target holds {target_count} checkpoints, fewer than {MIN_TARGET_RATIO} "
            f"times the {held_out} of each noise-floor split: its splits leave less than "
            f"{100 - 100 // MIN_TARGET_RATIO}% of the target and overlap heavily, so the "
            "noise band is too narrow and too noisy to tell methods from another draw of the "
            f"target. Use a target of at least {MIN_TARGET_RATIO * held_out} checkpoints "
            "(the paper's: 1,000 against 100).")


@dataclass
class NoiseFloor:
    """The target-against-itself statistics of one symmetry setting (``"keep"`` or ``"remove"``).

    Attributes
    ----------
    symmetries : {"keep", "remove"}
    held_out : int
        n of the random splits (the methods' sample size).
    halves : dict
        Model-level ``median``, ``mean``, ``max`` (MMD^2, layer-weighted) of the halves.
    splits : numpy.ndarray
        ``(splits,)`` model-level median MMD^2 of each random split.
    layers : dict
        Layer -> ``(splits,)`` median MMD^2 of each split on that layer.
    """

    symmetries: str
    held_out: int
    halves: dict[str, float]
    splits: np.ndarray
    layers: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def band(self) -> tuple[float, float]:
        """The 5th and 95th percentiles of the splits' model-level medians."""
        low, high = np.percentile(self.splits, BAND_PERCENTILES)
        return float(low), float(high)

    def layer_band(self, layer: str) -> tuple[float, float]:
        low, high = np.percentile(self.layers[layer], BAND_PERCENTILES)
        return float(low), float(high)

    def contains(self, value: float) -> bool:
        """Whether a method's model-level median lies inside the band."""
        low, high = self.band
        return low <= value <= high

    def to_dict(self) -> dict[str, Any]:
        low, high = self.band
        return {"symmetries": self.symmetries, "held_out": self.held_out,
                "halves": self.halves, "splits": self.splits.tolist(),
                "band": {"percentiles": list(BAND_PERCENTILES), "low": low, "high": high},
                "layers": {name: values.tolist() for name, values in self.layers.items()}}


@public
def noise_floor(target: Mapping[str, np.ndarray] | Any, *, symmetries: str, held_out: int,
                splits: int = 50, seed: int = 0, number_bandwidths: int = 10,
                row_digests: Sequence[str] | None = None,
                block_bytes: int = DEFAULT_BLOCK_BYTES, precision: str = DEFAULT_PRECISION,
                device: str = "cpu") -> NoiseFloor:
    """The noise floor of the MMD against ``target``.

    Parameters
    ----------
    target : mapping of str to array of shape (m, *shape), or a sample source
        The target's samples per layer (stored weights, or canonical forms): arrays, or a
        source that reads blocks of them (a collection's
        :class:`~posteriorzoo.collection.comparison.ZooSource`), streamed so that memory
        holds one block and one layer's (m, m) distances, never the weights.
    symmetries : {"keep", "remove"}
        What ``target`` holds (a label of the result).
    held_out : int
        n of the random splits, 2 <= n <= m - 2.
    splits : int
        Number of random splits.
    seed : int
        Seed of the halves and of every split.
    number_bandwidths : int
        Bandwidths per kernel family, as in the report's comparison.
    row_digests : sequence of str, optional
        The content hashes of the target's rows (a collection's ``Zoo.digests``), so that
        the target's distances are shared through the distance cache with ``mmd`` of the
        same collection (:mod:`posteriorzoo.mmd.cache`); default: the hashes of the
        arrays' rows.
    block_bytes : int
        Budget of one block of features read from ``target``.
    precision, device
        The distances' arithmetic and where it runs (:func:`self_distances`), as in the
        comparison the floor is read against.
    """
    check_integer("splits", splits, 1)
    check_integer("seed", seed, 0)
    source = target if hasattr(target, "read") else ArraySource("target", target)
    count = source.rows
    check_integer("held_out", held_out, 2)
    if held_out > count - 2:
        raise InvalidOptionError(f"held_out must leave at least 2 of the target's {count} "
                                 f"checkpoints, not {held_out}")
    check_symmetry_setting(symmetries)
    check_number_bandwidths(number_bandwidths)
    if row_digests is not None and len(row_digests) != count:
        raise InvalidOptionError(f"row_digests holds {len(row_digests)} hashes for the "
                                 f"target's {count} checkpoints")
    if row_digests is None:
        row_digests = getattr(source, "row_digests", None)
    chosen = select_layers(group_layers(list(source.shapes), source.shapes), None)
    rng = np.random.default_rng(seed)
    order = rng.permutation(count)
    draws = [(order[:count // 2], order[count // 2:])]
    for _ in range(splits):
        order = rng.permutation(count)
        draws.append((order[held_out:], order[:held_out]))

    # Every split's X and Y together hold all of the target's pairs: their kernel sums for
    # any bandwidth come from one table per layer (KernelPairSums), made for the smallest
    # bandwidth any split's rule chooses (read first from the splits' first rows, as the
    # rule reads them); each split then sums its X-Y and Y-Y pairs itself, gathered one
    # split at a time so memory stays that of one split (a flat take: numpy's two-axis
    # fancy indexing is ten times slower here).
    upper = np.triu_indices(count, 1)
    empty = (np.empty(0), np.empty(0))

    def distances(l1: np.ndarray, l2sq: np.ndarray, first: np.ndarray, second: np.ndarray,
                  within_y: bool = True) -> Distances:
        # The X-Y block read as Y's rows (the matrices are symmetric, bit for bit): a few
        # whole rows rather than a few entries of most rows, a tenth of the memory read
        where = (second[:, None] * count + first).ravel()
        pairs = _packed_pairs(second, count) if within_y else np.empty(0, dtype=np.int64)
        return Distances(xx=empty, yy=(l1.take(pairs), l2sq.take(pairs)),
                         xy=tuple(np.ascontiguousarray(
                             matrix.take(where).reshape(len(second), len(first)).T)
                             for matrix in (l1, l2sq)), m=len(first), n=len(second))

    by_layer = []
    for layer in chosen:
        # The layer's full (count, count) L1 and squared-L2 matrices, once for every
        # split, read from the distance cache when the same rows were measured before.
        l1, l2sq = (matrix.ravel() for matrix in self_distances(
            source, layer, row_digests, block_bytes=block_bytes, precision=precision,
            device=device))
        widths = [bandwidths_from_distances(distances(l1, l2sq, first[:BANDWIDTH_ROWS],
                                                      second[:BANDWIDTH_ROWS], False),
                                            number_bandwidths) for first, second in draws]
        every_pair = KernelPairSums(
            l1.reshape(count, count)[upper], l2sq.reshape(count, count)[upper],
            *(min(width[family][0] for width in widths) for family in range(2)))
        by_layer.append([LayerResult("draw", symmetries, layer.name, layer.keys, layer.size,
                                     kernel_mmds_from_distances(
                                         distances(l1, l2sq, first, second),
                                         number_bandwidths, z_pairs=every_pair))
                         for first, second in draws])
    scored = [Comparison([results[k] for results in by_layer], ["draw"],
                         kernel_names(number_bandwidths)) for k in range(len(draws))]

    summary = scored[0].summary("draw", symmetries)
    medians, layers = [], {}
    for comparison in scored[1:]:
        medians.append(comparison.summary("draw", symmetries).median)
        for result in comparison.results:
            layers.setdefault(result.layer, []).append(result.median)
    return NoiseFloor(symmetries, held_out,
                      {"median": summary.median, "mean": summary.mean, "max": summary.max,
                       "m": summary.m, "n": summary.n},
                      np.array(medians), {k: np.array(v) for k, v in layers.items()})


@public
def self_distances(source: Any, layer: Layer, row_digests: Sequence[str] | None = None, *,
                   block_bytes: int = DEFAULT_BLOCK_BYTES, precision: str = DEFAULT_PRECISION,
                   device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """The full (m, m) L1 and squared-L2 matrices of one layer of a sample source's m rows,
    streamed block by block of features (memory: one block and the matrices), through the
    distance cache (:mod:`posteriorzoo.mmd.cache`) when it is on and the layer is large.

    ``row_digests`` (the rows' content hashes, a collection's ``Zoo.digests``) key the
    cache; without them, in-memory arrays are hashed row by row and other sources are not
    cached.
    """
    count = source.rows
    cache = DistanceCache.from_environment()
    entry = None
    if cache is not None and cache.worth(count, layer.size):
        if row_digests is None and isinstance(source, ArraySource):
            row_digests = array_row_hashes([source.arrays[key] for key in layer.keys])
        if row_digests is not None:
            entry = DistanceKey(tuple(str(d) for d in row_digests), tuple(layer.keys),
                                tuple(tuple(int(s) for s in source.shapes[key])
                                      for key in layer.keys), precision_key(precision, device))
    packed = cache.load(entry) if entry is not None else None
    if packed is None:
        shared = SharedTargetDistances(count, [], precision=precision, device=device)
        for block in layer_blocks(source, layer, features_per_block(count, block_bytes)):
            shared.update(block, [], check_finite=False)   # layer_blocks checked it
        packed = shared.self_packed()
        if entry is not None:
            cache.store(entry, *packed)
    return unpack(packed[0], count), unpack(packed[1], count)


def _packed_pairs(rows: np.ndarray, count: int) -> np.ndarray:
    """Positions in a flattened (count, count) matrix of the pairs (rows[a], rows[b]),
    a < b, in packed order: (0, 1), (0, 2), ..., (1, 2), ..."""
    first, second = np.triu_indices(len(rows), 1)
    return rows[first] * count + rows[second]
