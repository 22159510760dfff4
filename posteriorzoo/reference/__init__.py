"""The reference zoo shipped with the package: OptuNet on Fashion-MNIST.

Twenty-six collections, produced by the mass trainer from the specs in the repository's
``specs/`` folder with the paper's 60-epoch OptuNet recipe (the exact commands and times
are in data_card.md):

- ``"target"``: 1,000 independently trained checkpoints (the target posterior);
- ``"de"``: 100 further ones (a Deep Ensemble, disjoint from the target);
- the single-mode method collections ``"mc-dropout"``, ``"bbb"``, ``"bbb-trained-variance"``,
  ``"swag"``, ``"laplace"`` and ``"sghmc"``: 100 samples around one base network (SGHMC:
  four chains of 25 from it);
- ``"laplace-kfac"``, ``"laplace-diag"`` and ``"laplace-last-layer"``: the Laplace
  approximation's other curvature structures (KFAC over all layers, the GGN's diagonal,
  KFAC of the last layer), at the same base network as ``"laplace"`` (full GGN), so the
  four differ only by the structure;
- ``"ivon"``: 100 draws of one IVON posterior (the ivon-opt optimiser);
- ``"csgld"`` and ``"csghmc"``: cyclical SG-MCMC, one run of 10 cycles from the
  initialisation, 10 samples at the end of each cycle (a single run through several
  modes, so no multi-mode version);
- ``"svgd"``: 100 SVGD particles moved together from their own initialisations (one run,
  BlackJAX's median bandwidth); measured to sit in as many modes as a Deep Ensemble's
  members, so it is annotated multi-mode (``posteriorzoo annotate``; data_card.md);
- the seeds' variants ``"emp"``, ``"ecmp"`` (Ensemble Model Patching, per layer and per
  element) and ``"rank-1"`` (a rank-1 BNN): 100 draws of one trained network, each folded
  into an OptuNet checkpoint;
- the multi-mode ones ``"mc-dropout-multi-mode"``, ``"bbb-multi-mode"``,
  ``"bbb-trained-variance-multi-mode"``, ``"swag-multi-mode"``, ``"laplace-multi-mode"``,
  ``"laplace-kfac-multi-mode"``, ``"laplace-diag-multi-mode"`` (the three at the same ten
  base networks) and ``"ivon-multi-mode"``: 10 samples around each of 10 base networks
  (IVON: of 10 independent runs).

``"bbb"`` uses the paper's settings (its sigma never leaves its initial value; the
paper's Table 1), ``"bbb-trained-variance"`` the preset whose sigma trains (the
``preset`` in the recipe's method options, and the file name, tell them apart; the
``method`` attribute of both is ``bbb``).

Every sample is an ordinary OptuNet checkpoint, so all collections compare alike.

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

#: The method collections in the order of the paper's Table 1 (single-, then multi-mode;
#: the seeds' variants after the paper's single-mode methods; SVGD, one run measured
#: multi-mode, last).
METHOD_COLLECTIONS = ("mc-dropout", "bbb", "bbb-trained-variance", "swag", "laplace",
                      "laplace-kfac", "laplace-diag", "laplace-last-layer", "sghmc",
                      "ivon", "csgld", "csghmc", "emp", "ecmp", "rank-1",
                      "mc-dropout-multi-mode", "bbb-multi-mode",
                      "bbb-trained-variance-multi-mode", "swag-multi-mode",
                      "laplace-multi-mode", "laplace-kfac-multi-mode",
                      "laplace-diag-multi-mode", "ivon-multi-mode", "svgd")
#: Name -> file name of every shipped collection.
COLLECTIONS = {name: f"optunet-fashion-mnist-{name}.h5"
               for name in ("target", "de", *METHOD_COLLECTIONS)}
#: Name -> the spec that produced it, relative to the repository root.
SPECS = {name: f"specs/optunet-fashion-mnist-{name}.toml" for name in COLLECTIONS}
__all__ = ["COLLECTIONS", "METHOD_COLLECTIONS", "SPECS", "open_reference", "reference_path"]


@public
def reference_path(name: str = "target") -> Path:
    """Path of a shipped reference collection (a name of :data:`COLLECTIONS`)."""
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
