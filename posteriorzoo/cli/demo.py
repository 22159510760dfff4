"""``posteriorzoo demo``: the main job end to end, with no download.

1. The shipped reference zoo (OptuNet on Fashion-MNIST, the paper's 60-epoch recipe: 1,000
   target checkpoints, a 100-member Deep Ensemble and the fourteen method collections): what
   each holds, and a full integrity check.
2. The benchmark report on it (``posteriorzoo report``): Table 1 (MMD and NS-MMD to the
   target, accuracy, ECE, Brier, AUPR, FPR95, IDMI, OODMI) with the noise floor, the
   Table 2 detail, and the paper's figures, as one HTML page in report/. In-distribution
   data: Fashion-MNIST's test split, which ships with the package (a copy found in the
   usual data folders is preferred); OOD data: MNIST when its files are present, else
   scikit-learn's digits.
3. The mass trainer on data every machine has: a small OptuNet zoo on scikit-learn's
   digits (resumable: rerunning trains only what is missing).
4. The store's round trip: export to safetensors, import into a new collection
   (bit-identical check).

Last, a SHA256SUMS manifest of the output folder, and how to run the command yourself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from posteriorzoo.cli._types import (
    add_json_option,
    add_overwrite_option,
    integer_in,
    seed_option,
)

# The ranges of the numeric options (each is checked when the command line is parsed).
#: Checkpoints and epochs of the digits zoo: time (about 0.1 s per checkpoint and epoch).
CHECKPOINTS = integer_in(1, 1_000)
EPOCHS = integer_in(1, 1_000)
#: Images per dataset: every member's predictions on them are held in memory.
IMAGES = integer_in(1, 10_000_000)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the main job on the shipped reference zoo and bundled data",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo-output"),
                        help="output folder, built under a temporary name and renamed into "
                             "place when complete; refused if it exists unless --overwrite "
                             "(default: %(default)s)")
    add_overwrite_option(parser)
    parser.add_argument("--checkpoints", type=CHECKPOINTS, default=8,
                        help=f"checkpoints of the digits zoo, {CHECKPOINTS.range_text} (time) "
                             "(default: %(default)s)")
    parser.add_argument("--epochs", type=EPOCHS, default=20,
                        help=f"epochs per digits checkpoint, {EPOCHS.range_text} (time) "
                             "(default: %(default)s)")
    seed_option(parser, "seed of every random choice of the command: here, the base seed of "
                        "the digits zoo, whose checkpoint i's seeds derive from (seed, i)")
    parser.add_argument("--n-images", type=IMAGES, default=None, metavar="N",
                        help=f"the report uses only the first N images of each dataset, "
                             f"{IMAGES.range_text} (memory: every member's predictions on "
                             "them are held) (default: all; a smaller N gives a faster, "
                             "noisier demo)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_json_option(parser, "the demo's summary (demo-summary.json) on stdout; the step "
                            "lines go to stderr")
    parser.set_defaults(func=run_demo)


def _accuracy_line(info: dict[str, Any]) -> str:
    accuracy = info["metadata"]["test_accuracy"]
    return (f"{info['checkpoints']} x {info['architecture']} on {info['dataset']}, test "
            f"accuracy min {accuracy['min']:.3f} median {accuracy['median']:.3f} "
            f"max {accuracy['max']:.3f}, {info['metadata']['diverged']} diverged")


def reference_step(progress: bool) -> dict[str, Any]:
    """Describe and verify the shipped collections (skipped if not installed)."""
    from posteriorzoo.collection import describe, verify
    from posteriorzoo.errors import ZooFormatError
    from posteriorzoo.reference import COLLECTIONS, reference_path

    results: dict[str, Any] = {}
    for name in COLLECTIONS:
        try:
            path = reference_path(name)
        except ZooFormatError as error:
            print(f"[1] reference {name}: skipped ({error})")
            continue
        info = describe(path).to_dict()
        report = verify(path, progress=progress)
        print(f"[1] reference {name}: {_accuracy_line(info)}; "
              f"{'verified' if report.ok else 'CORRUPT'}")
        results[name] = {"info": info, "verify_ok": report.ok}
    return results


def report_step(out: Path, final: Path, command: str, progress: bool,
                n_images: int | None = None) -> dict[str, Any] | None:
    """[2] The benchmark report on the shipped zoo (Fashion-MNIST in distribution)."""
    from analysis.report import build_report
    from analysis.report.page import table1_text
    from posteriorzoo.data import load_dataset
    from posteriorzoo.errors import PosteriorZooError
    from posteriorzoo.reference import METHOD_COLLECTIONS, reference_path

    try:
        load_dataset("fashion-mnist", "test", download=False)
        methods = [reference_path(name) for name in ("de", *METHOD_COLLECTIONS)]
        target = reference_path("target")
    except PosteriorZooError as error:
        print(f"[2] report on the reference zoo: skipped ({error})")
        return None
    try:
        load_dataset("mnist", "test", download=False)
        ood = "mnist"
    except PosteriorZooError:
        ood = "digits"
    report = build_report(target, methods, id_data="fashion-mnist", ood_data=ood,
                          n_images=n_images, workdir=out, progress=progress, command=command)
    report.write(out / "report")
    print(f"[2] report on the reference zoo (OOD: {ood}): {final / 'report' / 'report.html'}")
    print(table1_text(report))
    return {"html": "report/report.html", "ood": ood,
            "table1": [{key: row.get(key) for key in ("name", "group", "n", *(
                column for column, *_ in report.columns()))} for row in report.rows],
            "noise_band": {k: v.band for k, v in report.noise.items()}}


def run_demo(args: argparse.Namespace) -> int:
    from posteriorzoo.outputs import atomic_directory

    # Every file is built inside a temporary folder next to --out, which replaces --out
    # only when the whole demo has succeeded.
    # With --json, stdout carries only the summary; the step lines go to stderr.
    lines = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with lines, atomic_directory(args.out, overwrite=args.overwrite) as work:
        code = _run_steps(args, work)
        summary = (work / "demo-summary.json").read_text()
    lines_out = sys.stderr if args.json else sys.stdout
    print(f"results in {args.out}/", file=lines_out)
    if (args.out / "report" / "report.html").is_file():
        print(f"the report: {args.out / 'report' / 'report.html'}", file=lines_out)
    for line in how_to_run_lines():
        print(line, file=lines_out)
    if args.json:
        print(summary)
    return code


def _as_typed(path: Path) -> str:
    """``path`` relative to the current folder when it lies inside it, else absolute."""
    path = path.absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def how_to_run_lines() -> list[str]:
    """Where to go next: how to run this command, as the user can type it.

    ``make demo`` runs ``.venv/bin/posteriorzoo`` without activating the environment, so
    a bare ``posteriorzoo`` would not be found by the shell: the lines name the script's
    own path, and the environment's activate script, unless the shell finds this very
    script already.
    """
    script = Path(sys.prefix) / "bin" / "posteriorzoo"
    on_path = shutil.which("posteriorzoo")
    if not script.is_file() or (on_path and os.path.samefile(on_path, script)):
        return ["next: posteriorzoo --help lists the commands"]
    lines = [f"next: {_as_typed(script)} --help lists the commands"]
    activate = Path(sys.prefix) / "bin" / "activate"
    if sys.prefix != sys.base_prefix and activate.is_file():
        lines.append(f"      or: source {_as_typed(activate)}, then posteriorzoo --help")
    return lines


def _run_steps(args: argparse.Namespace, out: Path) -> int:
    import torch

    from posteriorzoo.collection import describe, export_checkpoint, import_checkpoints, verify
    from posteriorzoo.provenance import record
    from posteriorzoo.zoo import open_zoo, verify_manifest, write_manifest
    from train_zoo import make_spec
    from train_zoo.backends import SerialBackend
    from train_zoo.run import train_collection

    reference = reference_step(progress=not args.no_progress)
    benchmark = report_step(out, args.out, args.command_line, progress=not args.no_progress,
                            n_images=args.n_images)

    # The paper's OptuNet recipe with a larger step, milder crops and a constant rate:
    # digits has only 1,347 training images (22 steps per epoch), upscaled from 8x8.
    spec = make_spec("optunet-mnist", name="demo", dataset="digits", method="de",
                     checkpoints=args.checkpoints, base_seed=args.seed,
                     recipe_overrides={"epochs": args.epochs, "lr": 0.2, "crop_padding": 2,
                                       "schedule": "constant", "milestones": []})
    zoo_path = out / "optunet-digits-de.h5"
    trained = train_collection(spec, zoo_path, backend=SerialBackend(),
                               progress=not args.no_progress, command=args.command_line)
    info = {**describe(zoo_path).to_dict(), "path": str(args.out / zoo_path.name)}
    report = verify(zoo_path, command=args.command_line)
    print(f"[3] trained {trained.trained} checkpoint(s) at {trained.steps_per_second:.0f} "
          f"model-steps/s: {zoo_path.name} holds {_accuracy_line(info)}; "
          f"{'verified' if report.ok else 'CORRUPT'}")

    exported = out / "checkpoint-0.safetensors"
    copy_path = out / "roundtrip.h5"
    with open_zoo(zoo_path) as zoo:
        export_checkpoint(zoo, 0, exported, command=args.command_line)
        original = zoo.state_dict(0)
    import_checkpoints(copy_path, [exported], command=args.command_line)
    with open_zoo(copy_path) as copy:
        restored = copy.state_dict(0)
    identical = all(torch.equal(original[k], restored[k]) for k in original)
    print(f"[4] safetensors round trip {exported.name} -> {copy_path.name}: "
          f"{'bit-identical' if identical else 'DIFFERENT'}")

    summary = {"kind": "demo",
               "provenance": record("posteriorzoo demo", command=args.command_line,
                                    seeds={"base_seed": args.seed}),
               "recipe": spec.collection_recipe(),
               "reference": reference, "report": benchmark, "collection": info,
               "verify_ok": report.ok, "roundtrip_identical": identical}
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2))
    manifest = write_manifest(out)
    verified = verify_manifest(out)
    print(f"{manifest.name} covers {len(verified)} files, all SHA-256 match")
    all_verified = report.ok and all(r["verify_ok"] for r in reference.values())
    return 0 if all_verified and identical else 1
