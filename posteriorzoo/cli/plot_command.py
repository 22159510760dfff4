"""``posteriorzoo plot``: draw one of the paper's figures for any collection, PNG and PDF.

The figures are :mod:`analysis.figures`; this module parses arguments, reads the data
through the collection layer (:mod:`analysis.figures.sources`), draws, saves and prints.
matplotlib, numpy and torch are imported only when a figure is drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path
from typing import Any

from posteriorzoo.cli._types import (
    add_json_option,
    add_no_verify_option,
    add_overwrite_option,
    file_stem_names,
    integer_in,
    seed_option,
)
from posteriorzoo.text import MMD_DISPLAY_SCALE, scaled_label
from posteriorzoo.vocabulary import (
    KERNEL_STATISTICS,
    MINMASS_SOLVERS,
    PERMUTATION_KEYS,
    SCALINGS,
    SYMMETRIES,
    SYMMETRY_CHOICES,
)

# The ranges of the numeric options (each is checked when the command line is parsed).
#: Units per layer: one histogram each, and KS tests between every two of them (N^2).
UNITS = integer_in(1, 64)
#: Images per dataset: every member's predictions on them are held in memory.
IMAGES = integer_in(1, 10_000_000)
#: Member pairs: each pair's mutual information is computed on every image (time).
PAIRS = integer_in(1, 100_000)
#: Noise-band splits: each is one more MMD on every layer (time).
NOISE_SPLITS = integer_in(0, 1_000)

_DESCRIPTION = f"""\
Draw one figure of the paper (Laurent et al., ICLR 2024) for any collection, without
writing matplotlib code. Each figure is written twice, as OUT.png (150 dpi) and OUT.pdf
(vector), under temporary names renamed into place only when both are complete (the file
a killed run left of an unfinished pair is replaced by the next run); existing files are
refused unless --overwrite, an input is never an output and a missing folder is an
error. Canonical copies go to a locked folder in TMPDIR, removed afterwards (or by the
next plot if this one is killed). --json prints the files written and the figure's
numbers.

figures:
  marginals  layer marginals, raw and canonical, with KS p-values between units (Fig. 9)
  mass       mass before and after min-mass, and each layer's largest |w| (Fig. 2)
  collapse   pairwise mutual information in and out of distribution (Figs. 3 and 7)
  mmd        MMD^2 (x {MMD_DISPLAY_SCALE:g}) per layer and method, with the target's noise band
  pca        cumulative explained variance of the weights' principal components
"""

_EPILOG = """\
examples:
  posteriorzoo plot marginals target.h5 --layers conv2.weight fc.weight --out marginals
  posteriorzoo plot mass target.h5 --out mass.png
  posteriorzoo plot collapse target.h5 --ood-data mnist --n-pairs 5000 --seed 1
  posteriorzoo plot mmd target.h5 DE=de.h5 SWAG=swag.h5 --symmetries remove
  posteriorzoo plot pca target.h5 de.h5 --symmetries both
"""

_SYMMETRY_HELP = ("the weights as stored (keep), in canonical form (remove: the collection "
                  "is canonicalized into a temporary folder, with --permutation and "
                  "--scaling), or both")


def _add_common(parser: argparse.ArgumentParser, name: str, numbers: str) -> None:
    parser.add_argument("--out", type=Path, default=Path(name), metavar="PATH",
                        help="output path without suffix, or ending in .png or .pdf: writes "
                             "PATH.png and PATH.pdf (default: %(default)s)")
    add_overwrite_option(parser)
    add_no_verify_option(parser)
    add_json_option(parser, f"the files written and {numbers} as JSON")


def _add_canonicalizer(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--permutation", choices=PERMUTATION_KEYS, default="first",
                        help="canonical form: the units' sort key (default: %(default)s)")
    parser.add_argument("--scaling", choices=SCALINGS,
                        default="norm", help="canonical form: the scaling (default: "
                                             "%(default)s)")


def _add_layers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", nargs="+", metavar="NAME",
                        help="parameter tensors: names or shell patterns such as 'conv*' "
                             "(default: every parameter); a pattern matching nothing is an "
                             "error")


def register(subparsers: argparse._SubParsersAction) -> None:
    plot = subparsers.add_parser(
        "plot", help="draw one of the paper's figures (PNG and PDF)", description=_DESCRIPTION,
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    figures = plot.add_subparsers(dest="figure", metavar="FIGURE", required=True)

    parser = figures.add_parser(
        "marginals", help="layer marginals with KS p-values between units (Fig. 9)",
        description="For each layer, the histograms over the checkpoints of one weight "
                    "position per unit (the unit's first incoming weight; for a last layer, "
                    "whose inputs are the permutable units, the weight from unit u to output "
                    "0), for the first --units units, as stored (symmetries kept) and in "
                    "canonical form (symmetries removed). Each panel prints the median and "
                    "minimum two-sample Kolmogorov-Smirnov p-value between those units: "
                    "Proposition 1 says the raw marginals of permutable units are equal; "
                    "sorting the units makes them differ. x: weight value (weights are "
                    "unitless); y: density.")
    parser.add_argument("zoo", type=Path, metavar="ZOO", help="collection file (.h5)")
    _add_layers(parser)
    parser.add_argument("--units", type=UNITS, default=4, metavar="N",
                        help=f"units drawn and compared per layer, {UNITS.range_text} (one "
                             "histogram each, KS tests between every two) "
                             "(default: %(default)s)")
    parser.add_argument("--symmetries", choices=SYMMETRY_CHOICES, default="both",
                        help=f"{_SYMMETRY_HELP} (default: %(default)s)")
    _add_canonicalizer(parser)
    _add_common(parser, "marginals", "the KS p-values between units")
    parser.set_defaults(func=run_marginals)

    parser = figures.add_parser(
        "mass", help="mass before and after min-mass, largest weights (Fig. 2)",
        description="Solve the minimum-mass rescaling of every checkpoint (the same "
                    "function with the smallest sum of squared weights, biases excluded) and "
                    "draw the histograms of the mass before and after, and box plots of each "
                    "weight tensor's largest |w| before and after. Nothing is written to ZOO.")
    parser.add_argument("zoo", type=Path, metavar="ZOO", help="collection file (.h5)")
    parser.add_argument("--solver", choices=MINMASS_SOLVERS, default="fast",
                        help="batched Newton (fast) or the cvxpy reference "
                             "(default: %(default)s)")
    _add_common(parser, "mass", "the mass summary")
    parser.set_defaults(func=run_mass)

    parser = figures.add_parser(
        "collapse", help="pairwise mutual information, ID and OOD (Figs. 3 and 7)",
        description="For random pairs of checkpoints, the mutual information of the "
                    "two-member ensemble averaged over test images (nats, in [0, log 2]), on "
                    "the in-distribution and on the out-of-distribution dataset: two "
                    "histograms and their scatter with Pearson's r. Both datasets are "
                    "normalised with the in-distribution dataset's mean and std, as in "
                    "'posteriorzoo report' (a checkpoint with non-finite outputs is an "
                    "error).")
    parser.add_argument("zoo", type=Path, metavar="ZOO", help="collection file (.h5)")
    parser.add_argument("--ood-data", required=True, metavar="NAME",
                        help="out-of-distribution dataset, e.g. mnist for Fashion-MNIST nets")
    parser.add_argument("--id-data", metavar="NAME",
                        help="in-distribution dataset (default: the collection's)")
    parser.add_argument("--data-dir", type=Path, metavar="DIR",
                        help="folder searched first for the dataset files")
    parser.add_argument("--n-images", type=IMAGES, default=2000, metavar="N",
                        help=f"the first N test images of each dataset, {IMAGES.range_text} "
                             "(memory: every member's predictions on them are held) "
                             "(default: %(default)s)")
    parser.add_argument("--n-pairs", type=PAIRS, default=2000, metavar="P",
                        help=f"at most P member pairs, drawn with --seed, {PAIRS.range_text} "
                             "(time: each pair's mutual information is computed on every "
                             "image) (default: %(default)s)")
    seed_option(parser, "seed of every random choice of the command: here, the member "
                        "pairs drawn")
    _add_common(parser, "collapse", "Pearson's r and the MI summaries")
    parser.set_defaults(func=run_collapse)

    parser = figures.add_parser(
        "mmd", help="MMD^2 per layer and method, with the noise band",
        description="Compare each METHOD with TARGET layer by layer (unbiased MMD^2, "
                    "MMDAgg's 20 kernels, as 'posteriorzoo mmd') and draw one point per "
                    "method and layer: the --statistic over the kernels, shown x "
                    f"{MMD_DISPLAY_SCALE:g} as in 'posteriorzoo mmd' and 'report' (the axis "
                    "says so; --json gives the raw values and display_scale), on a log or "
                    "symlog scale when the values span decades (MMD^2 can be slightly "
                    "negative). The grey band is the noise floor (with --statistic median): "
                    "--noise-splits times, n random target checkpoints (n: the methods' "
                    "median size, leaving at least 2 of the target) are compared with the "
                    "other target checkpoints; the band spans the 5th to 95th percentile, as "
                    "in 'posteriorzoo report', which also warns when the target holds fewer "
                    "than 5 n checkpoints.")
    parser.add_argument("target", type=Path, metavar="TARGET", help="target collection (.h5)")
    parser.add_argument("methods", nargs="+", metavar="METHOD",
                        help="method collections (.h5); NAME=PATH names one (default name: "
                             "the file stem)")
    parser.add_argument("--symmetries", choices=SYMMETRIES, default="keep",
                        help="MMD on the stored weights (keep) or NS-MMD on canonical forms "
                             "(remove) (default: %(default)s)")
    _add_canonicalizer(parser)
    _add_layers(parser)
    parser.add_argument("--statistic", choices=KERNEL_STATISTICS, default="median",
                        help="statistic over the 20 kernels (default: %(default)s)")
    parser.add_argument("--noise-splits", type=NOISE_SPLITS, default=20, metavar="K",
                        help=f"random target splits for the noise band, "
                             f"{NOISE_SPLITS.range_text}; 0: no band (time: each split is one "
                             "more MMD on every layer) (default: %(default)s)")
    seed_option(parser, "seed of every random choice of the command: here, the noise "
                        "band's splits")
    _add_common(parser, "mmd", "the MMD^2 values and noise band")
    parser.set_defaults(func=run_mmd)

    parser = figures.add_parser(
        "pca", help="explained variance of the weights' principal components",
        description="For each collection, the principal components of its flattened "
                    "weights (one row per checkpoint, the selected parameters concatenated, "
                    "centred, not scaled): the cumulative fraction of the total variance "
                    "explained by the first k components, against k. Memory: one layer "
                    "across checkpoints plus N x N values.")
    parser.add_argument("zoos", nargs="+", metavar="ZOO",
                        help="collection files (.h5); NAME=PATH names one")
    _add_layers(parser)
    parser.add_argument("--symmetries", choices=SYMMETRY_CHOICES, default="keep",
                        help=f"{_SYMMETRY_HELP} (default: %(default)s)")
    _add_canonicalizer(parser)
    _add_common(parser, "pca", "the curves")
    parser.set_defaults(func=run_pca)


# --------------------------------------------------------------------------- helpers
def _plain(value: Any) -> Any:
    """JSON-ready: numpy to Python, NaN and infinities to None."""
    import numpy as np

    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def _check_outputs(args: argparse.Namespace, inputs: list[Path]) -> None:
    """Refuse the outputs before any work (both files are checked)."""
    from analysis.figures.save import figure_paths
    from posteriorzoo.outputs import check_output

    for path in figure_paths(args.out).values():
        check_output(path, inputs=inputs, overwrite=args.overwrite)


def _finish(args: argparse.Namespace, figure, inputs: list[Path], numbers: dict,
            summary: str) -> int:
    from analysis.figures.save import save_figure

    written = save_figure(figure, args.out, overwrite=args.overwrite, inputs=inputs)
    if args.json:
        print(json.dumps(_plain({"figure": args.figure, "files": written,
                                 "inputs": [str(p) for p in inputs],
                                 "command": args.command_line, "numbers": numbers}),
                         indent=2))
        return 0
    print(summary)
    for path in written.values():
        print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------- figures
def run_marginals(args: argparse.Namespace) -> int:
    from analysis.figures.draw import marginals_figure
    from analysis.figures.sources import marginal_layers
    from analysis.figures.statistics import ks_summary, unit_ks_pvalues, unit_marginals

    inputs = [args.zoo]
    _check_outputs(args, inputs)
    data = marginal_layers(args.zoo, args.layers, symmetries=args.symmetries,
                           permutation=args.permutation, scaling=args.scaling,
                           verify=not args.no_verify)
    numbers: dict[str, Any] = {}
    for setting, layers in (("raw", data.raw), ("canonical", data.canonical)):
        for key, layer in (layers or {}).items():
            pvalues = unit_ks_pvalues(unit_marginals(layer, data.unit_axes[key], args.units))
            entry = numbers.setdefault(key, {"unit_axis": data.unit_axes[key],
                                             "exchangeable": data.exchangeable[key],
                                             "checkpoints": int(layer.shape[0])})
            entry[setting] = {**ks_summary(pvalues), "ks_pvalues": pvalues}
    figure = marginals_figure(data.raw, data.canonical, args.units, unit_axes=data.unit_axes,
                              exchangeable=data.exchangeable)
    lines = []
    for key, entry in numbers.items():
        parts = [f"{t} median p {entry[t]['median']:.3g}" for t in ("raw", "canonical")
                 if t in entry and entry[t]["median"] is not None]
        lines.append(f"{key}: KS between units: {', '.join(parts) or 'one unit'}")
    return _finish(args, figure, inputs, {"units": args.units, "layers": numbers},
                   "\n".join(lines))


def run_mass(args: argparse.Namespace) -> int:
    import numpy as np

    from analysis.figures.draw import mass_figure
    from posteriorzoo.collection import min_mass

    inputs = [args.zoo]
    _check_outputs(args, inputs)
    result = min_mass(args.zoo, solver=args.solver, verify=not args.no_verify,
                      command=args.command_line)
    figure = mass_figure(result.mass_before, result.mass_after, result.max_abs_before,
                         result.max_abs_after)
    summary = result.summary()
    largest = {key: {"median_before": float(np.nanmedian(result.max_abs_before[key])),
                     "median_after": float(np.nanmedian(result.max_abs_after[key]))}
               for key in result.max_abs_before}
    return _finish(args, figure, inputs, {**summary, "largest_abs_weight": largest},
                   f"{args.zoo}: median mass {summary['mass_before_median']:.6g} -> "
                   f"{summary['mass_after_median']:.6g} (median ratio "
                   f"{summary['mass_ratio_median']:.4f})")


def run_collapse(args: argparse.Namespace) -> int:
    import numpy as np

    from analysis.figures.draw import collapse_figure
    from analysis.figures.sources import collapse_data
    from analysis.figures.statistics import pearson

    inputs = [args.zoo]
    _check_outputs(args, inputs)
    data = collapse_data(args.zoo, args.ood_data, id_data=args.id_data, images=args.n_images,
                         pairs=args.n_pairs, seed=args.seed, data_dir=args.data_dir,
                         verify=not args.no_verify)
    figure = collapse_figure(data.id_mi, data.ood_mi, id_name=data.id_name,
                             ood_name=data.ood_name)
    r, p = pearson(data.id_mi, data.ood_mi)

    def described(values: np.ndarray) -> dict[str, float]:
        return {"mean": float(values.mean()), "median": float(np.median(values)),
                "std": float(values.std()), "min": float(values.min()),
                "max": float(values.max())}

    numbers = {"pearson_r": r, "pearson_p": p, "pairs": len(data.pairs),
               "images": data.images, "seed": args.seed, "unit": "nats",
               "id": {"dataset": data.id_name, **described(data.id_mi)},
               "ood": {"dataset": data.ood_name, **described(data.ood_mi)}}
    return _finish(args, figure, inputs, numbers,
                   f"{args.zoo}: {len(data.pairs)} pairs; mean pairwise MI "
                   f"{data.id_mi.mean():.4g} nats on {data.id_name}, "
                   f"{data.ood_mi.mean():.4g} on {data.ood_name}; Pearson r {r:.3f}")


def run_mmd(args: argparse.Namespace) -> int:
    from analysis.figures.draw import mmd_figure
    from analysis.figures.sources import collection_styles, mmd_noise_band, mmd_values
    from posteriorzoo.collection import compare
    from posteriorzoo.mmd import held_out_size, small_target_warning
    from posteriorzoo.outputs import temporary_folder

    methods = file_stem_names(args.methods)
    inputs = [args.target, *methods.values()]
    _check_outputs(args, inputs)
    # The canonical copies' folder in TMPDIR is locked while this runs: the next plot
    # removes it if this one is killed.
    with temporary_folder("plot") as folder:
        report = compare(args.target, methods, symmetries=args.symmetries, layers=args.layers,
                         permutation=args.permutation, scaling=args.scaling,
                         canonical_dir=folder if args.symmetries == "remove" else None,
                         verify=not args.no_verify, command=args.command_line)
        values = mmd_values(report, args.symmetries, args.statistic)
        noise, size = None, None
        if args.noise_splits and args.statistic == "median":  # the band is of medians
            # the target's canonical form that compare made (or the target, canonical
            # already), whatever the inputs' file names
            source = report.canonical_target if args.symmetries == "remove" else None
            source = source or args.target
            target_count = report.results[0].mmd.m
            sizes = {result.method: result.mmd.n for result in report.results}
            size = held_out_size(target_count, list(sizes.values()))
            warning = small_target_warning(target_count, size)
            if warning:
                warnings.warn(warning, stacklevel=1)
            layers = list(dict.fromkeys(result.layer for result in report.results))
            noise = mmd_noise_band(source, layers, size, splits=args.noise_splits,
                                   seed=args.seed, verify=not args.no_verify)
    figure = mmd_figure(values, noise, args.symmetries, statistic=args.statistic,
                        scale=MMD_DISPLAY_SCALE, styles=collection_styles(methods))
    summaries = {s.method: getattr(s, args.statistic) for s in report.summaries()
                 if s.symmetries == args.symmetries}
    # the JSON keeps the raw values; the figure and the printed line show them scaled
    numbers = {"symmetries": args.symmetries, "statistic": args.statistic,
               "display_scale": MMD_DISPLAY_SCALE, "per_layer": values,
               "model_level": summaries, "noise_band": noise,
               "noise_splits": args.noise_splits,
               "noise_held_out": size, "seed": args.seed}
    text = ", ".join(f"{name} {MMD_DISPLAY_SCALE * value:.4g}"
                     for name, value in summaries.items())
    label = scaled_label(f"{'MMD' if args.symmetries == 'keep' else 'NS-MMD'}^2")
    return _finish(args, figure, inputs, numbers,
                   f"{label} ({args.statistic}, weighted over layers): {text}")


def run_pca(args: argparse.Namespace) -> int:
    import numpy as np

    from analysis.figures.draw import pca_figure
    from analysis.figures.sources import canonical_copy, collection_styles, pca_curve

    zoos = file_stem_names(args.zoos)
    inputs = list(zoos.values())
    _check_outputs(args, inputs)
    curves, drawn = {}, {}

    def label(name: str, kind: str) -> str:
        shown = name if args.symmetries != "both" else f"{name} ({kind})"
        drawn[shown] = zoos[name]
        return shown

    for name, path in zoos.items():
        if args.symmetries in ("keep", "both"):
            curves[label(name, "raw")] = pca_curve(path, args.layers, verify=not args.no_verify)
        if args.symmetries in ("remove", "both"):
            with canonical_copy(path, permutation=args.permutation, scaling=args.scaling,
                                verify=not args.no_verify) as copy:
                curves[label(name, "canonical")] = pca_curve(
                    copy, args.layers, verify=not args.no_verify)
    # each curve in the style of what its file holds, as in the report (canonical: dotted)
    figure = pca_figure(curves, styles=collection_styles(drawn))

    def needed(curve: np.ndarray, level: float) -> int:
        return int(np.searchsorted(curve, level - 1e-12) + 1)

    numbers = {name: {"components": len(curve),
                      "components_for": {f"{level:g}": needed(curve, level)
                                         for level in (0.5, 0.9, 0.99)},
                      "cumulative_ratio": curve} for name, curve in curves.items()}
    text = "; ".join(f"{name}: {entry['components_for']['0.9']} of {entry['components']} "
                     "components for 90%" for name, entry in numbers.items())
    return _finish(args, figure, inputs, {"symmetries": args.symmetries, "curves": numbers},
                   text)
