"""``posteriorzoo train``: a zoo spec into a collection file, resumably."""

from __future__ import annotations

import argparse
from pathlib import Path

from posteriorzoo.cli._types import add_json_option, add_no_verify_option, integer_in

# The ranges of the numeric options (each is checked when the command line is parsed).
#: Worker processes on this machine, each with its own copy of the training data.
WORKERS = integer_in(1, 1_024)
#: Modes per task: the vectorised engine holds a group's networks and activations at once.
GROUP_SIZE = integer_in(1, 1_024)
#: Checkpoints: the spec's own limit (train_zoo.spec.MAX_CHECKPOINTS).
CHECKPOINTS = integer_in(1, 1_000_000)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train a collection from a zoo spec (resumable)",
        description="Produce the checkpoints of a TOML zoo spec into a collection file. "
                    "Methods: de (independently trained networks), mc-dropout, swag, "
                    "laplace, sghmc and bbb (samples around independently trained base "
                    "networks, stored as checkpoints of the base architecture); the spec "
                    "gives modes x samples_per_mode and [method_options] (see "
                    "train_zoo.spec and train_zoo.method_options). Mode i depends only on "
                    "the spec's base seed and i, and its samples are stored together. "
                    "Rerunning the same command after an interruption produces exactly the "
                    "missing modes. A new collection file appears once its first mode is "
                    "stored; a run that fails before leaves no file. Built-in recipes: "
                    "optunet-mnist, resnet18-cifar100, resnet18-tinyimagenet (see "
                    "train_zoo.recipes).")
    parser.add_argument("spec", type=Path, help="zoo spec (.toml)")
    parser.add_argument("--out", type=Path, required=True, help="collection file (.h5)")
    parser.add_argument("--backend", choices=["local", "serial", "ray"], default="local",
                        help="local: one process per worker on this machine (default); "
                             "serial: this process; ray: Ray tasks (pip install "
                             "posteriorzoo[ray])")
    parser.add_argument("--workers", type=WORKERS,
                        help=f"processes (local) or CPUs (ray, when starting a local "
                             f"instance), {WORKERS.range_text} (each holds its own copy of "
                             "the data); default: one per core")
    parser.add_argument("--engine", choices=["auto", "torch", "fast", "vectorised"],
                        default="auto", help="auto: the numba fast path where it applies, "
                        "else torch; vectorised: Deep Ensembles only (default: %(default)s)")
    parser.add_argument("--group-size", type=GROUP_SIZE, default=1,
                        help=f"modes per task, {GROUP_SIZE.range_text}; the vectorised engine "
                             "trains a group in lockstep, holding its networks and their "
                             "activations at once (default: %(default)s)")
    parser.add_argument("--ray-address", help="existing Ray cluster, e.g. auto or "
                        "ray://head:10001 (default: start a local instance)")
    parser.add_argument("--checkpoints", type=CHECKPOINTS,
                        help=f"override the spec's number of checkpoints, "
                             f"{CHECKPOINTS.range_text} as in a spec (the number of modes "
                             "follows; samples_per_mode must divide it)")
    add_no_verify_option(parser)
    add_json_option(parser, "the run's summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from train_zoo import load_spec
    from train_zoo.backends import make_backend
    from train_zoo.run import train_collection

    spec = load_spec(args.spec)
    if args.checkpoints is not None:
        spec = spec.replace(checkpoints=args.checkpoints)
    backend = make_backend(args.backend, workers=args.workers, group_size=args.group_size,
                           address=args.ray_address)
    summary = train_collection(spec, args.out, backend=backend, engine=args.engine,
                               progress=not args.no_progress, command=args.command_line,
                               verify=not args.no_verify)
    if args.json:
        import json

        print(json.dumps({"path": str(summary.path), "checkpoints": summary.checkpoints,
                          "requested": spec.checkpoints, "trained": summary.trained,
                          "diverged": summary.diverged, "steps": summary.steps,
                          "seconds": summary.seconds, "method": spec.method,
                          "modes": spec.modes, "samples_per_mode": spec.samples_per_mode},
                         indent=1))
        return 0
    print(f"{summary.path}: {summary.checkpoints}/{spec.checkpoints} checkpoints "
          f"({summary.trained} trained now, {summary.diverged} diverged) in "
          f"{summary.seconds:.1f} s, {summary.steps_per_second:.0f} model-steps/s")
    return 0
