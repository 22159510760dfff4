"""Zoo specifications: what collection to train, read from TOML.

A spec names the architecture, dataset, method, modes and samples, base seed and recipe
of one collection::

    name = "optunet-fashion-mnist-swag-multi-mode"
    recipe = "optunet-mnist"          # a built-in recipe (train_zoo.recipes)
    dataset = "fashion-mnist"         # overrides the recipe's dataset
    architecture = "optunet"          # any registered model, one of your own too
    method = "swag"                   # a method of train_zoo.methods.registry
    modes = 10                        # independently trained base networks
    samples_per_mode = 10             # draws around each
    base_seed = 1

    [recipe_overrides]                # any Recipe field
    epochs = 10                       # milestones are scaled unless given

    [model_options]                   # options of posteriorzoo.models.build
    width = 16

    [method_options]                  # see train_zoo.method_options
    scale = 0.1

``checkpoints`` may be given instead of (or with) ``modes`` and ``samples_per_mode``: it is
their product. For ``de`` a mode is one network (``samples_per_mode = 1``, so
``checkpoints`` is the number of members); for the other methods ``checkpoints = N`` alone
means one mode with N samples. Mode ``i``'s randomness derives only from
``(base_seed, i)``: see :mod:`train_zoo.seeds`. The base networks of every method are
trained with the spec's recipe exactly as DE members are, so a method spec with the DE's
base seed builds around the DE's own members.

The architecture may be a model of your own, named like a built-in one (``architecture``
or ``recipe_overrides.architecture``): its plugin module must be loaded before the spec is
read (``posteriorzoo --models MODULE train ...``, :mod:`posteriorzoo.models.plugins`); for
``mc-dropout`` it needs a ``dropout`` option.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posteriorzoo._streams import read_small_file
from posteriorzoo.errors import (
    InvalidOptionError,
    PosteriorZooError,
    UnknownNameError,
    ZooFormatError,
)
from posteriorzoo.models import model_entry
from posteriorzoo.options import check_integer, check_name, check_table, show
from posteriorzoo.zoo.schema import recipe_hash
from train_zoo.method_options import explain_method_options
from train_zoo.methods.registry import get_method
from train_zoo.recipes import Recipe, apply_overrides, explain_overrides, get_recipe

#: The ranges of the spec's numbers. A collection's checkpoints (modes x samples per
#: mode): its metadata table and the list of missing modes are held in memory, and the
#: reference target has 1,000.
MAX_CHECKPOINTS = 1_000_000
#: Base seeds are words of numpy's SeedSequence; 2**32 distinct collections are plenty.
MAX_SEED = 2**32 - 1
#: Output classes: the last layer holds num_classes x features weights (ImageNet-21k has
#: 21,841 classes).
MAX_CLASSES = 100_000
#: Largest spec file, bytes. A spec is a short TOML file (the shipped ones are under 2 kB);
#: a larger one, or an endless one (``/dev/zero``, a pipe), is refused after reading at
#: most this much, before parsing.
MAX_SPEC_BYTES = 2**20

_SPEC_KEYS = {"name", "recipe", "architecture", "dataset", "method", "checkpoints", "modes",
              "samples_per_mode", "base_seed", "num_classes", "data_dir", "recipe_overrides",
              "model_options", "method_options"}


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
        A name of :mod:`train_zoo.methods.registry`. ``"de"``: independently trained
        networks (deep-ensemble members, or the target posterior); ``"mc-dropout"``,
        ``"swag"``, ``"laplace"``, ``"sghmc"``, ``"bbb"``: the method's samples around
        independently trained base networks (:mod:`train_zoo.programs`).
    checkpoints : int
        Number of checkpoints, ``modes * samples_per_mode``.
    modes : int
        Independently trained base networks (SGHMC: chains; BBB: variational fits),
        stored as ``mode_id`` 0 .. modes-1.
    samples_per_mode : int
        Draws around each mode, stored as ``sample_id``; 1 for ``de``.
    base_seed : int
        Root of every seed (see :func:`train_zoo.seeds.checkpoint_seeds`).
    num_classes : int or None
        Output size (default: the model's).
    model_options : dict
        Options of ``posteriorzoo.models.build`` for the stored checkpoints (the base
        architecture).
    method_options : dict
        The method's options, every default filled in (:mod:`train_zoo.method_options`).
    data_dir : str or None
        Folder searched first for the dataset files.
    sources : dict
        Not part of the spec's identity: where each value came from, ``{"recipe":
        {field: source}, "method_options": {option: source}}`` with ``"given"``,
        ``"default"`` or ``"derived from ..."`` (what ``train --dry-run`` shows).
    derived : tuple of str
        One line per default that differs from its usual value because the recipe is
        shorter or the model larger (scaled milestones, SWAG's iterates, Laplace's
        ``auto`` structure), e.g. ``swag: iterates 2 (derived from epochs=4; default 20
        at 60 epochs)``: what ``train`` says on stderr.
    """

    name: str
    recipe: Recipe
    architecture: str
    dataset: str
    method: str = "de"
    checkpoints: int | None = None
    base_seed: int = 0
    num_classes: int | None = None
    model_options: Mapping[str, Any] = field(default_factory=dict)
    data_dir: str | None = None
    modes: int | None = None
    samples_per_mode: int | None = None
    method_options: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, Mapping[str, str]] = field(
        default_factory=dict, init=False, compare=False, repr=False)
    derived: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Every field is checked here, so a bad spec fails before anything is created.
        check_name(_field("name"), self.name)
        if not isinstance(self.recipe, Recipe):
            raise InvalidOptionError(
                f"spec field 'recipe' must be a Recipe, not {show(self.recipe)}")
        check_name(_field("architecture"), self.architecture)
        # A model of your own must be registered (its plugin loaded) before its spec is
        # read: the error names the valid models and how to load one's own.
        entry = model_entry(self.architecture)
        check_name(_field("dataset"), self.dataset)
        method = get_method(self.method)
        self._resolve_counts()
        check_integer(_field("base_seed"), self.base_seed, 0, MAX_SEED)
        if self.num_classes is not None:
            check_integer(_field("num_classes"), self.num_classes, 1, MAX_CLASSES)
        if self.data_dir is not None:
            if not isinstance(self.data_dir, str | os.PathLike):
                raise InvalidOptionError(
                    f"spec field 'data_dir' must be a folder path, not {show(self.data_dir)}")
            object.__setattr__(self, "data_dir", os.fspath(self.data_dir) or None)
        own = check_table(_field("model_options"), self.model_options)
        object.__setattr__(self, "model_options", {**self.recipe.model_options, **own})
        method.check_model(self.architecture, self.model_options, tuple(entry.options))
        method_options = check_table(_field("method_options"), self.method_options)
        explained = explain_method_options(
            self.method, method_options, self.architecture, self.recipe,
            model_options=self.model_options, num_classes=self.num_classes,
            samples_per_mode=self.samples_per_mode)
        object.__setattr__(self, "method_options", explained.values)
        object.__setattr__(self, "sources", {"method_options": explained.sources})
        object.__setattr__(self, "derived", explained.notes)
        chains = self.method_options.get("chains", 1)
        if self.samples_per_mode % chains:
            raise InvalidOptionError(
                f"spec field 'samples_per_mode' ({self.samples_per_mode}) must be a multiple "
                f"of the {self.method} option 'chains' ({chains})")

    def _resolve_counts(self) -> None:
        """Fill in whichever of checkpoints, modes and samples_per_mode is missing."""
        total, modes, per_mode = self.checkpoints, self.modes, self.samples_per_mode
        one_each = get_method(self.method).one_sample_per_mode  # a mode is one network
        for name, value in (("checkpoints", total), ("modes", modes),
                            ("samples_per_mode", per_mode)):
            if value is not None:
                check_integer(_field(name), value, 1, MAX_CHECKPOINTS)
        if modes is None and per_mode is None:
            total = 1 if total is None else total
            modes, per_mode = (total, 1) if one_each else (1, total)
        elif per_mode is None and modes is not None:
            if total is None and not one_each:
                raise InvalidOptionError(f"spec field 'samples_per_mode' is needed with "
                                         f"'modes' for the method {self.method}")
            per_mode = 1 if total is None else total // modes
        elif modes is None and per_mode is not None:
            modes = 1 if total is None else total // per_mode
        if modes is None or per_mode is None:  # each branch above set both
            raise AssertionError("spec counts left unresolved")
        if one_each and per_mode != 1:
            raise InvalidOptionError("spec field 'samples_per_mode' must be 1 for the method "
                                     f"{self.method} (each member is its own mode)")
        if total is not None and total != modes * per_mode:
            raise InvalidOptionError(
                f"spec field 'checkpoints' ({total}) must be modes x samples_per_mode "
                f"({modes} x {per_mode})")
        if modes * per_mode > MAX_CHECKPOINTS:
            raise InvalidOptionError(
                f"spec fields 'modes' x 'samples_per_mode' ({modes} x {per_mode}) must be at "
                f"most {MAX_CHECKPOINTS} checkpoints")
        for name, value in (("checkpoints", modes * per_mode), ("modes", modes),
                            ("samples_per_mode", per_mode)):
            object.__setattr__(self, name, value)

    def counts(self) -> tuple[int, int]:
        """``(modes, samples_per_mode)`` as ints. Construction resolves both (the fields
        accept ``None`` only as "derive me"), so callers need not check for ``None``."""
        if self.modes is None or self.samples_per_mode is None:
            raise AssertionError("a ZooSpec resolves modes and samples_per_mode on creation")
        return self.modes, self.samples_per_mode

    @property
    def training_model_options(self) -> dict[str, Any]:
        """The options base networks are trained with: the stored architecture's, plus
        MC Dropout's dropout layer."""
        return get_method(self.method).training_model_options(self.model_options,
                                                              self.method_options)

    def collection_recipe(self, num_data: int | None = None) -> dict[str, Any]:
        """What the collection file records as its recipe (everything that shapes weights).

        For methods other than ``de`` it includes ``samples_per_mode`` and the resolved
        ``method_options`` (BBB's ``kl_weight`` resolved for ``num_data`` training
        examples when given). The number of modes is not part of it: a collection can be
        extended by more modes.
        """
        recipe = {**self.recipe.to_dict(), "name": self.name, "base_seed": self.base_seed,
                  "method": self.method, "architecture": self.architecture,
                  "dataset": self.dataset, "num_classes": self.num_classes,
                  "model_options": dict(self.model_options)}
        method = get_method(self.method)
        if not method.one_sample_per_mode:
            options = method.recorded_options(self.method_options, num_data)
            recipe.update(samples_per_mode=self.samples_per_mode, method_options=options)
        return recipe

    @property
    def recipe_hash(self) -> str:
        """SHA-256 of everything that shapes the weights (the recipe without the name)."""
        recipe = self.collection_recipe()
        recipe.pop("name")
        return recipe_hash(recipe)

    def replace(self, **changes: Any) -> ZooSpec:
        """A copy with fields changed (``recipe`` overrides go through ``recipe=``).

        A new ``checkpoints`` without ``modes`` keeps ``samples_per_mode`` and sets the
        number of modes to match; a new ``modes`` or ``samples_per_mode`` without
        ``checkpoints`` sets ``checkpoints`` to their product.
        """
        if "checkpoints" in changes and "modes" not in changes:
            changes["modes"] = None
        elif {"modes", "samples_per_mode"} & set(changes) and "checkpoints" not in changes:
            changes["checkpoints"] = None
        replaced = dataclasses.replace(self, **changes)
        if not {"recipe", "method", "method_options", "architecture", "model_options",
                "num_classes"} & set(changes):  # the same values, from the same sources
            object.__setattr__(replaced, "sources", self.sources)
            object.__setattr__(replaced, "derived", self.derived)
        return replaced


def make_spec(recipe: str | Recipe = "optunet-mnist", *, name: str | None = None,
              recipe_overrides: Mapping[str, Any] | None = None, **fields: Any) -> ZooSpec:
    """Build a spec in code: a recipe (name or object), its overrides, and spec fields.

    Every value is checked (type and range): a bad one raises a
    :class:`~posteriorzoo.errors.PosteriorZooError` whose message names the field.
    """
    allowed = {f.name for f in dataclasses.fields(ZooSpec) if f.init} - {"name", "recipe"}
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
        base = get_recipe(recipe_name)
    elif isinstance(recipe, Recipe):
        recipe_name, base = "custom", recipe
        recipe = apply_overrides(recipe, overrides)
    else:
        raise InvalidOptionError(
            f"spec field 'recipe' must be a recipe name or a Recipe, not {show(recipe)}")
    fields.setdefault("architecture", recipe.architecture)
    fields.setdefault("dataset", recipe.dataset)
    recipe = dataclasses.replace(recipe, architecture=fields["architecture"],
                                 dataset=fields["dataset"])
    spec = ZooSpec(name=name or f"{recipe_name}-{fields['dataset']}", recipe=recipe, **fields)
    # Where the recipe's fields came from (the overrides, or the built-in recipe's, or
    # scaled to the new epochs): what the spec alone cannot tell.
    recipe_sources, recipe_notes = explain_overrides(base, overrides)
    object.__setattr__(spec, "sources", {"recipe": recipe_sources, **spec.sources})
    object.__setattr__(spec, "derived", (*recipe_notes, *spec.derived))
    return spec


def load_spec(path: str | os.PathLike) -> ZooSpec:
    """Read a TOML zoo spec (format in the module docstring).

    Raises a :class:`~posteriorzoo.errors.PosteriorZooError` (one line that starts with
    the path and names the offending key) for a missing, unreadable, non-UTF-8 or
    malformed file, one over :data:`MAX_SPEC_BYTES` (read no further), and for any value
    of the wrong type or out of range.
    """
    path = Path(path)
    if path.is_dir():
        raise ZooFormatError(f"{path}: is a folder, not a spec file")
    try:
        raw = read_small_file(path, MAX_SPEC_BYTES, f"{path}: the spec file",
                              " (a spec is a short TOML file)")
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
