"""``posteriorzoo demo``: the main job end to end, with no download.

1. The shipped reference zoo (OptuNet on Fashion-MNIST: 1,000 target checkpoints and a
   100-member Deep Ensemble): what it holds, and a full integrity check.
2. The Deep Ensemble's predictions on the Fashion-MNIST test set, members against the
   ensemble (when Debian's Fashion-MNIST files are installed).
3. The mass trainer on data every machine has: a small OptuNet zoo on scikit-learn's
   digits (resumable: rerunning trains only what is missing).
4. The store's round trip: export to safetensors, import into a new collection
   (bit-identical check).
5. Symmetries: the reference Deep Ensemble canonicalized (first + min-mass + softmax,
   10 checkpoints checked for unchanged logits), and the minimum-mass report.
6. The posterior comparison: the Deep Ensemble against the 1,000 target checkpoints,
   MMD and NS-MMD per layer, as CSV, JSON and a Markdown table like the paper's Table 2.

Last, a SHA256SUMS manifest of the output folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from posteriorzoo.cli._types import (
    add_json_option,
    add_overwrite_option,
    nonnegative_int,
    positive_int,
)


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
    parser.add_argument("--checkpoints", type=positive_int, default=8,
                        help="checkpoints of the digits zoo (default: %(default)s)")
    parser.add_argument("--epochs", type=positive_int, default=20,
                        help="epochs per digits checkpoint (default: %(default)s)")
    parser.add_argument("--seed", type=nonnegative_int, default=0,
                        help="seed of every random choice of the command: here, the base seed of "
                             "the digits zoo, whose checkpoint i's seeds derive from (seed, i) "
                             "(default: %(default)s)")
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


def ensemble_step() -> dict[str, Any] | None:
    """The Deep Ensemble's members and their average on the Fashion-MNIST test set."""
    import numpy as np

    from posteriorzoo.collection.evaluation import member_probabilities, normalized_images
    from posteriorzoo.data import load_dataset
    from posteriorzoo.errors import PosteriorZooError
    from posteriorzoo.metrics import accuracy, negative_log_likelihood
    from posteriorzoo.reference import open_reference

    try:
        test = load_dataset("fashion-mnist", "test", download=False)
        zoo = open_reference("de")
    except PosteriorZooError as error:
        print(f"[2] ensemble on Fashion-MNIST: skipped ({error})")
        return None
    with zoo:
        members = member_probabilities(zoo, normalized_images(test))
    labels = test.labels
    member_accuracy = [accuracy(p, labels) for p in members]
    member_nll = [negative_log_likelihood(p, labels) for p in members]
    ensemble = members.mean(axis=0)
    result = {"members": len(members), "member_accuracy_mean": float(np.mean(member_accuracy)),
              "member_nll_mean": float(np.mean(member_nll)),
              "ensemble_accuracy": accuracy(ensemble, labels),
              "ensemble_nll": negative_log_likelihood(ensemble, labels)}
    print(f"[2] Deep Ensemble of {result['members']} on Fashion-MNIST test: members "
          f"accuracy {result['member_accuracy_mean']:.3f} / NLL {result['member_nll_mean']:.3f} "
          f"(mean), ensemble accuracy {result['ensemble_accuracy']:.3f} / NLL "
          f"{result['ensemble_nll']:.3f}")
    return result


def symmetry_step(out: Path, command: str) -> dict[str, Any]:
    """[5] Canonicalize the reference Deep Ensemble; min-mass report of its members."""
    import numpy as np

    from posteriorzoo.collection import canonicalize, min_mass
    from posteriorzoo.reference import reference_path

    source = reference_path("de")
    target = out / "de-canonical.h5"
    summary = canonicalize(source, target, scaling="minmass", n_verify=10, command=command)
    masses = min_mass(source)
    result = {"checkpoints": summary.checkpoints, "verified": len(summary.verified),
              "largest_logit_change": summary.largest_change,
              "mass_before_median": float(np.median(masses.mass_before)),
              "mass_after_median": float(np.median(masses.mass_after))}
    print(f"[5] canonical Deep Ensemble {target.name}: {summary.checkpoints} checkpoints, "
          f"{result['verified']} checked, largest logit change "
          f"{result['largest_logit_change']:.1e}; min-mass median "
          f"{result['mass_before_median']:.2f} -> {result['mass_after_median']:.2f}")
    return result


def mmd_step(out: Path, command: str, progress: bool) -> dict[str, Any]:
    """[6] MMD and NS-MMD of the reference Deep Ensemble to the target, per layer."""
    from posteriorzoo.collection import compare
    from posteriorzoo.reference import reference_path

    # The canonical copies go inside the demo's (temporary) output folder, not the
    # system's temporary folder, so a killed demo leaves nothing behind elsewhere.
    report = compare(reference_path("target"), {"DE": reference_path("de")},
                     symmetries="both", workdir=out, progress=progress, command=command)
    report.scale = 100
    written = report.write(out / "mmd-report")
    kept, removed = report.summary("DE", "keep"), report.summary("DE", "remove")
    result = {"mmd_median": kept.median, "ns_mmd_median": removed.median,
              "files": sorted(path.name for path in written.values())}
    print(f"[6] Deep Ensemble vs target, MMD^2 x 100 weighted over layers: MMD median "
          f"{100 * kept.median:.4f}, NS-MMD median {100 * removed.median:.4f}; table in "
          f"mmd-report/mmd_report.md")
    return result


def run_demo(args: argparse.Namespace) -> int:
    from posteriorzoo.outputs import atomic_directory

    # Every file is built inside a temporary folder next to --out, which replaces --out
    # only when the whole demo has succeeded.
    # With --json, stdout carries only the summary; the step lines go to stderr.
    lines = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with lines, atomic_directory(args.out, overwrite=args.overwrite) as work:
        code = _run_steps(args, work)
        summary = (work / "demo-summary.json").read_text()
    print(f"results in {args.out}/", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(summary)
    return code


def _run_steps(args: argparse.Namespace, out: Path) -> int:
    import torch

    from posteriorzoo.collection import describe, export_checkpoint, import_checkpoints, verify
    from posteriorzoo.provenance import record
    from posteriorzoo.zoo import open_zoo, verify_manifest, write_manifest
    from train_zoo import make_spec
    from train_zoo.backends import SerialBackend
    from train_zoo.run import train_collection

    reference = reference_step(progress=not args.no_progress)
    ensemble = ensemble_step()

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
    symmetry = symmetry_step(out, args.command_line)
    comparison = mmd_step(out, args.command_line, progress=not args.no_progress)

    summary = {"kind": "demo",
               "provenance": record("posteriorzoo demo", command=args.command_line,
                                    seeds={"base_seed": args.seed}),
               "recipe": spec.collection_recipe(),
               "reference": reference, "ensemble": ensemble, "collection": info,
               "verify_ok": report.ok, "roundtrip_identical": identical,
               "symmetry": symmetry, "mmd": comparison}
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2))
    manifest = write_manifest(out)
    verified = verify_manifest(out)
    print(f"{manifest.name} covers {len(verified)} files, all SHA-256 match")
    all_verified = report.ok and all(r["verify_ok"] for r in reference.values())
    return 0 if all_verified and identical else 1
