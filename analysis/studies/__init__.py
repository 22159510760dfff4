"""Studies that train their own networks, each with its figure (paper Fig. 1 and Fig. 4).

- :mod:`analysis.studies.toy`: the toy example (Fig. 1, appendix A): 10,000 2-2-1 ReLU
  perceptrons on two separable Gaussian blobs, trained at once, and the density of their
  output weights raw, rescaled and sorted (:func:`run_toy_study`).
- :mod:`analysis.studies.permutation_stability`: Kendall's tau between successive sorting
  permutations during training (Fig. 4), through the mass trainer's callbacks
  (:func:`run_permutation_stability`).
- :mod:`analysis.studies.byov`: Bootstrap Your Own Variance (seed 004) at CPU size: BYOV
  under three priors against deterministic BYOL, linear-probe calibration with and
  without input noise, SNR against magnitude pruning (:func:`run_byov_study`; the
  numerical core is :mod:`train_zoo.byov`).

Each returns a result (a :class:`posteriorzoo.results.CollectionResult`) with
``to_dict()``, ``write(out)`` (JSON with provenance, CSV tables, the figure as PNG and
PDF) and ``figure()`` (a :class:`matplotlib.figure.Figure`). From the command line:
``posteriorzoo study toy|permutation-stability|byov --out DIR``. Heavy libraries (torch,
scipy, matplotlib) are imported by the functions that use them.
"""

from analysis.studies.byov import ByovStudyResult, run_byov_study
from analysis.studies.permutation_stability import (
    PermutationStabilityResult,
    kendall_tau,
    run_permutation_stability,
    sorting_permutations,
    successive_taus,
)
from analysis.studies.toy import (
    ToyStudyResult,
    make_blobs,
    remove_symmetries,
    rescale_direct,
    run_toy_study,
    sort_direct,
    train_networks,
)

__all__ = [
    "ByovStudyResult",
    "PermutationStabilityResult",
    "ToyStudyResult",
    "kendall_tau",
    "make_blobs",
    "remove_symmetries",
    "run_byov_study",
    "rescale_direct",
    "run_permutation_stability",
    "run_toy_study",
    "sort_direct",
    "sorting_permutations",
    "successive_taus",
    "train_networks",
]
