"""The toy example of the paper's Fig. 1 (appendix A): 10,000 two-hidden-unit perceptrons.

Data (appendix A and its Fig. 5): two classes of 200 points each, drawn from normal
distributions with identity covariance and means (-2, -2) (label 0) and (2, 2) (label 1),
made fully separable: a point on the wrong side of the Bayes boundary x0 + x1 = 0 (the
perpendicular bisector of the means) is drawn again. The means did not survive the
paper's text extraction; they are those of the authors' published data (Fig. 5: empirical
means (-2.09, -1.89) and (2.19, 2.17), unit variances, separable by x0 + x1 = 0).

Model and training (appendix A): Linear(2, 2) -> ReLU -> Linear(2, 1), binary
cross-entropy on the logit, plain SGD (learning rate 2, no momentum, no weight decay),
batches of 10 in a fresh random order every epoch, 10 epochs, PyTorch's default
initialisation (every weight and bias uniform in +-1/sqrt(fan_in) = +-1/sqrt(2)). All
networks are trained at once: one stacked parameter tensor per layer, shape (R, ...),
batched matrix products and the closed-form gradient of the loss (the fast path; it
gives the weights a plain ``torch.optim.SGD`` loop gives, which the tests check), as a
stepper of the trainer's one loop (:func:`train_zoo.loop.fit`).
Networks whose mean mini-batch loss over the last epoch exceeds 0.01 "had not been
trained successfully" and are dropped (the paper: fewer than 1%).

Symmetry removal (appendix A, Fig. 1): the density of the two output weights (the last
bias excluded), raw; after the ReLU scaling symmetry is removed (each hidden unit's
incoming weights, bias excluded, rescaled to L2 norm 3, the paper's choice "for visual
purposes", the outgoing weight divided by the same factor); and after the permutation
symmetry is also removed by ordering the hidden units by their output weight (the paper
orders "starting from the last layer" for this figure), so that w_1 <= w_2. Both
transformations are applied with the project's canonicalizer
(:func:`posteriorzoo.symmetry.apply_symmetry_batch` on the structure traced from the
model); :func:`rescale_direct` and :func:`sort_direct` compute the same in numpy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from analysis.studies._common import StudyResult, summary_stats
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_integer, check_number
from posteriorzoo.results import csv_text

#: Class means of the two blobs (label 0, label 1); identity covariance.
MEANS = ((-2.0, -2.0), (2.0, 2.0))
POINTS_PER_CLASS = 200
EPOCHS = 10
BATCH_SIZE = 10
LEARNING_RATE = 2.0
#: A network is kept when its mean mini-batch loss over the last epoch is at most this.
LOSS_THRESHOLD = 0.01
#: Incoming L2 norm of every hidden unit after the scaling symmetry is removed.
NORM = 3.0
#: The figure's window, as in the paper's Fig. 1.
VIEW = 4.0
#: The ranges of the options (``posteriorzoo study toy`` parses the same). Networks and
#: points per class bound the time (about 10 s for the paper's 10,000 x 200 on one core)
#: and their product the memory: every epoch draws a (networks, 2 x points) data order
#: (12 bytes an entry: 0.5 GB at the largest product).
MAX_NETWORKS = 100_000
MAX_POINTS_PER_CLASS = 10_000
MAX_NETWORK_POINTS = 20_000_000
#: The incoming norm after rescaling: three decades either side of the paper's 3. Far
#: outside, every rescaled output weight leaves the figure's window or collapses onto 0,
#: and the outputs of the rescaled networks overflow (1e308 gives inf - inf = NaN).
NORM_RANGE = (1e-3, 1e3)
#: Epochs and batch size of the Python API (the command line keeps the paper's).
MAX_EPOCHS = 1_000
KEYS = ("0.weight", "0.bias", "2.weight", "2.bias")
PANELS = ("raw", "rescaled", "sorted")

Params = dict[str, np.ndarray]


def study_seeds(seed: int) -> dict[str, int]:
    """The three seeds drawn from ``seed``: data points, initial weights, batch order."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise InvalidOptionError(f"seed must be a non-negative integer, not {seed!r}")
    data, init, order = np.random.SeedSequence(seed).generate_state(3)
    return {"seed": seed, "data": int(data), "init": int(init), "order": int(order)}


def make_blobs(seed: int, points_per_class: int = POINTS_PER_CLASS,
               means: tuple[tuple[float, float], ...] = MEANS
               ) -> tuple[np.ndarray, np.ndarray, int]:
    """The two separable Gaussian blobs: points (2n, 2) float64, labels (2n,) float64
    (the first n are class 0), and how many points were drawn again because they fell on
    the wrong side of the perpendicular bisector of the means."""
    rng = np.random.default_rng(seed)
    m0, m1 = (np.asarray(m, dtype=np.float64) for m in means)
    normal, centre = m1 - m0, (m0 + m1) / 2
    points, redrawn = [], 0
    for label, mean in ((0, m0), (1, m1)):
        x = rng.standard_normal((points_per_class, 2)) + mean
        while True:
            side = (x - centre) @ normal
            wrong = side >= 0 if label == 0 else side <= 0
            if not wrong.any():
                break
            redrawn += int(wrong.sum())
            x[wrong] = rng.standard_normal((int(wrong.sum()), 2)) + mean
        points.append(x)
    labels = np.repeat(np.arange(2, dtype=np.float64), points_per_class)
    return np.concatenate(points), labels, redrawn


def toy_model() -> Any:
    """The paper's network, ``nn.Sequential(Linear(2, 2), ReLU(), Linear(2, 1))``."""
    from torch import nn

    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))


def initial_parameters(networks: int, seed: int, dtype: Any = None) -> dict[str, Any]:
    """Initial weights of ``networks`` networks as stacked tensors keyed like the model's
    state_dict: PyTorch's default (uniform in +-1/sqrt(fan_in)), drawn in float64 from a
    ``torch.Generator`` seeded with ``seed`` (network r is row r of every tensor)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shapes = {"0.weight": (2, 2), "0.bias": (2,), "2.weight": (1, 2), "2.bias": (1,)}
    bound = 1 / math.sqrt(2)  # fan_in is 2 in both layers
    params = {}
    for key in KEYS:
        draw = torch.rand((networks, *shapes[key]), generator=generator, dtype=torch.float64)
        params[key] = ((2 * draw - 1) * bound).to(dtype or torch.float32)
    return params


def epoch_orders(networks: int, points: int, seed: int) -> Callable[[], Any]:
    """A function that returns the next epoch's data order of every network, (R, points):
    an independent uniform permutation per network and epoch from one generator."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def next_epoch() -> Any:
        return torch.argsort(torch.rand((networks, points), generator=generator), dim=1)

    return next_epoch


@dataclass
class ToyTraining:
    """Trained networks: final weights (numpy, stacked) and each epoch's mean mini-batch
    loss of every network, (epochs, R), in nats."""

    params: Params
    epoch_loss: np.ndarray
    seconds: float


def train_networks(x: np.ndarray, y: np.ndarray, networks: int, init_seed: int,
                   order_seed: int, *, epochs: int = EPOCHS, batch_size: int = BATCH_SIZE,
                   lr: float = LEARNING_RATE, dtype: Any = None, progress: bool = False
                   ) -> ToyTraining:
    """Train ``networks`` perceptrons at once with mini-batch SGD on the logistic loss.

    Network r starts from row r of :func:`initial_parameters` ``(networks, init_seed)`` and
    sees the data in row r of each epoch's :func:`epoch_orders` ``(networks, len(x),
    order_seed)``; the last batch of an epoch may be smaller. ``dtype`` defaults to
    float32 (the paper's). Runs on one torch thread (restored afterwards).
    """
    import torch

    dtype = dtype or torch.float32
    threads = torch.get_num_threads()
    # Each step is many tiny products: one thread is fastest, and several threads on a
    # busy machine are many times slower (measured: 83 s instead of 4.5 s on 2 cores).
    torch.set_num_threads(1)
    try:
        return _train(x, y, networks, init_seed, order_seed, epochs, batch_size, lr, dtype,
                      progress)
    finally:
        torch.set_num_threads(threads)


class _ToyStepper:
    """SGD on every network at once, as a stepper of the one training loop
    (:func:`train_zoo.loop.fit`): a batch is ``(inputs, targets)`` stacked per network,
    ``(R, B, 2)`` and ``(R, B)``. It keeps each network's loss summed over the epoch and
    closes the epoch at ``on_epoch_end`` (it is its own callback). A diverged network is
    kept training (the study drops it afterwards), so the stepper never stops."""

    stopped = False

    def __init__(self, params: dict[str, Any], epochs: int, batches: int, bar: Any) -> None:
        import torch

        self.params, self.batches, self.bar = params, batches, bar
        networks = len(params[KEYS[0]])
        self.total = torch.zeros(networks, dtype=torch.float64)
        self.epoch_loss = np.zeros((epochs, networks))

    def step(self, batch: tuple[Any, Any], lr: float) -> float:
        import torch
        import torch.nn.functional as F  # noqa: N812

        xb, yb = batch                                                  # (R, B, 2), (R, B)
        w1, b1, w2, b2 = (self.params[key] for key in KEYS)
        pre = torch.einsum("rbi,rhi->rbh", xb, w1) + b1[:, None, :]
        hidden = pre.clamp_min(0)
        logits = torch.einsum("rbh,rh->rb", hidden, w2[:, 0, :]) + b2
        loss = F.binary_cross_entropy_with_logits(logits, yb, reduction="none").mean(1)
        self.total += loss.double()
        # Gradient of the mean loss of each network's batch (ReLU'(0) = 0, as torch).
        d_logits = (torch.sigmoid(logits) - yb) / xb.shape[1]
        d_hidden = d_logits[:, :, None] * w2[:, 0, None, :] * (pre > 0)
        w2 -= lr * torch.einsum("rb,rbh->rh", d_logits, hidden)[:, None, :]
        b2 -= lr * d_logits.sum(1, keepdim=True)
        w1 -= lr * torch.einsum("rbh,rbi->rhi", d_hidden, xb)
        b1 -= lr * d_hidden.sum(1)
        self.bar.update(1)
        return float(loss.mean())

    def arrays(self) -> dict[str, np.ndarray]:
        return {key: value.numpy() for key, value in self.params.items()}

    def on_epoch_end(self, info: Any, weights: Any) -> None:
        self.epoch_loss[info.epoch] = (self.total / self.batches).numpy()
        self.total.zero_()


def _train(x: np.ndarray, y: np.ndarray, networks: int, init_seed: int, order_seed: int,
           epochs: int, batch_size: int, lr: float, dtype: Any, progress: bool
           ) -> ToyTraining:
    import torch

    from train_zoo.loop import fit

    started = time.perf_counter()
    params = initial_parameters(networks, init_seed, dtype)
    inputs = torch.as_tensor(x, dtype=dtype)
    targets = torch.as_tensor(y, dtype=dtype)
    next_order = epoch_orders(networks, len(x), order_seed)
    batches = math.ceil(len(x) / batch_size)
    bar = _progress(epochs * batches, "training the toy networks", progress)

    def epoch_batches(epoch: int) -> Any:
        # fit asks for epochs 0, 1, ... in turn: each draws the next epoch's orders
        order = next_order()
        for start in range(0, len(x), batch_size):
            index = order[:, start:start + batch_size]
            yield inputs[index], targets[index]

    stepper = _ToyStepper(params, epochs, batches, bar)
    fit(stepper, epoch_batches, lambda epoch: lr, epochs, phase="toy", callbacks=[stepper])
    bar.close()
    return ToyTraining({key: value.double().numpy() for key, value in params.items()},
                       stepper.epoch_loss, time.perf_counter() - started)


def network_outputs(params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Logits of every network on every point, (R, N), in float64."""
    w1, b1, w2, b2 = (np.asarray(params[key], dtype=np.float64) for key in KEYS)
    hidden = np.maximum(np.einsum("ni,rhi->rnh", x, w1) + b1[:, None, :], 0)
    return np.einsum("rnh,rh->rn", hidden, w2[:, 0, :]) + b2


def rescale_direct(params: Mapping[str, np.ndarray], norm: float = NORM) -> Params:
    """Numpy: give each hidden unit's incoming weights (bias excluded) L2 norm ``norm``,
    multiplying its bias by the same factor and dividing its output weight by it (a dead
    unit, with zero incoming weights, is left as it is)."""
    w1, b1, w2, b2 = (np.asarray(params[key], dtype=np.float64) for key in KEYS)
    length = np.linalg.norm(w1, axis=2)                                   # (R, 2)
    factor = np.where(length > 0, norm / np.where(length > 0, length, 1.0), 1.0)
    return {"0.weight": w1 * factor[:, :, None], "0.bias": b1 * factor,
            "2.weight": w2 / factor[:, None, :], "2.bias": b2.copy()}


def sort_direct(params: Mapping[str, np.ndarray]) -> Params:
    """Numpy: reorder each network's hidden units by increasing output weight (stable)."""
    w1, b1, w2, b2 = (np.asarray(params[key], dtype=np.float64) for key in KEYS)
    order = np.argsort(w2[:, 0, :], axis=1, kind="stable")                 # (R, 2)
    return {"0.weight": np.take_along_axis(w1, order[:, :, None], axis=1),
            "0.bias": np.take_along_axis(b1, order, axis=1),
            "2.weight": np.take_along_axis(w2, order[:, None, :], axis=2),
            "2.bias": b2.copy()}


def remove_symmetries(params: Mapping[str, np.ndarray], norm: float = NORM
                      ) -> tuple[Params, Params]:
    """The rescaled and the rescaled-and-sorted networks, computed with the canonicalizer.

    The symmetry structure is traced from :func:`toy_model` (:mod:`posteriorzoo.symmetry`):
    its one scalable, permutable space is the hidden layer. The scales (``norm`` over each
    unit's incoming weights, bias excluded) and the order (by output weight, the space's
    reader) follow appendix A; :func:`posteriorzoo.symmetry.apply_symmetry_batch` applies
    them to every network at once. Same result as :func:`rescale_direct` and
    :func:`sort_direct`.
    """
    import torch

    from posteriorzoo.symmetry import apply_symmetry_batch, symmetry_structure

    model = toy_model()
    structure = symmetry_structure(model, model.state_dict(), input_shape=(2,))
    (scale_index,) = structure.scalable()
    (space_index,) = structure.permutable()
    variable, space = structure.scales[scale_index], structure.spaces[space_index]
    states = {key: torch.as_tensor(np.asarray(params[key], dtype=np.float64))
              for key in KEYS}
    weight = next(axis.key for axis in variable.writers if states[axis.key].dim() == 3)
    length = torch.linalg.vector_norm(states[weight], dim=2)
    factors = torch.where(length > 0, norm / torch.where(length > 0, length, 1.0), 1.0)
    rescaled = apply_symmetry_batch(states, structure, scales={scale_index: factors})
    reader = space.readers[0].key                                         # "2.weight"
    order = torch.argsort(rescaled[reader][:, 0, :], dim=1, stable=True)
    ordered = apply_symmetry_batch(rescaled, structure, permutations={space_index: order})
    return ({key: value.numpy() for key, value in rescaled.items()},
            {key: value.numpy() for key, value in ordered.items()})


def _progress(total: int, description: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, disable=not enabled, leave=False,
                unit="step")


def _weights_summary(w: np.ndarray) -> dict[str, Any]:
    """Median, 5% and 95% quantiles, quadrants, order and points outside the view of
    (R, 2) output weights; every statistic is None (unavailable) when no network was
    kept."""
    inside = (np.abs(w) <= VIEW).all(axis=1)

    def fraction(selected: np.ndarray) -> float | None:
        return float(selected.mean()) if len(w) else None

    return {
        "median": np.median(w, axis=0).tolist() if len(w) else None,
        "quantile_05": np.quantile(w, 0.05, axis=0).tolist() if len(w) else None,
        "quantile_95": np.quantile(w, 0.95, axis=0).tolist() if len(w) else None,
        "fraction_w1_le_w2": fraction(w[:, 0] <= w[:, 1]),
        "quadrants": {"w1>0,w2>0": fraction((w[:, 0] > 0) & (w[:, 1] > 0)),
                      "w1<=0,w2>0": fraction((w[:, 0] <= 0) & (w[:, 1] > 0)),
                      "w1>0,w2<=0": fraction((w[:, 0] > 0) & (w[:, 1] <= 0)),
                      "w1<=0,w2<=0": fraction((w[:, 0] <= 0) & (w[:, 1] <= 0))},
        "outside_view": int((~inside).sum()),
    }


@dataclass
class ToyStudyResult(StudyResult):
    """The toy study: the data, every network's output weights and the checks.

    ``x``, ``y``: the training points; ``weights``: panel -> (R, 2) output weights of every
    trained network (``raw``, ``rescaled``, ``sorted``); ``kept``: (R,) bool;
    ``final_loss``: (R,) mean mini-batch loss of the last epoch; ``summary``: every
    reported number (JSON).
    """

    kind: ClassVar[str] = "study-toy"
    figure_name: ClassVar[str] = "toy_output_weights"

    x: np.ndarray = field(repr=False, default=None)
    y: np.ndarray = field(repr=False, default=None)
    weights: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    kept: np.ndarray = field(repr=False, default=None)
    final_loss: np.ndarray = field(repr=False, default=None)
    summary: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        return dict(self.summary)

    def tables(self) -> dict[str, str]:
        rows = ([r, bool(self.kept[r]), float(self.final_loss[r]),
                 *(float(v) for panel in PANELS for v in self.weights[panel][r])]
                for r in range(len(self.kept)))
        header = ["network", "kept", "final_loss"] + [f"{panel}_w{unit}" for panel in PANELS
                                                      for unit in (1, 2)]
        data = csv_text(["x1", "x2", "label"],
                        ([float(a), float(b), int(c)] for (a, b), c in zip(self.x, self.y,
                                                                          strict=True)))
        return {"toy_output_weights.csv": csv_text(header, rows), "toy_data.csv": data}

    def figure(self) -> Any:
        from matplotlib.colors import Normalize
        from matplotlib.figure import Figure

        norm_value = self.summary["symmetry_removal"]["norm"]
        titles = {"raw": "Original posterior",
                  "rescaled": f"After scaling removal (incoming norm {norm_value:g})",
                  "sorted": "After scaling & permutation removal"}
        figure = Figure(figsize=(14, 5.2), layout="constrained")
        axes = figure.subplots(1, 3, sharex=True, sharey=True)
        kept = self.kept
        gridsize = 70
        counts = []
        for panel in PANELS:
            w = self.weights[panel][kept]
            histogram, _, _ = np.histogram2d(w[:, 0], w[:, 1], bins=gridsize,
                                             range=[[-VIEW, VIEW], [-VIEW, VIEW]])
            counts.append(histogram.max())
        norm = Normalize(vmin=0, vmax=max(1.0, 0.5 * max(counts)), clip=True)
        image = None
        for axis, panel in zip(axes, PANELS, strict=True):
            w = self.weights[panel][kept]
            axis.grid(True, linestyle="--", alpha=0.5)
            axis.set_axisbelow(True)
            image = axis.hexbin(w[:, 0], w[:, 1], gridsize=gridsize, mincnt=1, cmap="Oranges",
                                norm=norm, extent=(-VIEW, VIEW, -VIEW, VIEW), linewidths=0)
            axis.set_xlim(-VIEW, VIEW)
            axis.set_ylim(-VIEW, VIEW)
            axis.set_aspect("equal")
            axis.set_title(titles[panel])
            axis.set_xlabel("output weight of hidden unit 1, $w_1$")
            outside = int((np.abs(w) > VIEW).any(axis=1).sum())
            axis.text(0.02, 0.02, f"{len(w)} networks, {outside} outside the window",
                      transform=axis.transAxes, fontsize=8, color="0.3")
        axes[0].set_ylabel("output weight of hidden unit 2, $w_2$")
        axes[2].plot([-VIEW, VIEW], [-VIEW, VIEW], color="#c96004", linestyle="--", alpha=0.6)
        colorbar = figure.colorbar(image, ax=list(axes), shrink=0.8)
        colorbar.set_label("networks per hexagon")
        figure.suptitle("2-2-1 ReLU perceptrons on two separable Gaussian blobs: density of "
                        "the output weights (paper Fig. 1)")
        return figure


def check_toy_options(networks: int, points_per_class: int, norm: float) -> None:
    """Refuse, before any work, options out of their ranges (the constants above).

    Raises :class:`~posteriorzoo.errors.InvalidOptionError` naming the option.
    """
    check_integer("networks", networks, 1, MAX_NETWORKS)
    check_integer("points_per_class", points_per_class, 1, MAX_POINTS_PER_CLASS)
    if networks * points_per_class > MAX_NETWORK_POINTS:
        raise InvalidOptionError(
            f"networks x points per class ({networks:,} x {points_per_class:,}) must be at "
            f"most {MAX_NETWORK_POINTS:,}: each epoch draws a data order of every point for "
            f"every network (memory); lower one of them")
    check_number("norm", norm, NORM_RANGE[0], maximum=NORM_RANGE[1])


def run_toy_study(networks: int = 10_000, seed: int = 0, *, norm: float = NORM,
                  epochs: int = EPOCHS, batch_size: int = BATCH_SIZE,
                  lr: float = LEARNING_RATE, loss_threshold: float = LOSS_THRESHOLD,
                  points_per_class: int = POINTS_PER_CLASS, progress: bool = False,
                  command: str | None = None) -> ToyStudyResult:
    """Train ``networks`` toy perceptrons and remove their symmetries (module docstring).

    Every random choice derives from ``seed`` (:func:`study_seeds`). Raises
    :class:`~posteriorzoo.errors.InvalidOptionError` for a bad option.
    """
    from posteriorzoo.provenance import record

    check_toy_options(networks, points_per_class, norm)
    check_integer("epochs", epochs, 1, MAX_EPOCHS)
    check_integer("batch_size", batch_size, 1, 2 * MAX_POINTS_PER_CLASS)
    for name, value in (("lr", lr), ("loss_threshold", loss_threshold)):
        check_number(name, value, 0, strict=True)
    seeds = study_seeds(seed)
    started = time.perf_counter()
    x, y, redrawn = make_blobs(seeds["data"], points_per_class)
    training = train_networks(x, y, networks, seeds["init"], seeds["order"], epochs=epochs,
                              batch_size=batch_size, lr=lr, progress=progress)
    final_loss = training.epoch_loss[-1]
    kept = final_loss <= loss_threshold          # NaN (diverged) is not kept
    raw = training.params
    rescaled, ordered = remove_symmetries(raw, norm)

    # Checks: same functions, norms as asked, sorted keys, canonicalizer == numpy.
    outputs = network_outputs(raw, x)
    scale = np.maximum(np.abs(outputs).max(axis=1), 1.0)
    direct_rescaled = rescale_direct(raw, norm)
    direct_sorted = sort_direct(direct_rescaled)
    finite = np.isfinite(outputs).all(axis=1)

    def worst(values: np.ndarray) -> float:
        values = values[finite]
        return float(values.max()) if values.size else 0.0

    checks = {
        "max_relative_output_change_rescaled": worst(
            np.abs(network_outputs(rescaled, x) - outputs).max(axis=1) / scale),
        "max_relative_output_change_sorted": worst(
            np.abs(network_outputs(ordered, x) - outputs).max(axis=1) / scale),
        "max_incoming_norm_error": worst(
            np.abs(np.linalg.norm(rescaled["0.weight"], axis=2) - norm).max(axis=1)),
        "all_sorted": bool((ordered["2.weight"][finite, 0, 0]
                            <= ordered["2.weight"][finite, 0, 1]).all()),
        "max_difference_canonicalizer_vs_numpy": max(
            worst(np.abs(ordered[key] - direct_sorted[key]).reshape(networks, -1).max(axis=1))
            for key in KEYS),
    }
    weights = {"raw": raw["2.weight"][:, 0, :], "rescaled": rescaled["2.weight"][:, 0, :],
               "sorted": ordered["2.weight"][:, 0, :]}
    options = {"networks": networks, "epochs": epochs, "batch_size": batch_size, "lr": lr,
               "loss_threshold": loss_threshold, "norm": norm,
               "points_per_class": points_per_class}
    summary = {
        "data": {"means": [list(m) for m in MEANS], "covariance": "identity",
                 "points_per_class": points_per_class, "labels": [0, 1],
                 "separated_by": "x1 + x2 = 0 (points on the wrong side drawn again)",
                 "points_drawn_again": redrawn,
                 "empirical_means": [x[y == c].mean(axis=0).tolist() for c in (0, 1)]},
        "model": {"layers": "Linear(2, 2) -> ReLU -> Linear(2, 1)",
                  "loss": "binary cross-entropy on the logit (BCEWithLogitsLoss, mean)",
                  "init": "PyTorch default: uniform in +-1/sqrt(2) for weights and biases"},
        "training": {"optimizer": "SGD (no momentum, no weight decay)", "lr": lr,
                     "epochs": epochs, "batch_size": batch_size, "dtype": "float32",
                     "data_order": "independent random permutation per network and epoch",
                     "engine": "batched (stacked parameters, closed-form gradients)",
                     "seconds": training.seconds,
                     # None for an epoch after which every network had diverged
                     "median_epoch_loss": [float(np.median(loss[np.isfinite(loss)]))
                                           if np.isfinite(loss).any() else None
                                           for loss in training.epoch_loss]},
        "selection": {"rule": "mean mini-batch loss of the last epoch <= loss_threshold",
                      "loss_threshold": loss_threshold, "networks": networks,
                      "kept": int(kept.sum()), "dropped": int((~kept).sum()),
                      "dropped_fraction": float((~kept).mean()),
                      "final_loss": summary_stats(final_loss[np.isfinite(final_loss)]),
                      "diverged": int((~np.isfinite(final_loss)).sum())},
        "symmetry_removal": {
            "norm": norm,
            "scaling": "each hidden unit's incoming weights (bias excluded) to L2 norm "
                       "`norm`; the outgoing weight divided by the same factor",
            "permutation": "hidden units ordered by increasing output weight (w1 <= w2)",
            "applied_with": "posteriorzoo.symmetry.apply_symmetry_batch on the traced "
                            "structure",
            "checks_on": "the training points, every finite network",
            "checks": checks},
        "output_weights": {panel: _weights_summary(weights[panel][kept]) for panel in PANELS},
        "figure": {"panels": list(PANELS), "window": [-VIEW, VIEW],
                   "networks_plotted": int(kept.sum())},
        "seconds": time.perf_counter() - started,
    }
    provenance = record("posteriorzoo study toy", command=command, seeds=seeds,
                        options=options)
    return ToyStudyResult(x=x, y=y, weights=weights, kept=kept, final_loss=final_loss,
                          summary=summary, provenance=provenance)
