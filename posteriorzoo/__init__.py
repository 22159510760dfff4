"""posteriorzoo: Bayesian neural network posteriors through large collections of checkpoints.

Subpackages, one per concept:

- :mod:`posteriorzoo.data`: datasets by name (IDX reader, downloads with SHA-256, transforms)
- :mod:`posteriorzoo.models`: the model registry (``build("optunet")``)
- :mod:`posteriorzoo.zoo`: the HDF5 checkpoint store
- :mod:`posteriorzoo.hub`: Hugging Face Hub download and upload
- :mod:`posteriorzoo.symmetry`, :mod:`posteriorzoo.mmd`, :mod:`posteriorzoo.metrics`
"""

from posteriorzoo.errors import PosteriorZooError

__version__ = "0.1.0"

__all__ = ["PosteriorZooError", "__version__"]
