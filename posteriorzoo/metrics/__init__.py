"""Predictive metrics of ensembles of checkpoints (accuracy, ECE, Brier, OOD detection).

Not implemented yet.
"""
