"""Bootstrap Your Own Variance (seed 004) at the size of a CPU: priors, calibration, pruning.

Four students are trained for the same budget on the same images, from the same initial
means and in the same batch order (one seed): BYOV (:mod:`train_zoo.byov`) under each of
the paper's three priors, N(0, I), N(mu_T, I) and N(mu_T, Sigma_T), and deterministic
BYOL. The encoder is the registered ``small-cnn`` (three 3x3 conv blocks, 23,408
parameters); the data a seeded subset of Fashion-MNIST's training images, augmented by
random crops (zero padding 4), horizontal flips and Gaussian pixel noise (std 0.1).

Evaluation (the paper's section 4.1 and Fig. 4, at this scale):

- **Linear probe.** A multinomial logistic regression on the encoder's representation of
  the (unaugmented) training subset, standardised with the training features' mean and
  standard deviation, fitted by L-BFGS (float64, L2 penalty :data:`PROBE_L2` on the
  weights) once per student on its posterior-mean encoder (BYOL: its weights). It is
  scored on a seeded subset of the test images, clean and with Gaussian input noise
  (``noise_std`` in pixel units on the [0, 1] scale, clipped; the same noise for every
  model): accuracy, ECE (:data:`posteriorzoo.metrics.DEFAULT_ECE_BINS` equal-width bins)
  and Brier score (:mod:`posteriorzoo.metrics`). BYOV students are scored two ways:
  ``mean`` (the posterior-mean encoder, the paper's Fig. 2) and ``mc`` (the probe's
  probabilities averaged over ``samples`` posterior draws of the encoder, the same probe
  weights).
- **Recalibration** (``recalibrate``, default on): for every encoder other than the one
  the probe was fitted on (a posterior draw, a pruned encoder) the probe's feature
  standardisation is recomputed from that encoder's features of the first
  :data:`CALIBRATION_IMAGES` training images; its weights are kept (nothing is trained).
  A draw or a pruned encoder shifts the mean and scale of every feature, which a fixed
  standardisation turns into wrong logits: measured on 4,096 images after 4 epochs
  (N(0, I)), four draws scored 11-18% with the mean encoder's standardisation and 43-57%
  with their own, and SNR pruning at sparsity 0.5 38% and 68% (the mean encoder: 77%).
- **Pruning** (section 4.4, no retraining, the probe kept): in each conv layer of the
  encoder separately, keep the ``1 - sparsity`` fraction of weights with the largest SNR
  ``|mu| / sigma`` or the largest magnitude ``|mu|``, zero the rest, and score the
  pruned posterior-mean encoder on the clean test subset (recalibrated). BYOL's weights
  are magnitude-pruned as a reference.

The posterior draws of every BYOV encoder (and BYOL's encoder, one checkpoint) are
written as collections of the zoo (``byov-<prior>.h5``, ``byol.h5``: architecture
``small-cnn``, one checkpoint per draw with its seed, its probe accuracy on the clean
test subset, the training record of the run).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from analysis.studies._common import StudyResult
from posteriorzoo.errors import DataNotFoundError, InvalidOptionError
from posteriorzoo.options import check_bool, check_choice, check_integer, check_number
from posteriorzoo.results import csv_text

#: Datasets of 28x28 grey images the study takes (``auto``: Fashion-MNIST when its files
#: are on this machine, else scikit-learn's digits).
DATASETS = ("auto", "fashion-mnist", "mnist", "digits")
#: The default size: about 7 minutes on one busy CPU core (the four trainings take most).
DEFAULTS = {"train_images": 10_000, "test_images": 5_000, "epochs": 6, "batch_size": 128,
            "samples": 16}
#: ``--quick``: a smoke run of seconds.
QUICK = {"train_images": 512, "test_images": 256, "epochs": 1, "batch_size": 64,
         "samples": 2}
#: Pruning sparsities (fraction of each conv layer's weights removed).
SPARSITIES = (0.25, 0.5, 0.75, 0.9, 0.95)
#: Gaussian input noise of the shifted test set, pixel units on the [0, 1] scale.
NOISE_STD = 0.3
#: Training images (the first of the subset) on which the probe's feature standardisation
#: is recomputed for each posterior draw and pruned encoder (``recalibrate``).
CALIBRATION_IMAGES = 2_000
#: The probe's L2 penalty (on the mean negative log-likelihood) and L-BFGS iterations.
PROBE_L2 = 1e-4
PROBE_ITERATIONS = 300
#: Bounds of the options (the command line parses the same): sizes bound time and memory.
MAX_TRAIN_IMAGES = 60_000
MAX_TEST_IMAGES = 10_000
MAX_EPOCHS = 1_000
MAX_BATCH = 4_096
MAX_SAMPLES = 1_000
MODEL_BYOL = "byol"


def model_name(prior: str | None) -> str:
    """``byov-<prior>`` for a BYOV student, ``byol`` for the baseline."""
    return MODEL_BYOL if prior is None else f"byov-{prior}"


def model_label(prior: str | None) -> str:
    from train_zoo.byov import PRIOR_LABELS

    return "BYOL" if prior is None else f"BYOV {PRIOR_LABELS[prior]}"


def study_seeds(seed: int) -> dict[str, int]:
    """Seeds drawn from ``seed``: the data subsets, the training runs (shared by all four,
    so they start from the same means and see the same batches), the posterior draws and
    the test noise."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise InvalidOptionError(f"seed must be a non-negative integer, not {seed!r}")
    data, train, draws, noise = np.random.SeedSequence(seed).generate_state(4)
    return {"seed": seed, "data": int(data), "train": int(train), "draws": int(draws),
            "noise": int(noise)}


def resolve_dataset(name: str, data_dir: str | None = None) -> str:
    """``auto``: Fashion-MNIST when its files are here (no download), else digits."""
    check_choice("dataset", name, DATASETS)
    if name != "auto":
        return name
    from posteriorzoo.data import dataset_files

    try:
        dataset_files("fashion-mnist", data_dir=data_dir, download=False)
    except DataNotFoundError:
        return "digits"
    return "fashion-mnist"


def subset(dataset: Any, count: int, seed: int) -> tuple[Any, np.ndarray]:
    """``count`` images of ``dataset`` chosen without replacement by
    ``numpy.random.default_rng(seed)``, in increasing index order, and their indices."""
    from posteriorzoo.data import ArrayDataset

    if count > len(dataset):
        raise InvalidOptionError(f"{dataset.name} has {len(dataset):,} {dataset.split} "
                                 f"images; {count:,} were asked for")
    index = np.sort(np.random.default_rng(seed).choice(len(dataset), count, replace=False))
    return ArrayDataset(dataset.images[index], dataset.labels[index], dataset.num_classes,
                        dataset.name, dataset.split, dataset.mean, dataset.std,
                        dataset.class_names), index


def normalised(images: np.ndarray, mean: Sequence[float], std: Sequence[float],
               noise_std: float = 0.0, seed: int | None = None) -> Any:
    """uint8 images ``(N, C, H, W)`` as normalised float32 tensors; with ``noise_std``,
    Gaussian pixel noise (std in [0, 1] pixel units, from a generator seeded with
    ``seed``) is added and clipped to [0, 1] first."""
    import torch

    from posteriorzoo.data import Normalize

    x = torch.from_numpy(np.ascontiguousarray(images)).float() / 255.0
    if noise_std > 0:
        generator = torch.Generator().manual_seed(int(seed))
        x = (x + noise_std * torch.randn(x.shape, generator=generator)).clamp(0.0, 1.0)
    return Normalize(mean, std)(x)


# --- the linear probe ---------------------------------------------------------------------


@dataclass(frozen=True)
class LinearProbe:
    """Multinomial logistic regression on standardised features.

    ``weight`` ``(D, K)``, ``bias`` ``(K,)``, ``feature_mean`` and ``feature_std``
    ``(D,)`` (float64 numpy arrays): logits ``((f - mean) / std) @ weight + bias``.
    """

    weight: np.ndarray
    bias: np.ndarray
    feature_mean: np.ndarray
    feature_std: np.ndarray

    def recalibrated(self, features: Any) -> LinearProbe:
        """The same weights with the standardisation of ``features`` ``(N, D)`` (another
        encoder's features of training images): its mean and standard deviation."""
        f = np.asarray(features, dtype=np.float64)
        std = f.std(axis=0)
        return LinearProbe(self.weight, self.bias, f.mean(axis=0),
                           np.where(std > 1e-12, std, 1.0))

    def probabilities(self, features: Any) -> np.ndarray:
        """Class probabilities ``(N, K)`` (float64) of features ``(N, D)``."""
        f = (np.asarray(features, dtype=np.float64) - self.feature_mean) / self.feature_std
        logits = f @ self.weight + self.bias
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)


def fit_linear_probe(features: Any, labels: np.ndarray, classes: int, *,
                     l2: float = PROBE_L2, iterations: int = PROBE_ITERATIONS) -> LinearProbe:
    """Fit :class:`LinearProbe` by L-BFGS (strong Wolfe line search, float64) on the mean
    cross-entropy plus ``l2 * ||weight||^2``, from zero weights: deterministic.

    Parameters
    ----------
    features : array-like, shape (N, D)
    labels : ndarray of int, shape (N,)
    classes : int
    """
    import torch

    f = np.asarray(features, dtype=np.float64)
    mean = f.mean(axis=0)
    std = f.std(axis=0)
    std = np.where(std > 1e-12, std, 1.0)          # a constant feature stays 0
    x = torch.from_numpy((f - mean) / std)
    y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    weight = torch.zeros((f.shape[1], classes), dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=iterations,
                                  tolerance_grad=1e-9, tolerance_change=1e-12,
                                  history_size=20, line_search_fn="strong_wolfe")

    def closure() -> Any:
        optimizer.zero_grad()
        loss = (torch.nn.functional.cross_entropy(x @ weight + bias, y)
                + l2 * weight.square().sum())
        loss.backward()
        return loss

    optimizer.step(closure)
    return LinearProbe(weight.detach().numpy().copy(), bias.detach().numpy().copy(), mean, std)


def probe_metrics(probabilities: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Accuracy, ECE (default bins), Brier score and NLL of ``probabilities`` ``(N, K)``
    (:mod:`posteriorzoo.metrics`)."""
    from posteriorzoo.metrics import (
        accuracy,
        brier_score,
        expected_calibration_error,
        negative_log_likelihood,
    )

    return {"accuracy": accuracy(probabilities, labels),
            "ece": expected_calibration_error(probabilities, labels),
            "brier": brier_score(probabilities, labels),
            "nll": negative_log_likelihood(probabilities, labels)}


# --- the result ------------------------------------------------------------------------


PROBE_COLUMNS = ("model", "prior", "inference", "input", "accuracy", "ece", "brier", "nll")
PRUNING_COLUMNS = ("model", "criterion", "sparsity", "achieved_sparsity", "accuracy", "ece",
                   "brier")


@dataclass
class ByovStudyResult(StudyResult):
    """The BYOV study: probe and pruning tables, training histories, the encoder draws.

    ``summary``: every reported number (JSON); ``probe`` and ``pruning``: the tables (lists
    of records, columns :data:`PROBE_COLUMNS`, :data:`PRUNING_COLUMNS`); ``history``:
    model -> one row per epoch; ``collections``: file name -> (draws, metadata rows,
    training record, collection facts) written by :meth:`write_into`; ``posteriors``:
    model -> the trained :class:`train_zoo.byov.Posterior` (means and log-variances of
    the whole student; BYOL's log-variances are unused), kept in memory only.
    """

    kind: ClassVar[str] = "study-byov"
    figure_name: ClassVar[str] = "byov"
    frame_tables: ClassVar[tuple[str, ...]] = ("probe",)

    summary: dict[str, Any] = field(default_factory=dict)
    collections: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    posteriors: dict[str, Any] = field(default_factory=dict, repr=False)

    def payload(self) -> dict[str, Any]:
        return dict(self.summary)

    def tables(self) -> dict[str, str]:
        probe = csv_text(PROBE_COLUMNS, ([row[c] for c in PROBE_COLUMNS]
                                         for row in self.summary["probe"]))
        pruning = csv_text(PRUNING_COLUMNS, ([row[c] for c in PRUNING_COLUMNS]
                                             for row in self.summary["pruning"]))
        history_columns: list[str] = []
        for rows in self.summary["history"].values():
            for row in rows:
                history_columns += [k for k in row if k not in history_columns]
        history = csv_text(["model", *history_columns],
                           ([model, *(row.get(c, "") for c in history_columns)]
                            for model, rows in self.summary["history"].items()
                            for row in rows))
        return {"byov_probe.csv": probe, "byov_pruning.csv": pruning,
                "byov_training.csv": history}

    def write_into(self, folder: str | Any) -> dict[str, Path]:
        """The JSON, tables and figure (:meth:`StudyResult.write_into`) and the encoder
        collections (``byov-<prior>.h5``, ``byol.h5``)."""
        from posteriorzoo.zoo import create_zoo

        folder = Path(folder)
        paths = {}
        for name, collection in self.collections.items():
            path = folder / name
            with create_zoo(path, **collection["create"]) as zoo:
                zoo.append_many(collection["draws"], collection["metadata"],
                                records={0: collection["record"]})
            paths[name] = path
        return {**paths, **super().write_into(folder)}

    def figure(self) -> Any:
        from matplotlib.figure import Figure

        summary = self.summary
        models = [row["model"] for row in summary["models"]]
        labels = {row["model"]: row["label"] for row in summary["models"]}
        palette = iter(("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"))
        colours = {model: "#555555" if model == MODEL_BYOL else next(palette)
                   for model in models}
        from matplotlib.ticker import MaxNLocator

        figure = Figure(figsize=(15, 8.5), layout="constrained")
        axes = figure.subplots(2, 3)
        for axis in axes[0, :2]:
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        # (a) training loss and the KL weight
        axis = axes[0, 0]
        for model in models:
            rows = summary["history"][model]
            axis.plot([r["epoch"] for r in rows], [r["byol_loss"] for r in rows], marker="o",
                      color=colours[model], label=labels[model])
        axis.set_xlabel("epoch")
        axis.set_ylabel("BYOL loss (mean over the epoch, [0, 8])")
        axis.set_title("Training")
        axis.legend(fontsize=8)
        # (b) posterior sigma per layer
        axis = axes[0, 1]
        styles = ("-", "--", ":", "-.")
        for model in models:
            rows = summary["history"][model]
            keys = [k for k in rows[-1] if k.startswith("sigma_mean/")] if rows else []
            for style, key in zip(styles, keys, strict=False):
                axis.plot([r["epoch"] for r in rows], [r[key] for r in rows],
                          linestyle=style, marker=".", color=colours[model],
                          label=f"{labels[model]}, {key.split('/')[1][8:]}")
        axis.set_yscale("log")
        axis.set_xlabel("epoch")
        axis.set_ylabel("mean posterior sigma of the layer")
        axis.set_title("Encoder sigma per conv layer")
        axis.legend(fontsize=6)
        # (c)-(e) probe metrics, clean and noisy, posterior mean and MC average
        variants = [("clean", "mean"), ("clean", "mc"), ("noisy", "mean"), ("noisy", "mc")]
        hatches = {"mean": "", "mc": "//"}
        for axis, metric, title in ((axes[0, 2], "accuracy", "Probe accuracy"),
                                    (axes[1, 0], "ece", "Probe ECE (lower is better)"),
                                    (axes[1, 1], "brier", "Probe Brier (lower is better)")):
            width = 0.8 / len(variants)
            for position, model in enumerate(models):
                for offset, (inputs, inference) in enumerate(variants):
                    row = _probe_row(summary["probe"], model, inputs, inference)
                    if row is None or (row["inference"] == "point" and inference == "mc"):
                        continue            # BYOL has one (point) bar per input
                    axis.bar(position - 0.4 + width * (offset + 0.5), row[metric], width,
                             color=colours[model], hatch=hatches[inference],
                             alpha=1.0 if inputs == "clean" else 0.45, edgecolor="white")
            axis.set_xticks(range(len(models)), [labels[m].replace("BYOV ", "BYOV\n")
                                                 for m in models], fontsize=8)
            axis.set_title(f"{title}: clean / noisy (pale), mean / MC (hatched)",
                           fontsize=9)
            axis.set_ylabel(metric)
        # (f) pruning
        axis = axes[1, 2]
        for model in models:
            for criterion, style in (("snr", "-"), ("magnitude", "--")):
                rows = [r for r in summary["pruning"] if r["model"] == model
                        and r["criterion"] == criterion]
                unpruned = _probe_row(summary["probe"], model, "clean", "mean")
                if rows and unpruned is not None:     # sparsity 0: the unpruned encoder
                    rows = [{"sparsity": 0.0, "accuracy": unpruned["accuracy"]}, *rows]
                    axis.plot([r["sparsity"] for r in rows], [r["accuracy"] for r in rows],
                              linestyle=style, marker="o", color=colours[model],
                              label=f"{labels[model]}, {criterion}")
        axis.set_xlabel("sparsity of each conv layer (fraction removed)")
        axis.set_ylabel("probe accuracy (clean, no retraining)")
        axis.set_title("SNR (solid) vs magnitude (dashed) pruning")
        axis.legend(fontsize=6)
        data = summary["data"]
        figure.suptitle(f"BYOV vs BYOL on {data['dataset']} ({data['train_images']:,} "
                        f"training images, {summary['training']['epochs']} epochs, "
                        f"{data['test_images']:,} test images, noise std "
                        f"{data['noise_std']:g})")
        return figure


def _probe_row(rows: Sequence[Mapping[str, Any]], model: str, inputs: str, inference: str
               ) -> Mapping[str, Any] | None:
    for row in rows:
        if row["model"] == model and row["input"] == inputs and (
                row["inference"] == inference or row["inference"] == "point"):
            return row
    return None


# --- the study ---------------------------------------------------------------------------


def check_byov_options(priors: Sequence[str], train_images: int, test_images: int,
                       epochs: int, batch_size: int, samples: int, noise_std: float,
                       dataset: str) -> tuple[str, ...]:
    """Refuse, before any work, an option out of its range; returns the priors without
    repeats. Raises :class:`~posteriorzoo.errors.InvalidOptionError` naming the option."""
    from train_zoo.byov import PRIORS

    if isinstance(priors, str) or not priors:
        raise InvalidOptionError("priors must be a non-empty list of "
                                 f"{', '.join(PRIORS)}")
    chosen = tuple(dict.fromkeys(check_choice("prior", p, PRIORS) for p in priors))
    check_integer("train_images", train_images, 2, MAX_TRAIN_IMAGES)
    check_integer("test_images", test_images, 1, MAX_TEST_IMAGES)
    check_integer("epochs", epochs, 1, MAX_EPOCHS)
    check_integer("batch_size", batch_size, 2, MAX_BATCH)
    check_integer("samples", samples, 1, MAX_SAMPLES)
    check_number("noise_std", noise_std, 0.0, strict=True, maximum=1.0)
    check_choice("dataset", dataset, DATASETS)
    if batch_size > train_images:
        raise InvalidOptionError(f"batch size {batch_size:,} is larger than the "
                                 f"{train_images:,} training images")
    return chosen


def run_byov_study(priors: Sequence[str] = ("standard", "teacher", "teacher-variance"),
                   seed: int = 0, *, train_images: int = DEFAULTS["train_images"],
                   test_images: int = DEFAULTS["test_images"], epochs: int = DEFAULTS["epochs"],
                   batch_size: int = DEFAULTS["batch_size"], samples: int = DEFAULTS["samples"],
                   noise_std: float = NOISE_STD, dataset: str = "auto",
                   data_dir: str | None = None, sparsities: Sequence[float] = SPARSITIES,
                   recalibrate: bool = True, config: Any = None, progress: bool = False,
                   command: str | None = None
                   ) -> ByovStudyResult:
    """Train BYOV under ``priors`` and deterministic BYOL, probe and prune them (module
    docstring).

    Parameters
    ----------
    priors : sequence of {"standard", "teacher", "teacher-variance"}
    seed : int
        Every random choice derives from it (:func:`study_seeds`).
    train_images, test_images : int
        Sizes of the seeded subsets of the training and test splits.
    epochs, batch_size : int
        The training budget of every model.
    samples : int
        Posterior draws of each BYOV encoder: the MC predictive and the collections.
    noise_std : float
        Gaussian input noise of the shifted test set, pixel units ([0, 1] scale).
    dataset : {"auto", "fashion-mnist", "mnist", "digits"}
    data_dir : str, optional
        Folder searched first for the dataset's files.
    sparsities : sequence of float
        Pruning sparsities, each in (0, 1).
    recalibrate : bool
        Recompute the probe's feature standardisation for each posterior draw and pruned
        encoder on :data:`CALIBRATION_IMAGES` training images (module docstring); False
        keeps the mean encoder's.
    config : train_zoo.byov.ByovConfig, optional
        Other training settings (its epochs and batch size are replaced by the
        arguments').
    progress : bool
    command : str, optional
        Recorded in the provenance.

    Raises
    ------
    InvalidOptionError
        An option out of its range (before any work).
    DataNotFoundError
        The dataset's files are not here and cannot be downloaded.
    """
    import dataclasses

    import torch
    from tqdm.auto import tqdm

    from posteriorzoo.data import load_dataset
    from posteriorzoo.provenance import record
    from posteriorzoo.zoo import checkpoint_digest
    from train_zoo.byov import (
        ENCODER,
        LOG_VARIANCE_INIT,
        MEAN_INIT_STD,
        PRIOR_LABELS,
        TEACHER_VARIANCE_FLOOR,
        ByovConfig,
        encoder_draws,
        encoder_features,
        encoder_parameters,
        layer_statistics,
        prune,
        pruned_keys,
        snr,
        train_byov,
    )

    priors = check_byov_options(priors, train_images, test_images, epochs, batch_size,
                                samples, noise_std, dataset)
    check_bool("recalibrate", recalibrate)
    sparsities = tuple(check_number("sparsity", s, 0.0, strict=True, maximum=1.0,
                                    strict_maximum=True) for s in sparsities)
    config = dataclasses.replace(config or ByovConfig(), epochs=epochs, batch_size=batch_size)
    config.check()
    seeds = study_seeds(seed)
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # small convolutions: one thread, and the machine is shared
    try:
        name = resolve_dataset(dataset, data_dir)
        train_full = load_dataset(name, "train", data_dir)
        test_full = load_dataset(name, "test", data_dir)
        data_seeds = np.random.SeedSequence(seeds["data"]).generate_state(2)
        train, train_index = subset(train_full, train_images, int(data_seeds[0]))
        test, test_index = subset(test_full, test_images, int(data_seeds[1]))
        if train.images.shape[1:] != (1, 28, 28):
            raise InvalidOptionError(f"{name}: the study needs 28x28 grey images, not "
                                     f"{train.images.shape[1:]}")
        mean, std = train_full.mean, train_full.std
        train_x = normalised(train.images, mean, std)
        calibration_x = train_x[:CALIBRATION_IMAGES]
        test_inputs = {"clean": normalised(test.images, mean, std),
                       "noisy": normalised(test.images, mean, std, noise_std, seeds["noise"])}
        steps = (train_images // batch_size) * epochs
        bar = tqdm(total=steps * (len(priors) + 1), desc="training (steps)", leave=False,
                   disable=not progress, unit="step")
        runs = {}
        for prior in (*priors, None):
            runs[model_name(prior)] = train_byov(train, config, prior, seeds["train"],
                                                 mean=mean, std=std, progress=bar)
        bar.close()

        probe_rows: list[dict[str, Any]] = []
        pruning_rows: list[dict[str, Any]] = []
        collections: dict[str, dict[str, Any]] = {}
        training: dict[str, Any] = {}
        layer_stats: dict[str, Any] = {}
        evaluation_started = time.perf_counter()
        for model, run in runs.items():
            network = run.network
            mean_encoder = encoder_parameters(run.posterior.means)
            probe = fit_linear_probe(encoder_features(network, mean_encoder, train_x).numpy(),
                                     train.labels, train.num_classes)

            def score(encoder: Mapping[str, Any], inputs: Sequence[str] = ("clean",),
                      network: Any = network, probe: LinearProbe = probe,
                      fitted: bool = False) -> dict[str, np.ndarray]:
                """The probe's probabilities ``(N, K)`` on each of ``inputs`` through
                ``encoder``; unless it is the encoder the probe was fitted on, with the
                feature standardisation recomputed for it (when recalibrating)."""
                if recalibrate and not fitted:
                    probe = probe.recalibrated(encoder_features(network, encoder,
                                                                calibration_x).numpy())
                return {name: probe.probabilities(
                    encoder_features(network, encoder, test_inputs[name]).numpy())
                    for name in inputs}

            prior_name = run.prior if run.prior is not None else ""
            point = score(mean_encoder, ("clean", "noisy"), fitted=True)
            for inputs in ("clean", "noisy"):
                probe_rows.append({"model": model, "prior": prior_name,
                                   "inference": "mean" if run.variational else "point",
                                   "input": inputs, **probe_metrics(point[inputs],
                                                                    test.labels)})
            draws, draw_seeds = [mean_encoder], [seeds["train"]]
            members = [point]
            if run.variational:
                draws, draw_seeds = encoder_draws(run.posterior, samples, seeds["draws"])
                members = [score(draw, ("clean", "noisy")) for draw in draws]
                for inputs in ("clean", "noisy"):
                    average = np.mean([member[inputs] for member in members], axis=0)
                    probe_rows.append({"model": model, "prior": prior_name,
                                       "inference": "mc", "input": inputs,
                                       **probe_metrics(average, test.labels)})
            draw_accuracy = [float((member["clean"].argmax(1) == test.labels).mean())
                             for member in members]
            keys = pruned_keys(run.posterior.means)
            criteria = {"magnitude": {k: v.abs() for k, v in run.posterior.means.items()}}
            if run.variational:
                criteria = {"snr": snr(run.posterior), **criteria}
            for criterion, scores in criteria.items():
                for sparsity in sparsities:
                    pruned, masks = prune(run.posterior.means, scores, sparsity, keys)
                    removed = sum(int((~m).sum()) for m in masks.values())
                    total = sum(m.numel() for m in masks.values())
                    metrics = probe_metrics(score(encoder_parameters(pruned))["clean"],
                                            test.labels)
                    pruning_rows.append({"model": model, "criterion": criterion,
                                         "sparsity": sparsity,
                                         "achieved_sparsity": removed / total,
                                         **{k: metrics[k] for k in ("accuracy", "ece",
                                                                    "brier")}})
            final = run.history[-1] if run.history else {}
            training[model] = {"prior": run.prior, "steps": run.steps, "seconds": run.seconds,
                               "final_byol_loss": final.get("byol_loss"),
                               "final_kl": final.get("kl") if run.variational else None,
                               "final_beta": final.get("beta")}
            stats = layer_statistics(run.posterior) if run.variational else {}
            layer_stats[model] = stats
            collections[f"{model}.h5"] = _collection(
                run, model, name, draws, draw_seeds, draw_accuracy, seeds, config,
                train_images, final, stats, command, checkpoint_digest)
        evaluation_seconds = time.perf_counter() - evaluation_started
    finally:
        torch.set_num_threads(threads)

    models = [{"model": model, "label": model_label(run.prior), "prior": run.prior,
               "prior_label": PRIOR_LABELS.get(run.prior) if run.prior else None}
              for model, run in runs.items()]
    options = {"priors": list(priors), "train_images": train_images,
               "test_images": test_images, "epochs": epochs, "batch_size": batch_size,
               "samples": samples, "noise_std": noise_std, "dataset": dataset,
               "data_dir": data_dir, "sparsities": list(sparsities),
               "recalibrate": recalibrate,
               "config": dataclasses.asdict(config)}
    summary = {
        "models": models,
        "data": {"dataset": name, "train_images": train_images, "test_images": test_images,
                 "train_index_sha256": hashlib.sha256(train_index.tobytes()).hexdigest(),
                 "test_index_sha256": hashlib.sha256(test_index.tobytes()).hexdigest(),
                 "normalisation": {"mean": list(mean), "std": list(std)},
                 "noise_std": noise_std,
                 "noise": "Gaussian pixel noise on the [0, 1] scale, clipped, then "
                          "normalised; the same draw for every model"},
        "training": {"epochs": epochs, "batch_size": batch_size,
                     "steps_per_model": (train_images // batch_size) * epochs,
                     "encoder": ENCODER, "encoder_options": {"widths": list(config.widths),
                                                             "in_channels": 1},
                     "log_variance_init": LOG_VARIANCE_INIT, "mean_init_std": MEAN_INIT_STD,
                     "teacher_variance_floor": TEACHER_VARIANCE_FLOOR,
                     "kl_scale": f"1 / {train_images} (per training image)",
                     "weight_draws_per_batch": 1, "weight_decay": 0.0,
                     "optimizer": "Adam", "models": training},
        "probe": probe_rows,
        "pruning": pruning_rows,
        "history": {model: run.history for model, run in runs.items()},
        "layers": layer_stats,
        "comparison": _comparison(probe_rows, pruning_rows, priors),
        "probe_settings": {"l2": PROBE_L2, "iterations": PROBE_ITERATIONS,
                           "fitted_on": "posterior-mean (BYOL: point) encoder features of "
                                        "the clean training subset, standardised",
                           "recalibrated": (f"feature standardisation recomputed for each "
                                            f"draw and pruned encoder on the first "
                                            f"{min(CALIBRATION_IMAGES, train_images)} "
                                            f"training images; weights kept"
                                            if recalibrate else "no: the mean encoder's "
                                            "standardisation for every encoder"),
                           "ece_bins": _ece_bins()},
        "collections": {file: {"checkpoints": len(c["draws"]),
                               "method": c["create"]["method"],
                               "checkpoint_sha256": [m["sha256"] for m in c["digests"]]}
                        for file, c in collections.items()},
        "seconds": {"total": time.perf_counter() - started,
                    "evaluation": evaluation_seconds},
    }
    for collection in collections.values():
        collection.pop("digests")
    provenance = record("posteriorzoo study byov", command=command, seeds=seeds,
                        options=options)
    return ByovStudyResult(summary=summary, collections=collections,
                           posteriors={model: run.posterior for model, run in runs.items()},
                           provenance=provenance)


def _ece_bins() -> int:
    from posteriorzoo.metrics import DEFAULT_ECE_BINS

    return DEFAULT_ECE_BINS


def _collection(run: Any, model: str, dataset: str, draws: list, draw_seeds: list[int],
                draw_accuracy: list[float], seeds: Mapping[str, int], config: Any,
                train_images: int, final: Mapping[str, Any], stats: Mapping[str, float],
                command: str | None, digest: Any) -> dict[str, Any]:
    """What :meth:`ByovStudyResult.write_into` needs to write one encoder collection."""
    import dataclasses

    from train_zoo.byov import ENCODER

    arrays = [{key: value.numpy() for key, value in draw.items()} for draw in draws]
    keys = list(arrays[0])
    method = "byov" if run.variational else "byol"
    recipe = {"study": "posteriorzoo study byov", "prior": run.prior,
              "train_images": train_images, "config": dataclasses.asdict(config)}
    record = {"prior": run.prior, "steps": run.steps,
              "final_byol_loss": final.get("byol_loss"), "final_beta": final.get("beta"),
              **{key.replace("/", " "): value for key, value in stats.items()}}
    metadata = [{"seed": draw_seed, "data_seed": seeds["train"], "method": method,
                 "mode_id": 0, "sample_id": index, "epoch": config.epochs,
                 "train_loss": float(final.get("byol_loss", math.nan)),
                 "test_accuracy": accuracy, "wall_time": run.seconds / len(arrays),
                 "source": f"posteriorzoo study byov ({model})"}
                for index, (draw_seed, accuracy) in enumerate(zip(draw_seeds, draw_accuracy,
                                                                   strict=True))]
    return {"create": {"architecture": ENCODER, "dataset": dataset, "method": method,
                       "num_classes": None,
                       "model_options": {"widths": list(config.widths), "in_channels": 1},
                       "template": arrays[0], "recipe": recipe,
                       "annotations": {"posterior": "single-mode", "modes": 1,
                                       "samples_per_mode": len(arrays),
                                       "what": "encoder of the BYOL student (posterior "
                                               "draws)" if run.variational else
                                               "encoder of the BYOL student",
                                       "prior": run.prior},
                       "command": command},
            "draws": arrays, "metadata": metadata, "record": record,
            "digests": [{"sha256": digest(a, keys)} for a in arrays]}


def _comparison(probe_rows: Sequence[Mapping[str, Any]],
                pruning_rows: Sequence[Mapping[str, Any]], priors: Sequence[str]
                ) -> dict[str, Any]:
    """The paper's headline quantities: BYOV minus BYOL in accuracy, ECE and Brier (clean
    and noisy, posterior mean and MC; negative ECE and Brier differences are
    improvements), and SNR minus magnitude pruning accuracy per sparsity."""
    out: dict[str, Any] = {"byov_minus_byol": {}, "snr_minus_magnitude_accuracy": {}}
    for prior in priors:
        model = model_name(prior)
        differences = {}
        for inputs in ("clean", "noisy"):
            base = _probe_row(probe_rows, MODEL_BYOL, inputs, "point")
            for inference in ("mean", "mc"):
                row = _probe_row(probe_rows, model, inputs, inference)
                if row is None or base is None:
                    continue
                differences[f"{inputs}/{inference}"] = {
                    metric: row[metric] - base[metric] for metric in ("accuracy", "ece",
                                                                      "brier")}
        out["byov_minus_byol"][model] = differences
        by = {(r["criterion"], r["sparsity"]): r["accuracy"] for r in pruning_rows
              if r["model"] == model}
        out["snr_minus_magnitude_accuracy"][model] = {
            str(s): by[("snr", s)] - by[("magnitude", s)]
            for (criterion, s) in by if criterion == "snr" and ("magnitude", s) in by}
    return out
