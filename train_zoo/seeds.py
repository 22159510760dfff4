"""Per-mode seeds: everything random about mode i derives from (base seed, i).

``numpy.random.SeedSequence([base_seed, index])`` yields five independent 32-bit words:

- ``init``: the base network's initial weights (BBB: the initial variational state);
- ``data``: its training batches' order and augmentation (through
  :func:`posteriorzoo.data.iterate_batches`);
- ``noise``: dropout masks during training (BBB: the ELBO's weight noise);
- ``method``: the batches of a method's own phase (SWAG's continued training, the SGHMC
  chain, BatchNorm recomputation);
- ``sample``: the draws around the mode (dropout masks, Gaussian draws; the SGHMC chain's
  injected noise).

A Deep-Ensemble member is a mode with one sample, so checkpoint i of a DE collection uses
the first three words exactly as before the method words were added (a SeedSequence's
first words do not depend on how many are drawn). Training mode i alone, in any batch, on
any worker, therefore gives the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CheckpointSeeds:
    """The seeds of one mode (each in 0 .. 2**32 - 1); see the module docstring."""

    init: int
    data: int
    noise: int
    method: int
    sample: int


def checkpoint_seeds(base_seed: int, index: int) -> CheckpointSeeds:
    """Seeds of mode ``index`` of a collection with ``base_seed``."""
    if base_seed < 0 or index < 0:
        raise ValueError(f"base_seed and index must be non-negative, got {base_seed}, {index}")
    words = np.random.SeedSequence([base_seed, index]).generate_state(5, np.uint32)
    return CheckpointSeeds(*(int(word) for word in words))
