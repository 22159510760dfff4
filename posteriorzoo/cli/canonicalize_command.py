"""``posteriorzoo canonicalize`` and ``posteriorzoo min-mass``: weight-space symmetries of
whole collections."""

from __future__ import annotations

import argparse
from pathlib import Path

from posteriorzoo.cli._types import (
    add_device_option,
    add_json_option,
    add_no_verify_option,
    add_overwrite_option,
    integer_in,
    seed_option,
)
from posteriorzoo.vocabulary import MINMASS_SOLVERS, PERMUTATION_KEYS, SCALINGS, STORAGE_DTYPES

# The ranges of the numeric options (each is checked when the command line is parsed).
#: Checkpoints per batch: held in memory together, with their canonical forms.
PER_BATCH = integer_in(1, 1_000_000)
#: Checkpoints checked before and after: each is run on a batch of inputs twice (time).
VERIFY = integer_in(0, 1_000_000)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "canonicalize", help="remove permutation, scaling, sign and softmax symmetries",
        description="Write the canonical form of every checkpoint of IN to a new collection "
                    "OUT: scalings first (each scalable unit's incoming weights normalised, "
                    "layer by layer, or the minimum-mass scaling), then sign flips (units "
                    "behind odd activations such as tanh: incoming weights and bias summing "
                    "to a positive number), then the softmax shift (output biases sum to "
                    "zero), then permutations (hidden units sorted). Units an unsupported "
                    "operation (e.g. LayerNorm) leaves untouched are named in a warning on "
                    "stderr. "
                    "The symmetries are derived by tracing the network once; checkpoints "
                    "are processed in batches, vectorised over the checkpoint axis. OUT's "
                    "annotations say what was removed and what could not be. Every "
                    "checkpoint's SHA-256 is checked as it is read. OUT is built under a "
                    "temporary name and appears only when complete. Exit code 2 on bad "
                    "input (missing or corrupt IN, NaN weights not flagged diverged, finite "
                    "weights whose canonical form overflows the stored dtype, OUT already "
                    "exists without --overwrite, OUT is IN); IN is never modified.")
    parser.add_argument("source", type=Path, metavar="IN", help="collection file (.h5)")
    parser.add_argument("--out", dest="target", type=Path, required=True, metavar="OUT",
                        help="new collection file (.h5)")
    parser.add_argument("--permutation", choices=PERMUTATION_KEYS, default="first",
                        help="sort key: first incoming weight (the paper's default), largest "
                             "incoming weight, or no sorting (default: %(default)s)")
    parser.add_argument("--scaling", choices=SCALINGS,
                        default="norm",
                        help="unit L2 norm or unit standard deviation of each unit's incoming "
                             "weights; minmass: norm, then the scaling of least total squared "
                             "weight (BatchNorm weights count; the scales a BatchNorm absorbs "
                             "keep their norm value); or none (default: %(default)s)")
    parser.add_argument("--solver", choices=MINMASS_SOLVERS, default="fast",
                        help="min-mass solver: batched Newton (fast) or the cvxpy reference, "
                             "one checkpoint at a time (default: %(default)s)")
    parser.add_argument("--checkpoints-per-batch", type=PER_BATCH, default=None, metavar="B",
                        help=f"checkpoints per batch, {PER_BATCH.range_text} (held in memory "
                             "together) (default: as many as fit in 256 MB)")
    parser.add_argument("--no-softmax", action="store_true",
                        help="keep the output biases' softmax shift")
    parser.add_argument("--no-signs", action="store_true",
                        help="keep the sign flips of odd activations")
    parser.add_argument("--n-verify", type=VERIFY, default=0, metavar="N",
                        help=f"check that N random checkpoints compute the same logits "
                             f"before and after, {VERIFY.range_text} (time) "
                             "(default: %(default)s)")
    parser.add_argument("--dtype", choices=STORAGE_DTYPES, default=None,
                        help="store the canonical floating tensors in this dtype (default: "
                             "the source's). The canonical form is computed in float32 "
                             "(float64 if stored or asked for) either way; float16 "
                             "storage (the release's, half the disk) rounds it by 4.9e-4 "
                             "relative, which --n-verify reports")
    add_device_option(parser, "where the batches are canonicalized (the min-mass solver "
                              "runs on cpu)")
    seed_option(parser, "seed of every random choice of the command: here, which checkpoints "
                        "--n-verify checks")
    add_overwrite_option(parser)
    add_no_verify_option(parser)
    add_json_option(parser, "the result (counts, annotations, provenance) as JSON")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run_canonicalize)

    report = subparsers.add_parser(
        "min-mass", help="minimum weight mass of every checkpoint (paper Fig. 2 data)",
        description="Solve the minimum scaled network mass problem for every checkpoint of "
                    "IN (nothing is written to IN) and print the mass before and after. With "
                    "--out DIR, write one CSV row per checkpoint (index, seed, mass before "
                    "and after, Newton iterations, dead units, and each weight tensor's "
                    "largest |w| before and after) and min_mass.json beside it with the "
                    "summary figures and the provenance (command, versions, git commit, the "
                    "input's SHA-256). Checkpoints with non-finite weights (flagged "
                    "diverged) get empty values.")
    report.add_argument("source", type=Path, metavar="IN", help="collection file (.h5)")
    report.add_argument("--solver", choices=MINMASS_SOLVERS, default="fast",
                        help="batched Newton (fast) or the cvxpy reference "
                             "(default: %(default)s)")
    report.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write the per-checkpoint table DIR/min_mass.csv and "
                             "DIR/min_mass.json (summary, provenance); the folder appears "
                             "only when both are complete and is refused if it exists "
                             "unless --overwrite")
    report.add_argument("--checkpoints-per-batch", type=PER_BATCH, default=None, metavar="B",
                        help=f"checkpoints per batch, {PER_BATCH.range_text} (held in memory "
                             "together) (default: as many as fit in 256 MB)")
    add_overwrite_option(report)
    add_no_verify_option(report)
    add_json_option(report, "the summary and provenance as JSON")
    report.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    report.set_defaults(func=run_min_mass)


def run_canonicalize(args: argparse.Namespace) -> int:
    import torch

    from posteriorzoo.collection import canonicalize

    result = canonicalize(
        args.source, args.target, permutation=args.permutation, scaling=args.scaling,
        softmax=not args.no_softmax, signs=not args.no_signs, solver=args.solver,
        n_verify=args.n_verify, seed=args.seed,
        dtype=None if args.dtype is None else getattr(torch, args.dtype),
        checkpoints_per_batch=args.checkpoints_per_batch, verify=not args.no_verify,
        overwrite=args.overwrite,
        progress=not args.no_progress, command=args.command_line, device=args.device)
    if args.json:
        print(result.to_json(), end="")
        return 0
    verified = (f"; {len(result.verified)} verified, largest logit change "
                f"{result.largest_change:.2g} as stored ({result.exact_change:.1g} as "
                "computed)") if result.verified else ""
    print(f"{result.path}: {result.checkpoints} canonical checkpoints "
          f"({result.dead_units} dead units left unscaled){verified}")
    return 0


def run_min_mass(args: argparse.Namespace) -> int:
    from posteriorzoo.collection import min_mass
    from posteriorzoo.outputs import check_output

    if args.out is not None:
        check_output(args.out, inputs=[args.source], overwrite=args.overwrite,
                     directory=True)
    result = min_mass(args.source, solver=args.solver,
                      checkpoints_per_batch=args.checkpoints_per_batch,
                      verify=not args.no_verify, progress=not args.no_progress,
                      command=args.command_line)
    written = (result.write(args.out, overwrite=args.overwrite)
               if args.out is not None else {})
    if args.json:
        print(result.to_json(), end="")
        return 0
    summary = result.summary()
    print(f"{args.source}: {summary['solved']} of {summary['checkpoints']} checkpoints; "
          f"median mass {summary['mass_before_median']:.6g} -> "
          f"{summary['mass_after_median']:.6g} (median ratio {summary['mass_ratio_median']:.4f})"
          f"; {summary['dead_units']} dead units left at scale 1")
    for path in written.values():
        print(f"wrote {path}")
    return 0
