"""The GPU check: each device path's time and its agreement with the CPU result, in one
short run that fits one call on a lent GPU machine.

Stages (each on ``--device`` and, for the agreement, on CPU with the same inputs):

1. **train**: ResNet-18 (100 classes, 11.2 M weights) steps of the torch engine's SGD
   under bf16 autocast and channels-last, the data set on the device and augmented there
   (synthetic CIFAR-shaped images: no data set is installed there). Time per step and the
   extrapolation to one paper checkpoint (200 epochs x 391 steps); agreement: the first
   batch's loss against the float32 CPU loss, within bf16's rounding (gamma(2L, 2^-8) on
   the logits' scale, L the layers).
2. **canonicalize**: a batch of ResNet-18 states; agreement: the largest difference from
   the CPU's canonical form (float32: a few roundings per weight).
3. **distances**: the L1 and squared-L2 tile of ``--rows`` checkpoints' ``--features``
   weights through ``cross_distances(device=...)`` against the CPU's fast path; ns per
   pair-weight next to a bare float32 GEMM on the same device.
4. **predictions**: softmax outputs of one checkpoint on a batch of images; agreement:
   the largest probability difference.

The device machine has its own Python with CUDA torch, numpy, h5py, numba and scipy, and
no package registry; the one pure-Python dependency these imports need that it lacks
(beartype) is carried as a wheel (``make gpu-wheels`` puts it in ``.gpu-wheels/``; the
device tool's ``carry``). One call, from the repository root::

    python3 -m pip install --no-index --no-deps -q .gpu-wheels/*.whl; \
        PYTHONPATH=. python3 benchmarks/gpu_check.py --device cuda --json $OUT/gpu.json

``--quick`` (the smoke run ``make test`` does, on CPU) uses a narrow ResNet and few rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posteriorzoo.data import ArrayDataset  # noqa: E402 -- after the source tree's path
from posteriorzoo.models import build  # noqa: E402
from posteriorzoo.symmetry import symmetry_structure  # noqa: E402
from posteriorzoo.symmetry.canonical import canonicalize_batch  # noqa: E402
from train_zoo.device import TrainingDevice  # noqa: E402
from train_zoo.recipes import get_recipe  # noqa: E402
from train_zoo.torch_engine import TorchSGD, torch_batches  # noqa: E402

U_BF16 = 2.0 ** -8      # bfloat16's unit roundoff (autocast's products)
U_TF32 = 2.0 ** -11     # TensorFloat-32's (a GPU's float32 convolutions by default)
U32, U64 = 2.0 ** -24, 2.0 ** -53


def gamma(k: float, u: float = U32) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative error of k roundings."""
    return k * u / (1 - k * u)


def layer_count(model: torch.nn.Module) -> int:
    return sum(isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) for m in model.modules())


def synchronised(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def timed(function: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, Any]:
    """Seconds per call (after one warm-up call) and the last result."""
    sync = synchronised(device)
    result = function()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        result = function()
    sync()
    return (time.perf_counter() - start) / repeats, result


def synthetic_data(count: int, seed: int) -> Any:
    """CIFAR-100-shaped uint8 images and labels (the training data's form)."""
    from train_zoo.data import TrainingData

    rng = np.random.default_rng(seed)
    def split(name: str, n: int) -> ArrayDataset:
        return ArrayDataset(rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8),
                            rng.integers(0, 100, n).astype(np.int64), 100, "synthetic",
                            name, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return TrainingData(split("train", count), split("test", 256))


def check_train(device: str, width: int, steps: int) -> dict[str, Any]:
    where = TrainingDevice(device, autocast=True, channels_last=True)
    recipe = get_recipe("resnet18-cifar100")
    data = synthetic_data(recipe.batch_size * (steps + 1), 0)
    torch.manual_seed(0)
    model = build("resnet18", num_classes=100, width=width)
    plain = build("resnet18", num_classes=100, width=width)
    plain.load_state_dict(model.state_dict())
    images, labels = next(iter(torch_batches(data, recipe, seed=1)(0)))
    with torch.no_grad():
        reference = plain.eval()(images)
        placed = where.place(model).eval()
        with where.compute():
            logits = placed(where.inputs(images.to(where.device))).float().cpu()
    change = float((logits - reference).abs().max() / reference.abs().max())
    # each layer's weights and inputs rounded to bf16: gamma(2L, u_bf16) on the logits'
    # scale (the convention of tests/rounding_bounds.deep_rtol)
    bound = gamma(2 * layer_count(plain), U_BF16)
    stepper = TorchSGD(placed.train(), recipe, noise_seed=0, device=where)
    batches = list(torch_batches(data, recipe, seed=1, device=where)(0))[:steps]
    sync = synchronised(where.device)
    stepper.step(batches[0], recipe.lr)
    sync()
    start = time.perf_counter()
    for batch in batches[1:]:
        stepper.step(batch, recipe.lr)
    sync()
    per_step = (time.perf_counter() - start) / max(1, len(batches) - 1)
    steps_per_checkpoint = recipe.epochs * math.ceil(50_000 / recipe.batch_size)
    return {"seconds_per_step": per_step,
            "minutes_per_checkpoint": per_step * steps_per_checkpoint / 60,
            "logit_change": change, "bound": bound, "agrees": change <= bound}


def check_canonicalize(device: str, width: int, batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build("resnet18", num_classes=100, width=width)
    state = model.state_dict()
    structure = symmetry_structure(model, state, input_shape=(3, 32, 32))
    states = {key: torch.stack([value.float() + 0.01 * b * torch.randn_like(value.float())
                                if value.is_floating_point() else value
                                for b in range(batch)]) for key, value in state.items()}
    where = torch.device(device)
    on_device = {key: value.to(where) for key, value in states.items()}
    seconds, (result, _) = timed(lambda: canonicalize_batch(on_device, structure), where, 2)
    cpu, _ = canonicalize_batch(states, structure)
    worst = max(float((result[k].cpu().double() - cpu[k].double()).abs().max()
                      / max(cpu[k].abs().max(), 1e-30)) for k in cpu
                if cpu[k].is_floating_point())
    # The same float32 operations in the same order; only the norms' sums (in float64 on
    # float32 rows) may be ordered differently. A scale factor then differs by at most the
    # rounding of its rows, which carry up to 3 roundings per earlier scale variable in
    # the chain: each weight by gamma(4 (L + 1)) of the largest in its tensor, L the
    # scale variables.
    bound = gamma(4 * (len(structure.scalable()) + 1))
    return {"seconds_per_checkpoint": seconds / batch, "largest_relative_difference": worst,
            "bound": bound, "agrees": worst <= bound}


def check_distances(device: str, rows: int, features: int) -> dict[str, Any]:
    from posteriorzoo.mmd.distances import cross_distances

    rng = np.random.default_rng(0)
    sample = rng.standard_normal((rows, features)).astype(np.float32)
    where = torch.device(device)
    seconds, (l1, l2) = timed(lambda: cross_distances(sample, sample, device=device), where, 2)
    cpu_l1, cpu_l2 = cross_distances(sample, sample)
    exact_l1, exact_l2 = cross_distances(sample, sample, precision="exact")
    pair_weights = rows * (rows - 1) / 2 * features
    on_device = torch.from_numpy(sample).to(where)
    gemm, _ = timed(lambda: on_device @ on_device.T, where, 5)
    bound_l1, bound_l2 = fast_bounds(sample)
    ratio = max(float((np.abs(found - exact) / np.maximum(bound, 1e-300)).max())
                for found, exact, bound in ((l1, exact_l1, bound_l1), (l2, exact_l2, bound_l2),
                                            (cpu_l1, exact_l1, bound_l1),
                                            (cpu_l2, exact_l2, bound_l2)))
    return {"ns_per_pair_weight": seconds / pair_weights * 1e9,
            "gemm_ns_per_pair_weight": gemm / pair_weights * 1e9,
            "cpu_vs_device_relative": max(float(np.abs(l1 - cpu_l1).max() / cpu_l1.max()),
                                          float(np.abs(l2 - cpu_l2).max() / cpu_l2.max())),
            "error_over_bound": ratio, "agrees": ratio <= 1.0}


def fast_bounds(sample: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pair, posteriorzoo.mmd.distances_fast's bounds of the fast L1 and squared-L2
    distances from the exact ones (its module docstring), for rows centred on their mean;
    the squared-L2 bound's first term taken at its upper bound N_i + N_j + 2P."""
    from posteriorzoo.mmd.distances_fast import GRAM_CHUNK, L1_CHUNK

    c = sample.astype(np.float64) - sample.astype(np.float64).mean(axis=0)
    rows, features = c.shape
    absolute = np.abs(c)
    ones = absolute.sum(axis=1)
    s = ones[:, None] + ones[None, :]
    p = absolute @ absolute.T
    n = (c ** 2).sum(axis=1)
    n_pair = n[:, None] + n[None, :]
    exact_l1 = np.abs(c[:, None, :] - c[None, :, :]).sum(axis=2) if rows <= 64 else None
    v = (1 + U32) * (1 + U64) - 1
    w = (1 + v) ** 2
    chunks = -(-features // min(L1_CHUNK, GRAM_CHUNK))
    l1_scale = (exact_l1 if exact_l1 is not None else s) + v * s
    bound_l1 = (v * s + gamma(L1_CHUNK + 1) * l1_scale
                + gamma(chunks, U64) * (1 + gamma(L1_CHUNK + 1)) * l1_scale)
    spread = n_pair + 2 * p
    bound_l2 = (2 * v * spread + v ** 2 * spread
                + w * (2 * gamma(GRAM_CHUNK) * p + gamma(features, U64) * n_pair
                       + 2 * gamma(chunks, U64) * (1 + gamma(GRAM_CHUNK)) * p
                       + gamma(2, U64) * (n_pair + 2 * (1 + gamma(GRAM_CHUNK)) * p)))
    return bound_l1, bound_l2


def check_predictions(device: str, width: int, images: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build("resnet18", num_classes=100, width=width).eval()
    inputs = torch.randn(images, 3, 32, 32)
    where = torch.device(device)
    placed = build("resnet18", num_classes=100, width=width).eval()
    placed.load_state_dict(model.state_dict())
    placed.to(where)
    on_device = inputs.to(where)
    with torch.no_grad():
        seconds, probabilities = timed(lambda: torch.softmax(placed(on_device), 1), where, 3)
        reference = torch.softmax(model(inputs), 1)
        largest = float(model(inputs).abs().max())
    difference = float((probabilities.cpu() - reference).abs().max())
    # A GPU's float32 convolutions may run in TF32 (cuDNN's default): each layer's weights
    # and inputs rounded to 2^-11, gamma(2L, u_tf32) on the logits' scale; a softmax
    # output moves by at most twice the largest logit change
    bound = 2 * gamma(2 * layer_count(model), U_TF32) * largest
    return {"microseconds_per_image": seconds / images * 1e6, "largest_difference": difference,
            "bound": bound, "agrees": difference <= bound}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smoke run: narrow, few rows")
    parser.add_argument("--json", type=Path, default=None, help="also write every number")
    args = parser.parse_args(argv)
    width, steps, batch, rows, features, images = ((4, 3, 2, 20, 20_000, 64) if args.quick
                                                   else (64, 20, 8, 400, 131_072, 1_000))
    print(f"torch {torch.__version__}; device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    result: dict[str, Any] = {"device": args.device, "torch": torch.__version__}
    for name, check in (("train", lambda: check_train(args.device, width, steps)),
                        ("canonicalize", lambda: check_canonicalize(args.device, width, batch)),
                        ("distances", lambda: check_distances(args.device, rows, features)),
                        ("predictions", lambda: check_predictions(args.device, width,
                                                                  images))):
        started = time.perf_counter()
        result[name] = check()
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in result[name].items())
        print(f"{name} ({time.perf_counter() - started:.1f} s): {shown}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if all(result[k]["agrees"] for k in ("train", "canonicalize", "distances",
                                                  "predictions")) else 1


if __name__ == "__main__":
    sys.exit(main())
