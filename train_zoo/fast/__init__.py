"""Fast path for small networks on CPU (numba). Placeholder until implemented."""

from __future__ import annotations

from collections.abc import Sequence

from train_zoo.data import TrainingData
from train_zoo.result import CheckpointResult
from train_zoo.spec import ZooSpec


def supports(spec: ZooSpec) -> bool:
    """Whether the fast path can train ``spec`` exactly as the torch engine would."""
    return False


def train_fast(spec: ZooSpec, index: int, data: TrainingData,
               callbacks: Sequence[object] = ()) -> CheckpointResult:
    raise NotImplementedError
