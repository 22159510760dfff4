"""Moving checkpoints in and out of collections: safetensors files and release archives.

- :func:`export_checkpoint` / :func:`read_checkpoint`: one checkpoint as a safetensors
  file whose header metadata says what it is (architecture, dataset, method, metadata row).
- :func:`read_release_archive`: the authors' release format, a ``.tgz`` of float16
  safetensors files, one per model, read member by member without extracting to disk.
- :class:`KeyMap`: renames foreign state keys to this project's model keys.
- :func:`import_checkpoints`: validate every input first, then append them all.

Nothing here unpickles: safetensors holds raw tensors and a JSON header only.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save_file

from posteriorzoo.errors import NonFiniteWeightsError, ZooFormatError, ZooSchemaError
from posteriorzoo.zoo import schema
from posteriorzoo.zoo.lifecycle import (
    check_architecture,
    create_zoo,
    normalise_template,
    open_zoo,
)
from posteriorzoo.zoo.store import Zoo

CHECKPOINT_FORMAT = "posteriorzoo-checkpoint"

#: Release task names (``models/<task>/<task>-<start>-<end>.tgz``) -> collection attributes.
RELEASE_TASKS: dict[str, dict[str, Any]] = {
    "mnist-optunet": {"architecture": "optunet", "dataset": "mnist", "num_classes": 10},
    "cifar10-resnet18": {"architecture": "resnet18", "dataset": "cifar10", "num_classes": 10},
    "cifar100-resnet18": {"architecture": "resnet18", "dataset": "cifar100", "num_classes": 100},
    "tiny-imagenet-resnet18": {"architecture": "resnet18-tiny", "dataset": "tinyimagenet",
                               "num_classes": 200},
}


# ---------------------------------------------------------------------- key maps
@dataclass
class KeyMap:
    """Rename foreign state keys: exact renames first, then regex rules in order.

    A JSON file ``{"rename": {"old": "new"}, "rules": [["^model\\\\.", ""]],
    "drop": ["regex", ...]}`` describes one; :meth:`from_file` reads it. Keys matching a
    ``drop`` pattern are discarded (e.g. optimizer state saved alongside weights).
    """

    rename: dict[str, str] = field(default_factory=dict)
    rules: list[tuple[str, str]] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> KeyMap:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as error:
            raise ZooFormatError(f"key map not found: {path}") from error
        except json.JSONDecodeError as error:
            raise ZooFormatError(f"key map {path} is not valid JSON: {error}") from error
        unknown = set(data) - {"rename", "rules", "drop"}
        if unknown:
            raise ZooFormatError(f"key map {path}: unknown entries {sorted(unknown)}")
        try:
            rules = [(str(pattern), str(replacement)) for pattern, replacement in
                     data.get("rules", [])]
            for pattern, _ in rules:
                re.compile(pattern)
        except (ValueError, re.error) as error:
            raise ZooFormatError(f"key map {path}: bad rule: {error}") from error
        return cls(dict(data.get("rename", {})), rules, list(data.get("drop", [])))

    def apply(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the state with renamed keys; two keys mapping to one name raise."""
        result: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if any(re.search(pattern, key) for pattern in self.drop):
                continue
            new = self.rename.get(key, key)
            for pattern, replacement in self.rules:
                new = re.sub(pattern, replacement, new)
            if new in result:
                raise ZooSchemaError(f"key map sends two keys to {new!r} (one is {key!r})")
            result[new] = value
        return result


# ---------------------------------------------------------------------- safetensors
def export_checkpoint(zoo: Zoo, index: int, path: str | os.PathLike) -> Path:
    """Write checkpoint ``index`` of ``zoo`` to a safetensors file; returns its path.

    The header's metadata records the collection attributes and the metadata row, so
    :func:`import_checkpoints` can rebuild a collection from exported files alone.
    """
    path = Path(path)
    state = {key: tensor.contiguous() for key, tensor in zoo.state_dict(index).items()}
    row = zoo.metadata_dict(index)
    header = {
        "format": CHECKPOINT_FORMAT,
        "architecture": zoo.architecture,
        "dataset": zoo.dataset,
        "method": zoo.method,
        "num_classes": "" if zoo.num_classes is None else str(zoo.num_classes),
        "model_options": schema.canonical_json(zoo.model_options),
        "state_keys": json.dumps(zoo.state_keys),
        "index": str(index % len(zoo)),
        "metadata": schema.canonical_json(row),
        "source_collection": zoo.path.name,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(state, str(temporary), metadata=header)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def _parse_safetensors(data: bytes, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        tensors = load_safetensors_bytes(data)
        header_size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_size])
    except (SafetensorError, ValueError, json.JSONDecodeError) as error:
        raise ZooFormatError(f"{name}: not a valid safetensors file ({error})") from error
    metadata = header.get("__metadata__") or {}
    keys = json.loads(metadata["state_keys"]) if "state_keys" in metadata else None
    if keys is not None and set(keys) == set(tensors):
        tensors = {key: tensors[key] for key in keys}
    return tensors, metadata


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors checkpoint: returns ``(state_dict, header metadata)``."""
    path = Path(path)
    if not path.is_file():
        raise ZooFormatError(f"{path}: no such file")
    return _parse_safetensors(path.read_bytes(), str(path))


def read_release_archive(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield ``(member name, state_dict)`` for each safetensors file of a release ``.tgz``.

    Members are read from the archive stream; nothing is extracted to disk.
    """
    path = Path(path)
    if not path.is_file():
        raise ZooFormatError(f"{path}: no such file")
    try:
        with tarfile.open(path, "r:*") as archive:
            for member in archive:
                if not member.isfile() or not member.name.endswith(".safetensors"):
                    continue
                handle = archive.extractfile(member)
                if handle is None:
                    continue
                name = f"{path.name}:{member.name}"
                yield name, _parse_safetensors(handle.read(), name)[0]
    except (tarfile.TarError, EOFError, OSError) as error:
        raise ZooFormatError(f"{path}: not a readable tar archive ({error})") from error


def release_task(path: str | os.PathLike) -> dict[str, Any] | None:
    """Collection attributes implied by a release archive's name, or None if unknown."""
    name = Path(path).name
    for task, attributes in sorted(RELEASE_TASKS.items(), key=lambda item: -len(item[0])):
        if name.startswith(task + "-") or name == f"{task}.tgz":
            return dict(attributes)
    return None


# ---------------------------------------------------------------------- import
@dataclass
class ImportSummary:
    """What :func:`import_checkpoints` did."""

    path: Path
    created: bool
    indices: range
    sources: list[str]


def _iter_sources(files: Iterable[str | os.PathLike]
                  ) -> Iterator[tuple[str, dict[str, torch.Tensor], dict[str, str]]]:
    for file in files:
        file = Path(file)
        if tarfile.is_tarfile(file) if file.is_file() else False:
            for name, state in read_release_archive(file):
                yield name, state, {}
        else:
            state, header = read_checkpoint(file)
            yield file.name, state, header


def _convert(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return state
    return {key: value.to(dtype) if value.is_floating_point() else value
            for key, value in state.items()}


def _row_from_header(header: Mapping[str, str], source: str) -> dict[str, Any]:
    row = json.loads(header["metadata"]) if "metadata" in header else {}
    row = {key: value for key, value in row.items()
           if key in schema.COLUMN_NAMES and key not in ("sha256", "written_at")}
    row["source"] = source[-256:]
    return row


def import_checkpoints(
    zoo_path: str | os.PathLike,
    files: Iterable[str | os.PathLike],
    *,
    architecture: str | None = None,
    dataset: str | None = None,
    method: str | None = None,
    num_classes: int | None = None,
    model_options: Mapping[str, Any] | None = None,
    key_map: KeyMap | None = None,
    dtype: torch.dtype | None = None,
    command: str | None = None,
    batch_size: int = 64,
    progress: bool = False,
) -> ImportSummary:
    """Append checkpoints from safetensors files and release archives to a collection.

    The collection is created if ``zoo_path`` does not exist; its attributes come from
    the arguments, else from the first exported checkpoint's header, else from the
    release archive's name (e.g. ``mnist-optunet-0-1023.tgz``). Every input is read and
    validated (keys after ``key_map``, shapes against the architecture, finite values)
    before the first one is appended, so a bad input leaves the collection unchanged.
    Floating tensors are cast to ``dtype`` if given (the release is float16).
    """
    from tqdm.auto import tqdm

    files = [Path(file) for file in files]
    if not files:
        raise ZooFormatError("no input files given")
    for file in files:
        if not file.is_file():
            raise ZooFormatError(f"{file}: no such file")
    key_map = key_map or KeyMap()
    zoo_path = Path(zoo_path)
    exists = zoo_path.exists()
    attributes: dict[str, Any] = {}
    if exists:
        with open_zoo(zoo_path) as zoo:
            attributes = {"architecture": zoo.architecture, "dataset": zoo.dataset,
                          "method": zoo.method, "num_classes": zoo.num_classes,
                          "model_options": zoo.model_options}
            spec = zoo.spec
            validate = bool(zoo._file.attrs.get("validated", True))
    template: dict[str, torch.Tensor] | None = None
    count = 0
    # Pass 1: read and check everything, keep nothing.
    for name, state, header in tqdm(_iter_sources(files), desc="check", unit="ckpt",
                                    disable=not progress):
        state = _convert(key_map.apply(state), dtype)
        if not exists and template is None:
            attributes = _attributes_for(files[0], header, architecture, dataset, method,
                                         num_classes, model_options)
            template = _ordered(state, attributes)
            spec = normalise_template(template)
            validate = True
            try:
                check_architecture(attributes["architecture"], spec,
                                   attributes["num_classes"], attributes["model_options"])
            except ZooSchemaError as error:
                raise ZooSchemaError(f"{name}: {error}; a --key-map can rename keys") from None
        _check_against(spec, state, name, diverged=_row_from_header(header, name)
                       .get("diverged", False))
        count += 1
    if count == 0:
        raise ZooFormatError("the inputs hold no safetensors checkpoints")
    # Pass 2: append in batches.
    if exists:
        zoo = open_zoo(zoo_path, mode="a")
    else:
        zoo = create_zoo(zoo_path, template=template, command=command, validate=validate,
                         **attributes)
    sources: list[str] = []
    first = len(zoo)
    with zoo, tqdm(total=count, desc="import", unit="ckpt", disable=not progress) as bar:
        batch: list[dict[str, torch.Tensor]] = []
        rows: list[dict[str, Any]] = []
        for name, state, header in _iter_sources(files):
            batch.append(_convert(key_map.apply(state), dtype))
            rows.append(_row_from_header(header, name))
            sources.append(name)
            if len(batch) == batch_size:
                zoo.append_many(batch, rows)
                bar.update(len(batch))
                batch, rows = [], []
        if batch:
            zoo.append_many(batch, rows)
            bar.update(len(batch))
        last = len(zoo)
    return ImportSummary(zoo_path, not exists, range(first, last), sources)


def _attributes_for(first: Path, header: Mapping[str, str], architecture: str | None,
                    dataset: str | None, method: str | None, num_classes: int | None,
                    model_options: Mapping[str, Any] | None) -> dict[str, Any]:
    implied: dict[str, Any] = {}
    if header.get("format") == CHECKPOINT_FORMAT:
        implied = {"architecture": header["architecture"], "dataset": header["dataset"],
                   "method": header["method"],
                   "num_classes": int(header["num_classes"]) if header["num_classes"] else None,
                   "model_options": json.loads(header["model_options"])}
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
            f"pass --{missing[0].replace('_', '-')}")
    return attributes


def _ordered(state: dict[str, torch.Tensor], attributes: Mapping[str, Any]
             ) -> dict[str, torch.Tensor]:
    """The state in the registered model's key order (storage order follows it)."""
    from posteriorzoo import models

    order = list(models.expected_state_shapes(attributes["architecture"],
                                              num_classes=attributes["num_classes"],
                                              **attributes["model_options"]))
    ranked = {key: position for position, key in enumerate(order)}
    return dict(sorted(state.items(), key=lambda item: ranked.get(item[0], len(ranked))))


def _check_against(spec: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                   state: Mapping[str, torch.Tensor], name: str, diverged: bool) -> None:
    if set(spec) != set(state):
        missing = sorted(set(spec) - set(state))[:3]
        extra = sorted(set(state) - set(spec))[:3]
        raise ZooSchemaError(f"{name}: keys do not match (missing {missing}, unexpected "
                             f"{extra}); a --key-map can rename them")
    for key, (shape, dtype) in spec.items():
        tensor = state[key]
        if tuple(tensor.shape) != tuple(shape):
            raise ZooSchemaError(f"{name}: {key} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(shape)}")
        if tensor.numpy().dtype != dtype:
            raise ZooSchemaError(f"{name}: {key} has dtype {tensor.numpy().dtype}, expected "
                                 f"{dtype} (use --dtype to convert)")
        if not diverged and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise NonFiniteWeightsError(f"{name}: {key} has NaN or infinite values")
