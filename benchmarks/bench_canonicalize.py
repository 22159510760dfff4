"""Benchmark the canonicalizer and the min-mass solvers (``posteriorzoo.symmetry``).

Side by side in one run, on the bundled Fashion-MNIST OptuNets
(``posteriorzoo.reference``, the 1000-checkpoint target collection):

1. **Canonicalize** (first + norm + softmax) N OptuNets (default 10,000: the 1000
   reference checkpoints, each also under 9 random symmetries from
   ``sample_permutations`` and log-uniform scales in [0.1, 10], seed ``--seed``):

   * ``canonicalize_batch``: the whole batch in one vectorised call (structure traced
     once, outside the timing; the tensors are already float64 in memory);
   * ``posteriorzoo.collection.canonicalize``: file to file, HDF5 in and out, including tracing,
     reading, float32 storage, digests and metadata;
   * baseline: one checkpoint at a time through the same code (``canonicalize_state``
     with B = 1, structure traced once), and the public per-checkpoint
     ``canonicalize(name, state)``, which traces the network on every call; both are run
     on ``--baseline`` checkpoints and extrapolated linearly to N (said in the output).

   The batched result is checked against the one-at-a-time result (largest difference).

2. **Min-mass** on M OptuNets (default 1000): the batched Newton solver (``fast``) vs
   the cvxpy reference (Clarabel, one checkpoint at a time) on the same checkpoints;
   the largest relative difference of the minimum masses is printed.

3. **Min-mass on one full ResNet-18** (100 classes, 11.2 M parameters, 2880 unknowns;
   a random init with random BatchNorm weights and statistics, seed ``--seed``): fast vs
   cvxpy, total time and the solver's share.

Absolute times on these shared 2-core machines are noisy; the ratios are what to compare.
Run from the repository root::

    .venv/bin/python benchmarks/bench_canonicalize.py            # full run, ~1 minute
    .venv/bin/python benchmarks/bench_canonicalize.py --quick    # smoke run
    .venv/bin/python benchmarks/bench_canonicalize.py --json benchmarks/output/canon.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posteriorzoo.collection import canonicalize as canonicalize_file
from posteriorzoo.models import build, input_shape
from posteriorzoo.provenance import library_versions
from posteriorzoo.reference import open_reference
from posteriorzoo.symmetry import (
    apply_symmetry_batch,
    canonicalize,
    sample_permutations,
)
from posteriorzoo.symmetry.canonical import canonicalize_batch, canonicalize_state
from posteriorzoo.symmetry.minmass import mass_problem, solve_min_mass_batch
from posteriorzoo.symmetry.structure import trace_structure
from posteriorzoo.zoo import create_zoo


def timed(function: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def optunet_batch(count: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` float64 OptuNets: the reference target, then random symmetric copies."""
    with open_reference("target") as zoo:
        base = {key: torch.from_numpy(zoo.layer(key)).double() for key in zoo.state_keys}
    structure = trace_structure(build("optunet").double(), input_shape("optunet"))
    rng = np.random.default_rng(seed)
    parts, have = [], 0
    while have < count:
        take = min(count - have, len(base["conv1.weight"]))
        chunk = {key: value[:take] for key, value in base.items()}
        if have:  # copies after the first: a random group element per checkpoint
            permutations = [sample_permutations(structure, rng) for _ in range(take)]
            scales = {i: np.exp(rng.uniform(np.log(0.1), np.log(10.0), (take, structure.spaces[
                structure.scales[i].space].size))) for i in structure.scalable()}
            chunk = apply_symmetry_batch(
                chunk, structure, {i: np.stack([p[i] for p in permutations])
                                   for i in permutations[0]}, scales,
                rng.standard_normal(take))
        parts.append(chunk)
        have += take
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def bench_canonicalize(count: int, baseline: int, seed: int, workdir: Path) -> dict[str, Any]:
    batch = optunet_batch(count, seed)
    structure = trace_structure(build("optunet").double(), input_shape("optunet"))
    canonicalize_batch({k: v[:8] for k, v in batch.items()}, structure)  # warm-up
    batched_time, (canonical, _) = timed(lambda: canonicalize_batch(batch, structure))
    rows = range(min(baseline, count))

    def one_at_a_time() -> list[dict[str, torch.Tensor]]:
        return [canonicalize_state({k: v[i] for k, v in batch.items()}, structure)[0]
                for i in rows]

    single_time, singles = timed(one_at_a_time)
    difference = max(float((canonical[key][i] - singles[i][key]).abs().max())
                     for i in rows for key in singles[0])
    public_time, _ = timed(lambda: [canonicalize("optunet", {k: v[i] for k, v in
                                                             batch.items()}) for i in rows])
    path = workdir / "optunets.h5"
    with create_zoo(path, architecture="optunet", dataset="fashion-mnist", method="de",
                    num_classes=10, template={k: v[0].float() for k, v in batch.items()}
                    ) as zoo:
        zoo.append_many([{k: v[i].float() for k, v in batch.items()} for i in range(count)],
                        [{"seed": i} for i in range(count)])
    file_time, summary = timed(lambda: canonicalize_file(path, workdir / "canon.h5"))
    assert summary.checkpoints == count
    per = len(rows)
    return {"checkpoints": count, "batched_s": batched_time, "file_to_file_s": file_time,
            "baseline_checkpoints": per,
            "one_at_a_time_s_extrapolated": single_time / per * count,
            "public_per_checkpoint_s_extrapolated": public_time / per * count,
            "largest_difference_batched_vs_single": difference}


def bench_min_mass(count: int, seed: int) -> dict[str, Any]:
    batch = {k: v[:count] for k, v in optunet_batch(count, seed).items()}
    structure = trace_structure(build("optunet").double(), input_shape("optunet"))
    problem = mass_problem(structure, {k: v[0] for k, v in batch.items()})
    solve_min_mass_batch({k: v[:4] for k, v in batch.items()}, structure, "fast", problem)
    fast_time, fast = timed(lambda: solve_min_mass_batch(batch, structure, "fast", problem))
    cvxpy_time, reference = timed(lambda: solve_min_mass_batch(batch, structure, "cvxpy",
                                                               problem))
    relative = np.abs(fast.mass_after - reference.mass_after) / reference.mass_after
    return {"checkpoints": count, "fast_s": fast_time, "cvxpy_s": cvxpy_time,
            "max_relative_mass_difference": float(relative.max()),
            "fast_lower_or_equal": int((fast.mass_after <= reference.mass_after).sum()),
            "newton_iterations_max": int(fast.iterations.max()),
            "mass_before_median": float(np.median(fast.mass_before)),
            "mass_after_median": float(np.median(fast.mass_after))}


def bench_resnet(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = build("resnet18", num_classes=100).double()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.2, 0.2)
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    state = {key: value[None] for key, value in model.state_dict().items()}
    structure = trace_structure(model, input_shape("resnet18"))
    problem = mass_problem(structure, model.state_dict())
    result: dict[str, Any] = {"unknowns": problem.size, "pairs": len(problem.rows)}
    for solver in ("fast", "cvxpy"):
        seconds, solved = timed(lambda s=solver: solve_min_mass_batch(state, structure, s,
                                                                      problem))
        result[f"{solver}_s"] = seconds
        result[f"{solver}_mass_after"] = float(solved.mass_after[0])
        result["mass_before"] = float(solved.mass_before[0])
    # the solver alone, on the aggregated problem (the rest is shared bookkeeping)
    from posteriorzoo.symmetry import minmass

    mass = problem.pair_mass(state)
    active = minmass._active(problem, mass)
    result["fast_solver_only_s"], _ = timed(lambda: minmass._newton(problem, mass, active))
    result["cvxpy_solver_only_s"], _ = timed(lambda: minmass._cvxpy(
        problem, mass[0].numpy(), active[0].numpy()))
    result["relative_mass_difference"] = (abs(result["fast_mass_after"]
                                              - result["cvxpy_mass_after"])
                                          / result["cvxpy_mass_after"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", type=int, default=10_000,
                        help="OptuNets to canonicalize (default: %(default)s)")
    parser.add_argument("--baseline", type=int, default=300,
                        help="checkpoints run one at a time for the baselines, extrapolated "
                             "(default: %(default)s)")
    parser.add_argument("--min-mass", type=int, default=1000,
                        help="OptuNets for fast vs cvxpy min-mass (default: %(default)s)")
    parser.add_argument("--no-resnet", action="store_true", help="skip the ResNet-18 part")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 500 / 50 / 50 checkpoints, no ResNet")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random symmetries")
    parser.add_argument("--workdir", type=Path, default=None, help="for temporary files")
    parser.add_argument("--json", type=Path, default=None, help="also write every number")
    args = parser.parse_args(argv)
    if args.quick:
        args.checkpoints, args.baseline, args.min_mass, args.no_resnet = 500, 50, 50, True
    torch.set_num_threads(2)
    print(f"torch threads: {torch.get_num_threads()}, {platform.processor() or 'cpu'}")
    with tempfile.TemporaryDirectory(dir=args.workdir) as folder:
        canon = bench_canonicalize(args.checkpoints, args.baseline, args.seed, Path(folder))
    n = canon["checkpoints"]
    print(f"\n1. canonicalize first+norm+softmax, {n} OptuNets")
    print(f"   batched (one call)             {canon['batched_s']:8.3f} s")
    print(f"   file to file (HDF5 in and out) {canon['file_to_file_s']:8.3f} s")
    print(f"   one at a time, same code       {canon['one_at_a_time_s_extrapolated']:8.3f} s "
          f"(extrapolated from {canon['baseline_checkpoints']}; "
          f"{canon['one_at_a_time_s_extrapolated'] / canon['batched_s']:.0f}x the batch)")
    print(f"   canonicalize() per checkpoint  "
          f"{canon['public_per_checkpoint_s_extrapolated']:8.3f} s (extrapolated; traces "
          f"every call; {canon['public_per_checkpoint_s_extrapolated'] / canon['batched_s']:.0f}"
          f"x the batch)")
    print(f"   largest |batched - one at a time|: "
          f"{canon['largest_difference_batched_vs_single']:.1e}")
    mm = bench_min_mass(args.min_mass, args.seed)
    print(f"\n2. min-mass, {mm['checkpoints']} OptuNets")
    print(f"   fast (batched Newton) {mm['fast_s']:8.3f} s")
    print(f"   cvxpy (Clarabel)      {mm['cvxpy_s']:8.3f} s  "
          f"({mm['cvxpy_s'] / mm['fast_s']:.0f}x the fast solver)")
    print(f"   largest relative mass difference {mm['max_relative_mass_difference']:.1e}; "
          f"median mass {mm['mass_before_median']:.2f} -> {mm['mass_after_median']:.2f}; "
          f"at most {mm['newton_iterations_max']} Newton iterations")
    results: dict[str, Any] = {"canonicalize": canon, "min_mass_optunet": mm}
    if not args.no_resnet:
        rn = bench_resnet(args.seed)
        results["min_mass_resnet18"] = rn
        print(f"\n3. min-mass, one ResNet-18 (100 classes; {rn['unknowns']} unknowns, "
              f"{rn['pairs']} unit pairs)")
        print(f"   fast   {rn['fast_s']:7.3f} s total, solver {rn['fast_solver_only_s']:.3f} s")
        print(f"   cvxpy  {rn['cvxpy_s']:7.3f} s total, solver {rn['cvxpy_solver_only_s']:.3f} s "
              f"({rn['cvxpy_solver_only_s'] / rn['fast_solver_only_s']:.1f}x the fast solver)")
        print(f"   mass {rn['mass_before']:.1f} -> {rn['fast_mass_after']:.4f}; relative "
              f"difference fast vs cvxpy {rn['relative_mass_difference']:.1e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": shlex.join([sys.executable, *sys.argv]),
                  "versions": library_versions(), "seed": args.seed, "results": results}
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
