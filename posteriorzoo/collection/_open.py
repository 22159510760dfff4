"""Accept a path or an open :class:`~posteriorzoo.zoo.Zoo` wherever a collection is read."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from posteriorzoo.errors import (
    InvalidOptionError,
    PosteriorZooError,
    ZooFormatError,
    ZooSchemaError,
)
from posteriorzoo.zoo import Zoo, open_zoo
from posteriorzoo.zoo.architecture import check_architecture

#: What the collection layer's functions take as a collection.
Source = str | os.PathLike | Zoo


@contextlib.contextmanager
def opened(source: Source, *, verify: bool = True) -> Iterator[Zoo]:
    """The collection ``source`` opened read-only (an open Zoo is used as it is and left
    open; its own ``verify`` setting applies)."""
    if isinstance(source, Zoo):
        yield source
        return
    if not isinstance(source, str | os.PathLike):
        raise InvalidOptionError(f"a collection is a path or an open Zoo, not "
                                 f"{type(source).__name__}")
    with open_zoo(Path(source), verify=verify) as zoo:
        yield zoo


def source_path(source: Source) -> Path:
    """The file behind ``source``."""
    return source.path if isinstance(source, Zoo) else Path(source)


def content_digest(zoo: Zoo) -> str:
    """SHA-256 of the collection's content: of its checkpoints' digests in row order.

    Cheap (no tensor is read) and independent of the HDF5 layout, so two files holding the
    same checkpoints in the same order have the same content digest.
    """
    digest = hashlib.sha256()
    for row in zoo.digests:
        digest.update(row.encode())
    return digest.hexdigest()


def architecture_fit(zoo: Zoo) -> tuple[bool | None, str | None]:
    """Whether the stored tensors fit the collection's registered architecture.

    ``(True, None)`` when they do; ``(False, why)`` when they do not (a collection
    created with ``validate=False`` is not checked when it opens); ``(None, why)`` when
    it cannot be told: the architecture is not registered, or cannot be built with the
    collection's options.
    """
    try:
        problem = _architecture_problem(zoo)
    except PosteriorZooError as error:  # an unknown name, an option out of range
        return None, str(error)
    return problem is None, problem


def require_architecture_fit(zoo: Zoo) -> None:
    """Raise :class:`ZooFormatError` unless the stored tensors fit the registered
    architecture (an unregistered one raises :class:`UnknownNameError`): every command
    that builds the network for a collection first checks it can load the weights."""
    problem = _architecture_problem(zoo)
    if problem is not None:
        raise ZooFormatError(f"{zoo.path}: does not fit architecture {zoo.architecture}: "
                             f"{problem}")


def _architecture_problem(zoo: Zoo) -> str | None:
    """Why the stored tensors do not fit the registered architecture; None if they do."""
    try:
        check_architecture(zoo.architecture, zoo.tensor_layout, zoo.num_classes,
                           zoo.model_options)
    except ZooSchemaError as error:
        return str(error)
    return None


def model_of(zoo: Zoo) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The collection's architecture (registered in :mod:`posteriorzoo.models`), built
    with its number of classes and model options, in eval mode, and its input shape.

    The stored tensors are checked against it first (:func:`require_architecture_fit`):
    a collection created with ``validate=False`` was not checked when it opened.
    """
    from posteriorzoo.models import build, input_shape

    require_architecture_fit(zoo)
    model = build(zoo.architecture, num_classes=zoo.num_classes, **zoo.model_options)
    return model.eval(), input_shape(zoo.architecture, **zoo.model_options)
