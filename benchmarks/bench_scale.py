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


def limits(paths: dict[str, Any], features: int, repeats: int = 3) -> dict[str, float]:
    """The disk and memory limits, measured here: seconds for the archive's gunzip + write,
    SHA-256 of the target file, and one in-memory float32 pass over a state."""
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
    state = np.random.default_rng(0).standard_normal(min(features, 1 << 24), dtype=np.float32)
    start = time.perf_counter()
    for _ in range(repeats):
        np.multiply(state, 1.0001, out=state)
    one_pass = (time.perf_counter() - start) / repeats * features / state.size
    return {"gunzip_write_s": gunzip, "sha256_s": sha, "float32_pass_s": one_pass}


def kernels(target: int, method: int, features: int, repeats: int = 2) -> dict[str, float]:
    """ns per pair-weight (pairs i < j of the pooled rows) at the paper's row count, on one
    block of ``features``: the distance engines as mmd runs them (SharedTargetDistances,
    fast and exact) beside a bare float32 GEMM of the pooled rows and a bare L1 reduction
    (three operations per pair-weight), the arithmetic limits. At 50 rows a block's
    distances are bound by reading it, not by arithmetic: the rates for the extrapolation
    come from here."""
    from posteriorzoo.mmd.distances import SharedTargetDistances

    rng = np.random.default_rng(0)
    x = rng.standard_normal((target, features), dtype=np.float32)
    y = rng.standard_normal((method, features), dtype=np.float32)
    pooled = np.concatenate([x, y])
    count = target + method
    pair_weights = count * (count - 1) / 2 * features

    def rate(function: Any) -> float:
        function()
        start = time.perf_counter()
        for _ in range(repeats):
            function()
        return (time.perf_counter() - start) / repeats / pair_weights * 1e9

    def engine(precision: str) -> Any:
        return lambda: SharedTargetDistances(target, [method], precision=precision).update(
            x, [y], check_finite=False)

    l1 = bare_l1_kernel()
    columns = np.ascontiguousarray(pooled.T)
    sums = np.zeros((count, count), dtype=np.float32)
    return {"rows": count, "features": features,
            "gemm_ns": rate(lambda: pooled @ pooled.T), "l1_ns": rate(lambda: l1(columns, sums)),
            "fast_ns": rate(engine("fast")), "exact_ns": rate(engine("exact"))}


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
    limit = limits(paths, features)
    paper_rows = (60, 6, 4096) if args.quick else (PAPER_TARGET, PAPER_SAMPLES, 32768)
    limit.update(kernels(*paper_rows))
    return {"target": args.target, "method": args.method, "width": args.width,
            "features": features, "archive_bytes": sizes, "stages": stages, "limits": limit,
            "rates": rates(args, stages, limit, features)}


def rates(args: argparse.Namespace, stages: dict[str, Any], limit: dict[str, float],
          features: int) -> dict[str, Any]:
    """Per checkpoint and per pair-weight, beside the limits, and the extrapolations.

    An mmd run costs its distances' arithmetic (pairs x weights x the engine's rate at the
    paper's row count, :func:`kernels`) plus reading and checking each checkpoint once: the
    latter is what the measured run took beyond its own arithmetic, per checkpoint.
    """
    count = args.target + args.method
    measured_pair_weights = pairs(args.target, [args.method]) * features
    engine = {"keep": "fast_ns", "remove": "fast_ns", "keep exact": "exact_ns"}
    reading = {setting: max(0.0, stages[f"mmd {setting}"]["seconds"] - limit[rate]
                            * 1e-9 * measured_pair_weights) / count
               for setting, rate in engine.items()}
    per = {"import_s": stages["import"]["seconds"] / count,
           "import_limit_s": limit["gunzip_write_s"] / args.target,
           "verify_s": stages["verify"]["seconds"] / args.target,
           "verify_limit_s": limit["sha256_s"] / args.target,
           "open_again_s": stages["open"]["again"],
           "canonicalize_s": stages["canonicalize"]["seconds"] / count,
           "canonicalize_limit_s": limit["float32_pass_s"],
           "mmd_reading_s": reading,
           "fast_ns": limit["fast_ns"], "exact_ns": limit["exact_ns"],
           "gemm_ns": limit["gemm_ns"], "l1_ns": limit["l1_ns"]}
    scale = RESNET18_WEIGHTS / features
    paper_checkpoints = PAPER_TARGET + PAPER_METHODS * PAPER_SAMPLES
    paper_pairs = pairs(PAPER_TARGET, [PAPER_SAMPLES] * PAPER_METHODS)
    release_pairs = RELEASE_CHECKPOINTS * (RELEASE_CHECKPOINTS - 1) / 2

    def mmd_hours(setting: str, pair_count: float, checkpoints: int) -> float:
        return (limit[engine[setting]] * 1e-9 * pair_count * RESNET18_WEIGHTS
                + reading[setting] * scale * checkpoints) / 3600

    hours = {
        "import": per["import_s"] * scale * paper_checkpoints / 3600,
        "canonicalize": per["canonicalize_s"] * scale * paper_checkpoints / 3600,
        "mmd keep": mmd_hours("keep", paper_pairs, paper_checkpoints),
        "mmd remove": mmd_hours("remove", paper_pairs, paper_checkpoints),
    }
    # the measure: end to end from the imported files
    hours["paper table from imported files"] = (hours["canonicalize"] + hours["mmd keep"]
                                                + hours["mmd remove"])
    hours["release all-pairs mmd"] = mmd_hours("keep", release_pairs, RELEASE_CHECKPOINTS)
    return {"per": per, "hours": hours, "scale_to_resnet18": scale,
            "paper_pairs": paper_pairs, "release_pairs": release_pairs,
            "exact_paper_mmd_hours": 2 * mmd_hours("keep exact", paper_pairs,
                                                   paper_checkpoints),
            "fast_over_gemm": limit["fast_ns"] / limit["gemm_ns"],
            "exact_over_gemm": limit["exact_ns"] / limit["gemm_ns"]}


def print_table(result: dict[str, Any]) -> None:
    per, limit, stages = result["rates"]["per"], result["limits"], result["stages"]
    print(f"\n{result['target']} + {result['method']} ResNet-18 checkpoints (width "
          f"{result['width']}, {result['features']:,} weights each)")
    print(f"{'stage':<16}{'measured':>18}{'limit':>20}{'ratio':>9}{'peak MB':>10}")
    rows = [("import", per["import_s"], per["import_limit_s"], "s/ckpt"),
            ("verify", per["verify_s"], per["verify_limit_s"], "s/ckpt"),
            ("canonicalize", per["canonicalize_s"], per["canonicalize_limit_s"], "s/ckpt")]
    for name, value, bound, unit in rows:
        print(f"{name:<16}{value:>10.4g} {unit:<7}{bound:>12.4g} {unit:<7}"
              f"{value / bound:>8.1f}x{stages[name]['peak_mb']:>10.0f}")
    for name in ("mmd keep", "mmd remove", "mmd keep exact"):
        print(f"{name:<16}{stages[name]['seconds']:>10.1f} s       (reading "
              f"{per['mmd_reading_s'][name[4:]]:.3f} s/ckpt){stages[name]['peak_mb']:>27.0f}")
    print(f"{'open again':<16}{per['open_again_s']:>10.3g} s       (first open "
          f"{stages['open']['first']:.2f} s){stages['open']['peak_mb']:>26.0f}")
    print(f"{'report':<16}{stages['report']['seconds']:>10.1f} s       (--no-predictions, "
          f"--precision fast){stages['report']['peak_mb']:>16.0f}")
    print(f"distance engines at {limit['rows']} rows x {limit['features']} features, ns per "
          f"pair-weight: fast {limit['fast_ns']:.4g} ({result['rates']['fast_over_gemm']:.2f}x "
          f"the GEMM), exact {limit['exact_ns']:.4g} ({result['rates']['exact_over_gemm']:.2f}x);"
          f" bare float32 GEMM {limit['gemm_ns']:.4g}, bare L1 {limit['l1_ns']:.4g}")
    hours = result["rates"]["hours"]
    print("extrapolated to ResNet-18 on these cores (hours): "
          + "; ".join(f"{k} {v:.2f}" for k, v in hours.items())
          + "; the paper's mmd with the exact engine "
          + f"{result['rates']['exact_paper_mmd_hours']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
