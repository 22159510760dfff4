"""``posteriorzoo annotate``: set a collection's posterior group from a measurement."""

from __future__ import annotations

import argparse
from pathlib import Path

from posteriorzoo.cli._types import add_json_option, add_rewrite_options, check_rewrite_options
from posteriorzoo.vocabulary import POSTERIOR_GROUPS


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``annotate`` subcommand."""
    parser = subparsers.add_parser(
        "annotate", help="set a collection's posterior group (single-mode or multi-mode) "
                         "from a measurement",
        description="Write IN with its posterior group set to --posterior and the reason "
                    "recorded: the report groups Table 1 by it. The trainer sets the group "
                    "from the spec; where only the trained samples can tell (SVGD's "
                    "particles, trained as one mode, may end in many modes), measure them "
                    "and record the result here. The file's annotations gain 'posterior' "
                    "and 'posterior_set' (the group before, the reason, and the provenance: "
                    "command, versions, IN's SHA-256); nothing else changes (checkpoints, "
                    "metadata, training records, digests, chunking, schema). IN's digests "
                    "are checked first; the copy is built under a temporary name and only "
                    "then put in place. With --out, IN is never modified; --in-place "
                    "replaces IN by its annotated copy (update a SHA256SUMS that lists it). "
                    "A collection of one independently trained network per mode (DE) is "
                    "refused: its group is fixed by the method. Exit code 2 on bad input "
                    "(missing or damaged IN, a bad group or reason, a writer appending to "
                    "IN, OUT exists without --overwrite, OUT is IN).")
    parser.add_argument("source", type=Path, metavar="IN", help="collection file (.h5)")
    parser.add_argument("--posterior", required=True, choices=POSTERIOR_GROUPS,
                        help="the group the measurement puts the samples in")
    parser.add_argument("--reason", required=True, metavar="TEXT",
                        help="one printable line: what measurement decided it, e.g. 'loss "
                             "barriers: 87 of 100 particles in distinct modes'")
    add_rewrite_options(parser, "replace IN by its annotated copy")
    add_json_option(parser, "the result (group before and now, reason, provenance) as JSON")
    parser.set_defaults(func=run_annotate)


def run_annotate(args: argparse.Namespace) -> int:
    """Annotate, then say what changed."""
    from posteriorzoo.zoo import annotate_collection

    check_rewrite_options(args)
    result = annotate_collection(args.source, args.target, posterior=args.posterior,
                                 reason=args.reason, in_place=args.in_place,
                                 overwrite=args.overwrite, command=args.command_line)
    if args.json:
        print(result.to_json(), end="")
    else:
        print(result.summary())
    return 0
