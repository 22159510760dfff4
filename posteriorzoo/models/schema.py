"""State-dict schemas: what a checkpoint of a given architecture must contain.

The HDF5 zoo store checks every incoming checkpoint against these, so they are
derived from a model built on the ``meta`` device: exact keys, shapes and
dtypes (including BatchNorm buffers) without allocating or initialising weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from posteriorzoo._api import public
from posteriorzoo.errors import ZooSchemaError
from posteriorzoo.models import registry

__all__ = ["check_state_dict", "expected_state_shapes", "parameter_count"]

StateShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _freeze(value: Any) -> Any:
    """Hashable stand-in for an option value (lists -> tuples) for the cache key."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@lru_cache(maxsize=64)
def _meta_summary(
    name: str, num_classes: int | None, frozen: tuple[tuple[str, Any], ...], dtype: torch.dtype
) -> tuple[tuple[tuple[str, tuple[int, ...], torch.dtype], ...], int]:
    # Cached because the zoo store validates thousands of checkpoints of the
    # same architecture; the default dtype is part of the key since it sets
    # the parameters' dtype.
    with torch.device("meta"):
        model = registry.build(name, num_classes, **dict(frozen))
    entries = tuple(
        (key, tuple(tensor.shape), tensor.dtype) for key, tensor in model.state_dict().items()
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return entries, trainable


# A re-registered name must not be answered from a stale cache entry.
registry._ON_CHANGE.append(_meta_summary.cache_clear)


def _summary(
    name: str, num_classes: int | None, options: Mapping[str, Any]
) -> tuple[tuple[tuple[str, tuple[int, ...], torch.dtype], ...], int]:
    # Resolving first raises UnknownNameError early and makes equivalent calls
    # (defaults given explicitly or not) share one cache entry.
    _, n_out, merged = registry.resolve(name, num_classes, options)
    frozen = tuple(sorted((k, _freeze(v)) for k, v in merged.items()))
    try:
        return _meta_summary(name, n_out, frozen, torch.get_default_dtype())
    except TypeError:  # an unhashable option value: compute without caching
        return _meta_summary.__wrapped__(name, n_out, frozen, torch.get_default_dtype())


@public
def expected_state_shapes(name: str, num_classes: int | None = None, **options: Any) -> StateShapes:
    """Keys, shapes and dtypes of the state_dict of ``build(name, num_classes, **options)``.

    Computed on the ``meta`` device: no weights are allocated and torch's
    random generator is not advanced.

    Parameters
    ----------
    name : str
        Registered model name.
    num_classes : int, optional
        Number of outputs (defaults to the spec's).
    **options
        Architecture options.

    Returns
    -------
    dict[str, tuple[tuple[int, ...], torch.dtype]]
        ``key -> (shape, dtype)`` in state_dict order, BatchNorm buffers
        included (``running_mean``, ``running_var``: ``(C,)`` float;
        ``num_batches_tracked``: ``()`` int64).

    Raises
    ------
    UnknownNameError
        Unknown model name or option name.
    """
    entries, _ = _summary(name, num_classes, options)
    return {key: (shape, dtype) for key, shape, dtype in entries}


@public
def parameter_count(name: str, num_classes: int | None = None, **options: Any) -> int:
    """Number of trainable parameters (BatchNorm buffers excluded).

    Returns
    -------
    int
        E.g. 392 for ``"optunet"``, 11,220,132 for ``"resnet18"`` with 100 classes.

    Raises
    ------
    UnknownNameError
        Unknown model name or option name.
    """
    _, trainable = _summary(name, num_classes, options)
    return trainable


def _shape_of(key: str, value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", None)
    if shape is None:
        raise ZooSchemaError(f"state_dict entry {key!r} has no shape (got {type(value).__name__})")
    return tuple(int(d) for d in shape)


def _dtype_of(value: Any) -> torch.dtype:
    if isinstance(value, torch.Tensor):
        return value.dtype
    # numpy arrays and h5py datasets: map the numpy dtype through torch.
    return torch.from_numpy(np.empty(0, dtype=np.dtype(value.dtype))).dtype


@public
def check_state_dict(
    name: str,
    state_dict: Mapping[str, Any],
    num_classes: int | None = None,
    *,
    check_dtypes: bool = False,
    **options: Any,
) -> None:
    """Raise :class:`ZooSchemaError` unless ``state_dict`` fits the architecture.

    Checks, in this order: every expected key is present and no unexpected key is
    (both named at once), every shape matches.

    Parameters
    ----------
    name : str
        Registered model name.
    state_dict : Mapping[str, array-like]
        Values may be torch tensors, numpy arrays or anything with ``.shape``
        (and ``.dtype`` when ``check_dtypes``), e.g. h5py datasets.
    num_classes : int, optional
        Number of outputs (defaults to the spec's).
    check_dtypes : bool, default False
        Also require the exact dtypes of a freshly built model. Off by default
        because zoos legitimately store weights in float16 (the authors'
        release does).
    **options
        Architecture options.

    Raises
    ------
    ZooSchemaError
        Naming the first missing and the first unexpected key (with how many more),
        else the first shape (or dtype) mismatch with expected and actual values.
    UnknownNameError
        Unknown model name or option name.
    """
    expected = expected_state_shapes(name, num_classes, **options)
    what = f"state_dict does not fit model {name!r}"
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    if missing or unexpected:
        # Both sides, so a renamed key shows as what it is ('model.conv1.weight' where
        # 'conv1.weight' is missing): what a key map would have to rename.
        parts = [f"{kind} key {keys[0]!r}" + (f" (and {len(keys) - 1} more)"
                                              if len(keys) > 1 else "")
                 for kind, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise ZooSchemaError(f"{what}: {'; '.join(parts)}")
    for key, (shape, dtype) in expected.items():
        value = state_dict[key]
        got = _shape_of(key, value)
        if got != shape:
            raise ZooSchemaError(f"{what}: {key!r} has shape {got}, expected {shape}")
        if check_dtypes and (got_dtype := _dtype_of(value)) != dtype:
            raise ZooSchemaError(f"{what}: {key!r} has dtype {got_dtype}, expected {dtype}")
