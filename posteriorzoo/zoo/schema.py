"""The fixed parts of a collection file: format marker, metadata columns, digests.

A collection is one HDF5 file::

    /                attrs: format, schema_version, architecture, dataset, method,
                            num_classes, model_options, recipe, state_keys, created_by,
                            hdf5_format (:data:`HDF5_FORMAT`)
    /state/<key>     one dataset per parameter or buffer, shape (N, *tensor_shape),
                     chunked along the checkpoint axis so a layer read is contiguous
    /metadata        one row per checkpoint (compound dtype, columns below; the
                     columns of a file's schema version, :func:`metadata_dtype`)
    /metadata_sha256 one SHA-256 per metadata row (schema 2), so a changed value in
                     the table (an accuracy, a seed) is detected like a changed weight
    /mode_records    one row per recorded mode (schema 3; :data:`RECORD_DTYPE`):
                     ``mode_id``, ``record`` (what the mode's method phase recorded while
                     training, as canonical JSON of at most :data:`RECORD_BYTES` bytes)
                     and ``sha256`` (the digest of those bytes)
    /committed       int64[1]: the number of complete checkpoints; rows past it are
                     leftovers of an interrupted append and are never read

Nothing else: no links, no external or virtual storage, no compression
(:mod:`posteriorzoo.zoo.layout` refuses files that have them). Schema 1 files (without
row digests) and schema 2 files (without training records) are read; a writer upgrades
them to schema 3 before it appends. Schema 4 added the metadata column ``chain``
(:data:`COLUMN_SINCE`); files of schemas 1 to 3 are read as they are, their ``chain``
reading -1 (not recorded). Rows are stored in their file's own table: an append to a
schema 1 to 3 file stores no ``chain`` (a chain given for it is dropped, with a warning,
rather than refused, so that a training run begun before schema 4 can still be resumed;
its rows then all say "not recorded", which is the truth), and a rebuild keeps a file's
table (no row is re-hashed). New files are schema 4.

Each row's SHA-256 (:func:`row_digest`) covers the row's bytes in the table it is stored
in, so the digests of an earlier schema's rows stay valid as written.

A training record belongs to the collection once its mode has committed checkpoints: a
record row is written in the same block as its mode's checkpoints, before the committed
count advances, so a killed writer leaves either no record or one whose mode was
committed. A mode recorded twice (a resumed run appends it again) is described by its
last row. Records are JSON objects whose numbers are finite (``null`` where unknown).

Every object is written within HDF5's 1.10 format bounds (:data:`HDF5_FORMAT`, h5py's
``libver``), so HDF5 1.10 and every later version read the whole file, from any language:
the newest formats (HDF5 2.0's, h5py's default ``libver="latest"``) encode the metadata
table's boolean column and the attributes in datatype messages that HDF5 1.10 and 1.14
cannot decode. The root attribute ``hdf5_format`` records the bound; a file without it
(written by an earlier posteriorzoo, with the newest formats) is rewritten within the
bound the next time a writer opens it (see :mod:`posteriorzoo.zoo.lifecycle`).

Strings in the metadata are fixed-length UTF-8 bytes, because HDF5's single-writer /
multiple-reader mode (used for crash-safe appends) does not support variable-length data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.errors import ZooSchemaError

FORMAT_NAME = "posteriorzoo-collection"
SCHEMA_VERSION = 4
#: h5py ``libver`` bounds of every write: the oldest and the newest object formats used.
#: HDF5 1.10's, the oldest that single-writer / multiple-reader appends need (superblock
#: version 3) and the newest that HDF5 1.10 (Debian 12's python3-h5py) can read.
HDF5_FORMAT: tuple[str, str] = ("v110", "v110")
#: The root attribute that records the bound: ``"v110"``.
HDF5_FORMAT_ATTRIBUTE = "hdf5_format"
#: The largest training record, in bytes of canonical JSON (a ResNet-18 BBB record, 62
#: tensors' sigmas, takes about 8 kB).
RECORD_BYTES = 16384
#: One row of ``/mode_records``.
RECORD_DTYPE = np.dtype([("mode_id", "<i8"), ("record", f"S{RECORD_BYTES}"),
                         ("sha256", "S64")])
#: Nesting deeper than this is not a record but an attack on the JSON parser.
_RECORD_DEPTH = 32


@dataclass(frozen=True)
class Column:
    """One metadata column: name, numpy dtype, value when unknown, and meaning."""

    name: str
    dtype: str
    missing: object
    doc: str


METADATA_COLUMNS: tuple[Column, ...] = (
    Column("seed", "<i8", -1, "seed of initialisation (and of everything not listed apart)"),
    Column("data_seed", "<i8", -1, "seed of the data order and augmentation"),
    Column("method", "S32", b"", "posterior approximation that produced the checkpoint"),
    Column("mode_id", "<i8", -1, "the base network (mode) the sample belongs to: a DE "
           "member's own index, the network a method's samples surround (SGHMC's chains "
           "start from it)"),
    Column("sample_id", "<i8", -1, "the draw around its mode, 0 .. samples_per_mode-1 "
           "(0 for DE members)"),
    Column("chain", "<i8", -1, "the Markov chain the sample was drawn from, 0 .. chains-1 "
           "within its mode; -1 for methods without chains (and in files of schema 1 to 3, "
           "which do not record it)"),
    Column("epoch", "<i8", -1, "epochs of the recipe the (base) network was trained for"),
    Column("train_loss", "<f8", np.nan, "final training loss (mean cross-entropy, nats)"),
    Column("train_accuracy", "<f8", np.nan, "final training accuracy, in [0, 1]"),
    Column("test_loss", "<f8", np.nan, "test loss (mean cross-entropy, nats)"),
    Column("test_accuracy", "<f8", np.nan, "test accuracy, in [0, 1]"),
    Column("recipe_hash", "S64", b"", "SHA-256 of the recipe's canonical JSON"),
    Column("wall_time", "<f8", np.nan, "training wall-clock time, seconds (a method's samples "
           "share their mode's time evenly, plus their own evaluation)"),
    Column("versions", "S256", b"", "JSON of library versions that produced the checkpoint"),
    Column("source", "S256", b"", "where the checkpoint came from (trainer, file, archive)"),
    Column("diverged", "?", False, "True if training diverged (NaN or infinite weights or "
           "metrics; a finite run near chance accuracy is undertrained, not diverged)"),
    Column("written_at", "<f8", np.nan, "Unix time the checkpoint was appended, seconds"),
    Column("sha256", "S64", b"", "SHA-256 of the checkpoint's tensors (see checkpoint_digest)"),
)
COLUMN_NAMES = tuple(column.name for column in METADATA_COLUMNS)
#: The schema version that added a column; the others are in every version's table.
COLUMN_SINCE: dict[str, int] = {"chain": 4}


def metadata_dtype(version: int) -> np.dtype:
    """The metadata table of a schema ``version``'s files: the columns it had, in order.

    The layout check requires exactly this dtype, and row digests hash rows in it.
    """
    return np.dtype([(column.name, column.dtype) for column in METADATA_COLUMNS
                     if COLUMN_SINCE.get(column.name, 1) <= version])


#: The metadata table of new files (the current schema's).
METADATA_DTYPE = metadata_dtype(SCHEMA_VERSION)
#: Every schema version's metadata table.
METADATA_DTYPES: dict[int, np.dtype] = {version: metadata_dtype(version)
                                        for version in range(1, SCHEMA_VERSION + 1)}


def newest_schema(dtype: np.dtype) -> int:
    """The newest schema version whose files store metadata rows of ``dtype``: what a
    rebuilt file becomes, since a rebuild keeps the table (and its digests) as it is."""
    versions = [version for version, table in METADATA_DTYPES.items() if table == dtype]
    if not versions:
        raise ZooSchemaError(f"{dtype} is not the metadata table of any schema version")
    return max(versions)


def as_table(rows: np.ndarray, dtype: np.dtype = METADATA_DTYPE) -> np.ndarray:
    """``rows`` (a metadata table of any schema version) as a table of ``dtype``.

    Shared columns are copied, columns ``rows`` lack get their missing value (a schema 3
    row's ``chain`` reads -1), and columns ``dtype`` lacks are left out. Rows already of
    ``dtype`` are returned as they are.
    """
    if rows.dtype == dtype:
        return rows
    table = np.zeros(rows.shape, dtype=dtype)
    present = set(rows.dtype.names or ())
    for column in METADATA_COLUMNS:
        if column.name in (dtype.names or ()):
            table[column.name] = rows[column.name] if column.name in present \
                else column.missing
    return table


def dropped_columns(rows: np.ndarray, dtype: np.dtype) -> list[str]:
    """Columns of ``rows`` that a table of ``dtype`` lacks and in which some row holds a
    value other than the column's missing one (what storing them there would lose)."""
    kept = set(dtype.names or ())
    return [column.name for column in METADATA_COLUMNS
            if column.name in (rows.dtype.names or ()) and column.name not in kept
            and bool(np.any(rows[column.name] != column.missing))]
# Columns the store fills itself; users may not set them.
_AUTOMATIC = {"sha256", "written_at"}


def canonical_json(value: object) -> str:
    """JSON with sorted keys and no spaces, so equal values hash equally."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


@public
def recipe_hash(recipe: Mapping[str, object]) -> str:
    """SHA-256 hex digest of a recipe's canonical JSON."""
    return hashlib.sha256(canonical_json(recipe).encode()).hexdigest()


@public
def checkpoint_digest(arrays: Mapping[str, np.ndarray], keys: list[str]) -> str:
    """SHA-256 over a checkpoint's tensors, in ``keys`` order.

    Each tensor contributes its key, dtype, shape and C-order little-endian bytes, so a
    changed value, dtype, shape or name changes the digest.
    """
    digest = hashlib.sha256()
    for key in keys:
        array = np.ascontiguousarray(arrays[key])
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        header = f"{key}\0{array.dtype.str}\0{array.shape}\0"
        digest.update(header.encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def record_bytes(record: object, mode_id: int) -> bytes:
    """A training record as the canonical JSON bytes stored for it.

    The record must be a JSON object of text keys whose values are JSON: text, finite
    numbers (numpy scalars are taken as the numbers they hold), booleans, ``None``,
    lists or tuples, and objects, at most :data:`RECORD_BYTES` bytes once encoded.
    Raises :class:`ZooSchemaError` naming what is wrong and where.
    """
    if not isinstance(record, Mapping):
        raise ZooSchemaError(f"training record of mode {mode_id} must be a JSON object "
                             f"(a dict), not {type(record).__name__}")
    plain = _plain_json(record, "the record", 0, mode_id)
    data = canonical_json(plain).encode("utf-8")
    if len(data) > RECORD_BYTES:
        raise ZooSchemaError(f"training record of mode {mode_id} is {len(data)} bytes of "
                             f"JSON; the limit is {RECORD_BYTES}")
    return data


def _plain_json(value: object, where: str, depth: int, mode_id: int) -> object:
    """``value`` as plain JSON types, or ZooSchemaError (``where``: its place, for the
    message)."""
    def refuse(problem: str) -> ZooSchemaError:
        return ZooSchemaError(f"training record of mode {mode_id}: {where} {problem}")

    if depth > _RECORD_DEPTH:
        raise refuse(f"is nested more than {_RECORD_DEPTH} levels deep")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        if not np.isfinite(value):
            raise refuse(f"is {float(value)}; JSON numbers must be finite (use None "
                         "for unknown)")
        return float(value)
    if isinstance(value, list | tuple):
        return [_plain_json(item, f"{where}[{position}]", depth + 1, mode_id)
                for position, item in enumerate(value)]
    if isinstance(value, Mapping):
        plain = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise refuse(f"has the key {key!r}; JSON object keys are text")
            plain[key] = _plain_json(item, f"{where}[{key!r}]", depth + 1, mode_id)
        return plain
    raise refuse(f"is a {type(value).__name__}, not a JSON value")


def record_digest(data: bytes) -> str:
    """SHA-256 hex digest of a training record's stored bytes."""
    return hashlib.sha256(data).hexdigest()


def row_digest(row: np.void | np.ndarray) -> str:
    """SHA-256 hex digest of one metadata row's bytes in the table it is stored in.

    A row of one of the schema versions' tables (:data:`METADATA_DTYPES`, as read from a
    file, whose table the layout check requires to be its version's) is hashed in that
    table's little-endian layout, so the digests written for schema 1 to 3 rows stay
    valid; anything else is hashed as a row of :data:`METADATA_DTYPE`.
    """
    array = np.asarray(row)
    if not any(array.dtype == table for table in METADATA_DTYPES.values()):
        array = np.asarray(row, dtype=METADATA_DTYPE)
    return hashlib.sha256(array.tobytes()).hexdigest()


def metadata_row(values: Mapping[str, object]) -> np.ndarray:
    """One metadata row (a 0-d structured array) from user values; the rest are 'missing'.

    Raises :class:`ZooSchemaError` for an unknown column, an automatic column, or a
    string too long for its fixed width.
    """
    unknown = set(values) - set(COLUMN_NAMES)
    if unknown:
        raise ZooSchemaError(
            f"unknown metadata column(s) {sorted(unknown)}; known: {', '.join(COLUMN_NAMES)}"
        )
    forbidden = set(values) & _AUTOMATIC
    if forbidden:
        raise ZooSchemaError(f"metadata column(s) {sorted(forbidden)} are filled by the store")
    row = np.zeros((), dtype=METADATA_DTYPE)
    for column in METADATA_COLUMNS:
        value = values.get(column.name, column.missing)
        if value is None:
            value = column.missing
        if column.dtype.startswith("S"):
            if not isinstance(value, str | bytes):
                raise ZooSchemaError(f"metadata {column.name!r} must be text, not {value!r}")
            encoded = value if isinstance(value, bytes) else value.encode("utf-8")
            width = int(column.dtype[1:])
            if len(encoded) > width:
                raise ZooSchemaError(
                    f"metadata {column.name!r} is {len(encoded)} bytes; the limit is {width}"
                )
            row[column.name] = encoded
        else:
            row[column.name] = _typed(column, value)
    return row


def _typed(column: Column, value: object) -> object:
    """``value`` checked against a numeric or boolean column (no silent conversions)."""
    kind = np.dtype(column.dtype).kind
    if kind == "b":
        if not isinstance(value, bool | np.bool_):
            raise ZooSchemaError(f"metadata {column.name!r} must be true or false, "
                                 f"not {value!r}")
        return bool(value)
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
        raise ZooSchemaError(f"metadata {column.name!r} must be a number, not {value!r}")
    if kind == "i":
        if isinstance(value, float | np.floating) and not float(value).is_integer():
            raise ZooSchemaError(f"metadata {column.name!r} must be an integer, not {value!r}")
        if not -(2**63) <= int(value) < 2**63:
            raise ZooSchemaError(f"metadata {column.name!r} is out of range: {value!r}")
        return int(value)
    return float(value)


def decode(value: object) -> object:
    """A metadata value as a plain Python object (bytes become str)."""
    if isinstance(value, bytes | np.bytes_):
        return bytes(value).decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    return value


def decode_table(rows: np.ndarray) -> np.ndarray:
    """A metadata table with its byte-string columns decoded to numpy ``str`` (UTF-8)."""
    fields = [(name, f"U{rows.dtype[name].itemsize}" if rows.dtype[name].kind == "S"
               else rows.dtype[name]) for name in rows.dtype.names]
    decoded = np.empty(rows.shape, dtype=fields)
    for name in rows.dtype.names:
        column = rows[name]
        decoded[name] = (np.char.decode(column, "utf-8", errors="replace")
                         if column.dtype.kind == "S" else column)
    return decoded
