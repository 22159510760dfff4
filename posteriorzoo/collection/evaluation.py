"""Evaluate a collection's predictions: every member and their average (the ensemble).

The numbers come from the pure core :mod:`posteriorzoo.metrics` (on probability arrays);
this module runs the collection's checkpoints on a dataset split to get them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from posteriorzoo._api import public
from posteriorzoo.collection._open import (
    Source,
    content_digest,
    model_of,
    opened,
    require_architecture_fit,
    source_path,
)
from posteriorzoo.data import ArrayDataset, Normalize, load_dataset
from posteriorzoo.devices import check_device
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.metrics import (
    DEFAULT_ECE_BINS,
    OOD_SCORES,
    accuracy,
    agreement,
    aupr,
    brier_score,
    draw_pairs,
    expected_calibration_error,
    fpr_at_95_recall,
    negative_log_likelihood,
    pairwise_mutual_information,
    total_variation,
)
from posteriorzoo.metrics._checks import probabilities as check_probabilities
from posteriorzoo.metrics.information import ensemble_summary, member_scores
from posteriorzoo.metrics.ood import scores_of
from posteriorzoo.options import check_choice, check_integer
from posteriorzoo.provenance import record
from posteriorzoo.results import CollectionResult, csv_text
from posteriorzoo.symmetry.structure import FX_TRACING
from posteriorzoo.vocabulary import ENGINES

__all__ = ["PREDICTION_ENGINES", "EvaluateResult", "evaluate", "member_probabilities",
           "normalized_images", "reusing_images"]


def normalized_images(dataset: ArrayDataset) -> torch.Tensor:
    """The dataset's images as float32 ``(N, C, H, W)``, normalised with its mean and std
    (uint8 values as stored, then ``(x / 255 - mean) / std``: how every collection was
    trained and evaluated)."""
    return Normalize(dataset.mean, dataset.std)(torch.from_numpy(dataset.images))


#: How :func:`member_probabilities` computes: ``"auto"`` by numba kernels for OptuNets
#: (all checkpoints of a collection at once, the networks as the SIMD axis; 49x batched
#: torch on two cores, ``benchmarks/bench_report.py``), else one torch module per
#: checkpoint; ``"torch"`` always the latter.
PREDICTION_ENGINES = tuple(e for e in ENGINES if e in ("auto", "torch"))


@torch.no_grad()
def member_probabilities(source: Source, images: torch.Tensor,
                         indices: Sequence[int] | None = None, batch_size: int = 2000,
                         verify: bool = True, engine: str = "auto", device: str = "cpu"
                         ) -> np.ndarray:
    """Softmax outputs of each checkpoint, in eval mode.

    Parameters
    ----------
    source : path or Zoo
        A collection whose architecture is registered in :mod:`posteriorzoo.models`.
    images : torch.Tensor
        Model inputs ``(n, C, H, W)``, already normalised (:func:`normalized_images`).
    indices : sequence of int, optional
        Checkpoints to use (default: all).
    batch_size : int
        Images per forward pass.
    verify : bool
        Check each checkpoint's digests as it is read (for a path).
    engine : {"auto", "torch"}
        ``"auto"``: every checkpoint of an OptuNet collection (``indices`` None) at once
        by numba kernels (:mod:`posteriorzoo.collection._optunet_kernels`; the same
        probabilities to about 1e-6), anything else by torch; ``"torch"``: one torch
        module per checkpoint, ``batch_size`` images at a time.
    device : str
        ``cpu``, ``cuda`` or ``cuda:N``: where the torch modules run (the images are
        copied there once; each checkpoint's weights in turn). Off CPU the torch path is
        used whatever ``engine`` says (the numba kernels run on CPU).

    Returns
    -------
    numpy.ndarray
        ``(n_checkpoints, n, num_classes)`` float32 probabilities.
    """
    check_integer("batch_size", batch_size, 1)
    check_choice("engine", engine, PREDICTION_ENGINES)
    where = check_device(device)
    with opened(source, verify=verify) as zoo:
        require_architecture_fit(zoo)  # the kernels, too, compute the registered network
        if engine == "auto" and indices is None and where.type == "cpu":
            from posteriorzoo.collection import _optunet_kernels

            fast = _optunet_kernels.probabilities(zoo, images)
            if fast is not None:
                return fast
        with FX_TRACING:   # not while another thread traces a model (the report's)
            model, _ = model_of(zoo)
        model.to(where)
        images = images.to(where)
        indices = range(len(zoo)) if indices is None else indices
        outputs = []
        for index in indices:
            state = zoo.state_dict(index)
            with FX_TRACING:
                model.load_state_dict(state)
                probabilities = [torch.softmax(model(images[start:start + batch_size]),
                                               dim=1)
                                 for start in range(0, len(images), batch_size)]
            outputs.append(torch.cat(probabilities).cpu().numpy())
    return np.stack(outputs)


@dataclass
class EvaluateResult(CollectionResult):
    """A collection's predictive performance: the paper's Table 1 metrics.

    The ensemble is the posterior predictive: the average of the members' softmax outputs.

    Attributes
    ----------
    dataset, split : str
        The in-distribution (ID) images.
    member_accuracy, member_nll : numpy.ndarray
        ``(N,)`` accuracy in [0, 1] and mean negative log-likelihood (nats) of each
        checkpoint.
    ensemble_accuracy, ensemble_nll, ensemble_brier, ensemble_ece : float
        Of the predictive: accuracy in [0, 1], NLL in nats, Brier score (multi-class
        sum, in [0, 2]) and top-label ECE in [0, 1] with ``bins`` equal-width bins.
    idmi : float
        Mean mutual information between the members' predictions and the label on the ID
        images, in nats (0 for a single network; at most log(min(N, K))).
    ood_dataset : str or None
        The out-of-distribution (OOD) images' dataset, when one was given; then
        ``oodmi`` (nats), ``aupr`` and ``fpr95`` (OOD is the positive class, scored by
        ``ood_score``; both in [0, 1]) are set, else None.
    pairwise_id, pairwise_ood : numpy.ndarray or None
        ``(P,)`` mutual information of the 2-member ensembles of ``pairs`` (nats), when
        ``n_pairs`` were asked for (the functional-collapse figure).
    pairs : numpy.ndarray or None
        ``(P, 2)`` member indices.
    image_counts : dict
        How many ID and OOD images were used.
    function_space : dict or None
        Against each reference predictive given to :func:`evaluate`, by its name: the
        NeurIPS 2021 competition's ``{"agreement": a, "total_variation": tv}`` of the
        predictive (:func:`posteriorzoo.metrics.agreement`,
        :func:`posteriorzoo.metrics.total_variation`); None when none was given.
    predictive : numpy.ndarray or None
        ``(n, K)`` float64: the predictive itself on the ID images, so that it can serve
        as another collection's reference without running the members again. Not part
        of :meth:`payload` or the tables.
    """

    kind = "evaluate"
    dataset: str
    split: str
    member_accuracy: np.ndarray
    member_nll: np.ndarray
    ensemble_accuracy: float
    ensemble_nll: float
    ensemble_brier: float
    ensemble_ece: float
    idmi: float
    bins: int
    image_counts: dict[str, int]
    ood_dataset: str | None = None
    ood_score: str | None = None
    oodmi: float | None = None
    aupr: float | None = None
    fpr95: float | None = None
    pairwise_id: np.ndarray | None = None
    pairwise_ood: np.ndarray | None = None
    pairs: np.ndarray | None = None
    function_space: dict[str, dict[str, float]] | None = None
    predictive: np.ndarray | None = field(default=None, repr=False)

    def metrics(self) -> dict[str, Any]:
        """The ensemble's figures by name (those of the paper's Table 1 and NLL)."""
        return {"accuracy": self.ensemble_accuracy, "nll": self.ensemble_nll,
                "brier": self.ensemble_brier, "ece": self.ensemble_ece, "aupr": self.aupr,
                "fpr95": self.fpr95, "idmi": self.idmi, "oodmi": self.oodmi}

    def payload(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "split": self.split, "ood_dataset": self.ood_dataset,
                "ood_score": self.ood_score, "bins": self.bins, "image_counts": self.image_counts,
                "members": len(self.member_accuracy),
                "member_accuracy_mean": float(np.mean(self.member_accuracy)),
                "member_nll_mean": float(np.mean(self.member_nll)),
                "ensemble_accuracy": self.ensemble_accuracy, "ensemble_nll": self.ensemble_nll,
                "ensemble_brier": self.ensemble_brier, "ensemble_ece": self.ensemble_ece,
                "idmi": self.idmi, "oodmi": self.oodmi, "aupr": self.aupr,
                "fpr95": self.fpr95, "pairs": None if self.pairs is None else len(self.pairs),
                "function_space": self.function_space}

    def tables(self) -> dict[str, str]:
        tables = {"members.csv": csv_text(
            ["checkpoint", "accuracy", "nll"],
            ([i, float(a), float(n)] for i, (a, n) in
             enumerate(zip(self.member_accuracy, self.member_nll, strict=True))))}
        if self.pairs is not None:
            ood = self.pairwise_ood if self.pairwise_ood is not None else [None] * len(self.pairs)
            tables["pairwise_mi.csv"] = csv_text(
                ["first", "second", "id_mi", "ood_mi"],
                ([int(i), int(j), float(a), None if b is None else float(b)]
                 for (i, j), a, b in zip(self.pairs, self.pairwise_id, ood, strict=True)))
        return tables


#: While :func:`reusing_images` is active: the labels and normalised images of each split
#: :func:`evaluate` has read, by (dataset, split, data_dir, n_images, normalisation).
_reused: dict[tuple, tuple[np.ndarray, torch.Tensor, tuple]] | None = None


@contextlib.contextmanager
def reusing_images() -> Iterator[None]:
    """Within the block, :func:`evaluate` reads and normalises each dataset split once
    (the report evaluates every collection on the same images); each call still gets
    its own copy of the images. Outside it every call reads the files again."""
    global _reused
    outer = _reused
    _reused = {} if outer is None else outer
    try:
        yield
    finally:
        _reused = outer


def read_images_first(dataset: str, ood_dataset: str | None = None, *, split: str = "test",
                      data_dir: str | None = None, n_images: int | None = None) -> None:
    """Within :func:`reusing_images`, read the splits :func:`evaluate` will use now, in
    this thread: a missing or corrupt dataset is refused before any long work starts (a
    report of a ResNet zoo would otherwise learn it after its comparisons), and the
    evaluations reuse what was read."""
    if _reused is None:
        raise RuntimeError("read_images_first is for use within reusing_images()")
    _, _, stats = _split_images(dataset, split, data_dir, n_images)
    if ood_dataset is not None:
        _split_images(ood_dataset, split, data_dir, n_images, stats)


def _split_images(name: str, split: str, data_dir: str | None, n_images: int | None,
                  stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None
                  ) -> tuple[np.ndarray, torch.Tensor, tuple]:
    """``(labels, images, (mean, std))`` of the first ``n_images`` of a split, the images
    normalised with ``stats`` (default: the dataset's own mean and std, returned)."""
    key = (name, split, data_dir, n_images, stats)
    if _reused is not None and key in _reused:
        labels, images, used = _reused[key]
        return labels, images.clone(), used
    data = load_dataset(name, split, data_dir=data_dir)
    used = stats or (tuple(data.mean), tuple(data.std))
    images = Normalize(*used)(torch.from_numpy(data.images[:n_images]))
    labels = data.labels[:n_images]
    if _reused is not None:
        _reused[key] = (labels, images.clone(), used)
    return labels, images, used


@public
def evaluate(source: Source, *, dataset: str | None = None, split: str = "test",
             ood_dataset: str | None = None, ood_score: str = "max-probability",
             bins: int = DEFAULT_ECE_BINS, n_images: int | None = None, n_pairs: int = 0,
             seed: int = 0, data_dir: str | None = None, batch_size: int = 2000,
             verify: bool = True, command: str | None = None,
             predict: Callable[[Any, torch.Tensor], np.ndarray] | None = None,
             device: str = "cpu", references: Mapping[str, np.ndarray] | None = None
             ) -> EvaluateResult:
    """The posterior predictive's metrics (paper's Table 1) on a dataset split.

    Every image, in and out of distribution, is normalised as the collection's training
    images were: with the mean and std of the in-distribution dataset.

    Parameters
    ----------
    source : path or Zoo
    dataset : str, optional
        The in-distribution dataset (:func:`posteriorzoo.data.load_dataset`; default: the
        collection's).
    split : {"train", "test"}
        Split of the in-distribution and OOD datasets.
    ood_dataset : str, optional
        An out-of-distribution dataset of the same image shape, e.g. ``"digits"`` for a
        Fashion-MNIST collection: adds AUPR, FPR95 and OODMI.
    ood_score : {"max-probability", "mutual-information"}
        What ranks images as OOD (:func:`posteriorzoo.metrics.ood_scores`).
    bins : int, default 15
        Equal-width confidence bins of the ECE.
    n_images : int, optional
        Use only the first ``n_images`` images of each split (default: all).
    n_pairs : int, default 0
        Also compute the pairwise mutual information of this many member pairs, drawn
        without repetition with ``seed`` (all pairs if there are fewer).
    seed : int
        Seed of the pairs' draw.
    data_dir : str, optional
        Folder searched first for the dataset files.
    batch_size : int
        Images per forward pass.
    verify : bool
        Check each checkpoint's digests as it is read.
    command : str, optional
        Recorded in the provenance.
    predict : callable, optional
        ``predict(zoo, images)``: the members' softmax outputs ``(N, n, K)`` on normalised
        images, in place of :func:`member_probabilities` (the default, engine
        ``"auto"``; ``batch_size`` and ``device`` are its).
    device : str
        Where the members' predictions run: ``cpu``, ``cuda`` or ``cuda:N``.
    references : mapping of str to ndarray of shape (n, K), optional
        Reference predictives by name (e.g. a target's or an HMC collection's
        :attr:`EvaluateResult.predictive`, or a file read by
        :func:`posteriorzoo.collection.reference_predictive.read_reference_predictive`),
        each on the same ``n`` images (after ``n_images``) in the same order: adds the
        predictive's agreement and total variation against each
        (:attr:`EvaluateResult.function_space`). Their names and content hashes are
        recorded in the provenance.
    """
    check_choice("ood_score", ood_score, OOD_SCORES)
    check_integer("bins", bins, 1)
    check_integer("n_pairs", n_pairs, 0)
    check_integer("seed", seed, 0)
    if n_images is not None:
        check_integer("n_images", n_images, 1)
    references = dict(references or {})
    for reference_name, reference in references.items():
        # before the members run: a reference that is no predictive is refused at once
        check_probabilities("evaluate", f"references[{reference_name!r}]", reference,
                            ndim=2)
    with opened(source, verify=verify) as zoo:
        name = dataset or zoo.dataset
        labels, images, stats = _split_images(name, split, data_dir, n_images)
        predict = predict or functools.partial(member_probabilities, batch_size=batch_size,
                                               device=device)
        members = predict(zoo, images)
        ood = None
        if ood_dataset is not None:
            # normalised as the in-distribution images (the collection was trained on them)
            _, ood_images, _ = _split_images(ood_dataset, split, data_dir, n_images, stats)
            if ood_images.shape[1:] != images.shape[1:]:
                raise InvalidOptionError(
                    f"the OOD images of {ood_dataset} have shape "
                    f"{tuple(ood_images.shape[1:])}, the collection's {name} images "
                    f"{tuple(images.shape[1:])}")
            ood = predict(zoo, ood_images)
        digest = content_digest(zoo)
    # Each array's predictive and mutual information once (checked once): IDMI, OODMI,
    # the OOD scores and the ensemble's metrics all derive from them.
    predictive, information = ensemble_summary("evaluate", members)
    extra: dict[str, Any] = {}
    if ood is not None:
        ood_predictive, ood_information = ensemble_summary("evaluate", ood)
        id_scores = scores_of(predictive, information, ood_score)
        ood_scored = scores_of(ood_predictive, ood_information, ood_score)
        extra.update(ood_dataset=ood_dataset, ood_score=ood_score,
                     oodmi=float(ood_information.mean()), aupr=aupr(id_scores, ood_scored),
                     fpr95=fpr_at_95_recall(id_scores, ood_scored))
    if n_pairs and len(members) >= 2:
        chosen = draw_pairs(len(members), n_pairs, seed)
        extra["pairwise_id"], extra["pairs"] = pairwise_mutual_information(members, chosen)
        if ood is not None:
            extra["pairwise_ood"] = pairwise_mutual_information(ood, chosen)[0]
    # the ensemble's first: they check the labels (ensemble_summary checked the members)
    ensemble_accuracy = accuracy(predictive, labels)
    ensemble_nll = negative_log_likelihood(predictive, labels)
    if references:
        extra["function_space"] = _function_space(predictive, references)
    return EvaluateResult(
        name, split, *member_scores(members, labels), ensemble_accuracy, ensemble_nll,
        brier_score(predictive, labels), expected_calibration_error(predictive, labels, bins),
        float(information.mean()), bins,
        {"id": len(labels), "ood": 0 if ood is None else ood.shape[1]}, **extra,
        predictive=predictive,
        provenance=record("posteriorzoo evaluate", command=command,
                          inputs={"collection": {"path": str(source_path(source)),
                                                 "content_sha256": digest},
                                  **({"references": {
                                      key: _array_digest(value)
                                      for key, value in references.items()}}
                                     if references else {})},
                          seeds={"pairs": seed if n_pairs else None},
                          options={"dataset": name, "split": split, "ood_dataset": ood_dataset,
                                   "ood_score": ood_score, "bins": bins, "n_images": n_images,
                                   "n_pairs": n_pairs, "verify": verify,
                                   "device": device,
                                   "references": sorted(references) or None}))


def _function_space(predictive: np.ndarray, references: Mapping[str, np.ndarray]
                    ) -> dict[str, dict[str, float]]:
    """The predictive's agreement and total variation against each reference, once
    each reference covers the same images and classes."""
    scores = {}
    for name, reference in references.items():
        if reference.shape != predictive.shape:
            raise InvalidOptionError(
                f"evaluate(): the reference predictive {name!r} has shape "
                f"{reference.shape}, the collection's predictive {predictive.shape} (its "
                "images and classes): a reference must cover the same images, in order")
        scores[name] = {"agreement": agreement(predictive, reference),
                        "total_variation": total_variation(predictive, reference)}
    return scores


def _array_digest(array: np.ndarray) -> dict[str, Any]:
    """What identifies a reference array in the provenance: its shape, dtype and the
    SHA-256 of its bytes (C order)."""
    return {"shape": list(array.shape), "dtype": str(array.dtype),
            "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()}
