"""Diagnose a collection: what its samples and its recorded training say, not what the
method promises (``posteriorzoo diagnose``).

Three parts, each present where it applies; what applies is read from the method's entry
in :data:`posteriorzoo.vocabulary.METHODS` (its family, whether its samples show a sigma,
what it records), so a new method gets them by being described there:

- **every collection:** sample diversity (the spread of the members' test accuracies, and
  with predictions the ensemble's in-distribution mutual information, IDMI) and what the
  method recorded at build time (SWAG's rank and iterates, Laplace's prior precision and
  evidence, ...);
- **chains** (the ``chain`` family: SGHMC, SGLD, HMC): per mode, the samples grouped by
  the chain each was drawn from (the metadata column ``chain``), each chain's draws in
  sample order (where the rows do not record chains, as in files of schema 1 to 3, the
  samples are split into the method's ``chains`` in sample order, and ``unknown`` says
  so), then :func:`posteriorzoo.diagnostics.chain_statistics` on every weight, and what
  each chain recorded (``chains`` records): SGHMC's kinetic temperature, HMC's acceptance,
  frozen step, leapfrog steps and E-BFMI, flagged by
  :func:`~posteriorzoo.diagnostics.sampler_flags`. R-hat compares the chains *of one
  mode* (with one chain, its two halves), never chains of different modes: those start
  from different trained networks on purpose (HMC's one chain per mode), and their
  spread is said as modes instead (:func:`~posteriorzoo.diagnostics.chain_spread`: the
  distance between every two chains' means in within-chain standard deviations, in the
  weights and in the test log-likelihood). Where the collection fits in memory
  (:data:`IN_MEMORY_BYTES`) the weight statistics are repeated with the symmetries
  removed (each checkpoint canonicalized by :mod:`posteriorzoo.symmetry`, or as stored in
  a canonical collection), and the spread is of those weights. With predictions, each
  sample's test log-likelihood (mean log p(y | x) over the test split, from the
  predictions IDMI uses) gets the same ESS and R-hat
  (:func:`~posteriorzoo.diagnostics.series_statistics`): mixing in function space;
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
import warnings
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
    chain_spread,
    sampler_flags,
    scale_movement,
    series_statistics,
)
from posteriorzoo.errors import DataNotFoundError, PosteriorZooError
from posteriorzoo.provenance import record
from posteriorzoo.results import CollectionResult, csv_text
from posteriorzoo.vocabulary import method_info

__all__ = ["DiagnoseResult", "diagnose"]

NOT_RECORDED = ("unknown: not recorded (the collection was made before training records "
                "were stored)")


#: Budget of one block of a mode's draws (bytes, at 8 per value): 100 ResNet-18
#: checkpoints in float64 are 9 GB, so the statistics stream through blocks of weights.
BLOCK_BYTES = 64 << 20
#: The most a chain collection's finite checkpoints may take in float64 for diagnose to
#: hold them in memory: canonicalize them (the statistics with the symmetries removed)
#: and measure the spread between chains in weights. 100 OptuNets are 0.3 MB; past the
#: budget both are unknown (canonicalize the collection and diagnose the copy).
IN_MEMORY_BYTES = 256 << 20
#: What a chain's record may hold beside its temperature (HMC's sampler), each reported
#: per chain in the mode's entry (None where no chain recorded it).
SAMPLER_FIELDS = ("acceptance_rate", "e_bfmi", "step_size", "leapfrog_steps",
                  "divergences")


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
        Per mode: :meth:`~posteriorzoo.diagnostics.ChainStatistics.to_dict` of its
        weights; ``chain_ids``; what each chain recorded (``kinetic_temperature`` and
        ``exact_temperature``; :data:`SAMPLER_FIELDS` as lists over chains and
        ``target_accept``; None where not recorded); ``symmetries_removed`` (ESS and
        R-hat of the canonical weights, or None); ``log_likelihood``
        (:meth:`~posteriorzoo.diagnostics.SeriesStatistics.to_dict` of each sample's
        test log-likelihood with each chain's ``mean`` and ``sd``, or None without
        predictions).
    between_chains : dict or None
        With two chains or more: ``chains`` (mode and chain id of each), ``symmetries``
        (``"remove"`` or ``"keep"``: the weights measured), ``weights`` and
        ``log_likelihood``
        (:meth:`~posteriorzoo.diagnostics.ChainSpread.to_dict`, or None when unknown),
        ``pairs`` (each pair's distances) and ``sentence``.
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
    between_chains: dict[str, Any] | None = None

    def payload(self) -> dict[str, Any]:
        return {"path": self.path, "method": self.method, "flags": self.flags,
                "diversity": self.diversity, "build": self.build, "chains": self.chains,
                "between_chains": self.between_chains,
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
        if self.between_chains:
            tables["between_chains.csv"] = csv_text(
                ["first_mode", "first_chain", "second_mode", "second_chain",
                 "weights_distance", "log_likelihood_distance"],
                ([p["first"]["mode"], p["first"]["chain"], p["second"]["mode"],
                  p["second"]["chain"], p["weights"], p["log_likelihood"]]
                 for p in self.between_chains["pairs"]))
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


def _weights_in_memory(zoo, finite: np.ndarray, keys: list[str], unknown: list[str]
                       ) -> tuple[np.ndarray | None, str | None]:
    """``(N, d)`` float64: the weights ``keys`` of every checkpoint (NaN rows for the
    non-finite ones) with the symmetries removed, and ``"remove"``; the stored weights and
    ``"keep"`` where they cannot be canonicalized; ``(None, None)`` past
    :data:`IN_MEMORY_BYTES`. The reason for anything less is added to ``unknown``.

    A canonical collection's stored weights already have the symmetries removed; any
    other is canonicalized here by :func:`posteriorzoo.symmetry.canonicalize_many` with
    its defaults (the paper's ``first`` permutation key and ``norm`` scaling).
    """
    count = int(finite.sum())
    width = sum(math.prod(shape) for shape, _ in zoo.tensor_layout.values())
    size = 8 * count * width
    if count == 0:
        return None, None
    if size > IN_MEMORY_BYTES:
        unknown.append(f"the weights with the symmetries removed and the spread between "
                       f"chains in weights: the {count} finite checkpoints take "
                       f"{size / 2**20:.0f} MiB in float64, over the "
                       f"{IN_MEMORY_BYTES >> 20} MiB diagnose holds in memory (canonicalize "
                       "the collection and diagnose the copy)")
        return None, None
    states: Any = {key: zoo.layer(key, finite) for key in zoo.state_keys}
    setting = "remove"
    if "canonicalized_from" not in zoo.annotations:
        from posteriorzoo.collection._open import model_of
        from posteriorzoo.symmetry import SymmetryCoverageWarning, canonicalize_many

        try:
            model, shape = model_of(zoo)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", SymmetryCoverageWarning)
                states = canonicalize_many(model.double(), states, input_shape=shape)
            for warning in caught:
                if issubclass(warning.category, SymmetryCoverageWarning):
                    unknown.append(f"symmetries removed: {warning.message}")
                else:  # not ours to swallow
                    warnings.warn(warning.message, warning.category, stacklevel=2)
        except PosteriorZooError as error:
            unknown.append(f"the weights with the symmetries removed: {error}; the spread "
                           "between chains is of the stored weights")
            setting = "keep"
    flat = np.full((len(finite), sum(math.prod(zoo.tensor_layout[key][0]) for key in keys)),
                   np.nan)
    flat[finite] = np.concatenate([np.asarray(states[key], dtype=np.float64).reshape(count, -1)
                                   for key in keys], axis=1)
    return flat, setting


def _recorded_chains(mode: int, records: dict[int, dict[str, Any]]
                     ) -> tuple[dict[str, Any], list[str], bool]:
    """What the chains of ``mode`` recorded: ``(fields, flags, recorded)``. ``fields``
    holds ``kinetic_temperature`` (a list over chains, None where no chain recorded one),
    ``exact_temperature``, each of :data:`SAMPLER_FIELDS` (a list over chains, or None)
    and ``target_accept``; ``flags`` the temperature's and
    :func:`~posteriorzoo.diagnostics.sampler_flags`' verdicts (``"mode 3: ..."``);
    ``recorded`` whether the mode has chain records at all."""
    chain_records = (records.get(mode) or {}).get("chains") or []
    fields: dict[str, Any] = {"kinetic_temperature": None, "exact_temperature": None}
    fields.update({name: None for name in SAMPLER_FIELDS}, target_accept=None)
    raised: list[str] = []
    if not chain_records:
        return fields, raised, False
    temperatures = [c.get("kinetic_temperature") for c in chain_records]
    if any(t is not None for t in temperatures):
        exact = chain_records[0].get("exact_temperature")
        fields.update(kinetic_temperature=temperatures, exact_temperature=exact)
        if exact and any(t is not None and t > (1 + TEMPERATURE_TOLERANCE) * exact
                         for t in temperatures):
            raised.append("chain too hot")
    for name in SAMPLER_FIELDS:
        values = [c.get(name) for c in chain_records]
        if any(value is not None for value in values):
            fields[name] = values
    fields["target_accept"] = chain_records[0].get("target_accept")
    for chain in chain_records:
        for flag in sampler_flags(chain.get("acceptance_rate"), chain.get("e_bfmi")):
            if flag not in raised:
                raised.append(flag)
    return fields, [f"mode {mode}: {flag}" for flag in raised], True


def _removed_statistics(weights: np.ndarray | None, setting: str | None,
                        ordered: np.ndarray, shape: tuple[int, int], lags: tuple[int, ...]
                        ) -> dict[str, Any] | None:
    """ESS and R-hat of the chains' canonical weights (None unless ``setting`` is
    ``"remove"``); ``ordered`` are their rows chain-major, ``shape`` (chains, draws)."""
    if weights is None or setting != "remove":
        return None
    stats = chain_coordinates(weights[ordered].reshape(*shape, -1), lags).summary()
    return {"ess": stats.ess.to_dict(), "r_hat": stats.r_hat.to_dict(),
            "r_hat_above_1_01": stats.r_hat_above_strict, "constant": stats.constant}


def _chain_part(zoo, modes, options, records, lags, flags, unknown, finite, chain_ids,
                log_likelihood):
    keys = _weight_keys(zoo)
    chains_per_mode = int(options.get("chains", 1))
    weights, setting = _weights_in_memory(zoo, finite, keys, unknown)
    canonical = "canonicalized_from" in zoo.annotations
    parts, measured = [], []
    for mode, rows in modes.items():
        recorded, raised, has_records = _recorded_chains(mode, records)
        diverged = int((~finite[rows]).sum())
        if diverged:
            unknown.append(f"mode {mode}: {diverged} of its {len(rows)} samples diverged "
                           "(NaN or infinite weights), so its chains are broken: no chain "
                           "statistics")
            flags.extend(raised)
            continue
        chains = _chains_of(mode, rows, chain_ids, chains_per_mode, unknown)
        lengths = [len(chain) for chain in chains]
        per_chain = min(lengths)
        if per_chain < 4:
            unknown.append(f"mode {mode}: {len(rows)} samples in {len(chains)} chain(s) "
                           "are too few for chain statistics (4 per chain)")
            flags.extend(raised)
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
        ids = ([int(chain_ids[chain[0]]) for chain in chains]
               if (chain_ids[rows] >= 0).all() else None)
        entry = {"mode": mode, **stats.to_dict(), **recorded, "chain_ids": ids}
        if canonical:  # the stored weights are the canonical ones
            entry["symmetries_removed"] = {
                "ess": stats.ess.to_dict(), "r_hat": stats.r_hat.to_dict(),
                "r_hat_above_1_01": stats.r_hat_above_strict, "constant": stats.constant}
        else:
            entry["symmetries_removed"] = _removed_statistics(
                weights, setting, ordered, (len(chains), per_chain), chain_lags)
        entry["log_likelihood"] = None
        if log_likelihood is not None:
            series = series_statistics(
                log_likelihood[ordered].reshape(len(chains), per_chain), chain_lags)
            entry["log_likelihood"] = {
                **series.to_dict(),
                "mean": [float(log_likelihood[chain].mean()) for chain in chains],
                "sd": [float(log_likelihood[chain].std(ddof=1)) for chain in chains]}
        flags.extend(f"mode {mode}: {flag}" for flag in stats.flags())
        flags.extend(raised)
        if not has_records:
            unknown.append(f"mode {mode}: kinetic temperature {NOT_RECORDED}")
        parts.append(entry)
        measured.extend((mode, index if ids is None else ids[index], chain)
                        for index, chain in enumerate(chains))
    between = (_between_chains(measured, weights, setting, log_likelihood)
               if len(measured) >= 2 else None)
    return parts, between


def _between_chains(measured: list[tuple[int, int, np.ndarray]], weights: np.ndarray | None,
                    setting: str | None, log_likelihood: np.ndarray | None
                    ) -> dict[str, Any]:
    """The spread between every two chains (``(mode, chain id, rows)``), in the weights
    (canonical where ``setting`` is ``"remove"``) and in the test log-likelihood, each
    None where unknown (:func:`~posteriorzoo.diagnostics.chain_spread`)."""
    labels = [{"mode": mode, "chain": chain} for mode, chain, _ in measured]
    in_weights = (None if weights is None else
                  chain_spread([weights[rows] for _, _, rows in measured]))
    in_function = (None if log_likelihood is None else
                   chain_spread([log_likelihood[rows][:, None] for _, _, rows in measured]))
    pairs = [{"first": labels[a], "second": labels[b],
              "weights": None if in_weights is None else float(in_weights.distance[a, b]),
              "log_likelihood": (None if in_function is None
                                 else float(in_function.distance[a, b]))}
             for a in range(len(labels)) for b in range(a + 1, len(labels))]
    if in_weights is not None:
        sentence = in_weights.sentence()
        if setting == "keep":
            sentence += " in the stored weights (the symmetries kept)"
    else:
        sentence = f"{len(labels)} chains: their spread in weights is unknown"
    if in_function is not None:
        distances = in_function.pair_distances()
        low, high = float(distances.min()), float(distances.max())
        shown = f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f} to {high:.1f}"
        sentence += f"; in test log-likelihood {shown} within-chain sd apart"
    return {"chains": labels, "symmetries": setting,
            "weights": None if in_weights is None else in_weights.to_dict(),
            "log_likelihood": None if in_function is None else in_function.to_dict(),
            "pairs": pairs, "sentence": sentence}


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
               unknown: list[str], finite: np.ndarray
               ) -> tuple[dict[str, Any], np.ndarray | None]:
    """The spread of the finite checkpoints' test accuracies and their ensemble's IDMI;
    and from the same predictions each checkpoint's test log-likelihood, the mean of
    ``log p(y | x)`` over the test split (``(N,)``, NaN for the non-finite ones; None
    without predictions)."""
    metadata = metadata[finite]
    accuracy = metadata["test_accuracy"][np.isfinite(metadata["test_accuracy"])]
    diversity: dict[str, Any] = {"test_accuracy": None if accuracy.size == 0 else {
        "min": float(accuracy.min()), "median": float(np.median(accuracy)),
        "max": float(accuracy.max()), "std": float(accuracy.std())}}
    if not predictions:
        diversity["idmi"] = "not computed (predictions were not asked for)"
        return diversity, None
    if not finite.any():
        diversity["idmi"] = "unknown: every checkpoint diverged (NaN or infinite weights)"
        return diversity, None
    from posteriorzoo.collection.evaluation import evaluate, member_probabilities

    def finite_members(zoo, images):
        # every checkpoint at once (the fast engine), then the finite ones' predictions
        return member_probabilities(zoo, images, verify=False)[finite]

    try:
        evaluated = evaluate(zoo, data_dir=data_dir, verify=False, predict=finite_members)
    except DataNotFoundError as error:
        diversity["idmi"] = f"unknown: {error}"
        unknown.append(f"IDMI: the dataset is not available ({error})")
        return diversity, None
    diversity["idmi"] = evaluated.idmi
    log_likelihood = np.full(len(finite), np.nan)
    log_likelihood[finite] = -np.asarray(evaluated.member_nll, dtype=np.float64)
    return diversity, log_likelihood


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
        chains = variational = between = None
        # what the method is decides what is computed (posteriorzoo.vocabulary); a method
        # the vocabulary does not know gets the statistics every collection gets
        info = method_info(zoo.method)
        family, records_kinds = (info.family, info.records) if info else (None, ())
        # the predictions first: the chains' test log-likelihoods come from them (their
        # unknowns are listed where they always were, after the others)
        predicted: list[str] = []
        diversity, log_likelihood = _diversity(zoo, metadata, predictions, data_dir,
                                               predicted, finite)
        if family == "chain":
            chains, between = _chain_part(zoo, modes, options, records, lags, flags,
                                          unknown, finite, np.asarray(metadata["chain"]),
                                          log_likelihood)
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
        unknown.extend(predicted)
        path = source_path(source)
        return DiagnoseResult(
            str(path), zoo.method, diversity, build, chains, variational, flags, unknown,
            left_out=int((~finite).sum()), between_chains=between,
            provenance=record("posteriorzoo diagnose", command=command,
                              inputs={"collection": {"path": str(path),
                                                     "content_sha256": content_digest(zoo)}},
                              options={"predictions": predictions, "lags": list(lags),
                                       "verify": verify}))
