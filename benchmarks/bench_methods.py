"""Benchmark the posterior methods' hot loops: the Laplace GGN, the BBB training step, the
EMP, ECMP and Rank-1 training steps, the SGLD chain step and the cSGLD, IVON and SVGD
steps.

Side by side in one run:

(a) **Full GGN of OptuNet** (392 parameters, 10 classes) on the first ``--ggn-images``
    Fashion-MNIST training images (default all 60,000; normalised, not augmented) at one
    fixed set of weights (``--weights reference``: checkpoint 0 of the bundled, trained
    target collection; ``random``: a seeded initialisation):

    * this project: ``train_zoo.methods.laplace_curvature.full_ggn`` (OptuNet takes its
      layer-formula path), and the same function forced onto its generic ``torch.func``
      path (``generic=True``) for reference;
    * laplace-torch 0.3: ``Laplace(model, "classification", subset_of_weights="all",
      hessian_structure="full", backend=...)`` fitted on a ``DataLoader`` of a
      ``TensorDataset``, with ``BackPackGGN`` and with ``CurvlinopsGGN``. Each backend
      gets the batch size that is fastest for it: every size in ``--batch-sizes`` is timed
      on the first ``--calibration-images`` images (Curvlinops: at most 512) and the
      fastest is used. Curvlinops forms the GGN as ``G @ I`` (392 GGN-vector products per
      batch) and needs about half an hour for 60,000 images here, so it is timed on
      ``--curvlinops-images`` and its time extrapolated linearly to N (marked in the
      table); its difference is measured against ours on the same images.

    ``max rel diff`` is ``max |G_theirs - G_ours| / max |G_ours|`` (their ``la.H``). The
    headline ratio is the faster baseline's time over ours.

(b) **BBB training steps per second**, OptuNet, batch 64, 3 ELBO samples, SGD at the
    optunet-mnist recipe's lr 0.04: ``train_zoo.methods.bbb.step`` (torch.func) vs
    ``FastBBB.step`` (numba), cycling over 32 Fashion-MNIST batches prepared beforehand
    (data preparation is not timed), same initial state and noise generator. Also: the
    largest difference of the means after ``min(steps, 50)`` steps of each path.

(c) **Collection times** (:func:`collection_times`): the 100-sample collection of each
    method of ``--methods`` (default: every method of ``posteriorzoo.vocabulary`` but the
    ensemble family's that has a single-mode spec in ``specs/``; none with ``--quick``).

(d) **Variant training steps per second**, OptuNet, batch 64, ``--variant-steps`` steps
    (default 200) over 32 Fashion-MNIST batches prepared beforehand, for EMP, ECMP and
    Rank-1: this project's steppers as the trainer's fast engine runs them
    (``train_zoo.methods.emp.EmpStepper`` with the numba kernels' cross-entropy gradient
    at the folded draw, Adam lr 1e-3, K = 5 components of conv1.weight, fc.weight and
    fc.bias; ``rank1.Rank1Stepper`` with the kernel of the per-example scaled network,
    K = 4, the batch tiled 4 times, SGD with Nesterov momentum 0.9 at lr 0.04, the KL
    annealed over the recipe's 60 epochs) against the same method written plainly as an
    ``nn.Module`` trained with ``loss.backward()`` and a ``torch.optim`` optimiser
    (:class:`PlainEMP`, :class:`PlainRank1`). Both start from the same state and draw
    their noise from generators of the same seed in the same order, so their losses must
    agree step by step: the table prints the largest difference of the two losses of a
    step, and each path's mean loss over its first and last 10 steps. The headline is ours
    / plain steps per second (goal >= 3x). The runs alternate, best of ``--repeats``.

(e) **SG-MCMC steps per second**: SGLD (``train_zoo.methods.sgld``: SGHMC's chain at
    friction 1), OptuNet at ``--weights`` (a chain starts from a trained network), batch
    64 (the recipe's), ``--sgmcmc-steps`` steps (default 500) over 32 Fashion-MNIST
    batches prepared beforehand, in each path's layout (not timed). Built as
    ``Sghmc.fit`` builds a ``preconditioner = "none"`` chain (:func:`sgld_setup`): ``N =
    60,000``, prior precision ``N x`` the optunet-mnist recipe's weight decay (12), step
    ``eta = lr / N`` with ``SGHMC_LR`` (2e-4 / 60,000).

    * ours: ``sghmc.SghmcStepper`` at friction ``sgld.METHOD.sampling_friction`` with the
      gradient the fast engine gives (``ModeEngine(spec, 0, data, "fast").log_posterior``:
      the numba kernels' ``-(N dL/dtheta + prior theta)``), recording the kinetic
      temperature every step as a chain's kept part does; the noise correction off (the
      headline), and on as the trainer's default runs it (a row of its own: posteriors'
      SGLD has only a constant ``beta``, so that row has no plain counterpart);
    * plain: the `posteriors` library's ``posteriors.sgmcmc.sgld`` (``build`` / ``init``
      / ``update``, temperature 1, ``beta`` 0) at ``lr = eta``, its log posterior
      (:func:`plain_log_posterior`) ``N`` times the batch's mean log-likelihood of OptuNet
      as an ``nn.Module`` through ``torch.func.functional_call`` plus the Gaussian log
      prior, differentiated by ``torch.func`` inside ``update``.

    Both start from the same weights, see the same batches in the same order and draw the
    same normals: posteriors draws ``torch.randn_like`` from torch's global generator
    and ours ``torch.randn`` from a ``torch.Generator``, one tensor per parameter in
    order, each seeded with ``seed + 1`` (the parameters go to posteriors as an
    ``OrderedDict``: optree walks a plain dict in sorted key order, ``fc.bias`` before
    ``fc.weight``, which draws the normals in another order). So the two chains walk the
    same path up to rounding: the table prints the largest difference of a step's two
    losses (minus the log posterior over ``N``) and of the parameters after
    ``min(steps, 50)`` steps. Bound on the latter (``tests/test_bench_methods.py``,
    ``_sgld_parameter_bound``): per step the two gradients' roundings (``2 gamma(k)`` of
    the largest ``|grad log p|``, times ``eta``) and the updates' (``16 u`` of the largest
    ``|theta|``), carried by at most ``1 + eta (N lambda + prior)`` a step (``lambda``
    the batch Hessian's largest eigenvalue, below 100 here): 2.7e-4 after 50 steps from
    checkpoint 0, measured 1.1e-6 (the chains moved 3.6e-3; a plain side with other
    normals, or with them in another order, ends about as far from ours). The headline
    is ours / plain steps per second (goal >= 3x); the runs alternate, best of
    ``--repeats``.

    Measured (``--parts e``, 1 thread, 2-core machine at load 6 from other jobs, so wall
    time is about twice CPU time): ours 1,912 steps/s, with the noise correction 1,182,
    posteriors 158: **12.1x** (7.5x with the correction; CPU seconds 0.13 / 0.21 / 1.41).
    Two more runs: 8.2x and 9.3x (``--repeats 3``), 5.3x and 6.0x with the correction;
    ours stays at 1,910-1,970 steps/s, posteriors' side varies (158-236).

(f) **New methods' steps per second**: cSGLD, IVON and SVGD on OptuNet from its seeded
    initialisation (each method starts there in the trainer; SVGD's other particles are
    the inits of ``svgd.particle_seed``), batch 64, ``--new-steps`` steps (default 200)
    over the 32 batches of (e), N = 60,000, each method's options its spec's defaults
    (:func:`new_method_setup`):

    * **cSGLD**: ours ``csgmcmc.CyclicalStepper`` at alpha 1 with the fast engine's
      gradient (``ModeEngine(..., "fast").log_posterior``, prior precision 12), lr 0.04
      (the recipe's, momentum 0), one cosine cycle over the timed steps with the
      method's sampling stage (its last 10%, as in a run); plain: OptuNet as an
      ``nn.Module``, ``loss.backward()`` of ``N`` x the mean cross-entropy + the prior,
      the cosine step size and the noise by hand (:func:`_csgld_chains`), normals from a
      ``torch.Generator`` of the same seed, one tensor per parameter in order.
    * **IVON**: ours ``ivon.IvonStepper`` (the ivon-opt package's ``IVON`` fed the
      kernels' gradient), lr 0.1, ``hess_init`` 1, beta 0.9 / 0.99999, delta 2e-4;
      plain: the package on the ``nn.Module`` as its README trains
      (``sampled_params(train=True)``: ``loss.backward()``; ``step()``), torch's
      global generator seeded alike before each (IVON draws its noise there).
    * **SVGD**: ours ``svgd.SvgdStepper``, ``--svgd-particles`` particles (default 20,
      the method's ``samples_per_mode``), one kernel gradient per particle, lr 0.04;
      plain: the particles stacked ``(n, d)``, their gradients in one
      ``torch.func.vmap(torch.func.grad_and_value(...))`` through ``functional_call``
      (the fastest plain way), the median bandwidth and ``stein_direction``'s formula
      written out in torch.

    Agreement: each pair is run again for ``min(steps, 10)`` steps from the same start,
    batches and noise (cSGLD's check cycle samples over its second half, so that the
    normals are compared), and the table prints the largest parameter difference (SVGD:
    over every particle) beside how far ours moved and the batch curvature the bound
    uses (the largest Hessian eigenvalue of the mean loss at the check's start and end,
    first and last batch: :func:`batch_curvature`). ``tests/test_bench_methods.py``
    (``_new_method_bound``: the gradients' float32 roundings and the updates', carried
    by twice that curvature) bounds it: after 10 steps 3.5e-5 (cSGLD), 2.7e-4 (IVON),
    9.6e-5 (SVGD); measured 6.0e-8, 3.0e-8 and 2.1e-7 (they moved 7.1e-3, 3.0e-2,
    1.6e-3). IVON agrees to rounding in float32 too (bit for bit in float64 with N a
    power of two: ``tests/test_method_ivon.py``); here ``-(-N g) / N`` and the kernels'
    gradient differ from autograd's by float32 rounding.

    Measured (``--parts f``, 1 thread, 2-core machine at load 2.3-3.3 from other jobs,
    best of 2): cSGLD 5,279 vs 781 steps/s, **6.8x**; IVON 2,897 vs 714, **4.1x**; SVGD
    (20 particles) 271 vs 61, **4.5x** (wall and CPU seconds equal: the load did not
    stretch these). A second run (``--repeats 3``, load 2.7): 7.0x, 4.3x, 4.5x. The
    plain SVGD's vmap is its fastest plain form: 20 module forward and backward passes
    take 22-26 ms (measured, before any update), vmap's gradients and step 16 ms.

Every contestant runs with the same ``--threads`` torch threads (default 1: on a shared
2-core machine two threads per process slow everyone down; ``full_ggn`` gives its BLAS
calls the same budget). Times are wall-clock; CPU seconds are printed too, since a busy
machine stretches wall time. The best of ``--repeats`` runs is reported for ours and
BackPack (Curvlinops and the generic path run once).

Run from the repository root::

    .venv/bin/python benchmarks/bench_methods.py                 # ~6 minutes + (c)'s collections
    .venv/bin/python benchmarks/bench_methods.py --quick         # smoke run, seconds
    .venv/bin/python benchmarks/bench_methods.py --parts d       # part (d) alone, ~40 s
    .venv/bin/python benchmarks/bench_methods.py --parts e       # part (e) alone, ~20 s
    .venv/bin/python benchmarks/bench_methods.py --parts f       # part (f) alone, ~30 s
    .venv/bin/python benchmarks/bench_methods.py --json benchmarks/output/methods.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posteriorzoo import vocabulary

DATASET = "fashion-mnist"
BBB_BATCH = 64
BBB_BATCHES = 32       # prepared batches the BBB loops cycle over
BBB_LR = 0.04          # the optunet-mnist recipe's learning rate
BBB_CHECK_STEPS = 50
# Curvlinops' batch sizes are timed on at most this many images: each of its batches is
# 392 GGN-vector products, so a calibration on thousands of images would take minutes
# (and its memory grows with 392 x the batch's activations).
CURVLINOPS_CALIBRATION = 512
PARTS = "abcdef"


def timed(function: Callable[[], Any], repeats: int = 1) -> tuple[float, float, Any]:
    """``(best wall s, CPU s of that run, result of the last run)`` over ``repeats``."""
    best = (float("inf"), 0.0)
    result = None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = function()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        best = min(best, (wall, cpu))
    return best[0], best[1], result


def training_images(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` Fashion-MNIST training images, normalised ``(count, 1, 28, 28)``
    float32, and their int64 labels ``(count,)``."""
    from train_zoo.data import eval_transform, load_training_data

    train = load_training_data(DATASET).train
    count = min(count, len(train))
    images = eval_transform(train)(torch.from_numpy(train.images[:count]))
    return images.float().contiguous(), torch.from_numpy(train.labels[:count]).long()


def optunet(weights: str, seed: int) -> torch.nn.Module:
    """OptuNet in eval mode: the bundled target's checkpoint 0, or a seeded init."""
    from posteriorzoo.models import build

    torch.manual_seed(seed)
    model = build("optunet")
    if weights == "reference":
        from posteriorzoo.reference import open_reference

        with open_reference("target") as zoo:
            model.load_state_dict(zoo.state_dict(0))
    return model.eval()


# ------------------------------------------------------------------ (a) the full GGN
def ours(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, generic: bool = False
         ) -> torch.Tensor:
    from train_zoo.methods.common import parameters_of
    from train_zoo.methods.laplace_curvature import full_ggn

    params, buffers = parameters_of(model)
    return full_ggn(model, params, buffers, [(x, y)], generic=generic)[0]


def laplace_torch(backend: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                  batch: int) -> torch.Tensor:
    """laplace-torch's full GGN ``la.H`` ``(D, D)`` float64, fitted batch by batch."""
    import laplace
    import laplace.curvature
    from torch.utils.data import DataLoader, TensorDataset

    la = laplace.Laplace(model, "classification", subset_of_weights="all",
                         hessian_structure="full",
                         backend=getattr(laplace.curvature, backend))
    la.fit(DataLoader(TensorDataset(x, y), batch_size=batch))
    return la.H.detach().double()


def relative_difference(theirs: torch.Tensor, reference: torch.Tensor) -> float:
    return float((theirs - reference).abs().max() / reference.abs().max())


def bench_ggn(args: argparse.Namespace) -> dict[str, Any]:
    x, y = training_images(args.ggn_images)
    n = len(y)
    model = optunet(args.weights, args.seed)
    ours(model, x[:256], y[:256])                                     # warm-up
    wall, cpu, ggn = timed(lambda: ours(model, x, y), args.repeats)
    rows = [{"method": "this project: full_ggn", "setting": "chunk 256", "images": n,
             "wall_s": wall, "cpu_s": cpu, "max_rel_diff": None}]
    if not args.no_generic:
        wall, cpu, generic = timed(lambda: ours(model, x, y, generic=True))
        rows.append({"method": "this project: full_ggn(generic=True)", "setting": "chunk 256",
                     "images": n, "wall_s": wall, "cpu_s": cpu,
                     "max_rel_diff": relative_difference(generic, ggn)})
    calibration: dict[str, dict[int, float]] = {}
    calibration_images: dict[str, int] = {}
    for backend in ("BackPackGGN", "CurvlinopsGGN"):
        def fit(b: int, c: int, backend: str = backend) -> torch.Tensor:
            # a fresh copy each time: BackPack extends the modules it is given
            return laplace_torch(backend, copy.deepcopy(model), x[:c], y[:c], b)

        fit(64, 64)                                                  # warm-up
        limit = min(n, args.calibration_images)
        if backend == "CurvlinopsGGN":
            limit = min(limit, args.curvlinops_images, CURVLINOPS_CALIBRATION)
        calibration_images[backend] = limit
        calibration[backend] = {batch: timed(lambda b=batch, c=limit: fit(b, c))[0]
                                for batch in args.batch_sizes if batch <= limit}
        best = min(calibration[backend], key=calibration[backend].get)
        count = n if backend == "BackPackGGN" else min(n, args.curvlinops_images)
        repeats = args.repeats if backend == "BackPackGGN" else 1
        wall, cpu, theirs = timed(lambda b=best, c=count: fit(b, c), repeats)
        reference = ggn if count == n else ours(model, x[:count], y[:count])
        rows.append({"method": f"laplace-torch {backend}", "setting": f"batch {best}",
                     "images": count, "wall_s": wall * n / count, "cpu_s": cpu * n / count,
                     "extrapolated_from": count if count < n else None,
                     "max_rel_diff": relative_difference(theirs, reference)})
    base = rows[0]
    for row in rows:
        row["x_ours"] = row["wall_s"] / base["wall_s"]
    faster = min((row for row in rows if row["method"].startswith("laplace-torch")),
                 key=lambda row: row["wall_s"])
    return {"images": n, "weights": args.weights, "rows": rows, "calibration": calibration,
            "calibration_images": calibration_images, "faster_baseline": faster["method"],
            "ratio": faster["x_ours"]}


# ------------------------------------------------------------------ (b) BBB steps
def bench_bbb(args: argparse.Namespace) -> dict[str, Any]:
    from posteriorzoo.models import build
    from train_zoo.fast.bbb import FastBBB
    from train_zoo.fast.layout import describe_model
    from train_zoo.methods import bbb

    x, y = training_images(BBB_BATCH * BBB_BATCHES)
    batches = [(x[i:i + BBB_BATCH], y[i:i + BBB_BATCH]) for i in range(0, len(y), BBB_BATCH)]
    # the kernels' layout: (C, H, W, B) float32
    fast_batches = [(xb.permute(1, 2, 3, 0).contiguous().numpy(), yb.numpy())
                    for xb, yb in batches]
    torch.manual_seed(args.seed)
    model = build("optunet")
    layout = describe_model(model, (1, 28, 28))
    start = bbb.init(model, torch.Generator().manual_seed(args.seed))
    num_data = 60_000

    def torch_steps(steps: int) -> bbb.BBBState:
        state, noise = start, torch.Generator().manual_seed(args.seed + 1)
        for i in range(steps):
            state, _ = bbb.step(state, model, {}, batches[i % len(batches)], noise, num_data,
                                BBB_LR)
        return state

    def fast_steps(steps: int) -> bbb.BBBState:
        fast, noise = FastBBB(layout, start), torch.Generator().manual_seed(args.seed + 1)
        for i in range(steps):
            xb, yb = fast_batches[i % len(fast_batches)]
            fast.step(xb, yb, noise, num_data, BBB_LR)
        return fast.state()

    torch_steps(5)
    fast_steps(5)                                           # loads / compiles the kernels
    result: dict[str, Any] = {"batch": BBB_BATCH, "lr": BBB_LR,
                              "elbo_samples": start.options.elbo_samples}
    for name, run, steps in (("torch", torch_steps, args.bbb_steps),
                             ("numba", fast_steps, args.bbb_fast_steps)):
        wall, cpu, _ = timed(lambda r=run, s=steps: r(s), args.repeats)
        result[name] = {"steps": steps, "wall_s": wall, "cpu_s": cpu,
                        "steps_per_s": steps / wall}
    result["ratio"] = result["numba"]["steps_per_s"] / result["torch"]["steps_per_s"]
    check = min(args.bbb_steps, BBB_CHECK_STEPS)
    a, b = torch_steps(check), fast_steps(check)
    result["check_steps"] = check
    result["max_rel_mu_diff"] = max(float((a.mu[k] - b.mu[k]).abs().max() / a.mu[k].abs().max())
                                    for k in a.mu)
    return result


# ------------------------------------------------------------------ (c) collections
SPECS = Path(__file__).resolve().parent.parent / "specs"
#: (c)'s methods: every method of the vocabulary but the ensemble family's (a DE
#: collection is 100 base networks trained by the recipe, whose training throughput
#: bench_training.py measures), so a method added there is timed here too once it has a
#: spec (collection_spec).
METHODS = tuple(name for name, info in vocabulary.METHODS.items() if info.family != "ensemble")


def collection_spec(method: str) -> Path:
    """The single-mode spec (c) trains for ``method``: 1 base network x 100 samples."""
    return SPECS / f"optunet-fashion-mnist-{method}.toml"


def collection_times(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time each method's 100-sample collection, as the trainer produces it.

    One ``train_zoo.run.train_collection`` per method (``--methods``, default every method
    of :data:`METHODS` with a single-mode spec in ``specs/``, :func:`collection_spec`: 1
    base network x 100 samples of OptuNet on Fashion-MNIST with the 60-epoch recipe), into
    a temporary file, in this process (serial backend, the auto engine).
    ``--collection-epochs E`` shortens the recipe (the method phases scale with it: SWAG
    runs 2E epochs). Returns one row per method::

        {"method": str, "samples": int, "epochs": int, "engine": str, "wall_s": float,
         "cpu_s": float}
    """
    import tempfile

    from train_zoo import load_spec
    from train_zoo.backends import SerialBackend
    from train_zoo.run import train_collection

    rows = []
    for method in args.methods:
        spec = load_spec(collection_spec(method))
        if args.collection_epochs is not None:
            spec = spec.replace(recipe=spec.recipe.with_epochs(args.collection_epochs))
            spec = _shortened_method_options(spec, method)
        with tempfile.TemporaryDirectory(prefix="bench-methods-") as folder:
            wall, cpu = time.perf_counter(), time.process_time()
            summary = train_collection(spec, Path(folder) / f"{method}.h5",
                                       backend=SerialBackend(), progress=False)
            rows.append({"method": method, "samples": summary.checkpoints,
                         "epochs": spec.recipe.epochs, "engine": "auto",
                         "wall_s": time.perf_counter() - wall,
                         "cpu_s": time.process_time() - cpu})
        print_collections(rows[-1:], header=not rows[:-1])
    return rows


def _shortened_method_options(spec: Any, method: str) -> Any:
    """``spec`` with the method options that depend on the recipe's length re-resolved
    (SWAG's phase is twice the recipe, its ramp at most that long)."""
    if method != "swag":
        return spec
    options = {key: value for key, value in spec.method_options.items()
               if key not in ("epochs", "ramp_epochs", "iterates")}
    epochs = 2 * spec.recipe.epochs
    options.update(epochs=epochs, ramp_epochs=min(10, epochs), iterates=min(20, epochs))
    return spec.replace(method_options=options)


# ------------------------------------------------------------------ (d) variant training
VARIANT_BATCH = 64
VARIANT_BATCHES = 32      # prepared batches the variant loops cycle over
VARIANTS = ("emp", "ecmp", "rank-1")
RANK1_LR = 0.04           # the optunet-mnist recipe's base learning rate
NUM_DATA = 60_000
# Rank-1's KL annealing runs over the whole training: the recipe's 60 epochs of 938 batches
RANK1_TOTAL_STEPS = 60 * math.ceil(NUM_DATA / VARIANT_BATCH)
# the loss summaries average this many steps at the start and the end of a run
LOSS_WINDOW = 10


def _optunet_trunk(x: torch.Tensor, conv1: torch.Tensor, conv2: torch.Tensor
                   ) -> torch.Tensor:
    """OptuNet's layers up to ``fc``'s input: conv1, ReLU, max-pool 3, grouped conv2, ReLU,
    global average pool (``posteriorzoo.models.optunet``)."""
    x = F.max_pool2d(F.relu(F.conv2d(x, conv1)), 3, 3)
    return F.adaptive_avg_pool2d(F.relu(F.conv2d(x, conv2, groups=2)), 1).flatten(1)


class PlainEMP(nn.Module):
    """EMP or ECMP on OptuNet written plainly: the ``K`` components of the patched layers
    (``conv1.weight``, ``fc.weight``, ``fc.bias``) are ``nn.Parameter`` stacks, ``conv2`` is
    shared, and ``forward`` draws the indices from ``generator`` (EMP: one per layer, fc's
    weight and bias sharing it; ECMP: one per element) in the order the method draws them.
    Trained with ``loss.backward()`` and ``torch.optim.Adam``."""

    def __init__(self, conv1: torch.Tensor, conv2: torch.Tensor, fc_weight: torch.Tensor,
                 fc_bias: torch.Tensor, variant: str, generator: torch.Generator) -> None:
        super().__init__()
        self.conv1 = nn.Parameter(conv1.detach().clone())          # (K, 2, 1, 4, 4)
        self.conv2 = nn.Parameter(conv2.detach().clone())          # (10, 1, 5, 5)
        self.fc_weight = nn.Parameter(fc_weight.detach().clone())  # (K, 10, 10)
        self.fc_bias = nn.Parameter(fc_bias.detach().clone())      # (K, 10)
        self.variant = variant
        self.generator = generator

    @classmethod
    def from_state(cls, state: Any, generator: torch.Generator) -> PlainEMP:
        """The module holding an ``EmpState``'s values (the same starting point)."""
        components, shared = state.components, state.shared
        return cls(components["conv1.weight"], shared["conv2.weight"],
                   components["fc.weight"], components["fc.bias"], state.variant, generator)

    def _element_draw(self, stack: torch.Tensor) -> torch.Tensor:
        index = torch.randint(stack.shape[0], stack.shape[1:], generator=self.generator)
        return stack.gather(0, index.unsqueeze(0)).squeeze(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.variant == "emp":
            first = torch.randint(self.conv1.shape[0], (), generator=self.generator)
            last = torch.randint(self.fc_weight.shape[0], (), generator=self.generator)
            conv1, fc_weight, fc_bias = self.conv1[first], self.fc_weight[last], self.fc_bias[last]
        else:
            conv1 = self._element_draw(self.conv1)
            fc_weight = self._element_draw(self.fc_weight)
            fc_bias = self._element_draw(self.fc_bias)
        return F.linear(_optunet_trunk(x, conv1, self.conv2), fc_weight, fc_bias)


def plain_emp_step(module: PlainEMP, optimizer: torch.optim.Optimizer,
                   batch: tuple[torch.Tensor, torch.Tensor], weight_decay: float) -> float:
    """Mean cross-entropy plus ``weight_decay / B`` times the squares of every parameter
    (every component, drawn or not), one Adam step."""
    images, labels = batch
    squares = sum(parameter.square().sum() for parameter in module.parameters())
    loss = F.cross_entropy(module(images), labels) + weight_decay / len(labels) * squares
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


class PlainRank1(nn.Module):
    """Rank-1 OptuNet written plainly: per layer (conv1, conv2, fc) a shared weight, and
    the ``(K, outputs)`` / ``(K, inputs)`` locations and ``rho`` of ``r`` and ``s`` as
    parameters; fc's bias is one row per component. ``forward`` tiles the batch ``K`` times
    (component-major), draws ``r = clip(loc + softplus(rho) eps)`` and ``s`` likewise per
    example (``eps`` from ``generator``, layer by layer, ``r``'s then ``s``'s) and computes
    ``(W (x * s)) * r + b_k``. Trained with ``loss.backward()`` and ``torch.optim.SGD``
    (Nesterov momentum 0.9)."""

    LAYERS = ("conv1", "conv2", "fc")

    def __init__(self, weights: dict[str, torch.Tensor], fc_bias: torch.Tensor,
                 factors: dict[str, dict[str, torch.Tensor]], generator: torch.Generator, *,
                 prior_mean: float = 1.0, prior_scale: float = 0.1, clip: float = 10.0
                 ) -> None:
        super().__init__()
        self.weight = nn.ParameterDict({layer: nn.Parameter(weights[layer].detach().clone())
                                        for layer in self.LAYERS})
        self.fc_bias = nn.Parameter(fc_bias.detach().clone())       # (K, 10)
        self.r_loc, self.r_rho, self.s_loc, self.s_rho = (
            nn.ParameterDict({layer: nn.Parameter(factors[part][layer].detach().clone())
                              for layer in self.LAYERS})
            for part in ("r_loc", "r_rho", "s_loc", "s_rho"))
        self.components = self.fc_bias.shape[0]
        self.generator = generator
        self.prior_mean, self.prior_scale, self.clip = prior_mean, prior_scale, clip

    @classmethod
    def from_state(cls, state: Any, generator: torch.Generator) -> PlainRank1:
        """The module holding a ``Rank1State``'s values (the same starting point)."""
        options = state.options
        return cls({layer: state.weights[f"{layer}.weight"] for layer in cls.LAYERS},
                   state.biases["fc.bias"],
                   {part: getattr(state, part) for part in ("r_loc", "r_rho", "s_loc",
                                                            "s_rho")},
                   generator, prior_mean=options.prior_mean,
                   prior_scale=options.prior_scale, clip=options.clip)

    def _draw(self, loc: torch.Tensor, rho: torch.Tensor, which: torch.Tensor
              ) -> torch.Tensor:
        eps = torch.randn(len(which), loc.shape[1], generator=self.generator)
        return (loc[which] + F.softplus(rho[which]) * eps).clamp(-self.clip, self.clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(K B, 10)`` of the tiled batch: row ``k B + i`` is example ``i`` under
        component ``k``."""
        which = torch.arange(self.components).repeat_interleave(x.shape[0])
        x = x.repeat(self.components, 1, 1, 1)
        r, s = {}, {}
        for layer in self.LAYERS:
            r[layer] = self._draw(self.r_loc[layer], self.r_rho[layer], which)
            s[layer] = self._draw(self.s_loc[layer], self.s_rho[layer], which)
        w = self.weight
        h = F.conv2d(x * s["conv1"][:, :, None, None], w["conv1"]) * r["conv1"][:, :, None, None]
        h = F.max_pool2d(F.relu(h), 3, 3)
        h = (F.conv2d(h * s["conv2"][:, :, None, None], w["conv2"], groups=2)
             * r["conv2"][:, :, None, None])
        h = F.adaptive_avg_pool2d(F.relu(h), 1).flatten(1)
        return F.linear(h * s["fc"], w["fc"]) * r["fc"] + self.fc_bias[which]

    def kl(self) -> torch.Tensor:
        """Closed-form KL of every factor entry of every component to N(mean, scale^2)."""
        total = torch.zeros(())
        for locs, rhos in ((self.r_loc, self.r_rho), (self.s_loc, self.s_rho)):
            for layer in self.LAYERS:
                scale = F.softplus(rhos[layer])
                total = total + (math.log(self.prior_scale) - torch.log(scale)
                                 + (scale ** 2 + (locs[layer] - self.prior_mean) ** 2)
                                 / (2 * self.prior_scale ** 2) - 0.5).sum()
        return total


def plain_rank1_step(module: PlainRank1, optimizer: torch.optim.Optimizer,
                     batch: tuple[torch.Tensor, torch.Tensor], step: int, *, num_data: int,
                     total_steps: int, annealing: float = 0.8, l2: float = 1e-4) -> float:
    """Mean cross-entropy over the tiled batch + annealed KL / N + L2 on the weights and
    biases, one optimiser step."""
    images, labels = batch
    kl_scale = min(1.0, (step + 1) / (annealing * total_steps))
    squares = sum(value.square().sum() for value in (*module.weight.values(), module.fc_bias))
    loss = (F.cross_entropy(module(images), labels.repeat(module.components))
            + kl_scale * module.kl() / num_data + l2 * squares)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def _kernel_layout(step: Callable[[tuple], float]) -> Callable[[tuple, int], float]:
    """``step`` fed the kernels' layout of each torch batch, converted once per batch and
    kept (the trainer's ``batches_for`` delivers that layout; neither path's data
    preparation is timed)."""
    prepared: dict[int, tuple] = {}

    def run(batch: tuple, index: int) -> float:
        key = id(batch[0])
        if key not in prepared:
            images, labels = batch
            prepared[key] = (images.permute(1, 2, 3, 0).contiguous().numpy(), labels.numpy())
        return step(prepared[key])
    return run


def _variant_runners(variant: str, seed: int, num_data: int
                     ) -> tuple[Callable[[], Callable], Callable[[], Callable]]:
    """Two factories, ours and plain, each returning a fresh ``step(batch, index) ->
    loss`` from the same initial state with a noise generator of the same seed."""
    from posteriorzoo.models import build
    from train_zoo.fast.gradients import fast_loss_gradient
    from train_zoo.fast.layout import describe_model
    from train_zoo.fast.rank1 import rank1_network
    from train_zoo.methods import emp, rank1

    torch.manual_seed(seed)
    model = build("optunet")
    init_generator = torch.Generator().manual_seed(seed)
    if variant in ("emp", "ecmp"):
        options = emp.EmpOptions(variant=variant)
        start = emp.init_model(model, init_generator, options)

        def ours() -> Callable:
            # the trainer's fast engine: the kernels' gradient, batches in their layout
            # (the trainer's batches_for prepares them so; converted once here, untimed)
            layout = describe_model(model, (1, 28, 28))
            gradient = fast_loss_gradient(layout, {name: value.detach() for name, value
                                                   in model.named_parameters()})
            stepper = emp.EmpStepper(model, start, torch.Generator().manual_seed(seed + 1),
                                     weight_decay=options.weight_decay, lr=options.lr,
                                     gradient=gradient)
            return _kernel_layout(lambda batch: stepper.step(batch, options.lr))

        def plain() -> Callable:
            module = PlainEMP.from_state(start, torch.Generator().manual_seed(seed + 1))
            optimizer = torch.optim.Adam(module.parameters(), lr=options.lr)
            return lambda batch, index: plain_emp_step(module, optimizer, batch,
                                                       options.weight_decay)
        return ours, plain

    params = {name: value.detach() for name, value in model.named_parameters()}
    start = rank1.init(model, params, rank1.Rank1Options.components, init_generator)

    def ours() -> Callable:
        # the trainer's fast engine: the network part on the kernel, batches in its layout
        network = rank1_network(describe_model(model, (1, 28, 28)), start.layers)
        stepper = rank1.Rank1Stepper(start, model, rank1.Rank1Run(
            torch.Generator().manual_seed(seed + 1), num_data, RANK1_TOTAL_STEPS), network)
        return _kernel_layout(lambda batch: stepper.step(batch, RANK1_LR))

    def plain() -> Callable:
        module = PlainRank1.from_state(start, torch.Generator().manual_seed(seed + 1))
        optimizer = torch.optim.SGD(module.parameters(), lr=RANK1_LR,
                                    momentum=rank1.MOMENTUM, nesterov=rank1.NESTEROV)
        options = start.options
        return lambda batch, index: plain_rank1_step(
            module, optimizer, batch, index, num_data=num_data,
            total_steps=RANK1_TOTAL_STEPS, annealing=options.kl_annealing, l2=options.l2)
    return ours, plain


def _timed_steps(factory: Callable[[], Callable], batches: list, steps: int
                 ) -> tuple[float, float, list[float]]:
    """``(wall s, CPU s, losses)`` of ``steps`` steps of a fresh runner (its construction
    is not timed)."""
    step = factory()
    losses = []
    wall, cpu = time.perf_counter(), time.process_time()
    for index in range(steps):
        losses.append(step(batches[index % len(batches)], index))
    return time.perf_counter() - wall, time.process_time() - cpu, losses


def bench_variants(args: argparse.Namespace) -> dict[str, Any]:
    x, y = training_images(VARIANT_BATCH * VARIANT_BATCHES)
    batches = [(x[i:i + VARIANT_BATCH], y[i:i + VARIANT_BATCH])
               for i in range(0, len(y), VARIANT_BATCH)]
    steps = args.variant_steps
    window = min(LOSS_WINDOW, steps)
    rows = []
    for variant in VARIANTS:
        ours, plain = _variant_runners(variant, args.seed, NUM_DATA)
        factories = {"ours": ours, "plain": plain}
        for factory in factories.values():
            _timed_steps(factory, batches, 3)                           # warm-up
        best: dict[str, tuple[float, float]] = {}
        losses: dict[str, list[float]] = {}
        for _ in range(args.repeats):                                   # interleaved
            for name, factory in factories.items():
                wall, cpu, losses[name] = _timed_steps(factory, batches, steps)
                best[name] = min(best.get(name, (float("inf"), 0.0)), (wall, cpu))
        row: dict[str, Any] = {"variant": variant, "steps": steps}
        for name in factories:
            wall, cpu = best[name]
            row[name] = {"wall_s": wall, "cpu_s": cpu, "steps_per_s": steps / wall,
                         "loss_start": sum(losses[name][:window]) / window,
                         "loss_end": sum(losses[name][-window:]) / window}
        row["ratio"] = row["ours"]["steps_per_s"] / row["plain"]["steps_per_s"]
        # same initial state, same batches, same noise seed: the two losses of each step
        row["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses["ours"],
                                                              losses["plain"], strict=True))
        rows.append(row)
    return {"batch": VARIANT_BATCH, "steps": steps, "loss_window": window,
            "rank1_lr": RANK1_LR, "rows": rows}


# ------------------------------------------------------------------ (e) SG-MCMC steps
SGMCMC_BATCHES = 32       # prepared batches the chains cycle over
SGMCMC_CHECK_STEPS = 50   # steps of the matched-noise check of the parameters


class SgmcmcChain:
    """One chain of part (e): ``step(batch) -> loss`` (the batch's mean cross-entropy plus
    ``prior_precision / 2 ||theta||^2 / N``, i.e. minus the log posterior over ``N``, at the
    parameters before the step) and :meth:`params`."""

    def __init__(self, step: Callable[[tuple], float], params: Callable[[], dict]) -> None:
        self.step, self.params = step, params


def sgld_setup(weights: str, seed: int) -> dict[str, Any]:
    """What the trainer's SGLD mode (``preconditioner = "none"``) derives for OptuNet on
    Fashion-MNIST, built the way :meth:`train_zoo.methods.sghmc.Sghmc.fit` builds it: a
    :class:`train_zoo.programs.ModeEngine` on the fast engine, ``N`` the training set's
    size, the prior precision ``N x`` the optunet-mnist recipe's weight decay, ``eta =
    lr / N`` with the method's default ``lr`` (``SGHMC_LR``), the friction of
    ``sgld.METHOD`` and the gradient ``engine.log_posterior`` gives (the numba kernels')."""
    from train_zoo import make_spec
    from train_zoo.data import load_training_data
    from train_zoo.fast.engine import layout_for
    from train_zoo.methods import sghmc, sgld
    from train_zoo.methods.common import parameters_of
    from train_zoo.programs import ModeEngine

    spec = make_spec("optunet-mnist", dataset=DATASET, method="sgld", modes=1,
                     samples_per_mode=1, base_seed=seed,
                     method_options={"preconditioner": "none"})
    data = load_training_data(DATASET)
    engine = ModeEngine(spec, 0, data, "fast")
    model = optunet(weights, seed)
    params, buffers = parameters_of(model)
    num_data = len(data.train)
    options = spec.method_options
    prior = sghmc.prior_precision_from_weight_decay(num_data, spec.recipe.weight_decay)
    if layout_for(model, data) is None:      # ModeEngine's test: the kernels take OptuNet
        raise RuntimeError("the fast engine does not take OptuNet: part (e) times nothing")
    return {"model": model, "params": params, "buffers": buffers, "num_data": num_data,
            "prior_precision": prior, "eta": options["lr"] / num_data, "lr": options["lr"],
            "friction": sgld.METHOD.sampling_friction, "batch": spec.recipe.batch_size,
            "noise_decay": options["noise_decay"],
            "gradient": engine.log_posterior(model, params, buffers, num_data, prior)}


def plain_log_posterior(model: nn.Module, buffers: dict[str, torch.Tensor], num_data: int,
                        prior_precision: float) -> Callable:
    """The `posteriors` library's ``log_posterior(params, batch) -> (value, aux)`` for
    OptuNet as an ``nn.Module``: ``N`` times the batch's mean log-likelihood plus the
    Gaussian log prior ``-prior_precision / 2 ||theta||^2`` (the function the trainer's
    gradient differentiates, up to a constant), by ``torch.func.functional_call``."""
    def log_posterior(params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        logits = torch.func.functional_call(model, (params, buffers), (images,))
        log_likelihood = -num_data * F.cross_entropy(logits, labels)
        log_prior = -0.5 * prior_precision * sum(value.square().sum()
                                                 for value in params.values())
        return log_likelihood + log_prior, logits
    return log_posterior


def _sgld_chains(setup: dict[str, Any], seed: int,
                 watch: list[tuple[float, float]] | None = None
                 ) -> dict[str, Callable[[], SgmcmcChain]]:
    """A factory per path of part (e), each making a fresh chain from ``setup``'s weights
    whose normals come from seed ``seed``: ours from a ``torch.Generator`` (one normal
    tensor per parameter, in order), the plain side from torch's global generator (its
    ``torch.randn_like``), seeded here: run it inside ``torch.random.fork_rng``. With
    ``watch``, ours appends ``(max |grad log p|, max |theta|)`` of each step to it."""
    from train_zoo.methods.sghmc import NOISE_WARM_UP, SghmcStepper

    with warnings.catch_warnings():        # tensordict's FutureWarning on posteriors' states
        warnings.simplefilter("ignore", FutureWarning)
        from posteriors.sgmcmc import sgld as posteriors_sgld

    params, eta, friction = setup["params"], setup["eta"], setup["friction"]
    gradient = setup["gradient"]
    if watch is not None:
        def gradient(theta: dict, batch: tuple, inner: Callable = setup["gradient"]
                     ) -> tuple[float, dict]:
            loss, grads = inner(theta, batch)
            watch.append((max(float(value.abs().max()) for value in grads.values()),
                          max(float(value.abs().max()) for value in theta.values())))
            return loss, grads

    def ours(noise_decay: float | None = None) -> SgmcmcChain:
        # record_from 0: the kinetic temperature of every step, as in a chain's kept part
        stepper = SghmcStepper(params, gradient, eta, friction,
                               torch.Generator().manual_seed(seed), 2**62,
                               noise_decay=noise_decay, warm_up=NOISE_WARM_UP)
        return SgmcmcChain(lambda batch: stepper.step(batch, eta),
                           lambda: stepper.state.params)

    def plain() -> SgmcmcChain:
        num_data = setup["num_data"]
        transform = posteriors_sgld.build(
            plain_log_posterior(setup["model"], setup["buffers"], num_data,
                                setup["prior_precision"]), lr=eta)
        # an OrderedDict: optree walks a plain dict in sorted key order (fc.bias before
        # fc.weight), which would draw the normals in another order than ours
        state = transform.init(OrderedDict((name, value.clone())
                                           for name, value in params.items()))
        torch.manual_seed(seed)

        def step(batch: tuple) -> float:
            nonlocal state
            state, _ = transform.update(state, batch)
            return -float(state.log_posterior) / num_data
        return SgmcmcChain(step, lambda: dict(state.params))

    return {"ours": ours, "ours_corrected": lambda: ours(setup["noise_decay"]),
            "plain": plain}


def _run_chain(chain: SgmcmcChain, batches: list, steps: int
               ) -> tuple[float, float, list[float]]:
    """``(wall s, CPU s, losses)`` of ``steps`` steps of ``chain`` over ``batches``."""
    losses = []
    wall, cpu = time.perf_counter(), time.process_time()
    for index in range(steps):
        losses.append(chain.step(batches[index % len(batches)]))
    return time.perf_counter() - wall, time.process_time() - cpu, losses


def _time_chains(factories: dict[str, Callable[[], SgmcmcChain]], data: dict[str, list],
                 steps: int, repeats: int, warm_up: int
                 ) -> tuple[dict[str, tuple[float, float]], dict[str, list[float]]]:
    """Each chain's best ``(wall s, CPU s)`` over ``repeats`` interleaved runs of ``steps``
    steps (after ``warm_up`` steps of a fresh one), and its last run's losses."""
    for name, factory in factories.items():
        _run_chain(factory(), data[name], warm_up)
    best: dict[str, tuple[float, float]] = {}
    losses: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, factory in factories.items():
            wall, cpu, losses[name] = _run_chain(factory(), data[name], steps)
            best[name] = min(best.get(name, (float("inf"), 0.0)), (wall, cpu))
    return best, losses


def prepared_batches(batch: int, count: int) -> tuple[list, list]:
    """``count`` Fashion-MNIST batches of ``batch`` images as torch takes them, and the
    same in the kernels' layout ((C, H, W, B) float32, as the fast engine's batches come)."""
    x, y = training_images(batch * count)
    batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(y), batch)]
    kernel_batches = [(xb.permute(1, 2, 3, 0).contiguous().numpy(), yb.numpy())
                      for xb, yb in batches]
    return batches, kernel_batches


def bench_sgmcmc(args: argparse.Namespace) -> dict[str, Any]:
    """Part (e): SGLD steps per second, ours (three paths: see the module docstring)."""
    setup = sgld_setup(args.weights, args.seed)
    batches, kernel_batches = prepared_batches(setup["batch"], SGMCMC_BATCHES)
    data = {"ours": kernel_batches, "ours_corrected": kernel_batches, "plain": batches}
    steps, noise = args.sgmcmc_steps, args.seed + 1
    window = min(LOSS_WINDOW, steps)
    with torch.random.fork_rng(devices=[]):        # the plain side seeds torch's generator
        factories = _sgld_chains(setup, noise)
        best, losses = _time_chains(factories, data, steps, args.repeats, warm_up=3)
        check = min(steps, SGMCMC_CHECK_STEPS)
        watch: list[tuple[float, float]] = []
        checked = _sgld_chains(setup, noise, watch)
        ours, plain = checked["ours"](), checked["plain"]()
        _run_chain(ours, kernel_batches, check)
        _run_chain(plain, batches, check)
    result: dict[str, Any] = {"batch": setup["batch"], "steps": steps, "lr": setup["lr"],
                              "eta": setup["eta"], "num_data": setup["num_data"],
                              "prior_precision": setup["prior_precision"],
                              "friction": setup["friction"], "weights": args.weights,
                              "loss_window": window}
    for name in factories:
        wall, cpu = best[name]
        result[name] = {"wall_s": wall, "cpu_s": cpu, "steps_per_s": steps / wall,
                        "loss_start": sum(losses[name][:window]) / window,
                        "loss_end": sum(losses[name][-window:]) / window}
    result["ratio"] = result["ours"]["steps_per_s"] / result["plain"]["steps_per_s"]
    result["corrected_ratio"] = (result["ours_corrected"]["steps_per_s"]
                                 / result["plain"]["steps_per_s"])
    # same start, batches and normals: the two losses of each step
    result["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses["ours"], losses["plain"],
                                                             strict=True))
    a, b = ours.params(), plain.params()
    result["check_steps"] = check
    result["max_param_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    result["max_param_moved"] = max(float((a[k] - setup["params"][k]).abs().max()) for k in a)
    # the largest |theta| and |grad log p| along ours (the bound's scales)
    result["max_param"] = max(max(theta for _, theta in watch),
                              *(float(value.abs().max()) for value in (*a.values(),
                                                                       *b.values())))
    result["max_grad"] = max(grad for grad, _ in watch)
    return result


# ------------------------------------------------------------------ (f) new methods
NEW_METHODS = ("csgld", "ivon", "svgd")
NEW_CHECK_STEPS = 10      # steps of the agreement check of part (f)
SVGD_PARTICLES = 20       # the method's default: samples_per_mode particles
CSGLD_CHECK_FRACTION = 0.5  # the sampling stage's share of the check's cycle


def new_method_setup(seed: int, particles: int) -> dict[str, Any]:
    """What the trainer derives for cSGLD, IVON and SVGD on OptuNet / Fashion-MNIST (each
    from its spec's defaults: ``make_spec``), with the fast engine's gradients
    (``ModeEngine(spec, 0, data, "fast").log_posterior``: the numba kernels'). Each method
    starts from the network's initialisation (the seeded init here); SVGD's particles are
    the inits of :func:`train_zoo.methods.svgd.particle_seed`."""
    from train_zoo import make_spec
    from train_zoo.data import load_training_data
    from train_zoo.fast.engine import layout_for
    from train_zoo.methods import sghmc
    from train_zoo.methods.common import parameters_of
    from train_zoo.methods.svgd import particle_seed
    from train_zoo.programs import ModeEngine

    def spec_of(method: str, samples: int) -> Any:
        return make_spec("optunet-mnist", dataset=DATASET, method=method, modes=1,
                         samples_per_mode=samples, base_seed=seed)

    csgld, ivon, svgd = spec_of("csgld", 10), spec_of("ivon", 1), spec_of("svgd", particles)
    data = load_training_data(DATASET)
    engine = ModeEngine(csgld, 0, data, "fast")
    model = optunet("random", seed)
    params, buffers = parameters_of(model)
    if buffers or layout_for(model, data) is None:
        raise RuntimeError("the fast engine does not take OptuNet: part (f) times nothing")
    num_data = len(data.train)
    recipe = csgld.recipe
    prior = sghmc.prior_precision_from_weight_decay(num_data, recipe.weight_decay)
    inits = [params] + [parameters_of(optunet("random", particle_seed(seed, j)))[0]
                        for j in range(1, particles)]
    return {"model": model, "params": params, "num_data": num_data,
            "prior_precision": prior, "batch": recipe.batch_size,
            "gradient": engine.log_posterior(model, params, buffers, num_data, prior),
            "likelihood_gradient": engine.log_posterior(model, params, buffers, num_data,
                                                        0.0),
            "csgld": dict(csgld.method_options), "ivon": dict(ivon.method_options),
            "svgd_lr": svgd.recipe.learning_rate(0), "particles": inits}


def _watched(gradient: Callable, watch: list[tuple[float, float]] | None) -> Callable:
    """``gradient``, appending ``(max |grad|, max |theta|)`` of each call to ``watch``."""
    if watch is None:
        return gradient

    def watched(theta: dict, batch: tuple) -> tuple[float, dict]:
        loss, grads = gradient(theta, batch)
        watch.append((max(float(value.abs().max()) for value in grads.values()),
                      max(float(value.abs().max()) for value in theta.values())))
        return loss, grads
    return watched


def _csgld_chains(setup: dict[str, Any], seed: int, cycle_steps: int,
                  watch: list[tuple[float, float]] | None = None,
                  fraction: float | None = None) -> dict[str, Callable[[], SgmcmcChain]]:
    """Part (f)'s cSGLD: ours ``CyclicalStepper`` at alpha 1 on the kernels' gradient;
    plain OptuNet as an ``nn.Module``, ``loss.backward()`` on ``N`` x the mean
    cross-entropy + the prior, the cosine step size and the noise by hand. One cycle of
    ``cycle_steps`` whose last ``fraction`` (by default the method's) is the sampling
    stage; both draw their normals from a ``torch.Generator`` seeded ``seed``, one tensor
    per parameter in order, in the sampling stage only."""
    from train_zoo.methods.csgmcmc import CyclicalStepper

    options, num_data = setup["csgld"], setup["num_data"]
    lr, prior = options["lr"], setup["prior_precision"]
    if fraction is None:
        fraction = options["sampling_fraction"]

    def ours() -> SgmcmcChain:
        stepper = CyclicalStepper(setup["params"], _watched(setup["gradient"], watch), lr,
                                  num_data, 1.0, cycle_steps, fraction, 2**62,
                                  torch.Generator().manual_seed(seed))
        return SgmcmcChain(lambda batch: stepper.step(batch, lr), lambda: stepper.params)

    def plain() -> SgmcmcChain:
        model = copy.deepcopy(setup["model"]).train()
        generator = torch.Generator().manual_seed(seed)
        count = 0

        def step(batch: tuple) -> float:
            nonlocal count
            images, labels = batch
            model.zero_grad(set_to_none=True)
            prior_term = 0.5 * prior * sum(p.square().sum() for p in model.parameters())
            loss = num_data * F.cross_entropy(model(images), labels) + prior_term
            loss.backward()
            eta = lr / 2 * (math.cos(math.pi * (count % cycle_steps) / cycle_steps) + 1)
            eta /= num_data
            sampling = count % cycle_steps >= (1 - fraction) * cycle_steps
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(eta * p.grad)
                    if sampling:
                        p.add_(math.sqrt(2 * eta) * torch.randn(p.shape, generator=generator))
            count += 1
            return float(loss) / num_data
        return SgmcmcChain(step, lambda: {name: p.detach().clone()
                                          for name, p in model.named_parameters()})

    return {"ours": ours, "plain": plain}


def _ivon_chains(setup: dict[str, Any], seed: int,
                 watch: list[tuple[float, float]] | None = None,
                 hess: list[float] | None = None) -> dict[str, Callable[[], SgmcmcChain]]:
    """Part (f)'s IVON: ours ``IvonStepper`` (the ivon-opt optimiser fed the kernels'
    gradient); plain the package's own loop on OptuNet as an ``nn.Module``
    (``sampled_params(train=True)``: ``loss.backward()``; ``step()``). Each seeds torch's
    global generator with ``seed`` when built (IVON draws its noise there): run them
    inside ``torch.random.fork_rng``. With ``hess``, ours appends the smallest Hessian
    estimate after each step."""
    import ivon

    from train_zoo.methods.ivon import IvonStepper

    options, num_data = setup["ivon"], setup["num_data"]
    lr, decay = options["lr"], options["weight_decay"]

    def ours() -> SgmcmcChain:
        torch.manual_seed(seed)
        stepper = IvonStepper(copy.deepcopy(setup["model"]),
                              _watched(setup["likelihood_gradient"], watch), num_data, lr,
                              options, decay)

        def step(batch: tuple) -> float:
            loss = stepper.step(batch, lr)
            if hess is not None:
                hess.append(float(stepper.hess().min()))
            return loss
        return SgmcmcChain(step, lambda: {name: p.detach().clone() for name, p in
                                          zip(stepper.names, stepper.parameters,
                                              strict=True)})

    def plain() -> SgmcmcChain:
        torch.manual_seed(seed)
        model = copy.deepcopy(setup["model"]).train()
        optimizer = ivon.IVON(model.parameters(), lr=lr, ess=float(num_data),
                              hess_init=options["hess_init"], beta1=options["beta1"],
                              beta2=options["beta2"], weight_decay=decay, mc_samples=1,
                              hess_approx="price")

        def step(batch: tuple) -> float:
            images, labels = batch
            with optimizer.sampled_params(train=True):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(images), labels)
                loss.backward()
            optimizer.step()
            return float(loss)
        return SgmcmcChain(step, lambda: {name: p.detach().clone()
                                          for name, p in model.named_parameters()})

    return {"ours": ours, "plain": plain}


def _largest_kernel_row_sum(particles: torch.Tensor) -> float:
    """``max_i sum_j k(x_j, x_i)`` of SVGD's kernel at these particles ``(n, d)`` (the
    median-rule bandwidth of :mod:`train_zoo.methods.svgd`)."""
    from train_zoo.methods.svgd import median_bandwidth

    x = particles.double()
    kernel = torch.exp(-torch.cdist(x, x).square() / median_bandwidth(x))
    return float(kernel.sum(1).max())


def _svgd_chains(setup: dict[str, Any], watch: list[tuple[float, float]] | None = None
                 ) -> dict[str, Callable[[], SgmcmcChain]]:
    """Part (f)'s SVGD: ours ``SvgdStepper`` (a kernel gradient per particle, BlackJAX's
    median bandwidth, float64 particles); plain the particles stacked ``(n, d)`` in
    float64, their gradients by ``torch.func.vmap(torch.func.grad(...))`` of OptuNet
    through ``functional_call`` (in float32, as ours), the bandwidth and the Stein
    direction written out in torch. ``params()`` gives every particle, flat."""
    from train_zoo.methods.common import flatten
    from train_zoo.methods.svgd import SvgdStepper

    num_data, prior, lr = setup["num_data"], setup["prior_precision"], setup["svgd_lr"]
    model = setup["model"]
    names = list(setup["params"])
    shapes = [setup["params"][name].shape for name in names]
    sizes = [math.prod(shape) for shape in shapes]

    def ours() -> SgmcmcChain:
        stepper = SvgdStepper(setup["particles"], _watched(setup["gradient"], watch),
                              num_data)
        return SgmcmcChain(lambda batch: stepper.step(batch, lr),
                           lambda: {"particles": stepper.x.clone()})

    def plain() -> SgmcmcChain:
        def minus_log_posterior(flat: torch.Tensor, images: torch.Tensor,
                                labels: torch.Tensor) -> torch.Tensor:
            params = {name: part.reshape(shape) for name, part, shape in
                      zip(names, flat.split(sizes), shapes, strict=True)}
            logits = torch.func.functional_call(model, params, (images,))
            return (num_data * F.cross_entropy(logits, labels)
                    + 0.5 * prior * flat.square().sum())

        grads = torch.func.vmap(torch.func.grad_and_value(minus_log_posterior),
                                in_dims=(0, None, None))
        x = torch.stack([flatten(p).double() for p in setup["particles"]])

        def step(batch: tuple) -> float:
            nonlocal x
            gradient, value = grads(x.float(), *batch)
            g = -gradient.double()
            n = x.shape[0]
            squared = torch.cdist(x, x).square()
            if n > 1:
                pairs = torch.triu_indices(n, n, offset=1)
                bandwidth = float(squared[pairs[0], pairs[1]].median()) / math.log(n)
            else:
                bandwidth = 1.0
            kernel = torch.exp(-squared / bandwidth)
            repulsion = (2 / bandwidth) * (kernel.sum(1, keepdim=True) * x - kernel @ x)
            # phi = (kernel @ g + repulsion) / n, stepped by n lr / N (train_zoo.methods.svgd)
            x = x + (lr / num_data) * (kernel @ g + repulsion)
            return float(value.mean()) / num_data
        return SgmcmcChain(step, lambda: {"particles": x.clone()})

    return {"ours": ours, "plain": plain}


def batch_curvature(model: nn.Module, points: list[dict[str, torch.Tensor]],
                    batches: list[tuple]) -> float:
    """The largest Hessian eigenvalue (in absolute value) of OptuNet's batch mean
    cross-entropy over ``points`` x ``batches`` (392 parameters: the full Hessian by
    ``torch.func.hessian``): the scale by which a difference of weights moves a gradient,
    for the agreement bounds of ``tests/test_bench_methods.py``."""
    names = list(points[0])
    shapes = [points[0][name].shape for name in names]
    sizes = [math.prod(shape) for shape in shapes]

    def loss(flat: torch.Tensor, images: torch.Tensor, labels: torch.Tensor
             ) -> torch.Tensor:
        params = {name: part.reshape(shape) for name, part, shape in
                  zip(names, flat.split(sizes), shapes, strict=True)}
        return F.cross_entropy(torch.func.functional_call(model, params, (images,)), labels)

    largest = 0.0
    for point in points:
        flat = torch.cat([point[name].detach().float().flatten() for name in names])
        for images, labels in batches:
            hessian = torch.func.hessian(loss)(flat, images, labels).double()
            largest = max(largest, float(torch.linalg.eigvalsh(hessian).abs().max()))
    return largest


def _unflat(setup: dict[str, Any], row: torch.Tensor) -> dict[str, torch.Tensor]:
    from train_zoo.methods.common import unflatten

    return unflatten(row.float(), setup["params"])


def bench_new_methods(args: argparse.Namespace) -> dict[str, Any]:
    """Part (f): cSGLD, IVON and SVGD steps per second, ours against plain (module
    docstring), and the agreement of the two after ``min(steps, NEW_CHECK_STEPS)``."""
    setup = new_method_setup(args.seed, args.svgd_particles)
    batches, kernel_batches = prepared_batches(setup["batch"], SGMCMC_BATCHES)
    data = {"ours": kernel_batches, "plain": batches}
    steps, noise = args.new_steps, args.seed + 1
    check = min(steps, NEW_CHECK_STEPS)
    window = min(LOSS_WINDOW, steps)
    rows = []
    with torch.random.fork_rng(devices=[]):        # IVON and the inits use torch's generator
        for method in NEW_METHODS:
            if method == "csgld":
                factories = _csgld_chains(setup, noise, steps)
            elif method == "ivon":
                factories = _ivon_chains(setup, noise)
            else:
                factories = _svgd_chains(setup)
            best, losses = _time_chains(factories, data, steps, args.repeats, warm_up=2)
            watch: list[tuple[float, float]] = []
            hess: list[float] = []
            if method == "csgld":
                # half the check's cycle samples, so that the normals are compared
                checked = _csgld_chains(setup, noise, check, watch, CSGLD_CHECK_FRACTION)
            elif method == "ivon":
                checked = _ivon_chains(setup, noise, watch, hess)
            else:
                checked = _svgd_chains(setup, watch)
            # each built just before it runs: IVON's seeds torch's generator when built
            ours = checked["ours"]()
            _run_chain(ours, kernel_batches, check)
            plain = checked["plain"]()
            _run_chain(plain, batches, check)
            a, b = ours.params(), plain.params()
            if method == "svgd":
                start = {"particles": torch.stack([torch.cat([p[k].double().flatten()
                                                              for k in p])
                                                   for p in setup["particles"]])}
                ends = [_unflat(setup, a["particles"][0]), _unflat(setup, a["particles"][-1])]
                starts = [setup["particles"][0], setup["particles"][-1]]
            else:
                start = setup["params"]
                ends, starts = [a], [setup["params"]]
            row: dict[str, Any] = {"method": method, "steps": steps, "check_steps": check}
            for name in factories:
                wall, cpu = best[name]
                row[name] = {"wall_s": wall, "cpu_s": cpu, "steps_per_s": steps / wall,
                             "loss_start": sum(losses[name][:window]) / window,
                             "loss_end": sum(losses[name][-window:]) / window}
            row["ratio"] = row["ours"]["steps_per_s"] / row["plain"]["steps_per_s"]
            row["max_param_diff"] = max(float((a[k].double() - b[k].double()).abs().max())
                                        for k in a)
            row["max_param_moved"] = max(float((a[k].double() - start[k].double()).abs()
                                               .max()) for k in a)
            row["max_param"] = max(max(theta for _, theta in watch),
                                   *(float(value.abs().max()) for value in (*a.values(),
                                                                            *b.values())))
            row["max_grad"] = max(grad for grad, _ in watch)
            row["curvature"] = batch_curvature(setup["model"], starts + ends,
                                               batches[:1] + batches[check - 1:check])
            if method == "csgld":
                row.update(lr=setup["csgld"]["lr"], eta=setup["csgld"]["lr"]
                           / setup["num_data"], cycle_steps=steps,
                           sampling_fraction=setup["csgld"]["sampling_fraction"],
                           check_sampling_fraction=CSGLD_CHECK_FRACTION)
            elif method == "ivon":
                row.update(lr=setup["ivon"]["lr"], weight_decay=setup["ivon"]["weight_decay"],
                           hess_init=setup["ivon"]["hess_init"],
                           min_hess=min([setup["ivon"]["hess_init"], *hess]))
            else:
                # each particle moves by (n lr / N) phi = (lr / N) sum_j k_ij g_j + ...:
                # a gradient's error reaches it weighted by its kernel row's sum, at most
                # n, about 2 under the median rule; the largest sum at the start and the
                # end (the particles moved 1e-2, their distances are O(1))
                row_sum = max(_largest_kernel_row_sum(x) for x in (start["particles"],
                                                                   a["particles"]))
                row.update(lr=setup["svgd_lr"],
                           eta=row_sum * setup["svgd_lr"] / setup["num_data"],
                           particles=len(setup["particles"]), kernel_row_sum=row_sum)
            rows.append(row)
    return {"batch": setup["batch"], "steps": steps, "num_data": setup["num_data"],
            "prior_precision": setup["prior_precision"], "loss_window": window,
            "rows": rows}


# ------------------------------------------------------------------ printing
def print_ggn(result: dict[str, Any]) -> None:
    n = result["images"]
    print(f"(a) full GGN of OptuNet (392 parameters, 10 classes), {n:,} {DATASET} training "
          f"images, weights: {result['weights']}")
    print(f"    {'method':38} {'setting':10} {'images':>16} {'wall s':>8} {'cpu s':>8} "
          f"{'x ours':>7} {'max rel diff':>13}")
    for row in result["rows"]:
        images = (f"{row['extrapolated_from']:,} -> {n:,}*" if row.get("extrapolated_from")
                  else f"{row['images']:,}")
        diff = "-" if row["max_rel_diff"] is None else f"{row['max_rel_diff']:.1e}"
        print(f"    {row['method']:38} {row['setting']:10} {images:>16} {row['wall_s']:8.2f} "
              f"{row['cpu_s']:8.2f} {row['x_ours']:7.1f} {diff:>13}")
    if any(row.get("extrapolated_from") for row in result["rows"]):
        print("    * timed on the first images and extrapolated linearly to all of them")
    for backend, times in result["calibration"].items():
        cal = result["calibration_images"][backend]
        sizes = ", ".join(f"{b}: {t:.2f}" for b, t in times.items())
        print(f"    batch-size calibration, {backend}, wall s on {cal:,} images: {sizes}")
    print(f"    => ours is {result['ratio']:.1f}x faster than the faster baseline "
          f"({result['faster_baseline']}; goal >= 5x)")


def print_bbb(result: dict[str, Any]) -> None:
    print(f"(b) BBB training steps/s, OptuNet, {DATASET}, batch {result['batch']}, "
          f"{result['elbo_samples']} ELBO samples, lr {result['lr']}")
    print(f"    {'path':38} {'steps':>8} {'wall s':>8} {'cpu s':>8} {'steps/s':>9}")
    for name, label in (("torch", "train_zoo.methods.bbb.step (torch)"),
                        ("numba", "FastBBB.step (numba)")):
        row = result[name]
        print(f"    {label:38} {row['steps']:8d} {row['wall_s']:8.2f} {row['cpu_s']:8.2f} "
              f"{row['steps_per_s']:9.0f}")
    print(f"    => numba / torch: {result['ratio']:.1f}x; means after "
          f"{result['check_steps']} steps of each differ by {result['max_rel_mu_diff']:.1e} "
          "(relative to the largest mean of each layer)")


def print_collections(rows: list[dict[str, Any]], header: bool = True) -> None:
    if header:
        print("(c) 100-sample collection per method (train_zoo.run.train_collection, serial)")
        print(f"    {'method':38} {'samples':>8} {'epochs':>7} {'wall s':>8} {'cpu s':>8}")
    for row in rows:
        print(f"    {row['method']:38} {row['samples']:8d} {row['epochs']:7d} "
              f"{row['wall_s']:8.1f} {row['cpu_s']:8.1f}")


def print_variants(result: dict[str, Any]) -> None:
    print(f"(d) variant training steps/s, OptuNet, {DATASET}, batch {result['batch']}, "
          f"{result['steps']} steps each: ours (train_zoo.methods) vs the same method as a "
          "plain nn.Module with autograd")
    print(f"    {'variant':8} {'path':34} {'wall s':>8} {'cpu s':>8} {'steps/s':>9} "
          f"{'loss start -> end':>19}")
    labels = {"emp": ("EmpStepper (emp), kernel gradient", "PlainEMP + Adam"),
              "ecmp": ("EmpStepper (ecmp), kernel gradient", "PlainEMP(ecmp) + Adam"),
              "rank-1": ("Rank1Stepper, kernel network", "PlainRank1 + SGD Nesterov")}
    for row in result["rows"]:
        for name, label in zip(("ours", "plain"), labels[row["variant"]], strict=True):
            part = row[name]
            losses = f"{part['loss_start']:.4f} -> {part['loss_end']:.4f}"
            print(f"    {row['variant']:8} {label:34} {part['wall_s']:8.2f} "
                  f"{part['cpu_s']:8.2f} {part['steps_per_s']:9.0f} {losses:>19}")
    for row in result["rows"]:
        print(f"    => {row['variant']}: ours / plain {row['ratio']:.2f}x (goal >= 3x); "
              f"same start, batches and noise seed: the losses of each step differ by at "
              f"most {row['max_loss_diff']:.1e}")
    print(f"    loss start / end: mean of the first / last {result['loss_window']} steps "
          f"(Adam lr 1e-3 for EMP/ECMP, SGD lr {result['rank1_lr']} for Rank-1)")


def print_sgmcmc(result: dict[str, Any]) -> None:
    print(f"(e) SG-MCMC (SGLD) steps/s, OptuNet, {DATASET}, batch {result['batch']}, "
          f"{result['steps']} steps each, lr {result['lr']:g} / N = {result['eta']:.3g}, "
          f"prior precision {result['prior_precision']:g}, friction {result['friction']:g}, "
          f"weights: {result['weights']}")
    print(f"    {'path':50} {'wall s':>8} {'cpu s':>8} {'steps/s':>9} {'loss start -> end':>19}")
    labels = {"ours": "SghmcStepper, kernel gradient",
              "ours_corrected": "SghmcStepper + noise correction (trainer default)",
              "plain": "posteriors.sgmcmc.sgld, functional_call"}
    for name, label in labels.items():
        part = result[name]
        losses = f"{part['loss_start']:.4f} -> {part['loss_end']:.4f}"
        print(f"    {label:50} {part['wall_s']:8.2f} {part['cpu_s']:8.2f} "
              f"{part['steps_per_s']:9.0f} {losses:>19}")
    print(f"    => ours / plain {result['ratio']:.2f}x (goal >= 3x; with the noise correction, "
          f"which posteriors' SGLD has no counterpart of, {result['corrected_ratio']:.2f}x)")
    print(f"    same start, batches and normals: the losses of each step differ by at most "
          f"{result['max_loss_diff']:.1e}; the parameters after {result['check_steps']} steps "
          f"by {result['max_param_diff']:.1e} (they moved {result['max_param_moved']:.1e})")
    print(f"    loss: minus the log posterior over N (mean cross-entropy + prior term), mean of "
          f"the first / last {result['loss_window']} steps")


def print_new_methods(result: dict[str, Any]) -> None:
    print(f"(f) new methods' steps/s, OptuNet from its seeded init, {DATASET}, batch "
          f"{result['batch']}, {result['steps']} steps each, N = {result['num_data']:,}, "
          f"prior precision {result['prior_precision']:g}: ours (train_zoo.methods, the fast "
          "engine's gradients) vs the same method written plainly")
    print(f"    {'method':6} {'path':46} {'wall s':>8} {'cpu s':>8} {'steps/s':>9} "
          f"{'loss start -> end':>19}")
    labels = {"csgld": ("CyclicalStepper (alpha 1), kernel gradient",
                        "nn.Module, backward, cosine lr + noise by hand"),
              "ivon": ("IvonStepper (ivon.IVON), kernel gradient",
                       "nn.Module, ivon.IVON sampled_params/backward"),
              "svgd": ("SvgdStepper, kernel gradient per particle",
                       "vmap(grad) over stacked particles + Stein")}
    for row in result["rows"]:
        for name, label in zip(("ours", "plain"), labels[row["method"]], strict=True):
            part = row[name]
            losses = f"{part['loss_start']:.4f} -> {part['loss_end']:.4f}"
            print(f"    {row['method']:6} {label:46} {part['wall_s']:8.2f} "
                  f"{part['cpu_s']:8.2f} {part['steps_per_s']:9.0f} {losses:>19}")
    for row in result["rows"]:
        extra = {"csgld": f"lr {row.get('lr', 0):g}, one cycle of {row.get('cycle_steps')} "
                          "steps",
                 "ivon": f"lr {row.get('lr', 0):g}, same seed of torch's generator",
                 "svgd": f"{row.get('particles')} particles, lr {row.get('lr', 0):g}"
                 }[row["method"]]
        print(f"    => {row['method']}: ours / plain {row['ratio']:.2f}x (goal >= 3x; "
              f"{extra}); after {row['check_steps']} steps from the same start, batches "
              f"and noise the parameters differ by {row['max_param_diff']:.1e} (they moved "
              f"{row['max_param_moved']:.1e}; batch curvature <= {row['curvature']:.3g})")
    print(f"    loss: the batch's mean cross-entropy (+ the prior term over N for cSGLD and "
          f"SVGD; SVGD: mean over the particles), mean of the first / last "
          f"{result['loss_window']} steps")


# ------------------------------------------------------------------ main
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ggn-images", type=int, default=60_000,
                        help="training images for the GGN (default: %(default)s, all)")
    parser.add_argument("--weights", choices=("reference", "random"), default="reference",
                        help="OptuNet weights for the GGN and the SGLD chains: the bundled "
                             "target's checkpoint 0 or a seeded init (default: %(default)s)")
    parser.add_argument("--batch-sizes", type=lambda s: [int(v) for v in s.split(",")],
                        default=None, help="laplace-torch batch sizes to calibrate "
                                           "(default: 64,128,256,512,1024)")
    parser.add_argument("--calibration-images", type=int, default=4096,
                        help="images the batch sizes are timed on (default: %(default)s)")
    parser.add_argument("--curvlinops-images", type=int, default=2000,
                        help="images Curvlinops is timed on, then extrapolated "
                             "(default: %(default)s)")
    parser.add_argument("--no-generic", action="store_true",
                        help="skip the full_ggn(generic=True) row")
    parser.add_argument("--bbb-steps", type=int, default=300,
                        help="timed BBB steps of the torch path (default: %(default)s)")
    parser.add_argument("--bbb-fast-steps", type=int, default=None,
                        help="timed BBB steps of the numba path (default: 5 x --bbb-steps)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of ours, BackPack, the BBB, variant and SGLD loops; the "
                             "best is reported (default: 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every contestant (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of inits and noise")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: at most 512 images, batch sizes 64,128, "
                             "calibration on 256 and Curvlinops on 64 images, 5 / 10 BBB "
                             "steps, 5 variant, 5 SGLD and 5 cSGLD / IVON / SVGD "
                             "steps, 1 repeat (explicit "
                             "options still apply)")
    with_spec = [method for method in METHODS if collection_spec(method).is_file()]
    without = "".join(f"; {method} has no spec yet" for method in METHODS
                      if method not in with_spec)
    parser.add_argument("--methods", nargs="*", default=None, metavar="METHOD",
                        help="(c): methods whose 100-sample collection is timed (default: "
                             f"{' '.join(with_spec)}; none with --quick{without})")
    parser.add_argument("--collection-epochs", type=int, default=None, metavar="E",
                        help="(c): train the base networks for E epochs instead of the "
                             "spec's 60")
    parser.add_argument("--variant-steps", type=int, default=200, metavar="STEPS",
                        help="(d): timed training steps of each EMP / ECMP / Rank-1 path "
                             "(default: %(default)s; 5 with --quick)")
    parser.add_argument("--sgmcmc-steps", type=int, default=500, metavar="STEPS",
                        help="(e): timed SGLD steps of each path (default: %(default)s; 5 "
                             "with --quick)")
    parser.add_argument("--new-steps", type=int, default=200, metavar="STEPS",
                        help="(f): timed cSGLD / IVON / SVGD steps of each path (default: "
                             "%(default)s; 5 with --quick)")
    parser.add_argument("--svgd-particles", type=int, default=SVGD_PARTICLES, metavar="N",
                        help="(f): SVGD's particles (default: %(default)s, the method's "
                             "samples_per_mode)")
    parser.add_argument("--parts", default=PARTS,
                        help=f"the parts to run, letters of {PARTS} (default: all; (c) also "
                             "needs --methods)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write every number, the command and versions as JSON")
    args = parser.parse_args(argv)
    if not args.parts or set(args.parts) - set(PARTS):
        parser.error(f"--parts takes letters of {PARTS}, not {args.parts!r}")
    if args.variant_steps < 1:
        parser.error(f"--variant-steps must be at least 1, not {args.variant_steps}")
    if args.sgmcmc_steps < 1:
        parser.error(f"--sgmcmc-steps must be at least 1, not {args.sgmcmc_steps}")
    if args.new_steps < 1:
        parser.error(f"--new-steps must be at least 1, not {args.new_steps}")
    if args.svgd_particles < 1:
        parser.error(f"--svgd-particles must be at least 1, not {args.svgd_particles}")
    if args.quick:
        args.ggn_images = min(args.ggn_images, 512)
        args.batch_sizes = args.batch_sizes or [64, 128]
        args.calibration_images = min(args.calibration_images, 256)
        args.curvlinops_images = min(args.curvlinops_images, 64)
        args.bbb_steps = min(args.bbb_steps, 5)
        args.bbb_fast_steps = min(args.bbb_fast_steps or 10, 10)
        args.variant_steps = min(args.variant_steps, 5)
        args.sgmcmc_steps = min(args.sgmcmc_steps, 5)
        args.new_steps = min(args.new_steps, 5)
        args.repeats = args.repeats or 1
    if args.methods is None:
        args.methods = [] if args.quick else with_spec
    missing = [method for method in args.methods if not collection_spec(method).is_file()]
    if missing:
        parser.error(f"--methods: no spec {', '.join(str(collection_spec(m)) for m in missing)}")
    args.batch_sizes = args.batch_sizes or [64, 128, 256, 512, 1024]
    args.bbb_fast_steps = args.bbb_fast_steps or 5 * args.bbb_steps
    args.repeats = args.repeats or 2
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every part of ``--parts``, printed as it finishes; returns the numbers (None for a
    part not run)."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), seed {args.seed}")
    ggn = bbb = variants = sgmcmc = new_methods = None
    collections: list[dict[str, Any]] = []
    if "a" in args.parts:
        ggn = bench_ggn(args)
        print_ggn(ggn)
        print()
    if "b" in args.parts:
        bbb = bench_bbb(args)
        print_bbb(bbb)
        print()
    if "c" in args.parts:
        if args.methods:
            collections = collection_times(args)
        else:
            print_collections([])
            print("    not measured yet: pass --methods (the default without --quick)")
        print()
    if "d" in args.parts:
        variants = bench_variants(args)
        print_variants(variants)
        print()
    if "e" in args.parts:
        sgmcmc = bench_sgmcmc(args)
        print_sgmcmc(sgmcmc)
        print()
    if "f" in args.parts:
        new_methods = bench_new_methods(args)
        print_new_methods(new_methods)
    return {"ggn": ggn, "bbb": bbb, "collections": collections, "variants": variants,
            "sgmcmc": sgmcmc, "new_methods": new_methods}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with warnings.catch_warnings():
            # laplace-torch and BackPack warn about hooks and link_approx on every fit
            warnings.simplefilter("ignore", UserWarning)
            results = run(args)
    finally:
        torch.set_num_threads(threads)       # main() may run inside another process
    if args.json:
        from posteriorzoo.provenance import library_versions

        record = {"command": shlex.join([sys.executable, *sys.argv]),
                  "versions": library_versions(), "threads": args.threads, "seed": args.seed,
                  **results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
