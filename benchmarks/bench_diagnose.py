"""Benchmark the chain statistics of ``diagnose``: bulk ESS and rank-normalised split
R-hat of every weight, vectorised (``posteriorzoo._ess_rhat``) against arviz-stats' own
per-coordinate loop, side by side in one run on the same draws.

The draws are AR(1) chains (correlations from 0 to 0.95) of the shape an SGHMC
collection has (``--chains`` chains of ``--draws`` draws). arviz-stats runs on the first
``--oracle-coordinates`` coordinates (it takes about 0.7 ms each), the vectorised code on
all ``--coordinates``; both rates are per coordinate, with their ratio, the largest
relative difference on the shared coordinates, and the time for the 11.2 M weights of a
ResNet-18 chain at each rate.

    .venv/bin/python benchmarks/bench_diagnose.py            # about a minute
    .venv/bin/python benchmarks/bench_diagnose.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Weights of a CIFAR ResNet-18 (posteriorzoo's resnet18, 10 classes).
RESNET18_WEIGHTS = 11_173_962


def draws(chains: int, count: int, coordinates: int, seed: int = 0) -> np.ndarray:
    """AR(1) chains, ``(coordinates, chains, count)``."""
    rng = np.random.default_rng(seed)
    rho = rng.uniform(0.0, 0.95, (coordinates, 1))
    x = np.empty((coordinates, chains, count))
    x[:, :, 0] = rng.standard_normal((coordinates, chains))
    for t in range(1, count):
        x[:, :, t] = rho * x[:, :, t - 1] + rng.standard_normal((coordinates, chains))
    return x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--draws", type=int, default=25)
    parser.add_argument("--coordinates", type=int, default=200_000)
    parser.add_argument("--oracle-coordinates", type=int, default=2_000)
    parser.add_argument("--quick", action="store_true", help="smoke run (a few seconds)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.coordinates, args.oracle_coordinates = 2_000, 100
    from arviz_stats.base import array_stats

    from posteriorzoo._ess_rhat import ess_bulk, rhat_rank

    x = draws(args.chains, args.draws, args.coordinates)
    ess_bulk(x[:2]), rhat_rank(x[:2])     # compile (or load) the rank kernel first
    start = time.perf_counter()
    ess, rhat = ess_bulk(x), rhat_rank(x)
    ours = (time.perf_counter() - start) / args.coordinates
    shared = np.ascontiguousarray(x[:args.oracle_coordinates].transpose(1, 2, 0))
    start = time.perf_counter()
    oracle_ess = np.asarray(array_stats.ess(shared, chain_axis=0, draw_axis=1, method="bulk"))
    oracle_rhat = np.asarray(array_stats.rhat(shared, chain_axis=0, draw_axis=1))
    theirs = (time.perf_counter() - start) / args.oracle_coordinates
    n = args.oracle_coordinates
    difference = max(float(np.max(np.abs(ess[:n] - oracle_ess) / oracle_ess)),
                     float(np.max(np.abs(rhat[:n] - oracle_rhat) / oracle_rhat)))
    result = {"chains": args.chains, "draws": args.draws, "coordinates": args.coordinates,
              "oracle_coordinates": n, "vectorised_us_per_coordinate": ours * 1e6,
              "arviz_us_per_coordinate": theirs * 1e6, "ratio": theirs / ours,
              "largest_relative_difference": difference,
              "resnet18_minutes_vectorised": ours * RESNET18_WEIGHTS / 60,
              "resnet18_minutes_arviz": theirs * RESNET18_WEIGHTS / 60}
    print(f"ESS + R-hat, {args.chains} chains x {args.draws} draws")
    print(f"  vectorised  {ours * 1e6:8.1f} us/coordinate  ({args.coordinates} coordinates)")
    print(f"  arviz-stats {theirs * 1e6:8.1f} us/coordinate  ({n} coordinates)")
    print(f"  ratio {theirs / ours:.1f}x; largest relative difference {difference:.1e}")
    print(f"  one ResNet-18 chain ({RESNET18_WEIGHTS:,} weights): "
          f"{result['resnet18_minutes_vectorised']:.1f} min vectorised, "
          f"{result['resnet18_minutes_arviz']:.0f} min arviz-stats")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
