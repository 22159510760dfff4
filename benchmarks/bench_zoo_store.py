"""Benchmark the HDF5 checkpoint store (``posteriorzoo.zoo.store``) against flat files.

What it measures, for two architectures, side by side in one run:

* **OptuNet** (392 parameters; default 1000 checkpoints, distinct random inits via
  ``torch.manual_seed(i)``) and
* **ResNet-18, 100 classes** (11,220,132 parameters, ~45 MB per checkpoint; default 20
  checkpoints, ~900 MB per file).

Write throughput (checkpoints/s and MB/s of tensor payload, MB = 10**6 bytes):

* ``zoo.append`` once per checkpoint -- one crash-safe commit per checkpoint, as a
  trainer does (time includes ``create_zoo`` and ``close``);
* ``zoo.append_many`` in batches (100 OptuNets, 10 ResNets per call);
* baseline ``np.save``: the same tensors stacked per layer, one ``.npy`` per layer
  (no crash safety, no metadata, no digests; the stacking is timed too);
* reference ``torch.save``: one ``.pt`` per checkpoint (no metadata either).

Neither the zoo nor the baselines call ``fsync``: all writes end in the OS page cache,
so write numbers compare the work done by each format, not the disk. An untimed
``os.sync()`` before each write lets it start without the previous one's dirty pages.
The zoo's write time includes what only it does: validation (keys, shapes, dtypes,
finite values), a SHA-256 digest per checkpoint, a metadata row, and two flushes per
commit.

Read times (median of ``--repeats``):

* one layer across all checkpoints, ``zoo.layer(key)`` on an open zoo, vs ``np.load`` of
  the same bytes from the flat ``.npy`` (for OptuNet ``conv2.weight`` and the largest
  layer; for ResNet-18 ``layer4.1.conv2.weight`` (512x512x3x3) and ``bn1.weight``);
* checkpoint i as a state_dict, ``zoo.state_dict(i)``, mean (and median) over random i,
  vs rows of memory-mapped per-layer ``.npy`` files and vs ``torch.load`` of one ``.pt``;
  ``zoo.arrays(i)`` (the same read, as numpy arrays) shows what the conversion costs;
* ``open_zoo`` itself (a fixed cost per file, not included in the layer reads).

Reads are **warm-cache**: dropping the OS page cache needs root, which is not assumed.
For fairness every file (zoo and baselines) is read once in full, untimed, right before
its timed reads, so all of them are timed from the page cache in the same way (and one
untimed read through each reader warms its code path and checks that it returns the
values of the in-memory checkpoints). Python's garbage collector is off while timing.
Absolute times on shared machines are noisy; the ``x npy`` columns (time / baseline time,
>1 means slower than the baseline) are the numbers to compare across machines.

Run (from the repository root)::

    make bench                                      # the full run, well under a minute
    .venv/bin/python benchmarks/bench_zoo_store.py --quick          # a smoke run
    .venv/bin/python benchmarks/bench_zoo_store.py --json out.json --workdir /scratch

All files go to a temporary directory (under ``--workdir`` if given, else the system's
temporary directory) that is deleted at the end; a full run needs about 3 GB free there
and about 2.3 GB of memory (the checkpoints are built in memory first, outside the timing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posteriorzoo.models import build
from posteriorzoo.provenance import library_versions
from posteriorzoo.zoo import create_zoo, open_zoo

MB = 1e6
STATE_READ_SEED = 12345  # numpy seed of the random checkpoint indices read as state_dicts
RESNET_SEED_OFFSET = 0  # ResNet checkpoint i is initialised under torch.manual_seed(i + this)


# ---------------------------------------------------------------------------- helpers
def make_checkpoints(architecture: str, count: int, seed_offset: int,
                     **build_options: Any) -> list[dict[str, torch.Tensor]]:
    """``count`` state_dicts; checkpoint i is a random init under ``manual_seed(i + offset)``."""
    checkpoints = []
    for index in range(count):
        torch.manual_seed(index + seed_offset)
        model = build(architecture, **build_options)
        checkpoints.append({key: value.detach().clone()
                            for key, value in model.state_dict().items()})
    return checkpoints


def payload_bytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(value.numel() * value.element_size() for value in state.values())


def file_name(key: str) -> str:
    return key.replace("/", "_") + ".npy"


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def warm(path: Path) -> None:
    """Read a file (or every file under a directory) once, so it sits in the page cache."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for item in files:
        with open(item, "rb", buffering=0) as handle:
            while handle.read(1 << 24):
                pass


def median_time(function: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
    """Median wall time of ``repeats`` calls, and all of them (seconds)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


# ---------------------------------------------------------------------------- writing
def write_zoo(path: Path, checkpoints: list[dict[str, torch.Tensor]], family: Mapping[str, Any],
              batch: int | None) -> dict[str, Any]:
    """Write a zoo with one ``append`` per checkpoint (batch None) or ``append_many``."""
    per_call = []
    start = time.perf_counter()
    zoo = create_zoo(path, architecture=family["architecture"], dataset="benchmark",
                     method="random-init", num_classes=family["num_classes"],
                     model_options=family["model_options"], template=checkpoints[0],
                     command="benchmarks/bench_zoo_store.py")
    created = time.perf_counter()
    try:
        step = 1 if batch is None else batch
        for first in range(0, len(checkpoints), step):
            group = checkpoints[first:first + step]
            metadata = [{"seed": first + offset + family["seed_offset"],
                         "source": "benchmark"} for offset in range(len(group))]
            call = time.perf_counter()
            if batch is None:
                zoo.append(group[0], **metadata[0])
            else:
                zoo.append_many(group, metadata)
            per_call.append(time.perf_counter() - call)
    finally:
        zoo.close()
    total = time.perf_counter() - start
    return {"seconds": total, "create_seconds": created - start,
            "median_call_ms": 1e3 * statistics.median(per_call), "calls": len(per_call)}


def write_npy(directory: Path, checkpoints: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Baseline: stack each layer across checkpoints and ``np.save`` it (one file per layer)."""
    directory.mkdir()
    start = time.perf_counter()
    for key in checkpoints[0]:
        stacked = np.stack([state[key].numpy() for state in checkpoints])
        np.save(directory / file_name(key), stacked)
    return {"seconds": time.perf_counter() - start}


def write_pt(directory: Path, checkpoints: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Reference: ``torch.save`` of each state_dict to its own file."""
    directory.mkdir()
    per_call = []
    start = time.perf_counter()
    for index, state in enumerate(checkpoints):
        call = time.perf_counter()
        torch.save(state, directory / f"{index:06d}.pt")
        per_call.append(time.perf_counter() - call)
    return {"seconds": time.perf_counter() - start,
            "median_call_ms": 1e3 * statistics.median(per_call), "calls": len(per_call)}


# ---------------------------------------------------------------------------- one family
def bench_family(family: dict[str, Any], count: int, args: argparse.Namespace,
                 workdir: Path) -> dict[str, Any]:
    """Write and read ``count`` checkpoints of one architecture in every format.

    Python's garbage collector is off while timing (as in :mod:`timeit`), so a collection
    triggered by the benchmark's own allocations does not land in one format's time.
    """
    gc.collect()
    gc.disable()
    try:
        return _bench_family(family, count, args, workdir)
    finally:
        gc.enable()


def _bench_family(family: dict[str, Any], count: int, args: argparse.Namespace,
                  workdir: Path) -> dict[str, Any]:
    name = family["name"]
    print(f"[{name}] building {count} checkpoints ...", file=sys.stderr, flush=True)
    checkpoints = make_checkpoints(family["architecture"], count, family["seed_offset"],
                                   num_classes=family["num_classes"],
                                   **family["model_options"])
    keys = list(checkpoints[0])
    per_checkpoint = payload_bytes(checkpoints[0])
    total_bytes = per_checkpoint * count
    layer_bytes = {key: value.numel() * value.element_size()
                   for key, value in checkpoints[0].items()}
    largest = max(keys, key=lambda key: layer_bytes[key])
    read_keys = list(family["read_layers"])
    if layer_bytes[largest] > max(layer_bytes[key] for key in read_keys):
        read_keys.append(largest)  # else a named layer already is (one of) the largest
    root = workdir / name
    root.mkdir()

    zoo_path = root / "append.h5"
    many_path = root / "append_many.h5"
    npy_dir = root / "npy"
    pt_dir = root / "pt"
    batch = min(family["batch"], count)

    print(f"[{name}] writing ...", file=sys.stderr, flush=True)
    writers = {
        "zoo_append": lambda: write_zoo(zoo_path, checkpoints, family, batch=None),
        "zoo_append_many": lambda: write_zoo(many_path, checkpoints, family, batch=batch),
        "npy": lambda: write_npy(npy_dir, checkpoints),
        "torch_save": lambda: write_pt(pt_dir, checkpoints),
    }
    sizes = {"zoo_append": zoo_path, "zoo_append_many": many_path, "npy": npy_dir,
             "torch_save": pt_dir}
    writes = {}
    for label, writer in writers.items():
        # Start every write with no dirty pages of the previous one waiting for writeback.
        os.sync()
        writes[label] = writer()
        writes[label]["file_bytes"] = tree_bytes(sizes[label])
    many_path.unlink()  # same layout as append.h5, which is the one read below
    for label in writers:
        result = writes[label]
        result["checkpoints_per_s"] = count / result["seconds"]
        result["mb_per_s"] = total_bytes / MB / result["seconds"]
        result["time_vs_npy"] = result["seconds"] / writes["npy"]["seconds"]

    print(f"[{name}] reading ...", file=sys.stderr, flush=True)
    for path in (zoo_path, npy_dir, pt_dir):
        warm(path)
    repeats = args.repeats
    open_seconds, _ = median_time(lambda: open_zoo(zoo_path).close(), repeats)

    layer_reads = {}
    with open_zoo(zoo_path) as zoo:
        assert len(zoo) == count
        for key in read_keys:
            npy_file = npy_dir / file_name(key)
            # Untimed round: checks the two give the same bytes, and warms both paths.
            if not np.array_equal(zoo.layer(key), np.load(npy_file)):
                raise AssertionError(f"{key}: zoo and .npy differ")
            zoo_seconds, _ = median_time(lambda key=key: zoo.layer(key), repeats)
            npy_seconds, _ = median_time(lambda npy_file=npy_file: np.load(npy_file), repeats)
            nbytes = layer_bytes[key] * count
            layer_reads[key] = {
                "shape": [count, *checkpoints[0][key].shape], "bytes": nbytes,
                "zoo_seconds": zoo_seconds, "npy_seconds": npy_seconds,
                "zoo_mb_per_s": nbytes / MB / zoo_seconds,
                "npy_mb_per_s": nbytes / MB / npy_seconds,
                "zoo_vs_npy": zoo_seconds / npy_seconds,
            }

        rng = np.random.default_rng(STATE_READ_SEED)
        indices = [int(i) for i in rng.integers(0, count, size=args.state_reads)]
        mapped = {key: np.load(npy_dir / file_name(key), mmap_mode="r") for key in keys}

        def from_npy(index: int) -> dict[str, torch.Tensor]:
            return {key: torch.from_numpy(np.array(mapped[key][index])) for key in keys}

        def from_pt(index: int) -> dict[str, torch.Tensor]:
            return torch.load(pt_dir / f"{index:06d}.pt", weights_only=True)

        readers = {"zoo": zoo.state_dict, "zoo_arrays": zoo.arrays, "npy_mmap": from_npy,
                   "torch_load": from_pt}
        check = indices[0]
        for label, reader in readers.items():
            state = reader(check)  # untimed: correctness and warm-up
            if not all(torch.equal(torch.as_tensor(state[key]), checkpoints[check][key])
                       for key in keys):
                raise AssertionError(f"{label}: checkpoint {check} differs")
        state_reads = {}
        for label, reader in readers.items():
            times = []
            for index in indices:
                start = time.perf_counter()
                reader(index)
                times.append(time.perf_counter() - start)
            state_reads[label] = {"mean_seconds": statistics.fmean(times),
                                  "median_seconds": statistics.median(times)}
        for result in state_reads.values():
            result["mb_per_s"] = per_checkpoint / MB / result["mean_seconds"]
            result["vs_npy"] = result["mean_seconds"] / state_reads["npy_mmap"]["mean_seconds"]

    shutil.rmtree(root)
    return {
        "architecture": family["architecture"], "num_classes": family["num_classes"],
        "model_options": family["model_options"], "checkpoints": count,
        "parameters_and_buffers": sum(v.numel() for v in checkpoints[0].values()),
        "bytes_per_checkpoint": per_checkpoint, "payload_bytes": total_bytes,
        "seeds": f"torch.manual_seed(i + {family['seed_offset']}) for i in range({count})",
        "append_many_batch": batch, "largest_layer": largest,
        "largest_layer_bytes": layer_bytes[largest],
        "write": writes, "open_zoo_seconds": open_seconds, "layer_read": layer_reads,
        "state_dict_read": {"count": len(indices), "index_seed": STATE_READ_SEED,
                            **state_reads},
        "repeats": repeats,
    }


# ---------------------------------------------------------------------------- report
def print_family(title: str, result: dict[str, Any]) -> None:
    count = result["checkpoints"]
    print(f"\n== {title}: {count} checkpoints x {result['bytes_per_checkpoint'] / MB:.4g} MB "
          f"= {result['payload_bytes'] / MB:.4g} MB of tensors ==")
    print(f"{'write':<46}{'total s':>9}{'ckpt/s':>10}{'MB/s':>9}{'x npy':>8}"
          f"{'ms/call':>9}{'file MB':>9}")
    labels = {
        "zoo_append": "zoo.append, 1 commit per checkpoint",
        "zoo_append_many": f"zoo.append_many, batches of {result['append_many_batch']}",
        "npy": "np.save, 1 .npy per layer [base]",
        "torch_save": "torch.save, 1 .pt per checkpoint [ref]",
    }
    for key, label in labels.items():
        row = result["write"][key]
        call = "-" if "median_call_ms" not in row else (
            f"{row['median_call_ms']:.0f}" if row["median_call_ms"] >= 100
            else f"{row['median_call_ms']:.3g}")
        print(f"{label:<46}{row['seconds']:>9.3f}{row['checkpoints_per_s']:>10.1f}"
              f"{row['mb_per_s']:>9.1f}{row['time_vs_npy']:>8.2f}{call:>9}"
              f"{row['file_bytes'] / MB:>9.2f}")
    print(f"\n{'read one layer across all (median)':<46}{'zoo ms':>9}{'npy ms':>9}"
          f"{'zoo MB/s':>10}{'npy MB/s':>10}{'x npy':>8}")
    for key, row in result["layer_read"].items():
        label = f"{key} {tuple(row['shape'])}"
        if row["bytes"] == result["largest_layer_bytes"] * count:
            label += " *"
        print(f"{label:<46}{1e3 * row['zoo_seconds']:>9.3f}{1e3 * row['npy_seconds']:>9.3f}"
              f"{row['zoo_mb_per_s']:>10.0f}{row['npy_mb_per_s']:>10.0f}"
              f"{row['zoo_vs_npy']:>8.2f}")
    reads = result["state_dict_read"]
    print("  (* = a largest layer; rows are medians of "
          f"{result['repeats']} reads on an open zoo)")
    print(f"\n{'read checkpoint i as a state_dict':<46}{'mean ms':>9}{'median':>9}"
          f"{'MB/s':>10}{'x npy':>8}   ({reads['count']} random i)")
    labels = {"zoo": "zoo.state_dict(i)", "zoo_arrays": "zoo.arrays(i) (numpy, no extra copy)",
              "npy_mmap": "row i of mmap'd .npy files [base]",
              "torch_load": "torch.load(one .pt) [ref]"}
    for key, label in labels.items():
        row = reads[key]
        print(f"{label:<46}{1e3 * row['mean_seconds']:>9.3f}{1e3 * row['median_seconds']:>9.3f}"
              f"{row['mb_per_s']:>10.0f}{row['vs_npy']:>8.2f}")
    print(f"open_zoo + close (median): {1e3 * result['open_zoo_seconds']:.2f} ms "
          "(not included in the zoo reads above)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optunet", type=int, default=1000, metavar="N",
                        help="number of OptuNet checkpoints (default 1000; 0 skips)")
    parser.add_argument("--resnet", type=int, default=20, metavar="N",
                        help="number of ResNet-18 (100 classes) checkpoints (default 20; 0 skips)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="parent of the temporary directory (default: system temp dir)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 50 OptuNets, 2 ResNets, 3 repeats, 20 state reads")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed repeats of each layer read; the median is reported")
    parser.add_argument("--state-reads", type=int, default=100, metavar="K",
                        help="random checkpoints read as state_dicts; the mean is reported")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write all results as JSON to OUT")
    args = parser.parse_args(argv)
    if args.quick:
        args.optunet, args.resnet = min(args.optunet, 50), min(args.resnet, 2)
        args.repeats, args.state_reads = min(args.repeats, 3), min(args.state_reads, 20)
    if args.optunet < 0 or args.resnet < 0 or args.repeats < 1 or args.state_reads < 1:
        parser.error("counts must be >= 0 and --repeats, --state-reads >= 1")
    return args


FAMILIES = {
    "optunet": {"name": "optunet", "title": "OptuNet", "architecture": "optunet",
                "num_classes": 10, "model_options": {}, "seed_offset": 0, "batch": 100,
                "read_layers": ["conv2.weight"]},
    "resnet": {"name": "resnet18", "title": "ResNet-18 (100 classes)",
               "architecture": "resnet18", "num_classes": 100, "model_options": {},
               "seed_offset": RESNET_SEED_OFFSET, "batch": 10,
               "read_layers": ["layer4.1.conv2.weight", "bn1.weight"]},
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    versions = library_versions()
    torch.set_num_threads(1)  # the machines are shared; no timed step needs threads
    print("posteriorzoo zoo-store benchmark: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print("Reads are warm-cache: each file is read once in full (untimed) before timing. "
          "No fsync in any writer (untimed os.sync() between writers). MB = 10^6 bytes.")
    print("'x npy' = time / time of the flat .npy baseline (>1: slower). The .npy and .pt "
          "baselines have no crash safety, metadata or digests.")
    results: dict[str, Any] = {}
    counts = {"optunet": args.optunet, "resnet": args.resnet}
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-zoo-", dir=args.workdir) as workdir:
        for label, family in FAMILIES.items():
            if counts[label] == 0:
                continue
            results[family["name"]] = bench_family(family, counts[label], args, Path(workdir))
            print_family(family["title"], results[family["name"]])
    wall = time.perf_counter() - started
    print(f"\nwall time of the benchmark: {wall:.1f} s")
    if args.json is not None:
        document = {
            "benchmark": "bench_zoo_store",
            "command": shlex.join([sys.executable, *sys.argv]),
            "arguments": {k: str(v) if isinstance(v, Path) else v
                          for k, v in vars(args).items()},
            "versions": versions,
            "platform": {"machine": platform.machine(), "system": platform.platform(),
                         "cpu_count": os.cpu_count()},
            "torch_threads": torch.get_num_threads(),
            "seeds": {"checkpoint_init": "torch.manual_seed(i + seed_offset)",
                      "resnet_seed_offset": RESNET_SEED_OFFSET,
                      "state_read_indices": f"numpy.random.default_rng({STATE_READ_SEED})"},
            "cache": "warm: every file read once in full before its timed reads",
            "mb": MB,
            "started_at": started_at,
            "wall_seconds": wall,
            "results": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
