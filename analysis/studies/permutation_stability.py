"""Permutation stability during training (the paper's section 5.2 and Fig. 4).

Several OptuNets are trained with the mass trainer (:func:`train_zoo.train_checkpoints`,
the paper's OptuNet recipe with the number of epochs given, milestones scaled; run i is
mode i of a Deep-Ensemble spec with ``base_seed = seed``). A trainer callback keeps the
weights after every ``every``-th SGD step (and the initial weights, step 0). For every
snapshot the canonicalizer (:func:`posteriorzoo.symmetry.canonicalize_batch`: scales
normalised first, then hidden units sorted by ``key``, by default ``"max"``, the largest
incoming weight, the statistic of the paper's section 5.2) gives the sorting permutation
of each permuted layer (:func:`sorting_permutations`). Kendall's tau
(:func:`scipy.stats.kendalltau`) between successive permutations of a layer, computed on
the positions the two orders give the units, is 1 when the sorted order did not change,
-1 when it reversed. The figure shows, per layer, the mean of tau over the runs at every
snapshot with its band (min to max over runs), against the epoch.

When the two conv1 channels swap, the groups of the grouped conv2 move with them, so
conv2's permutation changes too (its order combines the move of whole groups with the
sort inside them).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from analysis.studies._common import StudyResult
from posteriorzoo.errors import DataNotFoundError, InvalidOptionError
from posteriorzoo.options import check_choice, check_integer
from posteriorzoo.results import csv_text
from posteriorzoo.vocabulary import SORT_KEYS  # the canonicalizer's keys that sort

RECIPE = "optunet-mnist"
ARCHITECTURE = "optunet"
#: Bins of snapshots in the figure (and in tau_binned.csv).
FIGURE_BINS = 400
#: A tau this close to 1 means the permutation did not change (scipy's rounding).
TAU_TOLERANCE = 1e-9
#: Snapshots canonicalized at once (bounds memory on long runs).
CHUNK = 4096
#: The ranges of the options (``posteriorzoo study permutation-stability`` parses the
#: same): runs and epochs bound the time (a 60-epoch Fashion-MNIST run takes about 40 s).
MAX_RUNS = 100
MAX_EPOCHS = 1_000
#: --every is at most the SGD steps of one epoch (known once the dataset is loaded): the
#: figure's bins and the phases need a snapshot in every epoch.
MAX_EVERY = 100_000
#: A run keeps every snapshot until it ends (about 3 kB each for OptuNet's 392 weights
#: with their arrays' overhead): at most this many per run (about 0.6 GB).
MAX_SNAPSHOTS = 200_000


def kendall_tau(previous: Sequence[int], current: Sequence[int]) -> float:
    """Kendall's tau (:func:`scipy.stats.kendalltau`) between two sorting permutations.

    A permutation is given as an order: position p holds unit ``order[p]``. Tau is
    computed between the positions (ranks) the two orders give the units, so it counts
    the pairs of units whose relative order changed: 1 for the same order, -1 for the
    reversed order (``current == previous[::-1]``).
    """
    from scipy.stats import kendalltau

    ranks = [np.argsort(np.asarray(order), kind="stable") for order in (previous, current)]
    return float(kendalltau(*ranks).statistic)


def successive_taus(orders: np.ndarray) -> np.ndarray:
    """Kendall's tau between every pair of successive rows of ``orders`` (T, size):
    (T - 1,) values. Pairs already seen are looked up rather than computed again."""
    cache: dict[tuple[bytes, bytes], float] = {}
    orders = np.ascontiguousarray(orders, dtype=np.int64)
    taus = np.empty(max(len(orders) - 1, 0))
    for t in range(1, len(orders)):
        pair = (orders[t - 1].tobytes(), orders[t].tobytes())
        if pair not in cache:
            cache[pair] = kendall_tau(orders[t - 1], orders[t])
        taus[t - 1] = cache[pair]
    return taus


def _probe_key(index: int) -> str:
    return f"__sorting_probe_{index}__"


def sorting_permutations(states: Mapping[str, Any], structure: Any, key: str = "max",
                         scaling: str = "norm") -> dict[int, np.ndarray]:
    """The canonicalizer's sorting permutation of every permuted space, per checkpoint.

    ``states``: ``{key: (B, *shape)}``; ``structure``: its
    :class:`~posteriorzoo.symmetry.SymmetryStructure`. Returns space index -> (B, size)
    int64, where position p of checkpoint b's canonical form holds its unit
    ``order[b, p]`` (spaces next to a grouped convolution included: the order combines
    the move of whole groups with the sort inside them).

    The permutations are read from :func:`posteriorzoo.symmetry.canonicalize_batch`
    itself: every permuted space gets one more writer, a probe row holding the unit
    indices 0..size-1, which the canonicalizer permutes with the space but never scales,
    flips or sorts by.
    """
    import torch

    from posteriorzoo.symmetry import TensorAxis, canonicalize_batch

    probed = copy.deepcopy(structure)
    batch = {name: torch.as_tensor(np.asarray(value)).double()
             for name, value in states.items()}
    count = next(iter(batch.values())).shape[0]
    spaces = structure.permutable()
    for index in spaces:
        probed.spaces[index].writers.append(TensorAxis(_probe_key(index), 0))
        batch[_probe_key(index)] = torch.arange(
            structure.spaces[index].size, dtype=torch.float64).expand(count, -1).clone()
    canonical, _ = canonicalize_batch(batch, probed, permutation=key, scaling=scaling,
                                      softmax=False)
    return {index: canonical[_probe_key(index)].round().long().numpy() for index in spaces}


def layer_names(structure: Any) -> dict[int, str]:
    """Permuted space -> the module writing it (``conv1``, ``conv2``, ...)."""
    names = {}
    for index in structure.permutable():
        weight = structure.spaces[index].writers[0].key
        names[index] = weight.rsplit(".", 1)[0]
    return names


class SnapshotRecorder:
    """Trainer callback: keeps a copy of the weights after every ``every``-th step."""

    def __init__(self, every: int = 1, progress: Any = None) -> None:
        self.every = every
        self.progress = progress
        self.steps: list[int] = []
        self.epochs: list[int] = []
        self.snapshots: list[dict[str, np.ndarray]] = []

    def keep(self, step: int, epoch: int, weights: Mapping[str, np.ndarray]) -> None:
        self.steps.append(step)
        self.epochs.append(epoch)
        self.snapshots.append({name: np.array(value) for name, value in weights.items()})

    def on_step_end(self, info: Any, weights: Mapping[str, np.ndarray]) -> None:
        if info.phase == "train" and info.step % self.every == 0:
            self.keep(info.step, info.epoch, weights)

    def on_epoch_end(self, info: Any, weights: Mapping[str, np.ndarray]) -> None:
        if self.progress is not None:
            self.progress.update(1)

    def stacked(self) -> dict[str, np.ndarray]:
        """The snapshots as ``{key: (T, *shape)}``."""
        return {name: np.stack([s[name] for s in self.snapshots])
                for name in self.snapshots[0]}


def resolve_dataset(name: str) -> str:
    """``auto``: Fashion-MNIST when its files are on this machine (no download), else
    scikit-learn's digits; any other name is returned as it is."""
    if name != "auto":
        return name
    from posteriorzoo.data import dataset_files

    try:
        dataset_files("fashion-mnist", download=False)
    except DataNotFoundError:
        return "digits"
    return "fashion-mnist"


@dataclass
class RunTrace:
    """One training run: snapshot steps, fractional epochs, per layer the taus and whether
the permutation changed at each snapshot, the final metrics."""

    run: int
    steps: np.ndarray
    epoch: np.ndarray
    taus: dict[str, np.ndarray]
    changed: dict[str, np.ndarray]
    metrics: dict[str, float]
    engine: str
    seconds: float


@dataclass
class PermutationStabilityResult(StudyResult):
    """Kendall's tau between successive sorting permutations, per run, layer and step.

    ``steps``/``epoch``: (T,) the step of the later snapshot of each pair and its
    position in epochs (step / steps per epoch); ``taus``: layer -> (runs, T);
    ``milestones``: epochs at which the learning rate drops; ``summary``: every reported
    number (JSON).
    """

    kind: ClassVar[str] = "study-permutation-stability"
    figure_name: ClassVar[str] = "permutation_stability"

    steps: np.ndarray = field(repr=False, default=None)
    epoch: np.ndarray = field(repr=False, default=None)
    taus: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    milestones: list[int] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        return dict(self.summary)

    def binned(self, bins: int = FIGURE_BINS) -> dict[str, dict[str, np.ndarray]]:
        """What the figure plots: the snapshots cut into ``bins`` consecutive bins of equal
        length; per layer and bin, the mean of tau over runs and steps, its minimum and
        maximum, and the fraction of (run, step) pairs whose permutation changed."""
        count = len(self.steps)
        parts = [part for part in np.array_split(np.arange(count), min(bins, count))
                 if part.size]
        table = {}
        for layer, values in self.taus.items():
            table[layer] = {
                # Pair t spans the epochs from snapshot t - 1 (step 0 for t = 0) to t.
                "epoch_start": np.array([self.epoch[p[0] - 1] if p[0] else 0.0
                                         for p in parts]),
                "epoch_end": np.array([self.epoch[p[-1]] for p in parts]),
                "steps": np.array([p.size for p in parts]),
                "mean": np.array([values[:, p].mean() for p in parts]),
                "min": np.array([values[:, p].min() for p in parts]),
                "max": np.array([values[:, p].max() for p in parts]),
                "fraction_changed": np.array([(values[:, p] < 1 - TAU_TOLERANCE).mean()
                                              for p in parts])}
        return table

    def tables(self) -> dict[str, str]:
        layers = list(self.taus)
        runs = next(iter(self.taus.values())).shape[0] if self.taus else 0
        header = ["step", "epoch"] + [f"{layer}_run{run}" for layer in layers
                                      for run in range(runs)]
        by_step = ([int(self.steps[t]), float(self.epoch[t]),
                    *(float(self.taus[layer][run, t]) for layer in layers
                      for run in range(runs))] for t in range(len(self.steps)))
        binned = self.binned()
        columns = ("epoch_start", "epoch_end", "steps", "mean", "min", "max",
                   "fraction_changed")
        rows = ([layer, number, *(_plain(binned[layer][c][number]) for c in columns)]
                for layer in layers for number in range(len(binned[layer]["steps"])))
        return {"tau_by_step.csv": csv_text(header, by_step),
                "tau_binned.csv": csv_text(["layer", "bin", *columns], rows)}

    def figure(self) -> Any:
        from matplotlib.figure import Figure

        layers = list(self.taus)
        binned = self.binned()
        figure = Figure(figsize=(10, 2.2 + 2.0 * len(layers)), layout="constrained")
        axes = np.atleast_1d(figure.subplots(len(layers), 1, sharex=True))
        colors = ("#c96004", "#1f5fa8", "#2a8a3e", "#8a2a7a")
        for number, (axis, layer) in enumerate(zip(axes, layers, strict=True)):
            data, runs = binned[layer], self.taus[layer].shape[0]
            color = colors[number % len(colors)]
            middle = (data["epoch_start"] + data["epoch_end"]) / 2
            axis.fill_between(middle, data["min"], data["max"], color=color, alpha=0.3,
                              linewidth=0, step="mid",
                              label=f"min-max over {runs} run(s) and the bin's steps")
            axis.plot(middle, data["mean"], color=color, linewidth=1.0, drawstyle="steps-mid",
                      label=f"mean over {runs} run(s) and the bin's steps")
            for milestone in self.milestones:
                axis.axvline(milestone, color="0.4", linestyle=":", linewidth=1)
            size = self.summary["layers"][layer]["units"]
            axis.set_ylim(-1.05, 1.05)
            axis.set_ylabel("Kendall's $\\tau$")
            axis.set_title(f"{layer} ({size} units)", fontsize=10, loc="left")
            axis.grid(True, linestyle="--", alpha=0.5)
            axis.legend(loc="lower right", fontsize=8)
        steps = int(np.median(binned[layers[0]]["steps"])) if layers else 0
        every = self.provenance.get("options", {}).get("every", 1)
        axes[-1].set_xlabel(f"epoch (bins of about {steps} snapshots, a snapshot every "
                            f"{every} step(s); dotted: learning-rate drops)")
        options = self.provenance.get("options", {})
        figure.suptitle(
            f"Kendall's tau between successive sorting permutations during training "
            f"(paper Fig. 4): {options.get('architecture', 'optunet')} on "
            f"{options.get('dataset', '?')}, sort key '{options.get('key', 'max')}'",
            fontsize=10)
        return figure


def _plain(value: Any) -> Any:
    """A numpy scalar as a Python int or float (for the CSV)."""
    return value.item() if hasattr(value, "item") else value


def _phases(milestones: Sequence[int], epochs: int) -> list[tuple[int, int]]:
    bounds = [0, *[m for m in milestones if 0 < m < epochs], epochs]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def check_snapshots(every: int, epochs: int, steps_per_epoch: int, dataset: str) -> None:
    """Refuse, once the dataset is known and before any training, an ``every`` larger than
    one epoch's SGD steps, or more than :data:`MAX_SNAPSHOTS` snapshots per run."""
    if every > steps_per_epoch:
        raise InvalidOptionError(
            f"every ({every}) must be at most the {steps_per_epoch} SGD steps of one epoch "
            f"on {dataset}: the figure needs a snapshot in every epoch")
    snapshots = epochs * steps_per_epoch // every + 1
    if snapshots > MAX_SNAPSHOTS:
        raise InvalidOptionError(
            f"epochs x steps per epoch / every = {epochs} x {steps_per_epoch} / {every} gives "
            f"{snapshots:,} snapshots per run, more than {MAX_SNAPSHOTS:,} (each is kept in "
            f"memory until the run ends): raise every or lower epochs")


def run_permutation_stability(runs: int = 5, epochs: int = 60, dataset: str = "auto",
                              seed: int = 0, *, key: str = "max", scaling: str = "norm",
                              every: int = 1, engine: str = "auto", data_dir: str | None = None,
                              progress: bool = False, command: str | None = None
                              ) -> PermutationStabilityResult:
    """Train ``runs`` OptuNets for ``epochs`` epochs and measure how often their sorting
    permutations change (module docstring). Raises
    :class:`~posteriorzoo.errors.PosteriorZooError` subclasses for bad options or data."""
    from tqdm.auto import tqdm

    from posteriorzoo.provenance import record
    from posteriorzoo.symmetry import symmetry_structure
    from posteriorzoo.symmetry.canonical import check_options
    from train_zoo import checkpoint_seeds, make_spec, train_checkpoints
    from train_zoo.data import load_training_data
    from train_zoo.job import resolve_engine
    from train_zoo.torch_engine import initial_model

    check_integer("runs", runs, 1, MAX_RUNS)
    check_integer("epochs", epochs, 1, MAX_EPOCHS)
    check_integer("every", every, 1, MAX_EVERY)
    check_choice("key", key, SORT_KEYS)
    check_options(key, scaling)
    started = time.perf_counter()
    dataset = resolve_dataset(dataset)
    spec = make_spec(RECIPE, name="permutation-stability", dataset=dataset, base_seed=seed,
                     checkpoints=runs, data_dir=data_dir, recipe_overrides={"epochs": epochs})
    chosen = resolve_engine(spec, engine)
    if chosen == "vectorised":
        raise InvalidOptionError("the vectorised engine does not run callbacks; choose the "
                                 "engine auto, fast or torch")
    data = load_training_data(spec.dataset, spec.data_dir)
    steps_per_epoch = math.ceil(len(data.train.labels) / spec.recipe.batch_size)
    check_snapshots(every, epochs, steps_per_epoch, spec.dataset)
    template = initial_model(spec, 0).state_dict()
    model_options = {} if spec.num_classes is None else {"num_classes": spec.num_classes}
    structure = symmetry_structure(ARCHITECTURE, template, **model_options)
    names = layer_names(structure)

    traces: list[RunTrace] = []
    bar = tqdm(total=runs * epochs, desc="training (epochs)", disable=not progress,
               leave=False, unit="epoch")
    for run in range(runs):
        run_started = time.perf_counter()
        recorder = SnapshotRecorder(every, bar)
        initial = initial_model(spec, checkpoint_seeds(seed, run).init).state_dict()
        recorder.keep(0, 0, {k: v.numpy() for k, v in initial.items()})
        (result,) = train_checkpoints(spec, [run], data=data, engine=chosen,
                                      callbacks=[recorder])
        states = recorder.stacked()
        orders: dict[int, list[np.ndarray]] = {index: [] for index in names}
        total = len(recorder.steps)
        for start in range(0, total, CHUNK):
            chunk = {k: v[start:start + CHUNK] for k, v in states.items()}
            for index, order in sorting_permutations(chunk, structure, key, scaling).items():
                orders[index].append(order)
        joined = {names[index]: np.concatenate(parts) for index, parts in orders.items()}
        taus = {name: successive_taus(order) for name, order in joined.items()}
        changed = {name: (order[1:] != order[:-1]).any(axis=1)
                   for name, order in joined.items()}
        steps = np.asarray(recorder.steps[1:])
        traces.append(RunTrace(run, steps, steps / steps_per_epoch, taus, changed,
                               dict(result.metrics), result.engine,
                               time.perf_counter() - run_started))
    bar.close()

    length = min(len(t.steps) for t in traces)  # equal unless a run stopped early
    steps, epoch = traces[0].steps[:length], traces[0].epoch[:length]
    taus = {name: np.stack([t.taus[name][:length] for t in traces]) for name in names.values()}
    changes = {name: np.stack([t.changed[name][:length] for t in traces])
               for name in names.values()}
    milestones = sorted({int(m) for m in spec.recipe.milestones}) if spec.recipe.schedule == \
        "multistep" else []
    phases = _phases(milestones, epochs)
    layers = {}
    for index, name in names.items():
        values, changed = taus[name], changes[name]
        per_phase = []
        for a, b in phases:
            inside = (epoch > a) & (epoch <= b)
            per_phase.append({
                "epochs": [a, b], "lr": spec.recipe.learning_rate(a),
                "pairs": int(inside.sum()) * values.shape[0],
                "fraction_changed": float(changed[:, inside].mean()) if inside.any() else None,
                "mean_tau": float(values[:, inside].mean()) if inside.any() else None})
        last = np.flatnonzero(changed.any(axis=0))
        layers[name] = {
            "units": structure.spaces[index].size,
            "mean_tau": float(values.mean()), "min_tau": float(values.min()),
            "changes_per_run": changed.sum(axis=1).tolist(),
            "fraction_changed": float(changed.mean()),
            "last_change_epoch": float(epoch[last[-1]]) if last.size else None,
            "phases": per_phase}
    options = {"runs": runs, "epochs": epochs, "dataset": spec.dataset, "key": key,
               "scaling": scaling, "every": every, "engine": chosen,
               "architecture": ARCHITECTURE, "recipe": RECIPE}
    summary = {
        "protocol": "Kendall's tau (scipy.stats.kendalltau, tau-b) between the sorting "
                    "permutations of successive snapshots (on the positions they give "
                    "the units), per permuted layer; the permutation is the "
                    "canonicalizer's (scaling first, then sort by key)",
        "recipe": spec.recipe.to_dict(),
        "steps_per_epoch": steps_per_epoch, "snapshots_per_run": length + 1,
        "layers": layers,
        "runs": [{"run": t.run, "seeds": vars(checkpoint_seeds(seed, t.run)),
                  "engine": t.engine, "seconds": t.seconds, **t.metrics} for t in traces],
        "seconds": time.perf_counter() - started,
    }
    provenance = record("posteriorzoo study permutation-stability", command=command,
                        seeds={"base_seed": seed, "runs": {
                            str(t.run): vars(checkpoint_seeds(seed, t.run)) for t in traces}},
                        options=options)
    return PermutationStabilityResult(steps=steps, epoch=epoch, taus=taus,
                                      milestones=milestones, summary=summary,
                                      provenance=provenance)
