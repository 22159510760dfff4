"""Does BBB's sigma train? The paper's settings against the ``trained-variance`` preset.

For each preset, one mode of OptuNet / Fashion-MNIST is trained with the optunet-mnist
recipe (60 epochs by default) on the fast engine, from the seeds of the shipped
single-mode BBB collection (``--seed`` 3, ``--mode`` 0), by the trainer itself
(:func:`train_zoo.programs.train_bbb`). Then, per layer (parameter tensor):

- the median learned ``sigma`` of each run;
- the mean-field optimum of ``sigma`` at the learned means of each run, from the diagonal
  of the Gauss-Newton matrix: ``sigma_i^2 = 1 / (H_ii / (N kl_weight) + 1 / prior_sigma^2)``
  with ``H = sum_n J_n^T H_n J_n`` the GGN of the summed cross-entropy over the N
  un-augmented training images (:func:`train_zoo.methods.laplace_curvature.full_ggn`).
  It minimises the second-order expansion ``E_q[NLL] ~ NLL(mu) + 1/2 sum_i H_ii
  sigma_i^2 / N`` plus ``kl_weight`` times the closed-form KL; the table shows its
  median;
- ratio: median learned ``sigma`` over the median optimum.

And the ELBO per example of each run's final posterior, ``-(E_q[NLL per example] +
kl_weight * KL)`` with the closed-form KL and ``E_q[NLL]`` over the whole training set
(``--elbo-samples`` weight draws): on the plain images, and on augmented ones as in
training (the objective itself; draw s sees crops of its own, the same for both runs).
The training loop's own estimate, the average over the last epoch (one minibatch and 3
weight samples a step, while the weights still move), is printed beside them: it is
noisier than the two final evaluations, which see every image in every draw.

Acceptance (the ``trained-variance`` preset): every layer's ratio within [1/2, 2], and
both final ELBOs above the paper's. The script exits with status 1 when either fails.

Run from the repository root (one training at a time; about 4 minutes in all on one
core)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bbb_variance.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bbb_variance.py --json out.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bbb_variance.py --quick      # smoke run
    # only the new preset, with an option changed (tuning):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bbb_variance.py --presets trained-variance \\
        --option rho_lr=0.02
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from train_zoo.data import TrainingData, load_training_data  # noqa: E402
from train_zoo.methods import bbb  # noqa: E402
from train_zoo.methods.common import logits, unflatten  # noqa: E402
from train_zoo.methods.laplace_curvature import full_ggn  # noqa: E402
from train_zoo.programs import BBBTrainingRun, train_bbb  # noqa: E402
from train_zoo.spec import ZooSpec, make_spec  # noqa: E402
from train_zoo.torch_engine import torch_batches  # noqa: E402

PRESETS = tuple(bbb.PRESETS)
#: The shipped single-mode BBB collection's base seed (specs/optunet-fashion-mnist-bbb.toml).
BASE_SEED = 3
READ_BATCH = 500           # images per batch when reading the training set
RATIO_BOUND = 2.0          # acceptance: learned / optimal median sigma within [1/2, 2]


def make_bbb_spec(preset: str, epochs: int, seed: int, options: dict[str, Any],
                  modes: int = 1) -> ZooSpec:
    """BBB on OptuNet / Fashion-MNIST with ``preset`` and ``options``, one sample a mode."""
    overrides = {} if epochs == 60 else {"epochs": epochs}
    return make_spec("optunet-mnist", name=f"bbb-{preset}", recipe_overrides=overrides,
                     dataset="fashion-mnist", method="bbb", modes=modes, samples_per_mode=1,
                     base_seed=seed, method_options={"preset": preset, **options})


def _read_batches(data: TrainingData, spec: ZooSpec, augment: bool = False, draw: int = 0):
    """The training set in batches of READ_BATCH: normalised only, or augmented as in
    training (draw ``draw``'s crops, the same for every run)."""
    recipe = dataclasses.replace(spec.recipe, batch_size=READ_BATCH)
    return torch_batches(data, recipe, 0, augment=augment)(draw)


def optimal_sigma(run: BBBTrainingRun, data: TrainingData, spec: ZooSpec,
                  kl_weight: float) -> dict[str, torch.Tensor]:
    """The GGN-diagonal mean-field optimum of sigma at the run's learned means."""
    mu = {name: value.detach() for name, value in run.state.mu.items()}
    ggn, _, count = full_ggn(run.model, mu, {}, _read_batches(data, spec))
    diagonal = unflatten(torch.diagonal(ggn).clone(), {k: v.double() for k, v in mu.items()})
    prior_precision = 1.0 / run.state.options.prior_sigma ** 2
    return {name: (1.0 / (diagonal[name] / (count * kl_weight) + prior_precision)).sqrt()
            for name in run.state.rho}


def evaluated_elbo(run: BBBTrainingRun, data: TrainingData, spec: ZooSpec, kl_weight: float,
                   samples: int, seed: int, augment: bool) -> dict[str, float]:
    """The ELBO per example at the run's final posterior: ``E_q[NLL per example]`` over
    the whole training set (``samples`` weight draws; augmented: draw s sees the
    training set with crops of its own, the same for every run), the closed-form KL."""
    model: nn.Module = run.model
    model.eval()
    plain = None if augment else list(_read_batches(data, spec))
    noise = bbb.draw_noise(run.state.rho, torch.Generator().manual_seed(seed), samples)
    total, count = 0.0, 0
    with torch.no_grad():
        for draw, eps in enumerate(noise):
            weights = bbb.sample_weights(run.state, eps)
            for x, y in plain if plain is not None else _read_batches(data, spec, True, draw):
                out = logits(model, weights, {}, x)
                total += float(nn.functional.cross_entropy(out.double(), y, reduction="sum"))
                count += len(y)
    nll = total / count
    kl = float(bbb.kl_divergence(run.state))
    return {"nll": nll, "kl": kl, "kl_weight": kl_weight, "elbo": -(nll + kl_weight * kl)}


def median(values: torch.Tensor) -> float:
    return float(torch.quantile(values.detach().reshape(-1).double(), 0.5))


def measure(preset: str, args: argparse.Namespace, data: TrainingData) -> dict[str, Any]:
    """Train one preset and measure it."""
    options = args.option if preset != "paper" else {}
    spec = make_bbb_spec(preset, args.epochs, args.seed, options, args.mode + 1)
    started = time.perf_counter()
    run = train_bbb(spec, args.mode, data, args.engine)
    seconds = time.perf_counter() - started
    kl_weight = run.state.options.kl_weight_for(len(data.train))
    optimum = optimal_sigma(run, data, spec, kl_weight)
    sigma = run.state.sigma
    layers = {}
    for name in run.state.rho:
        layers[name] = {"sigma": median(sigma[name]), "optimum": median(optimum[name]),
                        **run.record["layers"][name]}
        layers[name]["ratio"] = layers[name]["sigma"] / layers[name]["optimum"]
    last = run.record["elbo"]["last_epoch"]
    return {"preset": preset, "method_options": dict(spec.method_options),
            "train_seconds": seconds, "steps": run.steps, "engine": run.engine,
            "layers": layers, "training_record": run.record,
            "elbo_last_epoch": -last["negative_elbo"],
            "elbo_evaluated": evaluated_elbo(run, data, spec, kl_weight, args.elbo_samples,
                                             args.seed, augment=False),
            "elbo_augmented": evaluated_elbo(run, data, spec, kl_weight, args.elbo_samples,
                                             args.seed, augment=True)}


def print_table(results: dict[str, dict[str, Any]]) -> None:
    names = list(next(iter(results.values()))["layers"])
    header = f"{'layer':<14}"
    for preset in results:
        header += f" | {preset + ' sigma':>22} {'GGN optimum':>12} {'ratio':>7} {'max|drho|':>9}"
    print(header)
    print("-" * len(header))
    for name in names:
        line = f"{name:<14}"
        for result in results.values():
            layer = result["layers"][name]
            line += (f" | {layer['sigma']:>22.3e} {layer['optimum']:>12.3e} "
                     f"{layer['ratio']:>7.2f} {layer['rho_max_change']:>9.3f}")
        print(line)
    print()
    print(f"{'ELBO per example':<18} {'final, plain':>12} {'final, augmented':>16} "
          f"{'last epoch':>10} | {'E[NLL] plain':>12} {'E[NLL] aug.':>11} {'KL (nats)':>10} "
          f"{'kl_weight':>9}")
    for preset, result in results.items():
        plain, augmented = result["elbo_evaluated"], result["elbo_augmented"]
        print(f"{preset:<18} {plain['elbo']:>12.4f} {augmented['elbo']:>16.4f} "
              f"{result['elbo_last_epoch']:>10.4f} | {plain['nll']:>12.4f} "
              f"{augmented['nll']:>11.4f} {plain['kl']:>10.1f} {plain['kl_weight']:>9.3g}")


def verdict(results: dict[str, dict[str, Any]]) -> list[str]:
    """The acceptance failures (empty: passed)."""
    failures = []
    trained = results.get("trained-variance")
    if trained is None:
        return failures
    for name, layer in trained["layers"].items():
        if not 1 / RATIO_BOUND <= layer["ratio"] <= RATIO_BOUND:
            failures.append(f"{name}: learned / optimal sigma {layer['ratio']:.2f} is outside "
                            f"[{1 / RATIO_BOUND:g}, {RATIO_BOUND:g}]")
    paper = results.get("paper")
    if paper is not None:
        for key, label in (("elbo_evaluated", "final ELBO (plain images)"),
                           ("elbo_augmented", "final ELBO (augmented images)")):
            new, old = trained[key]["elbo"], paper[key]["elbo"]
            if not new > old:
                failures.append(f"{label} {new:.4f} is not above the paper's {old:.4f}")
    return failures


def _option(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS),
                        help="comma-separated presets to train (default: %(default)s)")
    parser.add_argument("--option", type=_option, action="append", default=[],
                        metavar="NAME=VALUE",
                        help="a bbb option for the runs other than paper (repeatable)")
    parser.add_argument("--epochs", type=int, default=60,
                        help="epochs of the recipe (default: %(default)s, the paper's)")
    parser.add_argument("--seed", type=int, default=BASE_SEED,
                        help="base seed of the spec (default: %(default)s, the shipped "
                             "BBB collection's)")
    parser.add_argument("--mode", type=int, default=0,
                        help="the mode of the spec to train (default: %(default)s)")
    parser.add_argument("--engine", choices=("fast", "torch"), default="fast",
                        help="training engine (default: %(default)s)")
    parser.add_argument("--elbo-samples", type=int, default=10,
                        help="weight draws for the evaluated ELBO (default: %(default)s)")
    parser.add_argument("--images", type=int, default=None,
                        help="train and measure on the first N training images only "
                             "(default: all 60,000; for a smoke run)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 500 training images, 1 epoch, 1 ELBO draw; the "
                             "acceptance is printed but not judged (exit 0)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write every number and the command as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.epochs, args.elbo_samples = 500, 1, 1
    args.presets = [name for name in args.presets.split(",") if name]
    unknown = sorted(set(args.presets) - set(PRESETS))
    if unknown or not args.presets:
        parser.error(f"--presets: choose from {', '.join(PRESETS)}")
    args.option = dict(args.option)
    if min(args.epochs, args.elbo_samples, args.threads, args.images or 1) < 1:
        parser.error("--epochs, --elbo-samples, --images and --threads must be at least 1")
    if args.mode < 0 or args.seed < 0:
        parser.error("--mode and --seed must be at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_training_data("fashion-mnist")
    if args.images is not None:
        train = data.train
        data = dataclasses.replace(data, train=dataclasses.replace(
            train, images=train.images[:args.images], labels=train.labels[:args.images]))
    results = {}
    for preset in args.presets:
        results[preset] = measure(preset, args, data)
        print(f"{preset}: trained {results[preset]['steps']} steps in "
              f"{results[preset]['train_seconds']:.0f} s ({results[preset]['engine']})",
              flush=True)
    print()
    print(f"OptuNet / Fashion-MNIST ({len(data.train)} training images), {args.epochs} "
          f"epochs, base seed {args.seed} mode {args.mode}; median sigma per layer")
    print_table(results)
    failures = verdict(results)
    print()
    if "trained-variance" in results:
        print("acceptance: " + ("PASS" if not failures else "FAIL\n  " + "\n  ".join(failures))
              + (" (a --quick run: not judged)" if args.quick else ""))
    if args.json:
        record = {"command": shlex.join([sys.executable, *sys.argv]), "results": results,
                  "failures": failures, "torch": torch.__version__}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2, default=float) + "\n",
                             encoding="utf-8")
        print(f"wrote {args.json}")
    return 1 if failures and not args.quick else 0


if __name__ == "__main__":
    sys.exit(main())
