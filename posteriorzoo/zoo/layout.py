"""What a collection file must look like before anything in it is trusted.

:func:`read_layout` checks an open HDF5 file against the collection format and returns
its parsed attributes. It refuses, with one :class:`ZooFormatError` line each:

- links of any kind but hard links (soft links, external links to other files);
- datasets whose bytes live elsewhere (external storage, virtual datasets) or pass
  through filters (compression: a small file could expand without bound; the store
  never compresses);
- members that are not part of the format, a state entry that is a group, a metadata
  table of another dtype than its schema version's
  (:func:`~posteriorzoo.zoo.schema.metadata_dtype`: schema 4 added the column
  ``chain``), a committed count that is negative, not an integer or larger
  than the rows behind it;
- a training-record table (``/mode_records``, schema 3) of another dtype or shape, not
  chunked and resizable, or with more rows than the metadata table (each record row is
  written after its mode's checkpoint rows);
- attributes of the wrong type or with invalid JSON, and a ``num_classes`` beyond
  :data:`MAX_CLASSES` (or 0);
- state datasets that are not little-endian floating-point or integer numbers (booleans,
  complex numbers, big-endian bytes, more than 8 bytes a number): whether an integer
  tensor is right (BatchNorm's ``num_batches_tracked`` is) is the architecture check's;
- more committed bytes than the file can hold (rows declared but never written), and
  more rows than the committed ones and one append (:data:`MAX_APPEND_ROWS`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from posteriorzoo.errors import ZooFormatError
from posteriorzoo.zoo.schema import FORMAT_NAME, RECORD_DTYPE, SCHEMA_VERSION, metadata_dtype

STATE_GROUP = "state"
METADATA = "metadata"
COMMITTED = "committed"
#: Per-row SHA-256 of the metadata table (schema 2 and later).
ROW_DIGESTS = "metadata_sha256"
ROW_DIGEST_DTYPE = np.dtype("S64")
#: One row per recorded mode: what its method phase recorded while training (schema 3).
MODE_RECORDS = "mode_records"
#: The members of each schema version's files (schema 4 has schema 3's; its metadata
#: table has the column ``chain`` too: :func:`posteriorzoo.zoo.schema.metadata_dtype`).
_MEMBERS_OF = {1: {STATE_GROUP, METADATA, COMMITTED},
               2: {STATE_GROUP, METADATA, COMMITTED, ROW_DIGESTS},
               3: {STATE_GROUP, METADATA, COMMITTED, ROW_DIGESTS, MODE_RECORDS},
               4: {STATE_GROUP, METADATA, COMMITTED, ROW_DIGESTS, MODE_RECORDS}}
_JSON_ATTRIBUTES = {"model_options": dict, "recipe": dict, "created_by": dict,
                    "state_keys": list, "annotations": dict}
_STRING_ATTRIBUTES = ("architecture", "dataset", "method")
_REQUIRED = ("architecture", "dataset", "method", "num_classes", "model_options", "recipe",
             "state_keys", "created_by")
#: Most checkpoints one append adds (:meth:`posteriorzoo.zoo.Zoo.append_many`), and so
#: the most rows a dataset may have past the committed count (a writer extends the
#: datasets before it commits, and a killed one leaves them so): a declared size beyond it
#: is refused before anything is read, so that no reader or writer works in proportion to
#: rows that were never written.
MAX_APPEND_ROWS = 1 << 20
#: Most output classes a collection may declare, as the command line's --num-classes: the
#: last layer holds num_classes x features weights, so a huge count would make building
#: the network (even on the meta device) fail inside torch.
MAX_CLASSES = 100_000
#: Kinds of number a state dataset may hold: floating point, signed and unsigned integers.
_TENSOR_KINDS = "fiu"


@dataclass
class Layout:
    """The parsed, checked attributes of a collection file."""

    schema_version: int
    architecture: str
    dataset: str
    method: str
    num_classes: int | None
    model_options: dict[str, Any]
    recipe: dict[str, Any]
    annotations: dict[str, Any]
    created_by: dict[str, Any]
    state_keys: list[str]
    validated: bool
    committed: int
    #: The plugin that provides a model of your own (``--models`` takes it), and the
    #: package whose entry point named it; None for the built-in models.
    model_module: str | None = None
    model_package: str | None = None


def _fail(path: Path, message: str) -> ZooFormatError:
    return ZooFormatError(f"{path}: {message}")


def _check_links_and_storage(handle: h5py.File, path: Path) -> None:
    """Refuse soft and external links, external or virtual storage, and filters."""
    links: list[tuple[str, object]] = []
    # Collect first, judge after: an exception raised inside h5py's visitor callback
    # surfaces as a SystemError instead of itself.
    handle.visititems_links(lambda name, link: links.append((name, link)))
    for name, link in links:
        if not isinstance(link, h5py.HardLink):
            kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
            raise _fail(path, f"/{name} is {kind}; a collection holds no links")
    for name, _ in links:
        item = handle[name]
        if isinstance(item, h5py.Dataset):
            if item.is_virtual:
                raise _fail(path, f"/{name} is a virtual dataset; refused")
            if item.external:
                raise _fail(path, f"/{name} keeps its bytes in another file; refused")
            if item.id.get_create_plist().get_nfilters():
                raise _fail(path, f"/{name} is compressed or filtered; collections store "
                                  "raw bytes only")


def _string(attrs: h5py.AttributeManager, name: str, path: Path) -> str:
    value = attrs[name]
    if isinstance(value, bytes | np.bytes_):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(path, f"attribute {name!r} is not UTF-8 text") from None
    if not isinstance(value, str):
        raise _fail(path, f"attribute {name!r} is not text")
    return value


def _json(attrs: h5py.AttributeManager, name: str, path: Path, default: str | None = None
          ) -> Any:
    text = default if name not in attrs and default is not None else _string(attrs, name, path)
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise _fail(path, f"attribute {name!r} is not valid JSON") from None
    expected = _JSON_ATTRIBUTES[name]
    if not isinstance(value, expected):
        raise _fail(path, f"attribute {name!r} is not a JSON {expected.__name__}")
    return value


def _integer(value: object, what: str, path: Path) -> int:
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise _fail(path, f"{what} is not an integer")
    return int(value)


def read_layout(handle: h5py.File, path: str | os.PathLike) -> Layout:
    """Check ``handle`` against the collection format; return its parsed attributes."""
    path = Path(path)
    attrs = handle.attrs
    if attrs.get("format") != FORMAT_NAME:
        raise _fail(path, "not a posteriorzoo collection (no format marker)")
    version = _integer(attrs.get("schema_version", -1), "schema_version", path)
    if version > SCHEMA_VERSION:
        raise _fail(path, f"schema version {version} is newer than this posteriorzoo "
                          f"understands ({SCHEMA_VERSION}); upgrade posteriorzoo")
    if version < 1:
        raise _fail(path, f"schema version {version} is invalid")
    absent = [name for name in _REQUIRED if name not in attrs]
    members = set(handle.keys())
    expected = _MEMBERS_OF[version]
    absent += [f"/{member}" for member in sorted(expected - members)]
    if absent:
        raise _fail(path, f"damaged collection, missing {absent}")
    unexpected = sorted(members - expected)
    if unexpected:
        raise _fail(path, f"unexpected members {unexpected[:3]}; not a collection file")
    _check_links_and_storage(handle, path)

    strings = {name: _string(attrs, name, path) for name in _STRING_ATTRIBUTES}
    empty = [name for name, value in strings.items() if not value.strip()]
    if empty:
        raise _fail(path, f"attribute {empty[0]!r} is empty")
    num_classes = _integer(attrs["num_classes"], "attribute 'num_classes'", path)
    if num_classes == 0 or num_classes > MAX_CLASSES:
        raise _fail(path, f"attribute 'num_classes' is {num_classes}; a collection has 1 to "
                          f"{MAX_CLASSES} classes (or -1: the model's default)")
    keys = _json(attrs, "state_keys", path)
    if not keys or not all(isinstance(key, str) and key for key in keys) \
            or len(set(keys)) != len(keys):
        raise _fail(path, "attribute 'state_keys' is not a list of distinct names")
    layout = Layout(
        schema_version=version, **strings,
        num_classes=None if num_classes < 0 else num_classes,
        model_options=_json(attrs, "model_options", path), recipe=_json(attrs, "recipe", path),
        annotations=_json(attrs, "annotations", path, default="{}"),
        created_by=_json(attrs, "created_by", path), state_keys=list(keys),
        validated=bool(attrs.get("validated", True)), committed=0)
    layout.model_module, layout.model_package = _model_provider(attrs, path)
    layout.committed = _check_datasets(handle, path, layout)
    return layout


def _model_provider(attrs: h5py.AttributeManager, path: Path
                    ) -> tuple[str | None, str | None]:
    """The attributes ``model_module`` and ``model_package``, checked: they are shown in
    messages and named to be loaded, so they must be the names they claim to be."""
    from posteriorzoo.models.plugins import ModelPluginError, check_provider

    module = _string(attrs, "model_module", path) if "model_module" in attrs else None
    package = _string(attrs, "model_package", path) if "model_package" in attrs else None
    try:
        check_provider(module, package)
    except ModelPluginError as error:
        raise _fail(path, str(error)) from None
    return module, package


def _dataset(handle: h5py.File, name: str, path: Path) -> h5py.Dataset:
    item = handle[name]
    if not isinstance(item, h5py.Dataset):
        raise _fail(path, f"/{name} is not a dataset")
    return item


def _check_datasets(handle: h5py.File, path: Path, layout: Layout) -> int:
    """Check the metadata, committed count and state datasets; return the committed count."""
    committed_ds = _dataset(handle, COMMITTED, path)
    if committed_ds.shape != (1,) or committed_ds.dtype.kind not in "iu":
        raise _fail(path, "/committed is not one integer")
    if handle.swmr_mode:
        committed_ds.refresh()
    committed = int(committed_ds[0])
    if committed < 0:
        raise _fail(path, f"/committed is negative ({committed})")
    # The record table's length first: a writer extends the metadata table before it,
    # so a reader following a writer never sees more records than metadata rows.
    records = _dataset(handle, MODE_RECORDS, path) if layout.schema_version >= 3 else None
    record_rows = records.shape[0] if records is not None and records.ndim == 1 else 0
    metadata = _dataset(handle, METADATA, path)
    table = metadata_dtype(layout.schema_version)
    if metadata.dtype != table or metadata.ndim != 1:
        raise _fail(path, f"/metadata has another layout than schema "
                          f"{layout.schema_version}'s metadata table")
    rows = [metadata.shape[0]]
    if layout.schema_version >= 2:
        digests = _dataset(handle, ROW_DIGESTS, path)
        if digests.dtype != ROW_DIGEST_DTYPE or digests.ndim != 1:
            raise _fail(path, f"/{ROW_DIGESTS} is not a column of SHA-256 digests")
        rows.append(digests.shape[0])
    if records is not None:
        _check_records(records, record_rows, metadata.shape[0], path)
    group = handle[STATE_GROUP]
    if not isinstance(group, h5py.Group):
        raise _fail(path, "/state is not a group")
    names = set(group.keys())
    missing = [key for key in layout.state_keys if key not in names]
    if missing:
        raise _fail(path, f"state datasets missing: {missing[:3]}")
    extra = sorted(names - set(layout.state_keys))
    if extra:
        raise _fail(path, f"state datasets not listed in state_keys: {extra[:3]}")
    checkpoint_bytes = table.itemsize
    for key in layout.state_keys:
        dataset = group[key]
        if not isinstance(dataset, h5py.Dataset):
            raise _fail(path, f"state entry {key!r} is not a dataset")
        if dataset.ndim < 1:
            raise _fail(path, f"state dataset {key!r} has an unsupported layout "
                              f"({dataset.dtype}, {dataset.ndim} axes)")
        problem = tensor_dtype_problem(dataset.dtype)
        if problem:
            raise _fail(path, f"state dataset {key!r} has dtype {dataset.dtype} "
                              f"({problem})")
        rows.append(dataset.shape[0])
        checkpoint_bytes += int(np.prod(dataset.shape[1:], dtype=np.int64)) * \
            dataset.dtype.itemsize
    if committed > min(rows):
        raise _fail(path, f"committed count {committed} exceeds the {min(rows)} rows stored")
    if max(rows) - committed > MAX_APPEND_ROWS:
        raise _fail(path, f"declares {max(rows)} rows, more than its {committed} committed "
                          f"checkpoints and one append of at most {MAX_APPEND_ROWS}")
    size = os.fstat(handle.id.get_vfd_handle()).st_size if _has_fd(handle) else None
    if size is not None and committed * checkpoint_bytes > size:
        raise _fail(path, f"declares {committed} checkpoints of {checkpoint_bytes} bytes, "
                          f"more than the file's {size} bytes")
    return committed


def tensor_dtype_problem(dtype: np.dtype) -> str | None:
    """Why a state dataset of ``dtype`` cannot be read as weights, or None if it can.

    The store writes little-endian numbers; torch reads native (little-endian) bytes only,
    so a big-endian dataset is refused rather than converted behind every reader's back.
    """
    if dtype.kind not in _TENSOR_KINDS or dtype.itemsize > 8:
        return "a collection stores floating-point weights and integer counters only"
    if dtype != dtype.newbyteorder("<"):
        return "big-endian; a collection stores little-endian numbers"
    return None


def _check_records(records: h5py.Dataset, record_rows: int, metadata_rows: int, path: Path
                   ) -> None:
    """``/mode_records``: exactly the format's table, chunked and resizable, and no longer
    than the metadata table (a record row is written after its mode's checkpoint rows)."""
    if records.dtype != RECORD_DTYPE or records.ndim != 1:
        raise _fail(path, f"/{MODE_RECORDS} has another layout than this schema's table of "
                          "training records")
    if records.chunks is None or records.maxshape != (None,):
        raise _fail(path, f"/{MODE_RECORDS} is not a chunked, resizable table")
    if record_rows > metadata_rows:
        raise _fail(path, f"/{MODE_RECORDS} declares {record_rows} training records, "
                          f"more than the {metadata_rows} checkpoint rows stored")


def _has_fd(handle: h5py.File) -> bool:
    try:
        return handle.driver in ("sec2", "stdio") and handle.id.get_vfd_handle() >= 0
    except (ValueError, OSError, RuntimeError):  # pragma: no cover - other drivers
        return False
