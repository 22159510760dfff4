"""The mass trainer: zoo specifications, recipes, engines and backends.

>>> from train_zoo import load_spec
>>> from train_zoo.backends import LocalBackend
>>> from train_zoo.run import train_collection
>>> spec = load_spec("specs/optunet-fashion-mnist-target.toml")
>>> train_collection(spec, "target.h5", backend=LocalBackend(workers=2))   # resumable

Checkpoint i's randomness derives only from (spec.base_seed, i) (:mod:`train_zoo.seeds`).
"""

from train_zoo.job import ENGINES, resolve_engine, train_checkpoints
from train_zoo.recipes import BUILTIN_RECIPES, Recipe, get_recipe
from train_zoo.result import CheckpointResult
from train_zoo.seeds import CheckpointSeeds, checkpoint_seeds
from train_zoo.spec import ZooSpec, load_spec, make_spec

__all__ = [
    "BUILTIN_RECIPES",
    "ENGINES",
    "CheckpointResult",
    "CheckpointSeeds",
    "Recipe",
    "ZooSpec",
    "checkpoint_seeds",
    "get_recipe",
    "load_spec",
    "make_spec",
    "resolve_engine",
    "train_checkpoints",
]
