"""Benchmark the aggregated-MMD engine (``posteriorzoo.mmd``) against plain baselines.

Three measurements, side by side in one run:

1. **One layer, in memory.** ``kernel_mmds`` on X = 1000 x 250 and Y = 100 x 250: the
   ``conv2.weight`` of the bundled OptuNet target (1000 checkpoints) and deep ensemble (100),
   against the reference formulation done the straightforward way: ``scipy.spatial.distance
   .cdist`` (and, second baseline, ``torch.cdist`` in float64) for the pooled L1 and L2
   distance matrices, then the 20 kernel matrices and U-statistics in numpy, with the same
   bandwidth rule. Same values are checked (largest relative difference). Also timed:
   the full MMDAgg test (``mmdagg``, B1 = B2 = 2000, B3 = 50: 4,001 resampled statistics per
   kernel).
2. **The whole OptuNet table.** ``posteriorzoo.collection.compare`` of the bundled target
   (1000) with
   10 method collections of 100 checkpoints each, every layer, MMD and NS-MMD (symmetries
   removed by the canonicalizer, timed separately). The 10 collections are derived from the
   bundled data (see ``build_methods``): the deep ensemble itself, its members moved by a
   random symmetry each, the ensemble plus Gaussian noise, samples around one member or
   around ten members (stand-ins for single- and multi-mode methods), the target's first
   100 checkpoints, and the ensemble scaled by 1.5.
3. **One full-size ResNet-18 layer, streamed from disk.** A synthetic float32 collection of
   1000 checkpoints of ``layer4.1.conv2.weight`` (512 x 512 x 3 x 3 = 2,359,296 values) and
   one of 100, stored like any zoo (one chunk per checkpoint; 10.4 GB in all), written
   to ``--workdir``, evicted from the page cache (``posix_fadvise(DONTNEED)`` on these files
   only), then compared in a child process that reports its wall time and peak resident
   memory (``VmHWM``). The child streams the layer from disk in blocks of features; the
   SHA-256 that ``posteriorzoo mmd`` also computes of its inputs is timed separately.

Timing: each measured call runs once untimed first (numba compilation and loading happen
there, and are reported), then the median (and the fastest) of ``--repeats`` runs;
Python's garbage collector is off while timing. Numbers on the shared 2-core machines
vary (other jobs may hold a core); the ratios are the steadier figures.

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_mmd.py                       # the full run
    .venv/bin/python benchmarks/bench_mmd.py --quick               # a smoke run
    .venv/bin/python benchmarks/bench_mmd.py --json benchmarks/output/mmd.json

Files go to a temporary directory (under ``--workdir`` if given) deleted at the end; a
full run needs about 11 GB free there (if less is free, item 3 uses fewer output channels
of the layer, and says so).
"""

# ruff: noqa: N803, N806 -- the statistics' names: samples X, Y, Z, kernel matrices K

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SEEDS = {"methods": 2024, "resnet_target": 11, "resnet_method": 12, "kernels": 13}
LAYER_SHAPE = (512, 512, 3, 3)
GB = 1e9


# ------------------------------------------------------------------------ helpers
def timed(function: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """(first-call seconds, median seconds of ``repeats`` further calls, last result).

    The fastest of the repeats is kept in ``timed.fastest`` (seconds)."""
    start = time.perf_counter()
    result = function()
    first = time.perf_counter() - start
    times = []
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            result = function()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    timed.fastest = min(times)
    return first, statistics.median(times), result


def straightforward(X: np.ndarray, Y: np.ndarray, backend: str) -> np.ndarray:
    """The 20 MMD^2 values the plain way: full cdist matrices, 20 kernel matrices."""
    from posteriorzoo.mmd import bandwidth_collection

    m, n = len(X), len(Y)
    Z = np.vstack([X, Y]).astype(np.float64)
    if backend == "scipy":
        from scipy.spatial.distance import cdist

        l1, l2 = cdist(Z, Z, "cityblock"), cdist(Z, Z, "euclidean")
    else:
        import torch

        tensor = torch.from_numpy(Z)
        l1 = torch.cdist(tensor, tensor, p=1).numpy()
        l2 = torch.cdist(tensor, tensor, p=2).numpy()
    bw_l1 = bandwidth_collection(l1[:min(m, 500), m:m + min(n, 500)])
    bw_l2 = bandwidth_collection(l2[:min(m, 500), m:m + min(n, 500)])

    def u_statistic(K: np.ndarray) -> float:
        np.fill_diagonal(K, 0.0)
        return (K[:m, :m].sum() / (m * (m - 1)) + K[m:, m:].sum() / (n * (n - 1))
                - 2 * K[:m, m:].sum() / (m * n))

    return np.array([u_statistic(np.exp(-l1 / b)) for b in bw_l1]
                    + [u_statistic(np.exp(-(l2 / b) ** 2)) for b in bw_l2])


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))


# ------------------------------------------------------------------------ item 1
def bench_layer(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from posteriorzoo.mmd import kernel_mmds, mmdagg
    from posteriorzoo.reference import open_reference

    with open_reference("target") as target, open_reference("de") as de:
        X = target.layer("conv2.weight").reshape(len(target), -1)
        Y = de.layer("conv2.weight").reshape(len(de), -1)
    if args.quick:   # a smoke run: the test's resamples on the full sizes take seconds
        X, Y = X[:200], Y[:50]
    torch.set_num_threads(os.cpu_count() or 1)
    first, ours, result = timed(lambda: kernel_mmds(X, Y), args.repeats)
    rows = {"posteriorzoo kernel_mmds": {"seconds": ours, "fastest_seconds": timed.fastest,
                                         "first_call_seconds": first, "max_rel_diff": 0.0}}
    for label, backend in (("scipy cdist + numpy kernels", "scipy"),
                           ("torch cdist + numpy kernels", "torch")):
        _, seconds, values = timed(lambda b=backend: straightforward(X, Y, b), args.repeats)
        rows[label] = {"seconds": seconds, "fastest_seconds": timed.fastest,
                       "max_rel_diff": relative_difference(values, result.values)}
    first, seconds, test = timed(lambda: mmdagg(X, Y, seed=0), 1 if args.quick else 3)
    rows["posteriorzoo mmdagg (B1=B2=2000, B3=50)"] = {
        "seconds": seconds, "fastest_seconds": timed.fastest, "first_call_seconds": first,
        "max_rel_diff": relative_difference(test.statistics, result.values),
        "reject": bool(test.reject)}
    return {"shape_x": list(X.shape), "shape_y": list(Y.shape), "dtype": str(X.dtype),
            "median_mmd2": result.median, "rows": rows}


def print_layer(result: dict[str, Any]) -> None:
    m, d = result["shape_x"]
    n = result["shape_y"][0]
    print(f"\n1. One layer in memory: X = {m} x {d}, Y = {n} x {d} ({result['dtype']}; "
          "OptuNet conv2.weight, bundled target vs DE)")
    base = result["rows"]["posteriorzoo kernel_mmds"]["seconds"]
    fastest = result["rows"]["posteriorzoo kernel_mmds"]["fastest_seconds"]
    print(f"   {'':42s}{'median (s)':>11s}{'x ours':>8s}{'fastest (s)':>12s}{'x ours':>8s}"
          f"{'max rel diff':>14s}")
    for label, row in result["rows"].items():
        print(f"   {label:42s}{row['seconds']:11.4f}{row['seconds'] / base:8.1f}"
              f"{row['fastest_seconds']:12.4f}{row['fastest_seconds'] / fastest:8.1f}"
              f"{row['max_rel_diff']:14.1e}")
    ours = result["rows"]["posteriorzoo kernel_mmds"]
    print(f"   (first call of kernel_mmds, numba cache load included: "
          f"{ours['first_call_seconds']:.2f} s; median MMD^2 {result['median_mmd2']:.3g})")


# ------------------------------------------------------------------------ item 2
def build_methods(folder: Path, count: int) -> dict[str, dict[str, Any]]:
    """Method collections of 100 checkpoints derived from the bundled data."""
    import torch

    from posteriorzoo.reference import open_reference
    from posteriorzoo.symmetry import random_symmetry
    from posteriorzoo.zoo import create_zoo

    rng = np.random.default_rng(SEEDS["methods"])
    with open_reference("de") as de, open_reference("target") as target:
        members = [de.arrays(i) for i in range(len(de))]
        first_target = [target.arrays(i) for i in range(100)]
        template = de.tensor_layout

    def noisy(state: dict[str, np.ndarray], sigma: float) -> dict[str, np.ndarray]:
        return {k: (v + sigma * rng.standard_normal(v.shape)).astype(v.dtype)
                for k, v in state.items()}

    recipes: dict[str, tuple[str, Callable[[], list[dict[str, np.ndarray]]]]] = {
        "de": ("the 100 bundled deep-ensemble members (independent of the target)",
               lambda: members),
        "de-symmetric": ("the same members, each moved by a random symmetry (permutation, "
                         "scaling, softmax shift): same functions",
                         lambda: [{k: v.numpy() for k, v in random_symmetry(
                             "optunet", {k: torch.from_numpy(v) for k, v in s.items()},
                             seed=i).items()} for i, s in enumerate(members)]),
        "de-noise-0.02": ("members + N(0, 0.02^2) on every weight",
                          lambda: [noisy(s, 0.02) for s in members]),
        "de-noise-0.1": ("members + N(0, 0.1^2) on every weight",
                         lambda: [noisy(s, 0.1) for s in members]),
        "one-mode-0.02": ("100 samples N(w, 0.02^2) around member 0 (a single mode)",
                          lambda: [noisy(members[0], 0.02) for _ in range(100)]),
        "one-mode-0.1": ("100 samples N(w, 0.1^2) around member 0",
                         lambda: [noisy(members[0], 0.1) for _ in range(100)]),
        "ten-modes-0.02": ("10 samples N(w_k, 0.02^2) around each of members 0-9",
                           lambda: [noisy(members[k], 0.02) for k in range(10)
                                    for _ in range(10)]),
        "ten-modes-0.1": ("10 samples N(w_k, 0.1^2) around each of members 0-9",
                          lambda: [noisy(members[k], 0.1) for k in range(10)
                                   for _ in range(10)]),
        "target-first-100": ("the target's own first 100 checkpoints (a subset of X)",
                             lambda: first_target),
        "de-scaled-1.5": ("members with every weight multiplied by 1.5",
                          lambda: [{k: v * np.float32(1.5) for k, v in s.items()}
                                   for s in members]),
    }
    methods = {}
    for name, (description, make) in list(recipes.items())[:count]:
        path = folder / f"{name}.h5"
        states = make()
        with create_zoo(path, architecture="optunet", dataset="fashion-mnist", method=name,
                        num_classes=10, template=template) as zoo:
            zoo.append_many(states, [{"seed": i} for i in range(len(states))])
        methods[name] = {"path": path, "description": description}
    return methods


def bench_table(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from posteriorzoo.collection import compare
    from posteriorzoo.reference import reference_path

    methods = build_methods(folder, 3 if args.quick else 10)
    paths = {name: item["path"] for name, item in methods.items()}
    # untimed warm-up: numba cache loading and the canonicalizer's first trace
    compare(reference_path("target"), dict(list(paths.items())[:1]), symmetries="both")
    start = time.perf_counter()
    compare(reference_path("target"), paths, symmetries="keep")
    kept_seconds = time.perf_counter() - start
    start = time.perf_counter()
    both = compare(reference_path("target"), paths, symmetries="both", workdir=folder)
    both_seconds = time.perf_counter() - start
    start = time.perf_counter()
    written = both.write(folder / "report")
    write_seconds = time.perf_counter() - start
    rows = {}
    for name in paths:
        mmd, ns = both.summary(name, "keep"), both.summary(name, "remove")
        rows[name] = {"description": methods[name]["description"],
                      "mmd": [mmd.median, mmd.mean, mmd.max],
                      "ns_mmd": [ns.median, ns.mean, ns.max]}
    return {"methods": len(paths), "layers": len({r.layer for r in both.results}),
            "seconds_mmd_only": kept_seconds, "seconds_mmd_and_ns_mmd": both_seconds,
            "seconds_canonicalization": both.provenance["canonicalizer"]["seconds"],
            "seconds_statistics": both.provenance["seconds"]["statistics"],
            "seconds_write_report": write_seconds,
            "report_files": [str(p.name) for p in written.values()], "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    print(f"\n2. The whole OptuNet table: {result['layers']} layers, {result['methods']} "
          "method collections of 100 against the bundled target of 1000")
    print(f"   MMD only:                          {result['seconds_mmd_only']:7.2f} s")
    print(f"   MMD and NS-MMD:                    {result['seconds_mmd_and_ns_mmd']:7.2f} s  "
          f"(canonicalizing 1000 + {result['methods']} x 100 checkpoints: "
          f"{result['seconds_canonicalization']:.2f} s; statistics "
          f"{result['seconds_statistics']:.2f} s; the rest: SHA-256 of inputs, opening)")
    print(f"   writing CSV, JSON, Markdown:       {result['seconds_write_report']:7.2f} s")
    print(f"   {'method':18s}{'MMD med':>10s}{'mean':>10s}{'max':>10s}"
          f"{'NS med':>10s}{'mean':>10s}{'max':>10s}   (raw MMD^2 x 100)")
    for name, row in result["rows"].items():
        values = "".join(f"{100 * v:10.3f}" for v in row["mmd"] + row["ns_mmd"])
        print(f"   {name:18s}{values}   {row['description']}")


# ------------------------------------------------------------------------ item 3
_CHILD = r"""
import json, sys, time
start = time.perf_counter()
from posteriorzoo.collection.comparison import ZooSource
from posteriorzoo.mmd.comparison import compare_sources
from posteriorzoo.mmd.sources import Layer, features_per_block
from posteriorzoo.zoo import open_zoo
imported = time.perf_counter()
target_path, method_path, key, block_bytes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open_zoo(target_path) as target, open_zoo(method_path) as method:
    size = 1
    for s in target.shapes[key]:
        size *= s
    layer = Layer(key, (key,), size)
    sources = [ZooSource("target", target), ZooSource("method", method)]
    rows = len(target) + len(method)
    begin = time.perf_counter()
    results = compare_sources(sources[0], sources[1:], [layer], block_bytes=block_bytes)
    end = time.perf_counter()
status = open("/proc/self/status").read()
peak = int(next(l for l in status.splitlines() if l.startswith("VmHWM")).split()[1]) * 1024
print(json.dumps({"import_seconds": imported - start, "compare_seconds": end - begin,
                  "features_per_block": features_per_block(rows, block_bytes),
                  "peak_rss_bytes": peak, "values": results[0].mmd.values.tolist(),
                  "median": results[0].median}))
"""


def write_layer_zoo(path: Path, rows: int, shape: tuple[int, ...], seed: int, shift: float
                    ) -> float:
    """A synthetic collection of one float32 layer; returns the seconds spent."""
    from posteriorzoo.zoo import create_zoo

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    key = "layer4.1.conv2.weight"
    with create_zoo(path, architecture="resnet18-layer4.1.conv2", dataset="synthetic",
                    method=path.stem, template={key: (shape, np.float32)},
                    validate=False) as zoo:
        batch = 8
        for first in range(0, rows, batch):
            states = []
            for _ in range(min(batch, rows - first)):
                values = rng.standard_normal(shape, dtype=np.float32)
                values *= np.float32(0.02)
                values += np.float32(shift)
                states.append({key: values})
            zoo.append_many(states, [{"seed": first + i} for i in range(len(states))])
    return time.perf_counter() - start


def evict(path: Path) -> None:
    """Drop this file's pages from the page cache (flushes it first)."""
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def bench_resnet(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from posteriorzoo.hashing import sha256_file

    channels = args.resnet_channels if not args.quick else 1
    per_row = channels * int(np.prod(LAYER_SHAPE[1:])) * 4
    free = shutil.disk_usage(folder).free
    note = None
    if 1100 * per_row * 1.05 + 2 * GB > free:
        fitting = int((free - 2 * GB) / (1.05 * 1100 * np.prod(LAYER_SHAPE[1:]) * 4))
        note = (f"only {free / GB:.1f} GB free in {folder}: {fitting} instead of {channels} "
                "output channels")
        channels = max(1, fitting)
    shape = (channels, *LAYER_SHAPE[1:])
    target, method = folder / "resnet-target.h5", folder / "resnet-method.h5"
    write_seconds = write_layer_zoo(target, 1000, shape, SEEDS["resnet_target"], 0.0)
    write_seconds += write_layer_zoo(method, 100, shape, SEEDS["resnet_method"], 0.002)
    file_bytes = target.stat().st_size + method.stat().st_size
    for path in (target, method):
        evict(path)
    block_bytes = int(args.block_mb * (1 << 20))
    start = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", _CHILD, str(target), str(method),
                            "layer4.1.conv2.weight", str(block_bytes)],
                           capture_output=True, text=True, check=False)
    child_wall = time.perf_counter() - start
    if child.returncode != 0:
        raise RuntimeError(f"the streaming child failed:\n{child.stderr}")
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    for path in (target, method):
        evict(path)
    start = time.perf_counter()
    for path in (target, method):
        sha256_file(path)
    hash_seconds = time.perf_counter() - start
    values = np.array(measured.pop("values"))
    for path in (target, method):
        path.unlink()
    return {"rows": [1000, 100], "shape": list(shape), "features": int(np.prod(shape)),
            "dtype": "float32", "file_bytes": file_bytes, "write_seconds": write_seconds,
            "child_wall_seconds": child_wall, **measured, "block_bytes": block_bytes,
            "sha256_seconds": hash_seconds, "all_values_finite": bool(np.isfinite(values).all()),
            "note": note}


def print_resnet(result: dict[str, Any]) -> None:
    shape = "x".join(str(s) for s in result["shape"])
    print(f"\n3. One ResNet-18 layer streamed from disk: 1000 + 100 rows of d = "
          f"{result['features']:,} ({shape}, float32, {result['file_bytes'] / GB:.1f} GB "
          "on disk, evicted from the page cache before reading)")
    if result["note"]:
        print(f"   NOTE: {result['note']}")
    print(f"   writing the two synthetic collections (untimed part): "
          f"{result['write_seconds']:.0f} s")
    print(f"   stream + distances + 20 MMD^2:     {result['compare_seconds']:8.1f} s "
          f"({result['compare_seconds'] / 60:.1f} min; child process "
          f"{result['child_wall_seconds']:.1f} s with imports)")
    print(f"   peak resident memory of the child: {result['peak_rss_bytes'] / GB:8.2f} GB "
          f"(blocks of {result['features_per_block']:,} features, "
          f"--block-mb {result['block_bytes'] / (1 << 20):g})")
    print(f"   SHA-256 of both inputs (done by `posteriorzoo mmd` for provenance): "
          f"{result['sha256_seconds']:.1f} s")
    print(f"   median MMD^2 {result['median']:.3g}; all 20 values finite: "
          f"{result['all_values_finite']}")


# ------------------------------------------------------------------------ item 4
def bare_l1_kernel():
    """A bare float32 L1 reduction over all pairs i < j of the columns of ``t`` (features,
    rows) into float32 sums: the arithmetic of the fast kernel (subtract, absolute value,
    add; vectorised across pairs, four features per pass, 256 features at a time so that
    they stay in cache) without its centring, two-row sharing or float64 sums."""
    import numba
    from numba import prange, uint64

    @numba.njit(parallel=True, nogil=True)
    def bare_l1(t, out):  # pragma: no cover - compiled
        features, rows = t.shape
        tasks = numba.get_num_threads()
        for task in prange(tasks):
            for start in range(0, features - features % 4, 256):
                stop = min(start + 256, features - features % 4)
                for i in range(task, rows - 1, tasks):
                    acc = out[i, i + 1:]
                    for c in range(start, stop, 4):
                        c0 = t[c, i + 1:]
                        c1 = t[c + 1, i + 1:]
                        c2 = t[c + 2, i + 1:]
                        c3 = t[c + 3, i + 1:]
                        x0, x1, x2, x3 = t[c, i], t[c + 1, i], t[c + 2, i], t[c + 3, i]
                        for k in range(uint64(rows - i - 1)):
                            acc[k] += (abs(x0 - c0[k]) + abs(x1 - c1[k]) + abs(x2 - c2[k])
                                       + abs(x3 - c3[k]))

    return bare_l1


def bench_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """The distance kernels at a ResNet-like shape, beside the arithmetic limit.

    X (target) and Y (method) rows of ``features`` float32 weights, fed in the blocks a
    comparison streams (``features_per_block``). Timed in interleaved rounds (the fastest
    of each is kept, then the median): a bare float32 GEMM ``Z @ Z.T`` of the pooled rows
    Z = [X; Y]; the bare L1 reduction over the same pairs (:func:`bare_l1_kernel`); the
    exact path and the fast path (X-X, X-Y, Y-Y in one pass, then ``pooled``)."""
    import numba
    from threadpoolctl import threadpool_limits

    from posteriorzoo.mmd.distances import SharedTargetDistances
    from posteriorzoo.mmd.sources import DEFAULT_BLOCK_BYTES, features_per_block

    m, n, d = ((200, 20, 4096) if args.quick else
               (args.kernel_rows[0], args.kernel_rows[1], args.kernel_features))
    rows = m + n
    rng = np.random.default_rng(SEEDS["kernels"])
    Z = rng.standard_normal((rows, d), dtype=np.float32)
    Z += np.float32(0.5)
    width = features_per_block(rows, DEFAULT_BLOCK_BYTES)
    blocks = [(np.ascontiguousarray(Z[:m, s:s + width]), np.ascontiguousarray(Z[m:, s:s + width]))
              for s in range(0, d, width)]
    t = np.ascontiguousarray(Z.T)
    bare_l1 = bare_l1_kernel()
    l1_out = np.zeros((rows, rows), dtype=np.float32)

    def distances(precision: str):
        shared = SharedTargetDistances(m, [n], precision=precision)
        for x_block, y_block in blocks:
            shared.update(x_block, [y_block], check_finite=False)
        return shared.pooled(0)

    runs = {"gemm": lambda: Z @ Z.T, "l1_bare": lambda: bare_l1(t, l1_out),
            "exact": lambda: distances("exact"), "fast": lambda: distances("fast")}
    threads = args.threads or numba.get_num_threads()
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    times: dict[str, list[float]] = {name: [] for name in runs}
    try:
        with threadpool_limits(threads):
            for run in runs.values():   # compilation, first touches
                run()
            gc.disable()
            for _ in range(1 if args.quick else args.kernel_repeats):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
        numba.set_num_threads(before)
    pair_weights = rows * (rows - 1) / 2 * d      # what the distances need
    products = rows * rows * d                    # what the GEMM computes
    gemm = min(times["gemm"])
    out = {"m": m, "n": n, "features": d, "block_features": width, "threads": threads,
           "gemm_ns_per_product": gemm / products * 1e9, "rows": {}}
    for name, values in times.items():
        fastest = min(values)
        out["rows"][name] = {"fastest_seconds": fastest,
                             "median_seconds": statistics.median(values),
                             "ns_per_pair_weight": fastest / pair_weights * 1e9,
                             "x_gemm_time": fastest / gemm,
                             "x_gemm_per_pair_weight": (fastest / pair_weights)
                             / (gemm / products)}
    return out


def print_kernels(result: dict[str, Any]) -> None:
    m, n, d = result["m"], result["n"], result["features"]
    print(f"\n4. Distance kernels: X = {m}, Y = {n} rows of {d:,} float32 features, blocks "
          f"of {result['block_features']:,}, {result['threads']} thread(s); fastest of the "
          "interleaved rounds")
    print(f"   GEMM: {result['gemm_ns_per_product']:.4f} ns per product ((m + n)^2 d of "
          "them); the rest per pair-weight ((m + n)(m + n - 1) d / 2)")
    print(f"   {'':22s}{'seconds':>9s}{'median':>9s}{'ns/pair-w':>11s}{'x GEMM time':>13s}"
          f"{'x GEMM per pw':>15s}")
    labels = {"gemm": "bare float32 GEMM", "l1_bare": "bare L1 (numba f32)",
              "exact": "exact path (float64)", "fast": "fast path (L1 + L2)"}
    for name, row in result["rows"].items():
        print(f"   {labels[name]:22s}{row['fastest_seconds']:9.3f}{row['median_seconds']:9.3f}"
              f"{row['ns_per_pair_weight']:11.4f}{row['x_gemm_time']:13.2f}"
              f"{row['x_gemm_per_pair_weight']:15.2f}")


# ------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: X = 200 x 250 and Y = 50 x 250 in item 1, fewer "
                             "repeats, 3 methods, a 1-channel layer in item 3")
    parser.add_argument("--repeats", type=int, default=11, help="timed repeats in item 1")
    parser.add_argument("--resnet-channels", type=int, default=512,
                        help="output channels of the streamed layer (512: full size)")
    parser.add_argument("--block-mb", type=float, default=128.0,
                        help="block budget of the streaming in item 3 (MiB)")
    parser.add_argument("--skip-resnet", action="store_true", help="leave out item 3")
    parser.add_argument("--kernel-rows", type=int, nargs=2, default=[1000, 100],
                        metavar=("M", "N"), help="rows of X and Y in item 4")
    parser.add_argument("--kernel-features", type=int, default=262144,
                        help="features per row in item 4 (quick: 4096, 200 + 20 rows)")
    parser.add_argument("--kernel-repeats", type=int, default=3,
                        help="interleaved rounds in item 4")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads of numba and BLAS in item 4 (0: all)")
    parser.add_argument("--only-kernels", action="store_true",
                        help="run item 4 only")
    parser.add_argument("--workdir", type=Path, help="where the temporary files go")
    parser.add_argument("--json", type=Path, help="also write every number here")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 3)
    return args


def main(argv: list[str] | None = None) -> int:
    import numba

    from posteriorzoo.provenance import library_versions

    args = parse_args(argv)
    started = time.perf_counter()
    versions = {**library_versions(), "numba": numba.__version__}
    command = shlex.join([sys.executable, *sys.argv])
    print("posteriorzoo MMD benchmark: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"command: {command}")
    print(f"cpus: {os.cpu_count()}, numba threads: {numba.get_num_threads()}; times are "
          "medians after one untimed call; 'x ours' = time / time of posteriorzoo")
    results: dict[str, Any] = {}
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-mmd-", dir=args.workdir) as workdir:
        if not args.only_kernels:
            results["layer"] = bench_layer(args)
            print_layer(results["layer"])
            results["table"] = bench_table(args, Path(workdir))
            print_table(results["table"])
            if not args.skip_resnet:
                results["resnet"] = bench_resnet(args, Path(workdir))
                print_resnet(results["resnet"])
        results["kernels"] = bench_kernels(args)
        print_kernels(results["kernels"])
    wall = time.perf_counter() - started
    print(f"\nwall time of the benchmark: {wall:.0f} s")
    if args.json is not None:
        document = {"benchmark": "bench_mmd", "command": command,
                    "arguments": {k: str(v) if isinstance(v, Path) else v
                                  for k, v in vars(args).items()},
                    "versions": versions,
                    "platform": {"machine": platform.machine(), "system": platform.platform(),
                                 "cpu_count": os.cpu_count(),
                                 "numba_threads": numba.get_num_threads()},
                    "seeds": {**SEEDS, "mmdagg": 0,
                              "note": "numpy.random.default_rng(seed) for the derived method "
                                      "collections and the synthetic layer"},
                    "wall_seconds": wall, "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2, default=str) + "\n")
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
