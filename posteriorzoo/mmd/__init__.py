"""Aggregated MMD between collections of checkpoints, layer by layer.

Not implemented yet.
"""
