"""Per-checkpoint seeds: everything random about checkpoint i derives from (base seed, i).

``numpy.random.SeedSequence([base_seed, index])`` yields three independent 32-bit words:
the initialisation seed, the data seed (order and augmentation, through
:func:`posteriorzoo.data.iterate_batches`) and the noise seed (dropout masks, sampling).
Training checkpoint i alone, in any batch, on any worker, therefore gives the same
weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CheckpointSeeds:
    """The three seeds of one checkpoint (each in 0 .. 2**32 - 1)."""

    init: int
    data: int
    noise: int


def checkpoint_seeds(base_seed: int, index: int) -> CheckpointSeeds:
    """Seeds of checkpoint ``index`` of a collection with ``base_seed``."""
    if base_seed < 0 or index < 0:
        raise ValueError(f"base_seed and index must be non-negative, got {base_seed}, {index}")
    init, data, noise = np.random.SeedSequence([base_seed, index]).generate_state(3, np.uint32)
    return CheckpointSeeds(int(init), int(data), int(noise))
