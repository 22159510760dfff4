"""``posteriorzoo reorder``: a collection's rows in mode order (row i holds mode i)."""

from __future__ import annotations

import argparse
from pathlib import Path

from posteriorzoo.cli._types import add_json_option, add_rewrite_options, check_rewrite_options


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``reorder`` subcommand."""
    parser = subparsers.add_parser(
        "reorder", help="put a collection's rows in mode order (row i holds mode i)",
        description="Write IN with its rows in mode order: ascending mode_id, each mode's "
                    "samples in ascending sample_id (rows without a mode_id keep their "
                    "places), so row i holds mode i's samples as the trainer writes them "
                    "now. Collections trained by earlier versions with several workers "
                    "may hold modes in the order they finished (posteriorzoo verify says "
                    "so). Only the order changes: every checkpoint keeps its tensors, "
                    "metadata row and digests, the file its attributes, training records, "
                    "chunking and schema. The copy is built under a temporary name, every "
                    "checkpoint is checked against its digests, and only then is it put in "
                    "place. With --out, IN is never modified; --in-place replaces IN by its "
                    "reordered copy (update a SHA256SUMS that lists it). Exit code 2 on bad "
                    "input (missing or damaged IN, a writer appending to IN, OUT exists "
                    "without --overwrite, OUT is IN).")
    parser.add_argument("source", type=Path, metavar="IN", help="collection file (.h5)")
    add_rewrite_options(parser, "replace IN by its reordered copy (nothing is written when its "
                            "rows are already in order)")
    add_json_option(parser, "the result (rows moved, provenance) as JSON")
    parser.set_defaults(func=run_reorder)


def run_reorder(args: argparse.Namespace) -> int:
    """Reorder, then say what moved."""
    from posteriorzoo.zoo import reorder_collection

    check_rewrite_options(args)
    result = reorder_collection(args.source, args.target, overwrite=args.overwrite,
                                in_place=args.in_place, command=args.command_line)
    if args.json:
        print(result.to_json(), end="")
    else:
        print(result.summary())
    return 0
