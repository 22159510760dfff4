"""``posteriorzoo demo``: the main job end to end on data every machine has offline.

Trains a small OptuNet collection on scikit-learn's digits (resized to 28x28), then runs
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
                        help="base seed: checkpoint i uses seed+i for init and data order "
                             "(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from posteriorzoo.cli.zoo_commands import describe
    from posteriorzoo.data import load_dataset
    from posteriorzoo.zoo import (
        MANIFEST_NAME,
        create_zoo,
        export_checkpoint,
        import_checkpoints,
        open_zoo,
        recipe_hash,
        verify_manifest,
        verify_zoo,
        write_manifest,
    )
    from posteriorzoo.zoo.schema import library_versions
    from train_zoo import train_classifier

    if args.checkpoints < 1 or args.epochs < 1:
        from posteriorzoo.errors import InvalidOptionError
        raise InvalidOptionError("--checkpoints and --epochs must be at least 1")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # The folder's files are about to change; the manifest is rewritten at the end.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    # The paper's OptuNet recipe with a larger step and milder crops: digits has only
    # 1,347 training images (21 steps per epoch), upscaled from 8x8.
    recipe = {"architecture": "optunet", "dataset": "digits", "epochs": args.epochs,
              "batch_size": 64, "optimizer": "sgd", "lr": 0.2, "weight_decay": 2e-4,
              "crop_padding": 2}
    settings = {key: recipe[key] for key in ("epochs", "batch_size", "lr", "weight_decay",
                                               "crop_padding")}
    zoo_path = out / "optunet-digits-de.h5"
    if zoo_path.exists():
        zoo = open_zoo(zoo_path, mode="a")
        if zoo.recipe != recipe:
            zoo.close()
            from posteriorzoo.errors import ZooSchemaError
            raise ZooSchemaError(f"{zoo_path} was trained with another recipe; "
                                 "use another --out")
    else:
        template = train_classifier("optunet", train, test, seed=0, data_seed=0, epochs=0,
                                    num_classes=10).state_dict
        zoo = create_zoo(zoo_path, architecture="optunet", dataset="digits", method="de",
                         num_classes=10, template=template, recipe=recipe,
                         command=args.command_line)
    with zoo, tqdm(total=args.checkpoints, initial=min(len(zoo), args.checkpoints),
                   desc="train", unit="ckpt", disable=args.no_progress) as bar:
        for index in range(len(zoo), args.checkpoints):
            seed = args.seed + index
            result = train_classifier("optunet", train, test, seed=seed, data_seed=seed,
                                      num_classes=10, **settings)
            zoo.append(result.state_dict, seed=seed, data_seed=seed, epoch=args.epochs,
                       recipe_hash=recipe_hash(recipe), wall_time=result.wall_time,
                       diverged=result.diverged, source="posteriorzoo demo", **result.metrics)
            bar.update(1)
            bar.set_postfix(test_acc=f"{result.metrics['test_accuracy']:.3f}")

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
               "seeds": [args.seed + i for i in range(args.checkpoints)], "recipe": recipe,
               "collection": info, "verify_ok": report.ok, "roundtrip_identical": identical}
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2))
    return 0 if report.ok and identical else 1
