"""``posteriorzoo canonicalize`` and ``posteriorzoo min-mass``: weight-space symmetries of
whole collections."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "canonicalize", help="remove permutation, scaling and softmax symmetries",
        description="Write the canonical form of every checkpoint of IN to a new collection "
                    "OUT: scalings first (each scalable unit's incoming weights normalised, "
                    "layer by layer, or the minimum-mass scaling), then the softmax shift "
                    "(output biases sum to zero), then permutations (hidden units sorted). "
                    "The symmetries are derived by tracing the network once; checkpoints "
                    "are processed in batches, vectorised over the checkpoint axis. OUT's "
                    "annotations say what was removed and what could not be. Exit code 2 on "
                    "bad input (missing or corrupt IN, NaN weights, OUT already exists); "
                    "IN is never modified and a partial OUT is removed.")
    parser.add_argument("source", type=Path, metavar="IN", help="collection file (.h5)")
    parser.add_argument("target", type=Path, metavar="OUT", help="new collection file (.h5)")
    parser.add_argument("--permutation", choices=["first", "max", "none"], default="first",
                        help="sort key: first incoming weight (the paper's default), largest "
                             "incoming weight, or no sorting (default: %(default)s)")
    parser.add_argument("--scaling", choices=["norm", "std", "minmass", "none"],
                        default="norm",
                        help="unit L2 norm or unit standard deviation of each unit's incoming "
                             "weights; minmass: norm, then the scaling of least total squared "
                             "weight (BatchNorm weights count; the scales a BatchNorm absorbs "
                             "keep their norm value); or none (default: %(default)s)")
    parser.add_argument("--solver", choices=["fast", "cvxpy"], default="fast",
                        help="min-mass solver: batched Newton (fast) or the cvxpy reference, "
                             "one checkpoint at a time (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="B",
                        help="checkpoints per batch (default: as many as fit in 256 MB)")
    parser.add_argument("--no-softmax", action="store_true",
                        help="keep the output biases' softmax shift")
    parser.add_argument("--verify", type=int, default=0, metavar="N",
                        help="check N random checkpoints compute the same function")
    parser.add_argument("--seed", type=int, default=0, help="seed of --verify's choice")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run_canonicalize)

    report = subparsers.add_parser(
        "min-mass", help="minimum weight mass of every checkpoint (paper Fig. 2 data)",
        description="Solve the minimum scaled network mass problem for every checkpoint of "
                    "IN (nothing is written to IN) and print the mass before and after. With "
                    "--out, write one CSV row per checkpoint (index, seed, mass before and "
                    "after, Newton iterations, dead units, and each weight tensor's largest "
                    "|w| before and after) and a JSON file next to it with the command, "
                    "versions, the input's SHA-256 and summary figures. Checkpoints with "
                    "non-finite weights (flagged diverged) get empty values.")
    report.add_argument("source", type=Path, metavar="IN", help="collection file (.h5)")
    report.add_argument("--solver", choices=["fast", "cvxpy"], default="fast",
                        help="batched Newton (fast) or the cvxpy reference "
                             "(default: %(default)s)")
    report.add_argument("--out", type=Path, default=None, metavar="CSV",
                        help="per-checkpoint table (.csv; CSV.json gets the provenance); "
                             "refused if either exists")
    report.add_argument("--batch-size", type=int, default=None, metavar="B",
                        help="checkpoints per batch (default: as many as fit in 256 MB)")
    report.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    report.set_defaults(func=run_min_mass)


def run_canonicalize(args: argparse.Namespace) -> int:
    from posteriorzoo.symmetry.collection import canonicalize_collection

    summary = canonicalize_collection(
        args.source, args.target, permutation=args.permutation, scaling=args.scaling,
        softmax=not args.no_softmax, solver=args.solver, verify=args.verify, seed=args.seed,
        batch_size=args.batch_size,
        progress=not args.no_progress, command=args.command_line)
    verified = (f"; {len(summary.verified)} verified, largest logit change "
                f"{summary.largest_change:.2g}") if summary.verified else ""
    print(f"{summary.path}: {summary.checkpoints} canonical checkpoints "
          f"({summary.dead_units} dead units left unscaled){verified}")
    return 0


def run_min_mass(args: argparse.Namespace) -> int:
    import csv
    import json

    import numpy as np

    from posteriorzoo.errors import InvalidOptionError
    from posteriorzoo.hashing import sha256_file
    from posteriorzoo.symmetry.collection import min_mass_collection
    from posteriorzoo.zoo import open_zoo
    from posteriorzoo.zoo.schema import library_versions

    sidecar = args.out.with_name(args.out.name + ".json") if args.out else None
    for path in (args.out, sidecar):
        if path is not None and path.exists():
            raise InvalidOptionError(f"{path} already exists; choose another --out")
    report = min_mass_collection(args.source, solver=args.solver,
                                 batch_size=args.batch_size, progress=not args.no_progress)
    with open_zoo(args.source) as zoo:
        seeds = zoo.metadata["seed"]
    finite = np.isfinite(report.mass_after)
    ratio = report.mass_after[finite] / report.mass_before[finite]
    summary = {"checkpoints": len(report.mass_before), "solved": int(finite.sum()),
               "dead_units": len(report.dead_units),
               "mass_before_median": float(np.median(report.mass_before[finite])),
               "mass_after_median": float(np.median(report.mass_after[finite])),
               "mass_ratio_median": float(np.median(ratio))}
    print(f"{args.source}: {summary['solved']} of {summary['checkpoints']} checkpoints; "
          f"median mass {summary['mass_before_median']:.6g} -> "
          f"{summary['mass_after_median']:.6g} (median ratio {summary['mass_ratio_median']:.4f})"
          f"; {summary['dead_units']} dead units left at scale 1")
    if args.out is None:
        return 0
    dead = np.bincount([unit[0] for unit in report.dead_units],
                       minlength=len(report.mass_before))
    keys = list(report.max_abs_before)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "x", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["checkpoint", "seed", "mass_before", "mass_after", "iterations",
                         "dead_units", *[f"max_abs_before:{k}" for k in keys],
                         *[f"max_abs_after:{k}" for k in keys]])
        for i in range(len(report.mass_before)):
            values = [report.mass_before[i], report.mass_after[i],
                      *[report.max_abs_before[k][i] for k in keys],
                      *[report.max_abs_after[k][i] for k in keys]]
            cells = ["" if not np.isfinite(v) else repr(float(v)) for v in values]
            writer.writerow([i, int(seeds[i]), *cells[:2], int(report.iterations[i]),
                             int(dead[i]), *cells[2:]])
    sidecar.write_text(json.dumps({
        "command": args.command_line, "versions": library_versions(),
        "input": {"path": str(args.source), "sha256": sha256_file(args.source)},
        "solver": args.solver, "summary": summary, "table": args.out.name}, indent=2))
    print(f"wrote {args.out} and {sidecar}")
    return 0
