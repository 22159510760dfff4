"""What :func:`~posteriorzoo.collection.import_checkpoints` reads, infers and checks.

Reading the inputs whatever their format, the attributes a new collection takes from
them, and the checks one input must pass before anything is written: keys, shapes,
dtypes and finite values against the collection, and a metadata row the columns accept.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posteriorzoo.dtypes import as_numpy
from posteriorzoo.errors import (
    ChecksumError,
    NonFiniteWeightsError,
    PosteriorZooError,
    ZooFormatError,
    ZooSchemaError,
)
from posteriorzoo.zoo import schema
from posteriorzoo.zoo.archives import read_archive, release_task
from posteriorzoo.zoo.formats import (
    CHECKPOINT_FORMAT,
    ReadLimits,
    Review,
    load_json,
    read_checkpoint,
    sniff_format,
)
from posteriorzoo.zoo.store import all_finite

TensorLayout = Mapping[str, tuple[tuple[int, ...], np.dtype]]


def read_inputs(files: Iterable[Path], limits: Callable[[], ReadLimits],
                review: Review | None = None, digests: dict[Path, str] | None = None
                ) -> Iterator[tuple[str, dict[str, torch.Tensor], dict[str, str]]]:
    """``(name, state, header)`` of every checkpoint in ``files``, any format.

    ``limits()`` is asked again for each file, so a caller can tighten the bounds once
    the size of a checkpoint is known; ``review`` sees every header before its tensors
    are read (:func:`~posteriorzoo.zoo.formats.read_safetensors`). ``digests`` receives
    each archive's SHA-256 from the read itself, once it is read to its end.
    """
    for file in files:
        current = limits()
        if sniff_format(file, current) == "safetensors":
            state, header = read_checkpoint(file, limits=current, review=review)
            yield file.name, state, header
        else:
            yield from read_archive(file, current, review, digests)


def limits_for_architecture(limits: ReadLimits, architecture: str | None,
                            num_classes: int | None,
                            model_options: Mapping[str, Any] | None) -> ReadLimits:
    """``limits`` tightened to the architecture's checkpoint size, when it is known."""
    if not architecture:
        return limits
    from posteriorzoo import models

    try:
        shapes = models.expected_state_shapes(architecture, num_classes=num_classes,
                                              **dict(model_options or {}))
    except (PosteriorZooError, TypeError, ValueError):
        return limits  # an unknown name is reported by the architecture check
    return limits.for_shapes(shapes)


def limits_for_new_collection(limits: ReadLimits, first: Path, header: Mapping[str, str],
                              given: Mapping[str, Any]) -> ReadLimits:
    """``limits`` tightened to the checkpoint size of the collection the first input will
    create, before its tensors are read.

    The architecture comes from ``given`` (the arguments of
    :func:`collection_attributes`), else the header, else the archive's name; when none
    tells it, or it is not a registered model, the import could not go on anyway, and
    refusing now spares reading tensors of any size.
    """
    attributes = collection_attributes(first, header, **given)
    from posteriorzoo import models

    try:
        shapes = models.expected_state_shapes(attributes["architecture"],
                                              num_classes=attributes["num_classes"],
                                              **attributes["model_options"])
    except (TypeError, ValueError) as error:
        if isinstance(error, PosteriorZooError):
            raise
        raise ZooSchemaError(f"model {attributes['architecture']!r} cannot be built with "
                             f"{attributes['model_options']}: {error}"[:400]) from None
    return limits.for_shapes(shapes)


def check_recorded_digest(state: Mapping[str, torch.Tensor], header: Mapping[str, str],
                          name: str) -> bool:
    """Check ``state`` against the SHA-256 its header records; False if it records none.

    An exported checkpoint's ``metadata`` row carries the collection's digest of its
    tensors (:func:`~posteriorzoo.zoo.schema.checkpoint_digest`, in the ``state_keys``
    order): any altered tensor byte, dtype, shape or key raises :class:`ChecksumError`.
    """
    if "metadata" not in header:
        return False
    row = load_json(header["metadata"], f"{name}: header 'metadata'")
    recorded = row.get("sha256") if isinstance(row, dict) else None
    if recorded in (None, ""):
        return False
    if not (isinstance(recorded, str) and len(recorded) == 64
            and all(c in "0123456789abcdef" for c in recorded)):
        raise ZooFormatError(f"{name}: header metadata 'sha256' is not a SHA-256 digest")
    keys = json.loads(header["state_keys"]) if "state_keys" in header else sorted(state)
    if set(keys) != set(state):
        keys = sorted(state)
    arrays = {key: as_numpy(state[key]) for key in keys}
    if schema.checkpoint_digest(arrays, keys) != recorded:
        raise ChecksumError(f"{name}: its tensors differ from the SHA-256 its header records "
                            "(altered or corrupt); refusing to import it (verify=False, "
                            "--no-verify on the command line, skips this check)")
    return True


def collection_attributes(first: Path, header: Mapping[str, str], architecture: str | None,
                          dataset: str | None, method: str | None, num_classes: int | None,
                          model_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A new collection's attributes: the arguments given, else what the inputs imply.

    An exported checkpoint's header implies all of them; otherwise the name of the first
    input, if it is a release archive (whose models are deep ensemble members).
    """
    implied: dict[str, Any] = {}
    if header.get("format") == CHECKPOINT_FORMAT:  # values checked when the file was read
        implied = {"architecture": header["architecture"], "dataset": header["dataset"],
                   "method": header["method"],
                   "num_classes": int(header["num_classes"]) if header.get("num_classes")
                   else None,
                   "model_options": json.loads(header.get("model_options", "{}"))}
    elif (task := release_task(first)) is not None:
        implied = {**task, "method": "de"}
    given = {"architecture": architecture, "dataset": dataset, "method": method,
             "num_classes": num_classes, "model_options": model_options}
    attributes = {key: value if value is not None else implied.get(key)
                  for key, value in given.items()}
    attributes["model_options"] = dict(attributes["model_options"] or {})
    missing = [key for key in ("architecture", "dataset", "method") if not attributes[key]]
    if missing:
        raise ZooFormatError(
            f"cannot tell the new collection's {', '.join(missing)} from the inputs; "
            f"give the {missing[0].replace('_', ' ')}")
    return attributes


def in_model_order(state: dict[str, torch.Tensor], attributes: Mapping[str, Any]
                   ) -> dict[str, torch.Tensor]:
    """The state in the registered model's key order (storage order follows it)."""
    from posteriorzoo import models

    order = list(models.expected_state_shapes(attributes["architecture"],
                                              num_classes=attributes["num_classes"],
                                              **attributes["model_options"]))
    ranked = {key: position for position, key in enumerate(order)}
    return dict(sorted(state.items(), key=lambda item: ranked.get(item[0], len(ranked))))


def convert_floats(state: dict[str, torch.Tensor], dtype: torch.dtype | None
                   ) -> dict[str, torch.Tensor]:
    """The state with floating tensors cast to ``dtype`` (unchanged if it is None)."""
    if dtype is None:
        return state
    return {key: value.to(dtype) if value.is_floating_point() else value
            for key, value in state.items()}


def _source_text(name: str) -> str:
    """The last 256 bytes of ``name`` as valid UTF-8 (the ``source`` column's width)."""
    encoded = name.encode("utf-8", errors="replace")[-256:]
    return encoded.decode("utf-8", errors="ignore")


def row_for_input(header: Mapping[str, str], source: str, method: str) -> dict[str, Any]:
    """The metadata row an input will get, checked now for the columns' types.

    The exported row is kept except the columns the collection computes itself
    (``sha256``, ``written_at``); ``source`` records where the input came from.
    """
    row = load_json(header["metadata"], f"{source}: header 'metadata'") \
        if "metadata" in header else {}
    if not isinstance(row, dict):
        raise ZooFormatError(f"{source}: header 'metadata' must be a JSON object")
    row = {key: value for key, value in row.items()
           if key in schema.COLUMN_NAMES and key not in ("sha256", "written_at")}
    row["source"] = _source_text(source)
    try:
        schema.metadata_row({"method": method, **row})
    except ZooSchemaError as error:
        raise ZooSchemaError(f"{source}: {error}") from None
    return row


def check_against_layout(tensor_layout: TensorLayout, state: Mapping[str, torch.Tensor], name: str,
                         diverged: bool) -> None:
    """Raise unless ``state`` has the keys, shapes and dtypes of ``tensor_layout``, all finite.

    A checkpoint whose metadata row says it ``diverged`` may hold NaN or infinite values.
    """
    if set(tensor_layout) != set(state):
        missing = sorted(set(tensor_layout) - set(state))[:3]
        extra = sorted(set(state) - set(tensor_layout))[:3]
        raise ZooSchemaError(f"{name}: keys do not match (missing {missing}, unexpected "
                             f"{extra}); a key map can rename them")
    for key, (shape, dtype) in tensor_layout.items():
        tensor = state[key]
        if tuple(tensor.shape) != tuple(shape):
            raise ZooSchemaError(f"{name}: {key} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(shape)}")
        found = as_numpy(tensor).dtype
        if found != dtype:
            # --dtype casts floating tensors only: an integer or boolean weight stays wrong.
            hint = ("a dtype conversion can be asked for" if found.kind == "f"
                    and np.dtype(dtype).kind == "f" else
                    "a dtype conversion casts floating-point tensors only")
            raise ZooSchemaError(f"{name}: {key} has dtype {found}, expected {dtype} "
                                 f"({hint})")
        # numpy's check: torch's isfinite of float16 on a CPU is 20x slower
        if not diverged and not all_finite(as_numpy(tensor)):
            raise NonFiniteWeightsError(f"{name}: {key} has NaN or infinite values")


def expected_keys(attributes: Mapping[str, Any]) -> list[str]:
    """The state keys of the model ``attributes`` name (none when it is unknown: then
    the architecture's own check names the problem)."""
    from posteriorzoo import models

    try:
        return list(models.expected_state_shapes(
            attributes["architecture"], attributes["num_classes"],
            **attributes["model_options"]))
    except PosteriorZooError:
        return []
