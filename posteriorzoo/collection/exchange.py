"""Moving checkpoints in and out of collections: safetensors files and release archives.

- :func:`export_checkpoint` / :func:`export_all`: checkpoints as safetensors files whose
  header metadata says what they are (architecture, dataset, method, metadata row).
  Exports follow :mod:`posteriorzoo.outputs`: never onto the input, never over an
  existing output unless asked, built under a temporary name. Both return an
  :class:`ExportResult` listing every file written with its SHA-256.
- :func:`import_checkpoints`: validate every input first, then append them all; inputs
  already stored are skipped, so an interrupted import is finished by running it again.
  Returns an :class:`ImportResult`.

The inputs are read by :mod:`posteriorzoo.zoo.formats` (safetensors files, read limits)
and :mod:`posteriorzoo.zoo.archives` (release archives), their keys renamed by
:mod:`posteriorzoo.zoo.keymap` and checked by :mod:`posteriorzoo.zoo.import_checks`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as save_safetensors_bytes

from posteriorzoo._api import public
from posteriorzoo._faults import fault_point
from posteriorzoo.collection._import_stream import ImportStream
from posteriorzoo.collection._open import Source, opened, source_path
from posteriorzoo.errors import (
    ChecksumError,
    InvalidOptionError,
    PosteriorZooError,
    ZooFormatError,
)
from posteriorzoo.options import check_integer
from posteriorzoo.outputs import atomic_directory, atomic_file, check_output, same_file
from posteriorzoo.provenance import describe_input, record
from posteriorzoo.results import CollectionResult, csv_text
from posteriorzoo.zoo import schema
from posteriorzoo.zoo.archives import list_archive, member_modes, release_task
from posteriorzoo.zoo.formats import (
    CHECKPOINT_FORMAT,
    ReadLimits,
    require_file,
    safetensors_keys,
    sniff_format,
)
from posteriorzoo.zoo.import_checks import (
    collection_attributes,
    expected_keys,
    limits_for_architecture,
)
from posteriorzoo.zoo.keymap import KeyMap, implied_reading
from posteriorzoo.zoo.lifecycle import open_zoo
from posteriorzoo.zoo.store import Zoo

__all__ = ["ExportResult", "ImportResult", "export_all", "export_checkpoint",
           "import_checkpoints", "plan_import"]


# ---------------------------------------------------------------------- export
@dataclass
class ExportResult(CollectionResult):
    """What :func:`export_checkpoint` or :func:`export_all` wrote.

    Attributes
    ----------
    path : Path
        The collection exported from.
    out : Path
        The output: the safetensors file, or the folder of ``NNNNNN.safetensors`` files.
    files : list of dict
        One ``{"name", "index", "sha256"}`` per file written (``name`` relative to
        ``out``'s folder for one checkpoint, to ``out`` for a folder), with the SHA-256 of
        its safetensors bytes; ``to_dict()`` lists them under ``"exported"`` (``"files"``
        in a written JSON holds the digests of the result's own tables).
    """

    kind = "export"
    path: Path
    out: Path
    files: list[dict[str, Any]] = field(default_factory=list)

    def payload(self) -> dict[str, Any]:
        return {"path": str(self.path), "out": str(self.out),
                "checkpoints": len(self.files), "exported": self.files}

    def tables(self) -> dict[str, str]:
        """``exported.csv``: name, index and SHA-256 of every file written."""
        return {"exported.csv": csv_text(["name", "index", "sha256"],
                                         ([f["name"], f["index"], f["sha256"]]
                                          for f in self.files))}


def _checkpoint_bytes(zoo: Zoo, index: int) -> bytes:
    """Checkpoint ``index`` of ``zoo`` as safetensors bytes, with its describing header."""
    state = {key: tensor.contiguous() for key, tensor in zoo.state_dict(index).items()}
    row = _text_row(zoo, index)
    header = {
        "format": CHECKPOINT_FORMAT,
        "architecture": zoo.architecture,
        "dataset": zoo.dataset,
        "method": zoo.method,
        "num_classes": "" if zoo.num_classes is None else str(zoo.num_classes),
        "model_options": schema.canonical_json(zoo.model_options),
        "state_keys": json.dumps(zoo.state_keys),
        "index": str(index),
        "metadata": schema.canonical_json(row),
        # A file name need not be UTF-8 (its bytes come back as surrogates); the header's
        # text must be, and the name is only a label here.
        "source_collection": os.fsencode(zoo.path.name).decode("utf-8", errors="replace"),
    }
    return _sorted_header(save_safetensors_bytes(state, metadata=header))


def _text_row(zoo: Zoo, index: int) -> dict[str, Any]:
    """Metadata row ``index`` as a dict, refused unless its text columns are UTF-8.

    A safetensors header holds text only, so bytes that are not UTF-8 (the API stores a
    ``bytes`` value as it is) cannot be exported as they are stored, and replacing them
    would export a row other than the one its digest covers.
    """
    try:
        return zoo.metadata_dict(index)
    except UnicodeDecodeError:
        row = zoo.stored_metadata()[index]
        column = next(name for name in row.dtype.names if row.dtype[name].kind == "S"
                      and not _is_utf8(bytes(row[name])))
        raise ZooFormatError(
            f"{zoo.path}: checkpoint {index % len(zoo)}'s metadata {column!r} is not UTF-8 "
            f"text ({bytes(row[column])[:40]!r}); a safetensors header holds text only, so "
            "it cannot be exported") from None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _sorted_header(data: bytes) -> bytes:
    """The same safetensors bytes with the header's keys in sorted order.

    safetensors writes its ``__metadata__`` in hash-map order, which changes from run to
    run; sorting makes an export byte-reproducible (so manifests of exports are stable).
    The header keeps its length: same keys and values, same compact separators.
    """
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if len(text) > length:  # pragma: no cover - serde_json and json agree on compact JSON
        return data
    return data[:8] + text.ljust(length) + data[8 + length:]


def _write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it, so a published output survives a crash."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _check_index(zoo: Zoo, index: int) -> int:
    """``index`` as a non-negative checkpoint index of ``zoo``, or InvalidOptionError."""
    count = len(zoo)
    if isinstance(index, bool) or not isinstance(index, int | np.integer):
        raise InvalidOptionError(f"a checkpoint index must be an integer, not {index!r}")
    if not -count <= index < count:
        raise InvalidOptionError(f"index {index} out of range; {zoo.path} holds {count} "
                                 "checkpoint(s)")
    return int(index) % count


def _verify_checkpoint(zoo: Zoo, index: int) -> None:
    """Check one checkpoint's digests even if ``zoo`` was opened without verification."""
    if zoo.verify:
        return  # reading it checks it
    problems = zoo.check_checkpoints(index, index + 1)
    if problems:
        raise ChecksumError(f"{zoo.path}: checkpoint {index} is corrupt: {problems[0][1]}; "
                            "'posteriorzoo verify' reports all damage")


def _write_checkpoint(zoo: Zoo, index: int, path: Path, verify: bool) -> dict[str, Any]:
    """Write checkpoint ``index`` to ``path`` (verified first with ``verify``); returns
    its ``{"name", "index", "sha256"}`` entry of :attr:`ExportResult.files`."""
    if verify:
        _verify_checkpoint(zoo, index)
    data = _checkpoint_bytes(zoo, index)
    _write_bytes(path, data)
    return {"name": path.name, "index": index, "sha256": hashlib.sha256(data).hexdigest()}


def _export_provenance(path: Path, command: str | None, **options: Any) -> dict[str, Any]:
    return record("posteriorzoo export", command=command,
                  inputs={"collection": describe_input(path)}, options=options)


@public
def export_checkpoint(source: Source, index: int, out: str | os.PathLike, *,
                      overwrite: bool = False, verify: bool = True,
                      command: str | None = None) -> ExportResult:
    """Write checkpoint ``index`` of a collection to a safetensors file.

    The header's metadata records the collection attributes and the metadata row, so
    :func:`import_checkpoints` can rebuild a collection from exported files alone.

    Parameters
    ----------
    source : path or Zoo
        An open collection, or the path of one (opened read-only for the call).
    index : int
        Checkpoint index; negative counts from the end.
    out : path-like
        The output file. Its folder must exist; it is never the collection itself, and
        an existing file is replaced only with ``overwrite=True``. It is written under a
        temporary name next to it and renamed into place.
    overwrite : bool
        Replace an existing output file.
    verify : bool
        Check the checkpoint's SHA-256 digests before writing it (default);
        a corrupt checkpoint raises :class:`ChecksumError` and nothing is written.
    command : str, optional
        Recorded in the provenance.

    Returns
    -------
    ExportResult
        The output file, with its checkpoint index and SHA-256 in ``files``; the
        provenance records the collection's SHA-256.
    """
    out = Path(out)
    path = source_path(source)
    with opened(source, verify=verify) as zoo:
        index = _check_index(zoo, index)
        with atomic_file(out, overwrite=overwrite, inputs=[zoo.path]) as partial:
            entry = _write_checkpoint(zoo, index, partial, verify)
    entry["name"] = out.name
    return ExportResult(path, out, [entry],
                        provenance=_export_provenance(path, command, index=index,
                                                      overwrite=overwrite, verify=verify))


@public
def export_all(source: Source, out: str | os.PathLike, *, overwrite: bool = False,
               verify: bool = True, progress: bool = False, command: str | None = None
               ) -> ExportResult:
    """Write every checkpoint of a collection into a new folder as ``NNNNNN.safetensors``.

    The folder is built under a temporary name next to ``out`` and renamed into place
    when every file is written, so it appears complete or not at all.

    Parameters
    ----------
    source : path or Zoo
        An open collection, or the path of one (opened read-only for the call).
    out : path-like
        The new folder. Its parent must exist; it never holds the collection, and an
        existing folder is replaced only with ``overwrite=True``.
    overwrite : bool
        Replace an existing folder.
    verify : bool
        Check every checkpoint's digests as it is read (default); a corrupt one raises
        :class:`ChecksumError` with nothing written.
    progress : bool
        Show a progress bar.
    command : str, optional
        Recorded in the provenance.

    Returns
    -------
    ExportResult
        The folder, with every file's name, checkpoint index and SHA-256 in ``files``;
        the provenance records the collection's SHA-256.
    """
    from posteriorzoo.progress import progress as progress_bar

    out = Path(out)
    path = source_path(source)
    files = []
    with opened(source, verify=verify) as zoo, \
            atomic_directory(out, overwrite=overwrite, inputs=[zoo.path]) as partial:
        for index in progress_bar(range(len(zoo)), desc="export", unit="ckpt",
                                  enabled=progress):
            files.append(_write_checkpoint(zoo, index, partial / f"{index:06d}.safetensors",
                                           verify))
            fault_point("export-file")
    return ExportResult(path, out, files,
                        provenance=_export_provenance(path, command, index="all",
                                                      overwrite=overwrite, verify=verify))


# ---------------------------------------------------------------------- import
@dataclass
class ImportResult(CollectionResult):
    """What :func:`import_checkpoints` did.

    Attributes
    ----------
    path : Path
        The collection.
    created : bool
        Whether the collection was created by this import.
    indices : range
        Indices of the checkpoints appended.
    sources : list of str
        Where each appended checkpoint came from (file, or ``archive:member``).
    skipped_existing : int
        Inputs skipped because the collection already held the same tensors (an
        interrupted import run again, or a file imported twice).
    skipped_repeated : int
        Inputs skipped because an earlier input had the same tensors.
    inputs : int
        Input files given (safetensors files and archives; their SHA-256s are in the
        provenance).
    """

    kind = "import"
    path: Path
    created: bool
    indices: range
    sources: list[str]
    skipped_existing: int = 0
    skipped_repeated: int = 0
    inputs: int = 0

    @property
    def skipped(self) -> int:
        """Inputs not appended because their tensors were already stored or repeated."""
        return self.skipped_existing + self.skipped_repeated

    def payload(self) -> dict[str, Any]:
        return {"path": str(self.path), "created": self.created,
                "added": list(self.indices), "inputs": self.inputs,
                "sources": self.sources, "skipped_existing": self.skipped_existing,
                "skipped_repeated": self.skipped_repeated, "skipped": self.skipped}

    def tables(self) -> dict[str, str]:
        """``imported.csv``: the index and source of every checkpoint appended."""
        return {"imported.csv": csv_text(["checkpoint", "source"],
                                         zip(self.indices, self.sources, strict=True))}



@public
def plan_import(files: Iterable[str | os.PathLike], *, architecture: str | None = None,
                dataset: str | None = None, method: str | None = None,
                num_classes: int | None = None,
                model_options: Mapping[str, Any] | None = None,
                key_map: KeyMap | None = None,
                limits: ReadLimits | None = None) -> dict[str, Any]:
    """What :func:`import_checkpoints` would take from ``files`` for a new collection,
    from the inputs' headers alone (no tensor is decoded, nothing is written): each
    input's safetensors files or archive members taken (with the mode a member's name
    numbers, where the archive's numbering tells one) and the members skipped, the
    collection's attributes as the options and the archive's name give them, and the key
    map (a wrapper's prefix the keys would lose, a known layout's names they would
    take, in words under ``reading``, and the model options that implies). JSON-able."""
    files = [Path(file) for file in files]
    if not files:
        raise ZooFormatError("no input files given")
    current = limits or ReadLimits()
    inputs, first_keys = [], None
    for file in files:
        require_file(file)
        if sniff_format(file, current) == "safetensors":
            with open(file, "rb") as handle:
                keys = safetensors_keys(handle, file.stat().st_size, file.name, current)
            entry = {"input": str(file), "kind": "safetensors", "skipped": [],
                     "taken": [{"name": file.name, "bytes": file.stat().st_size,
                                "mode": None}]}
        else:
            taken, skipped, keys = [], [], None
            for name, size, member_keys in list_archive(file, current):
                (skipped if member_keys is None else taken).append(
                    {"name": name, "bytes": size})
                keys = keys if keys is not None else member_keys
            modes = member_modes(file.name, [item["name"] for item in taken])
            for item in taken:
                item["mode"] = modes.get(item["name"])
            entry = {"input": str(file), "kind": "archive", "taken": taken,
                     "skipped": skipped}
        inputs.append(entry)
        first_keys = first_keys if first_keys is not None else keys
    try:
        attributes: dict[str, Any] | None = collection_attributes(
            files[0], {}, architecture, dataset, method, num_classes, model_options)
    except PosteriorZooError:   # an exported checkpoint's header tells them at import
        attributes = None
    implied, reading = None, None
    if key_map is None and attributes is not None and first_keys:
        given = attributes["model_options"]
        reading = implied_reading(first_keys, expected_keys(attributes), lambda options:
                                  expected_keys({**attributes, "model_options": {**options,
                                                                                 **given}}))
        if reading is not None:
            implied, attributes["model_options"] = reading.key_map, {**reading.options, **given}
    chosen = key_map or implied or KeyMap()
    return {"inputs": inputs, "attributes": attributes,
            "checkpoints": sum(len(entry["taken"]) for entry in inputs),
            "key_map": {"rename": chosen.rename, "rules": chosen.rules, "drop": chosen.drop,
                        "implied": implied is not None,
                        "reading": None if reading is None else reading.what},
            "written": False}


@public
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
    checkpoints_per_batch: int = 64,
    progress: bool = False,
    limits: ReadLimits | None = None,
    verify: bool = True,
) -> ImportResult:
    """Append checkpoints from safetensors files and release archives to a collection.

    The collection is created if ``zoo_path`` does not exist; its attributes come from
    the arguments, else from the first exported checkpoint's header, else from the
    release archive's name (e.g. ``mnist-optunet-0-1023.tgz``). Floating tensors are
    cast to ``dtype`` if given (the release is float16).

    Rows in mode order, with no reorder pass
    (:mod:`posteriorzoo.collection._import_stream`): each new checkpoint is written
    straight to its row, rows of known mode by ``(mode_id, sample_id)`` and the others
    after them in input order. A new collection is built in one streaming pass, every
    input read once, unless the names do not tell the rows while streaming (inputs
    holding their modes out of order, a numbering only the last member settles): then
    the inputs are read a second time. An existing collection is not written to before
    every input is checked, so its inputs are read twice: once to check, once to write.

    All or nothing, and idempotent:

    - Every input is read and checked (format, sizes, header values, keys after
      ``key_map``, shapes, dtypes, finite values, metadata rows) before anything is
      committed; a bad input raises a :class:`PosteriorZooError` and leaves the
      collection as it was (nothing at ``zoo_path`` for a new one).
    - A new collection is built under a temporary name and appears only when complete:
      a failure or a kill leaves nothing at ``zoo_path``.
    - An existing collection gets batches of ``checkpoints_per_batch``, each committed
      atomically. An input whose tensors (as they would be stored) are already in the
      collection, or repeat an earlier input, is skipped and counted, so an import
      killed part-way is completed by running it again.

    What the inputs tell is recorded: an exported checkpoint keeps its metadata row; a
    member of a release archive whose name numbers it (``.../model_17.safetensors``) gets
    that number as its ``mode_id`` (and ``sample_id`` 0) when the collection is a deep
    ensemble (``de``, what a release's name implies), every member of the archive is
    numbered, the numbers are distinct, and none is a mode the collection or another
    input holds already (see :func:`posteriorzoo.zoo.archives.member_modes`). Otherwise
    the mode, like the seeds of an archive's members, stays unknown (``-1``).

    ``limits`` bounds what reading the inputs may cost (:class:`ReadLimits`). The
    checkpoint size bound is the architecture's (4x its float64 size, plus 1 MiB): that
    of the existing collection, else of the architecture given, else of the one the first
    input's header (or the archive's name) tells, read before any of its tensors; an
    input no architecture can be told for is refused before its tensors are read.

    With ``verify`` (default) an existing collection's checkpoints are checked against
    their digests before anything is appended (a corrupt collection is refused), and so
    is every input whose header records the SHA-256 of its tensors (an exported
    checkpoint): an altered input raises :class:`ChecksumError`. Inputs that record none
    (release archives, foreign files) are imported with one warning that says how many
    could not be checked.

    Returns
    -------
    ImportResult
        The collection, whether it was created, the indices and sources of the
        checkpoints appended and the inputs skipped; the provenance records the SHA-256
        of every input file.
    """
    files = [Path(file) for file in files]
    if not files:
        raise ZooFormatError("no input files given")
    check_integer("checkpoints_per_batch", checkpoints_per_batch, 1)
    zoo_path = Path(zoo_path)
    for file in files:
        require_file(file)
        if same_file(file, zoo_path):
            raise InvalidOptionError(f"{zoo_path}: the collection is also an input")
    exists = zoo_path.exists()
    given = {"architecture": architecture, "dataset": dataset, "method": method,
             "num_classes": num_classes}
    attributes: dict[str, Any] = {}
    stored: set[str] = set()
    taken_modes: set[int] = set()  # modes the collection or the inputs hold
    tensor_layout: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
    current = limits or ReadLimits()
    writer: Zoo | None = None
    if exists:
        # The writer's lock first: a second writer of the collection is told it is busy
        # before either reads anything, and nothing changes the file while this one reads
        # it and its inputs (it is not written to before the first append).
        writer = open_zoo(zoo_path, mode="r+", verify=verify)
    try:
        if writer is not None:
            zoo = writer
            zoo.verify_all()  # nothing is appended to a corrupt collection
            attributes = {"architecture": zoo.architecture, "dataset": zoo.dataset,
                          "method": zoo.method, "num_classes": zoo.num_classes,
                          "model_options": zoo.model_options}
            tensor_layout = zoo.tensor_layout
            stored = set(zoo.digests)
            taken_modes = {int(mode) for mode in zoo.metadata["mode_id"] if mode >= 0}
            given["model_options"] = dict(model_options) if model_options is not None else None
            for key, value in given.items():
                if value is not None and value != attributes[key]:
                    raise InvalidOptionError(f"{zoo_path} holds {key} {attributes[key]!r}, "
                                             f"not {value!r}")
            current = current.for_shapes(tensor_layout)
        else:
            check_output(zoo_path, inputs=files)
            implied = release_task(files[0]) or {}
            current = limits_for_architecture(
                current, architecture or implied.get("architecture"),
                num_classes if num_classes is not None else implied.get("num_classes"),
                model_options)
        # Archive members are named "ARCHIVE:MEMBER"; their numbers may tell their modes.
        archives = [f"{file.name}:" for file in files
                    if sniff_format(file, current) != "safetensors"]
        stream = ImportStream(
            zoo_path, files, {**given, "model_options": model_options}, writer=writer,
            attributes=attributes, tensor_layout=tensor_layout, stored=stored,
            taken_modes=taken_modes, limits=current, key_map=key_map, dtype=dtype,
            archives=archives, verify=verify, command=command, progress=progress)
        first = len(writer) if writer is not None else 0
        try:
            stream.read()
            for _ in stream.commit(stream.order(), checkpoints_per_batch):
                fault_point("import-batch")
        except BaseException:
            stream.close(failed=True)
            raise
        key_map = stream.key_map
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    if writer is not None:
        writer.close()
    else:
        assert stream.target is not None
        with stream.target:  # published as the block ends
            pass
    skipped_existing, skipped_repeated = stream.skipped_existing, stream.skipped_repeated
    described = {f"input {i}": describe_input(file, stream.file_digests.get(file))
                 for i, file in enumerate(files)}
    indices, sources = range(first, first + len(stream.sources)), stream.sources
    options = {"architecture": architecture, "dataset": dataset, "method": method,
               "num_classes": num_classes,
               "model_options": None if model_options is None else dict(model_options),
               "key_map": {"rename": key_map.rename, "rules": key_map.rules,
                           "drop": key_map.drop},
               "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
               "checkpoints_per_batch": checkpoints_per_batch, "verify": verify}
    return ImportResult(zoo_path, not exists, indices, sources,
                        skipped_existing, skipped_repeated, len(files),
                        provenance=record("posteriorzoo import", command=command,
                                          inputs=described, options=options))

