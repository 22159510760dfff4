"""The report, the paper's figures and the studies, built on the collection layer.

- :mod:`analysis.report`: the benchmark report (``posteriorzoo report``): Table 1 with the
  MMD noise floor, the Table 2 detail, the figures, one HTML page;
- :mod:`analysis.figures`: the paper's figures as functions of arrays, and the data
  loading of ``posteriorzoo plot``;
- :mod:`analysis.studies`: the studies that need runs of their own (``posteriorzoo
  study toy|permutation-stability``).
"""
