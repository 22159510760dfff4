"""Weight-space symmetries: permutations, positive scalings, sign flips, the softmax shift.

The structure of a network's symmetry group is derived by tracing it with torch.fx
(:func:`symmetry_structure`), not from a list of architectures; which operations let
which symmetries through is one table (:mod:`posteriorzoo.symmetry.operations`).
:func:`random_symmetry` applies a random group element, for tests and for users checking
their own models. The canonicalizer (scaling normalisation or min-mass, signs, sorting)
builds on these pieces: :func:`canonicalize` and :func:`min_mass` for one checkpoint,
:func:`canonicalize_many` for a batch in memory, all vectorised over the checkpoint
axis. This package works on state dicts and arrays only; whole collection files are
canonicalized by :func:`posteriorzoo.collection.canonicalize` and measured by
:func:`posteriorzoo.collection.min_mass`. Where an operation the tracer does not support
leaves units untouched, the canonicalizers say so with a :class:`SymmetryCoverageWarning`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from posteriorzoo._api import public
from posteriorzoo.errors import InvalidOptionError, NonFiniteWeightsError
from posteriorzoo.symmetry.canonical import CanonicalReport, canonicalize_batch, canonicalize_state
from posteriorzoo.symmetry.minmass import (
    MinMassBatch,
    MinMassResult,
    mass_problem,
    solve_min_mass,
    solve_min_mass_batch,
)
from posteriorzoo.symmetry.operations import OperationProperties, operation_properties
from posteriorzoo.symmetry.structure import (
    ScaleVariable,
    SignVariable,
    SymmetryCoverageWarning,
    SymmetryStructure,
    TensorAxis,
    UnitSpace,
    trace_structure,
    warn_coverage,
)
from posteriorzoo.symmetry.transform import (
    apply_symmetry,
    apply_symmetry_batch,
    sample_permutations,
    sample_signs,
    stack_states,
)

__all__ = [
    "CanonicalReport",
    "MinMassBatch",
    "MinMassResult",
    "OperationProperties",
    "ScaleVariable",
    "SignVariable",
    "SymmetryCoverageWarning",
    "SymmetryStructure",
    "TensorAxis",
    "UnitSpace",
    "apply_symmetry",
    "apply_symmetry_batch",
    "canonicalize",
    "canonicalize_batch",
    "canonicalize_many",
    "canonicalize_state",
    "mass_problem",
    "min_mass",
    "operation_properties",
    "solve_min_mass",
    "solve_min_mass_batch",
    "stack_states",
    "random_symmetry",
    "resolve_model",
    "sample_permutations",
    "sample_signs",
    "symmetry_structure",
    "warn_coverage",
]


@public
def resolve_model(model_or_name: nn.Module | str, state_dict: Mapping[str, torch.Tensor],
                  **options: Any) -> tuple[nn.Module, tuple[int, ...]]:
    """A module and its input shape from a module (needs ``input_shape=``) or a registry name.

    With a name, ``state_dict`` is checked against ``build(name, **options)`` (raises
    :class:`~posteriorzoo.errors.ZooSchemaError` when it does not fit).
    """
    from posteriorzoo import models

    if isinstance(model_or_name, nn.Module):
        if "input_shape" not in options:
            raise InvalidOptionError("pass input_shape=(C, H, W) with a module")
        return model_or_name, tuple(options["input_shape"])
    models.check_state_dict(model_or_name, state_dict, **options)
    model_options = {k: v for k, v in options.items() if k != "num_classes"}
    model = models.build(model_or_name, num_classes=options.get("num_classes"), **model_options)
    return model, models.input_shape(model_or_name, **model_options)


@public
def symmetry_structure(model_or_name: nn.Module | str, state_dict: Mapping[str, torch.Tensor],
                       **options: Any) -> SymmetryStructure:
    """The symmetry structure of a model given by name (and options) or as a module."""
    model, shape = resolve_model(model_or_name, state_dict, **options)
    return trace_structure(model, shape)


def _require_finite(state_dict: Mapping[str, torch.Tensor]) -> None:
    for key, value in state_dict.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise NonFiniteWeightsError(f"{key} has NaN or infinite values")


@public
def canonicalize(model_or_name: nn.Module | str, state_dict: Mapping[str, torch.Tensor],
                 permutation: str = "first", scaling: str = "norm", softmax: bool = True,
                 solver: str = "fast", signs: bool = True, **options: Any
                 ) -> dict[str, torch.Tensor]:
    """The canonical form of a checkpoint: a new state_dict with the same keys and shapes.

    Parameters
    ----------
    model_or_name : nn.Module or str
        A registered model name (with its options, e.g. ``num_classes=10``) or a module
        (with ``input_shape=(C, H, W)``).
    state_dict : mapping of str to tensor
    permutation : {"first", "max", "none"}
        Sort hidden units by their first incoming weight (the paper's default) or by their
        largest incoming weight, after the scales are canonical.
    scaling : {"norm", "std", "minmass", "none"}
        Give each scalable unit's incoming weights unit L2 norm or unit standard deviation,
        layer by layer, pushing the scale into the next layer; or ``norm`` followed by
        the minimum-mass scaling (see :mod:`posteriorzoo.symmetry.canonical`).
    softmax : bool
        Shift the output biases to sum to zero.
    solver : {"fast", "cvxpy"}
        Min-mass solver (``scaling="minmass"`` only).
    signs : bool
        Remove the sign flips odd activations allow (tanh, sin, ...): each such unit's
        incoming values are made to sum to a positive number (see
        :mod:`posteriorzoo.symmetry.canonical`). Networks without them are unaffected.

    Returns
    -------
    dict of str to tensor

    Warns
    -----
    SymmetryCoverageWarning
        When an operation the tracer does not support (LayerNorm, a concatenation, ...)
        leaves units untouched; the message names the operation and the layers.

    Symmetric copies of one network map to the same canonical state_dict, and the
    canonical network computes the same function, both up to float rounding.
    """
    _require_finite(state_dict)
    structure = symmetry_structure(model_or_name, state_dict, **options)
    warn_coverage(structure)
    return canonicalize_state(state_dict, structure, permutation, scaling, softmax,
                              solver, signs)[0]


@public
def canonicalize_many(model_or_name: nn.Module | str,
                      states: Mapping[str, torch.Tensor | np.ndarray],
                      permutation: str = "first", scaling: str = "norm",
                      softmax: bool = True, solver: str = "fast", signs: bool = True,
                      **options: Any) -> dict[str, torch.Tensor]:
    """:func:`canonicalize` for B checkpoints at once, vectorised over the checkpoint axis.

    ``states`` maps every state key to an array of shape (B, *shape) (e.g. one
    ``Zoo.layer(key)`` per key); the result has the same keys and shapes, in float64.
    The structure is traced once; warns like :func:`canonicalize`.
    """
    batch = {key: torch.as_tensor(value) for key, value in states.items()}
    _require_finite(batch)
    batch = {key: value.double() if value.is_floating_point() else value
             for key, value in batch.items()}
    structure = symmetry_structure(model_or_name, {k: v[0] for k, v in batch.items()},
                                   **options)
    warn_coverage(structure)
    return canonicalize_batch(batch, structure, permutation, scaling, softmax, solver,
                              signs)[0]


@public
def min_mass(model_or_name: nn.Module | str, state_dict: Mapping[str, torch.Tensor],
             solver: str = "fast", **options: Any) -> MinMassResult:
    """Rescale a checkpoint to its minimum weight mass (see :mod:`posteriorzoo.symmetry.minmass`).

    Returns the mass before and after, the optimal scales per scale variable, each weight
    tensor's largest absolute value before and after, and the rescaled state_dict (same
    function). ``solver``: ``"fast"`` (Newton) or ``"cvxpy"`` (the reference).
    """
    _require_finite(state_dict)
    structure = symmetry_structure(model_or_name, state_dict, **options)
    return solve_min_mass(state_dict, structure, solver)


@public
def random_symmetry(model_or_name: nn.Module | str, state_dict: Mapping[str, torch.Tensor],
                    seed: int, scale_range: tuple[float, float] = (0.1, 10.0),
                    batchnorm_prescale: bool = True, softmax: bool = True,
                    signs: bool = True, **options: Any) -> dict[str, torch.Tensor]:
    """Apply a random element of the network's symmetry group; returns a new state_dict.

    Permutations are uniform (block-structured around grouped convolutions); every
    scalable unit gets a log-uniform scale in ``scale_range``; the output biases are
    shifted by a standard normal constant; with ``signs``, every unit an odd activation
    lets flip gets a uniformly random sign. ``batchnorm_prescale=False`` leaves out the
    scalings a normalization layer absorbs: a BatchNorm's running statistics (exact too:
    the running variance becomes ``lambda**2 * (var + eps) - eps``) and an FRN (exact
    but for its eps, see :mod:`posteriorzoo.symmetry.structure`).
    """
    _require_finite(state_dict)
    structure = symmetry_structure(model_or_name, state_dict, **options)
    if seed < 0:
        raise InvalidOptionError(f"seed must be a non-negative integer, not {seed}")
    if not 0 < scale_range[0] <= scale_range[1]:
        raise InvalidOptionError(f"scale_range must be (low, high) with 0 < low <= high, "
                                 f"not {scale_range}")
    rng = np.random.default_rng(seed)
    low, high = np.log(scale_range[0]), np.log(scale_range[1])
    scales = {index: np.exp(rng.uniform(low, high, structure.spaces[
        structure.scales[index].space].size))
        for index in structure.scalable()
        if batchnorm_prescale or not structure.scales[index].through_batchnorm}
    permutations = sample_permutations(structure, rng)
    shift = float(rng.standard_normal()) if softmax else 0.0
    flips = sample_signs(structure, rng) if signs else {}  # drawn last: old seeds still hold
    return apply_symmetry(state_dict, structure, permutations, scales, shift, flips)
