"""numpy <-> torch: one conversion for the whole package (dtypes and arrays)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from posteriorzoo.errors import ZooSchemaError

ArrayLike = torch.Tensor | np.ndarray


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch dtype (bfloat16 has none: ZooSchemaError)."""
    if dtype == torch.bfloat16:
        raise ZooSchemaError("bfloat16 tensors are not supported; convert to float32")
    return _numpy_dtype(dtype)


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def torch_dtype(dtype: np.dtype | str) -> torch.dtype:
    """The torch dtype of a numpy dtype."""
    return torch.from_numpy(np.empty(0, np.dtype(dtype))).dtype


def as_numpy(value: ArrayLike) -> np.ndarray:
    """A tensor or array as a numpy array (tensors are detached and moved to the CPU)."""
    if isinstance(value, torch.Tensor):
        numpy_dtype(value.dtype)  # refuses bfloat16
        return value.detach().cpu().numpy()
    return np.asarray(value)
