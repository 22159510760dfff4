"""Aggregated MMD between collections of checkpoints, layer by layer.

How far an approximate posterior is from the target posterior (paper section 4): every
layer of the target's checkpoints (X, m x d) is compared with the method's samples
(Y, n x d) by the unbiased MMD^2 under MMDAgg's 20 kernels (10 Laplace on L1 distances,
10 Gaussian on L2 distances, MMDAgg's bandwidth rule).

>>> from posteriorzoo.mmd import kernel_mmds, mmdagg
>>> result = kernel_mmds(X, Y)           # 20 MMD^2 values and bandwidths
>>> result.median, result.values, result.bandwidths
>>> test = mmdagg(X, Y, seed=0)          # the aggregated test: decision, p-values
>>> from posteriorzoo.mmd import compare_arrays
>>> comparison = compare_arrays({"w": X}, {"swag": {"w": Y}})   # layer by layer
>>> comparison.summary("swag").median

The pure core works on arrays only; :func:`posteriorzoo.collection.compare` compares
collection files and writes CSV, JSON and a Markdown table like Table 2.

Modules: :mod:`~posteriorzoo.mmd.distances` (distance matrices, blocked over features:
exact float64 kernels, and :func:`cross_distances` for one tile),
:mod:`~posteriorzoo.mmd.distances_fast` (the default fast path: float32 GEMM and SIMD
kernels with float64 accumulation, within a stated bound),
:mod:`~posteriorzoo.mmd.distances_torch` (the same path in torch, on any device),
:mod:`~posteriorzoo.mmd.kernels` (kernel sums and matrices),
:mod:`~posteriorzoo.mmd.pair_sums` (the kernel sums of one fixed set of pairs for any
bandwidth, from one pass: the target's pairs, shared by every method and noise split),
:mod:`~posteriorzoo.mmd.statistics` (bandwidths, :func:`kernel_mmds`),
:mod:`~posteriorzoo.mmd.aggregated` (:func:`mmdagg`), :mod:`~posteriorzoo.mmd.sources`
(layers of arrays, read in blocks), :mod:`~posteriorzoo.mmd.comparison` (layer-by-layer
comparisons and their summaries), :mod:`~posteriorzoo.mmd.noise` (the noise floor: the
target against disjoint draws of itself).
"""

from posteriorzoo.mmd.aggregated import MMDAggResult, mmdagg, mmdagg_from_distances
from posteriorzoo.mmd.comparison import (
    Comparison,
    LayerResult,
    MethodSummary,
    compare_arrays,
)
from posteriorzoo.mmd.distances import (
    Distances,
    SharedTargetDistances,
    cross_distances,
    pooled_distances,
    stream_pooled_distances,
)
from posteriorzoo.mmd.noise import (
    NoiseFloor,
    held_out_size,
    noise_floor,
    self_distances,
    small_target_warning,
)
from posteriorzoo.mmd.pair_sums import KernelPairSums, PairSums
from posteriorzoo.mmd.statistics import (
    KernelMMDs,
    bandwidth_collection,
    bandwidths_from_distances,
    kernel_mmds,
    kernel_mmds_from_distances,
    kernel_names,
)

__all__ = [
    "Comparison",
    "Distances",
    "KernelMMDs",
    "KernelPairSums",
    "LayerResult",
    "MMDAggResult",
    "MethodSummary",
    "NoiseFloor",
    "PairSums",
    "SharedTargetDistances",
    "bandwidth_collection",
    "bandwidths_from_distances",
    "compare_arrays",
    "cross_distances",
    "kernel_mmds",
    "kernel_mmds_from_distances",
    "kernel_names",
    "mmdagg",
    "mmdagg_from_distances",
    "noise_floor",
    "self_distances",
    "held_out_size",
    "small_target_warning",
    "pooled_distances",
    "stream_pooled_distances",
]
