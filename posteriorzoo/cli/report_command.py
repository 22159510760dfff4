"""``posteriorzoo report``: the benchmark report (Table 1, noise floor, figures)."""

from __future__ import annotations

import argparse
from pathlib import Path

from posteriorzoo.cli._types import (
    add_device_option,
    add_json_option,
    add_overwrite_option,
    integer_in,
    named_paths,
    seed_option,
)
from posteriorzoo.vocabulary import DISTANCE_PRECISIONS, OOD_SCORES

# The ranges of the numeric options (each is checked when the command line is parsed;
# bins, splits and pairs as analysis.report.build's MAX_BINS, MAX_SPLITS, MAX_PAIRS).
#: ECE bins: with more bins than test images (10,000 in every test set here) most are empty.
BINS = integer_in(1, 10_000)
#: Images per dataset: the members' predictions on N images are held in memory.
IMAGES = integer_in(1, 10_000_000)
#: Noise-floor splits: each is one more MMD on every layer (time).
SPLITS = integer_in(1, 1_000)
#: Collapse pairs: each pair's mutual information is computed on every image (time).
PAIRS = integer_in(0, 100_000)

_DESCRIPTION = """\
Write the benchmark report of METHOD collections against the TARGET collection into the
folder --out: one self-contained HTML page (report.html, figures embedded), the same as
Markdown (report.md), CSV tables (table1.csv, table2.csv, noise_floor.csv), every number
with its provenance (report.json: command, versions, git commit, seeds, input SHA-256s),
and the figures as PNG and PDF (figures/).

Table 1 (the paper's): per method, MMD and NS-MMD to the target (layer-weighted median
of the unbiased MMD^2 over MMDAgg's 20 kernels, x 100; NS: symmetries removed by
canonicalization), and the predictive metrics of the method's posterior predictive
(average softmax of its checkpoints) on --id-data: accuracy, ECE (--bins), Brier, and on
--ood-data AUPR and FPR95 (OOD is the positive class, --ood-score), IDMI and OODMI
(mutual information, nats). Rows are grouped single-mode / multi-mode (DE with the
multi-mode methods, as in the paper). The Table 2 detail gives the median, mean and max
over kernels and n.

The noise floor is the same MMD between disjoint draws of the target: its two halves,
and --splits random splits into n held-out checkpoints (the methods' n) and the rest,
whose 5th-95th percentile band tells a method's MMD from another draw of the target.
--test adds the MMDAgg test's decision per layer.

Figures: layer marginals raw and canonical with KS p-values between units (Fig. 9), mass
before and after min-mass (Fig. 2), functional collapse: pairwise MI in and out of
distribution (Figs. 3 and 7, for --collapse), MMD per layer with the noise band, and the
PCA explained-variance curve.

Function space (the NeurIPS 2021 approximate-inference competition's metrics): Agree, the
share of test images where a method's predictive and the target's pick the same class, and
TV, their total variation (half the L1 distance, mean over images), with the band of
held-out target checkpoints against the rest.

A gold standard: a method collection that samples the recipe's posterior exactly
(full-batch HMC, `posteriorzoo train` method hmc) is taken as the reference, or the one
--reference names. Its row is grouped "reference"; Table 1 gains MMD and NS-MMD to its
samples and Agree and TV with its predictive for every method and the target, and a
section answers how far the target is from it (weights and function, with the noise
bands), which method is closest, whether the paper's ordering survives, and whether the
symmetries explain the gap. --reference-predictive FILE takes the gold standard's
predictive from elsewhere instead (an N x C probability file, the competition's
probs.csv layout: one row per test image in order, comma- or space-separated, no header):
Agree and TV only.

--no-predictions leaves the predictive metrics out (a weights-only report). The target's
weights are streamed from its file, never held in memory (memory: a block of features and
the (m, m) distance matrices of one layer).

Collections trained on another dataset than the target's are refused unless
--allow-mixed. Nothing is written unless the whole report succeeds.
"""

_EPILOG = """\
examples:
  posteriorzoo report target.h5 de.h5 swag.h5 laplace.h5 --ood-data digits --out report
  posteriorzoo report target.h5 SWAG=runs/swag.h5 --id-data fashion-mnist --test --out r
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="the benchmark report: Table 1, noise floor and figures (HTML)",
        description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path, metavar="TARGET",
                        help="target collection (.h5), e.g. 1000 independent checkpoints")
    parser.add_argument("methods", nargs="+", metavar="METHOD",
                        help="method collections (.h5); NAME=PATH names one (default: the "
                             "method and its posterior, e.g. SWAG, MM-SWAG)")
    parser.add_argument("--id-data", metavar="NAME", default=None,
                        help="in-distribution dataset (default: the target's)")
    parser.add_argument("--ood-data", metavar="NAME", default=None,
                        help="out-of-distribution dataset with the same image shape, e.g. "
                             "digits or mnist for Fashion-MNIST (default: none: no AUPR, "
                             "FPR95, OODMI)")
    parser.add_argument("--out", type=Path, default=Path("report"),
                        help="output folder, built under a temporary name and renamed into "
                             "place when complete; refused if it exists unless --overwrite "
                             "(default: %(default)s)")
    add_overwrite_option(parser)
    parser.add_argument("--allow-mixed", action="store_true",
                        help="compare collections trained on another dataset than the "
                             "target's (default: refuse)")
    parser.add_argument("--test", action="store_true",
                        help="also run the MMDAgg test on every layer (slower)")
    parser.add_argument("--bins", type=BINS, default=15,
                        help=f"ECE bins, {BINS.range_text} (with more bins than test images "
                             "most are empty) (default: %(default)s)")
    parser.add_argument("--ood-score", choices=OOD_SCORES,
                        default="max-probability",
                        help="what ranks images as OOD for AUPR and FPR95 (default: "
                             "%(default)s)")
    parser.add_argument("--n-images", type=IMAGES, default=None, metavar="N",
                        help=f"use only the first N images of each dataset, "
                             f"{IMAGES.range_text} (memory: every member's predictions on "
                             "them are held) (default: all)")
    parser.add_argument("--splits", type=SPLITS, default=50,
                        help=f"random splits of the target for the noise floor, "
                             f"{SPLITS.range_text} (time: each is one more MMD on every "
                             "layer) (default: %(default)s)")
    parser.add_argument("--n-pairs", type=PAIRS, default=300, metavar="P",
                        help=f"member pairs of the collapse figure, {PAIRS.range_text} (time: "
                             "each pair's mutual information is computed on every image) "
                             "(default: %(default)s)")
    parser.add_argument("--collapse", metavar="NAME", default=None,
                        help="the method of the collapse figure (default: DE if present)")
    parser.add_argument("--reference", metavar="NAME", default=None,
                        help="the method collection that is the gold standard (default: the "
                             "one whose method samples the posterior exactly, HMC, if any)")
    parser.add_argument("--reference-predictive", type=Path, metavar="FILE", default=None,
                        help="a gold-standard predictive from elsewhere: N x C probabilities "
                             "on the --id-data test split (probs.csv layout); checked: "
                             "shape, rows summing to 1, the same split")
    parser.add_argument("--no-figures", action="store_true", help="tables only")
    parser.add_argument("--no-predictions", action="store_true",
                        help="a weights-only report: MMD, NS-MMD, noise floor, diagnostics "
                             "and the weight figures, without the predictive metrics (reads "
                             "no data set, runs no network: for when the data set or a GPU "
                             "is missing)")
    parser.add_argument("--precision", choices=DISTANCE_PRECISIONS, default=None,
                        help="the distances' arithmetic (as mmd --precision; fast: the "
                             "ResNet-scale path) (default: exact on cpu, fast on cuda)")
    add_device_option(parser, "where the members' predictions, the canonical copies and "
                              "the fast distances run")
    seed_option(parser, "seed of every random choice of the command: the noise floor's "
                        "splits, the pairs, the test")
    add_json_option(parser, "the report's JSON instead of Table 1")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from analysis.report import build_report
    from analysis.report.page import table1_text
    from posteriorzoo.outputs import atomic_directory

    methods = named_paths(args.methods)
    inputs = [args.target, *(path for _, path in methods),
              *([args.reference_predictive] if args.reference_predictive else [])]
    with atomic_directory(args.out, overwrite=args.overwrite, inputs=inputs) as partial:
        report = build_report(
            args.target, methods, id_data=args.id_data, ood_data=args.ood_data,
            allow_mixed=args.allow_mixed, test=args.test, bins=args.bins,
            ood_score=args.ood_score, n_images=args.n_images, splits=args.splits,
            n_pairs=args.n_pairs, collapse=args.collapse, seed=args.seed,
            figures=not args.no_figures, workdir=partial, progress=not args.no_progress,
            command=args.command_line, predictions=not args.no_predictions,
            device=args.device, precision=args.precision, reference=args.reference,
            reference_predictive=args.reference_predictive)
        report.write_into(partial)
    if args.json:
        print(report.to_json(), end="")
        return 0
    print(table1_text(report))
    print(f"\nreport: {args.out / 'report.html'}")
    return 0
