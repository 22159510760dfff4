"""Zoo specifications: what collection to train, read from TOML.

A spec names the architecture, dataset, method, number of checkpoints, base seed and
recipe of one collection::

    name = "optunet-fashion-mnist-target"
    recipe = "optunet-mnist"          # a built-in recipe (train_zoo.recipes)
    dataset = "fashion-mnist"         # overrides the recipe's dataset
    method = "de"                     # "de" (independent training) or "mc-dropout"
    checkpoints = 1000
    base_seed = 0

    [recipe_overrides]                # any Recipe field
    epochs = 10                       # milestones are scaled unless given

    [model_options]                   # options of posteriorzoo.models.build
    dropout = 0.0

Checkpoint ``i``'s randomness derives only from ``(base_seed, i)``: see :mod:`train_zoo.seeds`.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posteriorzoo.errors import (
    InvalidOptionError,
    PosteriorZooError,
    UnknownNameError,
    ZooFormatError,
)
from posteriorzoo.zoo.schema import recipe_hash
from train_zoo.recipes import (
    Recipe,
    apply_overrides,
    check_integer,
    check_name,
    check_table,
    get_recipe,
    show,
)

#: Methods the trainer implements, and the model options each implies by default.
METHODS: dict[str, dict[str, float]] = {
    "de": {},
    "mc-dropout": {"dropout": 0.2},
}
_SPEC_KEYS = {"name", "recipe", "architecture", "dataset", "method", "checkpoints",
              "base_seed", "num_classes", "data_dir", "recipe_overrides", "model_options"}


@dataclass(frozen=True)
class ZooSpec:
    """One collection to train.

    Attributes
    ----------
    name : str
        A label recorded with the collection.
    recipe : Recipe
        The training recipe (after overrides).
    architecture, dataset : str
        Model and data set names (default: the recipe's).
    method : str
        ``"de"``: independently trained networks (deep-ensemble members, or the target
        posterior); ``"mc-dropout"``: the same with dropout before the last layer.
    checkpoints : int
        Number of checkpoints N; checkpoint indices are 0..N-1.
    base_seed : int
        Root of every seed (see :func:`train_zoo.seeds.checkpoint_seeds`).
    num_classes : int or None
        Output size (default: the model's).
    model_options : dict
        Options of ``posteriorzoo.models.build``.
    data_dir : str or None
        Folder searched first for the dataset files.
    """

    name: str
    recipe: Recipe
    architecture: str
    dataset: str
    method: str = "de"
    checkpoints: int = 1
    base_seed: int = 0
    num_classes: int | None = None
    model_options: Mapping[str, Any] = field(default_factory=dict)
    data_dir: str | None = None

    def __post_init__(self) -> None:
        # Every field is checked here, so a bad spec fails before anything is created.
        check_name(_field("name"), self.name)
        if not isinstance(self.recipe, Recipe):
            raise InvalidOptionError(
                f"spec field 'recipe' must be a Recipe, not {show(self.recipe)}")
        check_name(_field("architecture"), self.architecture)
        check_name(_field("dataset"), self.dataset)
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise UnknownNameError(
                f"unknown method {show(self.method)}; the trainer implements "
                f"{', '.join(METHODS)}")
        check_integer(_field("checkpoints"), self.checkpoints, 1)
        check_integer(_field("base_seed"), self.base_seed, 0)
        if self.num_classes is not None:
            check_integer(_field("num_classes"), self.num_classes, 1)
        if self.data_dir is not None:
            if not isinstance(self.data_dir, str | os.PathLike):
                raise InvalidOptionError(
                    f"spec field 'data_dir' must be a folder path, not {show(self.data_dir)}")
            object.__setattr__(self, "data_dir", os.fspath(self.data_dir) or None)
        own = check_table(_field("model_options"), self.model_options)
        options = {**METHODS[self.method], **self.recipe.model_options, **own}
        object.__setattr__(self, "model_options", options)

    def collection_recipe(self) -> dict[str, Any]:
        """What the collection file records as its recipe (everything that shapes weights)."""
        return {**self.recipe.to_dict(), "name": self.name, "base_seed": self.base_seed,
                "method": self.method, "architecture": self.architecture,
                "dataset": self.dataset, "num_classes": self.num_classes,
                "model_options": dict(self.model_options)}

    @property
    def recipe_hash(self) -> str:
        """SHA-256 of everything that shapes the weights (the recipe without the name)."""
        recipe = self.collection_recipe()
        recipe.pop("name")
        return recipe_hash(recipe)

    def replace(self, **changes: Any) -> ZooSpec:
        """A copy with fields changed (``recipe`` overrides go through ``recipe=``)."""
        return dataclasses.replace(self, **changes)


def make_spec(recipe: str | Recipe = "optunet-mnist", *, name: str | None = None,
              recipe_overrides: Mapping[str, Any] | None = None, **fields: Any) -> ZooSpec:
    """Build a spec in code: a recipe (name or object), its overrides, and spec fields.

    Every value is checked (type and range): a bad one raises a
    :class:`~posteriorzoo.errors.PosteriorZooError` whose message names the field.
    """
    allowed = {f.name for f in dataclasses.fields(ZooSpec)} - {"name", "recipe"}
    unknown = set(fields) - allowed
    if unknown:
        raise UnknownNameError(
            f"unknown spec field(s) {sorted(unknown)}; fields: {', '.join(sorted(allowed))}")
    if name is not None and not isinstance(name, str):
        raise InvalidOptionError(f"spec field 'name' must be a string, not {show(name)}")
    for key in ("architecture", "dataset"):
        if key in fields:
            check_name(_field(key), fields[key])
    overrides = check_table("spec field 'recipe_overrides'",
                            {} if recipe_overrides is None else recipe_overrides)
    if isinstance(recipe, str):
        recipe_name = recipe
        recipe = get_recipe(recipe, **overrides)
    elif isinstance(recipe, Recipe):
        recipe_name = "custom"
        recipe = apply_overrides(recipe, overrides)
    else:
        raise InvalidOptionError(
            f"spec field 'recipe' must be a recipe name or a Recipe, not {show(recipe)}")
    fields.setdefault("architecture", recipe.architecture)
    fields.setdefault("dataset", recipe.dataset)
    recipe = dataclasses.replace(recipe, architecture=fields["architecture"],
                                 dataset=fields["dataset"])
    return ZooSpec(name=name or f"{recipe_name}-{fields['dataset']}", recipe=recipe, **fields)


def load_spec(path: str | os.PathLike) -> ZooSpec:
    """Read a TOML zoo spec (format in the module docstring).

    Raises a :class:`~posteriorzoo.errors.PosteriorZooError` (one line that starts with
    the path and names the offending key) for a missing, unreadable, non-UTF-8 or
    malformed file and for any value of the wrong type or out of range.
    """
    path = Path(path)
    if path.is_dir():
        raise ZooFormatError(f"{path}: is a folder, not a spec file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ZooFormatError(f"{path}: no such spec file") from None
    except OSError as error:
        raise ZooFormatError(
            f"{path}: cannot read the spec file: {error.strerror or error}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ZooFormatError(f"{path}: not a UTF-8 text file (undecodable byte at offset "
                             f"{error.start})") from None
    except tomllib.TOMLDecodeError as error:
        raise ZooFormatError(f"{path}: not valid TOML: {error}") from None
    unknown = set(data) - _SPEC_KEYS
    if unknown:
        raise UnknownNameError(
            f"{path}: unknown spec key(s) {sorted(unknown)}; keys: {', '.join(sorted(_SPEC_KEYS))}")
    if "recipe" not in data:
        raise ZooFormatError(f"{path}: the spec needs a recipe, e.g. recipe = \"optunet-mnist\"")
    data = dict(data)
    recipe = data.pop("recipe")
    try:
        if not isinstance(recipe, str):
            raise UnknownNameError(f"spec field 'recipe' must be the name of a built-in recipe, "
                                   f"not {show(recipe)}")
        data.setdefault("name", path.stem)
        data_dir = data.get("data_dir")
        if data_dir is not None and not isinstance(data_dir, str):
            raise InvalidOptionError(
                f"spec field 'data_dir' must be a folder path, not {show(data_dir)}")
        if data_dir:
            data["data_dir"] = str((path.parent / data_dir).resolve())
        return make_spec(recipe, **data)
    except PosteriorZooError as error:
        raise type(error)(f"{path}: {error}") from None


def _field(name: str) -> str:
    return f"spec field {name!r}"
