"""Benchmark the paper-scale workload end to end on release-shaped ResNet-18 archives, next
to the arithmetic limit of each stage measured in the same run, and extrapolate.

Two archives are built like the authors' release (``benchmarks/bench_import.py``'s
builder: float16 safetensors with ``model.`` keys in ``cifar100-resnet18-0-<N-1>.tgz``, tar
order shuffled): a target of ``--target`` checkpoints and one method of ``--method``
checkpoints (other seeds). Each stage then runs in its own process, whose wall time and
peak memory (``ru_maxrss``) are printed:

============== ======================================= ===================================
stage          what                                    limit measured beside it
============== ======================================= ===================================
import         ``import_checkpoints`` of both archives gunzip + write the archive's bytes
verify         ``verify`` of the target (full SHA-256) SHA-256 of the file's bytes
open           ``describe`` twice (the second trusts   --
               the verification record)
canonicalize   target and method (float32 compute)     one float32 pass over the states
mmd keep       ``compare``, stored weights, fast       a bare float32 GEMM of the pooled
mmd remove     ``compare`` of the canonical copies     rows and a bare L1 reduction, in
mmd keep exact the float64 engine (the old default)    ns per pair-weight
report         ``report --no-predictions``             --
============== ======================================= ===================================

The distance cache is off for the mmd stages (each computes every distance) and on, in a
fresh folder, for the report (as a user's report after mmd would find it).

The extrapolation multiplies the measured rates by the paper's workload (a 1,000-checkpoint
target, 10 methods x 100 samples, both symmetry settings: 2,000 checkpoints imported and
canonicalized; per setting 1,000 x 999 / 2 target pairs, once, plus 10 x (1,000 x 100 +
100 x 99 / 2) pairs, over 11.2 M weights) and by the whole release's all-pairs MMD (9,216
checkpoints). Ray workers divide the mmd and canonicalize hours (tiles and checkpoints are
independent); GPU figures come from ``benchmarks/gpu_check.py`` where a GPU was lent.

Run from the repository root (a full run writes about 4 x (N + M) x 45 MB to
``--workdir``, default a temporary folder, deleted at the end)::

    .venv/bin/python benchmarks/bench_scale.py                 # 40 + 10 ResNet-18s
    .venv/bin/python benchmarks/bench_scale.py --target 200 --method 20
    .venv/bin/python benchmarks/bench_scale.py --quick         # smoke run (width 4)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_import import build_archive  # noqa: E402 -- the release-shaped archive builder
from bench_mmd import bare_l1_kernel  # noqa: E402 -- the bare L1 reduction

#: The paper's workload and the release, for the extrapolation.
PAPER_TARGET, PAPER_METHODS, PAPER_SAMPLES = 1_000, 10, 100
RELEASE_CHECKPOINTS = 9_216
RESNET18_WEIGHTS = 11_220_132   # parameters of resnet18 with 100 classes

#: One stage, run in a child process: prints a JSON line with its own wall seconds.
STAGE = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
from analysis.report import build_report
from posteriorzoo.collection import canonicalize, compare, describe, import_checkpoints, verify
stage, paths = sys.argv[1], json.loads(sys.argv[2])
start = time.perf_counter()     # after the imports: the stage's own work
extra = {}
if stage == "import":
    for archive, out in paths["archives"]:
        import_checkpoints(out, [archive], model_options=paths["options"])
elif stage == "verify":
    verify(paths["target"])
elif stage == "open":
    for name in ("first", "again"):
        began = time.perf_counter()
        describe(paths["target"])
        extra[name] = time.perf_counter() - began
elif stage == "canonicalize":
    for source, out in paths["pairs"]:
        canonicalize(source, out)
elif stage.startswith("mmd"):
    setting = stage.split()[1]     # remove: the canonical copies, already made
    precision = "exact" if stage.endswith("exact") else "fast"
    suffix = "" if setting == "keep" else "-canonical"
    compare(paths["target" + suffix], {"method": paths["method" + suffix]}, symmetries=setting,
            precision=precision)
elif stage == "report":
    build_report(paths["target"], {"method": paths["method"]}, predictions=False,
                 splits=paths["splits"], figures=False, precision="fast")
print(json.dumps({"seconds": time.perf_counter() - start, **extra}))
"""


def run_stage(stage: str, paths: dict[str, Any], environment: dict[str, str]
              ) -> dict[str, Any]:
    """One stage in a child process: its own wall seconds and its peak resident memory
    (the child's ``ru_maxrss``, from ``wait4``)."""
    folder = Path(paths["scratch"])
    with open(folder / "stage.out", "w+") as out, open(folder / "stage.err", "w+") as err:
        child = subprocess.Popen([sys.executable, "-c", STAGE, stage, json.dumps(paths)],
                                 stdout=out, stderr=err, env=environment)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if child.returncode != 0:
            raise SystemExit(f"stage {stage} failed:\n{err.read()[-3000:]}")
        result = json.loads(out.read().strip().splitlines()[-1])
    result["peak_mb"] = usage.ru_maxrss / 1024
    return result


def limits(paths: dict[str, Any], rows: int, features: int, repeats: int = 3
           ) -> dict[str, float]:
    """The arithmetic and disk limits, measured here: seconds for the archive's gunzip +
    write, SHA-256 of the target file, one float32 pass over a state; ns per pair-weight
    of a bare float32 GEMM of the pooled rows and of a bare L1 reduction."""
    import gzip

    out = Path(paths["scratch"]) / "limit.bin"
    start = time.perf_counter()
    with gzip.open(paths["archives"][0][0], "rb") as source, open(out, "wb") as target:
        while block := source.read(1 << 22):
            target.write(block)
    gunzip = time.perf_counter() - start
    out.unlink()
    start = time.perf_counter()
    digest = hashlib.sha256()
    with open(paths["target"], "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    sha = time.perf_counter() - start
    rng = np.random.default_rng(0)
    state = rng.standard_normal(min(features, 1 << 24), dtype=np.float32)
    start = time.perf_counter()
    for _ in range(repeats):
        np.multiply(state, 1.0001, out=state)
    one_pass = (time.perf_counter() - start) / repeats * features / state.size
    block = rng.standard_normal((rows, min(features, 1 << 18)), dtype=np.float32)
    pair_weights = rows * (rows - 1) / 2 * block.shape[1]
    block @ block.T
    start = time.perf_counter()
    for _ in range(repeats):
        block @ block.T
    gemm = (time.perf_counter() - start) / repeats / pair_weights * 1e9
    kernel = bare_l1_kernel()
    columns = np.ascontiguousarray(block.T)
    sums = np.zeros((rows, rows), dtype=np.float32)
    kernel(columns, sums)
    start = time.perf_counter()
    for _ in range(repeats):
        kernel(columns, sums)
    l1 = (time.perf_counter() - start) / repeats / pair_weights * 1e9
    return {"gunzip_write_s": gunzip, "sha256_s": sha, "float32_pass_s": one_pass,
            "gemm_ns": gemm, "l1_ns": l1}


def pairs(target: int, methods: list[int]) -> float:
    """Pairs one setting's mmd computes: the target's once, each method's with it and itself."""
    return target * (target - 1) / 2 + sum(target * n + n * (n - 1) / 2 for n in methods)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=int, default=40, help="target checkpoints")
    parser.add_argument("--method", type=int, default=10, help="method checkpoints")
    parser.add_argument("--width", type=int, default=64,
                        help="ResNet-18 width (64: the release's 11.2 M weights)")
    parser.add_argument("--splits", type=int, default=5, help="noise-floor splits of report")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 6 + 4 checkpoints of width 4")
    parser.add_argument("--workdir", type=Path, default=None, help="for the archives")
    parser.add_argument("--json", type=Path, default=None, help="also write every number")
    args = parser.parse_args(argv)
    if args.quick:
        args.target, args.method, args.width, args.splits = 6, 4, 4, 2
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=args.workdir) as scratch:
        folder = Path(scratch)
        result = run(args, folder)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    archives = {"target": folder / f"cifar100-resnet18-0-{args.target - 1}.tgz",
                "method": folder / f"cifar100-resnet18-{args.target}-"
                                   f"{args.target + args.method - 1}.tgz"}
    start = time.perf_counter()
    sizes = {"target": build_archive(archives["target"], args.target, 0, args.width)}
    # the method's members are other networks: seeds after the target's
    sizes["method"] = build_archive(archives["method"], args.method, 1, args.width,
                                    first=args.target)
    print(f"archives built in {time.perf_counter() - start:.0f} s (untimed)", flush=True)
    paths = {"archives": [(str(archives[k]), str(folder / f"{k}.h5")) for k in archives],
             "options": None if args.width == 64 else {"width": args.width},
             "target": str(folder / "target.h5"), "method": str(folder / "method.h5"),
             "target-canonical": str(folder / "target-canonical.h5"),
             "method-canonical": str(folder / "method-canonical.h5"),
             "pairs": [(str(folder / f"{k}.h5"), str(folder / f"{k}-canonical.h5"))
                       for k in ("target", "method")],
             "splits": args.splits, "scratch": str(folder)}
    base = {**os.environ, "POSTERIORZOO_DISTANCE_CACHE": "off",
            "POSTERIORZOO_CACHE": str(folder / "cache")}
    stages: dict[str, dict[str, Any]] = {}
    for stage in ("import", "verify", "open", "canonicalize", "mmd keep", "mmd remove",
                  "mmd keep exact"):
        stages[stage] = run_stage(stage, paths, base)
        print(f"{stage}: {stages[stage]['seconds']:.1f} s", flush=True)
    cached = {**base, "POSTERIORZOO_DISTANCE_CACHE": str(folder / "distances")}
    stages["report"] = run_stage("report", paths, cached)
    print(f"report: {stages['report']['seconds']:.1f} s", flush=True)
    from posteriorzoo.zoo import open_zoo

    with open_zoo(paths["target"]) as zoo:
        features = sum(int(np.prod(shape)) for shape in zoo.shapes.values())
    rows = args.target + args.method
    limit = limits(paths, rows, features)
    return {"target": args.target, "method": args.method, "width": args.width,
            "features": features, "archive_bytes": sizes, "stages": stages, "limits": limit,
            "rates": rates(args, stages, limit, features)}


def rates(args: argparse.Namespace, stages: dict[str, Any], limit: dict[str, float],
          features: int) -> dict[str, Any]:
    """Per checkpoint and per pair-weight, beside the limits, and the extrapolations."""
    count = args.target + args.method
    measured_pairs = pairs(args.target, [args.method])
    ns = {setting: stages[f"mmd {setting}"]["seconds"] / (measured_pairs * features) * 1e9
          for setting in ("keep", "remove", "keep exact")}
    per = {"import_s": stages["import"]["seconds"] / count,
           "import_limit_s": limit["gunzip_write_s"] / args.target,
           "verify_s": stages["verify"]["seconds"] / args.target,
           "verify_limit_s": limit["sha256_s"] / args.target,
           "open_again_s": stages["open"]["again"],
           "canonicalize_s": stages["canonicalize"]["seconds"] / count,
           "canonicalize_limit_s": limit["float32_pass_s"],
           "mmd_keep_ns": ns["keep"], "mmd_remove_ns": ns["remove"],
           "mmd_exact_ns": ns["keep exact"],
           "gemm_ns": limit["gemm_ns"], "l1_ns": limit["l1_ns"]}
    scale = RESNET18_WEIGHTS / features
    paper_checkpoints = PAPER_TARGET + PAPER_METHODS * PAPER_SAMPLES
    paper_pairs = pairs(PAPER_TARGET, [PAPER_SAMPLES] * PAPER_METHODS)
    release_pairs = RELEASE_CHECKPOINTS * (RELEASE_CHECKPOINTS - 1) / 2
    hours = {
        "import": per["import_s"] * scale * paper_checkpoints / 3600,
        "canonicalize": per["canonicalize_s"] * scale * paper_checkpoints / 3600,
        "mmd (both settings)": (ns["keep"] + ns["remove"]) * 1e-9 * paper_pairs
        * RESNET18_WEIGHTS / 3600,
        "release all-pairs mmd": ns["keep"] * 1e-9 * release_pairs * RESNET18_WEIGHTS / 3600,
    }
    # the measure: end to end from the imported files
    hours["paper table from imported files"] = hours["canonicalize"] + hours[
        "mmd (both settings)"]
    return {"per": per, "hours": hours, "scale_to_resnet18": scale,
            "paper_pairs": paper_pairs, "release_pairs": release_pairs,
            "ratio_to_gemm": {k: v / limit["gemm_ns"] for k, v in ns.items()},
            "exact_paper_mmd_hours": 2 * ns["keep exact"] * 1e-9 * paper_pairs
            * RESNET18_WEIGHTS / 3600,
            "ratio_to_gemm_plus_l1": {k: v / (limit["gemm_ns"] + limit["l1_ns"])
                                      for k, v in ns.items()}}


def print_table(result: dict[str, Any]) -> None:
    per, limit, stages = result["rates"]["per"], result["limits"], result["stages"]
    print(f"\n{result['target']} + {result['method']} ResNet-18 checkpoints (width "
          f"{result['width']}, {result['features']:,} weights each)")
    print(f"{'stage':<14}{'measured':>20}{'limit':>20}{'ratio':>9}{'peak MB':>10}")
    rows = [("import", per["import_s"], per["import_limit_s"], "s/ckpt"),
            ("verify", per["verify_s"], per["verify_limit_s"], "s/ckpt"),
            ("canonicalize", per["canonicalize_s"], per["canonicalize_limit_s"], "s/ckpt"),
            ("mmd keep", per["mmd_keep_ns"], per["gemm_ns"], "ns/pw"),
            ("mmd remove", per["mmd_remove_ns"], per["gemm_ns"], "ns/pw"),
            ("mmd keep exact", per["mmd_exact_ns"], per["gemm_ns"], "ns/pw")]
    for name, value, bound, unit in rows:
        peak = stages[name]["peak_mb"]
        print(f"{name:<14}{value:>12.4g} {unit:<7}{bound:>12.4g} {unit:<7}"
              f"{value / bound:>8.1f}x{peak:>10.0f}")
    print(f"{'open again':<14}{per['open_again_s']:>12.3g} s       (first open "
          f"{stages['open']['first']:.2f} s){stages['open']['peak_mb']:>28.0f}")
    print(f"{'report':<14}{stages['report']['seconds']:>12.1f} s       (--no-predictions, "
          f"whole){stages['report']['peak_mb']:>29.0f}")
    print(f"limits: float32 GEMM {limit['gemm_ns']:.4g} ns and bare L1 {limit['l1_ns']:.4g} ns "
          "per pair-weight; mmd per pair-weight is "
          f"{result['rates']['ratio_to_gemm']['keep']:.1f}x the GEMM, "
          f"{result['rates']['ratio_to_gemm_plus_l1']['keep']:.1f}x GEMM + L1")
    hours = result["rates"]["hours"]
    print("extrapolated to ResNet-18 on these cores (hours): "
          + "; ".join(f"{k} {v:.2f}" for k, v in hours.items())
          + "; the paper's mmd with the exact engine "
          + f"{result['rates']['exact_paper_mmd_hours']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
