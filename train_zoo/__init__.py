"""The mass trainer: zoo specifications, recipes, methods, backends, fast paths.

Issue 3 grows this package; for now it holds :func:`train_classifier`, the plain torch
training loop of one checkpoint, used by ``posteriorzoo demo``.
"""

from train_zoo.loop import TrainResult, evaluate, train_classifier

__all__ = ["TrainResult", "evaluate", "train_classifier"]
