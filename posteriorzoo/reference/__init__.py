"""The reference zoo shipped with the package: OptuNet on Fashion-MNIST.

Two collections, produced by the mass trainer from the specs in the repository's
``specs/`` folder (the exact commands are in data_card.md):

- ``"target"``: 1,000 independently trained checkpoints (the target posterior);
- ``"de"``: 100 further ones (a Deep Ensemble, disjoint from the target).

>>> from posteriorzoo.reference import open_reference
>>> with open_reference("target") as zoo:
...     conv2 = zoo.layer("conv2.weight")       # (1000, 10, 1, 5, 5)
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from posteriorzoo._api import public
from posteriorzoo.errors import UnknownNameError, ZooFormatError
from posteriorzoo.zoo import Zoo, open_zoo

COLLECTIONS = {
    "target": "optunet-fashion-mnist-target.h5",
    "de": "optunet-fashion-mnist-de.h5",
}
__all__ = ["COLLECTIONS", "SPECS", "open_reference", "reference_path"]

SPECS = {
    "target": "specs/optunet-fashion-mnist-target.toml",
    "de": "specs/optunet-fashion-mnist-de.toml",
}


@public
def reference_path(name: str = "target") -> Path:
    """Path of a shipped reference collection (``"target"`` or ``"de"``)."""
    if name not in COLLECTIONS:
        raise UnknownNameError(
            f"unknown reference collection {name!r}; shipped: {', '.join(COLLECTIONS)}")
    path = Path(str(resources.files(__name__).joinpath(COLLECTIONS[name])))
    if not path.is_file():
        raise ZooFormatError(
            f"the reference collection {name!r} is not in this installation ({path}); "
            f"train it with: posteriorzoo train {SPECS[name]} --out {path}")
    return path


@public
def open_reference(name: str = "target") -> Zoo:
    """Open a shipped reference collection read-only."""
    return open_zoo(reference_path(name))
