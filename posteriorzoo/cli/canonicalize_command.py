"""``posteriorzoo canonicalize``: remove weight-space symmetries from a whole collection."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "canonicalize", help="remove permutation, scaling and softmax symmetries",
        description="Write the canonical form of every checkpoint of IN to a new collection "
                    "OUT: scalings first (each scalable unit's incoming weights normalised, "
                    "layer by layer), then the softmax shift (output biases sum to zero), "
                    "then permutations (hidden units sorted). The symmetries are derived by "
                    "tracing the network; OUT's annotations say what was removed and what "
                    "could not be.")
    parser.add_argument("source", type=Path, metavar="IN", help="collection file (.h5)")
    parser.add_argument("target", type=Path, metavar="OUT", help="new collection file (.h5)")
    parser.add_argument("--permutation", choices=["first", "max", "none"], default="first",
                        help="sort key: first incoming weight (the paper's default), largest "
                             "incoming weight, or no sorting (default: %(default)s)")
    parser.add_argument("--scaling", choices=["norm", "std", "none"], default="norm",
                        help="unit L2 norm or unit standard deviation of each unit's incoming "
                             "weights, or none (default: %(default)s)")
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
        softmax=not args.no_softmax, verify=args.verify, seed=args.seed,
        progress=not args.no_progress, command=args.command_line)
    verified = (f"; {len(summary.verified)} verified, largest logit change "
                f"{summary.largest_change:.2g}") if summary.verified else ""
    print(f"{summary.path}: {summary.checkpoints} canonical checkpoints "
          f"({summary.dead_units} dead units left unscaled){verified}")
    return 0
