"""``posteriorzoo overhead``: the parameters EMP/ECMP, Rank-1 and mean-field BBB add."""

from __future__ import annotations

import argparse
import json

from posteriorzoo.cli._types import add_json_option, integer_in

# The bounds of posteriorzoo.overhead (MAX_COMPONENTS), restated so that --help imports no
# torch; tests/test_overhead.py checks they agree.
EMP_COMPONENTS = integer_in(2, 1_000)
RANK1_COMPONENTS = integer_in(1, 1_000)
NUM_CLASSES = integer_in(1, 100_000)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "overhead", help="parameters that EMP/ECMP, Rank-1 BNNs and mean-field BBB add to "
                         "the registered networks",
        description="Count, on each network (built on the meta device: nothing allocated), "
                    "the parameters a method adds. EMP/ECMP (Ensemble Model Patching) keeps "
                    "K copies of the patch layers and adds (K - 1) x their parameters: bn = "
                    "the BatchNorm gamma/beta, bn+out = BN and the output layer, in+out = "
                    "the input and output layers (the first and last Conv/Linear; for "
                    "networks without BN). Rank-1 BNNs add, for every Conv/Linear layer, "
                    "vectors r (out) and s (in) per mixture component with a mean and a "
                    "scale each: 2 x K x sum(in + out). Mean-field BBB adds a rho for every "
                    "Conv/Linear weight and bias (BatchNorm stays a point estimate, as in "
                    "posteriorzoo's BBB). --seeds recomputes the figures the EMP and Rank-1 "
                    "papers print and says, where one differs, what it would take.")
    parser.add_argument("architectures", nargs="*", metavar="ARCHITECTURE",
                        help="registered architectures, with their default options "
                             "(default: every registered one, unless --seeds is given)")
    parser.add_argument("--num-classes", type=NUM_CLASSES,
                        help=f"outputs of the networks that take a class count, "
                             f"{NUM_CLASSES.range_text} (as a zoo spec's num_classes) "
                             "(default: each architecture's own)")
    parser.add_argument("--emp-components", type=EMP_COMPONENTS, default=5,
                        help=f"EMP/ECMP copies K, {EMP_COMPONENTS.range_text} (an ensemble "
                             "needs 2; more than 1,000 is no parameter-efficient method) "
                             "(default: %(default)s, as the EMP paper)")
    parser.add_argument("--rank1-components", type=RANK1_COMPONENTS, default=4,
                        help=f"Rank-1 mixture components K, {RANK1_COMPONENTS.range_text} "
                             "(more than 1,000 is no parameter-efficient method) "
                             "(default: %(default)s, as the Rank-1 paper)")
    parser.add_argument("--seeds", action="store_true",
                        help="also the papers' figures (at their K: 5 for EMP, 4 for "
                             "Rank-1), recomputed and compared at the precision they are "
                             "printed with (without ARCHITECTURE: only these)")
    add_json_option(parser, "one JSON object: the architectures' tables and the seed "
                            "figures")
    parser.set_defaults(func=run)


def _print_architecture(data: dict) -> None:
    classes = "" if data["num_classes"] is None else f", {data['num_classes']:,} classes"
    print(f"{data['architecture']}{classes}: {data['parameters']:,} parameters")
    for method in data["methods"]:
        added = f"+{method['added']:,}"
        percent = f"+{method['percent']:.4g}%"
        print(f"  {method['label']:<22} {added:>13} {percent:>10}  total {method['total']:>13,}")
        print(f"  {'':<22} {method['counted']}")
    for line in data["skipped"]:
        print(f"  skipped: {line}")


def _print_seeds(figures: list[dict]) -> None:
    matched = sum(figure["matches"] for figure in figures)
    print(f"The papers' figures, recomputed: {matched} of {len(figures)} match as printed")
    for figure in figures:
        verdict = "matches" if figure["matches"] else "DIFFERS"
        print(f"  {verdict:<7} printed {figure['printed']:>10}  computed "
              f"{figure['computed']:>10}  {figure['source']}: {figure['claim']} "
              f"[{figure['architecture']}]")
        print(f"          {figure['note']}")


def run(args: argparse.Namespace) -> int:
    from posteriorzoo.overhead import overhead_report

    names = args.architectures or (None if not args.seeds else [])
    report = overhead_report(names, args.num_classes, emp_components=args.emp_components,
                             rank1_components=args.rank1_components, seeds=args.seeds)
    data = report.to_dict()
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    if data["architectures"]:
        print(f"EMP/ECMP K = {data['emp_components']}, Rank-1 K = "
              f"{data['rank1_components']}: parameters added, overhead, total")
    for architecture in data["architectures"]:
        print()
        _print_architecture(architecture)
    if data["seed_figures"]:
        if data["architectures"]:
            print()
        _print_seeds(data["seed_figures"])
    return 0
