"""``posteriorzoo train``: a zoo spec into a collection file, resumably.

Besides training, ``--dry-run`` shows what a spec resolves to (every recipe field and
method option with where it came from, the checkpoints, the engine) and an estimated time
from a short measured run, writing nothing; ``--list-options [METHOD]`` lists every
method's options with their defaults and a line of help, from the declarations the
validation's records are made from (:func:`posteriorzoo.vocabulary.describe_options`),
without importing the trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

from posteriorzoo.cli._types import (
    add_device_option,
    add_json_option,
    add_no_verify_option,
    integer_in,
    number_in,
)
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.vocabulary import BACKENDS, ENGINES

# The ranges of the numeric options (each is checked when the command line is parsed).
#: Worker processes on this machine, each with its own copy of the training data.
WORKERS = integer_in(1, 1_024)
#: Modes per task: the vectorised engine holds a group's networks and activations at once.
GROUP_SIZE = integer_in(1, 1_024)
#: Checkpoints: the spec's own limit (train_zoo.spec.MAX_CHECKPOINTS).
CHECKPOINTS = integer_in(1, 1_000_000)
#: GPUs per Ray task: a fraction of one, or whole GPUs (Ray refuses 1.5).
NUM_GPUS = number_in(0, 64)

# The dry run's measured run: the first steps of a phase include compiling (numba, the
# first autograd graph) and are not timed; then steps are timed until there are enough
# for a stable mean or a few seconds have passed (a ResNet step on a CPU takes seconds).
WARM_UP_STEPS = 2
TIMED_STEPS = 30
TIMED_SECONDS = 3.0
#: Training examples Laplace's curvature is timed on (scaled to the training set), and
#: the two numbers of test examples evaluations are timed on: an evaluation costs a fixed
#: time per call (about 12 ms for OptuNet) plus a time per example, told apart by the two.
CURVATURE_EXAMPLES = 1_000
EVALUATION_EXAMPLES = (1_000, 3_000)


def _method_list() -> str:
    """``de (independently trained networks), mc-dropout, ... and rank-1``: the
    vocabulary's methods, read without importing the trainer."""
    from posteriorzoo.vocabulary import METHODS

    names = [f"{name} (independently trained networks)" if info.family == "ensemble"
             else name for name, info in METHODS.items()]
    return f"{', '.join(names[:-1])} and {names[-1]}"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train a collection from a zoo spec (resumable)",
        description="Produce the checkpoints of a TOML zoo spec into a collection file. "
                    f"Methods: {_method_list()} (samples of each mode's "
                    "posterior, stored as checkpoints of the base architecture); the spec "
                    "gives modes x samples_per_mode and [method_options] (--list-options "
                    "lists them with their defaults). Mode i depends only on "
                    "the spec's base seed and i, and its samples are stored together. "
                    "Rerunning the same command after an interruption produces exactly the "
                    "missing modes. A new collection file appears once its first mode is "
                    "stored; a run that fails before leaves no file. Defaults that follow "
                    "a shortened recipe or a large model (scaled lr milestones, SWAG's "
                    "iterates, Laplace's structure) are said on stderr, one line each, "
                    "with the progress bar. --dry-run shows the resolved spec and an "
                    "estimated time before any training. Built-in recipes: "
                    "optunet-mnist, resnet18-cifar100, resnet18-tinyimagenet (see "
                    "train_zoo.recipes).")
    parser.add_argument("spec", type=Path, nargs="?",
                        help="zoo spec (.toml); not needed with --list-options")
    parser.add_argument("--out", type=Path,
                        help="collection file (.h5); needed unless --dry-run or "
                             "--list-options")
    parser.add_argument("--dry-run", action="store_true",
                        help="write nothing: print the resolved recipe and method options "
                             "(each marked given, default or derived), the checkpoints, "
                             "the engine and an estimated time, extrapolated from a few "
                             "timed training steps with the chosen engine")
    parser.add_argument("--no-estimate", action="store_true",
                        help="with --dry-run: no measured run (and no data loaded)")
    parser.add_argument("--list-options", nargs="?", const="all", metavar="METHOD",
                        help="list the options of METHOD (default: every method) with "
                             "their defaults and a line of help, and exit")
    parser.add_argument("--backend", choices=BACKENDS, default="local",
                        help="local: one process per worker on this machine (default); "
                             "serial: this process; ray: Ray tasks (pip install "
                             "posteriorzoo[ray])")
    parser.add_argument("--workers", type=WORKERS,
                        help=f"processes (local) or CPUs (ray, when starting a local "
                             f"instance), {WORKERS.range_text} (each holds its own copy of "
                             "the data); default: one per core")
    parser.add_argument("--engine", choices=ENGINES,
                        default="auto", help="auto: the numba fast path where it applies, "
                        "else torch; vectorised: Deep Ensembles only (default: %(default)s)")
    parser.add_argument("--group-size", type=GROUP_SIZE, default=1,
                        help=f"modes per task, {GROUP_SIZE.range_text}; the vectorised engine "
                             "trains a group in lockstep, holding its networks and their "
                             "activations at once (default: %(default)s)")
    parser.add_argument("--ray-address", help="existing Ray cluster, e.g. auto or "
                        "ray://head:10001 (default: start a local instance)")
    parser.add_argument("--num-gpus", type=NUM_GPUS, default=0.0, metavar="GPUS",
                        help=f"ray: GPUs per task, {NUM_GPUS.range_text}: a fraction below "
                             "1 shares a GPU among small models, above 1 whole GPUs; the "
                             "task trains on cuda (default: %(default)s, CPU only)")
    add_device_option(parser, "where the torch engine trains (local and serial backends; with "
                              "cuda under bf16 autocast and channels-last, the data set and "
                              "its augmentation on the GPU; ray tasks: --num-gpus)")
    parser.add_argument("--checkpoints", type=CHECKPOINTS,
                        help=f"override the spec's number of checkpoints, "
                             f"{CHECKPOINTS.range_text} as in a spec (the number of modes "
                             "follows; samples_per_mode must divide it)")
    add_no_verify_option(parser)
    add_json_option(parser, "the run's summary (the dry run, the option list) as JSON")
    parser.add_argument("--no-progress", action="store_true",
                        help="hide the progress bar (drawn only when stderr is a "
                             "terminal); the lines saying which defaults were derived then "
                             "come once training succeeded, so that a failure is one line")
    parser.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    if args.list_options is not None:
        return _list_options(args)
    if args.spec is None:
        raise InvalidOptionError("a zoo spec (.toml) is needed, e.g. posteriorzoo train "
                                 "specs/optunet-fashion-mnist-de.toml --out de.h5")
    if args.no_estimate and not args.dry_run:
        raise InvalidOptionError("--no-estimate is an option of --dry-run")
    if args.out is None and not args.dry_run:  # a usage error before any file is read
        raise InvalidOptionError("--out names the collection file to train into (or ask "
                                 "for --dry-run)")
    from train_zoo import load_spec

    spec = load_spec(args.spec)
    if args.checkpoints is not None:
        spec = spec.replace(checkpoints=args.checkpoints)
    if args.dry_run:
        return _dry_run(args, spec)
    from posteriorzoo import progress
    from train_zoo.backends import make_backend
    from train_zoo.run import train_collection

    # What was derived is part of what is trained: at a terminal it is said before the
    # progress bar; in a log, once the run succeeded, so that a failure is still one
    # line there (a log's progress lines come only after minutes of work)
    at_terminal = progress.stderr_is_terminal() and not args.no_progress
    if at_terminal:
        _say_derived(spec)
    backend = make_backend(args.backend, workers=args.workers, group_size=args.group_size,
                           address=args.ray_address, num_gpus=args.num_gpus,
                           device=args.device)
    summary = train_collection(spec, args.out, backend=backend, engine=args.engine,
                               progress=not args.no_progress, command=args.command_line,
                               verify=not args.no_verify)
    if not at_terminal:
        _say_derived(spec)
    if args.json:
        import json

        print(json.dumps({"path": str(summary.path), "checkpoints": summary.checkpoints,
                          "requested": spec.checkpoints, "trained": summary.trained,
                          "diverged": summary.diverged, "near_chance": summary.near_chance,
                          "steps": summary.steps,
                          "seconds": summary.seconds, "method": spec.method,
                          "modes": spec.modes, "samples_per_mode": spec.samples_per_mode,
                          "derived": list(spec.derived)},
                         indent=1))
        return 0
    chance = (f", {summary.near_chance} near chance accuracy (undertrained: more epochs?)"
              if summary.near_chance else "")
    print(f"{summary.path}: {summary.checkpoints}/{spec.checkpoints} checkpoints "
          f"({summary.trained} trained now, {summary.diverged} diverged{chance}) in "
          f"{summary.seconds:.1f} s, {summary.steps_per_second:.0f} model-steps/s")
    return 0


def _say_derived(spec: Any) -> None:
    """One stderr line per default derived from the recipe (``spec.derived``)."""
    for line in spec.derived:
        print(f"posteriorzoo train: {line}", file=sys.stderr)


# ---------------------------------------------------------------- --list-options
def _list_options(args: argparse.Namespace) -> int:
    # The vocabulary's declarations alone: no trainer is imported (and no torch).
    from posteriorzoo.options import check_choice
    from posteriorzoo.vocabulary import METHODS, describe_options

    method = args.list_options
    if method != "all":
        check_choice("--list-options", method, tuple(METHODS))
    rows = describe_options(None if method == "all" else method)
    if args.json:
        import json

        print(json.dumps(rows, indent=1))
        return 0
    for name in METHODS if method == "all" else (method,):
        options = [row for row in rows if row["method"] == name]
        print(f"{name}:" if options else f"{name}: no options")
        width = max((len(row["option"]) for row in options), default=0)
        for row in options:
            print(f"  {row['option']:<{width}}  {row['help']} (default: {row['default']})")
    return 0


# ---------------------------------------------------------------- --dry-run
def _show(value: object) -> str:
    """A value as a spec writes it (TOML)."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "unset"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_show(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_show(item)}" for key, item in value.items()) + "}"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _duration(seconds: float) -> str:
    """``seconds`` rounded for a person: "about 42 s", "about 3.5 h", "under 1 s"."""
    if seconds < 1:
        return "under 1 s"
    return f"about {_rounded(seconds)}"


def _rounded(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7_200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3_600:.1f} h"
    return f"{seconds / 86_400:.1f} days"


def _dry_run(args: argparse.Namespace, spec: Any) -> int:
    from train_zoo.job import resolve_engine

    engine = resolve_engine(spec, args.engine)  # refused here as train refuses it
    out = None
    if args.out is not None:
        if not args.out.parent.is_dir():
            raise InvalidOptionError(f"{args.out}: the folder {args.out.parent} does not exist")
        out = {"path": str(args.out), "exists": args.out.exists()}
    for line in spec.derived:
        print(f"posteriorzoo train: {line}", file=sys.stderr)
    sources = spec.sources
    recipe = {name: {"value": value, "source": sources.get("recipe", {}).get(name, "given")}
              for name, value in spec.recipe.to_dict().items()
              if name not in ("architecture", "dataset")}
    options = {name: {"value": value,
                      "source": sources.get("method_options", {}).get(name, "given")}
               for name, value in spec.method_options.items()}
    estimate = None
    if not args.no_estimate:
        from posteriorzoo.data.datasets import no_cache_writes

        with no_cache_writes():   # a dry run writes nothing, not even the data cache
            estimate = _estimate(spec, engine, args)
    report = {"spec": str(args.spec), "name": spec.name, "method": spec.method,
              "architecture": spec.architecture, "model_options": dict(spec.model_options),
              "dataset": spec.dataset, "checkpoints": spec.checkpoints, "modes": spec.modes,
              "samples_per_mode": spec.samples_per_mode, "base_seed": spec.base_seed,
              "recipe": recipe, "method_options": options, "derived": list(spec.derived),
              "engine": engine, "out": out, "estimate": estimate, "written": False}
    if args.json:
        import json

        print(json.dumps(report, indent=1, default=str))
        return 0
    _print_dry_run(report)
    return 0


def _print_dry_run(report: dict[str, Any]) -> None:
    print(f"dry run of {report['spec']} ({report['name']}): nothing is written")
    model = report["architecture"]
    if report["model_options"]:
        model += f" {_show(report['model_options'])}"
    print(f"  {report['method']} on {model}, {report['dataset']}; {report['checkpoints']:,} "
          f"checkpoints = {report['modes']:,} modes x {report['samples_per_mode']:,} samples "
          f"per mode; base seed {report['base_seed']}")
    for title, table in (("recipe", report["recipe"]),
                         (f"method options ({report['method']})", report["method_options"])):
        if not table:
            print(f"{title}: none")
            continue
        print(f"{title}:")
        width = max(len(f"{name} = {_show(row['value'])}") for name, row in table.items())
        for name, row in table.items():
            print(f"  {name + ' = ' + _show(row['value']):<{width}}  {row['source']}")
    print(f"engine: {report['engine']}")
    if report["out"] is not None:
        state = ("exists: train resumes it if it was trained from this spec"
                 if report["out"]["exists"] else "new")
        print(f"output: {report['out']['path']} ({state})")
    estimate = report["estimate"]
    if estimate is None:
        return
    if estimate["seconds"] is None:
        print(f"estimated time: unavailable ({estimate['unavailable']})")
        return
    parallel = estimate["parallel"]
    spread = (f" with {parallel} processes" if parallel and parallel > 1 else
              "" if parallel else " of one process (divided among the Ray workers)")
    print(f"estimated time: {_duration(estimate['seconds'])}{spread} "
          f"({_duration(estimate['cpu_seconds'])} of one process); an estimate, "
          "extrapolated from a short measured run:")
    for part in estimate["parts"]:
        if part.get("seconds") is None:
            print(f"  {part['phase']}: not measured ({part['unavailable']})")
        elif "steps" in part:
            print(f"  {part['phase']}: {part['steps']:,} steps x "
                  f"{part['seconds_per_step'] * 1e3:.3g} ms ({part['timed_steps']} timed) = "
                  f"{_duration(part['seconds'])}")
        else:
            print(f"  {part['phase']}: {part['what']} = {_duration(part['seconds'])}")


# ---------------------------------------------------------------- the measured run
class _TimingDoneError(Exception):
    """Raised by :class:`_StepTimer` to end the measured run once it has its steps."""


class _StepTimer:
    """Times the steps of one training phase, then ends the run (:class:`_TimingDoneError`).
    A method's sub-phases (``sghmc-adapt``, ``sghmc-round-1``, ...) count as its phase:
    the first of them is timed, not run to its end (an adapted SGHMC's warm-up alone is
    160,000 steps)."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.created = time.perf_counter()
        self.times: list[float] = []

    def on_step_end(self, info: Any, weights: Any) -> None:
        if info.phase != self.phase and not info.phase.startswith(f"{self.phase}-"):
            if self.times:  # the phase ended before enough steps: nothing more to time
                raise _TimingDoneError
            return
        self.times.append(time.perf_counter())
        timed = len(self.times) - 1 - WARM_UP_STEPS
        if timed >= TIMED_STEPS or (
                timed >= 1 and self.times[-1] - self.times[WARM_UP_STEPS] >= TIMED_SECONDS):
            raise _TimingDoneError

    def result(self) -> tuple[float, int] | None:
        """(seconds per step, steps timed), or None when no step of the phase ran."""
        times = self.times
        if len(times) > WARM_UP_STEPS + 1:
            return ((times[-1] - times[WARM_UP_STEPS]) / (len(times) - 1 - WARM_UP_STEPS),
                    len(times) - 1 - WARM_UP_STEPS)
        if len(times) >= 2:
            return (times[-1] - times[0]) / (len(times) - 1), len(times) - 1
        if times:  # one step: its time includes building the model
            return times[0] - self.created, 1
        return None


def _head(dataset: Any, count: int) -> Any:
    """The first ``count`` examples of an ArrayDataset."""
    import dataclasses

    return dataclasses.replace(dataset, images=dataset.images[:count],
                               labels=dataset.labels[:count])


def _estimate(spec: Any, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """The measured run behind ``--dry-run``'s estimated time (see :func:`_parts`)."""
    import os

    import torch

    from posteriorzoo.data import load_dataset
    from posteriorzoo.errors import DataNotFoundError
    from train_zoo.data import TrainingData

    try:
        data = TrainingData(
            load_dataset(spec.dataset, "train", data_dir=spec.data_dir, download=False),
            load_dataset(spec.dataset, "test", data_dir=spec.data_dir, download=False))
    except DataNotFoundError as error:
        return {"seconds": None, "unavailable": f"the data are not here yet (train "
                f"downloads them): {str(error).splitlines()[0]}"}
    if spec.num_classes is not None and spec.num_classes < data.train.num_classes:
        raise InvalidOptionError(
            f"spec field 'num_classes' is {spec.num_classes}, but {spec.dataset} has "
            f"{data.train.num_classes} classes")
    tasks = math.ceil(spec.modes / args.group_size)
    if args.backend == "serial":
        parallel: int | None = 1
    elif args.backend == "local":
        parallel = min(args.workers or os.cpu_count() or 1, tasks)
    else:
        parallel = None
    threads = torch.get_num_threads()
    if args.backend != "serial":
        torch.set_num_threads(1)  # as each worker process trains
    try:
        parts = _parts(spec, engine, data, args.group_size)
    finally:
        torch.set_num_threads(threads)
    total = sum(part["seconds"] or 0.0 for part in parts)
    return {"seconds": total / (parallel or 1), "cpu_seconds": total, "parallel": parallel,
            "engine": engine, "parts": parts,
            "note": "an estimate: a few timed steps of each phase on this machine, "
                    "extrapolated to the spec's steps; not a measurement of the run"}


def _parts(spec: Any, engine: str, data: Any, group_size: int) -> list[dict[str, Any]]:
    """Each phase of the run: its steps (or examples), its measured cost and the total."""
    import dataclasses

    from train_zoo.methods.registry import get_method

    method = get_method(spec.method)
    options = spec.method_options
    steps_per_epoch = math.ceil(len(data.train) / spec.recipe.batch_size)
    chains = options.get("chains", 1)
    small = spec.replace(modes=1, samples_per_mode=chains)
    first = "train" if method.trains_base else spec.method
    parts = []
    if engine == "vectorised":
        rate = _time_vectorised(spec, data, min(group_size, spec.modes))
    else:
        rate = _time_phase(small, data, engine, first)
    parts.append(_step_part(first, spec.modes * spec.recipe.epochs * steps_per_epoch, rate))
    steps = method.phase_steps(spec, steps_per_epoch)
    if steps:
        # The method's phase alone: a recipe of 0 epochs trains no base network.
        method_only = small.replace(recipe=dataclasses.replace(spec.recipe, epochs=0))
        parts.append(_step_part(spec.method, spec.modes * steps,
                                _time_phase(method_only, data, engine, spec.method)))
    if method.fits_curvature:
        parts.append(_curvature_part(spec, data))
    parts.append(_evaluation_part(spec, data))
    return parts


def _step_part(phase: str, steps: int, rate: tuple[float, int] | None) -> dict[str, Any]:
    if rate is None:
        return {"phase": phase, "steps": steps, "seconds": None,
                "unavailable": "no step ran (a diverged network?)"}
    seconds_per_step, timed = rate
    return {"phase": phase, "steps": steps, "seconds_per_step": seconds_per_step,
            "timed_steps": timed, "seconds": steps * seconds_per_step}


def _time_phase(spec: Any, data: Any, engine: str, phase: str) -> tuple[float, int] | None:
    from train_zoo.programs import produce_mode

    timer = _StepTimer(phase)
    with contextlib.suppress(_TimingDoneError):
        produce_mode(spec, 0, data, engine, [timer])
    return timer.result()


def _time_vectorised(spec: Any, data: Any, group: int) -> tuple[float, int] | None:
    """Model-steps of the vectorised engine, which takes no callbacks: a group trained on
    the first batches of the training set for one epoch and for two; the difference is
    one epoch's steps without the setup and the evaluation."""
    import dataclasses

    from train_zoo.data import TrainingData
    from train_zoo.vectorised import train_vectorised

    examples = min(len(data.train), TIMED_STEPS * spec.recipe.batch_size)
    steps = math.ceil(examples / spec.recipe.batch_size)
    tiny = TrainingData(_head(data.train, examples), _head(data.test, 1))
    seconds = []
    for epochs in (1, 2):
        short = spec.replace(recipe=dataclasses.replace(spec.recipe, epochs=epochs),
                             modes=group, samples_per_mode=1)
        started = time.perf_counter()
        train_vectorised(short, list(range(group)), tiny)
        seconds.append(time.perf_counter() - started)
    one_epoch = seconds[1] - seconds[0]
    if one_epoch <= 0:  # timing noise beyond the epoch's cost: the whole second run
        one_epoch = seconds[1] / 2
    return one_epoch / (steps * group), steps


def _curvature_part(spec: Any, data: Any) -> dict[str, Any]:
    """Laplace's curvature (GGN or KFAC) of an untrained network on the first
    :data:`CURVATURE_EXAMPLES` training examples, scaled to the training set."""
    import dataclasses

    from posteriorzoo.errors import PosteriorZooError
    from train_zoo.methods import laplace
    from train_zoo.methods.common import parameters_of
    from train_zoo.methods.laplace import READ_BATCH
    from train_zoo.torch_engine import initial_model, torch_batches

    options = spec.method_options
    count = min(len(data.train), CURVATURE_EXAMPLES)
    subset = dataclasses.replace(data, train=_head(data.train, count))
    model = initial_model(spec, 0)
    params, buffers = parameters_of(model)
    prior = options["prior_precision"]
    batches = torch_batches(subset, dataclasses.replace(spec.recipe, batch_size=READ_BATCH),
                            0, augment=False)(0)
    started = time.perf_counter()
    try:
        laplace.init(model, params, buffers, batches, count, structure=options["structure"],
                     prior_precision=prior,
                     weight_decay=spec.recipe.weight_decay if prior == "training" else None)
    except PosteriorZooError as error:
        return {"phase": "laplace curvature", "seconds": None, "unavailable": str(error)}
    seconds = (time.perf_counter() - started) * len(data.train) / count * spec.modes
    return {"phase": "laplace curvature",
            "what": f"{spec.modes:,} x {options['structure']} on {len(data.train):,} "
                    f"examples (timed on {count:,})", "seconds": seconds}


def _evaluation_part(spec: Any, data: Any) -> dict[str, Any]:
    """Every checkpoint is evaluated on both splits: evaluations of the first
    :data:`EVALUATION_EXAMPLES` test examples give the cost per call and per example."""
    from train_zoo.torch_engine import evaluate, initial_model

    model = initial_model(spec, 0, training=False)
    evaluate(model, _head(data.test, 10))  # the first call builds kernels
    timings = []
    for count in sorted({min(len(data.test), n) for n in EVALUATION_EXAMPLES}):
        started = time.perf_counter()
        evaluate(model, _head(data.test, count))
        timings.append((count, time.perf_counter() - started))
    (small, first), (large, last) = timings[0], timings[-1]
    per_example = (last - first) / (large - small) if large > small else first / small
    per_call = max(0.0, first - per_example * small)
    examples = len(data.train) + len(data.test)
    return {"phase": "evaluation",
            "what": f"{spec.checkpoints:,} checkpoints x {examples:,} examples",
            "seconds": (2 * per_call + per_example * examples) * spec.checkpoints}
