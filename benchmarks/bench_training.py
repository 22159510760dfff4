"""Benchmark OptuNet training throughput: plain PyTorch against the numba fast path.

Everything runs side by side in one invocation, on the same data and recipe: OptuNet,
batch 64, the ``optunet-mnist`` recipe (SGD, lr 0.04, weight decay 2e-4) with random-crop
padding 4, on Fashion-MNIST when its files are installed, else on ``digits``. Each row
trains fresh models (checkpoint indices 0, 1, ... of base seed 0, so every process has its
own weights and batch order) for ``--steps`` timed optimiser steps per model after an
untimed warm-up, and reports **model-steps per second** summed over the processes that run
at the same time (start and stop are synchronised with a barrier; the wall time is from
the first start to the last stop):

(a) **baseline**: plain PyTorch, one model per core: 2 processes, each with
    ``torch.set_num_threads(1)``, running the torch engine's inner loop
    (``train_zoo.torch_engine.train_torch``: ``iterate_batches`` with the recipe's
    augmentation, forward, cross-entropy, backward, ``SGD.step``, ``loss.item()``);
(b) plain PyTorch, one process with 2 threads;
(c) the fast path (``train_zoo.fast``), 2 processes with one thread each, running
    ``train_fast``'s inner loop (the same batches via ``iterate_batches`` and the numba
    batch preparation, then one numba step);
(c-maths) the fast path's maths alone: the same, cycling through 64 batches prepared
    before the timing (forward, backward and SGD only);
(c-data) the fast path's data preparation alone (its batches, no training);
(d) hook for the vectorised torch.func engine (``train_zoo.vectorised``): measured only if
    ``train_zoo.vectorised.supports(spec)`` is true when this runs, else "not available".
    It is timed as one whole ``train_vectorised`` call (16 models in lockstep, 2 threads,
    one epoch of ``max(50, --steps / 10)`` batches of a training subset) and therefore
    includes its final evaluation on that subset and on a 1,000-example test split.

Data preparation (batch order, crop, normalisation) is inside the timed loop of (a), (b),
(c) and (d): that is what training costs. Ratios are against (a). Every row is measured
``--repeats`` times, the rows interleaved, and the best run is reported (other load on a
shared machine only ever slows a run down); all runs are in the ``--json`` record. The
numbers still vary by tens of percent between invocations on a shared machine.

Then what a user meets, which the steady state leaves out:

(e) **stages of one checkpoint**, per engine, in this process: loading the data set (once
    per process: the trainer's parent and each worker), training it (``--e2e-epochs``
    epochs of the recipe), evaluating it on both splits (the trainer records the loss and
    accuracy of every checkpoint), and committing it to a collection; each stage's share;
(f) **end to end**: ``posteriorzoo train SPEC --engine fast`` against ``--engine torch``
    (each a fresh command, the default local backend, one worker per core) on a
    Deep-Ensemble spec of ``--e2e-modes`` networks and ``--e2e-epochs`` epochs: the
    model-steps/s the command reports (its own clock, from the start of the training
    to the last commit) and the command's wall time, and their ratio.

Run from the repository root::

    .venv/bin/python benchmarks/bench_training.py                 # a few minutes
    .venv/bin/python benchmarks/bench_training.py --quick         # smoke run, seconds
    .venv/bin/python benchmarks/bench_training.py --json benchmarks/output/training.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

BATCH_SIZE = 64
CROP_PADDING = 4
BASE_SEED = 0  # checkpoint i of this base seed: init, data order and augmentation
WARMUP_STEPS = 30
MATHS_BATCHES = 64
VECTORISED_MODELS = 16  # models trained in lockstep by the vectorised engine's hook row
E2E_SEED = 5  # base seed of the end-to-end spec


def pick_dataset() -> str:
    """``fashion-mnist`` if its files are on disk (no download), else ``digits``."""
    from posteriorzoo.data import dataset_files
    from posteriorzoo.errors import PosteriorZooError

    try:
        dataset_files("fashion-mnist", download=False)
    except PosteriorZooError:
        return "digits"
    return "fashion-mnist"


def make_bench_spec(dataset: str) -> Any:
    """The spec every row trains: OptuNet, batch 64, crop padding 4, many epochs."""
    from train_zoo import make_spec

    return make_spec("optunet-mnist", dataset=dataset, base_seed=BASE_SEED,
                     recipe_overrides={"batch_size": BATCH_SIZE, "crop_padding": CROP_PADDING,
                                       "epochs": 10_000, "milestones": []})


# ------------------------------------------------------------------ workers
def _torch_steps(spec: Any, index: int, data: Any) -> Iterator[float]:
    """The torch engine's inner loop, one yielded loss per optimiser step."""
    import torch
    from torch import nn

    from posteriorzoo.data import iterate_batches
    from train_zoo.data import train_transform
    from train_zoo.seeds import checkpoint_seeds
    from train_zoo.torch_engine import initial_model

    recipe = spec.recipe
    seeds = checkpoint_seeds(spec.base_seed, index)
    model = initial_model(spec, seeds.init)
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=recipe.momentum,
                                nesterov=recipe.nesterov, weight_decay=recipe.weight_decay)
    augment = train_transform(recipe, data.train)
    for epoch in range(recipe.epochs):
        for group in optimizer.param_groups:
            group["lr"] = recipe.learning_rate(epoch)
        model.train()
        for images, labels in iterate_batches(data.train, recipe.batch_size, seed=seeds.data,
                                              epoch=epoch, transform=augment):
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            loss_value = loss.item()
            if not np.isfinite(loss_value):
                raise RuntimeError("the benchmark run diverged")
            yield loss_value


def _fast_parts(spec: Any, index: int, data: Any) -> tuple[Any, Any, Any]:
    from train_zoo.data import train_transform
    from train_zoo.fast import FastNet, FastTransform, describe_model
    from train_zoo.seeds import checkpoint_seeds
    from train_zoo.torch_engine import initial_model

    seeds = checkpoint_seeds(spec.base_seed, index)
    model = initial_model(spec, seeds.init)
    net = FastNet(describe_model(model, data.train.image_shape), model.state_dict(),
                  spec.recipe)
    augment = FastTransform(train_transform(spec.recipe, data.train), data.train.image_shape)
    return net, augment, seeds


def _fast_batches_forever(spec: Any, data: Any, augment: Any, seed: int
                          ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    from train_zoo.fast import fast_batches

    for epoch in range(spec.recipe.epochs):
        for x, labels in fast_batches(data.train, spec.recipe.batch_size, seed, epoch, augment):
            yield epoch, x, labels


def _fast_steps(spec: Any, index: int, data: Any) -> Iterator[float]:
    """``train_fast``'s inner loop (batches included), one yielded loss per step."""
    net, augment, seeds = _fast_parts(spec, index, data)
    for epoch, x, labels in _fast_batches_forever(spec, data, augment, seeds.data):
        loss = net.step((x, labels), spec.recipe.learning_rate(epoch))
        if not np.isfinite(loss):
            raise RuntimeError("the benchmark run diverged")
        yield loss


def _fast_maths(spec: Any, index: int, data: Any) -> Iterator[float]:
    """The fast step alone on batches prepared beforehand (cycled)."""
    net, augment, seeds = _fast_parts(spec, index, data)
    prepared = []
    for _, x, labels in _fast_batches_forever(spec, data, augment, seeds.data):
        prepared.append((x.copy(), labels.copy()))
        if len(prepared) == MATHS_BATCHES:
            break
    lr = spec.recipe.learning_rate(0)
    step = 0
    while True:
        x, labels = prepared[step % MATHS_BATCHES]
        yield net.step((x, labels), lr)
        step += 1


def _fast_data(spec: Any, index: int, data: Any) -> Iterator[float]:
    """The fast path's batches alone (no training)."""
    _, augment, seeds = _fast_parts(spec, index, data)
    for _ in _fast_batches_forever(spec, data, augment, seeds.data):
        yield 0.0


LOOPS = {"torch": _torch_steps, "fast": _fast_steps, "fast-maths": _fast_maths,
         "fast-data": _fast_data}


def worker(loop: str, index: int, threads: int, dataset: str, steps: int, barrier: Any,
           results: Any, warmup: int = WARMUP_STEPS) -> None:
    """One process of a row: warm up, wait for the others, time ``steps`` steps."""
    import torch

    torch.set_num_threads(threads)
    from train_zoo.data import load_training_data

    data = load_training_data(dataset)
    spec = make_bench_spec(dataset)
    iterator = LOOPS[loop](spec, index, data)
    for _ in range(warmup):
        next(iterator)
    barrier.wait()
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    stop = time.perf_counter()
    results.put((index, start, stop))


def run_row(loop: str, processes: int, threads: int, dataset: str, steps: int,
            inline: bool = False) -> dict[str, Any]:
    """Run ``processes`` workers at once; returns model-steps/s and per-process rates.
    ``inline``: one worker in this process (the smoke run: no process start-up)."""
    if inline:
        processes, results = 1, queue.Queue()
        worker(loop, 0, threads, dataset, steps, threading.Barrier(1), results, warmup=2)
        timings = [results.get()]
    else:
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(processes)
        results = context.Queue()
        jobs = [context.Process(target=worker, args=(loop, i, threads, dataset, steps,
                                                     barrier, results))
                for i in range(processes)]
        for job in jobs:
            job.start()
        timings = [results.get(timeout=3600) for _ in jobs]
        for job in jobs:
            job.join()
            if job.exitcode:
                raise RuntimeError(f"a {loop} worker failed (exit code {job.exitcode})")
    wall = max(stop for _, _, stop in timings) - min(start for _, start, _ in timings)
    return {"loop": loop, "processes": processes, "threads": threads, "steps": steps,
            "wall_s": wall, "model_steps_per_s": processes * steps / wall,
            "per_process_steps_per_s": [steps / (stop - start) for _, start, stop in timings]}


def vectorised_row(dataset: str, steps: int, models: int = VECTORISED_MODELS
                   ) -> dict[str, Any] | None:
    """Hook for the vectorised engine: None unless it supports the benchmark spec."""
    import torch

    from posteriorzoo.data import ArrayDataset
    from train_zoo import vectorised
    from train_zoo.data import TrainingData, load_training_data

    spec = make_bench_spec(dataset)
    if not vectorised.supports(spec):
        return None
    subset = max(50, steps // 10) * BATCH_SIZE
    full = load_training_data(dataset)

    def head(split: ArrayDataset, count: int) -> ArrayDataset:
        count = min(count, len(split))
        return ArrayDataset(split.images[:count], split.labels[:count], split.num_classes,
                            split.name, split.split, split.mean, split.std)

    data = TrainingData(head(full.train, subset), head(full.test, 1000))
    spec = spec.replace(recipe=spec.recipe.with_epochs(1))
    torch.set_num_threads(2)
    warm_up = TrainingData(head(full.train, 4 * BATCH_SIZE), head(full.test, 100))
    vectorised.train_vectorised(spec, [0, 1], warm_up)
    start = time.perf_counter()
    vectorised.train_vectorised(spec, list(range(models)), data)
    wall = time.perf_counter() - start
    model_steps = models * -(-len(data.train) // BATCH_SIZE)
    return {"loop": "vectorised", "processes": 1, "threads": 2, "models": models,
            "steps": model_steps // models, "wall_s": wall,
            "model_steps_per_s": model_steps / wall, "per_process_steps_per_s": []}


# ------------------------------------------------------------------ what a user meets
def e2e_spec_text(dataset: str, modes: int, epochs: int) -> str:
    """The end-to-end spec: a Deep Ensemble of the optunet-mnist recipe."""
    return (f'name = "bench-training-e2e"\nrecipe = "optunet-mnist"\ndataset = "{dataset}"\n'
            f'method = "de"\ncheckpoints = {modes}\nbase_seed = {E2E_SEED}\n\n'
            f"[recipe_overrides]\nepochs = {epochs}\n")


def stages(dataset: str, epochs: int, folder: Path) -> dict[str, dict[str, float]]:
    """Seconds of each stage of one checkpoint, per engine, in this process (see (e)).
    Run first in the process, so that the data set is not loaded yet."""
    import torch

    from posteriorzoo.zoo import create_zoo
    from train_zoo import make_spec
    from train_zoo.data import load_training_data
    from train_zoo.fast import engine as fast_engine
    from train_zoo.seeds import checkpoint_seeds
    from train_zoo.torch_engine import evaluate, finish, initial_model
    from train_zoo.torch_engine import train_base as torch_train_base

    torch.set_num_threads(1)
    clock = time.perf_counter()
    data = load_training_data(dataset)
    loading = time.perf_counter() - clock
    spec = make_spec("optunet-mnist", dataset=dataset, method="de", checkpoints=1,
                     base_seed=E2E_SEED, recipe_overrides={"epochs": epochs})
    trainers = {"fast": lambda: fast_engine.train_base(spec, 0, data)[:2],
                "torch": lambda: torch_train_base(spec, 0, data)}
    measures = {"fast": fast_engine.evaluate, "torch": evaluate}
    out: dict[str, dict[str, float]] = {}
    for name in ("fast", "torch"):
        clock = time.perf_counter()
        model, steps = trainers[name]()
        trained = time.perf_counter() - clock
        clock = time.perf_counter()
        result = finish(spec, 0, model, checkpoint_seeds(E2E_SEED, 0), steps, clock, name,
                        data, measure=measures[name])
        evaluated = time.perf_counter() - clock
        clock = time.perf_counter()
        template = initial_model(spec, 0, training=False).state_dict()
        with create_zoo(folder / f"stages-{name}.h5", architecture=spec.architecture,
                        dataset=dataset, method="de", num_classes=data.train.num_classes,
                        template=template, recipe=spec.collection_recipe()) as zoo:
            zoo.append_many([result.state], [result.metadata(epochs, spec.recipe_hash,
                                                             "bench")])
        committed = time.perf_counter() - clock
        out[name] = {"data loading (once per process)": loading, "training": trained,
                     "evaluation (both splits)": evaluated, "commit": committed,
                     "steps": steps}
    return out


def end_to_end(dataset: str, modes: int, epochs: int, folder: Path
               ) -> dict[str, dict[str, Any]]:
    """``posteriorzoo train`` with each engine, as a user runs it (see (f))."""
    spec = folder / "e2e.toml"
    spec.write_text(e2e_spec_text(dataset, modes, epochs), encoding="utf-8")
    command = [sys.executable, "-m", "posteriorzoo", "train", str(spec), "--no-progress",
               "--json"]
    out = {}
    for engine in ("fast", "torch"):
        target = folder / f"e2e-{engine}.h5"
        clock = time.perf_counter()
        done = subprocess.run([*command, "--engine", engine, "--out", str(target)],
                              capture_output=True, text=True, check=False)
        wall = time.perf_counter() - clock
        if done.returncode:
            raise RuntimeError(f"posteriorzoo train --engine {engine} failed:\n{done.stderr}")
        summary = json.loads(done.stdout)
        out[engine] = {"steps": summary["steps"], "train_seconds": summary["seconds"],
                       "model_steps_per_s": summary["steps"] / summary["seconds"],
                       "command_wall_s": wall,
                       "model_steps_per_s_command": summary["steps"] / wall}
    return out


def print_user_view(stage_times: dict[str, dict[str, float]],
                    e2e: dict[str, dict[str, Any]] | None, modes: int, epochs: int) -> None:
    print(f"\n(e) one checkpoint, {epochs} epoch(s), stage by stage (seconds; share of the "
          "checkpoint's total)")
    for engine, times in stage_times.items():
        parts = {k: v for k, v in times.items() if k != "steps"}
        total = sum(parts.values())
        shares = ", ".join(f"{name} {seconds:.2f} ({100 * seconds / total:.0f}%)"
                           for name, seconds in parts.items())
        print(f"  {engine:6} {total:6.2f} s: {shares}")
    if e2e is None:
        print("\n(f) end to end: not run with --quick")
        return
    fast, slow = e2e["fast"], e2e["torch"]
    print(f"\n(f) end to end: posteriorzoo train, {modes} modes x {epochs} epoch(s)")
    for engine, row in e2e.items():
        print(f"  --engine {engine:6} {row['model_steps_per_s']:8.0f} model-steps/s "
              f"({row['steps']} steps in {row['train_seconds']:.1f} s); the whole command "
              f"{row['command_wall_s']:.1f} s")
    print(f"  fast / torch: {fast['model_steps_per_s'] / slow['model_steps_per_s']:.1f}x as "
          f"reported, {slow['command_wall_s'] / fast['command_wall_s']:.1f}x in command "
          "wall time")


# ------------------------------------------------------------------ main
ROWS = [
    ("a", "torch, 2 processes x 1 thread (baseline)", "torch", 2, 1),
    ("b", "torch, 1 process x 2 threads", "torch", 1, 2),
    ("c", "fast, 2 processes x 1 thread", "fast", 2, 1),
    ("c-maths", "  fast maths alone (batches prepared beforehand)", "fast-maths", 2, 1),
    ("c-data", "  fast data preparation alone (batches/s)", "fast-data", 2, 1),
]


def warm_numba_cache(dataset: str) -> None:
    """Compile (or load) the numba kernels once, before the workers start."""
    from train_zoo.data import load_training_data

    data = load_training_data(dataset)
    spec = make_bench_spec(dataset)
    loop = _fast_steps(spec, 0, data)
    next(loop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: digits, 20 / 100 steps in this process, one repeat, "
                             "a 2-model vectorised row, the stages of a 1-epoch checkpoint; "
                             "no end-to-end run (f)")
    parser.add_argument("--steps", type=int, default=2000,
                        help="timed steps per model for the torch rows (default 2000)")
    parser.add_argument("--fast-steps", type=int, default=None,
                        help="timed steps per model for the fast rows (default 5 x --steps)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="measure every row this many times, report the best (default 2)")
    parser.add_argument("--dataset", default=None,
                        help="dataset name (default: fashion-mnist if installed, else digits)")
    parser.add_argument("--e2e-modes", type=int, default=8,
                        help="networks of the end-to-end spec (default %(default)s)")
    parser.add_argument("--e2e-epochs", type=int, default=2,
                        help="epochs of the end-to-end spec and of the stages (default "
                             "%(default)s)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write the results, command, versions and seeds as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.dataset = args.dataset or "digits"
        args.steps, args.fast_steps, args.repeats = 20, 100, 1
        args.e2e_epochs = 1
    fast_steps = args.fast_steps or 5 * args.steps

    import numba
    import torch

    from posteriorzoo.provenance import library_versions

    dataset = args.dataset or pick_dataset()
    versions = {**library_versions(), "numba": numba.__version__}
    print(f"OptuNet training throughput: {dataset}, batch {BATCH_SIZE}, crop padding "
          f"{CROP_PADDING}, recipe optunet-mnist, {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()}), torch {torch.__version__} "
          f"(CPU capability {torch.backends.cpu.get_cpu_capability()}), "
          f"numba {numba.__version__}")
    print(f"timed steps per model: torch {args.steps}, fast {fast_steps} "
          f"(after {WARMUP_STEPS} warm-up steps), best of {args.repeats} interleaved "
          f"repeats; checkpoint seeds of base seed {BASE_SEED}")
    with tempfile.TemporaryDirectory(prefix="bench-training-") as folder:
        stage_times = stages(dataset, args.e2e_epochs, Path(folder))  # first: data not loaded
        e2e = None if args.quick else end_to_end(dataset, args.e2e_modes, args.e2e_epochs,
                                                 Path(folder))
    warm_numba_cache(dataset)
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key, *_ in ROWS}
    for _ in range(args.repeats):  # rows interleaved, so slow phases of the machine spread
        for key, _, loop, processes, threads in ROWS:
            steps = args.steps if loop == "torch" else fast_steps
            runs[key].append(run_row(loop, processes, threads, dataset, steps,
                                     inline=args.quick))
    rows: dict[str, dict[str, Any]] = {}
    for key, label, *_ in ROWS:
        best = max(runs[key], key=lambda run: run["model_steps_per_s"])
        rows[key] = {"label": label, **best,
                     "all_model_steps_per_s": [r["model_steps_per_s"] for r in runs[key]]}
    try:
        vectorised = vectorised_row(dataset, args.steps, 2 if args.quick else VECTORISED_MODELS)
        vectorised_error = None
    except Exception as error:  # another team's engine in progress must not sink the rest
        vectorised, vectorised_error = None, f"{type(error).__name__}: {error}"
    baseline = rows["a"]["model_steps_per_s"]
    print()
    if args.quick:
        print("(--quick: every row is one worker in this process, a smoke run, not a "
              "measurement)")
    print(f"{'row':8} {'what':58} {'model-steps/s':>14} {'x (a)':>7}   per process")
    for key, row in rows.items():
        per = ", ".join(f"{r:.0f}" for r in row["per_process_steps_per_s"])
        row["ratio_vs_a"] = row["model_steps_per_s"] / baseline
        print(f"{key:8} {row['label']:58} {row['model_steps_per_s']:14.0f} "
              f"{row['ratio_vs_a']:7.2f}   {per}")
    models = 2 if args.quick else VECTORISED_MODELS
    label = f"vectorised (torch.func), {models} models, 1 process x 2 threads"
    if vectorised_error is not None:
        print(f"{'d':8} {label:58} {'failed':>14}   ({vectorised_error})")
    elif vectorised is None:
        print(f"{'d':8} {label:58} {'not available':>14}   "
              "(train_zoo.vectorised.supports(spec) is False)")
    else:
        vectorised["ratio_vs_a"] = vectorised["model_steps_per_s"] / baseline
        rows["d"] = {"label": label, **vectorised}
        print(f"{'d':8} {label:58} {vectorised['model_steps_per_s']:14.0f} "
              f"{vectorised['ratio_vs_a']:7.2f}   (includes its final evaluation)")
    print()
    print(f"fast path vs baseline: {rows['c']['ratio_vs_a']:.1f}x with data preparation, "
          f"{rows['c-maths']['ratio_vs_a']:.1f}x maths alone")
    print_user_view(stage_times, e2e, args.e2e_modes, args.e2e_epochs)
    if args.json:
        from train_zoo.seeds import checkpoint_seeds

        record = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "versions": versions,
            "dataset": dataset, "batch_size": BATCH_SIZE, "crop_padding": CROP_PADDING,
            "recipe": make_bench_spec(dataset).recipe.to_dict(),
            "base_seed": BASE_SEED,
            "seeds": {i: vars(checkpoint_seeds(BASE_SEED, i)) for i in range(2)},
            "warmup_steps": WARMUP_STEPS, "repeats": args.repeats,
            "cpu_count": os.cpu_count(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "rows": rows, "vectorised_available": vectorised is not None,
            "stages": stage_times, "end_to_end": e2e, "quick": args.quick,
            "e2e_spec": e2e_spec_text(dataset, args.e2e_modes, args.e2e_epochs),
            "vectorised_error": vectorised_error,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
