"""Canonicalize a collection, or measure its minimum mass: vectorised over checkpoints.

The symmetry structure is traced once per collection (the pure core
:mod:`posteriorzoo.symmetry`); checkpoints are then read, solved and written in batches
(``{key: (B, *shape)}``), each batch one call of the batched canonicalizer or Newton
solver. :func:`canonicalize` returns a :class:`CanonicalizeResult`, :func:`min_mass` a
:class:`MinMassResult` (whose ``write`` gives ``min_mass.csv``, one row per checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posteriorzoo._api import public
from posteriorzoo._faults import fault_point
from posteriorzoo._pipeline import WriteBehind, read_ahead
from posteriorzoo.collection._open import Source, model_of, opened, source_path
from posteriorzoo.dtypes import numpy_dtype, torch_dtype
from posteriorzoo.errors import CanonicalOverflowError, ChecksumError, InvalidOptionError
from posteriorzoo.options import check_choice, check_integer
from posteriorzoo.outputs import check_output
from posteriorzoo.provenance import describe_input, record
from posteriorzoo.results import CollectionResult, csv_text
from posteriorzoo.symmetry.canonical import canonicalize_batch, check_options
from posteriorzoo.symmetry.minmass import MinMassBatch, mass_problem, solve_min_mass_batch
from posteriorzoo.symmetry.structure import SymmetryStructure, trace_structure, warn_coverage
from posteriorzoo.vocabulary import MINMASS_SOLVERS, STORAGE_DTYPES
from posteriorzoo.zoo import Zoo, create_zoo
from posteriorzoo.zoo.schema import decode

__all__ = ["CanonicalizeResult", "MinMassResult", "canonicalize", "min_mass"]

#: Largest relative change of the logits that ``n_verify`` accepts from the canonical form
#: as computed (in float32: a few float32 roundings per weight, logit changes of order
#: 1e-6; in float64 about 1e-15). Storing it rounds each weight once more (float16: 4.9e-4,
#: a logit change of 3e-4 on OptuNet), which is reported apart (``largest_change``) and
#: warned about above this.
VERIFY_TOLERANCE = 1e-4
#: Memory budget of one batch of computed checkpoints and their temporaries, in bytes
#: (sized as if in float64, the widest computing dtype).
BATCH_BYTES = 256 * 2**20


@dataclass
class CanonicalizeResult(CollectionResult):
    """What :func:`canonicalize` did.

    Attributes
    ----------
    path : Path
        The canonical collection written.
    checkpoints : int
    dead_units : int
        Units without incoming weights, left at scale 1.
    verified : list of int
        Checkpoints checked to compute the same function before and after.
    largest_change : float
        Largest relative change of their logits, as stored.
    exact_change : float
        The same for the canonical form as computed (see :func:`computing_dtype`), before the stored
        dtype's rounding: what ``n_verify`` holds to :data:`VERIFY_TOLERANCE`.
    dtype : str or None
        The stored dtype of the floating tensors when not the source's (``dtype=``).
    copied_unchanged : int
        Checkpoints with non-finite weights (flagged diverged), copied unchanged.
    annotations : dict
        What the canonical collection records about the symmetries removed.
    """

    kind = "canonicalize"
    path: Path
    checkpoints: int
    dead_units: int
    verified: list[int]
    largest_change: float
    copied_unchanged: int = 0
    annotations: dict = field(default_factory=dict)
    exact_change: float = 0.0
    dtype: str | None = None

    def payload(self) -> dict:
        return {"path": str(self.path), "checkpoints": self.checkpoints,
                "dead_units": self.dead_units, "verified": self.verified,
                "largest_change": self.largest_change, "exact_change": self.exact_change,
                "dtype": self.dtype,
                "copied_unchanged": self.copied_unchanged, "annotations": self.annotations}


@dataclass
class MinMassResult(CollectionResult):
    """:func:`min_mass`'s result: arrays over the N checkpoints.

    ``mass_before``/``mass_after``: (N,) sums of squared weights; ``max_abs_before``/
    ``max_abs_after``: weight key -> (N,) largest |w| (paper Fig. 2); ``scales``: scale
    variable -> (N, size); ``dead_units``: ``(checkpoint, variable, unit)``;
    ``iterations``: (N,) Newton iterations (0 for cvxpy); ``seeds``: (N,) the
    checkpoints' seeds. NaN marks checkpoints with non-finite weights.
    ``write(out)`` gives ``min_mass.json`` (summary, provenance) and ``min_mass.csv``
    (one row per checkpoint).
    """

    kind = "min_mass"
    mass_before: np.ndarray
    mass_after: np.ndarray
    max_abs_before: dict[str, np.ndarray]
    max_abs_after: dict[str, np.ndarray]
    scales: dict[int, np.ndarray]
    iterations: np.ndarray
    dead_units: list[tuple[int, int, int]] = field(default_factory=list)
    seeds: np.ndarray | None = None

    def summary(self) -> dict:
        """Counts and medians over the solved checkpoints."""
        finite = np.isfinite(self.mass_after)
        ratio = self.mass_after[finite] / self.mass_before[finite]
        return {"checkpoints": len(self.mass_before), "solved": int(finite.sum()),
                "dead_units": len(self.dead_units),
                "mass_before_median": float(np.median(self.mass_before[finite])),
                "mass_after_median": float(np.median(self.mass_after[finite])),
                "mass_ratio_median": float(np.median(ratio))}

    def payload(self) -> dict:
        return {"summary": self.summary(), "table": "min_mass.csv"}

    def tables(self) -> dict[str, str]:
        count = len(self.mass_before)
        dead = np.bincount([unit[0] for unit in self.dead_units], minlength=count)
        seeds = self.seeds if self.seeds is not None else np.full(count, -1)
        keys = list(self.max_abs_before)
        rows = []
        for i in range(count):
            values = [self.mass_before[i], self.mass_after[i],
                      *[self.max_abs_before[k][i] for k in keys],
                      *[self.max_abs_after[k][i] for k in keys]]
            cells = ["" if not np.isfinite(v) else float(v) for v in values]
            rows.append([i, int(seeds[i]), *cells[:2], int(self.iterations[i]), int(dead[i]),
                         *cells[2:]])
        return {"min_mass.csv": csv_text(
            ["checkpoint", "seed", "mass_before", "mass_after", "iterations", "dead_units",
             *[f"max_abs_before:{k}" for k in keys], *[f"max_abs_after:{k}" for k in keys]],
            rows)}


def _model(zoo: Zoo) -> tuple[torch.nn.Module, tuple[int, ...]]:
    model, shape = model_of(zoo)
    return model.double(), shape


def default_checkpoints_per_batch(zoo: Zoo, structure: SymmetryStructure | None = None,
                       requested: int | None = None) -> int:
    """``requested``, or checkpoints per batch so that one batch stays within
    :data:`BATCH_BYTES`."""
    if requested is not None:
        if requested < 1:
            raise InvalidOptionError(f"batch size must be at least 1, not {requested}")
        return requested
    values = sum(int(np.prod(shape)) for shape in zoo.shapes.values())
    unknowns = 0 if structure is None else sum(
        structure.spaces[structure.scales[i].space].size for i in structure.scalable())
    per_checkpoint = 8 * (8 * values + 3 * (unknowns + 1) ** 2)
    return int(np.clip(BATCH_BYTES // per_checkpoint, 1, 16384))


def computing_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint is canonicalized in: the widest of its stored and output
    floating dtypes, and at least float32.

    float16 (the release's storage) would round every pass by 4.9e-4; float32 keeps the
    canonical form to a few of its roundings (logits within about 1e-6) at half the memory
    traffic of float64, which is what bounds the speed (every pass streams the whole
    state: 45 MB per ResNet-18 in float32).
    """
    widest = torch.float32
    for dtype in dtypes:
        if dtype.is_floating_point:
            widest = torch.promote_types(widest, dtype)
    return widest


def _batches(zoo: Zoo, checkpoints_per_batch: int, dtype: torch.dtype
             ) -> Iterator[tuple[int, dict[str, np.ndarray], dict[str, torch.Tensor],
                             torch.Tensor]]:
    """Yield ``(start, stored, {key: tensor (B, *shape)}, non_finite (B,))`` over the whole
    collection, floating tensors in ``dtype``; ``stored`` is the block as read
    (``{key: (B, *shape)}``). Checkpoints with NaN or infinite values (stored only when
    flagged diverged) are zeroed in the batch and marked in ``non_finite``. A zoo opened
    with ``verify=True`` checks every block's digests as it reads it."""
    for start, stored in zoo.checkpoint_blocks(checkpoints_per_batch):
        size = next(iter(stored.values())).shape[0]
        batch = {key: torch.from_numpy(value) for key, value in stored.items()}
        non_finite = torch.zeros(size, dtype=torch.bool)
        for key, value in batch.items():
            if value.is_floating_point():
                batch[key] = value.to(dtype)
                non_finite |= ~torch.isfinite(value.reshape(size, -1)).all(dim=1)
        if non_finite.any():
            batch = {key: torch.where(non_finite.reshape(-1, *[1] * (v.dim() - 1)), 0, v)
                     if v.is_floating_point() else v for key, v in batch.items()}
        yield start, stored, batch, non_finite


def logit_change(model: torch.nn.Module, shape: tuple[int, ...], before: dict,
                 after: dict, seed: int) -> float:
    """Largest change of the centred logits (softmax-shift free) on random float64 inputs,
    relative to the largest logit."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(16, *shape, dtype=torch.float64, generator=generator)
    outputs = []
    with torch.no_grad():
        for state in (before, after):
            model.load_state_dict({k: v.double() if v.is_floating_point() else v
                                   for k, v in state.items()})
            logits = model(inputs)
            outputs.append(logits - logits.mean(dim=1, keepdim=True))
    return float((outputs[0] - outputs[1]).abs().max() / outputs[0].abs().max())


@public
def canonicalize(source: Source, target: str | os.PathLike, *,
                            permutation: str = "first", scaling: str = "norm",
                            softmax: bool = True, solver: str = "fast", signs: bool = True,
                            n_verify: int = 0, dtype: torch.dtype | None = None,
                            seed: int = 0, checkpoints_per_batch: int | None = None,
                            verify: bool = True, overwrite: bool = False,
                            progress: bool = False, command: str | None = None,
                            device: str = "cpu") -> CanonicalizeResult:
    """Write the canonical form of every checkpoint of ``source`` to a new collection.

    The structure is traced once; checkpoints are canonicalized ``checkpoints_per_batch`` at a time
    (default: :func:`default_checkpoints_per_batch`) in float32 whatever their storage
    (float64 if stored or asked for: :func:`computing_dtype`), and
    stored in the source's dtypes, or in ``dtype`` (floating tensors) if given: a float16
    release canonicalized into float32 keeps the canonical form exact to float32's
    rounding, while float16 storage (half the disk) rounds it by 4.9e-4 relative.
    Reading and verifying the next block, and writing the last one, overlap with the
    computation (:mod:`posteriorzoo._pipeline`); memory holds a few blocks whatever the
    collection's size.
    The target keeps each checkpoint's metadata row and records in its ``annotations``
    attribute exactly what was removed and how. With ``n_verify = N``, N checkpoints
    drawn with ``seed`` are checked to compute the same function before and after
    (random float64 inputs): the canonical form as computed (:class:`ChecksumError` if
    its logits move by more than :data:`VERIFY_TOLERANCE` relative), and as stored, whose
    change is reported and, above that tolerance (float16), warned about with its cause.
    Checkpoints with NaN or infinite weights, which a
    collection holds only flagged as diverged, have no canonical form: they are copied
    unchanged, still flagged, and counted in :attr:`CanonicalizeResult.copied_unchanged`.
    Finite weights whose canonical form does not fit the stored dtype (near float32's
    largest value, rescaling overflows the next layer) raise :class:`CanonicalOverflowError`
    naming the checkpoint; nothing is written.
    ``signs`` removes the sign flips odd activations allow (see
    :mod:`posteriorzoo.symmetry.canonical`); a :class:`SymmetryCoverageWarning` names the
    units an unsupported operation leaves untouched (also in the ``not_removed``
    annotation).

    ``verify`` (default True) checks every source checkpoint's SHA-256 as it is read and
    refuses a corrupt source. The target is built under a temporary name and appears only
    when complete; it must not exist unless ``overwrite``, and is never the source.
    ``device`` (``cpu``, ``cuda``, ``cuda:N``): where each batch is canonicalized (the
    same torch code; the min-mass solver runs on CPU).
    """
    from posteriorzoo.devices import check_device
    from posteriorzoo.progress import progress as progress_bar

    check_options(permutation, scaling, solver)
    where = check_device(device)
    check_integer("n_verify", n_verify, 0)
    check_integer("seed", seed, 0)
    if dtype is not None and dtype not in [getattr(torch, name) for name in STORAGE_DTYPES]:
        raise InvalidOptionError(f"canonicalize dtype must be one of torch."
                                 f"{', torch.'.join(STORAGE_DTYPES)}, not {dtype}")
    path = source_path(source)
    target = check_output(target, inputs=[path], overwrite=overwrite, directory=False)
    with opened(source, verify=verify) as zoo:
        model, shape = _model(zoo)
        structure = trace_structure(model, shape)
        warn_coverage(structure)
        flips = signs and bool(structure.flippable())
        annotations = {"canonicalized_from": path.name, "permutation": permutation,
                       "scaling": scaling, "solver": solver if scaling == "minmass" else None,
                       "softmax": softmax,
                       "softmax_rule": "output biases sum to zero" if softmax else None,
                       "permuted_spaces": len(structure.permutable()),
                       "scaled_variables": len(structure.scalable()),
                       "flipped_variables": len(structure.flippable()) if signs else 0,
                       "sign_rule": "incoming weights and bias of each flippable unit sum "
                                    "to a positive number" if flips else None,
                       "not_removed": structure.notes,
                       "dead_units": "units without incoming weights keep scale 1",
                       "non_finite": "checkpoints with NaN or infinite weights (flagged "
                                     "diverged) are copied unchanged"}
        count = len(zoo)
        checked = set(np.random.default_rng(seed).choice(count, min(n_verify, count),
                                                         replace=False).tolist())
        checkpoints_per_batch = default_checkpoints_per_batch(zoo, structure, checkpoints_per_batch)
        rows = zoo.metadata
        dtypes = {key: torch_dtype(stored) for key, stored in zoo.dtypes.items()}
        computing = computing_dtype(*dtypes.values(), *([dtype] if dtype else []))
        if dtype is not None:
            dtypes = {key: dtype if stored.is_floating_point else stored
                      for key, stored in dtypes.items()}
        layout = {key: (shape, numpy_dtype(dtypes[key]))
                  for key, (shape, _) in zoo.tensor_layout.items()}
        dead, copied, largest, exact, verified = 0, 0, 0.0, 0.0, []
        # Unpublished until the block ends: a failure or a kill leaves no target.
        with create_zoo(target, architecture=zoo.architecture, dataset=zoo.dataset,
                        method=zoo.method, num_classes=zoo.num_classes,
                        model_options=zoo.model_options, template=layout,
                        recipe=zoo.recipe, annotations=annotations, command=command,
                        overwrite=overwrite, publish=False) as out, \
                progress_bar(total=count, desc="canonicalize", unit="ckpt",
                             enabled=progress) as bar, WriteBehind() as writer, \
                contextlib.closing(read_ahead(_batches(zoo, checkpoints_per_batch,
                                                       computing))) as blocks:
            out.check_space(count)  # a full disk refused before any work
            # The next block is read and verified, and the last one written, while this
            # one is canonicalized (posteriorzoo._pipeline); on an error the reader stops
            # before the input closes, and the writer finishes before the output does.
            for start, block, batch, non_finite in blocks:
                canonical, report = canonicalize_batch(
                    {key: value.to(where) for key, value in batch.items()}, structure,
                    permutation, scaling, softmax, solver, signs)
                canonical = {key: value.cpu() for key, value in canonical.items()}
                dead += sum(1 for unit in report.dead_units if not non_finite[unit[0]])
                size = len(non_finite)
                converted = {key: value.to(dtypes[key]) for key, value in canonical.items()}
                _check_in_range(batch, canonical, converted, non_finite, start,
                                path.name, scaling, softmax)
                stored = [{key: block[key][b].astype(layout[key][1]) for key in block}
                          if non_finite[b] else {key: converted[key][b] for key in converted}
                          for b in range(size)]
                copied += int(non_finite.sum())
                for b in sorted(i - start for i in checked if start <= i < start + size):
                    if non_finite[b]:
                        continue
                    before = {key: value[b] for key, value in batch.items()}
                    computed = {key: value[b] for key, value in canonical.items()}
                    change = logit_change(model, shape, before, computed, seed + start + b)
                    exact = max(exact, change)
                    if not change < VERIFY_TOLERANCE:
                        raise ChecksumError(
                            f"checkpoint {start + b}: the canonical network's logits "
                            f"differ by {change:.3g} (relative)")
                    change = logit_change(model, shape, before, stored[b], seed + start + b)
                    largest = max(largest, change)
                    verified.append(start + b)
                writer.submit(_append, out, stored,
                              [_copied_row(rows[start + b], path.name, start + b)
                               for b in range(size)], bar)
    stored_as = sorted({str(value).removeprefix("torch.") for value in dtypes.values()
                        if value.is_floating_point})
    if largest >= VERIFY_TOLERANCE:
        warnings.warn(f"{target.name}: stored in {', '.join(stored_as)}, the canonical "
                      f"weights' rounding moves the logits by up to {largest:.2g} "
                      f"(relative; the canonical form as computed: {exact:.1g}); "
                      "dtype float32 keeps it", stacklevel=2)
    return CanonicalizeResult(
        target, count, dead, verified, largest, copied, annotations, exact,
        None if dtype is None else str(dtype).removeprefix("torch."),
        provenance=record("posteriorzoo canonicalize", command=command,
                          inputs={"source": describe_input(path)},
                          seeds={"n_verify": seed if n_verify else None},
                          options={"permutation": permutation, "scaling": scaling,
                                   "softmax": softmax, "solver": solver, "signs": signs,
                                   "dtype": None if dtype is None
                                   else str(dtype).removeprefix("torch."),
                                   "n_verify": n_verify, "verify": verify,
                                   "device": device}))


def _append(out: Zoo, states: list[dict], rows: list[dict], bar: Any) -> None:
    """Append one canonicalized block (in the write-behind thread) and count it."""
    out.append_many(states, rows)
    fault_point("canonicalize-batch")
    bar.update(len(states))


def _check_in_range(batch: dict[str, torch.Tensor], canonical: dict[str, torch.Tensor],
                    converted: dict[str, torch.Tensor], non_finite: torch.Tensor,
                    start: int, source: str, scaling: str, softmax: bool) -> None:
    """Refuse a batch in which a checkpoint with finite weights has a canonical form that
    is not finite in the collection's dtype.

    Rescaling moves each unit's scale into the next layer, and the softmax shift
    subtracts the mean output bias: weights near the dtype's largest value (3.4e38 in
    float32) can overflow there, although they are valid. The collection would refuse the
    infinite values as a diverged run that is not flagged; the error says what happened
    instead, and which option avoids it: no rescaling, or (without rescaling) no softmax
    shift, since permutations and sign flips move no value out of range.
    """
    size = len(non_finite)
    overflowed = torch.zeros(size, dtype=torch.bool)
    for value in converted.values():
        if value.is_floating_point():
            overflowed |= ~torch.isfinite(value.reshape(size, -1)).all(dim=1)
    overflowed &= ~non_finite
    if not overflowed.any():
        return
    row = int(torch.nonzero(overflowed)[0])
    key = next(key for key, value in converted.items()
               if value.is_floating_point() and not torch.isfinite(value[row]).all())
    dtype = str(converted[key].dtype).removeprefix("torch.")
    largest = max(float(value[row].abs().max()) for value in batch.values()
                  if value.is_floating_point() and value[row].numel())
    where = ("" if torch.isfinite(canonical[key][row]).all()
             else f" (already in the computing dtype, {canonical[key].dtype})")
    problem = (f"{source}: checkpoint {start + row}: its weights are finite but too large "
               f"to canonicalize in {dtype}: the canonical {key} overflows{where} "
               f"(largest |weight| of the checkpoint {largest:.3g})")
    way_out = (("scaling='none'", "scaling", "--scaling none", "the weights keep their scale")
               if scaling != "none" else
               ("softmax=False", "no_softmax", "--no-softmax",
                "the output biases are not shifted") if softmax else None)
    raise CanonicalOverflowError(problem, way_out)


def _copied_row(row: np.void, source: str, index: int) -> dict:
    values = {name: decode(row[name]) for name in row.dtype.names
              if name not in ("sha256", "written_at")}
    values["source"] = f"canonical {source}[{index}]"[-256:]
    return values


def _blank(result: MinMassBatch, rows: np.ndarray) -> None:
    """Set the non-finite checkpoints' entries of ``result`` to NaN."""
    for values in (result.mass_before, result.mass_after, *result.max_abs_before.values(),
                   *result.max_abs_after.values(), *result.scales.values()):
        values[rows] = np.nan


@public
def min_mass(source: Source, *, solver: str = "fast", checkpoints_per_batch: int | None = None,
             verify: bool = True, progress: bool = False, command: str | None = None
             ) -> MinMassResult:
    """Minimum mass of every checkpoint of a collection (nothing is written).

    Returns the masses before and after, each weight tensor's largest |w| before and
    after (paper Fig. 2), the optimal scales and the dead units, as arrays over the
    checkpoint axis. ``solver``: ``"fast"`` (batched Newton) or ``"cvxpy"``. Checkpoints
    with non-finite weights (flagged diverged) get NaN in every array. ``verify``
    checks each checkpoint's SHA-256 as it is read.
    """
    from posteriorzoo.progress import progress as progress_bar

    check_choice("solver", solver, MINMASS_SOLVERS)
    path = source_path(source)
    with opened(source, verify=verify) as zoo:
        seeds = np.asarray(zoo.metadata["seed"])
        model, shape = _model(zoo)
        structure = trace_structure(model, shape)
        problem = mass_problem(structure, {k: torch.from_numpy(np.zeros(s, zoo.dtypes[k]))
                                           for k, s in zoo.shapes.items()})
        parts: list[MinMassBatch] = []
        dead: list[tuple[int, int, int]] = []
        with progress_bar(total=len(zoo), desc="min-mass", unit="ckpt",
                          enabled=progress) as bar:
            for start, _, batch, non_finite in _batches(
                    zoo, default_checkpoints_per_batch(zoo, structure, checkpoints_per_batch),
                    torch.float64):
                result = solve_min_mass_batch(batch, structure, solver, problem)
                result.states = {}
                _blank(result, non_finite.numpy())
                parts.append(result)
                dead += [(start + b, variable, unit) for b, variable, unit in result.dead_units
                         if not non_finite[b]]
                bar.update(len(result.mass_before))
    if not parts:
        raise InvalidOptionError(f"{source}: the collection holds no checkpoints")

    def joined(name: str) -> dict:
        return {key: np.concatenate([getattr(p, name)[key] for p in parts])
                for key in getattr(parts[0], name)}

    return MinMassResult(np.concatenate([p.mass_before for p in parts]),
                         np.concatenate([p.mass_after for p in parts]),
                         joined("max_abs_before"), joined("max_abs_after"), joined("scales"),
                         np.concatenate([p.iterations for p in parts]), dead, seeds,
                         provenance=record("posteriorzoo min-mass", command=command,
                                           inputs={"source": describe_input(path)},
                                           options={"solver": solver, "verify": verify}))
