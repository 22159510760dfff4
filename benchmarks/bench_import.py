"""Benchmark ``import`` of a release-shaped archive, and opening what it made, against
the disk-speed limit and (optionally) another version of the code, in one run.

The archive is built like the authors' release: ``cifar100-resnet18-0-<N-1>.tgz`` holding
float16 safetensors files with ``model.`` keys in torch-uncertainty's ResNet layout (head
``linear``, read as our ``fc``: ``posteriorzoo.zoo.keymap``), one ResNet-18 (100 classes,
11.2 M weights, 22 MB) per member, member i initialised under ``torch.manual_seed(i)``, the tar
order shuffled (``--seed``). Timed, per checkpoint:

* **limit**: read the archive, gunzip it and write its bytes to a file (what no import can
  beat: the archive read once at disk speed);
* **import**: ``import_checkpoints`` into a new collection (rows must land in mode order),
  and the peak memory of the process that ran it;
* **open (first)**: ``describe`` (``info``) of the new collection, which checks every
  checkpoint's digests and records that it did; **open (again)**: the same a second time,
  which checks the record (see README, "Verification");
* with ``--baseline-tree DIR`` (a source tree of another version, e.g. ``git archive
  HEAD~1 posteriorzoo | tar -x -C DIR``): the same import, then ``reorder_collection``
  when its rows are not in mode order, and two opens, in a subprocess running that code.

Writes go to a temporary folder (``--workdir``), deleted at the end; a full run needs
about 3 x N x 22 MB there. Absolute times on a shared machine are noisy: compare the
ratios to the limit measured in the same run.

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_import.py --checkpoints 20
    .venv/bin/python benchmarks/bench_import.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors_bytes

from posteriorzoo.models import build

#: What a timed import does, run by this interpreter or by one on another source tree.
IMPORT_SCRIPT = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
from pathlib import Path
from posteriorzoo.collection import describe, import_checkpoints
from posteriorzoo.zoo import open_zoo
archive, out, width = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
times = {}
start = time.perf_counter()
import_checkpoints(out, [archive], model_options=None if width == 64 else {"width": width})
times["import_s"] = time.perf_counter() - start
import resource
times["import_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
try:
    from posteriorzoo.zoo import reorder_collection
    from posteriorzoo.zoo.reorder import collection_row_order
    with open_zoo(out) as zoo:
        in_order = collection_row_order(zoo).in_order
    start = time.perf_counter()
    if not in_order:
        reorder_collection(out, in_place=True)
    times["reorder_s"] = time.perf_counter() - start
except ImportError:
    times["reorder_s"] = 0.0
# a file changed less than 2 s before a check is not noted as verified (coarse file
# times): wait, untimed, as any later session would have
time.sleep(2.1)
for name in ("open_first_s", "open_again_s"):
    start = time.perf_counter()
    describe(out)
    times[name] = time.perf_counter() - start
with open_zoo(out) as zoo:
    times["modes"] = zoo.metadata["mode_id"].tolist()
print(json.dumps(times))
"""


#: A collection of ``rows`` rows (the imported ones repeated, modes 0..rows-1), and the
#: time of ``describe`` (``info``) in a fresh process: what opening it costs.
OPEN_SCRIPT = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
from pathlib import Path
source, big, rows, build = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if build == "build":
    from posteriorzoo.zoo import create_zoo, open_zoo
    with open_zoo(source) as zoo:
        states = [zoo.state_dict(i) for i in range(len(zoo))]
        attributes = dict(architecture=zoo.architecture, dataset=zoo.dataset,
                          method=zoo.method, num_classes=zoo.num_classes,
                          model_options=zoo.model_options)
    with create_zoo(big, template=states[0], **attributes) as zoo:
        for start in range(0, rows, 10):
            chosen = range(start, min(rows, start + 10))
            zoo.append_many([states[i % len(states)] for i in chosen],
                            [{"mode_id": i, "sample_id": 0} for i in chosen])
    time.sleep(2.1)  # a file changed just before its check is not noted as verified
    sys.exit(0)
from posteriorzoo.collection import describe
start = time.perf_counter()
describe(big)
print(json.dumps(time.perf_counter() - start))
"""


def release_key(key: str) -> str:
    """Our ResNet-18 key as torch-uncertainty names it (the head is ``linear``)."""
    return "linear." + key[len("fc."):] if key.startswith("fc.") else key


def build_archive(path: Path, count: int, seed: int, width: int, first: int = 0) -> int:
    """The release-shaped archive of members ``first .. first + count - 1``; returns the
    bytes of its members."""
    order = list(range(first, first + count))
    random.Random(seed).shuffle(order)
    total = 0
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1) as gz, \
            tarfile.open(fileobj=gz, mode="w|") as archive:
        for index in order:
            torch.manual_seed(index)
            model = build("resnet18", num_classes=100, width=width)
            data = save_safetensors_bytes({
                f"model.{release_key(key)}": (value.half() if value.is_floating_point()
                                              else value)
                .detach().contiguous() for key, value in model.state_dict().items()})
            info = tarfile.TarInfo(f"cifar100-resnet18/model_{index}.safetensors")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
            total += len(data)
    return total


def limit_seconds(archive: Path, out: Path) -> float:
    """Read and gunzip the archive, and write its bytes: the disk-speed limit."""
    os.sync()
    start = time.perf_counter()
    with gzip.open(archive, "rb") as source, open(out, "wb") as target:
        while block := source.read(1 << 22):
            target.write(block)
    seconds = time.perf_counter() - start
    out.unlink()
    return seconds


def timed_import(archive: Path, out: Path, width: int, tree: Path | None) -> dict[str, Any]:
    """The import script's times, run here (``tree`` None) or on another source tree; the
    notes of verified files go to a folder beside ``out`` (not the user's cache)."""
    environment = {**os.environ, "POSTERIORZOO_CACHE": str(out.with_suffix(".cache"))}
    if tree is not None:
        environment["PYTHONPATH"] = str(tree)
    os.sync()
    done = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT, str(archive), str(out),
                           str(width)],
                          capture_output=True, text=True, env=environment, check=False,
                          cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"import failed ({tree or 'this tree'}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed_opens(source: Path, big: Path, rows: int, trees: dict[str, Path | None],
                cache: Path) -> dict[str, list[float]]:
    """``info`` of a ``rows``-row collection in fresh processes: with each tree, twice
    (the first open checks every checkpoint; on a version that notes a verified file, the
    second finds the note), the notes kept in ``cache``."""
    def run(tree: Path | None, build: str) -> float:
        environment = {**os.environ, "POSTERIORZOO_CACHE": str(cache)}
        if tree is not None:
            environment["PYTHONPATH"] = str(tree)
        done = subprocess.run([sys.executable, "-c", OPEN_SCRIPT, str(source), str(big),
                               str(rows), build], capture_output=True, text=True,
                              env=environment, check=False, cwd=tree)
        if done.returncode != 0:
            raise SystemExit(f"open failed ({tree or 'this tree'}):\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1]) if build == "time" else 0.0

    run(trees["this tree"], "build")
    return {label: [run(tree, "time"), run(tree, "time")] for label, tree in trees.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", type=int, default=20,
                        help="members of the archive (default: %(default)s)")
    parser.add_argument("--width", type=int, default=64,
                        help="ResNet-18 base width; 64 is the real one (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tar order")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="a source tree (holding posteriorzoo/) of the version to compare")
    parser.add_argument("--tree", type=Path, default=None,
                        help="the source tree to time (default: the installed posteriorzoo)")
    parser.add_argument("--open-rows", type=int, default=0,
                        help="also time info of a collection of this many rows (the "
                             "imported ones repeated), twice per tree (default: none)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4 members of a width-8 ResNet-18, 12 rows opened")
    parser.add_argument("--workdir", type=Path, default=None, help="for temporary files")
    parser.add_argument("--json", type=Path, default=None, help="also write every number")
    args = parser.parse_args(argv)
    if args.quick:
        args.checkpoints, args.width, args.open_rows = 4, 8, 12
    record: dict[str, Any] = {"checkpoints": args.checkpoints, "width": args.width,
                              "seed": args.seed}
    with tempfile.TemporaryDirectory(dir=args.workdir) as folder:
        work = Path(folder)
        archive = work / f"cifar100-resnet18-0-{args.checkpoints - 1}.tgz"
        record["member_bytes"] = build_archive(archive, args.checkpoints, args.seed,
                                               args.width)
        record["archive_bytes"] = archive.stat().st_size
        record["limit_s"] = limit_seconds(archive, work / "plain.tar")
        runs = {"this tree": timed_import(archive, work / "new.h5", args.width, args.tree)}
        if args.baseline_tree is not None:
            runs["baseline"] = timed_import(archive, work / "old.h5", args.width,
                                           args.baseline_tree)
        if args.open_rows:
            trees = {"this tree": args.tree}
            if args.baseline_tree is not None:
                trees["baseline"] = args.baseline_tree
            record["open_rows"] = args.open_rows
            record["open_s"] = timed_opens(work / "new.h5", work / "big.h5", args.open_rows,
                                           trees, work / "cache")
    n = args.checkpoints
    expected = list(range(n))
    print(f"{n} members, {record['member_bytes'] / n / 1e6:.1f} MB each, archive "
          f"{record['archive_bytes'] / 1e6:.0f} MB (gzip level 1), tar order shuffled")
    print(f"  limit (read + gunzip + write)   {record['limit_s'] / n:7.3f} s/ckpt")
    for label, times in runs.items():
        if times.pop("modes") != expected:
            raise SystemExit(f"{label}: rows not in mode order after import (+ reorder)")
        record[label] = times
        total = times["import_s"] + times["reorder_s"]
        print(f"  {label}: import {times['import_s'] / n:.3f} + reorder "
              f"{times['reorder_s'] / n:.3f} = {total / n:.3f} s/ckpt "
              f"({total / record['limit_s']:.1f}x the limit); open first "
              f"{times['open_first_s'] / n:.3f}, again {times['open_again_s'] / n:.4f} s/ckpt; "
              f"peak memory of the import {times['import_peak_mb']:.0f} MB")
    for label, (first, again) in record.get("open_s", {}).items():
        print(f"  {label}: info of {args.open_rows} rows {first:.2f} s, again {again:.2f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
