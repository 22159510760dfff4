"""Layer-by-layer comparison of approximate posteriors with the target posterior (pure).

For every method and every layer: the 20 MMD^2 statistics of the target's samples (X, e.g.
1000 checkpoints) against the method's (Y, e.g. 100), their median, mean and max; per
method, the mean over layers of each of these weighted by the layers' parameter counts
(the figures of the paper's Table 2). ``symmetries`` labels what the samples are:
``"keep"`` (stored weights: MMD) or ``"remove"`` (canonical forms: NS-MMD).

Each layer is read once for all methods (the target's self-distances are shared), in
blocks of features, so memory stays O((m + n)^2 + block) even for layers with millions
of weights. :func:`compare_arrays` works on arrays in memory and returns a
:class:`Comparison`; :func:`posteriorzoo.collection.compare` does the same for
collection files and wraps it in a report that writes CSV, JSON and Markdown.
"""

# ruff: noqa: N803, N806 -- the paper's and MMDAgg's names: X, Y, B1, B2, B3

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from posteriorzoo._api import public
from posteriorzoo._faults import fault_point
from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.mmd.aggregated import MMDAggResult, check_test_options, mmdagg_from_distances
from posteriorzoo.mmd.cache import DistanceCache, layer_distances
from posteriorzoo.mmd.distances import DEFAULT_PRECISION, Distances, check_precision
from posteriorzoo.mmd.pair_sums import KernelPairSums
from posteriorzoo.mmd.sources import (
    DEFAULT_BLOCK_BYTES,
    ArraySource,
    Layer,
    check_sources,
    features_per_block,
    group_layers,
    layer_blocks,
    select_layers,
)
from posteriorzoo.mmd.statistics import (
    KernelMMDs,
    bandwidths_from_distances,
    check_number_bandwidths,
    kernel_mmds_from_distances,
    kernel_names,
)
from posteriorzoo.options import check_choice
from posteriorzoo.vocabulary import KERNEL_STATISTICS, SYMMETRIES

#: What a comparison's samples are: stored weights, or canonical forms (the vocabulary's
#: :data:`~posteriorzoo.vocabulary.SYMMETRIES` settings, in their order).
SYMMETRY_SETTINGS = tuple(SYMMETRIES)


def check_symmetry_setting(symmetries: object) -> str:
    """``symmetries`` if it is ``"keep"`` or ``"remove"``."""
    return check_choice("symmetries", symmetries, SYMMETRY_SETTINGS)


@dataclass
class LayerResult:
    """The comparison of one method with the target on one layer.

    Attributes
    ----------
    method : str
        The method's name.
    symmetries : {"keep", "remove"}
        Stored weights (MMD) or canonical forms (NS-MMD).
    layer : str
        Layer name; ``keys`` are the state keys it concatenates.
    parameters : int
        Values per checkpoint in the layer (its weight in the model-level means).
    mmd : KernelMMDs
        The 20 statistics (unbiased MMD^2) and bandwidths; ``mmd.m`` and ``mmd.n`` are
        the target's and the method's sample sizes.
    test : MMDAggResult or None
        The MMDAgg test, if it was asked for.
    """

    method: str
    symmetries: str
    layer: str
    keys: tuple[str, ...]
    parameters: int
    mmd: KernelMMDs
    test: MMDAggResult | None = None

    @property
    def median(self) -> float:
        return self.mmd.median

    @property
    def mean(self) -> float:
        return self.mmd.mean

    @property
    def max(self) -> float:
        return self.mmd.max


@dataclass
class MethodSummary:
    """A method's model-level figures: per-layer statistics averaged with layer sizes;
    ``m`` and ``n`` are the target's and the method's sample sizes."""

    method: str
    symmetries: str
    layers: int
    parameters: int
    m: int
    n: int
    median: float
    mean: float
    max: float
    rejected_layers: int | None = None


@dataclass(repr=False)
class Comparison:
    """Every number of a comparison (no files: see :mod:`posteriorzoo.collection`)."""

    results: list[LayerResult]
    methods: list[str]
    kernels: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)

    def size_text(self) -> str:
        """``"3 methods x 2 symmetry settings x 9 layers"``."""
        def count(number: int, noun: str) -> str:
            return f"{number} {noun}{'' if number == 1 else 's'}"

        layers = len(dict.fromkeys(r.layer for r in self.results))
        return (f"{count(len(self.methods), 'method')} x "
                f"{count(len(self.symmetry_settings()), 'symmetry setting')} x "
                f"{count(layers, 'layer')}")

    def __repr__(self) -> str:  # one line, not every layer's 20 values
        return f"<Comparison: {self.size_text()}; .summaries() and .results for the numbers>"

    def summaries(self) -> list[MethodSummary]:
        """One :class:`MethodSummary` per method and symmetry setting, in input order."""
        out = []
        for symmetries in SYMMETRY_SETTINGS:
            for method in self.methods:
                rows = [r for r in self.results
                        if r.method == method and r.symmetries == symmetries]
                if not rows:
                    continue
                weights = np.array([r.parameters for r in rows], dtype=np.float64)
                figures = {stat: float(np.average([getattr(r, stat) for r in rows],
                                                  weights=weights))
                           for stat in KERNEL_STATISTICS}
                tested = [r.test for r in rows if r.test is not None]
                out.append(MethodSummary(
                    method, symmetries, len(rows), int(weights.sum()), rows[0].mmd.m,
                    rows[0].mmd.n, **figures,
                    rejected_layers=sum(t.reject for t in tested) if tested else None))
        return out

    def symmetry_settings(self) -> list[str]:
        """The symmetry settings computed (``"keep"``, ``"remove"``), in that order."""
        return [t for t in SYMMETRY_SETTINGS if any(r.symmetries == t for r in self.results)]

    def summary(self, method: str, symmetries: str | None = None) -> MethodSummary:
        """The summary of one method.

        ``symmetries``: ``"keep"`` or ``"remove"``; default: ``"keep"`` if it was computed,
        else ``"remove"`` (a comparison of canonical forms has only that). A method or
        setting the comparison does not hold is an error naming those it holds
        (:class:`~posteriorzoo.errors.UnknownNameError`,
        :class:`~posteriorzoo.errors.InvalidOptionError`).
        """
        if method not in self.methods:
            raise UnknownNameError(f"no method {method!r} in this comparison; its methods: "
                                   f"{', '.join(map(repr, self.methods))}")
        computed = self.symmetry_settings()
        if symmetries is None and computed:
            symmetries = computed[0]
        check_symmetry_setting(symmetries)
        for item in self.summaries():
            if item.method == method and item.symmetries == symmetries:
                return item
        raise InvalidOptionError(
            f"symmetries {symmetries!r} was not computed for {method!r}; this comparison "
            f"has {' and '.join(map(repr, computed)) or 'no results'}")

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-serialisable data."""
        layers = []
        for r in self.results:
            entry = {"method": r.method, "symmetries": r.symmetries, "layer": r.layer,
                     "keys": list(r.keys), "parameters": r.parameters, "m": r.mmd.m,
                     "n": r.mmd.n, "median": r.median, "mean": r.mean, "max": r.max,
                     "mmd2": r.mmd.values.tolist(),
                     "bandwidths": r.mmd.bandwidths.tolist()}
            if r.test is not None:
                entry["mmdagg"] = r.test.to_dict()
            layers.append(entry)
        return {"kernels": list(self.kernels),
                "statistic": "unbiased MMD^2 U-statistic (complete)",
                "options": self.options,
                "summary": [vars(s) for s in self.summaries()], "layers": layers}


def mmdagg_options(test: bool, alpha: float, B1: int, B2: int, B3: int, seed: int
                 ) -> dict[str, Any] | None:
    """The MMDAgg options (checked) when ``test`` is asked for, else None."""
    if not test:
        return None
    check_test_options(alpha, B1, B2, B3, seed)
    return {"alpha": alpha, "B1": B1, "B2": B2, "B3": B3, "seed": seed}


def describe_options(layers: Sequence[Layer], number_bandwidths: int, block_bytes: int,
                     test: Mapping[str, Any] | None, **extra: Any) -> dict[str, Any]:
    """The options a comparison records."""
    return {"layers": [layer.name for layer in layers], "number_bandwidths": number_bandwidths,
            "kernels": f"{number_bandwidths} laplace (L1) + {number_bandwidths} gaussian (L2)",
            "bandwidth_rule": "MMDAgg: cross distances of the first 500 rows of X and Y",
            "statistic": "complete unbiased MMD^2 U-statistic",
            "model_level": "mean over layers weighted by parameter count",
            "block_bytes": block_bytes, "mmdagg_test": dict(test) if test else None, **extra}


def score_layer(pooled: Sequence[Distances], names: Sequence[str], layer: Layer, *,
                symmetries: str, number_bandwidths: int,
                test: Mapping[str, Any] | None) -> Iterator[LayerResult]:
    """Each method's statistics on one layer, from its pooled distances with the target
    (``pooled[k]``: target and method ``names[k]``), one method at a time.

    The one scoring of :func:`compare_sources` and of the tiles
    (:func:`posteriorzoo.collection.compare_tiles`): the same distances give the same bits.
    """
    # The target's own pairs are summed for every method's bandwidths: one table of them
    # (PairSums) for the smallest bandwidth any method's cross distances choose.
    chosen = [bandwidths_from_distances(d, number_bandwidths) for d in pooled]
    target_pairs = KernelPairSums(*pooled[0].xx, *(min(c[family][0] for c in chosen)
                                                   for family in range(2)))
    for name, distances in zip(names, pooled, strict=True):
        mmd = kernel_mmds_from_distances(distances, number_bandwidths, x_pairs=target_pairs)
        outcome = (mmdagg_from_distances(distances, number_bandwidths=number_bandwidths,
                                         **test) if test else None)
        yield LayerResult(name, symmetries, layer.name, layer.keys, layer.size, mmd, outcome)


def compare_sources(target, methods: Sequence, layers: Sequence[Layer], *,
                    symmetries: str = "keep", number_bandwidths: int = 10,
                    block_bytes: int = DEFAULT_BLOCK_BYTES,
                    test: Mapping[str, Any] | None = None, bar=None,
                    cache: DistanceCache | bool = True, precision: str = DEFAULT_PRECISION,
                    device: str = "cpu") -> list[LayerResult]:
    """Compare every method source with the target source on every layer.

    Each layer is streamed once: block after block of its features is read from the
    target and from every method, and the target's self-distances are shared.

    Parameters
    ----------
    target, methods : sources
        Objects with ``name``, ``rows``, ``shapes`` and ``read(key, index)``
        (:class:`~posteriorzoo.mmd.sources.ArraySource`, or a collection's source).
    layers : sequence of Layer
    symmetries : {"keep", "remove"}
        Label stored in the results.
    number_bandwidths : int
    block_bytes : int
        Budget of one block over all sources (values counted at 8 bytes).
    test : mapping or None
        MMDAgg options (alpha, B1, B2, B3, seed) to also run the test per layer.
    bar : tqdm progress bar or None
        Advanced by one per method and layer.
    cache : DistanceCache or bool
        Where the target's self-distances are kept when its rows carry content hashes
        (``target.row_digests``): True, the environment's (:mod:`posteriorzoo.mmd.cache`).
    precision : {"fast", "exact"}
        How the distances are computed
        (:class:`~posteriorzoo.mmd.distances.SharedTargetDistances`).
    device : str
        ``"cpu"``, or a torch device (``"cuda"``, ``"cuda:N"``) for the fast path.
    """
    features = features_per_block(target.rows + sum(m.rows for m in methods), block_bytes)
    results = []
    for layer in layers:
        streams = [layer_blocks(source, layer, features) for source in (target, *methods)]
        pooled = layer_distances(target, methods, layer, zip(*streams, strict=True),
                                 cache=cache, precision=precision, device=device)
        scored = score_layer(pooled, [m.name for m in methods], layer, symmetries=symmetries,
                             number_bandwidths=number_bandwidths, test=test)
        for method, result in zip(methods, scored, strict=True):
            results.append(result)
            if bar is not None:
                bar.set_postfix_str(f"{symmetries} {layer.name} {method.name}", refresh=False)
                bar.update(1)
            fault_point("mmd-layer")
    return results


@public
def compare_arrays(target: Mapping[str, np.ndarray],
                   methods: Mapping[str, Mapping[str, np.ndarray]], *,
                   layers: Sequence[str] | None = None, number_bandwidths: int = 10,
                   symmetries: str = "keep", test: bool = False, alpha: float = 0.05,
                   B1: int = 2000, B2: int = 2000, B3: int = 50,
                   seed: int = 0, block_bytes: int = DEFAULT_BLOCK_BYTES,
                   progress: bool = False, precision: str = DEFAULT_PRECISION,
                   device: str = "cpu") -> Comparison:
    """Compare samples held in memory, layer by layer.

    Parameters
    ----------
    target : mapping of str to array of shape (m, *shape)
        The target posterior's samples, one array per layer (e.g. ``{"fc.weight": W}``
        with W of shape (1000, 10, 10)); m >= 2. numpy arrays (or array-likes).
    methods : mapping of str to mapping of str to array of shape (n_k, *shape)
        Each method's samples with the same layer keys and shapes; n_k >= 2.
    layers : sequence of str, optional
        Layer names or fnmatch patterns (default: every key of ``target``).
    number_bandwidths : int
        Bandwidths per kernel family (10: MMDAgg's 20 kernels).
    symmetries : {"keep", "remove"}
        Label of the results (say "remove" if you canonicalized the samples yourself,
        e.g. with :func:`posteriorzoo.symmetry.canonicalize`).
    test : bool
        Also run the MMDAgg test on every layer (with alpha, B1, B2, B3, seed).
    block_bytes : int
        Budget of one block of features over all samples.
    progress : bool
        Show a progress bar.
    precision : {"exact", "fast"}
        How the distances are computed: ``"exact"`` (default) or ``"fast"`` (float32
        GEMM and SIMD kernels, about half the time, within the bound of
        :mod:`posteriorzoo.mmd.distances_fast`).
    device : str
        ``"cpu"`` (default), or a torch device (``"cuda"``, ``"cuda:N"``; fast only).

    Returns
    -------
    Comparison
    """
    from posteriorzoo.progress import progress as progress_bar

    check_number_bandwidths(number_bandwidths)
    check_symmetry_setting(symmetries)
    check_precision(precision, device)
    if not methods:
        raise InvalidOptionError("no method samples to compare with the target")
    target_source = ArraySource("target", target)
    method_sources = [ArraySource(name, arrays) for name, arrays in methods.items()]
    chosen = select_layers(group_layers(list(target), target_source.shapes), layers)
    check_sources(target_source, method_sources, chosen)
    options = mmdagg_options(test, alpha, B1, B2, B3, seed)
    with progress_bar(total=len(chosen) * len(method_sources), desc="mmd", unit="layer",
                      enabled=progress) as bar:
        results = compare_sources(target_source, method_sources, chosen,
                                  symmetries=symmetries, number_bandwidths=number_bandwidths,
                                  block_bytes=block_bytes, test=options, bar=bar,
                                  precision=precision, device=device)
    return Comparison(results, [s.name for s in method_sources],
                      kernel_names(number_bandwidths),
                      describe_options(chosen, number_bandwidths, block_bytes, options,
                                       symmetries=symmetries, precision=precision,
                                       device=device))
