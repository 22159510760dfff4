"""Training recipes: optimiser, schedule and augmentation of one checkpoint's training.

The paper's recipes (appendix B.1) are built in by name; any field can be overridden.
Learning rates are a closed-form function of the epoch (:meth:`Recipe.learning_rate`),
so every engine (torch, the numba fast path, the vectorised path) follows exactly the
same schedule without sharing scheduler objects.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.options import (
    check_bool,
    check_integer,
    check_name,
    check_number,
    check_table,
    is_integer,
    show,
)
from posteriorzoo.vocabulary import MAX_BATCH_SIZE, MAX_EPOCHS

SCHEDULES = ("constant", "multistep", "cosine")
# The ranges of the recipe's numbers: MAX_EPOCHS (epochs and milestones) and
# MAX_BATCH_SIZE are the vocabulary's (posteriorzoo.vocabulary), shared with the methods'
# options.
#: Zero padding of the random crop, in pixels: the images here are 8 to 64 pixels wide,
#: and a crop out of more padding than image is mostly padding.
MAX_CROP_PADDING = 64
# lr and weight_decay are any finite numbers > 0 (>= 0): a value that makes training
# diverge is detected and reported per checkpoint (train's "diverged" count; Laplace names
# the mode), so no upper bound is needed. momentum is below 1 (at 1 SGD never forgets a
# gradient and its steps grow without bound); gamma is a decay factor in (0, 1].


# Field checks are posteriorzoo.options (shared with train_zoo.spec and the library).
def check_milestones(value: object) -> tuple[int, ...]:
    """A list or tuple of integers >= 0 as a tuple."""
    if not isinstance(value, list | tuple) or not all(is_integer(m) and 0 <= m <= MAX_EPOCHS
                                                      for m in value):
        raise InvalidOptionError(f"recipe field 'milestones' must be a list of integers in "
                                 f"[0, {MAX_EPOCHS}] (epochs), not {show(value)}")
    return tuple(int(m) for m in value)


@dataclass(frozen=True)
class Recipe:
    """How one checkpoint is trained.

    Attributes
    ----------
    architecture, dataset : str
        Defaults of a zoo spec that uses this recipe (a spec may override them).
    epochs : int
        Passes over the training set, 0 to :data:`MAX_EPOCHS`; training runs to the last
        step (no early stopping).
    batch_size : int
        Examples per step, 1 to :data:`MAX_BATCH_SIZE`; the last, smaller batch of an
        epoch is kept.
    lr : float
        Initial learning rate of SGD, any finite number > 0 (divergence is reported).
    momentum : float
        SGD momentum in [0, 1) (0 for plain SGD).
    nesterov : bool
        Nesterov momentum.
    weight_decay : float
        L2 coefficient added to the gradient (PyTorch SGD's ``weight_decay``), finite, >= 0.
    schedule : {"constant", "multistep", "cosine"}
        ``multistep``: lr multiplied by ``gamma`` at each epoch in ``milestones``;
        ``cosine``: lr * (1 + cos(pi * epoch / epochs)) / 2, per epoch.
    milestones : tuple of int
        Epochs at which a multistep schedule decays, each 0 to :data:`MAX_EPOCHS`.
    gamma : float
        Multistep decay factor, in (0, 1].
    crop_padding : int
        Zero padding of the random crop back to the input size, 0 (no crop) to
        :data:`MAX_CROP_PADDING`.
    horizontal_flip : bool
        Random horizontal flips with probability 0.5.
    """

    architecture: str
    dataset: str
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    schedule: str = "constant"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    crop_padding: int = 0
    horizontal_flip: bool = False
    model_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def field_name(name: str) -> str:
            return f"recipe field {name!r}"

        for name in ("architecture", "dataset"):
            check_name(field_name(name), getattr(self, name))
        check_name(field_name("schedule"), self.schedule, SCHEDULES)
        check_integer(field_name("epochs"), self.epochs, 0, MAX_EPOCHS)
        check_integer(field_name("batch_size"), self.batch_size, 1, MAX_BATCH_SIZE)
        check_integer(field_name("crop_padding"), self.crop_padding, 0, MAX_CROP_PADDING)
        check_number(field_name("lr"), self.lr, 0, strict=True)
        check_number(field_name("gamma"), self.gamma, 0, strict=True, maximum=1)
        check_number(field_name("weight_decay"), self.weight_decay, 0)
        check_number(field_name("momentum"), self.momentum, 0, maximum=1,
                     strict_maximum=True)
        for name in ("nesterov", "horizontal_flip"):
            check_bool(field_name(name), getattr(self, name))
        if self.nesterov and self.momentum == 0:
            raise InvalidOptionError("recipe field 'nesterov' needs momentum > 0")
        object.__setattr__(self, "milestones", check_milestones(self.milestones))
        object.__setattr__(self, "model_options",
                           check_table(field_name("model_options"), self.model_options))

    def learning_rate(self, epoch: int) -> float:
        """Learning rate during ``epoch`` (0-based)."""
        if self.schedule == "multistep":
            return self.lr * self.gamma ** sum(epoch >= m for m in self.milestones)
        if self.schedule == "cosine":
            return self.lr * (1 + math.cos(math.pi * epoch / max(1, self.epochs))) / 2
        return self.lr

    def with_epochs(self, epochs: int) -> Recipe:
        """The same recipe over ``epochs`` epochs, milestones scaled proportionally
        (:func:`scale_milestones`)."""
        milestones = scale_milestones(self.milestones, self.epochs, epochs)
        return dataclasses.replace(self, epochs=epochs, milestones=milestones)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (what a collection records as its recipe)."""
        values = dataclasses.asdict(self)
        values["milestones"] = list(self.milestones)
        return values


def scale_milestones(milestones: tuple[int, ...], epochs: int, new_epochs: int
                     ) -> tuple[int, ...]:
    """The milestones of a schedule of ``epochs`` epochs, for ``new_epochs`` epochs.

    Each is scaled in proportion and rounded, then kept strictly increasing (at least 1
    and one above the previous, so two decays never fall on one epoch and none replaces
    the initial lr); those that land at or beyond ``new_epochs`` would never apply and are
    dropped. The same length keeps them as they are. E.g. (15, 30) of 60 epochs: (1, 2)
    for 4 epochs, (1,) for 2, () for 1.
    """
    if new_epochs == epochs:
        return tuple(milestones)
    scale = new_epochs / epochs if epochs else 1.0
    scaled: list[int] = []
    for milestone in sorted(milestones):
        value = max(1, round(milestone * scale), scaled[-1] + 1 if scaled else 1)
        if value >= new_epochs:
            break
        scaled.append(value)
    return tuple(scaled)


def explain_overrides(recipe: Recipe, overrides: Mapping[str, Any]
                      ) -> tuple[dict[str, str], list[str]]:
    """Where each field of ``apply_overrides(recipe, overrides)`` comes from, and one line
    per value derived from the overrides.

    Returns ``(sources, notes)``: ``sources`` maps every field to ``"given"``,
    ``"default"`` (``recipe``'s) or ``"derived from ..."`` (milestones scaled to a new
    ``epochs``); ``notes`` has e.g. ``recipe: milestones [1] (derived from epochs=2;
    [15, 30] at 60 epochs)`` when the scaled milestones differ from ``recipe``'s.
    """
    sources = {f.name: "given" if f.name in overrides else "default"
               for f in dataclasses.fields(Recipe)}
    notes: list[str] = []
    if "epochs" in overrides and "milestones" not in overrides and recipe.milestones:
        epochs = overrides["epochs"]
        scaled = scale_milestones(recipe.milestones, recipe.epochs, epochs)
        if scaled != recipe.milestones:
            usual = f"{list(recipe.milestones)} at {recipe.epochs} epochs"
            sources["milestones"] = f"derived from epochs={epochs} ({usual})"
            notes.append(f"recipe: milestones {list(scaled)} (derived from epochs={epochs}; "
                         f"{usual})")
    return sources, notes


BUILTIN_RECIPES: dict[str, Recipe] = {
    "optunet-mnist": Recipe(
        architecture="optunet", dataset="mnist", epochs=60, batch_size=64, lr=0.04,
        weight_decay=2e-4, schedule="multistep", milestones=(15, 30), gamma=0.5,
        crop_padding=4),
    "resnet18-cifar100": Recipe(
        architecture="resnet18", dataset="cifar100", epochs=75, batch_size=128, lr=0.1,
        momentum=0.9, nesterov=True, weight_decay=5e-4, schedule="multistep",
        milestones=(25, 50), gamma=0.1, crop_padding=4, horizontal_flip=True),
    "resnet18-tinyimagenet": Recipe(
        architecture="resnet18-tiny", dataset="tinyimagenet", epochs=200, batch_size=128,
        lr=0.2, momentum=0.9, weight_decay=5e-4, schedule="cosine", crop_padding=4,
        horizontal_flip=True),
}


def get_recipe(name: str, **overrides: Any) -> Recipe:
    """A built-in recipe by name, with fields overridden.

    Overriding ``epochs`` without ``milestones`` scales the milestones proportionally
    (the paper's schedule compressed into fewer epochs; :func:`scale_milestones`).
    """
    if not isinstance(name, str) or name not in BUILTIN_RECIPES:
        raise UnknownNameError(
            f"unknown recipe {show(name)}; built in: {', '.join(sorted(BUILTIN_RECIPES))}")
    recipe = BUILTIN_RECIPES[name]
    return apply_overrides(recipe, overrides)


def apply_overrides(recipe: Recipe, overrides: Mapping[str, Any]) -> Recipe:
    """``recipe`` with fields replaced.

    Unknown field names raise UnknownNameError, values of the wrong type or range
    InvalidOptionError (one line naming the field).
    """
    overrides = check_table("the recipe overrides", overrides)
    fields = {f.name for f in dataclasses.fields(Recipe)}
    unknown = set(overrides) - fields
    if unknown:
        raise UnknownNameError(
            f"unknown recipe field(s) {sorted(unknown)}; fields: {', '.join(sorted(fields))}")
    if "epochs" in overrides and "milestones" not in overrides:
        epochs = check_integer("recipe field 'epochs'", overrides.pop("epochs"), 0,
                               MAX_EPOCHS)
        recipe = recipe.with_epochs(epochs)
    if "milestones" in overrides:
        overrides["milestones"] = check_milestones(overrides["milestones"])
    return dataclasses.replace(recipe, **overrides)
