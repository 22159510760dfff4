"""``posteriorzoo study``: studies that train their own networks (paper Fig. 1 and Fig. 4,
and BYOV, seed 004)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from posteriorzoo.cli._types import (
    add_json_option,
    add_overwrite_option,
    integer_in,
    number_in,
    seed_option,
)
from posteriorzoo.vocabulary import ENGINES, SCALINGS, SORT_KEYS

# The ranges of the numeric options, checked when the command line is parsed; the same
# as the library's (analysis.studies.toy and .permutation_stability, which also check
# what depends on the data before any training).
NETWORKS = integer_in(1, 100_000)            # toy.MAX_NETWORKS
POINTS = integer_in(1, 10_000)               # toy.MAX_POINTS_PER_CLASS
NORM = number_in(1e-3, 1e3)                  # toy.NORM_RANGE
RUNS = integer_in(1, 100)                    # permutation_stability.MAX_RUNS
EPOCHS = integer_in(1, 1_000)                # permutation_stability.MAX_EPOCHS
EVERY = integer_in(1, 100_000)               # permutation_stability.MAX_EVERY
TRAIN_IMAGES = integer_in(2, 60_000)         # byov.MAX_TRAIN_IMAGES
TEST_IMAGES = integer_in(1, 10_000)          # byov.MAX_TEST_IMAGES
BYOV_EPOCHS = integer_in(1, 1_000)           # byov.MAX_EPOCHS
BATCH = integer_in(2, 4_096)                 # byov.MAX_BATCH
SAMPLES = integer_in(1, 1_000)               # byov.MAX_SAMPLES
NOISE = number_in(0, 1, open_low=True)       # byov: noise_std in (0, 1]
# The permutation-stability study's named choices, from the vocabulary: the sort keys
# (permutation_stability.SORT_KEYS), the scalings it is run with (minmass is not offered),
# and the engines that run its per-step callback (run_permutation_stability refuses
# "vectorised").
STABILITY_SCALINGS = tuple(scaling for scaling in SCALINGS if scaling != "minmass")
STABILITY_ENGINES = tuple(engine for engine in ENGINES if engine != "vectorised")
# train_zoo.byov.PRIORS, analysis.studies.byov.DATASETS, DEFAULTS and QUICK (not imported:
# --help loads no torch).
BYOV_PRIORS = ("standard", "teacher", "teacher-variance")
BYOV_DATASETS = ("auto", "fashion-mnist", "mnist", "digits")
BYOV_DEFAULTS = {"train_images": 10_000, "test_images": 5_000, "epochs": 6,
                 "batch_size": 128, "samples": 16}
BYOV_QUICK = {"train_images": 512, "test_images": 256, "epochs": 1, "batch_size": 64,
              "samples": 2}

_DESCRIPTION = """\
Studies that need their own training runs, each written with its figure into a new
folder --out (built under a temporary name and renamed into place when complete; refused
if it exists unless --overwrite): a JSON with every reported number and the provenance
(command, versions, git commit, seeds, options), CSV tables of the data behind the figure
(pandas reads them as they are) and the figure as PNG and PDF.

  toy                     paper Fig. 1: 10,000 2-2-1 ReLU perceptrons, their output weights
                          raw, rescaled and sorted (about 10 s)
  permutation-stability   paper Fig. 4: Kendall's tau between successive sorting
                          permutations during training (about 3 minutes)
  byov                    seed 004: BYOL with a Bayes-by-Backprop student under three
                          priors against deterministic BYOL: linear-probe accuracy, ECE
                          and Brier with and without input noise, SNR vs magnitude
                          pruning (about 7 minutes; --quick: seconds)
"""

_TOY_DESCRIPTION = """\
The toy example of the paper's Fig. 1 (appendix A). Two classes of --points points each
(default 200) drawn from normal distributions with identity covariance and means
(-2, -2) and (2, 2), fully separable (a point on the wrong side of x1 + x2 = 0 is drawn
again). --networks perceptrons Linear(2, 2) -> ReLU -> Linear(2, 1) are trained at once
(stacked parameters, batched products) with SGD (lr 2, batches of 10, 10 epochs, a new
random order per network and epoch) on the binary cross-entropy, from PyTorch's default
initialisation. Networks whose mean mini-batch loss over the last epoch exceeds 0.01 are
dropped (the paper: fewer than 1%).

The figure shows the density (networks per hexagon) of the two output weights (w1, w2),
unitless, in the window [-4, 4]^2, in three panels: raw; after removing the ReLU scaling
symmetry (every hidden unit's incoming weights, bias excluded, rescaled to L2 norm --norm,
3 in the paper, the output weight divided by the same factor); after also removing the
permutation symmetry (hidden units ordered by output weight, so w1 <= w2). The
transformations are applied with the canonicalizer (posteriorzoo.symmetry) and checked:
every network computes the same outputs on the training points.

Writes into --out: study-toy.json, toy_output_weights.csv (one row per network: kept,
last-epoch loss, raw / rescaled / sorted w1 and w2), toy_data.csv (the training points),
toy_output_weights.png and .pdf. Every random choice derives from --seed. Runtime: about
10 s for 10,000 networks on one CPU core.
"""

_PERMUTATION_DESCRIPTION = """\
Permutation stability during training (the paper's section 5.2 and Fig. 4). --runs
OptuNets (392 parameters) are trained with the mass trainer on --dataset with the paper's
OptuNet recipe (SGD lr 0.04, batch 64, weight decay 2e-4, random crop; the learning rate
halved at 1/4 and 1/2 of the epochs: at epochs 15 and 30 of the paper's 60); run i
uses the seeds of mode i of a collection with base seed --seed. A trainer callback keeps
the weights after every --every SGD steps; for each snapshot the canonicalizer gives the
sorting permutation of every permuted layer (conv1: 2 channels, conv2: 10 channels): the
units' scales normalised first, then units sorted by --key ('max': largest incoming
weight, the paper's statistic for this figure; 'first': first incoming weight). Kendall's
tau (scipy.stats.kendalltau) between the positions two successive permutations give the
units is 1 when the order did not change and -1 when it reversed (unitless). When the two
conv1 channels swap, conv2's groups move with them, so conv2's tau drops too.

The figure shows, per layer, tau against the epoch, in 400 bins of consecutive snapshots:
the mean over runs and the bin's steps, with a band from the minimum to the maximum;
dotted lines mark the learning-rate drops. The JSON adds, per layer and learning-rate
phase, the fraction of steps whose permutation changed and the mean tau.

Writes into --out: study-permutation-stability.json, tau_by_step.csv (one row per
snapshot: step, epoch, then tau of every layer and run), tau_binned.csv (what the figure
plots: per layer and bin of snapshots, the mean, minimum and maximum of tau and the
fraction of changed permutations), permutation_stability.png and .pdf.

Runtime: the default (the paper's 60 epochs, 5 runs, Fashion-MNIST, every step; the numba
fast engine) takes about 3 minutes on 2 CPU cores; --epochs 20 about 1 minute. --dataset
auto uses Fashion-MNIST when its files are on this machine (no download; the paper used
MNIST), else scikit-learn's digits (1347 training images: seconds).
"""

_BYOV_DESCRIPTION = """\
Bootstrap Your Own Variance (seed 004) at the size of one CPU core. Four students are
trained for the same budget from the same initial means on the same batches: BYOV (BYOL
whose student, encoder + projector + predictor, has a mean-field Gaussian posterior
trained by Bayes by Backprop, one weight draw per batch; the teacher is the EMA of the
student's means) under each of --priors, and deterministic BYOL. The loss is the
symmetrised BYOL loss plus beta x KL(q || prior) / N (N training images), beta rising
from 0 to 1 along a single-cycle cosine; variances exp(log-variance), initialised at
-10; means trunc-normal with std 0.02; Adam, no weight decay. Priors:
  standard          N(0, I)
  teacher           N(mu_T, I): the teacher's weights as prior means
  teacher-variance  N(mu_T, Sigma_T): Sigma_T the variance of the student's means over
                    the EMA window (EMA of mu^2 minus mu_T^2), floored at exp(-10)
The encoder is the registered small-cnn (three 3x3 conv blocks with GroupNorm, 23,408
parameters, a 64-feature representation); the data a seeded subset of --train-images
training images (Fashion-MNIST with --dataset auto when its files are here), augmented
by random crops (zero padding 4), horizontal flips and Gaussian pixel noise (std 0.1).

Evaluation on a seeded subset of --test-images test images: a linear probe (logistic
regression, L-BFGS, fitted on the posterior-mean encoder's features of the training
subset) scored clean and with Gaussian input noise of std --noise-std (pixel units on
the [0, 1] scale): accuracy, ECE (15 equal-width bins) and Brier score, for BYOV with
the posterior-mean encoder and with the probe's probabilities averaged over --samples
posterior draws; pruning without retraining: in each conv layer, keep the weights with
the largest SNR |mu|/sigma or the largest magnitude |mu| at sparsities 0.25, 0.5,
0.75, 0.9, 0.95 and score the probe on the clean test subset. For a posterior draw or a
pruned encoder the probe's feature standardisation is recomputed on 2,000 training
images (its weights kept; --no-recalibration keeps the fitted encoder's): a draw shifts
every feature's mean and scale, which a fixed standardisation turns into wrong logits.

Writes into --out: study-byov.json (every number, the training histories, provenance),
byov_probe.csv (model, prior, inference mean|mc|point, input clean|noisy, accuracy, ece,
brier, nll), byov_pruning.csv (model, criterion snr|magnitude, sparsity, achieved
sparsity, accuracy, ece, brier), byov_training.csv (per model and epoch: BYOL loss, KL
in nats, beta, tau, per conv layer the mean and largest sigma and SNR), byov.png and
.pdf, and the encoders as zoo collections (architecture small-cnn): byov-<prior>.h5
(--samples posterior draws each, with their seeds and probe accuracies) and byol.h5.
Every random choice derives from --seed.

Runtime: the default (10,000 training and 5,000 test images, 6 epochs of batches of
128, 16 draws) about 7 minutes on one CPU core; --quick (512 and 256 images, 1 epoch of
batches of 64, 2 draws) about 15 seconds. Options given with --quick override its sizes.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "study", help="studies with their own training runs: the toy example (Fig. 1), "
                      "permutation stability (Fig. 4), BYOV (seed 004)",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    studies = parser.add_subparsers(dest="study", metavar="STUDY", required=True)

    toy = studies.add_parser(
        "toy", help="paper Fig. 1: output weights of 10,000 toy perceptrons, raw, "
                    "rescaled and sorted", description=_TOY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  posteriorzoo study toy --out toy-study")
    toy.add_argument("--networks", type=NETWORKS, default=10_000,
                     help=f"networks trained, {NETWORKS.range_text} (time; and networks x "
                          "points at most 20,000,000: each epoch draws a data order of "
                          "every point for every network, 0.5 GB at that product) "
                          "(default: %(default)s)")
    toy.add_argument("--norm", type=NORM, default=3.0,
                     help=f"incoming L2 norm of every hidden unit after the scaling "
                          f"symmetry is removed, in {NORM.range_text} (three decades either "
                          "side of the paper's 3: far outside, the rescaled weights leave "
                          "the figure and the outputs overflow) (default: %(default)s, the "
                          "paper's)")
    toy.add_argument("--points", type=POINTS, default=200,
                     help=f"training points per class, {POINTS.range_text} (time, and see "
                          "--networks) (default: %(default)s)")
    _common_options(toy, "toy-study")
    toy.set_defaults(func=run_toy)

    stability = studies.add_parser(
        "permutation-stability", help="paper Fig. 4: Kendall's tau between successive "
                                      "sorting permutations during training",
        description=_PERMUTATION_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  posteriorzoo study permutation-stability --out stability\n"
               "  posteriorzoo study permutation-stability --epochs 60 --runs 10 "
               "--out stability-60")
    stability.add_argument("--runs", type=RUNS, default=5,
                           help=f"independent training runs, {RUNS.range_text} (time: about "
                                "40 s each at the defaults) (default: %(default)s)")
    stability.add_argument("--epochs", type=EPOCHS, default=60,
                           help=f"epochs per run, {EPOCHS.range_text} (time, and the "
                                "snapshots a run keeps); the learning-rate milestones (15 "
                                "and 30 of 60) scale with it (default: %(default)s, the "
                                "paper's)")
    stability.add_argument("--dataset", default="auto", metavar="NAME",
                           help="training data: a dataset name (fashion-mnist, mnist, "
                                "digits, ...) or auto (default: %(default)s)")
    stability.add_argument("--data-dir", metavar="DIR",
                           help="folder searched first for the dataset's files")
    stability.add_argument("--key", choices=SORT_KEYS, default="max",
                           help="sort key of the units (default: %(default)s)")
    stability.add_argument("--scaling", choices=STABILITY_SCALINGS, default="norm",
                           help="scale normalisation before sorting (default: %(default)s)")
    stability.add_argument("--every", type=EVERY, default=1, metavar="K",
                           help=f"snapshot every K SGD steps, {EVERY.range_text} and at most "
                                "the steps of one epoch (the figure needs a snapshot in every "
                                "epoch), with at most 200,000 snapshots per run (each is kept "
                                "in memory until the run ends); both checked once the "
                                "dataset is loaded, before training (default: %(default)s, "
                                "every step as in the paper)")
    stability.add_argument("--engine", choices=STABILITY_ENGINES, default="auto",
                           help="trainer engine: auto picks the numba fast path for "
                                "OptuNet (default: %(default)s)")
    _common_options(stability, "permutation-stability")
    stability.set_defaults(func=run_permutation_stability)

    byov = studies.add_parser(
        "byov", help="seed 004: BYOL with a Bayes-by-Backprop student under three priors vs "
                     "deterministic BYOL: probe calibration, SNR pruning",
        description=_BYOV_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  posteriorzoo study byov --out byov\n"
               "  posteriorzoo study byov --quick --out byov-smoke\n"
               "  posteriorzoo study byov --priors standard --epochs 20 --out byov-20")
    byov.add_argument("--priors", nargs="+", choices=BYOV_PRIORS, default=list(BYOV_PRIORS),
                      metavar="PRIOR",
                      help=f"BYOV priors to train, of {', '.join(BYOV_PRIORS)} (time: one "
                           "training each; deterministic BYOL is always trained) (default: "
                           "all three)")
    sizes = (("--train-images", TRAIN_IMAGES, "train_images",
              "training images (a seeded subset of the training split; time is proportional "
              "to it), {range} and at most the split's size (checked once the data are "
              "loaded)"),
             ("--test-images", TEST_IMAGES, "test_images",
              "test images scored (a seeded subset of the test split), {range}"),
             ("--epochs", BYOV_EPOCHS, "epochs",
              "epochs of every model's training (the same budget for each; time), {range}"),
             ("--batch-size", BATCH, "batch_size",
              "images per step (two views each; drop-last batches), {range} and at most "
              "--train-images"),
             ("--samples", SAMPLES, "samples",
              "posterior draws of each BYOV encoder (the MC predictive and the checkpoints "
              "of its collection; time of the evaluation), {range}"))
    for flag, kind, key, text in sizes:
        byov.add_argument(flag, type=kind, default=None, dest=key,
                          help=f"{text.format(range=kind.range_text)} (default: "
                               f"{BYOV_DEFAULTS[key]:,}; --quick: {BYOV_QUICK[key]:,})")
    byov.add_argument("--noise-std", type=NOISE, default=0.3,
                      help=f"standard deviation of the Gaussian noise added to the test "
                           f"images, pixel units on the [0, 1] scale (then clipped), in "
                           f"{NOISE.range_text} (default: %(default)s)")
    byov.add_argument("--dataset", choices=BYOV_DATASETS, default="auto",
                      help="28x28 grey images: auto is Fashion-MNIST when its files are on "
                           "this machine (no download), else scikit-learn's digits (1,347 "
                           "training images) (default: %(default)s)")
    byov.add_argument("--data-dir", metavar="DIR",
                      help="folder searched first for the dataset's files")
    byov.add_argument("--no-recalibration", action="store_true",
                      help="score posterior draws and pruned encoders with the feature "
                           "standardisation of the probe's own encoder (default: recompute "
                           "it for each of them on 2,000 training images, the probe's "
                           "weights kept)")
    byov.add_argument("--quick", action="store_true",
                      help="smoke-test sizes (seconds): 512 training and 256 test images, "
                           "1 epoch, batches of 64, 2 draws")
    _common_options(byov, "byov-study")
    byov.set_defaults(func=run_byov)


def _common_options(parser: argparse.ArgumentParser, default_out: str) -> None:
    seed_option(parser, "seed of every random choice")
    parser.add_argument("--out", type=Path, default=Path(default_out), metavar="DIR",
                        help="output folder, built under a temporary name and renamed into "
                             "place when complete; refused if it exists unless --overwrite "
                             "(default: %(default)s)")
    add_overwrite_option(parser)
    add_json_option(parser, "the result's JSON instead of the summary")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def _report(args: argparse.Namespace, result: object, lines: list[str]) -> None:
    """Print the summary lines, or the result's JSON with --json."""
    if args.json:
        sys.stdout.write(result.to_json())
    else:
        print("\n".join(lines))


def run_toy(args: argparse.Namespace) -> int:
    from analysis.studies.toy import check_toy_options, run_toy_study
    from posteriorzoo.outputs import atomic_directory

    check_toy_options(args.networks, args.points, args.norm)  # before the output exists
    with atomic_directory(args.out, overwrite=args.overwrite) as partial:
        result = run_toy_study(args.networks, args.seed, norm=args.norm,
                               points_per_class=args.points, progress=not args.no_progress,
                               command=getattr(args, "command_line", None))
        selection = result.summary["selection"]
        checks = result.summary["symmetry_removal"]["checks"]
        lines = [
            f"trained {selection['networks']} networks, kept {selection['kept']} "
            f"(dropped {selection['dropped']}: last-epoch loss > "
            f"{selection['loss_threshold']:g})",
            "symmetry removal keeps every function: max relative output change "
            f"{max(checks[f'max_relative_output_change_{p}'] for p in ('rescaled', 'sorted')):.1e}",
            f"wrote {args.out}/ (study-toy.json, toy_output_weights.csv, toy_data.csv, "
            f"toy_output_weights.png/.pdf)"]
        result.write_into(partial)
    _report(args, result, lines)
    return 0


def run_permutation_stability(args: argparse.Namespace) -> int:
    from analysis.studies.permutation_stability import run_permutation_stability as run
    from posteriorzoo.outputs import atomic_directory

    with atomic_directory(args.out, overwrite=args.overwrite) as partial:
        result = run(args.runs, args.epochs, args.dataset, args.seed, key=args.key,
                     scaling=args.scaling, every=args.every, engine=args.engine,
                     data_dir=args.data_dir, progress=not args.no_progress,
                     command=getattr(args, "command_line", None))
        lines = [f"{args.runs} runs x {args.epochs} epochs on "
                 f"{result.provenance['options']['dataset']}, key {args.key!r}:"]
        for layer, values in result.summary["layers"].items():
            phases = ", ".join(
                f"epochs {p['epochs'][0]}-{p['epochs'][1]}: {p['fraction_changed']:.2%}"
                for p in values["phases"] if p["fraction_changed"] is not None)
            lines.append(f"  {layer}: mean tau {values['mean_tau']:.4f}; steps whose order "
                         f"changed: {phases}")
        lines.append(f"wrote {args.out}/ (study-permutation-stability.json, "
                     "tau_by_step.csv, tau_binned.csv, permutation_stability.png/.pdf)")
        result.write_into(partial)
    _report(args, result, lines)
    return 0


def run_byov(args: argparse.Namespace) -> int:
    from analysis.studies.byov import check_byov_options, run_byov_study
    from posteriorzoo.outputs import atomic_directory

    sizes = BYOV_QUICK if args.quick else BYOV_DEFAULTS
    chosen = {key: value if getattr(args, key) is None else getattr(args, key)
              for key, value in sizes.items()}
    check_byov_options(args.priors, noise_std=args.noise_std, dataset=args.dataset,
                       **chosen)  # before the output exists
    with atomic_directory(args.out, overwrite=args.overwrite) as partial:
        result = run_byov_study(args.priors, args.seed, noise_std=args.noise_std,
                                dataset=args.dataset, data_dir=args.data_dir,
                                recalibrate=not args.no_recalibration,
                                progress=not args.no_progress,
                                command=getattr(args, "command_line", None), **chosen)
        summary = result.summary
        lines = [f"{len(summary['models'])} models, {chosen['epochs']} epochs on "
                 f"{chosen['train_images']:,} {summary['data']['dataset']} images; linear "
                 f"probe on {chosen['test_images']:,} test images (noise std "
                 f"{args.noise_std:g}):"]
        for row in summary["probe"]:
            lines.append(f"  {row['model']:<22} {row['inference']:<5} {row['input']:<5} "
                         f"accuracy {row['accuracy']:.4f}  ECE {row['ece']:.4f}  "
                         f"Brier {row['brier']:.4f}")
        lines.append("pruning (clean accuracy at each sparsity):")
        for model in dict.fromkeys(row["model"] for row in summary["pruning"]):
            for criterion in ("snr", "magnitude"):
                cells = [f"{row['sparsity']:g}: {row['accuracy']:.4f}"
                         for row in summary["pruning"]
                         if row["model"] == model and row["criterion"] == criterion]
                if cells:
                    lines.append(f"  {model:<22} {criterion:<9} " + ", ".join(cells))
        files = ", ".join(sorted(summary["collections"]))
        lines.append(f"wrote {args.out}/ (study-byov.json, byov_probe.csv, byov_pruning.csv, "
                     f"byov_training.csv, byov.png/.pdf, {files})")
        result.write_into(partial)
    _report(args, result, lines)
    return 0
