"""Creating and opening collection files: the crash-safe writer protocol.

Writers open a published collection in HDF5's single-writer/multiple-reader (SWMR) mode
from its first write on, whose on-disk structure stays consistent at every instant, and
follow one protocol (see :meth:`posteriorzoo.zoo.store.Zoo.append_many`): extend the
datasets, write whole checkpoints and their metadata rows, flush, and only then advance
``/committed``. A writer killed at any point leaves a file that readers open with
exactly the checkpoints committed before the kill. Every change a SWMR writer cannot make
(an upgrade, cutting off rows of an interrupted append) is made by rebuilding the file
from its committed checkpoints and their modes' training records into a temporary file
renamed over the original; the next writer does so too when it finds HDF5's "open for
write" flag left behind by a killed one. Writers hold
an exclusive ``flock`` on the file, so a second writer fails fast with
:class:`ZooBusyError` instead of corrupting it.

New files are built under a temporary name next to the target
(``.NAME.partial-PID-RANDOM``, the convention of :mod:`posteriorzoo.outputs`) and linked
into place, so a half-created collection is never visible and an existing file is never
replaced unless asked. With ``create_zoo(..., publish=False)`` the collection stays under
its temporary name while it is filled and appears only when :meth:`Zoo.publish` runs (or
its ``with`` block ends without an error): commands that derive a whole collection use
this, so a killed command leaves nothing. The temporary file of a killed process is
reclaimed by the next writer of that path.

A full disk is refused before writing where the size is known (a new file, a block of
checkpoints, a rebuild) with :class:`~posteriorzoo.errors.NoSpaceError`; a write that
fails anyway abandons the file (:func:`posteriorzoo.zoo.store.abandon`) so HDF5 never
crashes the process when it closes, and an unpublished file is deleted.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from posteriorzoo import outputs
from posteriorzoo._api import public
from posteriorzoo._faults import fault_point
from posteriorzoo.dtypes import as_numpy, numpy_dtype
from posteriorzoo.errors import (
    InvalidOptionError,
    OutputExistsError,
    ZooBusyError,
    ZooFormatError,
    ZooSchemaError,
)
from posteriorzoo.provenance import git_commit, library_versions
from posteriorzoo.zoo.architecture import check_architecture, check_tensor_dtypes
from posteriorzoo.zoo.layout import MODE_RECORDS, ROW_DIGEST_DTYPE, ROW_DIGESTS
from posteriorzoo.zoo.schema import (
    FORMAT_NAME,
    HDF5_FORMAT,
    HDF5_FORMAT_ATTRIBUTE,
    METADATA_DTYPE,
    RECORD_DTYPE,
    SCHEMA_VERSION,
    canonical_json,
    newest_schema,
    row_digest,
)
from posteriorzoo.zoo.store import (
    _CRASHED_WRITER_MARKERS,
    _METADATA_CHUNK_ROWS,
    _RECORD_CHUNK_ROWS,
    _STATE_GROUP,
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_ROWS,
    METADATA_MARGIN,
    Zoo,
    close_or_abandon,
    create_h5,
    new_bytes,
    open_h5,
    reserved,
    writing_h5,
)


def _chunk_rows(shape: tuple[int, ...], dtype: np.dtype, chunk_bytes: int) -> int:
    per_checkpoint = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return int(min(MAX_CHUNK_ROWS, max(1, chunk_bytes // per_checkpoint)))


def _require_file(path: Path) -> None:
    if not path.exists():
        raise ZooFormatError(f"{path}: no such file")
    if not path.is_file():
        raise ZooFormatError(f"{path}: not a file")
    if not h5py.is_hdf5(path):
        raise ZooFormatError(f"{path}: not an HDF5 file")


def normalise_template(template: Mapping[str, Any]
                       ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{key: (shape, dtype)}`` from a state_dict, arrays, meta tensors or (shape, dtype)."""
    tensor_layout = {}
    for key, value in template.items():
        if isinstance(value, tuple) and len(value) == 2 and not isinstance(value[0], int):
            shape, dtype = value
            tensor_layout[key] = (tuple(int(s) for s in shape), np.dtype(dtype))
        else:
            array = as_numpy(value) if not isinstance(value, torch.Tensor) or \
                value.device.type != "meta" else np.empty(0, numpy_dtype(value.dtype))
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else array.shape
            tensor_layout[key] = (tuple(int(s) for s in shape), array.dtype)
    if not tensor_layout:
        raise ZooSchemaError("the template state_dict is empty")
    return tensor_layout


@public
def create_zoo(
    path: str | os.PathLike,
    *,
    architecture: str,
    dataset: str,
    method: str,
    template: Mapping[str, Any],
    num_classes: int | None = None,
    model_options: Mapping[str, Any] | None = None,
    recipe: Mapping[str, Any] | None = None,
    annotations: Mapping[str, Any] | None = None,
    command: str | None = None,
    validate: bool = True,
    overwrite: bool = False,
    publish: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Zoo:
    """Create an empty collection and return it opened for appending.

    Parameters
    ----------
    path : path-like
        The new ``.h5`` file. Its folder must exist. It is built under a temporary name
        and linked into place.
    architecture : str
        A model name of :mod:`posteriorzoo.models`; with ``validate=True`` the template's
        keys and shapes must match ``build(architecture, num_classes, **model_options)``.
    dataset, method : str
        Training data set and posterior approximation, e.g. ``"fashion-mnist"``, ``"de"``.
    template : mapping
        A state_dict (tensors or arrays), or ``{key: (shape, dtype)}``: the keys, order,
        shapes and dtypes every checkpoint must have.
    num_classes : int, optional
    model_options : mapping, optional
    recipe : mapping, optional
        JSON-serialisable training recipe, stored as a file attribute.
    annotations : mapping, optional
        JSON-serialisable facts about how the collection was derived (e.g. which
        symmetries were removed), stored as a file attribute.
    command : str, optional
        The command that produced the collection (provenance); defaults to none recorded.
    validate : bool
        Check the template against the registered architecture (unknown names raise).
    overwrite : bool
        Replace an existing file; otherwise an existing path raises OutputExistsError.
    publish : bool
        Put the file in place now (default). With False it keeps its temporary name until
        :meth:`Zoo.publish` or the end of its ``with`` block; an error in the block, or
        :meth:`Zoo.discard`, deletes it.
    chunk_bytes : int
        Target bytes per chunk of each state dataset.
    """
    path = Path(path)
    model_options = dict(model_options or {})
    tensor_layout = normalise_template(template)
    check_tensor_dtypes(tensor_layout)  # numbers the layout check would refuse at open
    if validate:
        check_architecture(architecture, tensor_layout, num_classes, model_options)
    if not path.parent.is_dir():
        raise InvalidOptionError(f"{path}: the folder {path.parent} does not exist")
    if path.is_dir():  # overwrite replaces a file, never a folder
        raise InvalidOptionError(f"{path}: is a folder; a collection is a file")
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{path}: already exists (open it with mode='r+' to append)")
    try:
        json_attributes = {"model_options": canonical_json(model_options),
                           "recipe": canonical_json(dict(recipe or {})),
                           "annotations": canonical_json(dict(annotations or {}))}
    except (TypeError, ValueError) as error:
        raise ZooSchemaError(f"collection attributes are not JSON-serialisable: {error}") \
            from None
    provenance = {"command": command, "versions": library_versions(),
                  "git_commit": git_commit(),
                  "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    outputs.ensure_space(path.parent, METADATA_MARGIN)  # an empty collection: about 10 kB
    # The temporary file is locked from its first byte: see posteriorzoo.outputs.
    temporary, fd = outputs.new_partial(path)
    try:
        with outputs.space_errors(path.parent, needed=METADATA_MARGIN), \
                writing_h5(create_h5(temporary), temporary, METADATA_MARGIN) as handle:
            _write_layout(handle, tensor_layout, architecture, dataset, method, num_classes,
                          json_attributes, provenance, validate, chunk_bytes)
        if publish:
            outputs.publish(temporary, path, overwrite=overwrite)
        zoo = _writer(path if publish else temporary, fd, final_path=None if publish else path)
    except BaseException:
        os.close(fd)
        temporary.unlink(missing_ok=True)
        raise
    zoo._overwrite = overwrite
    return zoo


def _write_layout(handle: h5py.File, tensor_layout: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                  architecture: str, dataset: str, method: str, num_classes: int | None,
                  json_attributes: Mapping[str, str], provenance: Mapping[str, Any],
                  validate: bool, chunk_bytes: int) -> None:
    """The attributes and empty datasets of a new collection file."""
    attrs = handle.attrs
    attrs["format"] = FORMAT_NAME
    attrs["schema_version"] = SCHEMA_VERSION
    attrs["architecture"] = architecture
    attrs["dataset"] = dataset
    attrs["method"] = method
    attrs["num_classes"] = -1 if num_classes is None else int(num_classes)
    for name, text in json_attributes.items():
        attrs[name] = text
    attrs["state_keys"] = json.dumps(list(tensor_layout))
    attrs["created_by"] = canonical_json(dict(provenance))
    attrs["validated"] = bool(validate)
    attrs[HDF5_FORMAT_ATTRIBUTE] = HDF5_FORMAT[1]
    # Which plugin module provides a model of your own (model_module, model_package), so
    # that a command meeting this file without it can say what to load.
    from posteriorzoo.models.registry import provider_attributes

    attrs.update(provider_attributes(architecture))
    group = handle.create_group(_STATE_GROUP)
    for key, (shape, dtype) in tensor_layout.items():
        rows = _chunk_rows(shape, dtype, chunk_bytes)
        group.create_dataset(key, shape=(0, *shape), maxshape=(None, *shape),
                             chunks=(rows, *shape) if shape else (rows,), dtype=dtype)
    handle.create_dataset("metadata", shape=(0,), maxshape=(None,),
                          chunks=(_METADATA_CHUNK_ROWS,), dtype=METADATA_DTYPE)
    handle.create_dataset(ROW_DIGESTS, shape=(0,), maxshape=(None,),
                          chunks=(_METADATA_CHUNK_ROWS,), dtype=ROW_DIGEST_DTYPE)
    _create_records(handle, np.zeros(0, dtype=RECORD_DTYPE))
    handle.create_dataset("committed", data=np.zeros(1, dtype=np.int64))


def _create_records(handle: h5py.File, rows: np.ndarray) -> None:
    """``/mode_records`` holding ``rows``: made with the file, because a writer in SWMR
    mode (every append) cannot create members."""
    handle.create_dataset(MODE_RECORDS, data=rows, maxshape=(None,),
                          chunks=(_RECORD_CHUNK_ROWS,), dtype=RECORD_DTYPE)


@public
def open_zoo(path: str | os.PathLike, mode: str = "r", *, verify: bool = False) -> Zoo:
    """Open an existing collection; the modes mean what they mean in h5py.

    ``"r"``: read only. ``"r+"``: read and append. ``"a"``: the same as ``"r+"`` for an
    existing file (h5py's ``"a"`` would also create a missing one, but a new collection
    needs its architecture and layout: use :func:`create_zoo`). ``"w"``, ``"w-"`` and
    ``"x"`` create files: use :func:`create_zoo` too.

    Reading never modifies the file and works while a writer appends. Appending takes an
    exclusive lock; if the previous writer was killed, the file is first rebuilt from its
    committed checkpoints (nothing committed is lost). With ``verify=True`` every
    checkpoint's digests are checked as it is read (see :class:`Zoo`).
    """
    if mode in ("w", "w-", "x"):
        raise InvalidOptionError(f"mode {mode!r} creates a file; create a collection with "
                                 "create_zoo(path, architecture=..., template=...)")
    if mode not in ("r", "r+", "a"):
        raise InvalidOptionError(f"mode must be 'r' (read) or 'r+' (read and append; 'a' "
                                 f"is the same for an existing file), not {mode!r}")
    path = Path(path)
    _require_file(path)
    if mode == "r":
        handle = open_h5(path, "r")
        try:
            return Zoo(path, handle, verify=verify)
        except BaseException:
            handle.close()
            raise
    zoo = _open_for_append(path)
    zoo.verify = verify
    return zoo


@public
def upgrade_zoo(path: str | os.PathLike) -> str | None:
    """Rewrite a collection in place in the newest schema its metadata table allows and
    within the HDF5 format bounds (:data:`~posteriorzoo.zoo.schema.HDF5_FORMAT`), if it
    is not so already.

    A schema 1 or 2 file becomes schema 3 (training records); the metadata table and its
    row digests are copied as they are, so a file of schema 1 to 3 stays without the
    column ``chain`` of schema 4 (:mod:`posteriorzoo.zoo.schema`).

    Every committed checkpoint, metadata row, digest and training record is copied into a
    temporary file renamed over the original, under the writer's lock: a kill leaves the
    file as it was or rewritten, never between. An append does the same when it must;
    this does it without appending (e.g. for files of an earlier posteriorzoo, whose
    newest formats HDF5 1.10 and 1.14 cannot read).

    Returns
    -------
    str or None
        Why the file was rewritten, or None when it was left as it was.
    """
    path = Path(path)
    _require_file(path)
    fd = _lock(path)
    try:
        open_zoo(path).close()  # checked first: a damaged file is refused, not rewritten
        reason = _rebuild_reason(path)
        if reason is not None:
            os.close(_rebuild_from_committed(path))
        return reason
    finally:
        os.close(fd)


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ZooBusyError(f"{path}: another process is writing to this collection") from None
    return fd


def _writer(path: Path, fd: int, final_path: Path | None = None) -> Zoo:
    """A writable Zoo on ``path``, whose lock ``fd`` the caller holds (and hands over).

    The file must be clean (:func:`_rebuild_reason` is None): it is opened straight in
    SWMR mode, so no moment of an append leaves it marked as written outside SWMR.
    """
    handle = open_h5(path, "a")
    fault_point("zoo-opened")
    try:
        return Zoo(path, handle, lock_fd=fd, final_path=final_path)
    except BaseException:
        close_or_abandon(handle)
        raise


def _rebuild_reason(path: Path) -> str | None:
    """Why the collection at ``path`` must be rebuilt before an append, or None.

    A writer in SWMR mode can only extend datasets and write into them, so every other
    change is made by rebuilding the file from its committed checkpoints into a temporary
    file renamed over it (:func:`_rebuild_from_committed`), which a kill leaves either
    undone or done: a writer that was killed (HDF5's "open for writing" flag is set), a
    schema 1 or 2 file, rows past the committed count (an interrupted append that closed),
    training records of modes that never committed, and a file written before the format
    bounds of :data:`~posteriorzoo.zoo.schema.HDF5_FORMAT`.
    """
    try:
        handle = h5py.File(path, "r", locking=False)  # plain: refused while flagged
    except OSError as error:
        if any(marker in str(error) for marker in _CRASHED_WRITER_MARKERS):
            return "its last writer was killed"
        raise ZooFormatError(f"{path}: cannot be read as HDF5 (truncated or corrupt): "
                             f"{error}") from None
    with Zoo(path, handle) as zoo:
        if handle.attrs.get(HDF5_FORMAT_ATTRIBUTE) != HDF5_FORMAT[1]:
            return f"it was written with HDF5 formats newer than {HDF5_FORMAT[1]}"
        if not zoo.has_training_records:
            return "its schema is older than 3"
        count = len(zoo)
        growing = [*zoo._datasets.values(), handle["metadata"], handle[ROW_DIGESTS]]
        if any(dataset.shape[0] != count for dataset in growing):
            return "it has rows past its committed count"
        if sorted(zoo.record_rows().values()) != list(range(handle[MODE_RECORDS].shape[0])):
            return "it has training records of modes that never committed"
    return None


def _upgraded_attributes(attrs: dict[str, Any], table: np.dtype) -> dict[str, Any]:
    """The root attributes of a rebuilt file: the newest schema whose metadata table is
    ``table`` (the file's, kept with its digests) and the format bound."""
    return {**attrs, "schema_version": newest_schema(table),
            HDF5_FORMAT_ATTRIBUTE: HDF5_FORMAT[1]}


def _open_for_append(path: Path) -> Zoo:
    """A writer on ``path``: locked and checked. A clean file is opened in SWMR mode at
    once (which changes no byte of it before an append); one that must be rebuilt first
    (:func:`_rebuild_reason`) is read only until its first append, so that opening a
    writer and being refused an append leave the file as it was."""
    fd = _lock(path)
    try:
        # Checked under the lock, so no other writer changes it meanwhile; a damaged or
        # crafted file is refused here and never opened for writing.
        open_zoo(path).close()
        if _rebuild_reason(path) is None:
            return _writer(path, fd)
        handle = open_h5(path, "r")
        try:
            zoo = Zoo(path, handle, lock_fd=fd)
        except BaseException:
            handle.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    zoo._start_writing = _start_writing
    return zoo


def _start_writing(path: Path, fd: int) -> tuple[h5py.File, int]:
    """Open the locked, checked collection at ``path`` for appending, rebuilding it first
    where a writer in SWMR mode could not append to it as it is (:func:`_rebuild_reason`).
    Returns the handle and the lock, a new one if the file was rebuilt; releases the lock
    if it fails."""
    try:
        if _rebuild_reason(path) is not None:
            # We hold the lock: a writer that left its flag behind is dead.
            new_fd = _rebuild_from_committed(path)
            os.close(fd)
            fd = new_fd
        return open_h5(path, "a"), fd
    except BaseException:
        os.close(fd)
        raise


def _rebuild_from_committed(path: Path) -> int:
    """Copy the committed checkpoints of a collection, and the training records of their
    modes, into a clean file (of the newest schema of its metadata table, and the format
    bounds) that replaces it.

    Returns a locked descriptor of the new file, which has replaced ``path``.
    """
    with Zoo(path, open_h5(path, "r")) as old:
        attrs = dict(old._file.attrs)
        tensor_layout = old.tensor_layout
        count = len(old)
        rows = old.stored_metadata()
        if old.has_row_digests:
            digests = old._file[ROW_DIGESTS][:count]
        else:
            digests = np.array([row_digest(row).encode() for row in rows],
                               dtype=ROW_DIGEST_DTYPE)
        keep = sorted(old.record_rows().values())
        records = (old._file[MODE_RECORDS][keep] if keep
                   else np.zeros(0, dtype=RECORD_DTYPE))
        attrs = _upgraded_attributes(attrs, rows.dtype)
        growing = [*old._datasets.values(), old._file["metadata"]]
        needed = (METADATA_MARGIN + new_bytes(growing, 0, count) + len(digests) * 64
                  + len(records) * RECORD_DTYPE.itemsize)
        outputs.ensure_space(path.parent, needed)
        temporary, fd = outputs.new_partial(path)
        try:
            with writing_h5(create_h5(temporary), temporary, needed) as new, \
                    reserved(new, temporary, needed):
                for name, value in attrs.items():
                    new.attrs[name] = value
                group = new.create_group(_STATE_GROUP)
                for key, (shape, dtype) in tensor_layout.items():
                    source = old._datasets[key]
                    target = group.create_dataset(key, shape=(count, *shape),
                                                  maxshape=(None, *shape),
                                                  chunks=source.chunks, dtype=dtype)
                    for start, block in old.layer_blocks(key):
                        target[start:start + block.shape[0]] = block
                new.create_dataset("metadata", data=rows, maxshape=(None,),
                                   chunks=(_METADATA_CHUNK_ROWS,), dtype=rows.dtype)
                new.create_dataset(ROW_DIGESTS, data=digests, maxshape=(None,),
                                   chunks=(_METADATA_CHUNK_ROWS,), dtype=ROW_DIGEST_DTYPE)
                _create_records(new, records)
                new.create_dataset("committed", data=np.array([count], dtype=np.int64))
            fault_point("zoo-rebuilt")
            os.replace(temporary, path)
        except BaseException:
            os.close(fd)
            temporary.unlink(missing_ok=True)
            raise
    return fd
