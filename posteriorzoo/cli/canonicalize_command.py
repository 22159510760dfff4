"""``posteriorzoo canonicalize`` and ``posteriorzoo min-mass``: weight-space symmetries of
whole collections."""

from __future__ import annotations

import argparse
from pathlib import Path

from posteriorzoo.cli._types import (
    add_no_verify_option,
    add_overwrite_option,
    nonnegative_int,
    positive_int,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "canonicalize", help="remove permutation, scaling and softmax symmetries",
        description="Write the canonical form of every checkpoint of IN to a new collection "
                    "OUT: scalings first (each scalable unit's incoming weights normalised, "
                    "layer by layer, or the minimum-mass scaling), then the softmax shift "
                    "(output biases sum to zero), then permutations (hidden units sorted). "
                    "The symmetries are derived by tracing the network once; checkpoints "
                    "are processed in batches, vectorised over the checkpoint axis. OUT's "
                    "annotations say what was removed and what could not be. Every "
                    "checkpoint's SHA-256 is checked as it is read. OUT is built under a "
                    "temporary name and appears only when complete. Exit code 2 on bad "
                    "input (missing or corrupt IN, NaN weights not flagged diverged, OUT "
                    "already exists without --overwrite, OUT is IN); IN is never modified.")
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
    parser.add_argument("--batch-size", type=positive_int, default=None, metavar="B",
                        help="checkpoints per batch (default: as many as fit in 256 MB)")
    parser.add_argument("--no-softmax", action="store_true",
                        help="keep the output biases' softmax shift")
    parser.add_argument("--n-verify", type=nonnegative_int, default=0, metavar="N",
                        help="check that N random checkpoints compute the same logits "
                             "before and after (default: %(default)s)")
    parser.add_argument("--seed", type=nonnegative_int, default=0,
                        help="seed of --n-verify's choice (default: %(default)s)")
    add_overwrite_option(parser)
    add_no_verify_option(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run_canonicalize)

    report = subparsers.add_parser(
        "min-mass", help="minimum weight mass of every checkpoint (paper Fig. 2 data)",
        description="Solve the minimum scaled network mass problem for every checkpoint of "
                    "IN (nothing is written to IN) and print the mass before and after. With "
                    "--out DIR, write one CSV row per checkpoint (index, seed, mass before "
                    "and after, Newton iterations, dead units, and each weight tensor's "
                    "largest |w| before and after) and a JSON file beside it with the "
                    "command, versions, the input's SHA-256 and summary figures. Checkpoints "
                    "with non-finite weights (flagged diverged) get empty values.")
    report.add_argument("source", type=Path, metavar="IN", help="collection file (.h5)")
    report.add_argument("--solver", choices=["fast", "cvxpy"], default="fast",
                        help="batched Newton (fast) or the cvxpy reference "
                             "(default: %(default)s)")
    report.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write the per-checkpoint table DIR/min_mass.csv and its "
                             "provenance DIR/min_mass.json (command, versions, the input's "
                             "SHA-256, the table's SHA-256); the folder appears only when "
                             "both are complete and is refused if it exists unless "
                             "--overwrite")
    report.add_argument("--batch-size", type=positive_int, default=None, metavar="B",
                        help="checkpoints per batch (default: as many as fit in 256 MB)")
    add_overwrite_option(report)
    add_no_verify_option(report)
    report.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    report.set_defaults(func=run_min_mass)


def run_canonicalize(args: argparse.Namespace) -> int:
    from posteriorzoo.symmetry.collection import canonicalize_collection

    summary = canonicalize_collection(
        args.source, args.target, permutation=args.permutation, scaling=args.scaling,
        softmax=not args.no_softmax, solver=args.solver, n_verify=args.n_verify, seed=args.seed,
        batch_size=args.batch_size, verify=not args.no_verify, overwrite=args.overwrite,
        progress=not args.no_progress, command=args.command_line)
    verified = (f"; {len(summary.verified)} verified, largest logit change "
                f"{summary.largest_change:.2g}") if summary.verified else ""
    print(f"{summary.path}: {summary.checkpoints} canonical checkpoints "
          f"({summary.dead_units} dead units left unscaled){verified}")
    return 0


def run_min_mass(args: argparse.Namespace) -> int:
    import csv
    import hashlib
    import io
    import json

    import numpy as np

    from posteriorzoo.hashing import sha256_file
    from posteriorzoo.outputs import atomic_directory, check_output
    from posteriorzoo.provenance import library_versions
    from posteriorzoo.symmetry.collection import min_mass_collection
    from posteriorzoo.zoo import open_zoo

    if args.out is not None:
        check_output(args.out, inputs=[args.source], overwrite=args.overwrite)
    report = min_mass_collection(args.source, solver=args.solver, batch_size=args.batch_size,
                                 verify=not args.no_verify, progress=not args.no_progress)
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
    table = io.StringIO(newline="")
    writer = csv.writer(table)
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
    text = table.getvalue().encode("utf-8")
    provenance = {"command": args.command_line, "versions": library_versions(),
                  "input": {"path": str(args.source), "sha256": sha256_file(args.source)},
                  "solver": args.solver, "summary": summary, "table": "min_mass.csv",
                  "table_sha256": hashlib.sha256(text).hexdigest()}
    # Both files in one folder that appears when both are complete.
    with atomic_directory(args.out, overwrite=args.overwrite, inputs=[args.source]) as partial:
        (partial / "min_mass.csv").write_bytes(text)
        (partial / "min_mass.json").write_text(json.dumps(provenance, indent=2))
    print(f"wrote {args.out / 'min_mass.csv'} and {args.out / 'min_mass.json'}")
    return 0
