"""Benchmark ``posteriorzoo report`` on the shipped reference zoo, stage by stage.

Side by side in one run:

1. **The report** exactly as ``posteriorzoo demo`` builds it (``analysis.report.build_report``
   on the target, the Deep Ensemble and the 14 method collections, Fashion-MNIST in
   distribution, MNIST out of distribution when its files are present, else
   scikit-learn's digits), then written
   to a temporary folder. The stages (``build_report(timings=...)``): reading the inputs
   (``load``), the canonical copies (``canonicalize``), MMD and NS-MMD (``mmd``), the
   noise floor, the members' predictions (``predictions``), the metrics on them
   (``metrics``), ``diagnostics``, ``figures``, and writing the files (``write``: HTML,
   Markdown, CSV, JSON, every figure as PNG and PDF). ``--no-figures`` as the command's.
   The predictions and metrics run in a second thread beside the other stages, and at
   the end in both threads (their seconds add up both), so the stages are printed in two
   groups: the main thread's add up to at most the total, the second group's need not.

2. **The predictions** alone, on the same checkpoints and images: the report's engine
   (``posteriorzoo.collection._optunet_kernels``: numba kernels, the networks as the SIMD axis)
   against plain batched torch (``torch.func.vmap`` of ``functional_call`` over the
   stacked checkpoints, 2 threads, chunks of ``--torch-models`` networks). torch runs on
   the first ``--torch-models`` checkpoints of each collection and ``--torch-images``
   images (it needs minutes for all of them); the kernels on the same subset and on all.
   Printed: model-images per second of both, their ratio, the largest difference of the
   probabilities, and the time torch would take for the report's full set at its rate.

Absolute times on the shared 2-core machines vary with the other load (``uptime``); the
ratios within one run are what to quote. Run from the repository root::

    .venv/bin/python benchmarks/bench_report.py                 # about a minute
    .venv/bin/python benchmarks/bench_report.py --quick         # smoke run, seconds
    .venv/bin/python benchmarks/bench_report.py --json benchmarks/output/report.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

STAGES = ("load", "canonicalize", "mmd", "noise floor", "predictions", "metrics",
          "diagnostics", "figures", "write")
#: The stages of the report's two threads (build_report runs the metrics beside the rest).
FUNCTION_STAGES = ("predictions", "metrics")
WEIGHT_STAGES = tuple(stage for stage in STAGES if stage not in FUNCTION_STAGES)


def datasets() -> tuple[str, str]:
    """(in-distribution, OOD) names as the demo picks them: Fashion-MNIST, and MNIST when
    its files are on disk, else digits."""
    from posteriorzoo.data import load_dataset
    from posteriorzoo.errors import PosteriorZooError

    try:
        load_dataset("mnist", "test", download=False)
    except PosteriorZooError:
        return "fashion-mnist", "digits"
    return "fashion-mnist", "mnist"


def collections(quick: bool, folder: Path) -> tuple[Path, list[Path]]:
    """The shipped target and method collections; with ``quick``, copies of the first
    200 target checkpoints and of the first 20 of three methods in ``folder``."""
    from posteriorzoo.reference import METHOD_COLLECTIONS, reference_path

    if not quick:
        return reference_path("target"), [reference_path(n) for n in ("de", *METHOD_COLLECTIONS)]
    return (_head(reference_path("target"), 200, folder),
            [_head(reference_path(name), 20, folder) for name in ("de", "swag", "laplace")])


def _head(path: Path, count: int, folder: Path) -> Path:
    """A collection of the first ``count`` checkpoints of ``path`` (same attributes)."""
    from posteriorzoo.zoo import create_zoo, open_zoo

    copy = folder / path.name
    with open_zoo(path) as source:
        states = [source.arrays(index) for index in range(count)]
        with create_zoo(copy, architecture=source.architecture, dataset=source.dataset,
                        method=source.method, num_classes=source.num_classes,
                        model_options=source.model_options, recipe=source.recipe,
                        annotations=source.annotations, template=states[0]) as zoo:
            zoo.append_many(states)
    return copy


def bench_report(target: Path, methods: list[Path], id_data: str, ood_data: str,
                 figures: bool, n_images: int | None, splits: int, workdir: Path | None
                 ) -> dict[str, Any]:
    """The report's stages and total (seconds), built and written as the demo does."""
    from analysis.report import build_report

    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-report-", dir=workdir) as folder:
        started = time.perf_counter()
        report = build_report(target, methods, id_data=id_data, ood_data=ood_data,
                              n_images=n_images, splits=splits, figures=figures,
                              workdir=folder, timings=timings)
        clock = time.perf_counter()
        report.write(Path(folder) / "report")
        timings["write"] = time.perf_counter() - clock
        total = time.perf_counter() - started
    return {"total_s": total, "stages_s": {stage: timings.get(stage, 0.0) for stage in STAGES},
            "rows": len(report.rows), "figures": sorted(report.figures)}


def _images(id_data: str, ood_data: str, count: int | None) -> torch.Tensor:
    """The report's images: in- and out-of-distribution, normalised with the ID statistics."""
    from posteriorzoo.data import Normalize, load_dataset

    data = load_dataset(id_data, "test")
    normalize = Normalize(data.mean, data.std)
    ood = load_dataset(ood_data, "test")
    both = np.concatenate([data.images[:count], ood.images[:count]])
    return normalize(torch.from_numpy(both))


def torch_probabilities(layers: dict[str, np.ndarray], images: torch.Tensor,
                        chunk: int) -> np.ndarray:
    """The baseline: ``torch.func.vmap`` of ``functional_call`` over stacked checkpoints."""
    from torch.func import functional_call, vmap

    from posteriorzoo.models import build

    model = build("optunet", num_classes=layers["fc.bias"].shape[1]).eval()

    def probabilities(parameters: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(functional_call(model, parameters, (x,)), dim=1)

    batched = vmap(probabilities, in_dims=(0, None))
    count = len(layers["fc.bias"])
    outputs = []
    with torch.no_grad():
        for start in range(0, count, chunk):
            parameters = {key: torch.from_numpy(np.asarray(value[start:start + chunk],
                                                           dtype=np.float32))
                          for key, value in layers.items()}
            outputs.append(batched(parameters, images).numpy())
    return np.concatenate(outputs)


def bench_predictions(methods: list[Path], images: torch.Tensor, torch_models: int,
                      torch_images: int) -> dict[str, Any]:
    """Kernels vs batched torch on a subset (both), and the kernels on everything."""
    from posteriorzoo.collection._optunet_kernels import SHAPES, kernel_probabilities
    from posteriorzoo.zoo import open_zoo

    every: dict[str, list[np.ndarray]] = {key: [] for key in SHAPES}
    subset: dict[str, list[np.ndarray]] = {key: [] for key in SHAPES}
    for path in methods:
        with open_zoo(path) as zoo:
            for key in SHAPES:
                layer = zoo.layer(key)
                every[key].append(layer)
                subset[key].append(layer[:torch_models])
    every_layers = {key: np.concatenate(value) for key, value in every.items()}
    subset_layers = {key: np.concatenate(value) for key, value in subset.items()}
    some = images[:torch_images]
    kernel_probabilities(subset_layers, some[:8].numpy())   # compile or load the kernels
    torch_probabilities({k: v[:2] for k, v in subset_layers.items()}, some[:8], 2)
    clock = time.perf_counter()
    ours = kernel_probabilities(subset_layers, some.numpy())
    ours_s = time.perf_counter() - clock
    clock = time.perf_counter()
    theirs = torch_probabilities(subset_layers, some, torch_models)
    theirs_s = time.perf_counter() - clock
    clock = time.perf_counter()
    kernel_probabilities(every_layers, images.numpy())
    all_s = time.perf_counter() - clock
    subset_work = len(subset_layers["fc.bias"]) * len(some)
    all_work = len(every_layers["fc.bias"]) * len(images)
    return {"subset_checkpoints": len(subset_layers["fc.bias"]), "subset_images": len(some),
            "kernels_subset_s": ours_s, "torch_subset_s": theirs_s,
            "kernels_model_images_per_s": subset_work / ours_s,
            "torch_model_images_per_s": subset_work / theirs_s,
            "ratio": theirs_s / ours_s,
            "max_abs_difference": float(np.abs(ours - theirs).max()),
            "all_checkpoints": len(every_layers["fc.bias"]), "all_images": len(images),
            "kernels_all_s": all_s, "torch_all_s_extrapolated": all_work * theirs_s / subset_work,
            "gflop_all": all_work * 45_000 / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 200 target checkpoints and 20 of 3 methods (copies "
                             "of the shipped ones), 300 images, 5 noise-floor splits, torch "
                             "on 8 checkpoints x 64 images")
    parser.add_argument("--no-figures", action="store_true", help="the report without figures")
    parser.add_argument("--torch-models", type=int, default=25,
                        help="checkpoints per collection for the torch baseline "
                             "(default: %(default)s)")
    parser.add_argument("--torch-images", type=int, default=1000,
                        help="images for the torch baseline (default: %(default)s)")
    parser.add_argument("--workdir", type=Path, default=None, help="for the temporary files")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write every number, the command and the versions")
    args = parser.parse_args(argv)
    from posteriorzoo.data import load_dataset
    from posteriorzoo.errors import PosteriorZooError
    from posteriorzoo.provenance import library_versions

    try:
        load_dataset("fashion-mnist", "test", download=False)
    except PosteriorZooError as error:
        print(f"skipped: the shipped zoo's report needs Fashion-MNIST ({error})")
        return 0
    n_images, splits = (300, 5) if args.quick else (None, 50)
    if args.quick:
        args.torch_models, args.torch_images = 8, 64
    torch.set_num_threads(2)
    id_data, ood_data = datasets()
    with tempfile.TemporaryDirectory(prefix="bench-report-inputs-", dir=args.workdir) as copies:
        target, methods = collections(args.quick, Path(copies))
        print(f"report of {target.name} and {len(methods)} method collections; ID {id_data}, "
              f"OOD {ood_data}{f', first {n_images} images' if n_images else ''}; "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        report = bench_report(target, methods, id_data, ood_data, not args.no_figures,
                              n_images, splits, args.workdir)
        images = _images(id_data, ood_data, n_images)
        predictions = bench_predictions(methods, images, args.torch_models,
                                        args.torch_images)
    print(f"\n1. the report{' (no figures)' if args.no_figures else ''}: "
          f"{report['total_s']:.1f} s in all")
    # The metrics thread's stages run beside the others, and at the end in both threads
    # (adding up both): only the main thread's group is bounded by the total.
    for title, group in (("weights (main thread)", WEIGHT_STAGES),
                         ("functions (metrics thread, then both)", FUNCTION_STAGES)):
        print(f"   {title}:")
        for stage in group:
            seconds = report["stages_s"][stage]
            share = 100 * seconds / report["total_s"]
            print(f"     {stage:14} {seconds:7.2f} s  {share:5.1f}%")
    p = predictions
    print(f"\n2. predictions, {p['subset_checkpoints']} checkpoints x {p['subset_images']} "
          "images (the first of each collection)")
    print(f"   kernels (member_probabilities, auto) {p['kernels_subset_s']:8.3f} s  "
          f"{p['kernels_model_images_per_s']:12,.0f} model-images/s")
    print(f"   batched torch (vmap, functional_call) {p['torch_subset_s']:8.3f} s  "
          f"{p['torch_model_images_per_s']:12,.0f} model-images/s")
    print(f"   kernels / torch: {p['ratio']:.0f}x; largest |difference| of the "
          f"probabilities {p['max_abs_difference']:.1e}")
    print(f"   all {p['all_checkpoints']} checkpoints x {p['all_images']} images "
          f"({p['gflop_all']:.0f} GFLOP): kernels {p['kernels_all_s']:.2f} s, batched torch "
          f"about {p['torch_all_s_extrapolated']:.0f} s at its rate above")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": shlex.join([sys.executable, *sys.argv]),
                  "versions": library_versions(), "cpu_count": os.cpu_count(),
                  "load_average": os.getloadavg(), "quick": args.quick,
                  "report": report, "predictions": predictions}
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
