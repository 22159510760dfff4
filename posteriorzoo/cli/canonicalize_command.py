"""``posteriorzoo canonicalize``: remove weight-space symmetries from a whole collection."""

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
