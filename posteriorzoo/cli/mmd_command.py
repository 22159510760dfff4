"""``posteriorzoo mmd``: compare method collections with the target posterior, layer by layer."""

from __future__ import annotations

import argparse
from pathlib import Path

from posteriorzoo.cli._types import (
    add_device_option,
    add_json_option,
    add_no_verify_option,
    add_overwrite_option,
    file_stem_names,
    integer_in,
    number_in,
    seed_option,
)
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.text import MMD_DISPLAY_SCALE
from posteriorzoo.vocabulary import (
    DISTANCE_PRECISIONS,
    LAYER_GROUPS,
    PERMUTATION_KEYS,
    SCALINGS,
    SYMMETRY_CHOICES,
)

# The ranges of the numeric options (each is checked when the command line is parsed).
#: Bandwidths per kernel family: each adds two kernels, one pass over the distances each.
BANDWIDTHS = integer_in(1, 100)
#: A display factor of the Markdown table's 4 decimals.
SCALE = number_in(1e-6, 1e6)
#: A test level.
ALPHA = number_in(0, 1, open_low=True, open_high=True)
#: Resampled statistics: (B1 + B2) x min(m, n) resampling indices are held in memory.
RESAMPLES = integer_in(1, 50_000)
#: Bisection steps: after about 60 halvings the level is exact in float64.
BISECTIONS = integer_in(1, 100)
#: MiB of features per block: smaller blocks only stream slower; the block is in memory.
BLOCK_MB = number_in(1, 1e6)
#: Rows per tile block: a tile holds 2 x N^2 float64 per layer (16 MiB at 1,024).
TILE_ROWS = integer_in(2, 65_536)
#: GPUs per Ray task: a fraction of one, or whole GPUs (Ray refuses 1.5).
NUM_GPUS = number_in(0, 64)

#: The display factor as the help shows it ("x 100").
_X = f"x {MMD_DISPLAY_SCALE:g}"
_DESCRIPTION = f"""\
Compare each METHOD collection with the TARGET collection (the posterior estimated by
independently trained checkpoints), layer by layer, with the unbiased MMD^2 under MMDAgg's
20 kernels (10 Laplace on L1 distances, 10 Gaussian on L2 distances, MMDAgg's bandwidth
rule). Per layer: the median, mean and max over the kernels. Per method: the mean of each
over layers, weighted by the layers' parameter counts (the figures of the paper's Table 2),
for MMD (symmetries kept) and NS-MMD (symmetries removed: the target and every method are
first canonicalized with --permutation, --scaling and the softmax shift removed). A layer
is one parameter tensor (BatchNorm running statistics and counters are buffers and are
left out) unless --group module.

Collections compare when their weight layouts (keys and shapes) agree, whatever their
model options; different datasets or recipes give a warning on stderr. Collections that
are already canonical (from 'posteriorzoo canonicalize') are not canonicalized again:
only NS-MMD is computed for them, and a raw target with a canonical method is refused.

Writes into --out: mmd_layers.csv (one row per method, symmetry setting and layer with all 20
values and bandwidths), mmd_summary.csv (one row per method and symmetry setting, with m and n),
mmd_report.json (every number, and the provenance: command, versions, git commit, seeds,
the input files with their SHA-256) and mmd_report.md (a table laid out like the paper's
Table 2, the per-layer figures, provenance). The Markdown table is also printed (--json:
the JSON instead). Tables show MMD^2 {_X} (--scale), as 'report' and 'plot mmd' do, and
every header says so ("MMD median ({_X})"); CSV and JSON hold the raw values (the JSON
records the factor as display_scale).
"""

_EPILOG = """\
examples:
  posteriorzoo mmd target.h5 swag.h5 laplace.h5 --out mmd-report
  posteriorzoo mmd target.h5 SWAG=runs/swag.h5 DE=runs/de.h5 --symmetries keep
  posteriorzoo mmd target.h5 de.h5 --layers 'layer4.*' --test --seed 1
  posteriorzoo mmd target.h5 de.h5 --symmetries keep --tiles-dir tiles --ray-address auto
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "mmd", help="layer-wise MMD of method collections to the target posterior",
        description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path, metavar="TARGET",
                        help="target collection (.h5), e.g. 1000 independent checkpoints")
    parser.add_argument("methods", nargs="+", metavar="METHOD",
                        help="method collections (.h5); NAME=PATH names one in the report "
                             "(default name: the file stem)")
    parser.add_argument("--symmetries", choices=SYMMETRY_CHOICES, default="both",
                        help="MMD on the stored weights (keep), NS-MMD on canonical forms "
                             "(remove), or both (default: %(default)s)")
    parser.add_argument("--permutation", choices=PERMUTATION_KEYS, default="first",
                        help="NS-MMD: the canonicalizer's permutation key "
                             "(default: %(default)s)")
    parser.add_argument("--scaling", choices=SCALINGS,
                        default="norm", help="NS-MMD: the canonicalizer's scaling "
                                             "(default: %(default)s)")
    parser.add_argument("--layers", nargs="+", metavar="NAME",
                        help="layers to compare: names or shell patterns such as 'layer4.*' "
                             "(default: every parameter); a pattern matching nothing is an "
                             "error")
    parser.add_argument("--group", choices=LAYER_GROUPS, default="tensor",
                        help="a layer is one parameter tensor, or one module's parameters "
                             "(weight and bias) together (default: %(default)s)")
    parser.add_argument("--include-buffers", action="store_true",
                        help="also compare floating-point buffers (BatchNorm running mean "
                             "and variance)")
    parser.add_argument("--out", type=Path, default=Path("mmd-report"), metavar="DIR",
                        help="output folder, built under a temporary name and renamed into "
                             "place when complete; refused if it exists unless --overwrite "
                             "(default: %(default)s)")
    add_overwrite_option(parser)
    add_no_verify_option(parser)
    parser.add_argument("--bandwidths", type=BANDWIDTHS, default=10, metavar="N",
                        help=f"bandwidths per kernel family: 2N kernels; "
                             f"{BANDWIDTHS.range_text} (time: each kernel is one more pass "
                             "over the distances) (default: %(default)s)")
    parser.add_argument("--scale", type=SCALE, default=MMD_DISPLAY_SCALE,
                        help=f"multiply the MMD^2 values shown in the Markdown table by this, "
                             f"in {SCALE.range_text}; the headers say it (the table shows 4 "
                             "decimals; CSV and JSON keep raw values and record it as "
                             "display_scale; default: %(default)s, as 'report' and 'plot "
                             "mmd')")
    parser.add_argument("--test", action="store_true",
                        help="also run the MMDAgg test (permutations or wild bootstrap, "
                             "level-corrected) on every layer and method: decision and "
                             "p-values (slower)")
    parser.add_argument("--alpha", type=ALPHA, default=0.05,
                        help=f"level of --test, in {ALPHA.range_text} (default: %(default)s)")
    parser.add_argument("--b1", type=RESAMPLES, default=2000,
                        help=f"--test: resampled statistics for the quantiles, "
                             f"{RESAMPLES.range_text} (memory: (B1 + B2) x min(m, n) "
                             "resampling indices) (default: %(default)s)")
    parser.add_argument("--b2", type=RESAMPLES, default=2000,
                        help=f"--test: resampled statistics for the level correction, "
                             f"{RESAMPLES.range_text} (as --b1) (default: %(default)s)")
    parser.add_argument("--b3", type=BISECTIONS, default=50,
                        help=f"--test: bisection steps, {BISECTIONS.range_text} (after about "
                             "60 halvings the level is exact in float64) "
                             "(default: %(default)s)")
    seed_option(parser, "seed of every random choice of the command: here, --test's "
                        "permutations / signs")
    parser.add_argument("--block-mb", type=BLOCK_MB, default=128.0, metavar="MB",
                        help=f"memory for one block of features over all collections, in MiB, "
                             f"in {BLOCK_MB.range_text} (layers larger than this stream from "
                             "disk; the block is held in memory; default: %(default)s)")
    parser.add_argument("--keep-canonical", action="store_true",
                        help="keep the canonical copies in OUT/canonical (default: they are "
                             "built inside the temporary output and deleted)")
    parser.add_argument("--tiles-dir", type=Path, metavar="DIR",
                        help="compute the distance matrices as tiles kept in DIR: a rerun "
                             "computes only the missing tiles (resumes a killed run); "
                             "compares the inputs as they are (raw: --symmetries keep; "
                             "canonical copies from 'posteriorzoo canonicalize': remove)")
    parser.add_argument("--ray-address", metavar="ADDRESS",
                        help="with --tiles-dir: compute the tiles as Ray tasks on this "
                             "cluster (auto, HOST:PORT, ray://HOST:10001), or 'local' for a "
                             "private local instance; the collection files and DIR must be "
                             "at the same paths on every node (default: in this process)")
    parser.add_argument("--tile-rows", type=TILE_ROWS, metavar="N",
                        help=f"with --tiles-dir: rows per tile block, {TILE_ROWS.range_text} "
                             "(a tile holds 2 x N^2 float64 per layer; default: 1024)")
    parser.add_argument("--num-gpus", type=NUM_GPUS, default=0.0, metavar="GPUS",
                        help=f"with --ray-address and a cuda device: GPUs per tile task, "
                             f"{NUM_GPUS.range_text} (a fraction below 1 shares a GPU; "
                             "default: %(default)s)")
    parser.add_argument("--precision", choices=DISTANCE_PRECISIONS, default=None,
                        help="the distances' arithmetic: exact (float64, the same bits on "
                             "every machine) or fast (float32 GEMM for L2 and a SIMD L1 "
                             "kernel with float64 sums, within a stated bound: the "
                             "ResNet-scale path) (default: exact on cpu, fast on cuda)")
    add_device_option(parser, "where the distances and the canonical copies are computed")
    add_json_option(parser, "the report's JSON instead of the Markdown table")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.set_defaults(func=run_mmd)


def run_mmd(args: argparse.Namespace) -> int:
    from posteriorzoo.collection import compare
    from posteriorzoo.devices import check_device
    from posteriorzoo.outputs import atomic_directory

    methods = file_stem_names(args.methods)
    inputs = [args.target, *methods.values()]
    check_device(args.device)   # before any work
    if args.precision is None:
        args.precision = "exact" if args.device == "cpu" else "fast"
    if args.tiles_dir is None and (args.ray_address or args.tile_rows or args.num_gpus):
        raise InvalidOptionError("--ray-address, --tile-rows and --num-gpus are options of "
                                 "--tiles-dir")
    if args.tiles_dir is not None and args.keep_canonical:
        raise InvalidOptionError("--tiles-dir compares the inputs as they are: canonicalize "
                                 "them first ('posteriorzoo canonicalize') instead of "
                                 "--keep-canonical")
    # Everything, canonical copies included, is built inside the temporary output folder:
    # a killed run leaves nothing behind but that folder, which the next run reclaims.
    with atomic_directory(args.out, overwrite=args.overwrite, inputs=inputs) as partial:
        canonical = partial / "canonical"
        if args.keep_canonical:
            canonical.mkdir()
        report = _tiled(args, methods) if args.tiles_dir is not None else compare(
            args.target, methods, symmetries=args.symmetries, layers=args.layers,
            group=args.group, include_buffers=args.include_buffers,
            permutation=args.permutation, scaling=args.scaling,
            number_bandwidths=args.bandwidths, test=args.test, alpha=args.alpha, B1=args.b1,
            B2=args.b2, B3=args.b3, seed=args.seed,
            block_bytes=int(args.block_mb * (1 << 20)),
            canonical_dir=canonical if args.keep_canonical else None,
            workdir=partial, verify=not args.no_verify, progress=not args.no_progress,
            command=args.command_line, precision=args.precision, device=args.device)
        report.scale = args.scale
        names = list(report.write_into(partial))
    if args.json:
        print(report.to_json(), end="")
        return 0
    table = report.to_markdown().split("\n## Per layer")[0]
    print(table.rstrip())
    print()
    for name in names:
        print(f"wrote {args.out / name}")
    return 0


def _tiled(args: argparse.Namespace, methods: dict) -> object:
    """``compare_tiles`` with the command's options (``--symmetries both``: what the
    inputs hold)."""
    from posteriorzoo.collection.tiles import compare_tiles
    from posteriorzoo.mmd.tiles import DEFAULT_BLOCK_ROWS

    address = None if args.ray_address in (None, "local") else args.ray_address
    return compare_tiles(
        args.target, methods, tiles_dir=args.tiles_dir,
        backend="serial" if args.ray_address is None else "ray", ray_address=address,
        block_rows=args.tile_rows or DEFAULT_BLOCK_ROWS,
        symmetries=None if args.symmetries == "both" else args.symmetries,
        layers=args.layers, group=args.group, include_buffers=args.include_buffers,
        number_bandwidths=args.bandwidths, test=args.test, alpha=args.alpha, B1=args.b1,
        B2=args.b2, B3=args.b3, seed=args.seed, block_bytes=int(args.block_mb * (1 << 20)),
        precision=args.precision, device=args.device, num_gpus=args.num_gpus,
        verify=not args.no_verify,
        progress=not args.no_progress, command=args.command_line)
