"""Aggregated MMD between collections of checkpoints, layer by layer.

How far an approximate posterior is from the target posterior (paper section 4): every
layer of the target's checkpoints (X, m x d) is compared with the method's samples
(Y, n x d) by the unbiased MMD^2 under MMDAgg's 20 kernels (10 Laplace on L1 distances,
10 Gaussian on L2 distances, MMDAgg's bandwidth rule).

>>> from posteriorzoo.mmd import kernel_mmds, mmdagg
>>> result = kernel_mmds(X, Y)           # 20 MMD^2 values and bandwidths
>>> result.median, result.values, result.bandwidths
>>> test = mmdagg(X, Y, seed=0)          # the aggregated test: decision, p-values
>>> from posteriorzoo.mmd import compare_collections
>>> report = compare_collections("target.h5", ["swag.h5", "laplace.h5"])
>>> report.write("mmd-report")           # CSV, JSON and a Markdown table like Table 2

Modules: :mod:`~posteriorzoo.mmd.distances` (numba distance kernels, blocked over
features), :mod:`~posteriorzoo.mmd.kernels` (kernel sums and matrices),
:mod:`~posteriorzoo.mmd.statistics` (bandwidths, :func:`kernel_mmds`),
:mod:`~posteriorzoo.mmd.aggregated` (:func:`mmdagg`), :mod:`~posteriorzoo.mmd.sources`
(layers of zoos and arrays), :mod:`~posteriorzoo.mmd.report` (comparisons and writers).
"""

from posteriorzoo.mmd.aggregated import MMDAggResult, mmdagg, mmdagg_from_distances
from posteriorzoo.mmd.distances import (
    Distances,
    SharedTargetDistances,
    pooled_distances,
    stream_pooled_distances,
)
from posteriorzoo.mmd.report import (
    ComparisonReport,
    LayerResult,
    MethodSummary,
    compare_arrays,
    compare_collections,
)
from posteriorzoo.mmd.statistics import (
    KernelMMDs,
    bandwidth_collection,
    bandwidths_from_distances,
    kernel_mmds,
    kernel_mmds_from_distances,
    kernel_names,
)

__all__ = [
    "ComparisonReport",
    "Distances",
    "KernelMMDs",
    "LayerResult",
    "MMDAggResult",
    "MethodSummary",
    "SharedTargetDistances",
    "bandwidth_collection",
    "bandwidths_from_distances",
    "compare_arrays",
    "compare_collections",
    "kernel_mmds",
    "kernel_mmds_from_distances",
    "kernel_names",
    "mmdagg",
    "mmdagg_from_distances",
    "pooled_distances",
    "stream_pooled_distances",
]
