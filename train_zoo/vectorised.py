"""Many small models trained in lockstep (torch.func over stacked parameters). Placeholder."""

from __future__ import annotations

from collections.abc import Sequence

from train_zoo.data import TrainingData
from train_zoo.result import CheckpointResult
from train_zoo.spec import ZooSpec


def supports(spec: ZooSpec) -> bool:
    """Whether ``spec`` can be trained by the vectorised engine."""
    return False


def train_vectorised(spec: ZooSpec, indices: Sequence[int],
                     data: TrainingData) -> list[CheckpointResult]:
    raise NotImplementedError
