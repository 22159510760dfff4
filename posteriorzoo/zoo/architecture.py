"""Does a collection's tensor layout fit its registered architecture?"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from posteriorzoo.dtypes import torch_dtype


def check_architecture(architecture: str,
                       tensor_layout: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                       num_classes: int | None, model_options: Mapping[str, Any]) -> None:
    """Raise unless ``tensor_layout`` (key -> (shape, dtype)) fits the registered architecture."""
    from posteriorzoo import models

    meta = {key: torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
            for key, (shape, dtype) in tensor_layout.items()}
    models.check_state_dict(architecture, meta, num_classes=num_classes, **model_options)
