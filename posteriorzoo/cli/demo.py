"""``posteriorzoo demo``: the main job end to end on data every machine has offline.

Trains a small OptuNet collection on scikit-learn's digits (resized to 28x28) with the
mass trainer, then runs
the store's whole round trip: info, verify, export to safetensors, import into a new
collection (bit-identical check), and a SHA256SUMS manifest. Rerunning resumes: only
missing checkpoints are trained. Later issues grow this into the full pipeline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the main job on bundled offline data (a smoke run)",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("--out", type=Path, default=Path("demo-output"),
                        help="output folder (default: %(default)s)")
    parser.add_argument("--checkpoints", type=int, default=8,
                        help="checkpoints to train (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=20,
                        help="epochs per checkpoint (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="base seed: checkpoint i's seeds derive from (seed, i) "
                             "(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from posteriorzoo.cli.zoo_commands import describe
    from posteriorzoo.zoo import (
        MANIFEST_NAME,
        export_checkpoint,
        import_checkpoints,
        open_zoo,
        verify_manifest,
        verify_zoo,
        write_manifest,
    )
    from posteriorzoo.zoo.schema import library_versions
    from train_zoo import make_spec
    from train_zoo.backends import SerialBackend
    from train_zoo.run import train_collection

    if args.checkpoints < 1 or args.epochs < 1:
        from posteriorzoo.errors import InvalidOptionError
        raise InvalidOptionError("--checkpoints and --epochs must be at least 1")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # The folder's files are about to change; the manifest is rewritten at the end.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    # The paper's OptuNet recipe with a larger step, milder crops and a constant rate:
    # digits has only 1,347 training images (22 steps per epoch), upscaled from 8x8.
    spec = make_spec("optunet-mnist", name="demo", dataset="digits", method="de",
                     checkpoints=args.checkpoints, base_seed=args.seed,
                     recipe_overrides={"epochs": args.epochs, "lr": 0.2, "crop_padding": 2,
                                       "schedule": "constant", "milestones": []})
    zoo_path = out / "optunet-digits-de.h5"
    summary = train_collection(spec, zoo_path, backend=SerialBackend(),
                               progress=not args.no_progress, command=args.command_line)
    print(f"trained {summary.trained} checkpoint(s) now at {summary.steps_per_second:.0f} "
          f"model-steps/s ({summary.checkpoints} in the collection)")

    info = describe(zoo_path)
    accuracy = info["metadata"]["test_accuracy"]
    print(f"{zoo_path}: {info['checkpoints']} x {info['architecture']} "
          f"({info['values_per_checkpoint']} values each); test accuracy "
          f"min {accuracy['min']:.3f} median {accuracy['median']:.3f} max {accuracy['max']:.3f}")
    report = verify_zoo(zoo_path)
    print(report.summary())

    exported = out / "checkpoint-0.safetensors"
    copy_path = out / "roundtrip.h5"
    copy_path.unlink(missing_ok=True)
    with open_zoo(zoo_path) as zoo:
        export_checkpoint(zoo, 0, exported)
        original = zoo.state_dict(0)
    import_checkpoints(copy_path, [exported], command=args.command_line)
    with open_zoo(copy_path) as copy:
        restored = copy.state_dict(0)
    identical = all(torch.equal(original[k], restored[k]) for k in original)
    print(f"safetensors round trip {exported.name} -> {copy_path.name}: "
          f"{'bit-identical' if identical else 'DIFFERENT'}")
    manifest = write_manifest(out)
    verified = verify_manifest(out)
    print(f"{manifest}: {len(verified)} files, all SHA-256 match")

    summary = {"command": args.command_line, "versions": library_versions(),
               "base_seed": args.seed, "recipe": spec.collection_recipe(),
               "collection": info, "verify_ok": report.ok, "roundtrip_identical": identical}
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2))
    return 0 if report.ok and identical else 1
