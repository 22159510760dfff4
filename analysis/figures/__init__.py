"""The paper's figures as a small library (drawn by ``posteriorzoo plot`` too).

Three layers, each readable on its own:

- :mod:`analysis.figures.statistics`: the numbers printed on the figures, from arrays
  (KS p-values between units, Pearson's r, PCA explained variance);
- :mod:`analysis.figures.draw`: one function per figure, plain arrays in, a
  :class:`matplotlib.figure.Figure` out (object-oriented API, no pyplot);
- :mod:`analysis.figures.save`: PNG and PDF written atomically, PNG as base64 for HTML;

and :mod:`analysis.figures.sources`, which reads the figures' data from collection files
through the collection layer.

>>> from analysis.figures import marginals_figure, save_figure
>>> from posteriorzoo.zoo import open_zoo
>>> with open_zoo("target.h5") as zoo:
...     layers = {key: zoo.layer(key) for key in ("conv2.weight",)}   # (N, 10, 1, 5, 5)
>>> save_figure(marginals_figure(layers), "conv2-marginals")   # .png and .pdf
"""

from analysis.figures.draw import (
    collapse_figure,
    marginals_figure,
    mass_figure,
    mmd_figure,
    pca_figure,
)
from analysis.figures.save import figure_paths, png_base64, save_figure
from analysis.figures.statistics import (
    gram_explained_variance,
    ks_summary,
    pca_explained_variance,
    pearson,
    unit_ks_pvalues,
    unit_marginals,
)

__all__ = ["collapse_figure", "figure_paths", "gram_explained_variance", "ks_summary",
           "marginals_figure", "mass_figure", "mmd_figure", "pca_explained_variance",
           "pca_figure", "pearson", "png_base64", "save_figure",
           "unit_ks_pvalues", "unit_marginals"]
