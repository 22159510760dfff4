"""The report, figures and studies (the paper's Table 1 and figures): not written yet.

This package holds no code today. The Table-2 MMD reports already exist
(:func:`posteriorzoo.collection.compare`, ``posteriorzoo mmd``); the benchmark report, the
paper's figures and the seeds' studies will be built here on the collection layer
(:mod:`posteriorzoo.collection`).
"""
