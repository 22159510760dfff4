"""Does a collection's tensor layout fit its registered architecture?"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from posteriorzoo.dtypes import torch_dtype
from posteriorzoo.errors import ZooSchemaError
from posteriorzoo.zoo.layout import tensor_dtype_problem


def check_tensor_dtypes(tensor_layout: Mapping[str, tuple[tuple[int, ...], np.dtype]]
                        ) -> None:
    """Raise :class:`ZooSchemaError` naming the first key whose dtype a collection cannot
    hold (:func:`~posteriorzoo.zoo.layout.tensor_dtype_problem`): checked before a new
    collection is written, whether or not its architecture is checked too."""
    for key, (_, dtype) in tensor_layout.items():
        problem = tensor_dtype_problem(np.dtype(dtype))
        if problem:
            raise ZooSchemaError(f"{key!r} has dtype {np.dtype(dtype)} ({problem})")


def check_architecture(architecture: str,
                       tensor_layout: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                       num_classes: int | None, model_options: Mapping[str, Any]) -> None:
    """Raise unless ``tensor_layout`` (key -> (shape, dtype)) fits the registered architecture.

    Keys and shapes must be the model's; each dtype must be a number a collection stores
    (:func:`~posteriorzoo.zoo.layout.tensor_dtype_problem`) of the model's kind: floating
    point where the model has floating point (any width: releases store float16), integer
    where it has integers (BatchNorm's ``num_batches_tracked``). Raises
    :class:`ZooSchemaError` naming the first key that does not fit.
    """
    from posteriorzoo import models

    what = f"state_dict does not fit model {architecture!r}"
    check_tensor_dtypes(tensor_layout)
    meta = {key: torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
            for key, (shape, dtype) in tensor_layout.items()}
    models.check_state_dict(architecture, meta, num_classes=num_classes, **model_options)
    expected = models.expected_state_shapes(architecture, num_classes=num_classes,
                                            **model_options)
    for key, (_, dtype) in expected.items():
        stored = meta[key].dtype
        if stored.is_floating_point != dtype.is_floating_point:
            kind = "floating point" if dtype.is_floating_point else "integer"
            raise ZooSchemaError(f"{what}: {key!r} has dtype {np.dtype(tensor_layout[key][1])}, "
                                 f"expected {kind} ({str(dtype).removeprefix('torch.')})")
