"""Benchmark full-batch HMC's leapfrog: the fast engine's kernels against plain torch.

One leapfrog step of :mod:`train_zoo.methods.hmc` costs one full-data gradient of the
potential ``U(theta) = sum_n CE(f_theta(x_n), y_n) + (lambda / 2) |theta|^2``. Side by
side in one run, on OptuNet and the Fashion-MNIST training split (or its first
``--examples``; ``digits`` when Fashion-MNIST is not installed), unaugmented, cut into
the kernels' 128-example chunks as ``Hmc._potential`` cuts it, ``lambda = N x`` the
``optunet-mnist`` recipe's weight decay, from checkpoint 0 of the bundled reference
target:

(ours)  ``hmc_sampler.leapfrog`` on ``hmc.kernel_potential``: the numba kernels' float32
        loss and gradient of each chunk, summed in float64; what the trainer runs.
(torch) the same leapfrog written plainly in torch: an ``nn.Module`` OptuNet from
        ``posteriorzoo.models``, its parameters set from the float64 position
        (``vector_to_parameters``), the cross-entropy summed over the same chunks and
        differentiated by ``torch.autograd.grad`` per chunk, summed in float64, the same
        prior, the same half steps and full steps. Also with 1,000-example chunks, the
        chunk of HMC's own torch fallback (``hmc.TORCH_CHUNK``); the headline ratio is
        against the faster torch row.

Before anything is timed both paths' potential and gradient at the start are compared
within the float32 rounding bound of each chunk (``tests/rounding_bounds.py``:
``cross_entropy_bound`` for the loss, ``gradient_rtol`` of each tensor's scale for the
gradient, summed over the chunks); the benchmark exits 1 if either is exceeded.

Each path runs ``--steps`` leapfrog steps from the same position and momentum (the start's
gradient computed before the clock starts, as the sampler reuses it), ``--repeats`` times
with the paths interleaved; the best time is reported (other load only slows a run down).
A leapfrog step is one gradient evaluation, so steps/s and gradients/s are the same
number; both are printed.

The arithmetic limit, measured beside them: the multiply-adds of OptuNet's forward and
backward pass over the ``N`` examples (conv1, conv2 and fc forward; their weight
gradients; conv2's and fc's input gradients; x 2 FLOPs; the elementwise ReLU, pooling and
softmax not counted) per gradient, over each path's time: GFLOP/s, and its fraction of a
bare float32 GEMM (``torch.mm``, 1 thread) timed in the same run.

Run from the repository root (one torch thread, as the trainer's workers)::

    .venv/bin/python benchmarks/bench_hmc.py                  # the full training split
    .venv/bin/python benchmarks/bench_hmc.py --quick          # smoke run, seconds
    .venv/bin/python benchmarks/bench_hmc.py --json benchmarks/output/hmc.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_training import pick_dataset  # noqa: E402 -- the same dataset choice as training's

#: The recipe whose weight decay sets the prior (the reference zoo's).
RECIPE = "optunet-mnist"
#: A leapfrog step size the reference chains adapt to on the full training split (they
#: froze near 1e-4 to 2e-3); scaled by sqrt(60,000 / N) on a cut, whose curvature is
#: smaller in proportion to N.
STEP_SIZE = 5e-4
FULL_TRAIN = 60_000


def optunet_macs(model: Any, image_shape: Sequence[int]) -> dict[str, int]:
    """Multiply-adds per example of OptuNet's layers (the shapes read from ``model``):
    each layer's forward, its weight gradient and, but for conv1 (whose input is the
    data), its input gradient, each as many multiply-adds as the forward
    (``forward_backward``, what a dense implementation does). ``at_arg_max``: the same
    with conv1's weight gradient taken only at the positions the max pool passes a
    gradient to (one per window), as the kernels take it; the other positions add zeros."""
    import torch

    with torch.no_grad():
        x = torch.zeros((1, *image_shape))
        c1 = model.conv1(x)
        pooled = model.pool1(c1)
        c2 = model.conv2(pooled)

    def conv(layer: Any, out: Any) -> int:
        kh, kw = layer.kernel_size
        return int(out[0].numel()) * layer.in_channels // layer.groups * kh * kw

    conv1, conv2 = conv(model.conv1, c1), conv(model.conv2, c2)
    fc = model.fc.in_features * model.fc.out_features
    kh, kw = model.conv1.kernel_size
    conv1_at_arg_max = int(pooled[0].numel()) * model.conv1.in_channels * kh * kw
    return {"conv1": conv1, "conv2": conv2, "fc": fc,
            "forward_backward": 2 * conv1 + 3 * conv2 + 3 * fc,
            "at_arg_max": conv1 + conv1_at_arg_max + 3 * conv2 + 3 * fc}


def gemm_gflops(size: int, repeats: int) -> float:
    """A bare float32 GEMM's rate (``torch.mm`` of two ``size x size`` matrices, best of
    ``repeats``), in GFLOP/s: the arithmetic limit of one core here."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size ** 3 / best / 1e9


def torch_gradient(model: Any, chunks: Sequence[tuple[Any, Any]], prior: float
                   ) -> Callable[[Any], tuple[float, Any, list[tuple[float, list[Any]]]]]:
    """The plain torch potential: ``theta`` (float64 tensor) -> ``(U, grad U, per chunk
    (summed loss, per-tensor summed gradients))``, the loss and gradient of each chunk in
    float32 by autograd, summed in float64."""
    import torch
    from torch import nn

    params = list(model.parameters())

    def gradient(theta: Any) -> tuple[float, Any, list[tuple[float, list[Any]]]]:
        nn.utils.vector_to_parameters(theta.float(), params)
        loss, grad = 0.0, torch.zeros_like(theta)
        parts = []
        for images, labels in chunks:
            total = nn.functional.cross_entropy(model(images), labels, reduction="sum")
            grads = torch.autograd.grad(total, params)
            loss += float(total.detach())
            grad += torch.cat([g.reshape(-1) for g in grads]).double()
            parts.append((float(total.detach()), grads))
        return (loss + 0.5 * prior * float(theta @ theta), grad + prior * theta, parts)

    return gradient


def torch_leapfrog(theta: Any, momentum: Any, grad: Any, step_size: float, steps: int,
                   gradient: Callable[[Any], tuple[float, Any, Any]]) -> tuple[Any, Any, float]:
    """``steps`` leapfrog steps in torch float64, one ``gradient`` call each (the same
    half and full steps as ``hmc_sampler.leapfrog``)."""
    momentum = momentum - 0.5 * step_size * grad
    value = math.nan
    for taken in range(1, steps + 1):
        theta = theta + step_size * momentum
        value, grad, _ = gradient(theta)
        if taken < steps:
            momentum = momentum - step_size * grad
    momentum = momentum - 0.5 * step_size * grad
    return theta, momentum, value


def check_paths(model: Any, layout: Any, kernel_chunks: Sequence[tuple[Any, Any]],
                torch_chunks: Sequence[tuple[Any, Any]], theta: np.ndarray, prior: float,
                potential: Callable[[np.ndarray], tuple[float, np.ndarray]],
                gradient: Callable[[Any], tuple[float, Any, Any]]) -> dict[str, Any]:
    """Both paths' ``U`` and ``grad U`` at ``theta``, against their rounding bound.

    Per chunk of ``B`` examples: the loss within ``B x cross_entropy_bound`` (the logits'
    worst-case float32 bound carried by the cross-entropy, and its own rounding), each
    gradient tensor within ``B x gradient_rtol`` of the chunk's mean gradient's largest
    entry of that tensor (``gamma(k)``, ``k`` the roundings on the longest path to a
    weight gradient); summed over the chunks, plus the float64 sums' ``gamma(chunks,
    u64)`` and the prior's ``gamma(P, u64)`` (both sides compute it alike)."""
    import torch
    from rounding_bounds import U64, cross_entropy_bound, gamma, gradient_rtol

    from train_zoo.fast.gradients import fast_loss_and_grad

    value, grad = potential(theta)
    # the kernels' chunks once more, one by one (the same calls kernel_potential makes)
    weights = theta.astype(np.float32)
    buffer = np.empty(layout.num_params, dtype=np.float32)
    loss, summed = 0.0, np.zeros(theta.size)
    for x, labels in kernel_chunks:
        mean, _ = fast_loss_and_grad(layout, weights, x, labels, grad=buffer)
        loss += labels.size * float(mean)
        summed += labels.size * buffer
    same = (loss + 0.5 * prior * float(theta @ theta) == value
            and np.array_equal(summed + prior * theta, grad))
    t_value, t_grad, parts = gradient(torch.from_numpy(theta))
    t_grad = t_grad.numpy()
    names = [name for name, _ in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    loss_bound = 0.0
    grad_bound = np.zeros(len(names))
    absolute = 0.0
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(weights), model.parameters())
        for (images, _), (chunk_loss, grads) in zip(torch_chunks, parts, strict=True):
            batch = images.shape[0]
            loss_bound += batch * cross_entropy_bound(model, images)
            rtol = gradient_rtol(model, images)
            grad_bound += np.array([rtol * float(g.abs().max()) for g in grads])
            absolute += abs(chunk_loss)
    chunks = len(torch_chunks)
    prior_term = 0.5 * prior * float(theta @ theta)
    loss_bound += 2 * gamma(chunks + 1, U64) * (absolute + prior_term) \
        + 2 * gamma(theta.size, U64) * prior_term
    splits = np.cumsum([0, *sizes])
    grad_diff = [float(np.abs(grad[a:b] - t_grad[a:b]).max())
                 for a, b in zip(splits[:-1], splits[1:], strict=True)]
    grad_bound += 2 * gamma(chunks + 1, U64) * np.array(
        [float(np.abs(t_grad[a:b]).max()) for a, b in zip(splits[:-1], splits[1:],
                                                         strict=True)])
    grad_bound += 2 * U64 * prior * np.array([float(np.abs(theta[a:b]).max()) for a, b in
                                              zip(splits[:-1], splits[1:], strict=True)])
    loss_diff = abs(value - t_value)
    ratios = [d / b for d, b in zip(grad_diff, grad_bound, strict=True)]
    return {"potential_kernels": value, "potential_torch": t_value,
            "potential_difference": loss_diff, "potential_bound": loss_bound,
            "gradient_difference": dict(zip(names, grad_diff, strict=True)),
            "gradient_bound": dict(zip(names, grad_bound.tolist(), strict=True)),
            "largest_share_of_bound": max([loss_diff / loss_bound, *ratios]),
            "kernel_potential_is_its_chunks": bool(same),
            "passed": bool(same and loss_diff <= loss_bound
                           and all(r <= 1 for r in ratios))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from posteriorzoo.data import load_dataset
    from posteriorzoo.models import build
    from posteriorzoo.reference import open_reference
    from train_zoo import get_recipe, make_spec
    from train_zoo.data import TrainingData
    from train_zoo.fast.engine import layout_for
    from train_zoo.fast.gradients import KERNEL_CHUNK
    from train_zoo.methods.hmc import TORCH_CHUNK, kernel_potential
    from train_zoo.methods.hmc_sampler import leapfrog
    from train_zoo.programs import ModeEngine

    torch.set_num_threads(1)
    train = load_dataset(args.dataset, "train", download=False)
    count = min(args.examples or len(train), len(train))
    train = dataclasses.replace(train, images=train.images[:count], labels=train.labels[:count])
    data = TrainingData(train, load_dataset(args.dataset, "test", download=False))
    spec = make_spec(RECIPE, dataset=args.dataset, method="hmc", modes=1,
                     samples_per_mode=1)
    prior = count * get_recipe(RECIPE).weight_decay
    model = build("optunet", num_classes=10)
    with open_reference("target") as zoo:
        model.load_state_dict(zoo.state_dict(0))
    layout = layout_for(model, data)
    if layout is None:
        raise SystemExit("the kernels do not cover OptuNet on these data")
    engine = ModeEngine(spec, 0, data, "fast")
    # As Hmc._potential: one unaugmented pass in the data seed's order, 128 at a time.
    batches = list(engine.read_batches(engine.seeds.data, KERNEL_CHUNK))
    kernel_chunks = [(np.ascontiguousarray(images.permute(1, 2, 3, 0).numpy()),
                      np.ascontiguousarray(labels.numpy(), dtype=np.int64))
                     for images, labels in batches]
    torch_chunks = {KERNEL_CHUNK: batches}
    if args.torch_chunk != KERNEL_CHUNK:
        torch_chunks[args.torch_chunk] = list(engine.read_batches(engine.seeds.data,
                                                                 args.torch_chunk))
    potential = kernel_potential(layout, kernel_chunks, prior)
    gradients = {size: torch_gradient(model, chunks, prior)
                 for size, chunks in torch_chunks.items()}
    theta = np.asarray(layout.flatten(model.state_dict()), dtype=np.float64)
    check = check_paths(model, layout, kernel_chunks, batches, theta, prior, potential,
                        gradients[KERNEL_CHUNK])
    step = args.step_size or STEP_SIZE * math.sqrt(FULL_TRAIN / count)
    head = {"dataset": args.dataset, "examples": count, "chunks": len(kernel_chunks),
            "prior_precision": prior, "step_size": step, "steps": args.steps,
            "repeats": args.repeats, "check": check}
    if not check["passed"]:  # two paths that disagree are not timed
        return {**head, "rows": None}
    momentum = np.random.default_rng(args.seed).standard_normal(theta.size)
    _, grad0 = potential(theta)
    t_theta, t_momentum = torch.from_numpy(theta), torch.from_numpy(momentum)
    t_grad0 = {size: gradient(t_theta)[1] for size, gradient in gradients.items()}

    def ours() -> tuple[np.ndarray, float]:
        end, _, value, _, taken = leapfrog(theta, momentum, grad0, step, args.steps,
                                           potential)
        if taken != args.steps:
            raise SystemExit("the kernels' trajectory diverged: a smaller --step-size")
        return end, value

    def plain(size: int) -> Callable[[], tuple[np.ndarray, float]]:
        def go() -> tuple[np.ndarray, float]:
            end, _, value = torch_leapfrog(t_theta, t_momentum, t_grad0[size], step,
                                           args.steps, gradients[size])
            return end.numpy(), value
        return go

    paths: dict[str, Callable[[], tuple[np.ndarray, float]]] = {"ours": ours}
    paths.update({f"torch-{size}": plain(size) for size in torch_chunks})
    times: dict[str, list[float]] = {name: [] for name in paths}
    ends: dict[str, tuple[np.ndarray, float]] = {}
    for _ in range(args.repeats):
        for name, path in paths.items():
            started = time.perf_counter()
            ends[name] = path()
            times[name].append(time.perf_counter() - started)
    macs = optunet_macs(model, train.image_shape)
    flops = 2 * macs["forward_backward"] * count  # per full-data gradient
    useful = 2 * macs["at_arg_max"] * count
    gemm = gemm_gflops(args.gemm_size, args.repeats + 2)
    rows = {}
    for name, measured in times.items():
        best = min(measured)
        rate = args.steps / best
        rows[name] = {"seconds": best, "all_seconds": measured,
                      "leapfrog_steps_per_s": rate, "gradients_per_s": rate,
                      "seconds_per_gradient": best / args.steps,
                      "gflops": flops * rate / 1e9,
                      "share_of_gemm": flops * rate / 1e9 / gemm,
                      "gflops_at_arg_max": useful * rate / 1e9,
                      "end_potential": ends[name][1],
                      "end_distance_to_ours": float(np.abs(ends[name][0]
                                                           - ends["ours"][0]).max())}
    fastest_torch = max((name for name in rows if name != "ours"),
                        key=lambda name: rows[name]["leapfrog_steps_per_s"])
    return {**head, "macs_per_example": macs,
            "flops_per_gradient": flops, "flops_at_arg_max_per_gradient": useful,
            "gemm_size": args.gemm_size,
            "gemm_gflops": gemm, "rows": rows, "fastest_torch": fastest_torch,
            "ratio": rows["ours"]["leapfrog_steps_per_s"]
            / rows[fastest_torch]["leapfrog_steps_per_s"],
            "ratio_same_chunks": rows["ours"]["leapfrog_steps_per_s"]
            / rows[f"torch-{KERNEL_CHUNK}"]["leapfrog_steps_per_s"],
            "torch_chunk_of_hmc": TORCH_CHUNK}


def report(result: dict[str, Any]) -> None:
    check = result["check"]
    print(f"HMC leapfrog, OptuNet on {result['dataset']} ({result['examples']:,} training "
          f"examples, {result['chunks']} chunks of 128), prior precision "
          f"{result['prior_precision']:g}, step {result['step_size']:.3g}, "
          f"{result['steps']} steps, best of {result['repeats']}")
    print(f"check at the start: U kernels {check['potential_kernels']:.6f}, torch "
          f"{check['potential_torch']:.6f}, |difference| {check['potential_difference']:.2e}"
          f" (bound {check['potential_bound']:.2e})")
    for name, difference in check["gradient_difference"].items():
        print(f"  grad {name:<13} |difference| {difference:.2e} "
              f"(bound {check['gradient_bound'][name]:.2e})")
    print(f"  largest share of its bound {check['largest_share_of_bound']:.3g}: "
          f"{'passed' if check['passed'] else 'FAILED'}")
    if result["rows"] is None:
        print("not timed: the two paths disagree beyond their rounding bound")
        return
    print(f"{'path':<12}{'steps/s':>10}{'grads/s':>10}{'s/grad':>10}{'GFLOP/s':>10}"
          f"{'of GEMM':>9}{'arg-max':>9}{'end U':>16}{'end apart':>11}")
    for name, row in result["rows"].items():
        print(f"{name:<12}{row['leapfrog_steps_per_s']:>10.2f}{row['gradients_per_s']:>10.2f}"
              f"{row['seconds_per_gradient']:>10.4f}{row['gflops']:>10.2f}"
              f"{row['share_of_gemm']:>9.1%}{row['gflops_at_arg_max']:>9.2f}"
              f"{row['end_potential']:>16.6f}{row['end_distance_to_ours']:>11.1e}")
    macs = result["macs_per_example"]
    print(f"limit: {2 * macs['forward_backward']:,} FLOPs per example forward + backward "
          f"(multiply-adds conv1 {macs['conv1']:,}, conv2 {macs['conv2']:,}, fc "
          f"{macs['fc']:,}; x2 forward/weight-gradient, x3 with the input gradient), "
          f"{result['flops_per_gradient'] / 1e9:.2f} GFLOP per gradient "
          f"({2 * macs['at_arg_max']:,} per example with conv1's weight gradient at the "
          f"pool's arg-max only: the arg-max column); a float32 GEMM "
          f"({result['gemm_size']}^2, 1 thread) runs {result['gemm_gflops']:.1f} GFLOP/s")
    print(f"ours / {result['fastest_torch']} (the faster torch): {result['ratio']:.1f}x; "
          f"against torch on the same 128-example chunks: {result['ratio_same_chunks']:.1f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=None,
                        help="the first N training examples (default: all)")
    parser.add_argument("--steps", type=int, default=10, help="leapfrog steps timed per path")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each path")
    parser.add_argument("--torch-chunk", type=int, default=None,
                        help="the second torch row's chunk (default: hmc.TORCH_CHUNK)")
    parser.add_argument("--step-size", type=float, default=None,
                        help=f"leapfrog step (default {STEP_SIZE:g} x sqrt(60,000 / N))")
    parser.add_argument("--gemm-size", type=int, default=1024)
    parser.add_argument("--dataset", default=None,
                        help="default: fashion-mnist if installed, else digits")
    parser.add_argument("--seed", type=int, default=0, help="the momentum's seed")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1,280 examples, 3 steps, 1 repeat, a 256 GEMM")
    parser.add_argument("--json", type=Path, default=None, help="also write the record here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))  # rounding_bounds: the error analysis
    from train_zoo.methods.hmc import TORCH_CHUNK

    args.dataset = args.dataset or pick_dataset()
    args.torch_chunk = args.torch_chunk or TORCH_CHUNK
    if args.quick:
        args.examples = min(args.examples or 1_280, 1_280)
        args.steps, args.repeats, args.gemm_size = 3, 1, 256
    for name in ("steps", "repeats", "torch_chunk", "gemm_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.examples is not None and args.examples < 1:
        parser.error("--examples must be at least 1")
    started = time.perf_counter()
    result = run(args)
    import numba
    import torch

    result.update({"command": shlex.join([sys.executable, *sys.argv]),
                   "wall_seconds": time.perf_counter() - started,
                   "machine": platform.processor() or platform.machine(),
                   "versions": {"torch": torch.__version__, "numba": numba.__version__,
                                "numpy": np.__version__, "python": platform.python_version()}})
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["check"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
