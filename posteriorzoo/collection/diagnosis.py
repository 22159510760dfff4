"""Diagnose a collection: what its samples and its recorded training say, not what the
method promises (``posteriorzoo diagnose``).

Three parts, each present where it applies; what applies is read from the method's entry
in :data:`posteriorzoo.vocabulary.METHODS` (its family, whether its samples show a sigma,
what it records), so a new method gets them by being described there:

- **every collection:** sample diversity (the spread of the members' test accuracies, and
  with predictions the ensemble's in-distribution mutual information, IDMI) and what the
  method recorded at build time (SWAG's rank and iterates, Laplace's prior precision and
  evidence, ...);
- **chains** (the ``chain`` family: SGHMC): per mode, the samples grouped by the chain
  each was drawn from (the metadata column ``chain``), each chain's draws in sample order
  (where the rows do not record chains, as in files of schema 1 to 3, the samples are
  split into the method's ``chains`` in sample order, and ``unknown`` says so), then
  :func:`posteriorzoo.diagnostics.chain_statistics` on every weight, and the kinetic
  temperature each chain recorded;
- **variational** (samples ``mu + sigma * eps``: BBB): per layer, the standard deviation
  of the samples around their mode (the learned sigma) against the initial sigma of the
  method's options, and the recorded sigma and ELBO terms at the start and the end of
  training. A method that records its ``scales`` (Rank-1, whose samples are products, so
  their spread is not a sigma): per layer and factor, the recorded median scale at the
  start and the end of training.

A collection made before training records existed still gets every statistic its
samples allow; what only a record can tell is reported as unknown, with the reason.

Checkpoints with NaN or infinite weights (a collection holds them only flagged
``diverged``) have no predictions and no place in a chain or a spread: every statistic is
computed on the finite checkpoints, the result says how many were left out
(:attr:`DiagnoseResult.left_out`), and a chain with a left-out draw gets no chain
statistics (its draws no longer follow each other). ``canonicalize`` copies such
checkpoints unchanged and ``min-mass`` gives them NaN, in the same spirit: they are kept
in the collection, never computed with.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.collection._open import Source, content_digest, opened, source_path
from posteriorzoo.diagnostics import (
    DEFAULT_LAGS,
    SCALE_MOVED_FACTOR,
    TEMPERATURE_TOLERANCE,
    ChainCoordinates,
    chain_coordinates,
    scale_movement,
)
from posteriorzoo.errors import DataNotFoundError
from posteriorzoo.provenance import record
from posteriorzoo.results import CollectionResult, csv_text
from posteriorzoo.vocabulary import method_info

__all__ = ["DiagnoseResult", "diagnose"]

NOT_RECORDED = ("unknown: not recorded (the collection was made before training records "
                "were stored)")


#: Budget of one block of a mode's draws (bytes, at 8 per value): 100 ResNet-18
#: checkpoints in float64 are 9 GB, so the statistics stream through blocks of weights.
BLOCK_BYTES = 64 << 20


@dataclass
class DiagnoseResult(CollectionResult):
    """The diagnostics of one collection.

    Attributes
    ----------
    path, method : str
    diversity : dict
        ``test_accuracy`` (min, median, max, std over the checkpoints) and ``idmi`` (nats,
        or a string saying why it is unknown).
    build : dict
        What the method recorded per mode (empty when nothing was).
    chains : list of dict or None
        Per mode: :meth:`~posteriorzoo.diagnostics.ChainStatistics.to_dict` and the
        recorded temperature of each chain.
    variational : list of dict or None
        Per mode and layer: initial sigma, the samples' sigma, how far it moved, and the
        recorded start / end values.
    flags : list of str
        Every :data:`posteriorzoo.diagnostics.FLAGS` entry raised, with the modes that
        raise it (``"variance did not train (modes 0, 1, 3)"``).
    unknown : list of str
        What could not be known, and why.
    left_out : int
        Checkpoints with NaN or infinite weights (flagged diverged), left out of every
        statistic.
    """

    kind = "diagnostics"
    path: str
    method: str
    diversity: dict[str, Any]
    build: dict[str, Any]
    chains: list[dict[str, Any]] | None
    variational: list[dict[str, Any]] | None
    flags: list[str]
    unknown: list[str]
    left_out: int = 0

    def payload(self) -> dict[str, Any]:
        return {"path": self.path, "method": self.method, "flags": self.flags,
                "diversity": self.diversity, "build": self.build, "chains": self.chains,
                "variational": self.variational, "unknown": self.unknown,
                "left_out": self.left_out}

    def tables(self) -> dict[str, str]:
        tables = {}
        if self.chains:
            tables["chains.csv"] = csv_text(
                ["mode", "chains", "draws", "ess_median", "ess_worst_tenth", "ess_min",
                 "r_hat_median", "r_hat_worst_tenth", "r_hat_max", "r_hat_above_1_01",
                 "autocorrelation_lag1_median", "drift_median",
                 "kinetic_temperature", "exact_temperature"],
                ([c["mode"], c["chains"], c["draws"], c["ess"]["median"],
                  c["ess"]["worst_tenth"], c["ess"]["worst"], c["r_hat"]["median"],
                  c["r_hat"]["worst_tenth"], c["r_hat"]["worst"], c["r_hat_above_1_01"],
                  c["autocorrelation"]["1"]["median"] if "1" in c["autocorrelation"]
                  else None, c["drift"]["median"], c["kinetic_temperature"],
                  c["exact_temperature"]] for c in self.chains))
        if self.variational:
            tables["layers.csv"] = csv_text(
                ["mode", "layer", "initial_sigma", "sample_sigma", "moved_factor"],
                ([v["mode"], v["layer"], v["initial_sigma"], v["sample_sigma"],
                  v["moved_factor"]] for v in self.variational))
        return tables


def _by_mode(metadata: np.ndarray) -> dict[int, np.ndarray]:
    """Mode id -> the row indices of its samples in sample order."""
    modes: dict[int, np.ndarray] = {}
    for mode in np.unique(metadata["mode_id"]):
        rows = np.flatnonzero(metadata["mode_id"] == mode)
        modes[int(mode)] = rows[np.argsort(metadata["sample_id"][rows], kind="stable")]
    return modes


def _finite_rows(zoo) -> np.ndarray:
    """``(N,)`` bool: the checkpoints whose floating tensors (buffers too) are all finite,
    read one block of one tensor at a time."""
    finite = np.ones(len(zoo), dtype=bool)
    for key, (shape, dtype) in zoo.tensor_layout.items():
        if np.dtype(dtype).kind != "f":
            continue
        rows = max(1, BLOCK_BYTES // (np.dtype(dtype).itemsize * max(1, math.prod(shape))))
        for start, block in zoo.layer_blocks(key, rows=rows):
            rows = block.reshape(len(block), -1)
            finite[start:start + len(block)] &= np.isfinite(rows).all(axis=1)
    return finite


def _weight_keys(zoo) -> list[str]:
    """The floating tensors whose samples are statistics: not BatchNorm's running ones."""
    return [key for key, (_, dtype) in zoo.tensor_layout.items()
            if np.dtype(dtype).kind == "f" and "running_" not in key]


def _mode_blocks(zoo, rows: np.ndarray, keys: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """``(key, block)`` over ``keys`` in order: ``block`` is ``(len(rows), b)`` float64,
    the checkpoints ``rows`` (in that order) at ``b`` consecutive weights of ``key``.

    Only the rows' span is read, one HDF5 hyperslab per block (a mode's rows are
    consecutive in a collection in mode order), so memory is one block whatever the
    collection's size.
    """
    from posteriorzoo.collection.comparison import ZooSource
    from posteriorzoo.mmd.sources import block_plan, features_per_block

    source = ZooSource("diagnose", zoo, keys=keys)
    first, last = int(rows.min()), int(rows.max())
    span = slice(first, last + 1)
    features = features_per_block(last + 1 - first, BLOCK_BYTES)
    try:
        for key in keys:
            for index in block_plan(source.shapes[key], features):
                block = source.read(key, index, rows=span)
                yield key, block[rows - first].astype(np.float64)
    finally:
        source.close()


def _chains_of(mode: int, rows: np.ndarray, chain_ids: np.ndarray, chains_per_mode: int,
                unknown: list[str]) -> list[np.ndarray]:
    """The row indices of each chain of a mode whose ``rows`` are in sample order: grouped
    by their recorded ``chain`` (ascending) when every row records one, else the rows
    split into ``chains_per_mode`` consecutive runs (what the trainer's chain-major
    sample order was), saying so in ``unknown``. Each chain keeps sample order."""
    recorded = chain_ids[rows]
    if rows.size and (recorded >= 0).all():
        return [rows[recorded == chain] for chain in np.unique(recorded)]
    unknown.append(f"mode {mode}: chains not recorded; split by the chains option in "
                   "sample order")
    per_chain = len(rows) // chains_per_mode
    return [rows[chain * per_chain:(chain + 1) * per_chain]
            for chain in range(chains_per_mode)]


def _chain_part(zoo, modes, options, records, lags, flags, unknown, finite, chain_ids):
    keys = _weight_keys(zoo)
    chains_per_mode = int(options.get("chains", 1))
    parts = []
    for mode, rows in modes.items():
        diverged = int((~finite[rows]).sum())
        if diverged:
            unknown.append(f"mode {mode}: {diverged} of its {len(rows)} samples diverged "
                           "(NaN or infinite weights), so its chains are broken: no chain "
                           "statistics")
            continue
        chains = _chains_of(mode, rows, chain_ids, chains_per_mode, unknown)
        lengths = [len(chain) for chain in chains]
        per_chain = min(lengths)
        if per_chain < 4:
            unknown.append(f"mode {mode}: {len(rows)} samples in {len(chains)} chain(s) "
                           "are too few for chain statistics (4 per chain)")
            continue
        if len(set(lengths)) > 1:
            unknown.append(f"mode {mode}: its chains hold {', '.join(map(str, lengths))} "
                           f"draws; the statistics use the first {per_chain} of each")
        chain_lags = tuple(lag for lag in lags if lag < per_chain)
        # chain-major, each chain in sample order: the streaming reader takes any row order
        ordered = np.concatenate([chain[:per_chain] for chain in chains])
        blocks = [chain_coordinates(block.reshape(len(chains), per_chain, -1), chain_lags)
                  for _, block in _mode_blocks(zoo, ordered, keys)]
        stats = ChainCoordinates.join(blocks).summary()
        entry = {"mode": mode, **stats.to_dict(), "kinetic_temperature": None,
                 "exact_temperature": None}
        flags.extend(f"mode {mode}: {flag}" for flag in stats.flags())
        chain_records = (records.get(mode) or {}).get("chains")
        if chain_records:
            temperatures = [c.get("kinetic_temperature") for c in chain_records]
            exact = chain_records[0].get("exact_temperature")
            entry["kinetic_temperature"] = temperatures
            entry["exact_temperature"] = exact
            if exact and any(t is not None and t > (1 + TEMPERATURE_TOLERANCE) * exact
                             for t in temperatures):
                flags.append(f"mode {mode}: chain too hot")
        else:
            unknown.append(f"mode {mode}: kinetic temperature {NOT_RECORDED}")
        parts.append(entry)
    return parts


def _layer_of(key: str) -> str:
    return key.rsplit(".", 1)[0] if "." in key else key


def _variational_part(zoo, modes, options, records, flags, unknown):
    kinds = {_layer_of(key): ("conv" if len(shape) >= 3 else "linear")
             for key, (shape, _) in zoo.tensor_layout.items() if key.endswith("weight")}
    rho = {"linear": float(options.get("rho_linear", -7.0)),
           "conv": float(options.get("rho_conv", -6.0))}
    keys = [key for key in _weight_keys(zoo) if _layer_of(key) in kinds]
    parts = []
    for mode, rows in modes.items():
        if len(rows) < 2:
            unknown.append(f"mode {mode}: one sample tells no sigma" if len(rows) else
                           f"mode {mode}: every sample diverged, none tells a sigma")
            continue
        sigmas: dict[str, list[np.ndarray]] = {key: [] for key in keys}
        for key, block in _mode_blocks(zoo, rows, keys):
            sigmas[key].append(block.std(axis=0, ddof=1))
        moved = []
        for key, pieces in sigmas.items():
            initial = math.log1p(math.exp(rho[kinds[_layer_of(key)]]))
            sample_sigma = np.concatenate(pieces)
            if not (sample_sigma > 0).any():
                continue
            factor = scale_movement(np.array([initial]),
                                    np.array([float(np.median(sample_sigma))]))
            moved.append(factor)
            parts.append({"mode": mode, "layer": key, "initial_sigma": initial,
                          "sample_sigma": float(np.median(sample_sigma)),
                          "moved_factor": factor})
        if moved and max(moved) < SCALE_MOVED_FACTOR:
            flags.append(f"mode {mode}: variance did not train")
        recorded = records.get(mode)
        if recorded:
            parts.append({"mode": mode, "layer": "(recorded)", "initial_sigma": None,
                          "sample_sigma": None, "moved_factor": None, "record": recorded})
        else:
            unknown.append(f"mode {mode}: sigma and ELBO terms during training "
                           f"{NOT_RECORDED}")
    return parts


def _recorded_scales_part(modes, records, flags, unknown):
    """Per mode and factor, how far the recorded median scale moved during training."""
    parts = []
    for mode in modes:
        scales = (records.get(mode) or {}).get("scales")
        if not scales:
            unknown.append(f"mode {mode}: the scales during training {NOT_RECORDED}")
            continue
        moved = []
        for factor, entry in scales.items():
            start, end = entry["scale_median_start"], entry["scale_median_end"]
            movement = scale_movement(np.array([start]), np.array([end]))
            moved.append(movement)
            parts.append({"mode": mode, "layer": factor, "initial_sigma": start,
                          "sample_sigma": None, "final_sigma": end,
                          "moved_factor": movement})
        if moved and max(moved) < SCALE_MOVED_FACTOR:
            flags.append(f"mode {mode}: variance did not train")
    return parts


def _diversity(zoo, metadata, predictions: bool, data_dir: str | None,
               unknown: list[str], finite: np.ndarray) -> dict[str, Any]:
    """The spread of the finite checkpoints' test accuracies and their ensemble's IDMI."""
    metadata = metadata[finite]
    accuracy = metadata["test_accuracy"][np.isfinite(metadata["test_accuracy"])]
    diversity: dict[str, Any] = {"test_accuracy": None if accuracy.size == 0 else {
        "min": float(accuracy.min()), "median": float(np.median(accuracy)),
        "max": float(accuracy.max()), "std": float(accuracy.std())}}
    if not predictions:
        diversity["idmi"] = "not computed (predictions were not asked for)"
        return diversity
    if not finite.any():
        diversity["idmi"] = "unknown: every checkpoint diverged (NaN or infinite weights)"
        return diversity
    from posteriorzoo.collection.evaluation import evaluate, member_probabilities

    def finite_members(zoo, images):
        # every checkpoint at once (the fast engine), then the finite ones' predictions
        return member_probabilities(zoo, images, verify=False)[finite]

    try:
        diversity["idmi"] = evaluate(zoo, data_dir=data_dir, verify=False,
                                     predict=finite_members).idmi
    except DataNotFoundError as error:
        diversity["idmi"] = f"unknown: {error}"
        unknown.append(f"IDMI: the dataset is not available ({error})")
    return diversity


def _grouped(flags: list[str]) -> list[str]:
    """``"mode 3: X"`` flags of several modes as one ``"X (modes 0, 1, 3)"``."""
    modes: dict[str, list[str]] = {}
    for flag in flags:
        mode, _, text = flag.partition(": ")
        modes.setdefault(text, []).append(mode.removeprefix("mode "))
    return [f"{text} (mode{'s' if len(found) > 1 else ''} {', '.join(found)})"
            for text, found in modes.items()]


@public
def diagnose(source: Source, *, predictions: bool = True, data_dir: str | None = None,
             lags: tuple[int, ...] = DEFAULT_LAGS, verify: bool = True,
             command: str | None = None) -> DiagnoseResult:
    """Diagnose a collection's samples (module docstring).

    Parameters
    ----------
    source : path or Zoo
    predictions : bool, default True
        Evaluate the collection on its dataset's test split for IDMI (needs the data).
    data_dir : str, optional
        Folder searched first for the dataset files.
    lags : tuple of int
        Autocorrelation lags of the chain statistics (those below a chain's length).
    verify : bool, default True
        Check every checkpoint against its digests first.
    command : str, optional
        Recorded in the provenance.
    """
    flags: list[str] = []
    unknown: list[str] = []
    with opened(source, verify=verify) as zoo:
        if verify:
            zoo.verify_all()
        metadata = zoo.metadata
        options = dict((zoo.recipe or {}).get("method_options") or {})
        records = zoo.training_records()
        finite = _finite_rows(zoo)
        modes = _by_mode(metadata)
        chains = variational = None
        # what the method is decides what is computed (posteriorzoo.vocabulary); a method
        # the vocabulary does not know gets the statistics every collection gets
        info = method_info(zoo.method)
        family, records_kinds = (info.family, info.records) if info else (None, ())
        if family == "chain":
            chains = _chain_part(zoo, modes, options, records, lags, flags, unknown, finite,
                                 np.asarray(metadata["chain"]))
        if info is not None and info.sample_sigma:
            finite_modes = {mode: rows[finite[rows]] for mode, rows in modes.items()}
            variational = _variational_part(zoo, finite_modes, options, records, flags,
                                            unknown)
        elif "scales" in records_kinds:
            variational = _recorded_scales_part(modes, records, flags, unknown)
        build = {str(mode): record_ for mode, record_ in records.items()}
        if not records and records_kinds:
            unknown.append(f"build-time records {NOT_RECORDED}")
        flags = _grouped(flags)
        diversity = _diversity(zoo, metadata, predictions, data_dir, unknown, finite)
        path = source_path(source)
        return DiagnoseResult(
            str(path), zoo.method, diversity, build, chains, variational, flags, unknown,
            left_out=int((~finite).sum()),
            provenance=record("posteriorzoo diagnose", command=command,
                              inputs={"collection": {"path": str(path),
                                                     "content_sha256": content_digest(zoo)}},
                              options={"predictions": predictions, "lags": list(lags),
                                       "verify": verify}))
